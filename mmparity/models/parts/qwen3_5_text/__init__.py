"""The Qwen3.5 / Qwen3.5-MoE language-model part of whole VLMs: its record in the registry (the
text model types it takes); its modules sit beside this file."""

from mmparity.models.record import PartRecord

PART = PartRecord(
    summary="Qwen3.5 / Qwen3.5-MoE decoder: a hybrid stack of Gated DeltaNet (linear attention) and "
            "gated full-attention layers with zero-centred q/k norms and partial RoPE; a dense MLP or "
            "routed experts with a gated shared expert; GPTModel with mcore's GatedDeltaNet",
    text_model_types=("qwen3_5_text", "qwen3_5_moe_text"),
    why_no_megatron="megatron-core's GatedDeltaNet needs fla (flash-linear-attention) to be built, and "
                    "its forward runs fla's triton kernels, which need a GPU; Megatron-LM's own loop "
                    "loads and saves this layout (tests/megatron/test_qwen3_5_megatron_lm.py)",
    # Every norm but the DeltaNet output norm scales by (1 + weight): Megatron-LM main's flag for it.
    megatron_args=(("layernorm_zero_centered_gamma", True),),
)
