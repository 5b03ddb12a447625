"""Reference side of Pixtral: transformers' ``PixtralVisionModel`` (multi-image, mixed sizes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.config import tower_config

if TYPE_CHECKING:
    from transformers import PixtralVisionConfig, PixtralVisionModel


MODEL_TYPES = ("pixtral",)
# Whole-VLM configs that carry a Pixtral tower as ``vision_config``.
PARENT_MODEL_TYPES = ("llava", "mistral3")


def tiny_config() -> PixtralVisionConfig:
    """Awkward tiny sizes: 4 heads of 12 (hd % 4 == 0 for 2D RoPE), FFN not a multiple of hidden."""
    from transformers import PixtralVisionConfig

    return PixtralVisionConfig(hidden_size=48, intermediate_size=44, num_hidden_layers=2,
                               num_attention_heads=4, image_size=64, patch_size=8,
                               hidden_act="silu", num_channels=3)


def vision_config(cfg):
    """The Pixtral vision config inside ``cfg`` (itself, or a VLM's ``vision_config``)."""
    return tower_config(cfg, MODEL_TYPES, PARENT_MODEL_TYPES, "Pixtral")


def build(cfg) -> PixtralVisionModel:
    from transformers import PixtralVisionModel

    return PixtralVisionModel(cfg).eval()


def state_shapes(cfg) -> dict[str, tuple]:
    """The shapes of :func:`build`'s state dict, read off the config (attention is hidden x hidden
    whatever ``head_dim`` says, as HF builds it)."""
    h, f, p = cfg.hidden_size, cfg.intermediate_size, patch_size(cfg)
    layer = {"attention_norm.weight": (h,), "ffn_norm.weight": (h,),
             **{f"attention.{x}_proj.weight": (h, h) for x in "qkvo"},
             "feed_forward.gate_proj.weight": (f, h), "feed_forward.up_proj.weight": (f, h),
             "feed_forward.down_proj.weight": (h, f)}
    return {"patch_conv.weight": (h, cfg.num_channels, p, p), "ln_pre.weight": (h,),
            **{f"transformer.layers.{i}.{k}": s for i in range(cfg.num_hidden_layers)
               for k, s in layer.items()}}


def patch_size(cfg) -> int:
    return cfg.patch_size if isinstance(cfg.patch_size, int) else cfg.patch_size[0]
