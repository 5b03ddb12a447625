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
from dataclasses import dataclass

import torch

from mmparity.parallel import tp as tp_mod
from mmparity.parallel.axes import Axis, PipelineError, pipeline_axis

__all__ = [
    "DEFAULT_LAYER_PREFIX",
    "DEFAULT_LAST_STAGE_PREFIXES",
    "PipelineError",
    "PipelineLayout",
    "buildable_layer_counts",
    "pipeline_layout",
    "tied_head",
    "hand_tied_copy",
    "split_ranks",
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


def buildable_layer_counts(num_layers: int, pp: int) -> list[int]:
    """The one split of `num_layers` over `pp` stages used everywhere: one that mcore can build
    (the pipeline axis's rule, :meth:`Axis.counts`). Checkpoints record the counts, so reading back
    needs no hint."""
    return pipeline_axis(pp).counts(num_layers)


_LAYER_KEY = re.compile(r"^(.*?decoder\.layers\.)(\d+)\.(.+)$")


def layer_key_parts(key: str) -> tuple[str, int, str] | None:
    """``(stack prefix, layer index, rest)`` of a key in a ``decoder.layers.`` stack, else None."""
    match = _LAYER_KEY.match(key)
    return (match.group(1), int(match.group(2)), match.group(3)) if match else None


def layer_stacks(keys: Sequence[str]) -> dict[str, set[int]]:
    """Every ``decoder.layers.`` stack among ``keys``, with the layer indices it holds."""
    stacks: dict[str, set[int]] = {}
    for key in keys:
        parts = layer_key_parts(key)
        if parts is not None:
            stacks.setdefault(parts[0], set()).add(parts[1])
    return stacks


@dataclass(frozen=True)
class PipelineLayout:
    """Which layer stack a pipeline splits, and which other keys live on the last stage."""

    layer_prefix: str
    num_layers: int
    last_stage_keys: tuple

    def layer_counts(self, pp: int | Axis) -> list[int]:
        return [len(r) for r in self.layer_ranges(pp)]

    def layer_ranges(self, pp: int | Axis) -> list[range]:
        """The global layers of each stage of the pipeline axis ``pp`` (an axis or its size)."""
        axis = pp if isinstance(pp, Axis) else pipeline_axis(pp)
        if axis.splits != "layers":
            raise PipelineError(f"axis {axis.name} splits {axis.splits}, not layers")
        if axis.size > 1 and axis.size > self.num_layers:
            raise PipelineError(f"--pp {axis.size} is more pipeline stages than the {self.num_layers} layers of "
                                f"{self.layer_prefix}")
        return axis.ranges(self.num_layers)


def pipeline_layout(mcore_keys: Sequence[str]) -> PipelineLayout:
    """The pipelined stack of a family's mcore keys (in plan order).

    One `decoder.layers.` stack: that one, and every non-layer key planned after its layers (final
    norm, merger, projector, head) is post-process, on the last stage. Several stacks (a VLM): the
    language model's, as Megatron-LM pipelines it, with the encoder and projector on the first
    stage; only the language model's own final norm and output layer go last.
    """
    stacks = layer_stacks(mcore_keys)
    if not stacks:
        return PipelineLayout(DEFAULT_LAYER_PREFIX, 0, ())
    if len(stacks) == 1:
        prefix = next(iter(stacks))
    elif "language_model.decoder.layers." in stacks:
        prefix = "language_model.decoder.layers."
    else:
        prefix = max(stacks, key=lambda p: len(stacks[p]))
    root = "" if len(stacks) <= 1 else prefix[: -len("decoder.layers.")]
    first = next((i for i, k in enumerate(mcore_keys) if k.startswith(prefix)), len(mcore_keys))
    last = tuple(k for i, k in enumerate(mcore_keys)
                 if i > first and k.startswith(root) and not k.startswith(prefix))
    return PipelineLayout(prefix, len(stacks.get(prefix, ())), last)


EMBEDDING_TABLE = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"


def tied_head(mcore_keys: Sequence[str], pp_size: int) -> tuple[str, str] | None:
    """``(embedding table, output layer)`` keys where a tied head needs the last stage's own copy:
    with pipeline stages Megatron's ``GPTModel`` keeps the table on the first stage and a copy as
    ``output_layer.weight`` on the last (their gradients are summed, so they stay equal), and its
    last stage's state dict holds that copy. None where the head is untied or there is one stage."""
    if pp_size <= 1:
        return None
    layout = pipeline_layout(mcore_keys)
    root = layout.layer_prefix[: -len(DEFAULT_LAYER_PREFIX)]
    keys = set(mcore_keys)
    table, head = root + EMBEDDING_TABLE, root + OUTPUT_LAYER
    return (table, head) if table in keys and head not in keys and layout.num_layers else None


def hand_tied_copy(state_dict: Mapping[str, torch.Tensor], tied: tuple[str, str] | None) -> dict:
    """``state_dict`` (one TP rank, globally numbered) with the last stage's copy of a tied table
    (``tied``, from :func:`tied_head` on the plan's keys) under the output layer's key, as a
    Megatron checkpoint's last stage holds it; the table's tensor itself, not a clone. A copy the
    state already holds is kept only if it is bit-identical to the table, the rule
    :func:`merge_pipeline_stages` applies to every key on several stages: a differing copy is a
    head untied somewhere, refused rather than checked or overwritten."""
    if tied is None:
        return dict(state_dict)
    table, head = tied
    if table not in state_dict:
        raise PipelineError(f"{head} is tied to {table}, which the state does not hold")
    state = dict(state_dict)
    copy = state.setdefault(head, state_dict[table])
    if not tp_mod.same_bytes(copy, state_dict[table]):
        raise PipelineError(f"the last stage's {head} differs from {table}, which this model ties it to "
                            f"(Megatron keeps the two equal)")
    return state


def split_ranks(rank_states: Sequence[Mapping[str, torch.Tensor]], layer_counts: Sequence[int],
                layout: PipelineLayout, tied: tuple[str, str] | None = None) -> list[list[dict]]:
    """Each TP rank's globally numbered state -> ``states[stage][tp_rank]``, split as ``layout``
    says; with a tied head (``tied``, :func:`tied_head` of the plan's keys) the last stage also
    holds its own copy of the table (:func:`hand_tied_copy`), as a Megatron checkpoint's does."""
    last = layout.last_stage_keys + ((tied[1],) if tied else ())
    per_rank = [split_pipeline_stages(hand_tied_copy(state, tied), layer_counts,
                                      layer_prefix=layout.layer_prefix, last_stage_prefixes=last)
                for state in rank_states]
    return [[stages[stage] for stages in per_rank] for stage in range(len(layer_counts))]


def _checked_counts(layer_counts: Sequence[int]) -> list[int]:
    counts = [int(c) for c in layer_counts]
    if not counts or any(c < 0 for c in counts):
        raise PipelineError(f"per-stage layer counts must be a non-empty list of counts >= 0, got {list(layer_counts)}")
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
        raise PipelineError(f"layer {global_index} is outside a {sum(counts)}-layer stack split {counts}")
    for stage, offset in enumerate(stage_offsets(counts)):
        if global_index < offset + counts[stage]:
            return stage, global_index - offset
    raise AssertionError("unreachable: the range check above covers every layer")


def local_to_global(stage: int, local_index: int, layer_counts: Sequence[int]) -> int:
    """(stage, local layer number) -> global layer number; the inverse of `global_to_local`."""
    counts = _checked_counts(layer_counts)
    if not 0 <= stage < len(counts):
        raise PipelineError(f"stage {stage} does not exist in a {len(counts)}-stage pipeline")
    if not 0 <= local_index < counts[stage]:
        raise PipelineError(f"stage {stage} has {counts[stage]} layers; there is no local layer {local_index}")
    return stage_offsets(counts)[stage] + local_index


def _layer_key_pattern(layer_prefix: str) -> re.Pattern:
    return re.compile(rf"^{re.escape(layer_prefix)}(\d+)\.(.+)$")


def _on_last_stage(key: str, last_stage_prefixes: tuple) -> bool:
    """Whether a non-layer key lives on the last stage. The prefixes may be whole tensor keys
    (`pipeline_layout`'s); a TE module's `_extra_state` slot is not among them but must be where
    the module is, or its stage's strict load sees it missing and the first stage's unexpected."""
    if key.startswith(last_stage_prefixes):
        return True
    module, _, leaf = key.rpartition(".")
    return leaf == "_extra_state" and any(p.startswith(module + ".") for p in last_stage_prefixes)


def split_pipeline_stages(
    state_dict: Mapping[str, torch.Tensor],
    layer_counts: Sequence[int],
    *,
    layer_prefix: str = DEFAULT_LAYER_PREFIX,
    last_stage_prefixes: Sequence[str] = DEFAULT_LAST_STAGE_PREFIXES,
) -> list[dict[str, torch.Tensor]]:
    """One globally numbered state dict -> one locally numbered state dict per pipeline stage.

    Non-layer keys go to the last stage if they start with one of `last_stage_prefixes` (or are
    the `_extra_state` of a module whose tensors do), else to the first stage. Tensors are shared,
    not copied.
    """
    counts = _checked_counts(layer_counts)
    pattern = _layer_key_pattern(layer_prefix)
    total = sum(counts)
    stages: list[dict[str, torch.Tensor]] = [{} for _ in counts]
    out_of_range = []
    for key, value in state_dict.items():
        match = pattern.match(key)
        if match is None:
            stage = len(counts) - 1 if _on_last_stage(key, tuple(last_stage_prefixes)) else 0
            stages[stage][key] = value
            continue
        global_index = int(match.group(1))
        if global_index >= total:
            out_of_range.append(key)
            continue
        stage, local = global_to_local(global_index, counts)
        stages[stage][f"{layer_prefix}{local}.{match.group(2)}"] = value
    if out_of_range:
        raise PipelineError(
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
            raise PipelineError(f"stage {len(counts)} has local layers {sorted(indices)} with gaps at {gaps}")
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
        raise PipelineError(f"{len(stage_state_dicts)} stage state dicts but layer counts for {len(counts)} stages")
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
                    same = tp_mod.same_bytes(previous, value)
                else:
                    same = not isinstance(previous, torch.Tensor) and not isinstance(value, torch.Tensor) and previous == value
                if not same:
                    conflicts.append(key)
                continue
            merged[key] = value
    if conflicts:
        raise PipelineError(
            f"{len(conflicts)} key(s) appear on several pipeline stages with different values: "
            f"{', '.join(sorted(conflicts)[:8])}"
        )
    return merged
