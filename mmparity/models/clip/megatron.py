"""Megatron's own classes CLIP's converted weights load into: stock megatron-core's
``CLIPViTModel`` in its CLIP configuration, and Megatron-LM main's ``ViTModel`` in its CLIP mode.
Both are configured by the family's one recipe (:func:`mmparity.models.clip.config.transformer_fields`)."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from mmparity.config import vision_of
from mmparity.models.clip.config import transformer_fields
from mmparity.models.core import megatron_classes as upstream

MODEL_TYPES = ("clip_vision_model",)
# Megatron's name of the CLIP configuration (CLIPViTModel's model_subtype, LLaVAModel's
# vision_model_type).
SUBTYPE = "clip"


def transformer_config(vc, params_dtype=torch.float32, num_layers: Optional[int] = None) -> TransformerConfig:
    """The tower's config as Megatron's classes take it; ``num_layers``: fewer layers than the
    config's (LLaVAModel builds the tower as deep as the features it reads)."""
    fields = transformer_fields(vc)
    fields["activation"] = upstream.activation(fields["activation"])
    if num_layers:
        fields["num_layers"] = num_layers
    return upstream.transformer_config(params_dtype=params_dtype, **fields)


def build_clip(cfg, params_dtype=torch.float32, num_layers: Optional[int] = None):
    """Stock ``CLIPViTModel`` in its CLIP configuration: class token, ``ln_pre``; no ``ln_post``."""
    vc = vision_of(cfg, MODEL_TYPES)
    return upstream.stock_clip_vit(vc, SUBTYPE, transformer_config(vc, params_dtype, num_layers), class_tokens=1)


@upstream.needs_vit_model
def build_clip_as_vit(cfg, params_dtype=torch.float32):
    """Megatron-LM main's ``ViTModel`` in its CLIP mode (class token, learned absolute positions,
    ``ln_pre``), the alternative to the stock class its docstring offers. It applies ``ln_pre``
    before the class token and positions are added; HF CLIP after."""
    vc = vision_of(cfg, MODEL_TYPES)
    return upstream.vit_model(vc, transformer_config(vc, params_dtype), add_class_token=True, class_token_len=1,
                              ln_pre=True, ln_pre_eps=vc.layer_norm_eps, pos_emb_type="learned_absolute").eval()
