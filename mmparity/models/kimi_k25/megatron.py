"""Megatron's own classes Kimi-K2.5's converted vision path loads into: Megatron-LM main's
``vit_model.KimiViTModel`` for a tower alone; for a whole model, :class:`VisionWithProjection`
(``KimiViTModel`` as ``vision_model``) and the closest Megatron construction of the projector
(:func:`kimi_projection`; Megatron has no exact place). The tower is configured by the family's
recipe (:func:`mmparity.models.kimi_k25.config.transformer_fields`)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from mmparity.config import first_int, rope_theta
from mmparity.models.core import megatron_classes as upstream
from mmparity.models.core.te_stand_ins import buildable_without_te, te_class
from mmparity.models.kimi_k25.config import projection_fields, transformer_fields

# Whole-model configs whose vision path this builds (a tower config is built alone).
MODEL_TYPES = ("kimi_k25",)
# Upstream's default RoPE table side (896/14); HF has no cap.
MAX_PATCHES_PER_SIDE = 64

KIMI_PROJECTIONS = ("drop_pre_norm", "fused_norm_over_merged")


def kimi_projection(cfg, variant: str, params_dtype=torch.float32) -> MultimodalProjector:
    """The closest Megatron construction for Kimi's projector (none is exact).

    Kimi normalises each of the m² sub-tokens of a merged vector with one LayerNorm over H, then
    runs Linear(m²H, m²H), erf GELU, Linear(m²H, text H). ``MultimodalProjector('mlp')`` holds the
    two linears exactly; for the per-sub-token norm:

    * ``drop_pre_norm``: no norm (``linear_fc1`` a plain column-parallel linear);
    * ``fused_norm_over_merged``: ``linear_fc1`` with TE's fused LayerNorm over the whole m²H vector
      (its weight and bias are the H-sized ones tiled m² times), a different function.
    """
    if variant not in KIMI_PROJECTIONS:
        raise ValueError(f"kimi projection variant must be one of {KIMI_PROJECTIONS}, got {variant!r}")
    _kimi_merge(cfg.vision_config)
    fc1 = (te_class("TELayerNormColumnParallelLinear") if variant == "fused_norm_over_merged"
           else te_class("TEColumnParallelLinear"))
    return MultimodalProjector(projection_config(cfg, params_dtype),
                               MLPSubmodules(linear_fc1=fc1, linear_fc2=te_class("TERowParallelLinear")), "mlp",
                               projection_fields(cfg)["ffn_hidden_size"])


def transformer_config(vc, params_dtype=torch.float32) -> TransformerConfig:
    """The tower's recipe (:func:`~mmparity.models.kimi_k25.config.transformer_fields`) as
    Megatron's classes take it."""
    fields = transformer_fields(vc)
    fields["activation"] = upstream.activation(fields["activation"])
    return upstream.transformer_config(params_dtype=params_dtype, **fields)


def projection_config(cfg, params_dtype=torch.float32) -> TransformerConfig:
    """The projector's recipe (:func:`~mmparity.models.kimi_k25.config.projection_fields`) as
    Megatron's ``MultimodalProjector`` takes it."""
    fields = projection_fields(cfg)
    fields["activation"] = upstream.activation(fields["activation"])
    return upstream.projection_config(params_dtype, **fields)


def _kimi_merge(vc) -> int:
    kh, kw = tuple(vc.merge_kernel_size)
    if (kh, kw) != (2, 2):
        raise ValueError(f"KimiViTModel merges 2x2 blocks; the config asks {kh}x{kw}")
    return kh


@upstream.needs_vit_model
def build_kimi_k25(cfg, params_dtype=torch.float32, projection: Optional[str] = "fused_norm_over_merged",
                   max_patches_per_side: int = MAX_PATCHES_PER_SIDE):
    vit = upstream.vit_model_module()
    vc = cfg.vision_config if getattr(cfg, "model_type", None) in MODEL_TYPES else cfg
    _kimi_merge(vc)
    p = first_int(vc.patch_size)
    config = transformer_config(vc, params_dtype)
    side = max_patches_per_side * p
    with buildable_without_te(vit):
        tower = vit.KimiViTModel(config, upstream.te_stand_ins.vit_layer_spec(), patch_dim=p, img_h=side,
                                 img_w=side, in_channels=3, pos_embed_height=vc.pos_emb_height,
                                 pos_embed_width=vc.pos_emb_width, rope_theta=rope_theta(vc))
    if vc is cfg:  # a tower alone: KimiViTModel's own keys, at the root
        return tower.eval()
    return upstream.VisionWithProjection(tower, kimi_projection(cfg, projection, params_dtype)
                                         if projection is not None else None).eval()


def kimi_parts(model) -> tuple:
    """(``KimiViTModel``, its projection or None) of what :func:`build_kimi_k25` built."""
    if isinstance(model, upstream.VisionWithProjection):
        return model.vision_model, model.vision_projection
    return model, None


def run_kimi(model, images: Sequence[torch.Tensor]):
    """``KimiViTModel`` (+ projection) on single-frame images: ``(merged tokens (ΣM, 4H),
    projected (ΣM, text H) or None)``; packed with THD attention when sizes differ."""
    tower, projection = kimi_parts(model)
    out, _grids = upstream.static_or_packed(tower, images)
    merged = out.reshape(-1, out.shape[-1])
    return merged, projection(merged) if projection is not None else None
