"""Native Pixtral vision encoder: ``ViTModel`` (after Megatron-LM ``megatron/core/models/vision/vit_model.py``) in its Pixtral configuration.

RMSNorm everywhere (eps 1e-5 as HF hard-codes it), SwiGLU-style gated MLP with the config's
activation, no biases, ``ln_pre``, axial 2D RoPE in mcore's interleaved layout.
"""

from __future__ import annotations

import torch

from mmparity.models.core.layers import activation_from_hf, vision_layer_spec, vision_transformer_config
from mmparity.models.core.vit import ViTModel
from mmparity.config import PIXTRAL_NORM_EPS, rope_theta
from mmparity.models.pixtral.config import transformer_fields


def _image_hw(cfg) -> tuple[int, int]:
    size = cfg.image_size
    return (size, size) if isinstance(size, int) else tuple(size)


def _patch(cfg) -> int:
    p = cfg.patch_size
    return p if isinstance(p, int) else p[0]


def transformer_config(cfg, params_dtype: torch.dtype = torch.float32):
    """The family's recipe (:func:`~mmparity.models.pixtral.config.transformer_fields`) with HF's
    own activation function."""
    fields = transformer_fields(cfg)
    fields["activation"] = activation_from_hf(fields["activation"])
    return vision_transformer_config(params_dtype=params_dtype, **fields)


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> ViTModel:
    """``ViTModel`` from an HF ``PixtralVisionConfig`` (the single source of truth for shapes)."""
    img_h, img_w = _image_hw(cfg)
    return ViTModel(transformer_config(cfg, params_dtype), vision_layer_spec(),
                    patch_dim=_patch(cfg), img_h=img_h, img_w=img_w,
                    in_channels=cfg.num_channels, patch_embed_bias=False, ln_pre=True,
                    ln_pre_eps=PIXTRAL_NORM_EPS, pos_emb_type="rope2d",
                    rope_theta=rope_theta(cfg))
