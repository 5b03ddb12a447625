"""The glm4v_moe family: GLM-4.5V whole (its record in the registry: what ``mmparity list`` shows and
which checkpoints detection gives it); its modules sit beside this file, its tower's in
``mmparity.models.glm4v_vision``."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="GLM-4.5V whole: the GLM vision tower (Conv3d patches, bicubic-resampled position table, 2D "
            "RoPE, downsample conv + gated merger) + GLM-4.5 MoE decoder (GQA with q/k/v biases, partial "
            "M-RoPE in t/h/w sections, sigmoid group-limited router with score-correction bias, shared "
            "experts); logits, per-token loss, router agreement",
    reference_classes=("Glm4vMoeForConditionalGeneration",),
    compared=("vision layers", "merger", "attention", "router", "routed experts", "shared experts",
              "language layers", "final_norm"),
    checkpoint_note="whole Glm4vMoeForConditionalGeneration checkpoint (model.visual.*, model.language_model.* "
                    "with one tensor per expert as save_pretrained writes it, lm_head) as Megatron's "
                    "LLaVAModel tree; experts as TEGroupedMLP names them",
    takes_whole=(Takes(architecture="Glm4vMoeForConditionalGeneration"), Takes(model_type="glm4v_moe")),
    # A whole VLM with its own decoder: its modules are named vision_model.* / language_model.*.
    with_language=True,
)
