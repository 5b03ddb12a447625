"""Native Pixtral vision encoder: the seed's ``ViTModel`` in its Pixtral configuration.

RMSNorm everywhere (eps 1e-5 as HF hard-codes it), SwiGLU-style gated MLP with the config's
activation, no biases, ``ln_pre``, axial 2D RoPE in mcore's interleaved layout.
"""

from __future__ import annotations

import torch

from mmparity.native.layers import (activation_from_hf, numbered_layers, vision_layer_spec,
                                    vision_transformer_config)
from mmparity.native.vit import ViTModel
from mmparity.native.rope import rope_theta

# HF's PixtralRMSNorm instances are built with a literal 1e-5, not a config field.
PIXTRAL_NORM_EPS = 1e-5


def _image_hw(cfg) -> tuple[int, int]:
    size = cfg.image_size
    return (size, size) if isinstance(size, int) else tuple(size)


def _patch(cfg) -> int:
    p = cfg.patch_size
    return p if isinstance(p, int) else p[0]


def transformer_config(cfg, params_dtype: torch.dtype = torch.float32):
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return vision_transformer_config(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, kv_channels=head_dim,
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


# --- parity glue: how the harness drives this model (framework-free cases in, tensors out) ---

def run(model: ViTModel, case) -> dict:
    from mmparity.parity import inputs

    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    imgs = case.data["images"]
    if case.name == "static":
        out = model(torch.stack(imgs).to(device, dtype))
    else:
        rows = inputs.packed_rows(imgs, model.patch_dim).to(device, dtype)
        out = model(rows, imgs_sizes=case.data["sizes"])
    if not model.post_process:
        return {}  # an earlier pipeline stage: the last one holds the outputs
    return {"last_hidden_state": out.reshape(-1, out.shape[-1])}


def pairs(model: ViTModel, cfg) -> list:
    from mmparity.parity.cases import Pair, sbh_tokens_2d, tokens_2d

    out = [Pair("patch_embed", model.patch_conv, tokens_2d), Pair("ln_pre", model.ln_pre, tokens_2d)]
    out += [Pair(f"layer.{i}", layer, sbh_tokens_2d) for i, layer in numbered_layers(model.decoder)]
    return out


COMPONENTS = ("rope2d", "patch_embed")


def apply_mcore_rope(model, q_interleaved: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """mcore's own RoPE application on (N, heads, hd) activations."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q_interleaved.unsqueeze(1), freqs, model.config).squeeze(1)


def component(name: str, model: ViTModel, cfg, seed: int) -> torch.Tensor:
    from mmparity.converters.ops import RopeInterleave
    from mmparity.parity import inputs

    if name == "rope2d":
        heads = cfg.num_attention_heads
        hd = cfg.hidden_size // heads
        q = inputs.rope_probe(heads, hd, inputs.COMPONENT_GRID, seed)
        q = inputs.like_model(q, model)
        n = q.shape[0]
        # Same per-head row permutation the converter applies to q/k weights, here on activations.
        op = RopeInterleave(heads, hd)
        q_mcore = op.apply([q.reshape(n, heads * hd).T])[0].T.reshape(n, heads, hd)
        freqs = model.rotary_pos_emb(*inputs.COMPONENT_GRID, q.device)
        rotated = apply_mcore_rope(model, q_mcore.to(freqs.device), freqs)
        return op.invert([rotated.reshape(n, heads * hd).T])[0].T.reshape(n, heads, hd)
    if name == "patch_embed":
        img = inputs.images([inputs.component_image_size(model.patch_dim)], cfg.num_channels, seed)[0]
        tokens, _, _ = model.patch_conv(inputs.like_model(img.unsqueeze(0), model))
        return tokens[0]
    raise KeyError(name)
