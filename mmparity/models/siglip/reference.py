"""Reference side of SigLIP: transformers' ``SiglipVisionModel``, as CLIP plus overrides.

No class token, no ``pre_layrnorm``, ``post_layernorm`` on every token, and (``vision_use_head``)
an attention-pooling head whose output is ``pooler_output``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.config import tower_config
from mmparity.models.clip.reference import encoder_shapes, patch_size

if TYPE_CHECKING:
    from transformers import SiglipVisionConfig, SiglipVisionModel

MODEL_TYPES = ("siglip_vision_model",)
PARENT_MODEL_TYPES = ("siglip", "paligemma", "llava", "llava_next", "llava_onevision")


def tiny_config() -> SiglipVisionConfig:
    """4 heads of 12 (TP 2 and 4), FFN 52, an odd 5x5 position grid, the pooling head on."""
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(hidden_size=48, intermediate_size=52, num_hidden_layers=2,
                              num_attention_heads=4, image_size=40, patch_size=8, num_channels=3,
                              hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                              vision_use_head=True)


def vision_config(cfg):
    """The SigLIP vision config inside ``cfg`` (itself, a ``SiglipConfig``'s or a VLM's)."""
    return tower_config(cfg, MODEL_TYPES, PARENT_MODEL_TYPES, "SigLIP vision")


def build(cfg) -> SiglipVisionModel:
    from transformers import SiglipVisionModel

    return SiglipVisionModel(vision_config(cfg)).eval()


def state_shapes(cfg) -> dict[str, tuple]:
    """The shapes of :func:`build`'s state dict, read off the config."""
    cfg = vision_config(cfg)
    h, f, p = cfg.hidden_size, cfg.intermediate_size, patch_size(cfg)
    shapes = {"embeddings.patch_embedding.weight": (h, cfg.num_channels, p, p),
              "embeddings.patch_embedding.bias": (h,),
              "embeddings.position_embedding.weight": ((cfg.image_size // p) ** 2, h),
              **encoder_shapes(cfg),
              "post_layernorm.weight": (h,), "post_layernorm.bias": (h,)}
    if cfg.vision_use_head:
        shapes |= {"head.probe": (1, 1, h), "head.attention.in_proj_weight": (3 * h, h),
                   "head.attention.in_proj_bias": (3 * h,), "head.attention.out_proj.weight": (h, h),
                   "head.attention.out_proj.bias": (h,), "head.layernorm.weight": (h,),
                   "head.layernorm.bias": (h,), "head.mlp.fc1.weight": (f, h), "head.mlp.fc1.bias": (f,),
                   "head.mlp.fc2.weight": (h, f), "head.mlp.fc2.bias": (h,)}
    return shapes
