"""Megatron's own class Pixtral's converted tower loads into: Megatron-LM main's ``ViTModel`` in
its Pixtral configuration (``rope2d``, ``ln_pre``), configured by the family's one recipe
(:func:`mmparity.models.pixtral.config.transformer_fields`). The whole VLMs on a Pixtral tower
build theirs with :func:`pixtral_vit` (with the merger where the VLM merges patches)."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from mmparity.config import PIXTRAL_NORM_EPS, rope_theta, vision_of
from mmparity.models.core import megatron_classes as upstream
from mmparity.models.pixtral.config import transformer_fields

MODEL_TYPES = ("pixtral",)
# Megatron's name of the Pixtral tower (LLaVAModel's vision_model_type).
SUBTYPE = "pixtral-vit"


def transformer_config(vc, params_dtype=torch.float32, num_layers: Optional[int] = None) -> TransformerConfig:
    """The tower's config as Megatron's classes take it; ``num_layers``: fewer layers than the
    config's (a VLM's tower is built as deep as the features it reads)."""
    fields = transformer_fields(vc)
    fields["activation"] = upstream.activation(fields["activation"])
    if num_layers:
        fields["num_layers"] = num_layers
    return upstream.transformer_config(params_dtype=params_dtype, **fields)


def pixtral_vit(vc, params_dtype=torch.float32, num_layers: Optional[int] = None, **mode):
    """Megatron-LM main's ``ViTModel`` on a Pixtral vision config; ``mode``: the merger, where the
    VLM merges patches."""
    return upstream.vit_model(vc, transformer_config(vc, params_dtype, num_layers), ln_pre=True,
                              ln_pre_eps=PIXTRAL_NORM_EPS, pos_emb_type="rope2d", rope_theta=rope_theta(vc),
                              **mode)


@upstream.needs_vit_model
def build_pixtral(cfg, params_dtype=torch.float32):
    return pixtral_vit(vision_of(cfg, MODEL_TYPES), params_dtype).eval()
