"""The siglip family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.llava import tower_takes as llava_tower
from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="SigLIP vision encoder (learned positions resampled for other sizes, tanh GELU, "
            "post-LayerNorm) and its attention-pooling head",
    reference_classes=("SiglipVisionModel",),
    compared=("patch_embed", "pos_embed", "layers", "ln_post", "head", "packed attention"),
    checkpoint_note="SiglipVisionModel, or the vision_model.* of a whole SiglipModel (the text "
                    "model and logit scale / bias are dropped)",
    takes_whole=(Takes(architecture="SiglipVisionModel"), Takes(model_type="siglip_vision_model")),
    takes_part=(Takes(architecture="SiglipModel"), Takes(model_type="siglip"),
                *llava_tower("siglip_vision_model")),
)
