"""Native side: CLIP's ``ViTModel`` configuration, unchanged."""

from mmparity.models.clip.native import build_native  # noqa: F401
