"""OS calls the writers and readers make, each with its fallback where the system lacks it:
libc functions by name, page population, writeback, positioned writes, in-kernel copies, fsync."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from mmparity.io.fsio.errors import CheckpointError


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library, errno kept for `ctypes.get_errno()`; None where there is none to load.

    glibc's soname first: `find_library` runs `ldconfig -p` in a child process, and this is first
    called in the middle of a conversion, where forking a process holding gigabytes of mappings
    costs time and, to anything summing the memory of a process tree, looks like a second copy of
    the converter (the benchmarks' RssAnon peak doubled whenever a sample fell in that window)."""
    for name in ("libc.so.6", None):
        try:
            return ctypes.CDLL(name or ctypes.util.find_library("c"), use_errno=True)
        except (OSError, TypeError):
            continue
    return None


def libc_function(name: str, argtypes: list):
    """A libc function with its argument types set, or False where this libc lacks it."""
    function = getattr(libc(), name, None)
    if function is None:
        return False
    function.argtypes = argtypes
    return function


_MADV_POPULATE_READ = 22  # Linux >= 5.14; older kernels answer EINVAL and we carry on unpopulated
_PAGE = mmap.PAGESIZE
_madvise = None


def prefault(tensors: Iterable[torch.Tensor]) -> None:
    """Maps the pages of file-backed tensors into the page table before the kernel copies from them.

    A `write`/`pwrite` from a freshly mapped file takes one page fault per page inside the syscall,
    which measured at less than half the throughput of the same write from a populated range
    (populating 500 MB of cached pages costs ~8 ms). Populating is per tensor, never per file, so
    a source whose other tensors are not converted is not read. Anonymous tensors are already resident;
    the call is then a cheap walk.
    """
    global _madvise
    if _madvise is None:
        _madvise = libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
    if not _madvise:
        return
    for tensor in tensors:
        if tensor.device.type != "cpu" or not tensor.numel():
            continue
        begin = tensor.data_ptr()
        # The span a (possibly strided) view reaches, not just numel bytes from its start.
        extent = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
        end = begin + extent * tensor.element_size()
        start = begin - begin % _PAGE
        if _madvise(start, end - start, _MADV_POPULATE_READ) != 0:
            if ctypes.get_errno() == errno.EINVAL:
                _madvise = False  # an older kernel: every later call would fail the same way
                return


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range = None


def start_writeback(fd: int, offset: int, count: int) -> None:
    """Asks the kernel to start writing a just-filled byte range to disk, without waiting for it.

    A writer that only fsyncs at the end fills the page cache first and then waits for the whole
    file to reach the disk, one after the other (for 0.9 GB, ~0.34 s of `copy_file_range` and then
    ~0.28 s of `fsync`, in the measurements of docs/convert.md). Starting writeback range by range
    overlaps the two (0.42-0.47 s in all: the `copy_writeback` job of
    benchmarks/convert_throughput.py); the final fsync still gives the durability
    guarantee. Not Linux, or a filesystem that refuses: nothing happens and the fsync does all the
    work, as before.
    """
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = libc_function(
            "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
    if _sync_file_range and count > 0:
        if _sync_file_range(fd, offset, count, _SYNC_FILE_RANGE_WRITE) != 0:
            if ctypes.get_errno() == errno.ENOSYS:
                _sync_file_range = False  # no such syscall: every later call would fail the same way


def pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


# What copy_file_range answers when the kernel cannot copy between these two files at all (another
# filesystem, one that does not implement it, an old kernel): the bytes then go through user space.
# Any other error is a real one and propagates.
_COPY_UNSUPPORTED = frozenset({errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})
_COPY_CHUNK = 8 * 2**20


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"source file (descriptor {fd})"


def copy_file_range_all(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int) -> None:
    """`count` bytes from one file to another inside the kernel (page cache to page cache), or by
    `pread`/`pwrite` where the kernel cannot copy between the two (e.g. across filesystems)."""
    while count:
        try:
            copied = os.copy_file_range(src_fd, dst_fd, count, src_offset, dst_offset)
        except OSError as exc:
            if exc.errno not in _COPY_UNSUPPORTED:
                raise
            _copy_through_user_space(src_fd, src_offset, dst_fd, dst_offset, count)
            return
        if copied <= 0:
            raise CheckpointError(f"{_fd_path(src_fd)}: copy_file_range stopped with {count} bytes left (the source "
                                  "file is shorter than its header says, or was truncated while read)")
        src_offset, dst_offset, count = src_offset + copied, dst_offset + copied, count - copied


def _copy_through_user_space(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int) -> None:
    while count:
        data = os.pread(src_fd, min(count, _COPY_CHUNK), src_offset)
        if not data:
            raise CheckpointError(f"{_fd_path(src_fd)}: source file ended with {count} bytes left to copy (shorter "
                                  "than its header says, or truncated while read)")
        pwrite_all(dst_fd, data, dst_offset)
        src_offset, dst_offset, count = src_offset + len(data), dst_offset + len(data), count - len(data)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under `root` (directories too, so new entries are durable)."""
    root = Path(root)
    for current, _dirs, files in os.walk(root):
        for file_name in files:
            fsync_path(Path(current) / file_name)
        fsync_path(Path(current))
