"""Pipeline-parallel renumbering of mcore layer keys.

A converter works on one whole model with global layer numbers (`decoder.layers.{i}.`). Megatron's
per-rank state dicts number layers locally: pipeline stage `s` holds layers
`offset(s) .. offset(s) + count(s) - 1` of the global stack, under the local names
`decoder.layers.0.` .. `decoder.layers.{count(s) - 1}.`. This module maps between the two, with an
inverse for every direction, and decides where the keys outside the layer stack live: pre-process
modules (patch / position embeddings, pre-norm) on the first stage, post-process modules (the final
norm, heads, projectors named by `last_stage_prefixes`) on the last stage, as mcore builds them.

Pure names and tensors: no framework import, nothing copied.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from mmparity.checkpoint.fsio import CheckpointError

__all__ = [
    "DEFAULT_LAYER_PREFIX",
    "DEFAULT_LAST_STAGE_PREFIXES",
    "even_layer_counts",
    "stage_offsets",
    "global_to_local",
    "local_to_global",
    "split_pipeline_stages",
    "merge_pipeline_stages",
    "infer_layer_counts",
]

DEFAULT_LAYER_PREFIX = "decoder.layers."
# TransformerBlock's only non-layer child is its final norm, built on the post-process stage.
DEFAULT_LAST_STAGE_PREFIXES: tuple[str, ...] = ("decoder.final_layernorm.", "decoder.final_norm.")


def even_layer_counts(num_layers: int, pp_size: int) -> list[int]:
    """mcore's default split: every stage gets `num_layers / pp_size` layers (must divide)."""
    if pp_size < 1:
        raise CheckpointError(f"pipeline size must be >= 1, got {pp_size}")
    if num_layers < 0 or num_layers % pp_size:
        raise CheckpointError(
            f"{num_layers} layers do not split evenly over {pp_size} pipeline stages; "
            "pass explicit per-stage layer counts"
        )
    return [num_layers // pp_size] * pp_size


def _checked_counts(layer_counts: Sequence[int]) -> list[int]:
    counts = [int(c) for c in layer_counts]
    if not counts or any(c < 0 for c in counts):
        raise CheckpointError(f"per-stage layer counts must be a non-empty list of counts >= 0, got {list(layer_counts)}")
    return counts


def stage_offsets(layer_counts: Sequence[int]) -> list[int]:
    """Global index of each stage's first layer."""
    offsets, total = [], 0
    for count in _checked_counts(layer_counts):
        offsets.append(total)
        total += count
    return offsets


def global_to_local(global_index: int, layer_counts: Sequence[int]) -> tuple[int, int]:
    """Global layer number -> (stage, local layer number)."""
    counts = _checked_counts(layer_counts)
    if not 0 <= global_index < sum(counts):
        raise CheckpointError(f"layer {global_index} is outside a {sum(counts)}-layer stack split {counts}")
    for stage, offset in enumerate(stage_offsets(counts)):
        if global_index < offset + counts[stage]:
            return stage, global_index - offset
    raise AssertionError("unreachable: the range check above covers every layer")


def local_to_global(stage: int, local_index: int, layer_counts: Sequence[int]) -> int:
    """(stage, local layer number) -> global layer number; the inverse of `global_to_local`."""
    counts = _checked_counts(layer_counts)
    if not 0 <= stage < len(counts):
        raise CheckpointError(f"stage {stage} does not exist in a {len(counts)}-stage pipeline")
    if not 0 <= local_index < counts[stage]:
        raise CheckpointError(f"stage {stage} has {counts[stage]} layers; there is no local layer {local_index}")
    return stage_offsets(counts)[stage] + local_index


def _layer_key_pattern(layer_prefix: str) -> re.Pattern:
    return re.compile(rf"^{re.escape(layer_prefix)}(\d+)\.(.+)$")


def split_pipeline_stages(
    state_dict: Mapping[str, torch.Tensor],
    layer_counts: Sequence[int],
    *,
    layer_prefix: str = DEFAULT_LAYER_PREFIX,
    last_stage_prefixes: Sequence[str] = DEFAULT_LAST_STAGE_PREFIXES,
) -> list[dict[str, torch.Tensor]]:
    """One globally numbered state dict -> one locally numbered state dict per pipeline stage.

    Non-layer keys go to the last stage if they start with one of `last_stage_prefixes`, else to
    the first stage. Tensors are shared, not copied.
    """
    counts = _checked_counts(layer_counts)
    pattern = _layer_key_pattern(layer_prefix)
    total = sum(counts)
    stages: list[dict[str, torch.Tensor]] = [{} for _ in counts]
    out_of_range = []
    for key, value in state_dict.items():
        match = pattern.match(key)
        if match is None:
            stage = len(counts) - 1 if key.startswith(tuple(last_stage_prefixes)) else 0
            stages[stage][key] = value
            continue
        global_index = int(match.group(1))
        if global_index >= total:
            out_of_range.append(key)
            continue
        stage, local = global_to_local(global_index, counts)
        stages[stage][f"{layer_prefix}{local}.{match.group(2)}"] = value
    if out_of_range:
        raise CheckpointError(
            f"{len(out_of_range)} key(s) name layers beyond the {total}-layer split {counts}: "
            f"{', '.join(sorted(out_of_range)[:8])}"
        )
    return stages


def infer_layer_counts(
    stage_state_dicts: Sequence[Mapping[str, torch.Tensor]], *, layer_prefix: str = DEFAULT_LAYER_PREFIX
) -> list[int]:
    """Per-stage layer counts read off locally numbered keys (highest local index + 1).

    Only exact when every stage holds at least one layer key for its last layer, which is the case
    for whole-model checkpoints; pass explicit counts for anything else.
    """
    pattern = _layer_key_pattern(layer_prefix)
    counts = []
    for state_dict in stage_state_dicts:
        indices = {int(m.group(1)) for key in state_dict if (m := pattern.match(key))}
        if indices and indices != set(range(max(indices) + 1)):
            gaps = sorted(set(range(max(indices) + 1)) - indices)
            raise CheckpointError(f"stage {len(counts)} has local layers {sorted(indices)} with gaps at {gaps}")
        counts.append(max(indices) + 1 if indices else 0)
    return counts


def merge_pipeline_stages(
    stage_state_dicts: Sequence[Mapping[str, torch.Tensor]],
    layer_counts: Sequence[int] | None = None,
    *,
    layer_prefix: str = DEFAULT_LAYER_PREFIX,
) -> dict[str, torch.Tensor]:
    """Locally numbered per-stage state dicts -> one globally numbered state dict.

    The inverse of `split_pipeline_stages`. A non-layer key present on several stages (a weight
    tied between first and last stage) is accepted only if every copy is bit-identical.
    """
    counts = (
        _checked_counts(layer_counts)
        if layer_counts is not None
        else infer_layer_counts(stage_state_dicts, layer_prefix=layer_prefix)
    )
    if len(counts) != len(stage_state_dicts):
        raise CheckpointError(f"{len(stage_state_dicts)} stage state dicts but layer counts for {len(counts)} stages")
    pattern = _layer_key_pattern(layer_prefix)
    merged: dict[str, torch.Tensor] = {}
    conflicts = []
    for stage, state_dict in enumerate(stage_state_dicts):
        for key, value in state_dict.items():
            match = pattern.match(key)
            if match is not None:
                global_index = local_to_global(stage, int(match.group(1)), counts)
                key = f"{layer_prefix}{global_index}.{match.group(2)}"
            if key in merged:
                previous = merged[key]
                if isinstance(previous, torch.Tensor) and isinstance(value, torch.Tensor):
                    same = previous.dtype == value.dtype and torch.equal(previous, value)
                else:
                    same = not isinstance(previous, torch.Tensor) and not isinstance(value, torch.Tensor) and previous == value
                if not same:
                    conflicts.append(key)
                continue
            merged[key] = value
    if conflicts:
        raise CheckpointError(
            f"{len(conflicts)} key(s) appear on several pipeline stages with different values: "
            f"{', '.join(sorted(conflicts)[:8])}"
        )
    return merged
