"""The qwen3_vl_moe family: Qwen3-VL-MoE whole (its record in the registry: what ``mmparity list``
shows and which checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="Qwen3-VL-MoE whole: the qwen3_vl tower with DeepStack + Qwen3-MoE decoder (q/k RMSNorm, "
            "interleaved M-RoPE, softmax top-k routed experts renormalised, dense layers by "
            "mlp_only_layers / decoder_sparse_step); logits, per-token loss, router agreement",
    reference_classes=("Qwen3VLMoeForConditionalGeneration",),
    compared=("vision layers", "deepstack mergers", "merger", "attention", "router", "routed experts",
              "language layers", "final_norm"),
    checkpoint_note="whole Qwen3VLMoeForConditionalGeneration checkpoint (model.visual.*, "
                    "model.language_model.* with each MoE layer's experts stacked as "
                    "mlp.experts.gate_up_proj / down_proj, lm_head) as Megatron's LLaVAModel tree; "
                    "experts as TEGroupedMLP names them",
    takes_whole=(Takes(architecture="Qwen3VLMoeForConditionalGeneration"), Takes(model_type="qwen3_vl_moe")),
    # A whole VLM with its own decoder: its modules are named vision_model.* / language_model.*.
    with_language=True,
)
