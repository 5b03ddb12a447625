"""The pixtral family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.llava import tower_takes as llava_tower
from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="Pixtral vision encoder (2D RoPE, RMSNorm, SwiGLU), static and packed mixed sizes",
    reference_classes=("PixtralVisionModel",),
    compared=("patch_embed", "rope2d", "ln_pre", "layers", "packed attention"),
    takes_whole=(Takes(architecture="PixtralVisionModel"), Takes(model_type="pixtral")),
    takes_part=llava_tower("pixtral"),
)
