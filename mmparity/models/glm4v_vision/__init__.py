"""The glm4v_vision family: the GLM-4.5V (and GLM-4.1V / GLM-4.6V) vision tower (its record in the registry: what ``mmparity
list`` shows and which checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="GLM-4.5V vision tower: Conv3d patches, post-conv RMSNorm, a learned position table "
            "resampled bicubically to each grid, 2D RoPE, RMSNorm blocks with a gated MLP, final "
            "norm, downsample conv and gated merger",
    reference_classes=("Glm4vMoeVisionModel", "Glm4vVisionModel"),
    compared=("layers", "position table", "merger", "packed mixed sizes"),
    checkpoint_note="standalone vision tower, or a whole Glm4vMoeForConditionalGeneration checkpoint "
                    "(model.visual.*) whose language model is dropped",
    takes_whole=(Takes(architecture="Glm4vMoeVisionModel"), Takes(model_type="glm4v_moe_vision"),
                 Takes(architecture="Glm4vVisionModel"), Takes(model_type="glm4v_vision")),
    takes_part=(Takes(architecture="Glm4vMoeForConditionalGeneration"),
                Takes(architecture="Glm46VForConditionalGeneration")),
)
