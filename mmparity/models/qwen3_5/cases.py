"""Qwen3.5-MoE VL vision parity: static pixels, packed single-frame rows and packed HF-processor
rows, each side's paired modules and components, and the family's hook record.

HF takes pre-patchified rows in the image processor's layout (block-first, width C·T·P·P) plus
``grid_thw``; its ``last_hidden_state`` precedes the merger, so :func:`reference_run` applies HF's
own merger norm and grouping to compare like with like with the native tower's output.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb as mcore_apply_rope
from transformers import Qwen3_5MoeVisionConfig
from transformers.vision_utils import (get_vision_interpolation_indices_and_weights,
                                       get_vision_position_ids)

from mmparity.models.core import sublayers
from mmparity.models.core import inputs
from mmparity.models.core import megatron_side
from mmparity.models.spec import (
    Bench, Case, FamilyHooks, Pair, Parity, Published, Side, TowerShape, module_hooks, sbh_tokens_2d, tokens_2d)
from mmparity.models.qwen3_5 import mapping as converter
from mmparity.config import first_int as _int
from mmparity.config import head_dim, vision_sub_config
from mmparity.models.qwen3_5 import native
from mmparity.models.core.layers import numbered_layers
from mmparity.models.qwen3_5.native import block_first, block_first_ids
from mmparity.models.qwen3_5 import reference
from mmparity.models.qwen3_5.reference import OUTPUTS, table_side
from mmparity.models.core import megatron_classes as upstream
from mmparity.models.qwen3_5.megatron import build_qwen3_5

COMPONENTS = ("patch_embed", "pos_embed", "rope2d", "block_first", "merger")
# Components whose module lives on the last pipeline stage (the others run on the first).
LAST_STAGE_COMPONENTS = ("merger",)


def default_image_sizes(cfg) -> list[tuple[int, int]]:
    """Three sizes (pixels) for one packed pass: a grid inside the learned table, one beyond it on
    both axes, and a tall one that crosses it on one axis only; none square."""
    p, m, g = _int(cfg.patch_size), cfg.spatial_merge_size, table_side(cfg)
    beyond = (g // m + 1) * m
    grids = [(m, 2 * m), (beyond + m, beyond + 2 * m), (beyond, m)]
    return [(h * p, w * p) for h, w in grids]


def _check_sizes(sizes, cfg) -> None:
    step = _int(cfg.patch_size) * cfg.spatial_merge_size
    bad = [s for s in sizes if s[0] % step or s[1] % step or min(s) <= 0]
    if bad:
        raise ValueError(f"image sizes {bad} are not positive multiples of patch_size*"
                         f"spatial_merge_size = {step}")


def case_inputs(cfg, seed: int, static_sizes, sizes) -> tuple[dict, dict, dict]:
    """The data of the three cases: a static batch of pixels at ``static_sizes`` (one size), the
    images at ``sizes`` as packed single-frame rows, and as packed HF-processor rows of T frames."""
    common = {"patch": _int(cfg.patch_size), "merge": cfg.spatial_merge_size}
    static = {"layout": "pixels", "images": inputs.images(static_sizes, cfg.in_channels, seed + 1),
              "sizes": static_sizes, **common}
    packed = {"layout": "frame_rows", "images": inputs.images(sizes, cfg.in_channels, seed),
              "sizes": sizes, **common}
    t = _int(cfg.temporal_patch_size)
    # T different frames per image: exercises the whole Conv3d kernel, not only its sum over T.
    frames = inputs.images([s for s in sizes for _ in range(t)], cfg.in_channels, seed + 2)
    clips = [torch.stack(frames[i * t:(i + 1) * t]) for i in range(len(sizes))]
    tubelets = {"layout": "processor_rows", "clips": clips, "sizes": sizes, **common}
    return static, packed, tubelets


def packed_cases(cfg, seed: int, sizes, static_sizes, note: str = "") -> list[Case]:
    """The three cases of :func:`case_inputs` (a static batch at ``static_sizes``, ``sizes`` as packed
    single-frame rows and as packed T-frame processor rows), described with the grids and ``note``
    (what else the sizes exercise): the Qwen-VL-shaped towers' usual set."""
    p, t = _int(cfg.patch_size), _int(cfg.temporal_patch_size)
    static, packed, tubelets = case_inputs(cfg, seed, static_sizes, sizes)
    described = ", ".join(f"{h // p}x{w // p}" for h, w in sizes)
    after, inside = (f", {note}", f"; {note}") if note else ("", "")
    return [Case("static", static, OUTPUTS, f"static batch of 2 images, grid {static_sizes[0][0] // p}x"
                                            f"{static_sizes[0][1] // p}{after}"),
            Case("packed", packed, OUTPUTS, f"{len(sizes)} images (grids {described}{inside}) as C*P*P rows "
                                            f"in one packed pass"),
            Case("processor_rows", tubelets, OUTPUTS, f"{len(sizes)} {t}-frame tubelets (grids {described}) "
                                                      f"as HF processor rows in one packed pass")]


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    """Static pixels, packed single-frame rows, packed HF-processor rows (T distinct frames)."""
    p, m = _int(cfg.patch_size), cfg.spatial_merge_size
    sizes = [tuple(s) for s in (image_sizes or default_image_sizes(cfg))]
    _check_sizes(sizes, cfg)

    def grids(ss):
        return ", ".join(f"{h // p}x{w // p}" for h, w in ss)

    # A static batch shares one size: a non-square one, distinct from the packed sizes by default.
    static_sizes = [sizes[0]] * 2 if image_sizes else [(3 * m * p, 2 * m * p)] * 2
    static, packed, tubelets = case_inputs(cfg, seed, static_sizes, sizes)
    t = _int(cfg.temporal_patch_size)
    g = table_side(cfg)
    return [
        Case("static", static, OUTPUTS, f"static batch of 2 images, grid {grids(static_sizes[:1])}"),
        Case("packed", packed, OUTPUTS, f"{len(sizes)} images (grids {grids(sizes)}; table {g}x{g}) "
                                        f"as C*P*P rows in one packed pass"),
        Case("processor_rows", tubelets, OUTPUTS, f"{len(sizes)} {t}-frame tubelets (grids "
                                                  f"{grids(sizes)}) as HF processor rows (C*T*P*P) "
                                                  f"in one packed pass"),
    ]


# --- the reference side (transformers) -----------------------------------------------------------


def processor_rows(case: Case, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The case as HF consumes it: (ΣN, C·T·P·P) rows and ``grid_thw`` (n, 3)."""
    p, m, t = _int(cfg.patch_size), cfg.spatial_merge_size, _int(cfg.temporal_patch_size)
    if case.data["layout"] == "processor_rows":
        clips = case.data["clips"]
    else:
        # A still image in the processor's layout is its frame repeated T times.
        clips = [img.unsqueeze(0).expand(t, -1, -1, -1) for img in case.data["images"]]
    rows = torch.cat([inputs.block_first_patch_rows(c, p, m) for c in clips])
    grid_thw = torch.tensor([[1, h // p, w // p] for h, w in case.data["sizes"]])
    return rows, grid_thw


def reference_run(model, case: Case) -> dict:
    cfg = model.config
    param = next(model.parameters())
    rows, grid_thw = processor_rows(case, cfg)
    out = model(rows.to(param.device, param.dtype), grid_thw=grid_thw.to(param.device))
    merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
    # HF's last_hidden_state precedes the merger; through HF's merger norm and 2×2 grouping it is
    # the native tower's output (rows are block-first, so grouping is a plain view).
    tokens = model.merger.norm(out.last_hidden_state).reshape(-1, merged)
    pooled = out.pooler_output.reshape(-1, cfg.out_hidden_size)
    return {"last_hidden_state": tokens, "pooler_output": pooled}


def reference_pairs(model, cfg) -> list[Pair]:
    out = [Pair("patch_embed", model.patch_embed, tokens_2d)]
    for i, block in enumerate(model.blocks):
        out += sublayers.layer_pairs(f"layer.{i}", block, tokens_2d, sublayers.HF_VISION_BLOCK)
    out += [Pair("merger.norm", model.merger.norm, tokens_2d),
            Pair("merger.linear_fc1", model.merger.linear_fc1, tokens_2d),
            Pair("merger.linear_fc2", model.merger.linear_fc2, tokens_2d)]
    return out


def _grid_thw(grids) -> torch.Tensor:
    return torch.tensor([[1, h, w] for h, w in grids])


@torch.no_grad()
def reference_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    param = next(model.parameters())
    m = cfg.spatial_merge_size
    grids = inputs.grids_around_table(table_side(cfg), m)
    grid_thw = _grid_thw(grids)
    if name == "patch_embed":
        h, w = grids[-1]
        p, t = _int(cfg.patch_size), _int(cfg.temporal_patch_size)
        img = inputs.images([(h * p, w * p)], cfg.in_channels, seed)[0]
        rows = inputs.block_first_patch_rows(img.unsqueeze(0).expand(t, -1, -1, -1), p, m)
        return model.patch_embed(rows.to(param.device, param.dtype))
    if name == "pos_embed":
        # HF's forward computes this inline; same helper, same arguments.
        index, weights = get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=model.num_grid_per_side, mode=model.interpolation_mode,
            align_corners=model.interpolation_align_corners, spatial_merge_size=m)
        return (model.pos_embed(index.to(param.device)) * weights.to(param.device)[:, :, None]).sum(1)
    if name == "rope2d":
        position_ids = get_vision_position_ids(grid_thw, m)
        heads = cfg.num_attention_heads
        q = inputs.rope_probe(heads, head_dim(cfg), (position_ids.shape[0], 1), seed)
        q = q.to(param.device, param.dtype)
        cos, sin = model.rotary_pos_emb(q, position_ids.to(param.device))
        # Model code, imported where it runs: loading the hooks (to write torch_dist) does not pay for it.
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import apply_rotary_pos_emb_vision

        rotated, _ = apply_rotary_pos_emb_vision(q, q, cos, sin)
        return rotated
    if name == "block_first":
        return get_vision_position_ids(grid_thw, m).float()
    if name == "merger":
        x = inputs.token_probe(sum(h * w for h, w in grids), cfg.hidden_size, seed)
        return model.merger(x.to(param.device, param.dtype))
    raise KeyError(name)


REFERENCE = Side(reference_run, reference_pairs, reference_component)


# --- the native side (mcore) ---------------------------------------------------------------------


def patch_rows(model, case) -> torch.Tensor:
    """The packed rows a case feeds: single-frame (C·P·P) or HF-processor (C·T·P·P) width."""
    p, m = model.patch_dim, model.spatial_merge_size
    if case.data["layout"] == "frame_rows":
        clips = [img.unsqueeze(0) for img in case.data["images"]]
    else:
        clips = case.data["clips"]
    return torch.cat([inputs.block_first_patch_rows(c, p, m) for c in clips]).unsqueeze(0)


def native_run(model, case) -> dict:
    param = next(model.parameters())
    if case.data["layout"] == "pixels":
        pixels = torch.stack(case.data["images"]).to(param.device, param.dtype)
        hidden, h, w = model.encode(pixels)
    else:
        rows = patch_rows(model, case).to(param.device, param.dtype)
        hidden, h, w = model.encode(rows, imgs_sizes=case.data["sizes"])
    if not model.post_process:
        return {}  # an earlier pipeline stage: the last one holds the outputs
    tokens = model.merger.encoder_tokens(hidden, h, w)
    pooled = model.merger(hidden, h, w)
    return {"last_hidden_state": tokens.reshape(-1, tokens.shape[-1]),
            "pooler_output": pooled.reshape(-1, pooled.shape[-1])}


def _patch_embed_tokens(output, case):
    """Static pixels come out raster with their grid; rows come out block-first already."""
    if isinstance(output, tuple):
        tokens, h, w = output
        merge = case.data["merge"]
        tokens = block_first(tokens, h, w, merge)
        return tokens.reshape(-1, tokens.shape[-1])
    return output.reshape(-1, output.shape[-1])


def native_pairs(model, cfg) -> list:
    out = [Pair("patch_embed", model.patch_embed, _patch_embed_tokens)]
    for i, layer in numbered_layers(model.decoder):
        out += sublayers.layer_pairs(f"layer.{i}", layer, sbh_tokens_2d)
    if model.merger is None:
        return out
    out.append(Pair("merger.norm", model.merger.patch_norm, tokens_2d))
    if model.merger.linear_fc1.weight.shape[0] == model.out_hidden_size:
        # Under TP the column-parallel fc1 output is a per-rank slice: nothing whole to compare.
        out.append(Pair("merger.linear_fc1", model.merger.linear_fc1, tokens_2d))
    out.append(Pair("merger.linear_fc2", model.merger.linear_fc2, tokens_2d))
    return out


def apply_mcore_rope(model, q: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """mcore's own RoPE application on (N, heads, hd) activations."""
    return mcore_apply_rope(q.unsqueeze(1), freqs, model.config).squeeze(1)


@torch.no_grad()
def native_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    param = next(model.parameters())
    m = model.spatial_merge_size
    grids = inputs.grids_around_table(native.table_side(cfg), m)
    ids = [block_first_ids(h, w, m, param.device) for h, w in grids]
    if name == "patch_embed":
        h, w = grids[-1]
        img = inputs.images([(h * model.patch_dim, w * model.patch_dim)], cfg.in_channels, seed)[0]
        tokens, h, w = model.patch_embed(img.unsqueeze(0).to(param.device, param.dtype))
        return block_first(tokens, h, w, m)[0]
    if name == "pos_embed":
        return torch.cat([model.pos_embed.lookup(r, c, h, w) for (r, c), (h, w) in zip(ids, grids)])
    if name == "rope2d":
        total = sum(h * w for h, w in grids)
        q = inputs.rope_probe(cfg.num_attention_heads, head_dim(cfg), (total, 1), seed)
        freqs = torch.cat([model.rotary_pos_emb(r, c) for r, c in ids])
        return apply_mcore_rope(model, q.to(param.device, param.dtype), freqs)
    if name == "block_first":
        out = []
        for h, w in grids:
            rows = torch.arange(h).repeat_interleave(w)
            cols = torch.arange(w).repeat(h)
            raster = torch.stack([rows, cols], dim=-1).unsqueeze(0)
            out.append(block_first(raster, h, w, m)[0])
        return torch.cat(out).float()
    if name == "merger":
        x = inputs.token_probe(sum(h * w for h, w in grids), cfg.hidden_size, seed)
        return model.merger(x.unsqueeze(0).to(param.device, param.dtype),
                            [h for h, _ in grids], [w for _, w in grids])[0]
    raise KeyError(name)


NATIVE = Side(native_run, native_pairs, native_component)


# --- the registry's record -------------------------------------------------------------------------

def random_config(pick) -> Qwen3_5MoeVisionConfig:
    heads = pick([1, 2, 3, 4, 6])
    head_dim = pick([4, 8, 12])
    side = pick(range(1, 7))
    return Qwen3_5MoeVisionConfig(
        depth=pick(range(1, 3)), hidden_size=heads * head_dim, num_heads=heads,
        intermediate_size=pick(range(1, 5)) * 12, in_channels=pick([1, 3]),
        patch_size=pick([2, 3]), temporal_patch_size=pick([1, 2]),
        spatial_merge_size=pick([1, 2]), out_hidden_size=pick(range(3, 21)),
        num_position_embeddings=side * side)


PUBLISHED = Published(
    source="Qwen3.5 vision tower (Qwen/Qwen3.5-35B-A3B vision_config; out_hidden_size 2048 "
           "assumed for that checkpoint's text width)",
    vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3,
                patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2048,
                num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh"),
    images=8, image_size=(768, 768),
    # 18272 tokens (uniform: 18432); every side a multiple of patch 16 x merge 2.
    mixed=((768, 768), (512, 1024), (1024, 512), (640, 640), (896, 448), (384, 768),
           (1024, 1024), (768, 1152)))


def flop_shape(cfg, base: TowerShape) -> TowerShape:
    vision = vision_sub_config(cfg)
    m = vision.spatial_merge_size
    wide = base.hidden * m * m
    return replace(base, merge=m, merger=((wide, wide), (wide, vision.out_hidden_size)))


# --- Megatron's own class: Megatron-LM main's QwenVLViTModel --------------------------------------

def megatron_run(model, case: Case, cfg) -> dict:
    rows, grid_thw = processor_rows(case, cfg)
    grids = [(h, w) for _, h, w in grid_thw.tolist()]
    if case.data["layout"] == "pixels":
        tokens, merged = upstream.run_qwen(model, grids, pixels=torch.stack(case.data["images"]))
    else:
        tokens, merged = upstream.run_qwen(model, grids, rows=rows)
    return {"last_hidden_state": tokens, "pooler_output": merged}


def megatron_pairs(model, cfg) -> list[Pair]:
    return megatron_side.layer_pairs(model) + [Pair("merger.norm", model.merger.patch_norm, tokens_2d),
                                               Pair("merger.linear_fc1", model.merger.linear_fc1, tokens_2d),
                                               Pair("merger.linear_fc2", model.merger.linear_fc2, tokens_2d)]


# What Megatron's default class has no place for, kept beside its state dict (the side file), on
# the config its layout is measured on: tests/models/test_upstream.py holds the converter to it.
SIDE_TENSORS = frozenset()
MEGATRON = {"QwenVLViTModel": megatron_side.MegatronClass(build_qwen3_5, megatron_side.same_cases,
                                                          megatron_run, megatron_pairs)}


def hooks(towers) -> FamilyHooks:
    return module_hooks(reference, native, converter.SPEC, reference=REFERENCE, native=NATIVE,
                        random_config=random_config,
                        parity=Parity(cases, components=COMPONENTS, last_stage_components=LAST_STAGE_COMPONENTS),
                        megatron=MEGATRON, bench=Bench(flop_shape, PUBLISHED))
