"""Native CLIP vision encoder: ``ViTModel`` (after Megatron-LM ``megatron/core/models/vision/vit_model.py``) in its CLIP configuration.

LayerNorm with biases everywhere, plain (non-gated) MLP with the config's activation (quick_gelu
for OpenAI CLIP), no patch-conv bias, one class token, a learned absolute position table
(resampled bicubically for other image sizes, as HF's ``interpolate_pos_encoding=True``),
``ln_pre`` after class token and positions, and ``post_layernorm`` on the pooled class token only.

SigLIP (:mod:`mmparity.models.siglip.native`) reuses this module's helpers with its own overrides.
"""

from __future__ import annotations

import torch

from mmparity.config import first_int, image_hw, vision_of
from mmparity.models.clip.config import transformer_fields
from mmparity.models.core.layers import activation_from_hf, vision_layer_spec, vision_transformer_config
from mmparity.models.core.vit import ViTModel

MODEL_TYPES = ("clip_vision_model",)
CLASS_TOKEN_LEN = 1


def vision_config(cfg, model_types=MODEL_TYPES):
    """The vision sub-config of a whole-model config, duck-typed (no transformers import here)."""
    return vision_of(cfg, model_types)


def transformer_config(cfg, params_dtype: torch.dtype = torch.float32):
    """The family's recipe (:func:`~mmparity.models.clip.config.transformer_fields`) with HF's own
    activation function."""
    fields = transformer_fields(cfg)
    fields["activation"] = activation_from_hf(fields["activation"])
    return vision_transformer_config(params_dtype=params_dtype, **fields)


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> ViTModel:
    """``ViTModel`` from an HF ``CLIPVisionConfig`` (or a config that contains one)."""
    cfg = vision_config(cfg)
    img_h, img_w = image_hw(cfg)
    eps = cfg.layer_norm_eps
    return ViTModel(transformer_config(cfg, params_dtype), vision_layer_spec(),
                    patch_dim=first_int(cfg.patch_size), img_h=img_h, img_w=img_w,
                    in_channels=cfg.num_channels, patch_embed_path="conv1", patch_embed_bias=False, add_class_token=True,
                    class_token_len=CLASS_TOKEN_LEN, ln_pre=True, ln_pre_eps=eps,
                    pos_emb_type="learned_absolute", ln_post="pooled", ln_post_eps=eps,
                    pooling="class_token")
