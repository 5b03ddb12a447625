"""The qwen3_5 family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="Qwen3.5-MoE VL vision tower (Conv3d patches, resampled learned positions, 2D RoPE, "
            "block-first order, 2x2 merger), static and packed mixed sizes",
    reference_classes=("Qwen3_5MoeVisionModel",),
    compared=("patch_embed", "pos_embed", "rope2d", "block_first", "layers", "merger",
              "packed attention"),
    checkpoint_note="standalone vision tower, or a whole Qwen3_5MoeForConditionalGeneration "
                    "checkpoint (model.visual.*) whose language model is dropped",
    takes_whole=(Takes(architecture="Qwen3_5MoeVisionModel"), Takes(model_type="qwen3_5_moe_vision")),
    takes_part=(Takes(architecture="Qwen3_5MoeForConditionalGeneration"), Takes(model_type="qwen3_5_moe")),
)
