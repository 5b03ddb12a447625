"""Megatron's own class Pixtral-Large's converted vision path loads into: Megatron-LM main's
Pixtral ``ViTModel`` with its merger (:mod:`mmparity.models.pixtral.megatron`, the tower's recipe)
as ``vision_model`` and the Mistral3 projector's two linears as a ``MultimodalProjector``
(:mod:`mmparity.models.llava.megatron`, the projector's recipe)."""

from __future__ import annotations

import torch

from mmparity.models.core import megatron_classes as upstream
from mmparity.models.llava.megatron import build_projector
from mmparity.models.pixtral.megatron import pixtral_vit
from mmparity.models.pixtral_large.native import MODEL_TYPES


@upstream.needs_vit_model
def build_pixtral_large(cfg, params_dtype=torch.float32):
    """``ViTModel(use_merger=True)`` + the Mistral3 projector's two linears as a
    ``MultimodalProjector``. Megatron's merger norm takes the *vision* epsilon (HF: the text
    config's ``rms_norm_eps``); that is Megatron's behaviour and is kept."""
    if getattr(cfg, "model_type", None) not in MODEL_TYPES:
        raise ValueError(f"pixtral_large needs a Mistral3 config, got {getattr(cfg, 'model_type', None)!r}")
    tower = pixtral_vit(cfg.vision_config, params_dtype, use_merger=True, spatial_merge_size=cfg.spatial_merge_size)
    return upstream.VisionWithProjection(tower, build_projector(cfg, params_dtype)).eval()
