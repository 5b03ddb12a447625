"""Qwen3-VL vision parity: Qwen3.5-MoE's cases, drivers and components (the same tower, imported)
with DeepStack added: every case also compares each DeepStack feature (``deepstack_{j}``), the
DeepStack mergers are paired module by module, and one component runs the first DeepStack merger
alone on a probe.

Pairs are listed in the order the data flows: patch embedding, layers, the DeepStack mergers, the
main merger; so a perturbed DeepStack merger is located to that merger, the layers before it and
the main merger agreeing.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import Qwen3VLVisionConfig

from mmparity.models.core import inputs
from mmparity.models.qwen3_5 import cases as tower
from mmparity.models.qwen3_5.reference import table_side
from mmparity.models.qwen3_vl import mapping as converter
from mmparity.models.qwen3_vl import native, reference
from mmparity.models.qwen3_vl.native import deepstack_problems
from mmparity.models.qwen3_vl.reference import OUTPUTS, deepstack_outputs
from mmparity.models.spec import (
    Case, FamilyHooks, NoMegatron, Pair, Parity, Side, module_hooks, tokens_2d)

COMPONENTS = tower.COMPONENTS + ("deepstack_merger",)
LAST_STAGE_COMPONENTS = tower.LAST_STAGE_COMPONENTS + ("deepstack_merger",)


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    """Qwen3.5's three cases (a static batch, packed frames of three sizes around the position
    table, packed T-frame tubelets), each also comparing the DeepStack features."""
    extra = deepstack_outputs(cfg)
    return [replace(case, outputs=tuple(case.outputs) + extra)
            for case in tower.cases(cfg, seed, image_sizes)]


# --- the reference side (transformers) -----------------------------------------------------------

def reference_run(model, case: Case) -> dict:
    cfg = model.config
    param = next(model.parameters())
    rows, grid_thw = tower.processor_rows(case, cfg)
    out = model(rows.to(param.device, param.dtype), grid_thw=grid_thw.to(param.device))
    merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
    # last_hidden_state precedes the merger: through HF's own merger norm and 2×2 grouping it is
    # the native tower's pre-projector tokens (rows are block-first: grouping is a view).
    result = {"last_hidden_state": model.merger.norm(out.last_hidden_state).reshape(-1, merged),
              "pooler_output": out.pooler_output.reshape(-1, cfg.out_hidden_size)}
    for name, feature in zip(deepstack_outputs(cfg), out.deepstack_features):
        result[name] = feature.reshape(-1, cfg.out_hidden_size)
    return result


def _deepstack_pairs(mergers, norm: str) -> list[Pair]:
    return [Pair(f"deepstack_merger_list.{j}.{part}", getattr(merger, attr), tokens_2d)
            for j, merger in enumerate(mergers)
            for part, attr in (("norm", norm), ("linear_fc1", "linear_fc1"), ("linear_fc2", "linear_fc2"))]


def _with_deepstack(pairs: list, deepstack: list) -> list:
    """``deepstack`` inserted before the main merger's pairs."""
    at = next((i for i, p in enumerate(pairs) if p.name.startswith("merger.")), len(pairs))
    return pairs[:at] + deepstack + pairs[at:]


def reference_pairs(model, cfg) -> list[Pair]:
    return _with_deepstack(tower.reference_pairs(model, cfg),
                           _deepstack_pairs(model.deepstack_merger_list, "norm"))


@torch.no_grad()
def reference_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    param = next(model.parameters())
    if name == "deepstack_merger":
        grids = inputs.grids_around_table(table_side(cfg), cfg.spatial_merge_size)
        x = inputs.token_probe(sum(h * w for h, w in grids), cfg.hidden_size, seed)
        return model.deepstack_merger_list[0](x.to(param.device, param.dtype))
    if name == "rope2d":
        return _reference_rope(model, cfg, seed)
    return tower.reference_component(name, model, cfg, seed)


def _reference_rope(model, cfg, seed: int) -> torch.Tensor:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision
    from transformers.vision_utils import get_vision_position_ids

    from mmparity.config import head_dim

    param = next(model.parameters())
    m = cfg.spatial_merge_size
    grids = inputs.grids_around_table(table_side(cfg), m)
    position_ids = get_vision_position_ids(torch.tensor([[1, h, w] for h, w in grids]), m)
    q = inputs.rope_probe(cfg.num_heads, head_dim(cfg), (position_ids.shape[0], 1), seed)
    q = q.to(param.device, param.dtype)
    cos, sin = model.rotary_pos_emb(q, position_ids.to(param.device))
    rotated, _ = apply_rotary_pos_emb_vision(q, q, cos, sin)
    return rotated


REFERENCE = Side(reference_run, reference_pairs, reference_component)


# --- the native side (mcore) ---------------------------------------------------------------------

def native_run(model, case) -> dict:
    param = next(model.parameters())
    if case.data["layout"] == "pixels":
        pixels = torch.stack(case.data["images"]).to(param.device, param.dtype)
        hidden, h, w, taps = model.encode_deepstack(pixels)
    else:
        rows = tower.patch_rows(model, case).to(param.device, param.dtype)
        hidden, h, w, taps = model.encode_deepstack(rows, imgs_sizes=case.data["sizes"])
    if not model.post_process:
        return {}
    tokens = model.merger.encoder_tokens(hidden, h, w)
    pooled = model.merger(hidden, h, w)
    result = {"last_hidden_state": tokens.reshape(-1, tokens.shape[-1]),
              "pooler_output": pooled.reshape(-1, pooled.shape[-1])}
    for j, feature in enumerate(model.deepstack(taps, h, w)):
        result[f"deepstack_{j}"] = feature.reshape(-1, feature.shape[-1])
    return result


def native_pairs(model, cfg) -> list:
    pairs = tower.native_pairs(model, cfg)
    if model.deepstack_merger_list is None:
        return pairs
    return _with_deepstack(pairs, _deepstack_pairs(model.deepstack_merger_list, "patch_norm"))


@torch.no_grad()
def native_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    if name != "deepstack_merger":
        return tower.native_component(name, model, cfg, seed)
    param = next(model.parameters())
    grids = inputs.grids_around_table(table_side(cfg), cfg.spatial_merge_size)
    x = inputs.token_probe(sum(h * w for h, w in grids), cfg.hidden_size, seed)
    return model.deepstack_merger_list[0](x.unsqueeze(0).to(param.device, param.dtype),
                                          [h for h, _ in grids], [w for _, w in grids])[0]


NATIVE = Side(native_run, native_pairs, native_component)


# --- the registry's record -------------------------------------------------------------------------

def random_config(pick) -> Qwen3VLVisionConfig:
    heads = pick([1, 2, 3, 4, 6])
    head_dim = pick([4, 8, 12])
    side = pick(range(1, 7))
    depth = pick(range(1, 4))
    taps = pick([[], [0], [depth - 1, 0], list(range(depth))])
    return Qwen3VLVisionConfig(
        depth=depth, hidden_size=heads * head_dim, num_heads=heads,
        intermediate_size=pick(range(1, 5)) * 12, in_channels=pick([1, 3]),
        patch_size=pick([2, 3]), temporal_patch_size=pick([1, 2]),
        spatial_merge_size=pick([1, 2]), out_hidden_size=pick(range(3, 21)),
        num_position_embeddings=side * side, deepstack_visual_indexes=list(dict.fromkeys(taps)))


def config_problems(cfg) -> list[str]:
    vc = reference.vision_config(cfg)
    return deepstack_problems(list(vc.deepstack_visual_indexes), vc.depth)


def pipeline_problems(cfg, pp: int) -> list[str]:
    if pp > 1 and reference.vision_config(cfg).deepstack_visual_indexes:
        return [f"--pp {pp}: the DeepStack taps read layers on every stage but their mergers sit on "
                f"the last one; check the tower at --pp 1 (convert takes any --pp)"]
    return []


MEGATRON = NoMegatron("Megatron-LM main's QwenVLViTModel has no DeepStack mergers; the tower with "
                      "DeepStack exists in Megatron-Bridge, not in megatron-core or Megatron-LM")


def hooks(towers) -> FamilyHooks:
    record = module_hooks(reference, native, converter.SPEC, reference=REFERENCE, native=NATIVE,
                          random_config=random_config,
                          parity=Parity(cases, components=COMPONENTS,
                                        last_stage_components=LAST_STAGE_COMPONENTS),
                          megatron=MEGATRON)
    return replace(record, config=replace(record.config, problems=config_problems,
                                          pipeline_problems=pipeline_problems))
