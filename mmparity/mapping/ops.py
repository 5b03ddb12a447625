"""Layout operations between HF and mcore tensors; every op carries its exact inverse.

``apply`` maps the HF-side tensors of one rule to its mcore-side tensors; ``invert`` maps them
back. Both only view, permute, split and concatenate, so a round trip is bit-exact in any dtype.
Outputs never alias their inputs (checkpoint writers refuse tensors that share storage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from mmparity.errors import ConversionError
from mmparity.parallel.tp import cat

Tensors = list[torch.Tensor]


class LayoutError(ValueError):
    """A tensor does not have the shape an op needs; the message names the op and the shapes."""


class AmbiguousLayout(ConversionError):
    """The stored tensors fit more than one layout of the family, and the reading transformers
    would do is not the files' own: a refusal no other reading of the files may override."""


def _own(t: torch.Tensor, inputs: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """`t` as a tensor owning exactly its bytes and sharing none of `inputs`' memory.

    Copies only when it has to: the result of `cat` or of a non-viewable reshape already is such
    a tensor, and a second copy of every converted byte was a measurable part of convert's time.
    """
    if not t.numel():
        return t.clone()
    compact = t.contiguous()
    if compact is not t:
        return compact  # `contiguous` made a fresh, exact copy
    storage = t.untyped_storage()
    if storage.nbytes() == t.numel() * t.element_size() and not any(
            x.numel() and x.untyped_storage().data_ptr() == storage.data_ptr() for x in inputs):
        return t
    return t.clone()


def _shapes(ts: Sequence[torch.Tensor]) -> str:
    return ", ".join(str(tuple(t.shape)) for t in ts)


class Op:
    n_hf = 1
    n_mcore = 1

    def apply(self, hf: Tensors) -> Tensors:
        raise NotImplementedError

    def invert(self, mcore: Tensors) -> Tensors:
        raise NotImplementedError

    # The *_pieces forms give each output as consecutive dim-0 pieces (views of the inputs where
    # the op only reorders row blocks) instead of one joined tensor: a writer can put the pieces
    # straight into place, skipping a copy of every byte. Joined with torch.cat they are exactly
    # `apply` / `invert`.

    def apply_pieces(self, hf: Tensors) -> list[Tensors]:
        return [[t] for t in self.apply(hf)]

    def invert_pieces(self, mcore: Tensors) -> list[Tensors]:
        return [[t] for t in self.invert(mcore)]

    def at_tp(self, tp: int, vocab_multiple: int) -> "Op":
        """The op for a conversion to ``tp`` ranks whose vocabularies are padded to multiples of
        ``vocab_multiple × tp`` (Megatron-LM's rule); most ops do not depend on either."""
        return self

    def __repr__(self) -> str:
        return type(self).__name__


@dataclass(frozen=True, repr=False)
class Identity(Op):
    def apply(self, hf):
        return [_own(hf[0], hf)]

    def invert(self, mcore):
        return [_own(mcore[0], mcore)]

    def apply_pieces(self, hf):
        return [[hf[0]]]

    def invert_pieces(self, mcore):
        return [[mcore[0]]]


@dataclass(frozen=True, repr=False)
class Reshape(Op):
    """A pure reshape, e.g. a Conv weight seen as a Linear one. ``mcore_shape`` may use -1."""

    hf_shape: tuple
    mcore_shape: tuple

    def apply(self, hf):
        return [_own(_reshape(hf[0], self.mcore_shape, self), hf)]

    def invert(self, mcore):
        return [_own(_reshape(mcore[0], self.hf_shape, self), mcore)]

    def apply_pieces(self, hf):
        return [[_reshape(hf[0], self.mcore_shape, self)]]

    def invert_pieces(self, mcore):
        return [[_reshape(mcore[0], self.hf_shape, self)]]


def _reshape(t, shape, op):
    try:
        return t.reshape(shape)
    except RuntimeError as exc:
        raise LayoutError(f"{op!r}: cannot reshape {tuple(t.shape)} to {shape}") from exc


@dataclass(frozen=True, repr=False)
class RopeInterleave(Op):
    """Undo HF's per-head rotate-half permutation of q/k rows (weights or biases).

    HF conversion scripts move row 2t of each head to t and row 2t+1 to hd/2 + t, so that
    rotate-half RoPE equals the original interleaved (complex-pair) RoPE. mcore with
    ``rotary_interleaved=True`` wants the original order back.
    """

    num_heads: int
    head_dim: int

    def _check(self, t):
        if t.shape[0] != self.num_heads * self.head_dim or self.head_dim % 2:
            raise LayoutError(f"{self!r}: expected leading dim {self.num_heads}x{self.head_dim}, "
                              f"got {tuple(t.shape)}")

    def apply(self, hf):
        t = hf[0]
        self._check(t)
        rest = t.shape[1:]
        halves = t.reshape(self.num_heads, 2, self.head_dim // 2, *rest)
        return [_own(halves.transpose(1, 2).reshape(t.shape), hf)]

    def invert(self, mcore):
        t = mcore[0]
        self._check(t)
        rest = t.shape[1:]
        pairs = t.reshape(self.num_heads, self.head_dim // 2, 2, *rest)
        return [_own(pairs.transpose(1, 2).reshape(t.shape), mcore)]

    def __repr__(self):
        return f"RopeInterleave(heads={self.num_heads}, head_dim={self.head_dim})"


@dataclass(frozen=True, repr=False)
class RopeHalve(RopeInterleave):
    """Original interleaved (complex-pair) q/k rows -> rotate-half order: what HF's conversion
    scripts do to Mistral-native weights, for an mcore model running rotate-half RoPE (the
    language model). Exactly :class:`RopeInterleave` backwards."""

    def apply(self, hf):
        return RopeInterleave.invert(self, hf)

    def invert(self, mcore):
        return RopeInterleave.apply(self, mcore)

    def __repr__(self):
        return f"RopeHalve(heads={self.num_heads}, head_dim={self.head_dim})"


@dataclass(frozen=True, repr=False)
class AxialRopeHalves(Op):
    """Per-axis rotate-half q/k rows (each half of a head rotated within itself: the first half by
    one axis, the second by the other, as Gemma 4's vision tower does) <-> whole-head rotate-half
    order (mcore with ``rotary_interleaved=False``, the angles laid out ``[a, b, a, b]``).

    Rows of a head in quarters ``[A, B, C, D]``: HF rotates pairs (A, B) and (C, D); mcore rotates
    (row j, row j + hd/2), so it wants ``[A, C, B, D]``. Swapping the middle quarters is its own
    inverse. Norm weights over one head (``q_norm``) take it with ``num_heads=1``.
    """

    num_heads: int
    head_dim: int

    def _swap(self, t):
        if t.shape[0] != self.num_heads * self.head_dim or self.head_dim % 4:
            raise LayoutError(f"{self!r}: expected leading dim {self.num_heads}x{self.head_dim} "
                              f"(head_dim a multiple of 4), got {tuple(t.shape)}")
        rest = t.shape[1:]
        quarters = t.reshape(self.num_heads, 4, self.head_dim // 4, *rest)
        return quarters[:, [0, 2, 1, 3]].reshape(t.shape)

    def apply(self, hf):
        return [_own(self._swap(hf[0]), hf)]

    def invert(self, mcore):
        return [_own(self._swap(mcore[0]), mcore)]

    def __repr__(self):
        return f"AxialRopeHalves(heads={self.num_heads}, head_dim={self.head_dim})"


@dataclass(frozen=True, repr=False)
class FuseQKV(Op):
    """Separate q, k, v (weights or biases) -> mcore ``linear_qkv`` in per-query-group order.

    mcore rows are ``[q heads of group g…, k_g, v_g]`` for g = 0..groups-1, so that a tensor-parallel
    rank's contiguous row slice holds whole query groups. ``pre`` ops (e.g. RopeInterleave) run on
    q, k, v individually before fusing.
    """

    num_heads: int
    num_groups: int
    head_dim: int
    pre: tuple = (None, None, None)
    n_hf = 3

    def apply(self, hf):
        q, k, v = (op.apply([t])[0] if op else t for op, t in zip(self.pre, hf))
        g, per, d = self.num_groups, self.num_heads // self.num_groups, self.head_dim
        expect = (self.num_heads * d, g * d, g * d)
        if tuple(t.shape[0] for t in (q, k, v)) != expect or self.num_heads % g:
            raise LayoutError(f"{self!r}: q/k/v leading dims must be {expect}, got {_shapes((q, k, v))}")
        rest = q.shape[1:]
        fused = cat([q.reshape(g, per, d, *rest), k.reshape(g, 1, d, *rest),
                           v.reshape(g, 1, d, *rest)], dim=1)
        return [_own(fused.reshape(-1, *rest), hf)]

    def apply_pieces(self, hf):
        if any(self.pre):
            return super().apply_pieces(hf)
        q, k, v = hf
        g, per, d = self.num_groups, self.num_heads // self.num_groups, self.head_dim
        expect = (self.num_heads * d, g * d, g * d)
        if tuple(t.shape[0] for t in (q, k, v)) != expect or self.num_heads % g:
            raise LayoutError(f"{self!r}: q/k/v leading dims must be {expect}, got {_shapes((q, k, v))}")
        pieces = []
        for group in range(g):
            pieces += [q[group * per * d:(group + 1) * per * d], k[group * d:(group + 1) * d],
                       v[group * d:(group + 1) * d]]
        return [pieces]

    def invert(self, mcore):
        t = mcore[0]
        g, per, d = self.num_groups, self.num_heads // self.num_groups, self.head_dim
        if t.shape[0] != (self.num_heads + 2 * g) * d:
            raise LayoutError(f"{self!r}: linear_qkv leading dim must be {(self.num_heads + 2 * g) * d}, "
                              f"got {tuple(t.shape)}")
        rest = t.shape[1:]
        grouped = t.reshape(g, per + 2, d, *rest)
        q = grouped[:, :per].reshape(-1, *rest)
        k = grouped[:, per].reshape(-1, *rest)
        v = grouped[:, per + 1].reshape(-1, *rest)
        return [_own(op.invert([x])[0] if op else x, mcore) for op, x in zip(self.pre, (q, k, v))]

    def invert_pieces(self, mcore):
        if any(self.pre):
            return super().invert_pieces(mcore)
        t = mcore[0]
        g, per, d = self.num_groups, self.num_heads // self.num_groups, self.head_dim
        if t.shape[0] != (self.num_heads + 2 * g) * d:
            raise LayoutError(f"{self!r}: linear_qkv leading dim must be {(self.num_heads + 2 * g) * d}, "
                              f"got {tuple(t.shape)}")
        block = (per + 2) * d
        q = [t[group * block:group * block + per * d] for group in range(g)]
        k = [t[group * block + per * d:group * block + (per + 1) * d] for group in range(g)]
        v = [t[group * block + (per + 1) * d:(group + 1) * block] for group in range(g)]
        return [q, k, v]

    def __repr__(self):
        return f"FuseQKV(heads={self.num_heads}, groups={self.num_groups}, head_dim={self.head_dim})"


@dataclass(frozen=True, repr=False)
class RegroupQKV(Op):
    """HF fused ``[q; k; v]`` rows (Qwen ``qkv``, Kimi ``wqkv``) -> mcore per-query-group order."""

    num_heads: int
    num_groups: int
    head_dim: int
    pre: tuple = (None, None, None)

    @property
    def _fuse(self):
        return FuseQKV(self.num_heads, self.num_groups, self.head_dim, self.pre)

    def _split(self, t):
        """HF's fused rows -> the q, k, v row blocks (views)."""
        sizes = [self.num_heads * self.head_dim, self.num_groups * self.head_dim,
                 self.num_groups * self.head_dim]
        if t.shape[0] != sum(sizes):
            raise LayoutError(f"{self!r}: fused qkv leading dim must be {sum(sizes)}, got {tuple(t.shape)}")
        return list(torch.split(t, sizes, dim=0))

    def apply(self, hf):
        return self._fuse.apply(self._split(hf[0]))

    def invert(self, mcore):
        return [_own(cat(self._fuse.invert(mcore), dim=0), mcore)]

    def apply_pieces(self, hf):
        return self._fuse.apply_pieces(self._split(hf[0]))

    def invert_pieces(self, mcore):
        if any(self.pre):
            return super().invert_pieces(mcore)
        q, k, v = self._fuse.invert_pieces(mcore)
        return [q + k + v]

    def __repr__(self):
        return f"RegroupQKV(heads={self.num_heads}, groups={self.num_groups}, head_dim={self.head_dim})"


@dataclass(frozen=True, repr=False)
class Concat(Op):
    """Several HF tensors stacked along ``dim`` into one mcore tensor, e.g. gated FC1 = [gate; up]."""

    n_hf: int = 2
    dim: int = 0

    def apply(self, hf):
        if len({t.shape[self.dim] for t in hf}) != 1:
            raise LayoutError(f"{self!r}: parts must have equal size along dim {self.dim}, got {_shapes(hf)}")
        return [_own(cat(hf, dim=self.dim), hf)]

    def invert(self, mcore):
        t = mcore[0]
        if t.shape[self.dim] % self.n_hf:
            raise LayoutError(f"{self!r}: dim {self.dim} of {tuple(t.shape)} does not split in {self.n_hf}")
        return [_own(x, mcore) for x in torch.chunk(t, self.n_hf, dim=self.dim)]

    def apply_pieces(self, hf):
        if self.dim != 0:
            return super().apply_pieces(hf)
        if len({t.shape[self.dim] for t in hf}) != 1:
            raise LayoutError(f"{self!r}: parts must have equal size along dim {self.dim}, got {_shapes(hf)}")
        return [list(hf)]

    def invert_pieces(self, mcore):
        t = mcore[0]
        if self.dim != 0:
            return super().invert_pieces(mcore)
        if t.shape[self.dim] % self.n_hf:
            raise LayoutError(f"{self!r}: dim {self.dim} of {tuple(t.shape)} does not split in {self.n_hf}")
        return [[x] for x in torch.chunk(t, self.n_hf, dim=0)]

    def __repr__(self):
        return f"Concat(n={self.n_hf}, dim={self.dim})"


@dataclass(frozen=True, repr=False)
class Unstack(Op):
    """One HF tensor holding a stack of ``count`` along dim 0 (transformers' fused experts,
    ``[experts, rows, cols]``) <-> ``count`` mcore tensors, one per entry (one per expert)."""

    count: int

    @property
    def n_mcore(self) -> int:
        return self.count

    def _check(self, t):
        if t.dim() < 2 or t.shape[0] != self.count:
            raise LayoutError(f"{self!r}: expected a stack of {self.count} along dim 0, got {tuple(t.shape)}")

    def apply(self, hf):
        self._check(hf[0])
        return [_own(hf[0][j], hf) for j in range(self.count)]

    def apply_pieces(self, hf):
        self._check(hf[0])
        return [[hf[0][j]] for j in range(self.count)]

    def invert(self, mcore):
        if len(mcore) != self.count or len({tuple(t.shape) for t in mcore}) != 1:
            raise LayoutError(f"{self!r}: expected {self.count} tensors of one shape, got {_shapes(mcore)}")
        return [_own(cat([t.unsqueeze(0) for t in mcore], dim=0), mcore)]

    def __repr__(self):
        return f"Unstack(count={self.count})"


@dataclass(frozen=True, repr=False)
class UnstackTransposed(Op):
    """One HF tensor holding a stack of ``count`` transposed matrices (``[experts, cols, rows]``,
    as Qwen's MoE releases store fused experts) <-> ``count`` mcore tensors ``[rows, cols]``.
    Not an :class:`Unstack`: an entry of the stack is not an mcore tensor's rows."""

    count: int

    @property
    def n_mcore(self) -> int:
        return self.count

    def apply(self, hf):
        t = hf[0]
        if t.dim() != 3 or t.shape[0] != self.count:
            raise LayoutError(f"{self!r}: expected a stack of {self.count} matrices, got {tuple(t.shape)}")
        return [_own(t[j].transpose(0, 1), hf) for j in range(self.count)]

    def invert(self, mcore):
        if len(mcore) != self.count or len({tuple(t.shape) for t in mcore}) != 1 or mcore[0].dim() != 2:
            raise LayoutError(f"{self!r}: expected {self.count} matrices of one shape, got {_shapes(mcore)}")
        return [_own(cat([t.transpose(0, 1).unsqueeze(0) for t in mcore], dim=0), mcore)]

    def __repr__(self):
        return f"UnstackTransposed(count={self.count})"


@dataclass(frozen=True, repr=False)
class Transpose(Op):
    """A matrix HF stores (in, out) and multiplies from the right <-> a Linear's (out, in) weight
    (Gemma 3's ``mm_input_projection_weight``); its own inverse."""

    def apply(self, hf):
        return [_own(_matrix(hf[0], self).transpose(0, 1), hf)]

    def invert(self, mcore):
        return [_own(_matrix(mcore[0], self).transpose(0, 1), mcore)]


def _matrix(t, op):
    if t.dim() != 2:
        raise LayoutError(f"{op!r}: expected a matrix, got {tuple(t.shape)}")
    return t


def fuse_gate_up() -> Concat:
    """HF ``gate_proj``/``up_proj`` -> mcore ``linear_fc1`` = [gate; up] (activation on the first half)."""
    return Concat(n_hf=2, dim=0)


# Megatron-LM pads a vocabulary to a multiple of its divisor (128 by default) times TP: a few
# thousand rows in any run, and never more than the vocabulary itself plus this many.
MAX_EXTRA_PAD_ROWS = 2**16


@dataclass(frozen=True, repr=False)
class PadRows(Op):
    """A table of ``rows`` rows (an embedding or output vocabulary) -> ``padded`` rows, zeros appended.

    mcore splits vocabularies evenly across tensor-parallel ranks, so the native table is padded
    past the HF vocabulary. The inverse trims back to ``rows`` and accepts any padded length, since
    a checkpoint trained elsewhere may have padded to another multiple; what the trimmed rows held
    is not part of the HF model.
    """

    rows: int
    padded: int

    def __post_init__(self):
        if self.padded < self.rows:
            raise ValueError(f"{self!r}: padded size is smaller than the table")

    def apply(self, hf):
        t = hf[0]
        if t.shape[0] != self.rows:
            raise LayoutError(f"{self!r}: expected {self.rows} rows, got {tuple(t.shape)}")
        out = t.new_zeros((self.padded, *t.shape[1:]))
        out[: self.rows] = t
        return [out]

    def invert(self, mcore):
        t = mcore[0]
        if t.shape[0] < self.rows:
            raise LayoutError(f"{self!r}: a padded table needs at least {self.rows} rows, "
                              f"got {tuple(t.shape)}")
        return [_own(t[: self.rows], mcore)]

    def apply_pieces(self, hf):
        # The table as it is, then the zero rows: the writer puts the table's rows in place
        # without the padded copy (only the padding is new memory).
        t = hf[0]
        if t.shape[0] != self.rows:
            raise LayoutError(f"{self!r}: expected {self.rows} rows, got {tuple(t.shape)}")
        return [self.pad_pieces([t])]

    def pad_pieces(self, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The table's ``rows`` rows given as consecutive dim-0 pieces (TP parts, say), followed
        by the zero rows as a piece of their own: nothing of the table is copied."""
        if self.padded == self.rows:
            return list(pieces)
        last = pieces[-1]
        return [*pieces, last.new_zeros((self.padded - self.rows, *last.shape[1:]))]

    def invert_pieces(self, mcore):
        # The first ``rows`` rows, a view: a TP-merged table goes out from its parts, not joined.
        t = mcore[0]
        if t.shape[0] < self.rows:
            raise LayoutError(f"{self!r}: a padded table needs at least {self.rows} rows, "
                              f"got {tuple(t.shape)}")
        return [[t[: self.rows]]]

    def at_tp(self, tp: int, vocab_multiple: int) -> "PadRows":
        step = vocab_multiple * tp
        return PadRows(self.rows, -(-self.rows // step) * step)

    @property
    def excessive(self) -> bool:
        """Padded past any divisor Megatron-LM is run with: more than twice the table plus
        ``MAX_EXTRA_PAD_ROWS``. What it asks for is zero rows by the hundred million (a divisor
        typed with too many digits), not a layout."""
        return self.padded > 2 * self.rows + MAX_EXTRA_PAD_ROWS

    def __repr__(self):
        return f"PadRows(rows={self.rows}, padded={self.padded})"


@dataclass(frozen=True, repr=False)
class TiedPadRows(PadRows):
    """A tied vocabulary table a state dict names twice (the embedding, then the head: one tensor in
    transformers' ``state_dict()`` of a tied model) <-> the one padded mcore table. Import reads the
    first name, as the layouts that drop a tied head do (the second is the same tensor in any state
    dict of a tied model); export writes the table under both names, separate copies."""

    n_hf = 2

    def _tied(self, hf) -> torch.Tensor:
        table, head = hf
        if table.shape != head.shape:
            raise LayoutError(f"{self!r}: the head {tuple(head.shape)} is not the embedding's shape "
                              f"{tuple(table.shape)}")
        return table

    def apply(self, hf):
        return super().apply([self._tied(hf)])

    def apply_pieces(self, hf):
        return super().apply_pieces([self._tied(hf)])

    def invert(self, mcore):
        (table,) = super().invert(mcore)
        return [table, table.clone()]

    def invert_pieces(self, mcore):
        (table,) = super().invert(mcore)
        return [[table], [table.clone()]]

    def at_tp(self, tp: int, vocab_multiple: int) -> "TiedPadRows":
        padded = super().at_tp(tp, vocab_multiple)
        return TiedPadRows(padded.rows, padded.padded)

    def __repr__(self):
        return f"TiedPadRows(rows={self.rows}, padded={self.padded})"
