"""Native SigLIP vision encoder: CLIP's configuration of ``ViTModel`` with SigLIP's overrides.

Patch conv with bias, no class token, no ``ln_pre``, tanh-GELU MLP, learned absolute positions
(resampled as HF's ``interpolate_pos_encoding=True``), ``ln_post`` on every token (HF
``post_layernorm`` is part of ``last_hidden_state``), and with ``vision_use_head`` the
attention-pooling head (``native.core.vit.AttentionPoolingHead``) for ``pooler_output``.
"""

from __future__ import annotations

import torch

from mmparity.config import first_int, image_hw
from mmparity.models.clip import native as clip
from mmparity.models.core.layers import vision_layer_spec
from mmparity.models.core.vit import ViTModel

MODEL_TYPES = ("siglip_vision_model",)


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> ViTModel:
    """``ViTModel`` from an HF ``SiglipVisionConfig`` (or a config that contains one)."""
    cfg = clip.vision_config(cfg, MODEL_TYPES)
    img_h, img_w = image_hw(cfg)
    return ViTModel(clip.transformer_config(cfg, params_dtype), vision_layer_spec(),
                    patch_dim=first_int(cfg.patch_size), img_h=img_h, img_w=img_w,
                    in_channels=cfg.num_channels, patch_embed_path="conv1", patch_embed_bias=True, add_class_token=False,
                    ln_pre=False, pos_emb_type="learned_absolute", ln_post="tokens",
                    ln_post_eps=cfg.layer_norm_eps,
                    pooling="attention" if cfg.vision_use_head else None)
