"""Reference side of CLIP: transformers' ``CLIPVisionModel`` with ``interpolate_pos_encoding=True``.

HF runs one image size per call, so a packed case (several sizes) is one HF call per image,
concatenated. Module pairs of such a case can only see the last call; both sides then compare
the last image's tokens (see :func:`last_image`), while the outputs compare every image.

SigLIP (:mod:`mmparity.models.siglip.reference`) is this module plus overrides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.config import tower_config

if TYPE_CHECKING:
    from transformers import CLIPVisionConfig, CLIPVisionModel


MODEL_TYPES = ("clip_vision_model",)
# Whole-model configs that carry a CLIP tower as ``vision_config``.
PARENT_MODEL_TYPES = ("clip", "llava", "llava_next", "vipllava")
OUTPUTS = ("last_hidden_state", "pooler_output")
CLASS_TOKEN_LEN = 1


def tiny_config() -> CLIPVisionConfig:
    """4 heads of 12 (TP 2 and 4), FFN 52 (not a multiple of 48), an odd 5x5 position grid."""
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(hidden_size=48, intermediate_size=52, num_hidden_layers=2,
                            num_attention_heads=4, image_size=40, patch_size=8, num_channels=3,
                            hidden_act="quick_gelu", layer_norm_eps=1e-5)


def vision_config(cfg):
    """The CLIP vision config inside ``cfg`` (itself, a ``CLIPConfig``'s or a LLaVA's)."""
    return tower_config(cfg, MODEL_TYPES, PARENT_MODEL_TYPES, "CLIP vision")


def build(cfg) -> CLIPVisionModel:
    from transformers import CLIPVisionModel

    return CLIPVisionModel(vision_config(cfg)).eval()


def encoder_shapes(cfg) -> dict[str, tuple]:
    """Pre-norm encoder layers with biases (``CLIPEncoderLayer`` / ``SiglipEncoderLayer``)."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    layer = {"layer_norm1.weight": (h,), "layer_norm1.bias": (h,), "layer_norm2.weight": (h,),
             "layer_norm2.bias": (h,), "mlp.fc1.weight": (f, h), "mlp.fc1.bias": (f,),
             "mlp.fc2.weight": (h, f), "mlp.fc2.bias": (h,)}
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        layer |= {f"self_attn.{proj}.weight": (h, h), f"self_attn.{proj}.bias": (h,)}
    return {f"encoder.layers.{i}.{k}": s for i in range(cfg.num_hidden_layers) for k, s in layer.items()}


def state_shapes(cfg) -> dict[str, tuple]:
    """The shapes of :func:`build`'s state dict, read off the config."""
    cfg = vision_config(cfg)
    h, p = cfg.hidden_size, patch_size(cfg)
    positions = (cfg.image_size // p) ** 2 + CLASS_TOKEN_LEN
    return {"embeddings.class_embedding": (h,),
            "embeddings.patch_embedding.weight": (h, cfg.num_channels, p, p),
            "embeddings.position_embedding.weight": (positions, h),
            "pre_layrnorm.weight": (h,), "pre_layrnorm.bias": (h,),
            **encoder_shapes(cfg),
            "post_layernorm.weight": (h,), "post_layernorm.bias": (h,)}


def patch_size(cfg) -> int:
    return cfg.patch_size if isinstance(cfg.patch_size, int) else cfg.patch_size[0]
