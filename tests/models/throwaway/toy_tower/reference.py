"""Reference side: transformers' own ``CLIPVisionModel`` (CLIP's reference module), at the tower's
own tiny sizes."""

from __future__ import annotations

from mmparity.models.clip.reference import build, state_shapes, vision_config  # noqa: F401  (the same HF class)


def tiny_config():
    """6 heads of 6 (TP 2 and 3), FFN 26, 3 layers (PP 2 splits them unevenly), a 5x5 grid."""
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(hidden_size=36, intermediate_size=26, num_hidden_layers=3, num_attention_heads=6,
                            image_size=30, patch_size=6, num_channels=3, hidden_act="gelu", layer_norm_eps=1e-6)
