"""Pixtral parity: packed mixed-size and static cases, each side's paired modules and components,
and the family's hook record."""

from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb as mcore_apply_rope
from transformers import PixtralVisionConfig

from mmparity.models.core import sublayers
from mmparity.models.core import inputs
from mmparity.models.core import megatron_side
from mmparity.models.spec import (
    Bench, Case, FamilyHooks, LlavaTower, Pair, Parity, Published, Side, TowerShape, first_tensor, module_hooks,
    recording_patch, sbh_tokens_2d, tokens_2d)
from mmparity.config import head_dim, image_hw
from mmparity.models.pixtral import mapping as converter
from mmparity.mapping.ops import RopeInterleave
from mmparity.models.pixtral import native
from mmparity.models.core.layers import numbered_layers
from mmparity.models.pixtral import reference
from mmparity.models.pixtral.reference import patch_size
from mmparity.models.core import megatron_classes as upstream
from mmparity.models.pixtral import megatron as pixtral_megatron

COMPONENTS = ("rope2d", "patch_embed")


def max_patches_per_side(cfg) -> int:
    """Patches per image side a Pixtral tower takes: HF's ``PixtralRotaryEmbedding`` holds angles
    for ``image_size // patch_size`` of them (a larger grid indexes past its table), and the native
    model refuses more."""
    return max(image_hw(cfg)) // patch_size(cfg)


def size_limit_problems(cfg, sizes) -> list[str]:
    """Images whose patch grid is beyond :func:`max_patches_per_side` of the vision config ``cfg``."""
    p, most = patch_size(cfg), max_patches_per_side(cfg)
    return [f"image size {h}x{w} is a {h // p}x{w // p} patch grid, beyond the {most} patches per side "
            f"the vision config allows (image_size {cfg.image_size} // patch_size {p}): at most "
            f"{most * p} pixels per side" for h, w in sizes if max(h // p, w // p) > most]


def default_image_sizes(cfg) -> list[tuple[int, int]]:
    """Three images, none square at the config size: odd patch grids, one portrait, one landscape
    (cut to what the config allows)."""
    p = patch_size(cfg)
    return inputs.within([(3 * p, 5 * p), (7 * p, 2 * p), (5 * p, 5 * p)], max_patches_per_side(cfg) * p, p)


def component_grid(cfg) -> tuple[int, int]:
    """The component checks' grid, cut to what the config allows."""
    most = max_patches_per_side(cfg)
    return tuple(min(n, max(most, 1)) for n in inputs.COMPONENT_GRID)


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


prepare_case = recording_patch(patch_size)


# --- the reference side (transformers) -----------------------------------------------------------


def reference_run(model, case: Case) -> dict:
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


def reference_pairs(model, cfg) -> list[Pair]:
    out = [Pair("patch_embed", model.patch_conv, _cropped_patch_grid),
           Pair("ln_pre", model.ln_pre, tokens_2d)]
    for i, layer in enumerate(model.transformer.layers):
        out += sublayers.layer_pairs(f"layer.{i}", layer, tokens_2d, sublayers.HF_PIXTRAL)
    return out


def rope_reference(cfg, seed: int, grid: tuple[int, int], dtype=torch.float32) -> torch.Tensor:
    """HF's rotary embedding applied to seeded q: (N, heads, hd) in HF (rotate-half) layout."""
    # Model code, imported where it runs: loading the hooks (to write torch_dist) does not pay for it.
    from transformers.models.pixtral.modeling_pixtral import PixtralVisionRotaryEmbedding, apply_rotary_pos_emb

    q = inputs.rope_probe(cfg.num_attention_heads, head_dim(cfg), grid, seed)
    q = q.to(dtype)
    rotary = PixtralVisionRotaryEmbedding(cfg)
    h, w = grid
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    position_ids = torch.stack([rows.flatten(), cols.flatten()], dim=-1)
    cos, sin = rotary(q, position_ids)
    q_bhsd = q.transpose(0, 1).unsqueeze(0)
    rotated, _ = apply_rotary_pos_emb(q_bhsd, q_bhsd, cos, sin, unsqueeze_dim=0)
    return rotated.squeeze(0).transpose(0, 1)


def reference_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    if name == "rope2d":
        return rope_reference(cfg, seed, component_grid(cfg), next(model.parameters()).dtype)
    if name == "patch_embed":
        img = inputs.images([inputs.component_image_size(patch_size(cfg))], cfg.num_channels, seed)[0]
        conv = model.patch_conv(inputs.like_model(img.unsqueeze(0), model))
        return conv.flatten(2).transpose(1, 2)[0]
    raise KeyError(name)


REFERENCE = Side(reference_run, reference_pairs, reference_component)


# --- the native side (mcore) ---------------------------------------------------------------------


def native_run(model, case) -> dict:
    images, sizes = inputs.native_images(model, case, packed=case.name != "static")
    out = model(images, **sizes)
    if not model.post_process:
        return {}  # an earlier pipeline stage: the last one holds the outputs
    return {"last_hidden_state": out.reshape(-1, out.shape[-1])}


def native_pairs(model, cfg) -> list:
    out = [Pair("patch_embed", model.patch_embedding, tokens_2d), Pair("ln_pre", model.ln_pre, tokens_2d)]
    for i, layer in numbered_layers(model.decoder):
        out += sublayers.layer_pairs(f"layer.{i}", layer, sbh_tokens_2d)
    return out


def apply_mcore_rope(model, q_interleaved: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """mcore's own RoPE application on (N, heads, hd) activations."""
    return mcore_apply_rope(q_interleaved.unsqueeze(1), freqs, model.config).squeeze(1)


def native_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    if name == "rope2d":
        heads = cfg.num_attention_heads
        hd = head_dim(cfg)
        grid = component_grid(cfg)
        q = inputs.rope_probe(heads, hd, grid, seed)
        q = inputs.like_model(q, model)
        n = q.shape[0]
        # Same per-head row permutation the converter applies to q/k weights, here on activations.
        op = RopeInterleave(heads, hd)
        q_mcore = op.apply([q.reshape(n, heads * hd).T])[0].T.reshape(n, heads, hd)
        freqs = model.rotary_pos_emb(*grid, q.device)
        rotated = apply_mcore_rope(model, q_mcore.to(freqs.device), freqs)
        return op.invert([rotated.reshape(n, heads * hd).T])[0].T.reshape(n, heads, hd)
    if name == "patch_embed":
        img = inputs.images([inputs.component_image_size(model.patch_dim)], cfg.num_channels, seed)[0]
        tokens, _, _ = model.patch_embedding(inputs.like_model(img.unsqueeze(0), model))
        return tokens[0]
    raise KeyError(name)


NATIVE = Side(native_run, native_pairs, native_component)


# --- the registry's record -------------------------------------------------------------------------

def random_config(pick) -> PixtralVisionConfig:
    heads = pick([1, 2, 3, 4, 6])
    head_dim = pick([4, 8, 12, 20])
    return PixtralVisionConfig(hidden_size=heads * head_dim, intermediate_size=pick(range(1, 10)) * 12,
                               num_hidden_layers=pick(range(1, 4)), num_attention_heads=heads,
                               image_size=64, patch_size=8, hidden_act="silu")


PUBLISHED = Published(
    source="Pixtral-12B vision encoder (24 x 1024, SwiGLU, patch 16)",
    vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                num_attention_heads=16, head_dim=64, image_size=1024, patch_size=16,
                num_channels=3, hidden_act="silu"),
    images=8, image_size=(1024, 1024),
    # No side above 1024 (the 64x64 RoPE grid), so 12 images for 32224 tokens (uniform: 32768).
    mixed=((1024, 1024), (1024, 768), (768, 1024), (896, 896), (1024, 512), (512, 1024),
           (768, 768), (1024, 640), (640, 1024), (960, 960), (832, 832), (512, 512)))


def flop_shape(cfg, base: TowerShape) -> TowerShape:
    return replace(base, gated=True)


def megatron_run(model, case: Case, cfg) -> dict:
    return {"last_hidden_state": upstream.run_vit(model, case.data["images"]).tokens}


# Megatron-LM main's ViTModel (rope2d, ln_pre) on every case, mixed sizes packed.
# What Megatron's default class has no place for, kept beside its state dict (the side file), on
# the config its layout is measured on: tests/models/test_upstream.py holds the converter to it.
SIDE_TENSORS = frozenset()
MEGATRON = {"ViTModel": megatron_side.MegatronClass(pixtral_megatron.build_pixtral, megatron_side.same_cases, megatron_run,
                                                    lambda model, cfg: megatron_side.vit_pairs(model))}


def hooks(towers) -> FamilyHooks:
    return module_hooks(reference, native, converter.SPEC, reference=REFERENCE, native=NATIVE,
                        random_config=random_config, image_size_problems=size_limit_problems,
                        parity=Parity(cases, prepare_case, COMPONENTS), megatron=MEGATRON,
                        bench=Bench(flop_shape, PUBLISHED),
                        llava_tower=LlavaTower(model_type=converter.SPEC.tower.model_type, variable_size=True,
                                               megatron_type=pixtral_megatron.SUBTYPE, vit_model=True,
                                               megatron_config=pixtral_megatron.transformer_config,
                                               max_patches=max_patches_per_side))
