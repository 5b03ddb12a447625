"""The clip family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.llava import tower_takes as llava_tower
from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="CLIP vision encoder (class token, learned positions resampled for other sizes, "
            "pre-LayerNorm, quick_gelu), last_hidden_state and pooled class token",
    reference_classes=("CLIPVisionModel",),
    compared=("patch_embed", "pos_embed", "ln_pre", "layers", "ln_post", "packed attention"),
    checkpoint_note="CLIPVisionModel, or the vision_model.* of a whole CLIPModel / the "
                    "vision tower of a LLaVA checkpoint (the rest is dropped)",
    takes_whole=(Takes(architecture="CLIPVisionModel"), Takes(model_type="clip_vision_model")),
    takes_part=(Takes(architecture="CLIPModel"), Takes(model_type="clip"),
                *llava_tower("clip_vision_model")),
)
