"""A throwaway tower on CLIP's architecture, as another release of it would be: its record."""

from mmparity.models.record import FamilyRecord

FAMILY = FamilyRecord(
    summary="a throwaway tower on CLIP's architecture (a test's), last_hidden_state and pooled class token",
    reference_classes=("CLIPVisionModel",),
    compared=("patch_embed", "pos_embed", "ln_pre", "layers", "ln_post"),
    checkpoint_note="CLIPVisionModel at its own sizes; picked by name (--family), never detected",
)
