"""Tensors handed over as pieces: views of file mappings (and where in the file their bytes are),
cut, routed through row-moving ops and joined without copies."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from mmparity.parallel.tp import as_tensor


class FileRanges:
    """Which file bytes a tensor view shows, for tensors that are views of read-only file mappings.

    A writer that knows a piece is bytes `[offset, offset + n)` of an open file can copy it with
    `copy_file_range` (page cache to page cache inside the kernel) instead of `pwrite` from user
    memory; where writing user memory into the page cache is slow (virtual machines, some
    filesystems) that measured ~3.7 GB/s against ~0.4 GB/s into a new file. A source registers
    each mapping it makes, with a descriptor of the same file, for as long as it lives; `locate`
    answers only for a contiguous tensor lying wholly inside one.
    """

    def __init__(self):
        self._ranges: list[tuple[int, int, int]] = []  # (start address, end address, fd)
        self._kept: list = []

    def add(self, base_address: int, length: int, path: str | os.PathLike, keep=None) -> None:
        """``keep``: what holds the mapping (its tensors), held as long as the range is registered:
        a mapping freed while registered could have its addresses reused by another file's, and
        ``locate`` would then answer with the wrong file."""
        fd = os.open(path, os.O_RDONLY)
        self._ranges.append((base_address, base_address + length, fd))
        if keep is not None:
            self._kept.append(keep)

    def locate(self, piece) -> tuple[int, int] | None:
        """(fd, file offset) of a contiguous CPU tensor inside a registered mapping, else None."""
        if not isinstance(piece, torch.Tensor) or piece.device.type != "cpu" or not piece.is_contiguous():
            return None
        begin = piece.data_ptr()
        end = begin + piece.numel() * piece.element_size()
        for start, stop, fd in self._ranges:
            if start <= begin and end <= stop:
                return fd, begin - start
        return None

    def close(self) -> None:
        for _start, _stop, fd in self._ranges:
            os.close(fd)
        self._ranges = []
        self._kept = []

    def __del__(self):
        self.close()


def mapping_address(mapping) -> int:
    """The address of an mmap object's first byte (where tensors made from it point)."""
    return torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() if len(mapping) else 0


def route_pieces(op_on_one_input, pieces: Sequence, shape: tuple, dtype: torch.dtype) -> list[list] | None:
    """The outputs of a one-input layout op as pieces of `pieces` (the input, joined along dim 0),
    when the op only selects blocks of whole rows; None when it does anything else.

    The op runs once on a meta tensor of the input's shape: each output view's storage offset and
    shape say which rows it takes, and those rows are cut from `pieces` without joining them.
    """
    if not len(shape):
        return None
    probe = torch.empty(tuple(shape), dtype=dtype, device="meta")
    try:
        outputs = op_on_one_input([probe])
    except Exception:
        return None
    row = math.prod(shape[1:]) if len(shape) else 1
    routed_outputs = []
    for output in outputs:
        routed = []
        for view in output:
            if (not isinstance(view, torch.Tensor) or not view.is_meta or view.dim() != len(shape)
                    or view.untyped_storage()._cdata != probe.untyped_storage()._cdata
                    or not view.is_contiguous() or tuple(view.shape[1:]) != tuple(shape[1:])
                    or not row or view.storage_offset() % row):
                return None
            first = view.storage_offset() // row
            routed += narrow_pieces(pieces, 0, first, first + view.shape[0])
        routed_outputs.append(routed)
    return routed_outputs


def joined(pieces: Sequence) -> torch.Tensor:
    """`pieces` as one tensor (a copy unless there is a single plain piece)."""
    tensors = [as_tensor(p) for p in pieces]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def narrow_pieces(pieces: Sequence[torch.Tensor], dim: int, start: int, stop: int) -> list[torch.Tensor]:
    """Views of `start:stop` along `dim` of the tensor that `pieces` form when joined along dim 0."""
    if dim != 0:
        return [p.narrow(dim, start, stop - start) for p in pieces]
    views, offset = [], 0
    for piece in pieces:
        rows = piece.shape[0] if piece.dim() else 1
        lo, hi = max(start, offset), min(stop, offset + rows)
        if lo < hi:
            views.append(piece.narrow(0, lo - offset, hi - lo))
        offset += rows
    return views
