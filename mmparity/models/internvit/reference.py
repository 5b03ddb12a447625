"""Reference side of InternViT: transformers' ``InternVLVisionModel``.

A class token, an absolute position table (resampled bicubically when an image's patch grid is not
the table's), pre-norm layers (LayerNorm or RMSNorm by ``norm_type``) whose attention and MLP
outputs are scaled by ``lambda_1`` / ``lambda_2`` before the residual add, q/k/v biases by
``attention_bias``, q/k RMSNorms over the whole width by ``use_qk_norm``, and a final LayerNorm
that is Identity with ``use_mean_pooling``. Its output is ``last_hidden_state`` (class token
first); transformers computes no pooled vector for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.config import first_int, tower_config

if TYPE_CHECKING:
    from transformers import InternVLVisionConfig, InternVLVisionModel

MODEL_TYPES = ("internvl_vision",)
PARENT_MODEL_TYPES = ("internvl",)
OUTPUTS = ("last_hidden_state",)
CLASS_TOKEN_LEN = 1


def tiny_config() -> InternVLVisionConfig:
    """The 6B tower's kind (RMSNorm, q/k norms, no q/k/v bias) with the final LayerNorm kept
    (``use_mean_pooling`` off, so Megatron's class has no place for it): 4 heads of 12 (TP 2 and
    4), FFN 52, three layers (PP 2 splits them unevenly), an odd 5x5 position grid, layer scales
    away from 1."""
    from transformers import InternVLVisionConfig

    return InternVLVisionConfig(hidden_size=48, intermediate_size=52, num_hidden_layers=3,
                                num_attention_heads=4, image_size=40, patch_size=8, num_channels=3,
                                hidden_act="gelu", norm_type="rms_norm", use_qk_norm=True,
                                attention_bias=False, layer_norm_eps=1e-5, layer_scale_init_value=0.5,
                                use_mean_pooling=False)


def vision_config(cfg):
    """The InternViT config inside ``cfg`` (itself, or a whole InternVL's)."""
    return tower_config(cfg, MODEL_TYPES, PARENT_MODEL_TYPES, "InternVL vision")


def build(cfg) -> InternVLVisionModel:
    from transformers import InternVLVisionModel

    return InternVLVisionModel(vision_config(cfg)).eval()


def patch_size(cfg) -> int:
    return first_int(cfg.patch_size)


def grid(cfg) -> int:
    """Patches per side of the position table (transformers' table is square)."""
    return first_int(cfg.image_size) // patch_size(cfg)


def state_shapes(cfg) -> dict[str, tuple]:
    """The shapes of :func:`build`'s state dict, read off the config."""
    cfg = vision_config(cfg)
    h, f, p = cfg.hidden_size, cfg.intermediate_size, patch_size(cfg)
    rms = cfg.norm_type == "rms_norm"
    shapes = {"embeddings.cls_token": (1, 1, h),
              "embeddings.patch_embeddings.projection.weight": (h, cfg.num_channels, p, p),
              "embeddings.patch_embeddings.projection.bias": (h,)}
    if cfg.use_mask_token:
        shapes["embeddings.mask_token"] = (1, 1, h)
    if cfg.use_absolute_position_embeddings:
        shapes["embeddings.position_embeddings"] = (1, grid(cfg) ** 2 + CLASS_TOKEN_LEN, h)
    layer = {"lambda_1": (h,), "lambda_2": (h,), "attention.projection_layer.weight": (h, h),
             "attention.projection_layer.bias": (h,), "mlp.fc1.weight": (f, h), "mlp.fc1.bias": (f,),
             "mlp.fc2.weight": (h, f), "mlp.fc2.bias": (h,)}
    for proj in ("q_proj", "k_proj", "v_proj"):
        layer[f"attention.{proj}.weight"] = (h, h)
        if cfg.attention_bias:
            layer[f"attention.{proj}.bias"] = (h,)
    if cfg.use_qk_norm:
        layer |= {"attention.q_norm.weight": (h,), "attention.k_norm.weight": (h,)}
    for norm in ("layernorm_before", "layernorm_after"):
        layer[f"{norm}.weight"] = (h,)
        if not rms:
            layer[f"{norm}.bias"] = (h,)
    shapes |= {f"encoder.layer.{i}.{k}": s for i in range(cfg.num_hidden_layers) for k, s in layer.items()}
    if not cfg.use_mean_pooling:
        shapes |= {"layernorm.weight": (h,), "layernorm.bias": (h,)}
    return shapes
