"""Expert-parallel renumbering of mcore MoE expert keys.

A converter works on one whole model: every MoE layer holds all ``E`` of its experts under global
numbers. Megatron's per-rank state dicts hold only the experts of their expert-parallel rank: EP
rank ``r`` of ``ep`` holds global experts ``r·E/ep .. (r+1)·E/ep − 1`` under the local numbers
``0 .. E/ep − 1`` (``MoELayer.local_expert_indices``; ``SequentialMLP`` and ``TEGroupedMLP`` both
number their modules locally and map them back to global offsets only in their sharded state
dicts). Everything else of the model, the router, shared experts and the MoE layer's norms
included, is replicated on every EP rank.

Two spellings of the same expert tensors, one per experts module Megatron builds:

* ``grouped`` (``TEGroupedMLP``, ``--moe-grouped-gemm``): ``<layer>.mlp.experts.linear_fc1.weight{E}``
* ``sequential`` (``SequentialMLP``): ``<layer>.mlp.experts.local_experts.{E}.linear_fc1.weight``

(and ``linear_fc2``, and ``.bias`` beside each ``.weight`` where the experts have biases). This module
parses them, respells one as the other, and splits / merges a state dict over the EP axis, with an
inverse for each direction. Expert tensor parallelism needs nothing here: with Megatron's default
``expert_tensor_parallel_size = tensor_model_parallel_size`` each expert's fc1 is cut like a dense
gated fc1 and its fc2 like a row-parallel weight, the TP kinds of ``converters.tp``.

Pure names and tensors: no framework import, no disk.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from mmparity.parallel import tp as tp_mod
from mmparity.parallel.axes import Axis, AxisError, expert_axis
from mmparity.errors import ConversionError

__all__ = [
    "GROUPED",
    "SEQUENTIAL",
    "LAYOUTS",
    "ExpertKey",
    "parse_expert_key",
    "is_expert_key",
    "expert_key_layout",
    "expert_count",
    "respell",
    "to_grouped",
    "to_sequential",
    "split_expert_ranks",
    "merge_expert_ranks",
]

GROUPED, SEQUENTIAL = "grouped", "sequential"
LAYOUTS = (GROUPED, SEQUENTIAL)

# ``<prefix>experts.linear_fc1.weight3``: one grouped linear's weight (bias) of expert 3.
_GROUPED_KEY = re.compile(r"^(.*\bmlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")
# ``<prefix>experts.local_experts.3.linear_fc1.weight``: expert 3's own MLP; any leaf (its
# ``_extra_state`` too) belongs to that expert.
_SEQUENTIAL_KEY = re.compile(r"^(.*\bmlp\.experts\.)local_experts\.(\d+)\.(.+)$")
_RESPELLABLE = re.compile(r"^(linear_fc[12])\.(weight|bias)$")


@dataclass(frozen=True)
class ExpertKey:
    """One expert tensor's key, taken apart.

    ``prefix``: everything up to and including ``mlp.experts.`` (it names the layer); ``expert``:
    the index the key spells (global or local, as the state dict it came from numbers them);
    ``rest``: the expert's own tensor name, the same in both layouts (``linear_fc1.weight``)."""

    prefix: str
    expert: int
    rest: str
    layout: str

    @property
    def layer(self) -> str:
        """The layer the expert belongs to, as errors name it (``...decoder.layers.3``)."""
        return self.prefix[: -len(".mlp.experts.")] if self.prefix.endswith(".mlp.experts.") else self.prefix

    def spell(self, layout: str | None = None, expert: int | None = None) -> str:
        """This key in ``layout`` (default: its own) with expert index ``expert`` (default: its own)."""
        layout = self.layout if layout is None else layout
        index = self.expert if expert is None else expert
        if layout == SEQUENTIAL:
            return f"{self.prefix}local_experts.{index}.{self.rest}"
        if layout != GROUPED:
            raise ValueError(f"unknown expert layout {layout!r}; known: {', '.join(LAYOUTS)}")
        match = _RESPELLABLE.match(self.rest)
        if match is None:
            raise ConversionError("expert keys with no grouped spelling",
                                  [f"{self.spell()}: a grouped linear has one {self.rest} for all its experts"])
        return f"{self.prefix}{match.group(1)}.{match.group(2)}{index}"


def parse_expert_key(key: str) -> ExpertKey | None:
    """The parts of an expert tensor's key in either layout, None for any other key."""
    match = _GROUPED_KEY.match(key)
    if match is not None:
        return ExpertKey(match.group(1), int(match.group(4)), f"{match.group(2)}.{match.group(3)}", GROUPED)
    match = _SEQUENTIAL_KEY.match(key)
    if match is not None:
        return ExpertKey(match.group(1), int(match.group(2)), match.group(3), SEQUENTIAL)
    return None


def is_expert_key(key: str) -> bool:
    return parse_expert_key(key) is not None


def expert_key_layout(keys: Iterable[str]) -> str | None:
    """The layout the expert keys among ``keys`` are spelled in; None when there are none. Both
    at once is an error."""
    found = {parsed.layout for k in keys if (parsed := parse_expert_key(k)) is not None}
    if len(found) > 1:
        raise ConversionError("expert keys in both layouts", ["grouped (linear_fc1.weight{E}) and sequential "
                                                             "(local_experts.{E}.linear_fc1.weight) at once"])
    return next(iter(found), None)


def _by_layer(keys: Iterable[str]) -> dict[str, dict[int, set[str]]]:
    layers: dict[str, dict[int, set[str]]] = {}
    for key in keys:
        parsed = parse_expert_key(key)
        if parsed is not None:
            layers.setdefault(parsed.layer, {}).setdefault(parsed.expert, set()).add(parsed.rest)
    return layers


def expert_count(keys: Iterable[str]) -> int:
    """How many experts each MoE layer among ``keys`` (a whole model's, globally numbered: a rule
    table's mcore keys) holds; 0 when there are none. This is how a family declares its experts:
    its rule table names them. Layers of different counts, or experts 0..E−1 with gaps, are one
    :class:`ConversionError`."""
    layers = _by_layer(keys)
    counts = {layer: max(experts) + 1 for layer, experts in layers.items()}
    problems = [f"layer {layer}: no expert {e}" for layer, experts in layers.items()
                for e in range(counts[layer]) if e not in experts]
    if len(set(counts.values())) > 1:
        problems.append("MoE layers hold different expert counts: "
                        + ", ".join(f"{layer} {n}" for layer, n in sorted(counts.items())))
    if problems:
        raise ConversionError("the MoE layers' experts are not numbered 0..E-1 alike", problems)
    return next(iter(counts.values()), 0)


def respell(state: Mapping[str, object], to: str) -> dict:
    """Every expert key of ``state`` in layout ``to`` (``grouped`` or ``sequential``), every
    other key as it is, values shared. Its inverse is ``respell(·, <the other layout>)``. Expert
    numbering is kept: global stays global, local stays local."""
    if to not in LAYOUTS:
        raise ValueError(f"unknown expert layout {to!r}; known: {', '.join(LAYOUTS)}")
    out: dict = {}
    problems = []
    for key, value in state.items():
        parsed = parse_expert_key(key)
        if parsed is None:
            new = key
        elif parsed.layout == SEQUENTIAL and to == GROUPED and not _RESPELLABLE.match(parsed.rest):
            problems.append(f"{key}: a grouped linear has one {parsed.rest} for all its experts")
            continue
        else:
            new = parsed.spell(to)
        if new in out:
            problems.append(f"{key}: respelled as {new}, which the state dict already holds")
            continue
        out[new] = value
    if problems:
        raise ConversionError(f"cannot respell the expert keys as {to}", problems)
    return out


def to_grouped(state: Mapping[str, object]) -> dict:
    return respell(state, GROUPED)


def to_sequential(state: Mapping[str, object]) -> dict:
    return respell(state, SEQUENTIAL)


def _axis(ep: Axis | int) -> Axis:
    axis = ep if isinstance(ep, Axis) else expert_axis(ep)
    if axis.splits != "experts":
        raise AxisError(f"axis {axis.name} splits {axis.splits}, not experts")
    return axis


def _check_count(num_experts) -> int:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise AxisError(f"an expert count must be a positive integer, got {num_experts!r}")
    return num_experts


def _check_experts(found: Mapping[tuple, list[str]], num_experts: int, what: str) -> list[str]:
    """Every (layer, expert, rest) of ``found`` (-> the source keys that spell it) exactly once,
    and every expert of a layer with all the tensors its layer's experts have."""
    problems = []
    layers: dict[str, dict[int, set[str]]] = {}
    outside: dict[tuple[str, int], list[str]] = {}
    for (layer, expert, rest), sources in sorted(found.items()):
        if len(sources) > 1:
            problems.append(f"layer {layer}: expert {expert} {rest} appears {len(sources)} times "
                            f"({', '.join(sources)})")
        if not 0 <= expert < num_experts:
            outside.setdefault((layer, expert), []).extend(sources)
            continue
        layers.setdefault(layer, {}).setdefault(expert, set()).add(rest)
    problems += [f"layer {layer}: expert {expert} is outside the {num_experts} experts{what} ({', '.join(sources)})"
                 for (layer, expert), sources in sorted(outside.items())]
    for layer, experts in sorted(layers.items()):
        tensors = set().union(*experts.values())
        for expert in range(num_experts):
            missing = sorted(tensors - experts.get(expert, set()))
            if expert not in experts:
                problems.append(f"layer {layer}: expert {expert} is missing")
            elif missing:
                problems.append(f"layer {layer}: expert {expert} lacks {', '.join(missing)}")
    return problems


def split_expert_ranks(state: Mapping[str, object], ep_axis: Axis | int, num_experts: int) -> list[dict]:
    """One globally numbered state dict -> one dict per rank of the expert axis ``ep_axis`` (an
    axis or its size), each with its own experts under local numbers, every other key replicated
    (values shared, not copied). Works on any part of a model (a pipeline stage holding no MoE
    layer comes back ``ep`` times). ``num_experts``: per MoE layer; EP must divide it. A missing,
    duplicated or out-of-range expert is one :class:`ConversionError` naming every one."""
    axis = _axis(ep_axis)
    num_experts = _check_count(num_experts)
    ranges = axis.ranges(num_experts)  # AxisError: EP does not divide the experts
    per_rank = len(ranges[0])
    ranks: list[dict] = [{} for _ in ranges]
    found: dict[tuple, list[str]] = {}
    placed: list[tuple[ExpertKey, object]] = []
    for key, value in state.items():
        parsed = parse_expert_key(key)
        if parsed is None:
            for rank in ranks:
                rank[key] = value
            continue
        found.setdefault((parsed.layer, parsed.expert, parsed.rest), []).append(key)
        placed.append((parsed, value))
    problems = _check_experts(found, num_experts, "")
    if problems:
        raise ConversionError(f"cannot split the experts over --ep {axis.size}", problems)
    for parsed, value in placed:
        rank, local = divmod(parsed.expert, per_rank)
        ranks[rank][parsed.spell(expert=local)] = value
    return ranks


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return tp_mod.same_bytes(a, b)
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b


def merge_expert_ranks(rank_states: Sequence[Mapping[str, object]], num_experts: int | None = None) -> dict:
    """Per-EP-rank state dicts, experts numbered locally -> one globally numbered state dict; the
    inverse of :func:`split_expert_ranks`.

    Rank ``r`` of ``ep = len(rank_states)`` holds experts ``r·E/ep ..``; ``num_experts`` (``E``,
    per MoE layer) is inferred when not given as ``ep`` times the most experts a rank holds. Every
    problem is one :class:`ConversionError`: an expert missing, held twice or numbered beyond its
    rank's share (listed by layer and global expert index), a replicated key absent from a rank
    or different on it (bit for bit)."""
    if not rank_states:
        raise ConversionError("no EP ranks to merge", ["got none"])
    ep = len(rank_states)
    if num_experts is None:
        local = [parsed.expert for state in rank_states for k in state if (parsed := parse_expert_key(k))]
        num_experts = ep * (max(local) + 1) if local else ep
    num_experts = _check_count(num_experts)
    per_rank = len(_axis(ep).ranges(num_experts)[0])
    merged: dict = {}
    found: dict[tuple, list[str]] = {}
    problems: list[str] = []
    holders: dict[str, list[int]] = {}
    beyond: dict[tuple[str, int, int], list[str]] = {}
    for rank, state in enumerate(rank_states):
        for key, value in state.items():
            parsed = parse_expert_key(key)
            if parsed is None:
                holders.setdefault(key, []).append(rank)
                if key not in merged:
                    merged[key] = value
                elif not _same(merged[key], value):
                    problems.append(f"{key}: replicated over EP, but EP rank {rank} holds other values than "
                                    f"rank {holders[key][0]}")
                continue
            if not 0 <= parsed.expert < per_rank:
                beyond.setdefault((parsed.layer, rank, parsed.expert), []).append(key)
                continue
            index = rank * per_rank + parsed.expert
            global_key = parsed.spell(expert=index)
            found.setdefault((parsed.layer, index, parsed.rest), []).append(f"EP rank {rank} {key}")
            merged[global_key] = value
    problems += [f"layer {layer}: EP rank {rank} holds local expert {local}, beyond its {per_rank} of "
                 f"{num_experts} ({', '.join(keys)})" for (layer, rank, local), keys in sorted(beyond.items())]
    for key, ranks in holders.items():
        if len(ranks) != ep:
            absent = [r for r in range(ep) if r not in ranks]
            problems.append(f"{key}: replicated over EP, but absent from EP rank(s) {', '.join(map(str, absent))}")
    problems += _check_experts(found, num_experts, "")
    if problems:
        raise ConversionError(f"cannot merge the experts of {ep} EP rank(s)", problems)
    return merged
