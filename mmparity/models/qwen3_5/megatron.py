"""Megatron's own class Qwen3.5's converted tower loads into: Megatron-LM main's
``vit_model.QwenVLViTModel``, configured by the family's recipe
(:func:`mmparity.models.qwen3_5.config.transformer_fields`)."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from mmparity.config import first_int, rope_theta, vision_of
from mmparity.models.core import megatron_classes as upstream
from mmparity.models.core.te_stand_ins import buildable_without_te
from mmparity.models.qwen3_5.config import transformer_fields

MODEL_TYPES = ("qwen3_5_moe_vision", "qwen3_5_vision")
# Upstream's default RoPE table side (768/16); HF has no cap.
MAX_PATCHES_PER_SIDE = 48


def transformer_config(vc, params_dtype=torch.float32) -> TransformerConfig:
    """The tower's recipe (:func:`~mmparity.models.qwen3_5.config.transformer_fields`) as
    Megatron's classes take it."""
    fields = transformer_fields(vc)
    fields["activation"] = upstream.activation(fields["activation"])
    return upstream.transformer_config(params_dtype=params_dtype, **fields)


@upstream.needs_vit_model
def build_qwen3_5(cfg, params_dtype=torch.float32, max_patches_per_side: int = MAX_PATCHES_PER_SIDE):
    vit = upstream.vit_model_module()
    vc = vision_of(cfg, MODEL_TYPES)
    p = first_int(vc.patch_size)
    g = int(round(vc.num_position_embeddings ** 0.5))
    config = transformer_config(vc, params_dtype)
    side = max_patches_per_side * p
    with buildable_without_te(vit):
        model = vit.QwenVLViTModel(config, upstream.te_stand_ins.vit_layer_spec(), patch_dim=p,
                                   temporal_patch_size=first_int(vc.temporal_patch_size), img_h=side,
                                   img_w=side, in_channels=vc.in_channels,
                                   spatial_merge_size=vc.spatial_merge_size,
                                   out_hidden_size=vc.out_hidden_size, num_pos_per_side=g,
                                   rope_theta=rope_theta(vc))
    return model.eval()
