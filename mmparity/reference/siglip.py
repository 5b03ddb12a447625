"""Reference side of SigLIP: transformers' ``SiglipVisionModel``, as CLIP plus overrides.

No class token, no ``pre_layrnorm``, ``post_layernorm`` on every token, and (``vision_use_head``)
an attention-pooling head whose output is ``pooler_output``.
"""

from __future__ import annotations

from transformers import SiglipVisionConfig, SiglipVisionModel

from mmparity.hfconfig import tower_config

MODEL_TYPES = ("siglip_vision_model",)
PARENT_MODEL_TYPES = ("siglip", "paligemma", "llava", "llava_next", "llava_onevision")


def tiny_config() -> SiglipVisionConfig:
    """4 heads of 12 (TP 2 and 4), FFN 52, an odd 5x5 position grid, the pooling head on."""
    return SiglipVisionConfig(hidden_size=48, intermediate_size=52, num_hidden_layers=2,
                              num_attention_heads=4, image_size=40, patch_size=8, num_channels=3,
                              hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                              vision_use_head=True)


def vision_config(cfg):
    """The SigLIP vision config inside ``cfg`` (itself, a ``SiglipConfig``'s or a VLM's)."""
    return tower_config(cfg, MODEL_TYPES, PARENT_MODEL_TYPES, "SigLIP vision")


def build(cfg) -> SiglipVisionModel:
    return SiglipVisionModel(vision_config(cfg)).eval()
