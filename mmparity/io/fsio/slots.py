"""Writing into files laid out in advance: each tensor (or its pieces) to the byte range reserved
for it, hashed as it goes; and `torch.save` skeletons without their CRC pass."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy
import torch

from mmparity.io.fsio import faults
from mmparity.io.fsio.checksums import PieceHasher, TensorChecksum
from mmparity.io.fsio.dtypes import dtype_name
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.syscalls import copy_file_range_all, prefault, pwrite_all, start_writeback
from mmparity.parallel.tp import ColumnJoin


@dataclasses.dataclass(frozen=True, slots=True)  # one per tensor of a file being written
class Slot:
    """Where one tensor's bytes go: file number, absolute offset, and what must arrive there."""

    file: int
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple
    # Bytes of the container written right before and after the tensor's (not hashed): a writer
    # that frames every tensor (DCP's torch.save blobs) then writes each blob in one sequential go.
    head: bytes = b""
    tail: bytes = b""


def _label(name) -> str:
    """A slot's name for a message (legacy and torch_dist slots are named by tuples: ranks and key, key and offsets)."""
    return name if isinstance(name, str) else " ".join(map(str, name))


_ROW_BLOCK_BYTES = 1 << 20  # a row-run block gathered for one write


def _row_bytes(piece: torch.Tensor):
    """A 2-D view whose rows are contiguous runs (a column range of a C-order matrix, or any
    contiguous matrix) as a numpy (rows, row bytes) array of uint8, or None for any other layout."""
    if piece.dim() != 2 or piece.stride(1) != 1 or piece.stride(0) < piece.shape[1] or not piece.numel():
        return None
    return piece.detach().cpu().view(torch.uint8).numpy()


def _writable(piece):
    """`piece` as the writer takes it: contiguous, row runs, or a ColumnJoin of row runs; anything
    else is copied here, on the producer's thread, so that the worker only moves bytes."""
    if isinstance(piece, ColumnJoin):
        return ColumnJoin([p if _row_bytes(p) is not None else p.contiguous() for p in piece.parts])
    return piece if piece.is_contiguous() or _row_bytes(piece) is not None else piece.contiguous()


_GATHER_BYTES = 1 << 20  # a tensor of many pieces up to this size is gathered into one buffer


def _gathered(pieces: list, nbytes: int) -> list:
    """Many small pieces of one tensor (a fused bias or projection split per head) as one buffer.

    Each piece costs the writer a system call, a hash update and a hand-off of the interpreter's
    lock between threads; a QKV bias interleaved per head is 48 pieces of 144 bytes. Gathered, on
    the producer's thread, they cost one of each and a copy in memory: a TP 1 legacy write of the
    0.9 GB tower (1296 such pieces of 2871) took 0.64-0.66 s instead of 0.68-0.72 s. Larger tensors
    are not gathered: a fresh buffer of each QKV weight (8 MB) made the same job 0.79-1.22 s.
    """
    if len(pieces) < 2 or nbytes > _GATHER_BYTES or not all(isinstance(p, torch.Tensor) for p in pieces):
        return pieces
    # As bytes: torch.cat need not know every dtype a checkpoint holds (float8, packed quantized).
    dtype = pieces[0].dtype
    return [torch.cat([p.reshape(-1).view(torch.uint8) for p in pieces]).view(dtype)]


class SlotWriter:
    """Tensors written straight to byte ranges reserved for them in already created files.

    A format whose layout can be fixed before any tensor exists (safetensors headers computed from
    a dry run, a `torch.save` skeleton written under `skip_data`) needs no buffering: each tensor is
    `pwrite`-n to its slot and dropped, and a tensor may arrive as consecutive *pieces* of its
    C-order bytes (TP parts, gated halves), which go to consecutive offsets without being
    concatenated first. Two worker threads write and hash (pwrite and xxh3 release the GIL) while
    the caller produces the next tensor; at most `max_inflight` tensors wait for them, so memory
    holds a few tensors, never a file. A file is fsynced as soon as its last slot is written,
    while later files are still being produced.

    `fds` are owned: closed when complete, on `close()` or on `abort()`. A None in `fds` is a file
    of the layout that this writer does not write (another process does): no slot may lie in it.
    """

    WORKERS = 2

    def __init__(self, directory: Path, fds: list[int], slots: Mapping[str, Slot], *, max_inflight: int = 4,
                 locate=None):
        self.directory = Path(directory)
        self._fds: list[int | None] = list(fds)
        self.slots = dict(slots)
        self._remaining = [0] * len(fds)
        for slot in self.slots.values():
            self._remaining[slot.file] += 1
        self._pool = None
        self._inflight: collections.deque = collections.deque()
        self._max_inflight = max_inflight
        self._locate = locate  # piece -> (fd, offset) of the file bytes it shows, or None
        self._lock = threading.Lock()
        # One writer at a time per file. A filesystem serialises buffered writes to one file on the
        # inode's lock (ext4's i_rwsem), and a writer kept waiting there spins on a CPU while the
        # other copies; waiting on this lock sleeps instead, and hashes its piece meanwhile.
        self._file_locks = [threading.Lock() for _ in fds]
        self.checksums: dict[str, TensorChecksum] = {}
        for number, remaining in enumerate(self._remaining):
            if remaining == 0:
                self._finish_file(number)

    def write(self, name: str, pieces: torch.Tensor | Sequence[torch.Tensor]) -> None:
        slot = self.slots.get(name)
        if slot is None:
            raise CheckpointError(f"{self.directory}: tensor {_label(name)!r} "
                                  + ("written twice" if name in self.slots else "was not announced"))
        pieces = [pieces] if isinstance(pieces, (torch.Tensor, ColumnJoin)) else list(pieces)
        pieces = [p if isinstance(p, ColumnJoin) else p.detach().cpu() for p in pieces]
        numel = sum(p.numel() for p in pieces)
        shapes_fit = (len(pieces) == 1 and tuple(pieces[0].shape) == slot.shape) or (
            len(pieces) > 1 and numel == math.prod(slot.shape))
        if any(p.dtype != slot.dtype for p in pieces) or not shapes_fit:
            got = [f"{dtype_name(p.dtype)} {list(p.shape)}" for p in pieces]
            raise CheckpointError(f"{_label(name)}: announced as {dtype_name(slot.dtype)} {list(slot.shape)}, "
                                  f"got {', '.join(got)}")
        # A written slot is let go (its name stays, marking it written): its frame bytes and shape
        # need not live until the checkpoint is finished.
        self.slots[name] = None
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            # Two writers: where one thread's pwrite into the page cache swings from run to run
            # (2-5 GB/s in docs/convert.md's measurements), two hold a steady ~4.8 GB/s.
            self._pool = ThreadPoolExecutor(max_workers=self.WORKERS, thread_name_prefix="mmparity-writer")
        # A column range of a matrix (a row-parallel TP part) is written row by row from where it
        # is; any other non-contiguous piece is copied here, on the producer's thread.
        pieces = _gathered([_writable(p) for p in pieces], slot.nbytes)
        self._inflight.append(self._pool.submit(self._write_one, name, slot, pieces))
        while len(self._inflight) > self._max_inflight:
            self._inflight.popleft().result()
        faults.fault_point("tensor")

    def _write_one(self, name: str, slot: Slot, pieces: list) -> None:
        hasher = PieceHasher(slot.dtype, slot.shape)
        located = [self._locate(p) if self._locate is not None and isinstance(p, torch.Tensor) and p.numel()
                   and p.is_contiguous() else None for p in pieces]
        # What the kernel copies file to file needs no page table entries of ours: the hash alone
        # reads it, and its faults map 16 pages each. Populating such pieces first cost 4-5% of a
        # torch_dist -> hf wall time (benchmarks/convert_throughput.py's tower, 0.72 -> 0.69 s).
        prefault(q for p, found in zip(pieces, located) if found is None
                 for q in (p.parts if isinstance(p, ColumnJoin) else [p]))
        offset = slot.offset
        fd = self._fds[slot.file]
        lock = self._file_locks[slot.file]
        if slot.head:
            with lock:
                pwrite_all(fd, slot.head, offset - len(slot.head))
        for piece, found in zip(pieces, located):
            if not piece.numel():
                continue
            if isinstance(piece, torch.Tensor) and piece.is_contiguous():
                data = piece.reshape(-1).view(torch.uint8).numpy()
                with lock:
                    if found is not None:
                        copy_file_range_all(found[0], found[1], fd, offset, data.nbytes)
                    else:
                        pwrite_all(fd, data, offset)
                hasher.update_bytes(data)
                offset += data.nbytes
                continue
            # Row runs: of one column range, or of every part of a ColumnJoin side by side. A block
            # of rows is gathered into one buffer (numpy's copy, in C) and written and hashed in
            # one go: a call per row cost more CPU than the copy (a TP 2 legacy write spent a
            # quarter of its CPU in Python); the buffer is at most _ROW_BLOCK_BYTES.
            parts = [_row_bytes(p) for p in (piece.parts if isinstance(piece, ColumnJoin) else [piece]) if p.numel()]
            rows = parts[0].shape[0]
            step = max(1, _ROW_BLOCK_BYTES // sum(part.shape[1] for part in parts))
            for first in range(0, rows, step):
                block = [part[first:first + step] for part in parts]
                block = numpy.ascontiguousarray(block[0]) if len(block) == 1 else numpy.concatenate(block, axis=1)
                with lock:
                    pwrite_all(fd, block, offset)
                hasher.update_bytes(block)
                offset += block.nbytes
        if slot.tail:
            with lock:
                pwrite_all(fd, slot.tail, slot.offset + slot.nbytes)
        start_writeback(fd, slot.offset - len(slot.head), len(slot.head) + slot.nbytes + len(slot.tail))
        self.checksums[name] = hasher.result()
        with self._lock:
            self._remaining[slot.file] -= 1
            finished = self._remaining[slot.file] == 0
        if finished:
            self._finish_file(slot.file)

    def _finish_file(self, number: int) -> None:
        if self._fds[number] is None:  # a file another process writes (several writing one checkpoint)
            return
        os.fsync(self._fds[number])
        os.close(self._fds[number])
        self._fds[number] = None

    def close(self) -> None:
        """Waits for the worker and checks that every announced slot was written."""
        try:
            while self._inflight:
                self._inflight.popleft().result()
        except BaseException:
            self.abort()
            raise
        missing = sorted(name for name, slot in self.slots.items() if slot is not None)
        self.abort()
        if missing:
            raise CheckpointError(f"{self.directory}: {len(missing)} announced tensor(s) never written, "
                                  f"e.g. {', '.join(map(_label, missing[:4]))}")

    def abort(self) -> None:
        for future in self._inflight:
            future.cancel()
        for future in self._inflight:
            if not future.cancelled():
                future.exception()  # wait; its error, if any, is the caller's to report
        self._inflight.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for number, fd in enumerate(self._fds):
            if fd is not None:
                os.close(fd)
                self._fds[number] = None


@contextlib.contextmanager
def torch_save_without_crc32():
    """`torch.save` (and DCP, which uses it per item) without its zip CRC32 pass.

    The CRC costs a full extra pass over the bytes, `torch.load` never checks it, and the manifest's
    checksum per tensor is the stronger check; torch versions without the switch are left as they are.
    """
    try:
        from torch.utils.serialization import config
        patch = config.patch({"save.compute_crc32": False})
    except (ImportError, AttributeError, KeyError):
        patch = contextlib.nullcontext()
    with patch:
        yield
