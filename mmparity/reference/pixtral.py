"""Reference side of Pixtral: transformers' ``PixtralVisionModel`` (multi-image, mixed sizes)."""

from __future__ import annotations

import torch
from transformers import PixtralVisionConfig, PixtralVisionModel
from transformers.models.pixtral.modeling_pixtral import PixtralVisionRotaryEmbedding

from mmparity.parity import inputs
from mmparity.parity.cases import Case, Pair, first_tensor, tokens_2d

MODEL_TYPES = ("pixtral",)
# Whole-VLM configs that carry a Pixtral tower as ``vision_config``.
PARENT_MODEL_TYPES = ("llava", "mistral3")


def tiny_config() -> PixtralVisionConfig:
    """Awkward tiny sizes: 4 heads of 12 (hd % 4 == 0 for 2D RoPE), FFN not a multiple of hidden."""
    return PixtralVisionConfig(hidden_size=48, intermediate_size=44, num_hidden_layers=2,
                               num_attention_heads=4, image_size=64, patch_size=8,
                               hidden_act="silu", num_channels=3)


def vision_config(cfg):
    """The Pixtral vision config inside ``cfg`` (itself, or a VLM's ``vision_config``)."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES:
        return cfg
    sub = getattr(cfg, "vision_config", None)
    if getattr(cfg, "model_type", None) in PARENT_MODEL_TYPES and getattr(sub, "model_type", None) in MODEL_TYPES:
        return sub
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a Pixtral model")


def build(cfg) -> PixtralVisionModel:
    return PixtralVisionModel(cfg).eval()


def patch_size(cfg) -> int:
    return cfg.patch_size if isinstance(cfg.patch_size, int) else cfg.patch_size[0]


def default_image_sizes(cfg) -> list[tuple[int, int]]:
    """Three images, none square at the config size: odd patch grids, one portrait, one landscape."""
    p = patch_size(cfg)
    return [(3 * p, 5 * p), (7 * p, 2 * p), (5 * p, 5 * p)]


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    sizes = list(image_sizes or default_image_sizes(cfg))
    imgs = inputs.images(sizes, cfg.num_channels, seed)
    out = [Case("packed", {"images": imgs, "sizes": sizes},
                description=f"{len(sizes)} images {', '.join(f'{h}x{w}' for h, w in sizes)} in one packed pass")]
    # A static batch needs equal sizes: repeat the first (non-square) size with fresh pixels.
    static_sizes = [sizes[0]] * 2
    static_imgs = inputs.images(static_sizes, cfg.num_channels, seed + 1)
    out.append(Case("static", {"images": static_imgs, "sizes": static_sizes},
                    description=f"static batch of 2 images {static_sizes[0][0]}x{static_sizes[0][1]}"))
    return out


def run(model, case: Case) -> dict:
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    batch, sizes = inputs.pad_batch(case.data["images"])
    out = model(batch.to(device, dtype), image_sizes=torch.tensor(sizes))
    return {"last_hidden_state": out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])}


def _cropped_patch_grid(output, case: Case):
    conv = first_tensor(output)  # (B, H, h_max, w_max) over the padded canvas
    p = case.data["patch"]
    parts = [conv[b, :, : h // p, : w // p].flatten(1).T for b, (h, w) in enumerate(case.data["sizes"])]
    return torch.cat(parts, dim=0)


def pairs(model, cfg) -> list[Pair]:
    out = [Pair("patch_embed", model.patch_conv, _cropped_patch_grid),
           Pair("ln_pre", model.ln_pre, tokens_2d)]
    out += [Pair(f"layer.{i}", layer, tokens_2d) for i, layer in enumerate(model.transformer.layers)]
    return out


def prepare_case(case: Case, cfg) -> Case:
    case.data.setdefault("patch", patch_size(cfg))
    return case


def rope_reference(cfg, seed: int, grid: tuple[int, int], dtype=torch.float32) -> torch.Tensor:
    """HF's rotary embedding applied to seeded q: (N, heads, hd) in HF (rotate-half) layout."""
    from transformers.models.pixtral.modeling_pixtral import apply_rotary_pos_emb

    q = inputs.rope_probe(cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads, grid, seed)
    q = q.to(dtype)
    rotary = PixtralVisionRotaryEmbedding(cfg)
    h, w = grid
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    position_ids = torch.stack([rows.flatten(), cols.flatten()], dim=-1)
    cos, sin = rotary(q, position_ids)
    q_bhsd = q.transpose(0, 1).unsqueeze(0)
    rotated, _ = apply_rotary_pos_emb(q_bhsd, q_bhsd, cos, sin, unsqueeze_dim=0)
    return rotated.squeeze(0).transpose(0, 1)


COMPONENTS = ("rope2d", "patch_embed")


def component(name: str, model, cfg, seed: int) -> torch.Tensor:
    if name == "rope2d":
        return rope_reference(cfg, seed, inputs.COMPONENT_GRID, next(model.parameters()).dtype)
    if name == "patch_embed":
        img = inputs.images([inputs.component_image_size(patch_size(cfg))], cfg.num_channels, seed)[0]
        conv = model.patch_conv(inputs.like_model(img.unsqueeze(0), model))
        return conv.flatten(2).transpose(1, 2)[0]
    raise KeyError(name)
