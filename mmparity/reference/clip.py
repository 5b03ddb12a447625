"""Reference side of CLIP: transformers' ``CLIPVisionModel`` with ``interpolate_pos_encoding=True``.

HF runs one image size per call, so a packed case (several sizes) is one HF call per image,
concatenated. Module pairs of such a case can only see the last call; both sides then compare
the last image's tokens (see :func:`last_image`), while the outputs compare every image.

SigLIP (:mod:`mmparity.reference.siglip`) is this module plus overrides.
"""

from __future__ import annotations

import torch
from transformers import CLIPVisionConfig, CLIPVisionModel

from mmparity.parity import inputs
from mmparity.parity.cases import Case, Pair, first_tensor, tokens_2d

MODEL_TYPES = ("clip_vision_model",)
# Whole-model configs that carry a CLIP tower as ``vision_config``.
PARENT_MODEL_TYPES = ("clip", "llava", "llava_next", "vipllava")
OUTPUTS = ("last_hidden_state", "pooler_output")
CLASS_TOKEN_LEN = 1


def tiny_config() -> CLIPVisionConfig:
    """4 heads of 12 (TP 2 and 4), FFN 52 (not a multiple of 48), an odd 5x5 position grid."""
    return CLIPVisionConfig(hidden_size=48, intermediate_size=52, num_hidden_layers=2,
                            num_attention_heads=4, image_size=40, patch_size=8, num_channels=3,
                            hidden_act="quick_gelu", layer_norm_eps=1e-5)


def _vision_config(cfg, model_types, parent_types, family: str):
    model_type = getattr(cfg, "model_type", None)
    if model_type in model_types:
        return cfg
    sub = getattr(cfg, "vision_config", None)
    if model_type in parent_types and getattr(sub, "model_type", None) in model_types:
        return sub
    raise ValueError(f"config of model_type {model_type!r} is not a {family} vision model")


def vision_config(cfg):
    """The CLIP vision config inside ``cfg`` (itself, a ``CLIPConfig``'s or a LLaVA's)."""
    return _vision_config(cfg, MODEL_TYPES, PARENT_MODEL_TYPES, "CLIP")


def build(cfg) -> CLIPVisionModel:
    return CLIPVisionModel(vision_config(cfg)).eval()


def patch_size(cfg) -> int:
    return cfg.patch_size if isinstance(cfg.patch_size, int) else cfg.patch_size[0]


def default_image_sizes(cfg) -> list[tuple[int, int]]:
    """Odd, non-square grids, one down- and one up-sampling; the last is the table's own grid."""
    p = patch_size(cfg)
    g = cfg.image_size // p
    return [(3 * p, 7 * p), (7 * p, 2 * p), (g * p, g * p)]


def make_cases(cfg, seed: int, image_sizes, outputs) -> list[Case]:
    sizes = list(image_sizes or default_image_sizes(cfg))
    static_sizes = [sizes[0]] * 3
    static_imgs = inputs.images(static_sizes, cfg.num_channels, seed + 1)
    h, w = static_sizes[0]
    out = [Case("static", {"images": static_imgs, "sizes": static_sizes}, outputs,
                description=f"static batch of 3 images {h}x{w}, position table resampled")]
    imgs = inputs.images(sizes, cfg.num_channels, seed)
    out.append(Case("packed", {"images": imgs, "sizes": sizes, "per_image": True}, outputs,
                    description=f"{len(sizes)} images {', '.join(f'{a}x{b}' for a, b in sizes)} "
                                "in one packed pass (HF: one call per image)"))
    return out


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    return make_cases(cfg, seed, image_sizes, OUTPUTS)


def prepare_case(case: Case, cfg) -> Case:
    case.data.setdefault("patch", patch_size(cfg))
    return case


def run(model, case: Case) -> dict:
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    if case.data.get("per_image"):
        calls = [img.unsqueeze(0) for img in case.data["images"]]
    else:
        calls = [torch.stack(case.data["images"])]
    hidden, pooled = [], []
    for batch in calls:
        out = model(batch.to(device, dtype), interpolate_pos_encoding=True)
        hidden.append(out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1]))
        if out.pooler_output is not None:
            pooled.append(out.pooler_output)
    result = {"last_hidden_state": torch.cat(hidden)}
    if pooled:
        result["pooler_output"] = torch.cat(pooled)
    return result


def conv_tokens(output, case: Case):
    """Conv output (B, H, h, w) -> (B·h·w, H) raster tokens."""
    conv = first_tensor(output)
    return conv.flatten(2).transpose(1, 2).reshape(-1, conv.shape[1])


def pairs(model, cfg) -> list[Pair]:
    out = [Pair("patch_embed", model.embeddings.patch_embedding, conv_tokens),
           Pair("ln_pre", model.pre_layrnorm, tokens_2d)]
    out += [Pair(f"layer.{i}", layer, tokens_2d) for i, layer in enumerate(model.encoder.layers)]
    out.append(Pair("ln_post", model.post_layernorm, tokens_2d))
    return out


COMPONENTS = ("patch_embed", "pos_embed")


def component(name: str, model, cfg, seed: int) -> torch.Tensor:
    p = patch_size(cfg)
    if name == "patch_embed":
        img = inputs.images([inputs.component_image_size(p)], cfg.num_channels, seed)[0]
        conv = model.embeddings.patch_embedding(inputs.like_model(img.unsqueeze(0), model))
        return conv.flatten(2).transpose(1, 2)[0]
    if name == "pos_embed":
        return interpolated_positions(model.embeddings, cfg, inputs.COMPONENT_GRID,
                                      CLASS_TOKEN_LEN)
    raise KeyError(name)


def interpolated_positions(embeddings, cfg, grid, class_token_len: int) -> torch.Tensor:
    """HF's own ``interpolate_pos_encoding`` for a (h, w) patch grid -> (class + h·w, H)."""
    h, w = grid
    p = patch_size(cfg)
    weight = embeddings.position_embedding.weight
    probe = weight.new_zeros(1, class_token_len + h * w, weight.shape[-1])
    return embeddings.interpolate_pos_encoding(probe, h * p, w * p)[0]
