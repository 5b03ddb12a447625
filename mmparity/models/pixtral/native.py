"""Native Pixtral vision encoder: ``ViTModel`` (after Megatron-LM ``megatron/core/models/vision/vit_model.py``) in its Pixtral configuration.

RMSNorm everywhere (eps 1e-5 as HF hard-codes it), SwiGLU-style gated MLP with the config's
activation, no biases, ``ln_pre``, axial 2D RoPE in mcore's interleaved layout.
"""

from __future__ import annotations

import torch

from mmparity.models.core.layers import activation_from_hf, vision_layer_spec, vision_transformer_config
from mmparity.models.core.vit import ViTModel
from mmparity.config import PIXTRAL_NORM_EPS, head_dim, rope_theta


def _image_hw(cfg) -> tuple[int, int]:
    size = cfg.image_size
    return (size, size) if isinstance(size, int) else tuple(size)


def _patch(cfg) -> int:
    p = cfg.patch_size
    return p if isinstance(p, int) else p[0]


def transformer_config(cfg, params_dtype: torch.dtype = torch.float32):
    return vision_transformer_config(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, kv_channels=head_dim(cfg),
        ffn_hidden_size=cfg.intermediate_size, normalization="RMSNorm",
        norm_eps=PIXTRAL_NORM_EPS, activation=activation_from_hf(cfg.hidden_act), gated=True,
        bias=False, rotary_interleaved=True, params_dtype=params_dtype)


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> ViTModel:
    """``ViTModel`` from an HF ``PixtralVisionConfig`` (the single source of truth for shapes)."""
    img_h, img_w = _image_hw(cfg)
    return ViTModel(transformer_config(cfg, params_dtype), vision_layer_spec(),
                    patch_dim=_patch(cfg), img_h=img_h, img_w=img_w,
                    in_channels=cfg.num_channels, patch_embed_bias=False, ln_pre=True,
                    ln_pre_eps=PIXTRAL_NORM_EPS, pos_emb_type="rope2d",
                    rope_theta=rope_theta(cfg))
