"""The parallel axes a checkpoint is laid out over, as records the plan, writers and rank names read.

An :class:`Axis` is a name, a size and what it splits: tensors by their TP split kind (``tp``),
ranges of a layer stack (``pp``), ranges of an expert list (``ep``). A :class:`Grid` is one axis of
each. Expert parallelism splits the experts of every MoE layer (``converters.ep``); a model without
experts has nothing to split, so an EP size above 1 for it is refused (:func:`Grid.problems`).

Pure: no framework import, and at the bottom of the layers (beside ``runtime``, which builds its
process groups from a :class:`Grid`); ``converters.axes`` adds how a tensor axis cuts a tensor.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

__all__ = ["AxisError", "PipelineError", "Axis", "Grid", "no_experts", "tensor_axis", "pipeline_axis",
           "expert_axis"]


def no_experts(family: str | None, ep: int) -> str:
    """The one line for an expert-parallel size above 1 asked of a model without experts."""
    return f"--ep {ep}: no experts in family {family or '(unknown)'} (expert parallelism splits MoE experts)"


class AxisError(ValueError):
    """A split along an axis that cannot be made; the message is one line."""


class PipelineError(AxisError):
    """A pipeline split that cannot be made or undone; the message is one line."""


SPLITS = ("tensors", "layers", "experts")


@dataclass(frozen=True)
class Axis:
    name: str
    size: int
    splits: str

    def __post_init__(self):
        if self.splits not in SPLITS:
            raise ValueError(f"axis {self.name}: splits must be one of {SPLITS}, got {self.splits!r}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            error = PipelineError if self.splits == "layers" else AxisError
            raise error(f"--{self.name} must be >= 1, got {self.size}")

    def counts(self, total: int) -> list[int]:
        """How many of ``total`` layers (or experts) each rank of this axis holds.

        Layers: Megatron-LM splits evenly; otherwise it only takes explicit sizes for the first and
        last stage (``num_layers_in_first/last_pipeline_stage``) with the middle stages even, so
        the middle stages get ``total // size`` each and the ends share the rest, the first taking
        the larger half: 7 over 2 -> [4, 3], 7 over 3 -> [3, 2, 2], 6 over 4 -> [2, 1, 1, 2].
        Experts: Megatron only splits them evenly.
        """
        if self.splits == "tensors":
            raise AxisError(f"axis {self.name} splits tensors, not ranges")
        if total < 0:
            raise (PipelineError if self.splits == "layers" else AxisError)(
                f"a {self.splits[:-1]} count must be >= 0, got {total}")
        base = total // self.size
        if self.size == 1 or total % self.size == 0:
            return [base] * self.size
        if self.splits == "experts":
            raise AxisError(f"--{self.name} {self.size} does not divide the {total} experts")
        ends = total - base * (self.size - 2)
        return [ends - ends // 2] + [base] * (self.size - 2) + [ends // 2]

    def ranges(self, items: range | int) -> list[range]:
        """``items`` (a count from 0, or a range that need not start at 0) cut into one contiguous
        range per rank of this axis."""
        items = range(items) if isinstance(items, int) else items
        out, start = [], items.start
        for count in self.counts(len(items)):
            out.append(range(start, start + count))
            start += count
        return out


def tensor_axis(size: int = 1) -> Axis:
    return Axis("tp", size, "tensors")


def pipeline_axis(size: int = 1) -> Axis:
    return Axis("pp", size, "layers")


def expert_axis(size: int = 1) -> Axis:
    return Axis("ep", size, "experts")


@dataclass(frozen=True)
class Grid:
    """The axes one checkpoint is laid out over; a rank is one coordinate per axis."""

    tp: Axis
    pp: Axis
    ep: Axis

    @classmethod
    def of(cls, tp: int = 1, pp: int = 1, ep: int = 1) -> "Grid":
        return cls(tensor_axis(tp), pipeline_axis(pp), expert_axis(ep))

    @property
    def axes(self) -> tuple[Axis, ...]:
        return (self.tp, self.pp, self.ep)

    @property
    def sizes(self) -> tuple[int, int, int]:
        """(TP, PP, EP) sizes."""
        return tuple(a.size for a in self.axes)

    @property
    def world_size(self) -> int:
        """Ranks of the grid: one per (tp, pp, ep) coordinate."""
        return self.tp.size * self.pp.size * self.ep.size

    def ranks(self) -> list[tuple[int, int, int]]:
        """Every (tp rank, pp rank, ep rank)."""
        return list(itertools.product(*(range(a.size) for a in self.axes)))

    def problems(self, num_experts: int = 0, family: str | None = None) -> list[str]:
        """What this grid asks that a model of ``num_experts`` experts per MoE layer (0: a model
        without experts, of ``family``) cannot be laid out as, one line each."""
        if self.ep.size == 1:
            return []
        if not num_experts:
            return [no_experts(family, self.ep.size)]
        try:
            self.ep.counts(num_experts)
        except AxisError as exc:
            return [str(exc)]
        return []
