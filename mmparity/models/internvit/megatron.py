"""Megatron's own class InternViT's converted weights load into: stock megatron-core's
``CLIPViTModel`` in its InternViT configurations (``model_subtype`` ``internvit`` for the RMSNorm
tower with q/k norms, ``internvit300M`` for the LayerNorm one), configured by the family's one
recipe. Its layers are those of Megatron-LM's InternViT layer specs
(:func:`mmparity.models.internvit.native.layer_spec` on Transformer Engine's linears and
attention, or their CPU stand-ins): Megatron-LM's own spec module imports Transformer Engine at
its top, which the CPU has not."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.vision import clip_vit_model
from megatron.core.transformer.transformer_config import TransformerConfig

from mmparity.config import first_int, image_hw, vision_of
from mmparity.models.core import megatron_classes as upstream
from mmparity.models.core.te_stand_ins import buildable_without_te, te_class
from mmparity.models.internvit.config import subtype, transformer_fields
from mmparity.models.internvit.native import layer_spec

MODEL_TYPES = ("internvl_vision",)


def transformer_config(vc, params_dtype=torch.float32, num_layers: Optional[int] = None) -> TransformerConfig:
    """The tower's config as Megatron's classes take it; ``num_layers``: fewer layers than the
    config's (a VLM's tower built as deep as the features it reads)."""
    fields = transformer_fields(vc)
    fields["activation"] = upstream.activation(fields["activation"])
    if num_layers:
        fields["num_layers"] = num_layers
    return upstream.transformer_config(params_dtype=params_dtype, **fields)


def megatron_layer_spec(vc):
    """Megatron-LM's InternViT layer for this tower, on Transformer Engine's linears and attention
    (or their CPU stand-ins)."""
    return layer_spec(bool(vc.use_qk_norm), column=te_class("TEColumnParallelLinear"),
                      row=te_class("TERowParallelLinear"), core_attention=te_class("TEDotProductAttention"))


def build_internvit(cfg, params_dtype=torch.float32, num_layers: Optional[int] = None):
    """Stock ``CLIPViTModel`` as InternViT: conv bias, one class token, no ``ln_pre`` or
    ``ln_post`` (transformers' final LayerNorm, where it has one, stays beside the checkpoint)."""
    vc = vision_of(cfg, MODEL_TYPES)
    if vc.num_channels != 3:
        raise ValueError(f"stock CLIPViTModel has 3 input channels, the config has {vc.num_channels}")
    img_h, img_w = image_hw(vc)
    with buildable_without_te(clip_vit_model):
        model = clip_vit_model.CLIPViTModel(
            transformer_config(vc, params_dtype, num_layers), megatron_layer_spec(vc),
            add_class_token=True, class_token_len=1, patch_dim=first_int(vc.patch_size),
            img_h=img_h, img_w=img_w, model_subtype=subtype(vc))
    return model.eval()
