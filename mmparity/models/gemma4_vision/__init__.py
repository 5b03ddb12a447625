"""The gemma4_vision family: Gemma 4's vision tower (its record in the registry: what ``mmparity list``
shows and which checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="Gemma 4 vision tower: linear patch embedding of processor rows, a 2-axis learned position "
            "table, axial 2D RoPE, q/k/v-normed attention at scale 1, four RMSNorms per layer, clipped "
            "linears, k x k average pooling by position and the standardize bias/scale",
    reference_classes=("Gemma4VisionModel",),
    compared=("patch_embed", "layers", "pooled soft tokens", "padding patches"),
    checkpoint_note="Gemma4VisionModel, or the vision_tower.* of a whole Gemma 4 checkpoint (the rest is "
                    "dropped)",
    takes_whole=(Takes(architecture="Gemma4VisionModel"), Takes(model_type="gemma4_vision")),
    takes_part=(Takes(architecture="Gemma4ForConditionalGeneration", vision_model_type="gemma4_vision"),
                Takes(model_type="gemma4", vision_model_type="gemma4_vision")),
)
