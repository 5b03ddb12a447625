"""Tensor-parallel shard / merge, kept apart from names and layouts.

Kinds (what mcore's layers expect on rank r of ``tp``):

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

import torch

KINDS = ("replicated", "column", "row", "qkv", "gated", "vocab")


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


def _split(t: torch.Tensor, tp: int, dim: int, kind: str) -> list[torch.Tensor]:
    if t.dim() <= dim or t.shape[dim] % tp:
        raise ShardError(f"{kind}: dim {dim} of shape {tuple(t.shape)} is not divisible by tp={tp}")
    # One copy per chunk: `contiguous().clone()` copied a column chunk twice.
    return [c.clone(memory_format=torch.contiguous_format) for c in torch.chunk(t, tp, dim=dim)]


def shard(t: torch.Tensor, kind: str, tp: int) -> list[torch.Tensor]:
    """Full tensor -> ``tp`` per-rank tensors."""
    if kind == "replicated":
        return [t if r == 0 else t.clone() for r in range(tp)]
    if kind in ("column", "qkv", "vocab"):
        return _split(t, tp, 0, kind)
    if kind == "row":
        return _split(t, tp, 1 if t.dim() > 1 else 0, kind) if t.dim() > 1 else [t.clone() for _ in range(tp)]
    if kind == "gated":
        gate, up = _split(t, 2, 0, kind)
        gates, ups = _split(gate, tp, 0, kind), _split(up, tp, 0, kind)
        return [cat([g, u], dim=0) for g, u in zip(gates, ups)]
    raise ShardError(f"unknown TP kind {kind!r}; known: {', '.join(KINDS)}")


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


def merge(parts: list[torch.Tensor], kind: str) -> torch.Tensor:
    """Per-rank tensors -> full tensor; replicated parts must agree bit for bit."""
    if not parts:
        raise ShardError("no shards to merge")
    if kind == "replicated":
        check_replicated(parts)
        return parts[0].clone(memory_format=torch.contiguous_format)
    if kind in ("column", "qkv", "vocab"):
        return cat(parts, dim=0)
    if kind == "row":
        return cat(parts, dim=1) if parts[0].dim() > 1 else merge(parts, "replicated")
    if kind == "gated":
        halves = [torch.chunk(p, 2, dim=0) for p in parts]
        return cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    raise ShardError(f"unknown TP kind {kind!r}; known: {', '.join(KINDS)}")


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


def merge_pieces(parts: list[torch.Tensor], kind: str) -> list:
    """Pieces whose concatenation along dim 0 is ``merge(parts, kind)``: views of ``parts``, or one
    ``ColumnJoin`` for a row-parallel matrix. Lets a writer put TP parts straight into place
    instead of concatenating them first. Replicated parts are not compared here."""
    if not parts:
        raise ShardError("no shards to merge")
    if kind == "replicated" or (kind == "row" and parts[0].dim() <= 1):
        return [parts[0]]
    if kind in ("column", "qkv", "vocab"):
        return list(parts)
    if kind == "gated":
        halves = [torch.chunk(p, 2, dim=0) for p in parts]
        return [h[0] for h in halves] + [h[1] for h in halves]
    if kind == "row":
        return [ColumnJoin(parts)]
    raise ShardError(f"unknown TP kind {kind!r}; known: {', '.join(KINDS)}")


def shard_slices(shape: tuple, kind: str, tp: int, rank: int) -> list[tuple[int, int, int]]:
    """(dim, start, stop) ranges of the full tensor that rank ``rank`` needs, for lazy reads.

    ``gated`` needs two ranges (its gate part and its up part); the others one, or none when the
    whole tensor is needed.
    """
    if kind == "replicated" or (kind == "row" and len(shape) == 1):
        return []
    dim = 1 if kind == "row" else 0
    if kind == "gated":
        half = shape[0] // 2
        step = half // tp
        return [(0, rank * step, (rank + 1) * step), (0, half + rank * step, half + (rank + 1) * step)]
    step = shape[dim] // tp
    return [(dim, rank * step, (rank + 1) * step)]
