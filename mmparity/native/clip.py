"""Native CLIP vision encoder: the seed's ``ViTModel`` in its CLIP configuration.

LayerNorm with biases everywhere, plain (non-gated) MLP with the config's activation (quick_gelu
for OpenAI CLIP), no patch-conv bias, one class token, a learned absolute position table
(resampled bicubically for other image sizes, as HF's ``interpolate_pos_encoding=True``),
``ln_pre`` after class token and positions, and ``post_layernorm`` on the pooled class token only.

SigLIP (:mod:`mmparity.native.siglip`) reuses this module's helpers with its own overrides.
"""

from __future__ import annotations

import torch

from mmparity.native.layers import (activation_from_hf, numbered_layers, vision_layer_spec,
                                    vision_transformer_config)
from mmparity.native.vit import ViTModel

MODEL_TYPES = ("clip_vision_model",)
CLASS_TOKEN_LEN = 1


def vision_config(cfg, model_types=MODEL_TYPES):
    """The vision sub-config of a whole-model config, duck-typed (no transformers import here)."""
    if getattr(cfg, "model_type", None) in model_types:
        return cfg
    sub = getattr(cfg, "vision_config", None)
    if getattr(sub, "model_type", None) in model_types:
        return sub
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} has no "
                     f"{'/'.join(model_types)} vision config")


def patch_size(cfg) -> int:
    return cfg.patch_size if isinstance(cfg.patch_size, int) else cfg.patch_size[0]


def image_hw(cfg) -> tuple[int, int]:
    size = cfg.image_size
    return (size, size) if isinstance(size, int) else tuple(size)


def transformer_config(cfg, params_dtype: torch.dtype = torch.float32):
    return vision_transformer_config(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        kv_channels=cfg.hidden_size // cfg.num_attention_heads,
        ffn_hidden_size=cfg.intermediate_size, normalization="LayerNorm",
        norm_eps=cfg.layer_norm_eps, activation=activation_from_hf(cfg.hidden_act), gated=False,
        bias=True, params_dtype=params_dtype)


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> ViTModel:
    """``ViTModel`` from an HF ``CLIPVisionConfig`` (or a config that contains one)."""
    cfg = vision_config(cfg)
    img_h, img_w = image_hw(cfg)
    eps = cfg.layer_norm_eps
    return ViTModel(transformer_config(cfg, params_dtype), vision_layer_spec(),
                    patch_dim=patch_size(cfg), img_h=img_h, img_w=img_w,
                    in_channels=cfg.num_channels, patch_embed_bias=False, add_class_token=True,
                    class_token_len=CLASS_TOKEN_LEN, ln_pre=True, ln_pre_eps=eps,
                    pos_emb_type="learned_absolute", ln_post="pooled", ln_post_eps=eps,
                    pooling="class_token")


# --- parity glue: how the harness drives this model (framework-free cases in, tensors out) ---

def run(model: ViTModel, case) -> dict:
    from mmparity.parity import inputs

    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    imgs = case.data["images"]
    if case.data.get("per_image"):
        rows = inputs.packed_rows(imgs, model.patch_dim).to(device, dtype)
        hidden, pooled = model(rows, imgs_sizes=case.data["sizes"], return_pooled=True)
    else:
        hidden, pooled = model(torch.stack(imgs).to(device, dtype), return_pooled=True)
    if not model.post_process:
        return {}  # an earlier pipeline stage: the last one holds the outputs
    out = {"last_hidden_state": hidden.reshape(-1, hidden.shape[-1])}
    if pooled is not None:
        out["pooler_output"] = pooled
    return out


def last_image(kind: str, model: ViTModel, to_2d):
    """Extractor: the whole tensor, or for a packed case only its last image's rows.

    ``kind`` is ``patch`` (h·w rows per image), ``tokens`` (class + h·w) or ``pooled`` (one).
    The HF side of a packed case runs one call per image, so its hooks hold the last image only.
    """

    def extract(output, case):
        t = to_2d(output, case)
        if not case.data.get("per_image"):
            return t
        h, w = case.data["sizes"][-1]
        p = model.patch_dim
        rows = {"patch": (h // p) * (w // p),
                "tokens": model.class_token_len + (h // p) * (w // p),
                "pooled": 1}[kind]
        return t[-rows:]

    return extract


def pairs(model: ViTModel, cfg) -> list:
    from mmparity.parity.cases import Pair, sbh_tokens_2d, tokens_2d

    out = [Pair("patch_embed", model.patch_conv, last_image("patch", model, tokens_2d))]
    if model.ln_pre is not None:
        out.append(Pair("ln_pre", model.ln_pre, last_image("tokens", model, tokens_2d)))
    out += [Pair(f"layer.{i}", layer, last_image("tokens", model, sbh_tokens_2d))
            for i, layer in numbered_layers(model.decoder)]
    if model.ln_post is not None:
        kind = "pooled" if model.ln_post_scope == "pooled" else "tokens"
        out.append(Pair("ln_post", model.ln_post, last_image(kind, model, tokens_2d)))
    if model.head is not None:
        out.append(Pair("head", model.head, last_image("pooled", model, tokens_2d)))
    return out


COMPONENTS = ("patch_embed", "pos_embed")


def component(name: str, model: ViTModel, cfg, seed: int) -> torch.Tensor:
    from mmparity.parity import inputs

    if name == "patch_embed":
        img = inputs.images([inputs.component_image_size(model.patch_dim)], model.in_channels,
                            seed)[0]
        tokens, _, _ = model.patch_conv(inputs.like_model(img.unsqueeze(0), model))
        return tokens[0]
    if name == "pos_embed":
        return model.position_embeddings(*inputs.COMPONENT_GRID)
    raise KeyError(name)
