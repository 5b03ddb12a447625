"""The state-dict layout of Megatron's class for a family: every key, its shape on each TP rank,
and whether TP splits it (along which dim) or replicates it.

Measured by building the class (``mmparity.models.core.megatron_classes``) at each TP size, TP > 1 on spawned
gloo ranks. ``scripts/megatron_layout.py`` writes the result to ``tests/data/megatron_layout/``;
the tests compare the installed Megatron against those files, so a layout change upstream shows
as a failing test that lists every key that moved.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from mmparity.parallel import runtime
from mmparity.models.core import megatron_classes as models


def state_shapes(model: torch.nn.Module) -> tuple[dict, list]:
    """``({tensor key: shape}, [non-tensor keys])``; the latter are TE's ``_extra_state`` slots."""
    tensors, extra = {}, []
    for key, value in model.state_dict().items():
        if isinstance(value, torch.Tensor):
            tensors[key] = list(value.shape)
        else:
            extra.append(key)
    return tensors, sorted(extra)


def _build_shapes(build: Callable, cfg, options: dict) -> dict:
    with torch.device("cpu"):
        model = models.build(build, cfg, **options)
    tensors, extra = state_shapes(model)
    return {"class": _describe(model), "tensors": tensors, "extra_state": extra}


def _qualified(module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _describe(model) -> str:
    if isinstance(model, models.VisionWithProjection):
        projection = (_qualified(model.vision_projection) if model.vision_projection is not None
                      else "none")
        return (f"LLaVAModel tree without a language model: vision_model="
                f"{_qualified(model.vision_model)}, vision_projection={projection}")
    return _qualified(model)


def _rank_shapes(rank: int, world: int, build: Callable, cfg, options: dict) -> dict:
    runtime.init_parallel(world, 1)
    try:
        return _build_shapes(build, cfg, options)
    finally:
        runtime.teardown_parallel()


def measure(family: str, build: Callable, cfg, tp_sizes: Sequence[int] = (1, 2), **options) -> dict:
    """Per TP size, every rank's shapes of the class ``build`` makes (``family``'s Megatron class,
    a builder of :mod:`mmparity.models.core.megatron_classes`) -> one record per key (see the module docstring)."""
    per_tp = {}
    for tp in tp_sizes:
        if tp == 1:
            if runtime.current_layout() is None:
                runtime.init_parallel(1, 1)
            per_tp[tp] = [_build_shapes(build, cfg, options)]
        else:
            per_tp[tp] = runtime.spawn(_rank_shapes, tp, build, cfg, options)
    base = per_tp[tp_sizes[0]][0]
    record = {"family": family, "class": base["class"], "extra_state": base["extra_state"],
              "tp_sizes": list(tp_sizes), "tensors": {}}
    for key, full in base["tensors"].items():
        entry = {"tp1": full}
        split = None
        for tp in tp_sizes[1:]:
            ranks = [r["tensors"].get(key) for r in per_tp[tp]]
            entry[f"tp{tp}"] = ranks
            for rank_shape in ranks:
                if rank_shape is None:
                    continue
                dims = [d for d, (a, b) in enumerate(zip(full, rank_shape)) if a != b]
                if dims:
                    split = dims[0]
        entry["split_dim"] = split
        record["tensors"][key] = entry
    for tp in tp_sizes[1:]:
        extra = sorted({k for r in per_tp[tp] for k in r["tensors"]} - set(base["tensors"]))
        if extra:
            record.setdefault("only_at_tp", {})[str(tp)] = extra
    return record


def differences(expected: dict, actual: dict) -> list[str]:
    """Every key missing, added, or with another per-rank shape or split, one line each."""
    lines = []
    exp, act = expected["tensors"], actual["tensors"]
    for key in sorted(set(exp) - set(act)):
        lines.append(f"missing in Megatron now: {key} {exp[key]['tp1']}")
    for key in sorted(set(act) - set(exp)):
        lines.append(f"new in Megatron now: {key} {act[key]['tp1']}")
    for key in sorted(set(exp) & set(act)):
        if exp[key] != act[key]:
            lines.append(f"changed: {key}: recorded {exp[key]}, now {act[key]}")
    if expected.get("extra_state") != actual.get("extra_state"):
        lines.append(f"_extra_state keys changed: recorded {len(expected.get('extra_state', []))}, "
                     f"now {len(actual.get('extra_state', []))}")
    return lines
