"""Megatron's own class SigLIP's converted weights load into: stock megatron-core's
``CLIPViTModel`` as SigLIP, configured by CLIP's recipe (the same architecture)."""

from __future__ import annotations

from typing import Optional

import torch

from mmparity.config import vision_of
from mmparity.models.clip.megatron import transformer_config
from mmparity.models.core import megatron_classes as upstream

MODEL_TYPES = ("siglip_vision_model",)
# Megatron's name of the SigLIP configuration (CLIPViTModel's model_subtype, LLaVAModel's
# vision_model_type).
SUBTYPE = "siglip"


def build_siglip(cfg, params_dtype=torch.float32, num_layers: Optional[int] = None):
    """Stock ``CLIPViTModel`` as SigLIP: conv bias, ``ln_post`` on every token, no class token;
    no attention-pooling head."""
    vc = vision_of(cfg, MODEL_TYPES)
    return upstream.stock_clip_vit(vc, SUBTYPE, transformer_config(vc, params_dtype, num_layers), class_tokens=0)
