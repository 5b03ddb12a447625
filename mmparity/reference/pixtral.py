"""Reference side of Pixtral: transformers' ``PixtralVisionModel`` (multi-image, mixed sizes)."""

from __future__ import annotations

from transformers import PixtralVisionConfig, PixtralVisionModel

from mmparity.hfconfig import tower_config


MODEL_TYPES = ("pixtral",)
# Whole-VLM configs that carry a Pixtral tower as ``vision_config``.
PARENT_MODEL_TYPES = ("llava", "mistral3")


def tiny_config() -> PixtralVisionConfig:
    """Awkward tiny sizes: 4 heads of 12 (hd % 4 == 0 for 2D RoPE), FFN not a multiple of hidden."""
    return PixtralVisionConfig(hidden_size=48, intermediate_size=44, num_hidden_layers=2,
                               num_attention_heads=4, image_size=64, patch_size=8,
                               hidden_act="silu", num_channels=3)


def vision_config(cfg):
    """The Pixtral vision config inside ``cfg`` (itself, or a VLM's ``vision_config``)."""
    return tower_config(cfg, MODEL_TYPES, PARENT_MODEL_TYPES, "Pixtral")


def build(cfg) -> PixtralVisionModel:
    return PixtralVisionModel(cfg).eval()


def patch_size(cfg) -> int:
    return cfg.patch_size if isinstance(cfg.patch_size, int) else cfg.patch_size[0]
