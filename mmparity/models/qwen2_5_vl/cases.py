"""Qwen2.5-VL vision parity: a static batch, packed single-frame rows and packed HF-processor rows
(T distinct frames), at sizes whose windows are partial; each side's paired modules (patch
embedding, every block's norms / attention / MLP in window order, the merger) and one component,
the window order itself against transformers' ``get_vision_window_index``.

HF's ``last_hidden_state`` is in window order and precedes the merger: :func:`reference_run` puts
it through HF's own ``ln_q`` and 2×2 grouping and back in the processor's order, which is what the
native tower's :meth:`features` gives.
"""

from __future__ import annotations

import torch
from transformers import Qwen2_5_VLVisionConfig

from mmparity.config import first_int
from mmparity.models.core import sublayers
from mmparity.models.qwen2_5_vl import mapping as converter
from mmparity.models.qwen2_5_vl import native, reference
from mmparity.models.qwen3_5 import cases as frames
from mmparity.models.spec import (
    Case, FamilyHooks, NoMegatron, Pair, Parity, Side, module_hooks, tokens_2d)

COMPONENTS = ("window_order",)


def default_image_sizes(cfg) -> list[tuple[int, int]]:
    """Three sizes (pixels), none square: one with partial windows on both axes, one a single
    merge unit wide (partial windows down a column), and one whose windows tile it exactly."""
    step = first_int(cfg.patch_size) * cfg.spatial_merge_size
    side = native.window_units(cfg.window_size, first_int(cfg.patch_size), cfg.spatial_merge_size)
    units = [(side + 1, 2 * side + 1), (2 * side + 1, 1), (side, 2 * side)]
    return [(h * step, w * step) for h, w in units]


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    """A static batch of two images, then the packed sizes as single-frame rows and as T-frame
    processor rows."""
    p = first_int(cfg.patch_size)
    sizes = [tuple(s) for s in (image_sizes or default_image_sizes(cfg))]
    return frames.packed_cases(cfg, seed, sizes, [sizes[0]] * 2,
                               f"windows of {cfg.window_size // p}x{cfg.window_size // p} patches")


# --- the reference side (transformers) -----------------------------------------------------------

def _hf_window_index(cfg, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.vision_utils import get_vision_window_index

    return get_vision_window_index(grid_thw, spatial_merge_size=cfg.spatial_merge_size,
                                   window_size=cfg.window_size, patch_size=first_int(cfg.patch_size))


def reference_run(model, case: Case) -> dict:
    cfg = model.config
    param = next(model.parameters())
    rows, grid_thw = frames.processor_rows(case, cfg)
    out = model(rows.to(param.device, param.dtype), grid_thw=grid_thw.to(param.device))
    index, _ = _hf_window_index(cfg, grid_thw)
    back = torch.argsort(index).to(param.device)
    merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
    tokens = model.merger.ln_q(out.last_hidden_state).reshape(-1, merged)[back]
    return {"last_hidden_state": tokens, "pooler_output": out.pooler_output.reshape(-1, cfg.out_hidden_size)}


def reference_pairs(model, cfg) -> list[Pair]:
    out = [Pair("patch_embed", model.patch_embed, tokens_2d)]
    for i, block in enumerate(model.blocks):
        out += sublayers.layer_pairs(f"layer.{i}", block, tokens_2d, sublayers.HF_VISION_BLOCK)
    return out + [Pair("merger.norm", model.merger.ln_q, tokens_2d),
                  Pair("merger.linear_fc1", model.merger.mlp[0], tokens_2d),
                  Pair("merger.linear_fc2", model.merger.mlp[2], tokens_2d)]


def _component_grids(cfg) -> list[tuple[int, int]]:
    p = first_int(cfg.patch_size)
    return [(h // p, w // p) for h, w in default_image_sizes(cfg)] + [(cfg.spatial_merge_size,) * 2]


@torch.no_grad()
def reference_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    if name != "window_order":
        raise KeyError(name)
    index, cu = _hf_window_index(cfg, torch.tensor([[1, h, w] for h, w in _component_grids(cfg)]))
    return torch.cat([index, cu.long()]).float()


REFERENCE = Side(reference_run, reference_pairs, reference_component)


# --- the native side (mcore) ---------------------------------------------------------------------

def native_inputs(model, case) -> tuple[torch.Tensor, dict]:
    param = next(model.parameters())
    if case.data["layout"] == "pixels":
        return torch.stack(case.data["images"]).to(param.device, param.dtype), {}
    rows = frames.patch_rows(model, case).to(param.device, param.dtype)
    return rows, {"imgs_sizes": case.data["sizes"]}


def native_run(model, case) -> dict:
    pixels, kwargs = native_inputs(model, case)
    if not model.post_process:
        model.encode(pixels, **kwargs)
        return {}  # an earlier pipeline stage: the last one holds the outputs
    tokens, pooled = model.features(pixels, **kwargs)
    return {"last_hidden_state": tokens.reshape(-1, tokens.shape[-1]),
            "pooler_output": pooled.reshape(-1, pooled.shape[-1])}


# The native tower is a QwenVLViTModel as the Qwen3.5 one is: the same modules, the same names.
native_pairs = frames.native_pairs


@torch.no_grad()
def native_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    if name != "window_order":
        raise KeyError(name)
    order, lengths = native.window_order(_component_grids(cfg), model.spatial_merge_size, model.window_side)
    unit = model.spatial_merge_size ** 2
    bounds = torch.tensor([0] + lengths).cumsum(0) * unit
    return torch.cat([order, bounds]).float()


NATIVE = Side(native_run, native_pairs, native_component)


# --- the registry's record -------------------------------------------------------------------------

def random_config(pick) -> Qwen2_5_VLVisionConfig:
    heads = pick([1, 2, 3, 4])
    depth = pick(range(1, 4))
    patch, merge = pick([2, 3]), pick([1, 2])
    return Qwen2_5_VLVisionConfig(
        depth=depth, hidden_size=heads * pick([4, 8, 12]), num_heads=heads,
        intermediate_size=pick(range(1, 5)) * 12, in_channels=pick([1, 3]), patch_size=patch,
        temporal_patch_size=pick([1, 2]), spatial_merge_size=merge, out_hidden_size=pick(range(3, 21)),
        window_size=patch * merge * pick([1, 2, 3]),
        fullatt_block_indexes=pick([[], [0], [depth - 1], list(range(depth))]))


def config_problems(cfg) -> list[str]:
    vc = reference.vision_config(cfg)
    return native.window_problems(vc.window_size, first_int(vc.patch_size), vc.spatial_merge_size)


MEGATRON = NoMegatron("megatron-core and Megatron-LM main have no Qwen2.5-VL tower (no window "
                      "attention); Megatron-Bridge has one, outside this project's scope")


def hooks(towers) -> FamilyHooks:
    from dataclasses import replace

    record = module_hooks(reference, native, converter.SPEC, reference=REFERENCE, native=NATIVE,
                          random_config=random_config, parity=Parity(cases, components=COMPONENTS),
                          megatron=MEGATRON)
    return replace(record, config=replace(record.config, problems=config_problems))
