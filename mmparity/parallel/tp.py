"""Tensor-parallel shard / merge, kept apart from names and layouts.

Each kind is a :class:`Split` record in ``KINDS``, by the name rule tables use (what mcore's
layers expect on rank r of ``tp``):

* ``replicated`` – every rank holds the full tensor (norms, row-parallel biases, conv stems).
* ``column``     – rows split in ``tp`` contiguous chunks (ColumnParallelLinear weight and bias).
* ``row``        – columns split (RowParallelLinear weight).
* ``qkv``        – ``column`` on the per-query-group fused layout: a chunk is whole query groups,
  which only holds when ``tp`` divides the group count (checked by the rule set).
* ``gated``      – fused ``[gate; up]``: rank r holds ``[gate_r; up_r]``, not a row slice of the
  concatenation, so that each rank's GLU halves still pair up.
* ``vocab``      – ``column`` over a vocabulary padded to a multiple of ``tp`` by the caller.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmparity.parallel.axes import Axis, AxisError

def cat(tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat``; on meta tensors, where conversions are planned, made from the shapes alone.

    torch's meta ``cat`` is a Python reference whose first call imports ``torch._dynamo``: more CPU
    time than the rest of a small conversion's start-up, where only the result's shape matters.
    """
    tensors = list(tensors)
    if not tensors or not all(t.is_meta and t.dim() == tensors[0].dim() > 0 for t in tensors):
        return torch.cat(tensors, dim=dim)
    shape = list(tensors[0].shape)
    axis = dim % len(shape)
    for number, t in enumerate(tensors[1:], start=1):
        for i, (want, got) in enumerate(zip(shape, t.shape)):
            if i != axis and want != got:
                raise RuntimeError(f"Sizes of tensors must match except in dimension {axis}. Expected "
                                   f"size {want} but got size {got} for tensor number {number} in the list.")
    shape[axis] = sum(t.shape[axis] for t in tensors)
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return torch.empty(shape, dtype=dtype, device="meta")


class ShardError(ValueError):
    pass


_SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same values bit for bit: same dtype, shape and bytes.

    Not `torch.equal` on the values: a NaN never equals itself and -0.0 equals +0.0, so two
    byte-identical copies holding a NaN would differ and two byte-different ones would agree.
    Comparing same-sized integers is also half the work of comparing bfloat16 on the CPU."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)  # integers and bools already compare bit for bit
    integer = _SAME_SIZE_INTEGER.get(a.element_size())
    if integer is None:  # complex128: no 16-byte integer to view it as
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a.view(integer), b.view(integer))


def check_replicated(parts: list[torch.Tensor]) -> None:
    """Every rank's copy of a replicated tensor holds the same bytes (the one check of it)."""
    for r, p in enumerate(parts[1:], start=1):
        if not same_bytes(p, parts[0]):
            raise ShardError(f"replicated tensor differs between rank 0 and rank {r}")


class ColumnJoin:
    """2-D tensors side by side, ``torch.cat(parts, dim=1)``, without making the copy.

    A row-parallel matrix merged from its TP parts is this: every row of the whole is the parts'
    rows one after another. Writers that understand it write those row runs straight from the
    parts; ``tensor()`` makes the copy for everyone else.
    """

    def __init__(self, parts):
        parts = list(parts)
        if not parts or any(p.dim() != 2 for p in parts) or len({p.shape[0] for p in parts}) != 1 \
                or len({p.dtype for p in parts}) != 1:
            raise ShardError(f"column join needs 2-D parts of equal rows and dtype, got "
                             f"{[tuple(p.shape) for p in parts]}")
        self.parts = parts
        self.dtype = parts[0].dtype
        self.shape = torch.Size((parts[0].shape[0], sum(p.shape[1] for p in parts)))

    def dim(self) -> int:
        return 2

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def element_size(self) -> int:
        return self.parts[0].element_size()

    def narrow(self, dim: int, start: int, length: int):
        if dim == 0:
            return ColumnJoin([p.narrow(0, start, length) for p in self.parts])
        picked, offset = [], 0
        for part in self.parts:
            lo, hi = max(start, offset), min(start + length, offset + part.shape[1])
            if lo < hi:
                picked.append(part.narrow(1, lo - offset, hi - lo))
            offset += part.shape[1]
        return picked[0] if len(picked) == 1 else ColumnJoin(picked)

    def tensor(self) -> torch.Tensor:
        return torch.cat(self.parts, dim=1)


def as_tensor(piece) -> torch.Tensor:
    return piece.tensor() if isinstance(piece, ColumnJoin) else piece


# --- the split kinds, as records ----------------------------------------------------------------


def _chunks(t: torch.Tensor, tp: int, dim: int, kind: str) -> list[torch.Tensor]:
    if t.dim() <= dim or t.shape[dim] % tp:
        raise ShardError(f"{kind}: dim {dim} of shape {tuple(t.shape)} is not divisible by tp={tp}")
    # One copy per chunk: `contiguous().clone()` copied a column chunk twice.
    return [c.clone(memory_format=torch.contiguous_format) for c in torch.chunk(t, tp, dim=dim)]


@dataclass(frozen=True)
class Split:
    """One TP split kind: which dim of a whole tensor is cut into ``tp`` contiguous chunks.

    ``dim`` None: every rank holds the whole tensor. ``whole_below``: tensors of fewer dims than
    this are held whole too (a row-parallel layer cuts its weight's columns, but a 1-D tensor has
    none to cut). ``paired``: the tensor is two dim-0 halves (``[gate; up]``) cut separately, so
    that rank r holds ``[gate_r; up_r]`` and each rank's GLU halves still pair up. ``sections``:
    the same for dim-0 blocks of these sizes (Gated DeltaNet's ``in_proj``, ``[q; k; v; z; b; a]``),
    a kind of its own per list of sizes (:func:`sections_kind`).
    """

    name: str
    dim: int | None = 0
    whole_below: int = 0
    paired: bool = False
    sections: tuple = ()
    section_names: tuple = ()

    def _blocks(self, size: int) -> list[int] | None:
        """The sizes of the blocks cut separately along the cut dim (None: cut as one)."""
        if self.sections:
            if sum(self.sections) != size:
                raise ShardError(f"{self.name}: sections {list(self.sections)} do not add up to {size}")
            return list(self.sections)
        return [size // 2, size // 2] if self.paired else None

    def cut_dim(self, ndim: int) -> int | None:
        """The dim a tensor of ``ndim`` dims is cut along, None when every rank holds it whole."""
        return None if self.dim is None or ndim < self.whole_below else self.dim

    def shard(self, t: torch.Tensor, tp: int) -> list[torch.Tensor]:
        """Full tensor -> ``tp`` per-rank tensors."""
        dim = self.cut_dim(t.dim())
        if dim is None:
            # A replicated tensor's rank 0 is the tensor itself; a row kind's vector was always
            # copied for every rank, and stays so.
            return [t if r == 0 and self.dim is None else t.clone() for r in range(tp)]
        if self.sections:
            cuts = [_chunks(b, tp, dim, self.name) for b in torch.split(t, self._blocks(t.shape[dim]), dim=dim)]
            return [cat([c[r] for c in cuts], dim=dim) for r in range(tp)]
        if self.paired:
            gate, up = _chunks(t, 2, dim, self.name)
            gates, ups = _chunks(gate, tp, dim, self.name), _chunks(up, tp, dim, self.name)
            return [cat([g, u], dim=dim) for g, u in zip(gates, ups)]
        return _chunks(t, tp, dim, self.name)

    def merge(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Per-rank tensors -> full tensor; parts held whole must agree bit for bit."""
        if not parts:
            raise ShardError("no shards to merge")
        dim = self.cut_dim(parts[0].dim())
        if dim is None:
            check_replicated(parts)
            return parts[0].clone(memory_format=torch.contiguous_format)
        return cat(self._ordered(parts, dim), dim=dim)

    def _ordered(self, parts: list[torch.Tensor], dim: int) -> list[torch.Tensor]:
        if self.sections:
            tp = len(parts)
            if any(s % tp for s in self.sections):
                raise ShardError(f"{self.name}: sections {list(self.sections)} do not divide by tp={tp}")
            blocks = [torch.split(p, [s // tp for s in self.sections], dim=dim) for p in parts]
            return [b[i] for i in range(len(self.sections)) for b in blocks]
        if not self.paired:
            return list(parts)
        halves = [torch.chunk(p, 2, dim=dim) for p in parts]
        return [h[0] for h in halves] + [h[1] for h in halves]

    def pieces(self, parts: list[torch.Tensor]) -> list:
        """Pieces whose concatenation along dim 0 is ``merge(parts)``: views of ``parts``, or one
        ``ColumnJoin`` for a tensor cut along dim 1. Parts held whole are not compared here."""
        if not parts:
            raise ShardError("no shards to merge")
        dim = self.cut_dim(parts[0].dim())
        if dim is None:
            return [parts[0]]
        if dim == 1:
            return [ColumnJoin(parts)]
        return self._ordered(parts, dim)

    def slices(self, shape: tuple, tp: int, rank: int) -> list[tuple[int, int, int]]:
        """(dim, start, stop) ranges of the full tensor that rank ``rank`` needs: one per half for a
        paired kind, none when the whole tensor is needed."""
        dim = self.cut_dim(len(shape))
        if dim is None:
            return []
        blocks = self._blocks(shape[dim]) or [shape[dim]]
        starts = [sum(blocks[:i]) for i in range(len(blocks))]
        return [(dim, start + rank * (size // tp), start + (rank + 1) * (size // tp))
                for start, size in zip(starts, blocks)]

    def merged_shape(self, shape: tuple, tp: int) -> tuple:
        """The whole tensor's shape, from one rank's part's."""
        dim = self.cut_dim(len(shape))
        if dim is None or tp == 1 or not shape:
            return shape
        return shape[:dim] + (shape[dim] * tp,) + shape[dim + 1:]


# The names rule tables use. ``qkv`` and ``vocab`` cut like ``column``; they are kinds of their own
# because what must divide differs (whole query groups; a vocabulary the caller pads) and the
# checks that say so find them by name.
KINDS: dict[str, Split] = {s.name: s for s in (
    Split("replicated", dim=None),
    Split("column"),
    Split("row", dim=1, whole_below=2),
    Split("qkv"),
    Split("gated", paired=True),
    Split("vocab"),
)}


SECTIONS = "sections:"


def sections_kind(sizes, names=()) -> str:
    """The kind of a tensor whose dim-0 blocks of ``sizes`` are each cut into ``tp`` chunks, rank r
    holding the r-th chunk of every block in order. ``names``: mcore's dist checkpoint stores each
    block as a tensor of its own, ``<key>.<name>`` (Gated DeltaNet's ``in_proj.weight.query`` …)."""
    return SECTIONS + ",".join(f"{n}={int(s)}" if n else str(int(s)) for s, n in
                               zip(sizes, tuple(names) or ("",) * len(sizes)))


def split_of(kind: str) -> Split:
    if kind.startswith(SECTIONS):
        items = [item.rpartition("=") for item in kind[len(SECTIONS):].split(",")]
        try:
            sizes = tuple(int(size) for _, _, size in items)
        except ValueError:
            raise ShardError(f"TP kind {kind!r}: sections must be integers") from None
        names = tuple(name for name, _, _ in items)
        return Split(kind, sections=sizes, section_names=names if all(names) else ())
    try:
        return KINDS[kind]
    except KeyError:
        raise ShardError(f"unknown TP kind {kind!r}; known: {', '.join(KINDS)}") from None


def shard(t: torch.Tensor, kind: str, tp: int) -> list[torch.Tensor]:
    """Full tensor -> ``tp`` per-rank tensors."""
    return split_of(kind).shard(t, tp)


def merge(parts: list[torch.Tensor], kind: str) -> torch.Tensor:
    """Per-rank tensors -> full tensor; replicated parts must agree bit for bit."""
    return split_of(kind).merge(parts)


def merge_pieces(parts: list[torch.Tensor], kind: str) -> list:
    """:meth:`Split.pieces` of ``kind``: lets a writer put TP parts straight into place instead of
    concatenating them first."""
    return split_of(kind).pieces(parts)


def shard_slices(shape: tuple, kind: str, tp: int, rank: int) -> list[tuple[int, int, int]]:
    """:meth:`Split.slices` of ``kind``: (dim, start, stop) ranges for lazy reads."""
    return split_of(kind).slices(shape, tp, rank)


def axis_split(axis: Axis, kind: str) -> Split:
    """How a tensor of TP split ``kind`` is cut along ``axis`` (a tensor axis)."""
    if axis.splits != "tensors":
        raise AxisError(f"axis {axis.name} splits {axis.splits}, not tensors")
    return split_of(kind)
