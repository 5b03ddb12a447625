"""The qwen3_5_lm family: Qwen3.5 and Qwen3.5-MoE language models alone (``Qwen3_5ForCausalLM``,
``Qwen3_5MoeForCausalLM``), the ``qwen3_5_text`` part under Megatron's ``GPTModel`` root; its
record in the registry, its modules beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="Qwen3.5 / Qwen3.5-MoE language model alone: Gated DeltaNet + gated attention hybrid, "
            "dense or routed experts with a gated shared expert",
    reference_classes=("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"),
    compared=("logits", "token_loss", "self_attention (DeltaNet and attention)", "mlp", "router"),
    checkpoint_note="a Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM checkpoint (model.*, lm_head)",
    takes_whole=(Takes(architecture="Qwen3_5ForCausalLM"), Takes(architecture="Qwen3_5MoeForCausalLM"),
                 Takes(model_type="qwen3_5_text"), Takes(model_type="qwen3_5_moe_text")),
    with_language=True,
    low_memory=False,
    # Every norm but the DeltaNet output norm scales by (1 + weight): Megatron-LM main's flag for it.
    megatron_args=(("layernorm_zero_centered_gamma", True),),
)
