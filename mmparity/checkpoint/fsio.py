"""Files in and out: streaming safetensors reading, sharded writing, atomic directories, checksums.

Pure torch + safetensors (no megatron, no transformers): everything here works on names, dtypes,
shapes and bytes.

Reading follows what `transformers` loads from a `save_pretrained` directory: a single
`model.safetensors` wins over `model.safetensors.index.json` when both exist (that is HF's
precedence), and a sharded checkpoint is described by its index. Nothing is loaded at open time
beyond the safetensors headers, so listing a multi-GB checkpoint is cheap, and tensors (or the TP
slice of one) are read one at a time.

Writing never leaves a half-written checkpoint where a finished one is expected: callers write into
`atomic_directory(...)`, which only moves the result into place after everything succeeded and was
fsynced.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import dataclasses
import errno
import fcntl
import functools
import hashlib
import json
import logging
import math
import mmap
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from mmparity.converters.tp import ColumnJoin, as_tensor
from safetensors.torch import save_file

__all__ = [
    "CheckpointError",
    "SAFETENSORS_SINGLE_FILE",
    "SAFETENSORS_INDEX_FILE",
    "TensorInfo",
    "TensorChecksum",
    "SafetensorsCheckpoint",
    "open_safetensors_checkpoint",
    "load_safetensors_state_dict",
    "StreamingSafetensorsWriter",
    "save_safetensors_checkpoint",
    "write_safetensors_shards",
    "parse_size",
    "atomic_directory",
    "fsync_tree",
    "make_staging_directory",
    "publish_staging_directory",
    "discard_staging_directory",
    "recover_destination",
    "remove_created_directories",
    "require_regular_file",
    "refuse_links_outside",
    "links_outside",
    "link_outside",
    "sources_unchanged",
    "changed_sources",
    "check_sources_unchanged",
    "refuse_link_destination",
    "is_plain_relative_path",
    "check_source_dtypes",
    "SOURCE_DTYPE_POLICY",
    "standalone_tensor",
    "tensor_checksum",
    "PieceHasher",
    "CHECKSUM_ALGORITHM",
    "prefault",
    "pwrite_all",
    "copy_file_range_all",
    "FileRanges",
    "mapping_address",
    "narrow_pieces",
    "route_pieces",
    "joined",
    "Slot",
    "SlotWriter",
    "torch_save_without_crc32",
    "dtype_name",
    "dtype_from_name",
]

SAFETENSORS_SINGLE_FILE = "model.safetensors"
MISTRAL_CONSOLIDATED_FILE = "consolidated.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"

# HF's own default for save_pretrained.
DEFAULT_MAX_SHARD_SIZE = "5GB"

# transformers refuses safetensors files whose header metadata lacks a known "format".
_HF_FORMAT_METADATA = {"format": "pt"}

# How many offending names an error message lists before summarising the rest; keeps one-line
# messages readable for checkpoints with thousands of tensors.
_MAX_NAMES_IN_MESSAGE = 8


# An mcore checkpoint's side file: the tensors Megatron's class has no place for (see
# `checkpoint.streaming`). Safetensors, but no HF weights: it never makes a directory an HF one.
MCORE_SIDE_FILE = "mcore_side.safetensors"


def has_hf_weights(path: Path) -> bool:
    """Whether directory `path` holds HF safetensors weights (a single file, an index, or shards)."""
    return ((path / SAFETENSORS_SINGLE_FILE).is_file() or (path / SAFETENSORS_INDEX_FILE).is_file()
            or any(p.name != MCORE_SIDE_FILE for p in path.glob("*.safetensors")))


class CheckpointError(ValueError):
    """A checkpoint cannot be read or written as asked. The message is one line and names the path."""


def _name_list(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_MAX_NAMES_IN_MESSAGE])
    hidden = len(names) - _MAX_NAMES_IN_MESSAGE
    return f"{shown} (+{hidden} more)" if hidden > 0 else shown


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# --------------------------------------------------------------------------------------------------
# what a checkpoint may name: regular files, inside itself


def require_regular_file(path: str | os.PathLike, what: str = "file") -> os.stat_result:
    """`stat`s `path` (never opens it) and refuses anything but a regular file.

    Opening a FIFO blocks until someone writes to it, and a device or socket is no checkpoint: they
    are refused before any `open`, so a hostile directory cannot make a reader hang. Symlinks are
    followed (HF's cache links every file to a blob elsewhere).
    """
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot stat {what} ({exc.strerror})") from None
    if not stat.S_ISREG(status.st_mode):
        raise CheckpointError(f"{path}: not a regular file (a {_file_kind(status.st_mode)}); a checkpoint's "
                              f"{what} must be a plain file")
    return status


# Links. A symbolic link inside a checkpoint is followed only where its target stays inside the
# checkpoint directory (a deduplicating layout linking within itself), or where the checkpoint is a
# Hugging Face hub cache snapshot (`<repo>/snapshots/<rev>/`), whose every file links to
# `<repo>/blobs/<hash>`. A link anywhere else is refused by name: the checkpoint would certify, and
# `convert` would publish, bytes that live in a file the checkpoint does not hold (and that can
# change, or vanish, under it). A hard link (st_nlink > 1) is accepted: its bytes are the file's own,
# read from the inode the checkpoint names exactly as a copy's would be, indistinguishable by path
# from a copy deduplicated by `cp --link` / `rsync --link-dest`, and certified by the manifest's
# checksums (`verify` re-reads them); mmparity never opens a source for writing and writes outputs
# only into files it creates, so nothing is written through the other name either.


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def link_outside(path: str | os.PathLike, root: str | os.PathLike) -> str | None:
    """The resolved target of symlink `path` if it lies outside checkpoint directory `root` (and is
    not a hub cache snapshot's blob), else None. `path` need not be a link."""
    if not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    real_root = os.path.realpath(root)
    if _inside(target, real_root):
        return None
    snapshots = os.path.dirname(real_root)
    if os.path.basename(snapshots) == "snapshots":
        blobs = os.path.join(os.path.dirname(snapshots), "blobs")
        if os.path.dirname(target) == blobs:
            return None  # huggingface_hub's cache layout: snapshots/<rev>/<file> -> ../../blobs/<hash>
    return target


def links_outside(root: str | os.PathLike, directories: Iterable[str | os.PathLike] = (), *,
                  recursive: bool = False, root_names: Iterable[str] | None = None) -> list[tuple[Path, str]]:
    """(link, target) for every symlink directly in `root` (only those named `root_names`, if
    given) or in `directories` (and below them with `recursive`; links to directories are not
    descended) whose target leaves `root`."""
    found = []

    def note(path) -> None:
        target = link_outside(path, root)
        if target is not None:
            found.append((Path(path), target))

    if root_names is not None:
        for name in root_names:
            note(os.path.join(root, name))
        scanned = [(str(d), recursive) for d in directories]
    else:
        scanned = [(str(root), False)] + [(str(d), recursive) for d in directories]
    for directory, deep in scanned:
        if os.path.islink(directory):
            note(directory)
            continue
        walk = os.walk(directory) if deep else [(directory, [], None)]
        for current, subdirectories, _files in walk:
            subdirectories.sort()
            try:
                entries = sorted(os.scandir(current), key=lambda e: e.name)
            except OSError:
                continue
            for entry in entries:
                if entry.is_symlink():
                    note(entry.path)
    return found


def refuse_links_outside(root: str | os.PathLike, directories: Iterable[str | os.PathLike] = (), *,
                         recursive: bool = False, root_names: Iterable[str] | None = None) -> None:
    """Raises `CheckpointError` naming the first symlink of :func:`links_outside`."""
    found = links_outside(root, directories, recursive=recursive, root_names=root_names)
    if found:
        link, target = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise CheckpointError(f"{link}: a symbolic link to {target}, outside the checkpoint {root}{more}; "
                              "mmparity reads only files inside a checkpoint: copy the file in (or link it "
                              "within the checkpoint)")


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def is_plain_relative_path(name: object) -> bool:
    """True for a relative path that stays inside the directory it is relative to (no `..`
    component, not absolute, not empty): how every path a checkpoint names must look."""
    return isinstance(name, str) and _is_plain_relative_str(name)


@functools.lru_cache(maxsize=4096)  # a manifest names the same few files in every record
def _is_plain_relative_str(name: str) -> bool:
    if not name or "\x00" in name:
        return False
    path = Path(name)
    return not path.is_absolute() and ".." not in path.parts and path.parts != ()


# --------------------------------------------------------------------------------------------------
# dtypes and checksums

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`: the spelling used in manifests and error messages."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype name {name!r}")
    return dtype


# Which dtypes a conversion accepts for a tensor it reads, as data: (key pattern, accepted dtypes in
# words, test), the first matching pattern decides. A model weight is floating: a container that
# labels one as an integer tensor (a header relabelled I32, DCP metadata claiming int32) lies, and
# converting it would truncate the values or write an integer tensor into a float checkpoint. Only
# tensors that are integer state by nature (Transformer Engine's serialized `_extra_state`, position
# ids, counters) may be anything else. This is the default for every family; entries of one family
# would sit beside its rule table once the architecture of #13 gives them a place.
SOURCE_DTYPE_POLICY: tuple[tuple[re.Pattern, str, object], ...] = (
    (re.compile(r"(^|\.)(_extra_state|position_ids|num_batches_tracked)$"), "any dtype", lambda dtype: True),
    (re.compile(r""), "a floating-point dtype", lambda dtype: dtype.is_floating_point),
)


def check_source_dtypes(where: str | os.PathLike, dtypes: Mapping[str, torch.dtype]) -> None:
    """Refuses source tensors whose declared dtype `SOURCE_DTYPE_POLICY` does not accept (reads no
    data: `dtypes` come from headers); one line naming every offender."""
    bad = []
    for name, dtype in dtypes.items():
        for pattern, accepted, accepts in SOURCE_DTYPE_POLICY:
            if pattern.search(name):
                if not accepts(dtype):
                    bad.append(f"{name} is {dtype_name(dtype)}, expected {accepted}")
                break
    if bad:
        bad.sort()
        more = f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""
        raise CheckpointError(f"{where}: the checkpoint declares a dtype a model weight cannot have: "
                              f"{'; '.join(bad[:4])}{more} (a relabelled header or metadata?)")


def _xxh3_128():
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh3_128


# The default checksum: xxh3-128 hashes ~15x as fast as sha256 (~30 GB/s against ~2 GB/s), which made
# sha256 a third of a conversion's CPU time. Checksums guard against corruption and layout
# mistakes, not tampering, so a non-cryptographic 128-bit hash is enough. Manifests written with
# sha256 stay verifiable: every record names its algorithm.
_HASHERS = {"sha256": hashlib.sha256}
if _xxh3_128() is not None:
    _HASHERS["xxh3_128"] = _xxh3_128()
CHECKSUM_ALGORITHM = "xxh3_128" if "xxh3_128" in _HASHERS else "sha256"
CHECKSUM_ALGORITHMS = ("xxh3_128", "sha256")


@dataclasses.dataclass(frozen=True)
class TensorChecksum:
    """What a tensor must be to count as unchanged: dtype, shape and a digest of its bytes."""

    dtype: str
    shape: tuple[int, ...]
    digest: str
    algorithm: str = CHECKSUM_ALGORITHM

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), self.algorithm: self.digest}

    @classmethod
    def from_json(cls, record: Mapping) -> TensorChecksum:
        algorithm = next((a for a in CHECKSUM_ALGORITHMS if a in record), None)
        if algorithm is None:
            raise KeyError(f"no checksum ({' or '.join(CHECKSUM_ALGORITHMS)})")
        shape, dtype, digest = record.get("shape"), record.get("dtype"), record[algorithm]
        if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                  for n in shape):
            raise ValueError(f"shape {shape!r} is not a list of sizes")
        if not isinstance(dtype, str) or not isinstance(digest, str):
            raise ValueError(f"dtype {dtype!r} and {algorithm} {digest!r} must be strings")
        return cls(dtype, tuple(shape), digest, algorithm)

    def differences(self, other: TensorChecksum) -> list[str]:
        """Human-readable reasons why `other` (found) is not `self` (expected); empty if equal."""
        found = []
        if self.dtype != other.dtype:
            found.append(f"dtype {other.dtype} != expected {self.dtype}")
        if self.shape != other.shape:
            found.append(f"shape {list(other.shape)} != expected {list(self.shape)}")
        if not found and (self.algorithm, self.digest) != (other.algorithm, other.digest):
            found.append(f"{self.algorithm} of the bytes differs")
        return found


class PieceHasher:
    """The checksum of a tensor fed as consecutive pieces of its C-order bytes.

    Lets a writer hash what it writes piece by piece (TP parts going straight to their offsets)
    without first concatenating them; gives exactly `tensor_checksum` of the whole tensor.
    """

    def __init__(self, dtype: torch.dtype, shape: tuple, algorithm: str = CHECKSUM_ALGORITHM):
        if algorithm not in _HASHERS:
            raise CheckpointError(f"checksum algorithm {algorithm!r} is not available here "
                                  f"(have {', '.join(_HASHERS)}; xxh3_128 needs the xxhash package)")
        self.dtype, self.shape, self.algorithm = dtype_name(dtype), tuple(int(n) for n in shape), algorithm
        self._hash = _HASHERS[algorithm]()
        self._hash.update(f"mmparity-tensor-v1|{self.dtype}|{self.shape}|".encode())

    def update(self, piece: torch.Tensor) -> None:
        if piece.numel():
            # Viewing as bytes works for every dtype, including bf16/fp8 that numpy cannot represent.
            self._hash.update(piece.detach().contiguous().reshape(-1).view(torch.uint8).numpy())

    def update_bytes(self, data) -> None:
        self._hash.update(data)

    def result(self) -> TensorChecksum:
        return TensorChecksum(self.dtype, self.shape, self._hash.hexdigest(), self.algorithm)


def tensor_checksum(tensor: torch.Tensor, algorithm: str = CHECKSUM_ALGORITHM) -> TensorChecksum:
    """A digest over dtype, shape and raw (little-endian, C-order) bytes.

    Dtype and shape are hashed too, so a reinterpretation of the same bytes (bf16 read as fp16, a
    transposed reshape) never passes as unchanged.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    hasher = PieceHasher(tensor.dtype, tuple(tensor.shape), algorithm)
    hasher.update(tensor)
    return hasher.result()


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library, errno kept for `ctypes.get_errno()`; None where there is none to load."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _libc_function(name: str, argtypes: list):
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
        _madvise = _libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
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
        _sync_file_range = _libc_function(
            "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
    if _sync_file_range and count > 0:
        if _sync_file_range(fd, offset, count, _SYNC_FILE_RANGE_WRITE) != 0:
            if ctypes.get_errno() == errno.ENOSYS:
                _sync_file_range = False  # no such syscall: every later call would fail the same way


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


# --------------------------------------------------------------------------------------------------
# reading


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """A tensor as described by a safetensors header: nothing is loaded to produce this."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str  # file name relative to the checkpoint directory

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _open_safetensors_file(path: Path):
    require_regular_file(path, "safetensors file")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # SafetensorError is not importable under a stable name
        raise CheckpointError(f"{path}: not a readable safetensors file ({_one_line(exc)})") from exc


def _header_infos(handle, path: Path, file_name: str) -> dict[str, TensorInfo]:
    infos = {}
    for name in handle.keys():
        view = handle.get_slice(name)
        dtype_code = view.get_dtype()
        if dtype_code not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype_code}")
        infos[name] = TensorInfo(name, _SAFETENSORS_DTYPES[dtype_code], tuple(view.get_shape()), file_name)
    return infos


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

    def add(self, base_address: int, length: int, path: str | os.PathLike) -> None:
        fd = os.open(path, os.O_RDONLY)
        self._ranges.append((base_address, base_address + length, fd))

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

    def __del__(self):
        self.close()


def mapping_address(mapping) -> int:
    """The address of an mmap object's first byte (where tensors made from it point)."""
    return torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() if len(mapping) else 0


class SafetensorsCheckpoint:
    """Read-only view of a `save_pretrained` safetensors directory.

    Opening validates the whole layout (files present, headers parse, file sizes match headers,
    index and shards agree) so later reads cannot fail halfway through a conversion for a reason
    that was knowable up front.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.exists():
            raise CheckpointError(f"{self.directory}: checkpoint directory does not exist")
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory")
        # What is read from an HF directory (config, index, shards) sits in it: none may link out.
        refuse_links_outside(self.directory, root_names=sorted(
            n for n in os.listdir(self.directory) if n in ("config.json", SAFETENSORS_INDEX_FILE) or n.endswith(".safetensors")))
        self._handles: dict[str, object] = {}
        self._mappings: dict[str, tuple] = {}
        self.file_ranges = FileRanges()  # where `map`'s tensors live in the files
        self._infos: dict[str, TensorInfo] = {}
        self.index_metadata: dict = {}
        try:
            single = self.directory / SAFETENSORS_SINGLE_FILE
            index = self.directory / SAFETENSORS_INDEX_FILE
            consolidated = self.directory / MISTRAL_CONSOLIDATED_FILE
            if os.path.lexists(single):  # a FIFO or directory under that name is refused by name
                self.layout = "single"
                self._open_single(single)
            elif os.path.lexists(consolidated) and not os.path.lexists(index):
                # Mistral's own release layout: one file under another name (tensor names are the
                # Mistral-native ones; the family converters detect that layout from the keys).
                self.layout = "single"
                self._open_single(consolidated)
            elif os.path.lexists(index):
                self.layout = "sharded"
                self._open_sharded(index)
            else:
                others = sorted(p.name for p in self.directory.glob("*.safetensors"))
                hint = f"; found {_name_list(others)} but no index naming them" if others else ""
                raise CheckpointError(
                    f"{self.directory}: no {SAFETENSORS_SINGLE_FILE} or {SAFETENSORS_INDEX_FILE}{hint}"
                )
        except BaseException:
            self.close()
            raise

    def _open_single(self, path: Path) -> None:
        handle = _open_safetensors_file(path)
        self._handles[path.name] = handle
        self._infos = _header_infos(handle, path, path.name)

    def _open_sharded(self, index_path: Path) -> None:
        require_regular_file(index_path, "index")
        try:
            with open(index_path, encoding="utf-8") as f:
                index = json.load(f)
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: unreadable index ({_one_line(exc)})") from exc
        self.index_metadata = dict(index.get("metadata") or {})

        names_by_file: dict[str, set[str]] = {}
        for name, file_name in weight_map.items():
            if not isinstance(file_name, str) or Path(file_name).name != file_name:
                # Refuse paths that would read outside the checkpoint directory.
                raise CheckpointError(f"{index_path}: shard name {file_name!r} is not a plain file name")
            names_by_file.setdefault(file_name, set()).add(name)

        missing = [f for f in names_by_file if not os.path.lexists(self.directory / f)]
        if missing:
            raise CheckpointError(f"{index_path}: index names missing shard file(s) {_name_list(missing)}")

        for file_name in sorted(names_by_file):
            path = self.directory / file_name
            handle = _open_safetensors_file(path)
            self._handles[file_name] = handle
            infos = _header_infos(handle, path, file_name)
            expected = names_by_file[file_name]
            not_in_shard = expected - infos.keys()
            not_in_index = infos.keys() - expected
            if not_in_shard or not_in_index:
                parts = []
                if not_in_shard:
                    parts.append(f"index lists {_name_list(not_in_shard)} but the shard lacks them")
                if not_in_index:
                    parts.append(f"shard holds {_name_list(not_in_index)} that the index assigns elsewhere or omits")
                raise CheckpointError(f"{path}: index/shard key mismatch: {'; '.join(parts)}")
            self._infos.update(infos)

    # -- queries -----------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return sorted(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(
                f"{self.directory}: no tensor {name!r}; it holds {len(self._infos)} tensors, "
                f"e.g. {_name_list(self.keys()[:_MAX_NAMES_IN_MESSAGE])}"
            ) from None

    def infos(self) -> dict[str, TensorInfo]:
        return {name: self._infos[name] for name in self.keys()}

    @property
    def files(self) -> list[str]:
        return sorted({info.file for info in self._infos.values()})

    @property
    def header_metadata(self) -> dict[str, str]:
        """The `__metadata__` of the first file (HF writes the same `{"format": "pt"}` in each)."""
        if not self._handles:
            return {}
        return dict(self._handles[sorted(self._handles)[0]].metadata() or {})

    # -- reads -------------------------------------------------------------------------------------

    def _handle_for(self, name: str):
        file_name = self.info(name).file
        if file_name not in self._handles:
            raise CheckpointError(f"{self.directory}: checkpoint is closed")
        return self._handles[file_name]

    def get(self, name: str) -> torch.Tensor:
        """One whole tensor, materialised on CPU."""
        handle = self._handle_for(name)
        try:
            return handle.get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"{self.directory}: cannot read {name!r} ({_one_line(exc)})") from exc

    def map(self, name: str) -> torch.Tensor:
        """One whole tensor as a copy-free view of the file, backed by the page cache.

        The tensor owns a storage of exactly its bytes (so `torch.save`, DCP and safetensors write
        just those), mapped copy-on-write from a read-only descriptor: the checkpoint file can never
        be modified through it, and the memory it occupies is file cache, not anonymous memory.
        Falls back to `get` for tensors whose bytes are not aligned for their dtype.
        """
        info = self.info(name)
        if info.file not in self._handles:
            raise CheckpointError(f"{self.directory}: checkpoint is closed")
        mapping, data_start, offsets = self._mapping(info.file)
        begin, end = offsets[name]
        if end - begin != info.nbytes:
            raise CheckpointError(f"{self.directory}: {name!r} spans {end - begin} bytes, its header says {info.nbytes}")
        if not 0 <= begin <= end <= len(mapping) - data_start:
            raise CheckpointError(f"{self.directory / info.file}: {name!r} lies at bytes {begin}..{end} of a data "
                                  f"section of {len(mapping) - data_start} (a truncated file?)")
        if info.nbytes == 0 or (data_start + begin) % info.dtype.itemsize:
            return self.get(name)
        raw = torch.frombuffer(mapping, dtype=torch.uint8, count=end - begin, offset=data_start + begin)
        return raw.view(info.dtype).view(info.shape)

    def _mapping(self, file_name: str):
        """(mmap of the file, byte offset of its data section, name -> (begin, end)), made once."""
        cached = self._mappings.get(file_name)
        if cached is not None:
            return cached
        path = self.directory / file_name
        try:
            with open(path, "rb") as f:
                header_size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(header_size))
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file ({_one_line(exc)})") from exc
        offsets = {k: tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"}
        self.file_ranges.add(mapping_address(mapping), len(mapping), path)
        self._mappings[file_name] = cached = (mapping, 8 + header_size, offsets)
        return cached

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """`tensor.narrow(dim, start, stop - start)` reading only those bytes from disk."""
        info = self.info(name)
        ndim = len(info.shape)
        if ndim == 0:
            raise CheckpointError(f"{self.directory}: {name!r} is a scalar and cannot be sliced")
        axis = dim + ndim if dim < 0 else dim
        if not 0 <= axis < ndim:
            raise CheckpointError(f"{self.directory}: {name!r} has {ndim} dims, cannot slice dim {dim}")
        if not 0 <= start <= stop <= info.shape[axis]:
            raise CheckpointError(
                f"{self.directory}: slice [{start}:{stop}] out of range for dim {axis} of {name!r} "
                f"with shape {list(info.shape)}"
            )
        index = tuple([slice(None)] * axis + [slice(start, stop)])
        try:
            return self._handle_for(name).get_slice(name)[index]
        except Exception as exc:
            raise CheckpointError(f"{self.directory}: cannot read {name!r} ({_one_line(exc)})") from exc

    def get_tp_slice(self, name: str, dim: int, rank: int, world_size: int) -> torch.Tensor:
        """The `rank`-th of `world_size` equal chunks along `dim`, read without the other chunks."""
        info = self.info(name)
        axis = dim + len(info.shape) if dim < 0 else dim
        if not 0 <= axis < len(info.shape):
            raise CheckpointError(f"{self.directory}: {name!r} has {len(info.shape)} dims, cannot split dim {dim}")
        size = info.shape[axis]
        if world_size < 1 or not 0 <= rank < world_size:
            raise CheckpointError(f"rank {rank} is not in a TP group of size {world_size}")
        if size % world_size:
            raise CheckpointError(
                f"{self.directory}: dim {axis} of {name!r} (size {size}) does not divide by TP size {world_size}"
            )
        chunk = size // world_size
        return self.get_slice(name, axis, rank * chunk, (rank + 1) * chunk)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) one at a time, file by file so each shard's pages are touched once."""
        for file_name in self.files:
            for name in sorted(n for n, i in self._infos.items() if i.file == file_name):
                yield name, self.get(name)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(iter(self))

    # -- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        # safe_open handles unmap when released; dropping our references is the close. Mappings
        # handed out by `map` stay valid while a tensor still uses them.
        self._handles = {}
        self._mappings = {}
        self.file_ranges.close()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def open_safetensors_checkpoint(directory: str | os.PathLike) -> SafetensorsCheckpoint:
    return SafetensorsCheckpoint(directory)


def load_safetensors_state_dict(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a `save_pretrained` directory (convenience for small models and tests)."""
    with SafetensorsCheckpoint(directory) as checkpoint:
        return checkpoint.state_dict()


# --------------------------------------------------------------------------------------------------
# writing

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """`"5GB"` -> 5_000_000_000, `"1MiB"` -> 1_048_576: HF's spelling of `max_shard_size`."""
    if isinstance(size, bool):
        raise CheckpointError(f"invalid size {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+)\s*([KMGT]I?B|B)?\s*", str(size), flags=re.IGNORECASE)
        if not match:
            raise CheckpointError(f"invalid size {size!r}; use bytes or e.g. '500MB', '5GB', '1GiB'")
        value = int(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").upper()]
    if value <= 0:
        raise CheckpointError(f"size must be positive, got {size!r}")
    return value


def standalone_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning exactly its bytes (safetensors refuses shared storage)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.itemsize:
        tensor = tensor.contiguous().clone()
    return tensor


def _tensor_table(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict:
    """Names to standalone tensors, refusing what a safetensors file cannot hold."""
    table: dict[str, torch.Tensor] = {}
    for name, tensor in (tensors.items() if isinstance(tensors, Mapping) else tensors):
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"tensor names must be non-empty strings, got {name!r}")
        if name in table:
            raise CheckpointError(f"tensor {name!r} written twice")
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        table[name] = standalone_tensor(tensor)
    return table


def write_safetensors_shards(staging: str | os.PathLike,
                             tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                             max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                             metadata: Mapping[str, str] | None = None) -> "StreamingSafetensorsWriter":
    """`save_pretrained`-style shards of in-memory tensors in `staging`, through the one
    safetensors writer the converter uses too; returns the closed writer (files, weight map,
    checksums)."""
    table = _tensor_table(tensors)
    writer = StreamingSafetensorsWriter(staging, [(n, t.dtype, tuple(t.shape)) for n, t in table.items()],
                                        max_shard_size=max_shard_size, metadata=metadata)
    try:
        for name, tensor in table.items():
            writer.write(name, tensor)
        writer.written = writer.close()
    except BaseException:
        writer.abort()
        raise
    return writer


def save_safetensors_checkpoint(
    directory: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
    extra_files: Mapping[str, str | bytes] | None = None,
    force: bool = False,
) -> dict[str, TensorChecksum]:
    """Writes a `save_pretrained`-style safetensors directory atomically; returns per-tensor checksums.

    The tensors are held in memory (every shard's header is laid out before writing); the
    converter streams through `StreamingSafetensorsWriter` directly. `extra_files` (e.g.
    `config.json`) land in the same atomic step.
    """
    with atomic_directory(directory, force=force) as staging:
        writer = write_safetensors_shards(staging, tensors, max_shard_size=max_shard_size, metadata=metadata)
        write_extra_files(staging, extra_files, writer.written)
    return writer.checksums


def write_extra_files(staging: Path, files: Mapping[str, str | bytes] | None,
                      reserved: Iterable[str] = ()) -> None:
    """Small files (e.g. ``config.json``) written next to the tensors in the same atomic step.

    Names must be plain file names that nothing else in the directory uses: an extra file must
    never shadow a shard, the manifest or the tracker.
    """
    reserved = set(reserved)
    for file_name, content in (files or {}).items():
        if Path(file_name).name != file_name or file_name in reserved or (staging / file_name).exists():
            raise CheckpointError(f"extra file name {file_name!r} is not a plain, unused file name")
        if isinstance(content, bytes):
            (staging / file_name).write_bytes(content)
        else:
            (staging / file_name).write_text(content, encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# atomic directories


def _fsync_path(path: Path) -> None:
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
            _fsync_path(Path(current) / file_name)
        _fsync_path(Path(current))


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --------------------------------------------------------------------------------------------------
# publishing: crash-safe at every instant
#
# A destination is always either the old complete checkpoint or the new complete one. The new one is
# written into a hidden sibling `.<name>.tmp-<host>.<pid>-<random>`, locked (`flock`) by its writer for as
# long as it lives, and published by one `renameat2(RENAME_EXCHANGE)`: the old checkpoint stays in
# place until the new one takes its name, then the old one (now under the staging name) is removed.
# Where the filesystem cannot exchange (EINVAL, e.g. NFS), the old one is first renamed aside to
# `.<name>.old-<host>.<pid>-<random>/old`; a writer killed between that rename and the next leaves no
# destination, and the next run to the same destination puts the old one back. Litter of dead
# writers (on this host, their lock free and their pid gone) is removed by the next run to the same destination
# and reported on the `mmparity` logger.

_log = logging.getLogger("mmparity.checkpoint")
_STAGING_LOCKS: dict[str, int] = {}  # staging path -> descriptor holding its flock
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2 = None


def _litter_pattern(name: str) -> re.Pattern:
    # The owner part is absent in the names of writers before the owner was recorded.
    return re.compile(rf"^\.{re.escape(name)}\.(tmp|old)-(?:([A-Za-z0-9_-]+)\.(\d+)-)?[a-z0-9_]{{8}}$")


@functools.cache
def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def _owner() -> str:
    """`<host>.<pid>` for staging names: a pid only says something about a writer on this host (a
    shared filesystem may hold another machine's live staging directory)."""
    return f"{_host()}.{os.getpid()}"


def _lock(path: Path) -> int | None:
    """A descriptor holding an exclusive flock on directory `path`, or None if another holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _unlock(path: Path) -> None:
    fd = _STAGING_LOCKS.pop(str(path), None)
    if fd is not None:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def recover_destination(destination: str | os.PathLike) -> list[str]:
    """Cleans up after writers to `destination` that died: puts back an old checkpoint a killed
    `--force` publish had moved aside (when nothing took its place), and removes their staging and
    displaced directories. Leaves alone everything a live writer holds. Returns what it did, one
    line each (also logged)."""
    destination = Path(destination).absolute()
    parent = destination.parent
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return []
    pattern = _litter_pattern(destination.name)
    notes = []
    for entry in entries:
        match = pattern.match(entry)
        if match is None:
            continue
        kind, host, pid = match.group(1), match.group(2), int(match.group(3)) if match.group(3) else None
        if pid is not None and (host != _host() or pid == os.getpid() or _pid_alive(pid)):
            continue  # another host's writer, or one alive here
        path = parent / entry
        fd = _lock(path)
        if fd is None:
            continue  # a live writer holds it
        try:
            owner = f"pid {pid}" if pid is not None else "a writer"
            if kind == "old" and not os.path.lexists(destination) and os.path.lexists(path / "old"):
                os.replace(path / "old", destination)
                _fsync_path(parent)
                notes.append(f"restored {destination} from {entry}, where {owner} (killed while replacing it) "
                             "had moved it")
            _remove(path)
            notes.append(f"removed {parent / entry}, left by {owner}, which is no longer running")
        finally:
            os.close(fd)
    for note in notes:
        _log.warning(note)
    return notes


def refuse_link_destination(destination: str | os.PathLike) -> None:
    """A destination that is a symbolic link (to a directory, to nothing, to the source) is refused,
    with or without force: publishing renames a new directory onto the name, so it would replace
    the link and not write where it points, and removing an old checkpoint must never follow a link
    into someone else's files. The user names the target itself, or another path."""
    if os.path.islink(destination):
        try:
            target = os.readlink(destination)
        except OSError:
            target = "?"
        raise CheckpointError(f"{destination}: is a symbolic link (to {target}); mmparity neither writes through "
                              "a link nor replaces one: name the directory it points to, or a path that is not a link")


def _unwritable(directory: Path, destination: Path, exc: OSError) -> CheckpointError:
    return CheckpointError(f"{directory}: cannot create {destination.name if directory == destination.parent else 'directories'} "
                           f"there ({exc.strerror or exc}); choose a destination in a directory you can write to")


def make_staging_directory(destination: str | os.PathLike, *, force: bool = False) -> tuple[Path, list[Path]]:
    """Checks `destination` may be written and creates an empty, locked sibling staging directory.

    Returns the staging path and the parent directories created on the way (so a failed write can
    remove them again). Split out of `atomic_directory` so multi-process writers can create the
    staging directory on one rank and share its name.
    """
    destination = Path(destination).absolute()
    refuse_link_destination(destination)
    recover_destination(destination)
    if os.path.lexists(destination) and not force:
        raise CheckpointError(f"{destination}: already exists; pass force=True to replace it")
    created: list[Path] = []
    missing = []
    parent = destination.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except OSError as exc:
            remove_created_directories(created)
            raise _unwritable(directory.parent, destination, exc) from None
        created.append(directory)
    try:
        try:
            staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-{_owner()}-", dir=destination.parent))
        except OSError as exc:
            raise _unwritable(destination.parent, destination, exc) from None
        fd = _lock(staging)
        if fd is not None:
            _STAGING_LOCKS[str(staging)] = fd
        # mkdtemp creates 0700; a published checkpoint should get the usual permissions.
        os.chmod(staging, 0o777 & ~_current_umask())
    except BaseException:
        remove_created_directories(created)
        raise
    fault_point("staged")
    return staging, created


def remove_created_directories(created: list[Path]) -> None:
    for directory in reversed(created):
        with contextlib.suppress(OSError):
            directory.rmdir()  # only if still empty: never delete what someone else put there


def discard_staging_directory(staging: Path, created: list[Path]) -> None:
    """Undoes `make_staging_directory` after a failure."""
    shutil.rmtree(staging, ignore_errors=True)
    _unlock(staging)
    remove_created_directories(created)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps the names `a` and `b` (both exist); False where this system cannot."""
    global _renameat2
    if "noexchange" in _FAULTS:
        return False
    if _renameat2 is None:
        _renameat2 = _libc_function("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                                                  ctypes.c_uint])
    if not _renameat2:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # a filesystem (or kernel) without RENAME_EXCHANGE
    raise OSError(code, os.strerror(code), str(b))


def publish_staging_directory(staging: Path, destination: str | os.PathLike, *, force: bool = False) -> None:
    """fsyncs `staging` and gives it the name `destination`, replacing an old one only if `force`;
    at every instant `destination` is the old checkpoint or the new one (see above)."""
    destination = Path(destination).absolute()
    fsync_tree(staging)
    fault_point("synced")
    check_sources_unchanged()  # the last moment before the new checkpoint takes the name
    if not os.path.lexists(destination):
        os.replace(staging, destination)
        fault_point("published")
        _fsync_path(destination.parent)
        _unlock(staging)
        return
    if not force:
        raise CheckpointError(f"{destination}: appeared while writing; pass force=True to replace it")
    if _exchange(staging, destination):
        fault_point("published")
        _fsync_path(destination.parent)
        _unlock(staging)
        _remove(staging)  # the old checkpoint, under the staging name
        fault_point("removed")
        return
    # os.replace cannot overwrite a non-empty directory: the old one goes aside first, and is
    # deleted only once the new one is in place.
    displaced = Path(tempfile.mkdtemp(prefix=f".{destination.name}.old-{_owner()}-", dir=destination.parent))
    fd = _lock(displaced)
    try:
        os.replace(destination, displaced / "old")
        fault_point("aside")
        try:
            os.replace(staging, destination)
        except BaseException:
            os.replace(displaced / "old", destination)
            raise
        fault_point("published")
        _fsync_path(destination.parent)
        _unlock(staging)
        _remove(displaced)
        fault_point("removed")
    finally:
        if fd is not None:
            os.close(fd)
        if not os.path.lexists(displaced / "old"):
            shutil.rmtree(displaced, ignore_errors=True)


# A conversion publishes only what it read from one state of its source: `sources_unchanged(paths)`
# records (inode, size, mtime) of every file under the source while a conversion runs, and
# `publish_staging_directory` re-checks them before the rename. A file rewritten in place, truncated
# or replaced by another under the converter is refused by name (the bytes read may mix two versions
# of it, and a checksum of them certifies neither); nothing is published.

_WATCHED_SOURCES: list[dict[str, tuple]] = []


def _signature(path: str) -> tuple | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def _source_files(paths: Iterable[str | os.PathLike]) -> dict[str, tuple]:
    files: dict[str, tuple] = {}
    for path in paths:
        path = os.fspath(path)
        walk = os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [os.path.basename(path)])]
        for current, _directories, names in walk:
            for name in names:
                full = os.path.join(current, name)
                if os.path.isfile(full):
                    files[full] = _signature(full)
    return files


def changed_sources() -> list[tuple[str, str]]:
    """(path, how) for every watched source file that is not as it was when the watch began."""
    found = []
    for files in _WATCHED_SOURCES:
        for path, before in files.items():
            now = _signature(path)
            if now == before:
                continue
            if now is None:
                how = "removed"
            elif now[:2] != before[:2]:
                how = "replaced by another file"
            elif now[2] != before[2]:
                how = f"resized from {before[2]} to {now[2]} bytes"
            else:
                how = "rewritten in place"
            found.append((path, how))
    return found


def check_sources_unchanged() -> None:
    changed = changed_sources()
    if changed:
        path, how = changed[0]
        more = f" (and {len(changed) - 1} more file(s))" if len(changed) > 1 else ""
        raise CheckpointError(f"{path}: changed while the conversion read it ({how}){more}; nothing was "
                              "published: convert again once the source is no longer being written")


@contextlib.contextmanager
def sources_unchanged(paths: Iterable[str | os.PathLike]) -> Iterator[None]:
    """Watches every file under `paths` (stat only, no reads) while the block runs; any publish in
    the block first checks that none changed (see above)."""
    files = _source_files(paths)
    _WATCHED_SOURCES.append(files)
    try:
        yield
    finally:
        _WATCHED_SOURCES.remove(files)


@contextlib.contextmanager
def atomic_directory(destination: str | os.PathLike, *, force: bool = False) -> Iterator[Path]:
    """Yields an empty staging directory that becomes `destination` only if the block succeeds.

    The staging directory is a hidden sibling of `destination` (same filesystem, so publishing is
    one atomic rename). On success everything is fsynced before the rename; on any exception
    (KeyboardInterrupt included) the staging directory and any parent directories created for it
    are removed, leaving the filesystem as it was.
    """
    staging, created = make_staging_directory(destination, force=force)
    try:
        yield staging
        publish_staging_directory(staging, destination, force=force)
    except BaseException:
        discard_staging_directory(staging, created)
        raise


# --------------------------------------------------------------------------------------------------
# fault injection (tests only)
#
# `MMPARITY_FAULT` makes a writer die or stop at a chosen point, so tests can check the publishing
# invariant at every point of a real conversion: comma-separated `kill@N` (SIGKILL at the N-th point
# reached), `kill@NAME` (at the first point of that name: staged, tensor, synced, aside, published,
# removed), `pause@N` / `pause@NAME` (sleep there until a signal arrives), `noexchange` (publish as
# on a filesystem without RENAME_EXCHANGE). Unset, a point is one counter increment.

_FAULTS = frozenset(filter(None, os.environ.get("MMPARITY_FAULT", "").split(",")))
_fault_points_reached = 0


def fault_point(name: str) -> None:
    global _fault_points_reached
    if not _FAULTS:
        return
    _fault_points_reached += 1
    for action in ("kill", "pause"):
        if f"{action}@{_fault_points_reached}" in _FAULTS or f"{action}@{name}" in _FAULTS:
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:
                time.sleep(3600)


# --------------------------------------------------------------------------------------------------
# writing into files laid out in advance


def pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


@dataclasses.dataclass(frozen=True)
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


_ROWS_PER_SYSCALL = 512  # well under IOV_MAX (1024 on Linux)


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


def _pwritev_all(fd: int, buffers: list, offset: int) -> int:
    want = sum(b.nbytes for b in buffers)
    written = os.pwritev(fd, buffers, offset)
    if written < want:  # a short write: finish it the slow way
        pwrite_all(fd, b"".join(b.tobytes() for b in buffers)[written:], offset + written)
    return offset + want


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

    `fds` are owned: closed when complete, on `close()` or on `abort()`.
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
        self._written: set[str] = set()
        self.checksums: dict[str, TensorChecksum] = {}
        for number, remaining in enumerate(self._remaining):
            if remaining == 0:
                self._finish_file(number)

    def write(self, name: str, pieces: torch.Tensor | Sequence[torch.Tensor]) -> None:
        slot = self.slots.get(name)
        if slot is None:
            raise CheckpointError(f"{self.directory}: tensor {name!r} was not announced")
        if name in self._written:
            raise CheckpointError(f"{self.directory}: tensor {name!r} written twice")
        pieces = [pieces] if isinstance(pieces, (torch.Tensor, ColumnJoin)) else list(pieces)
        pieces = [p if isinstance(p, ColumnJoin) else p.detach().cpu() for p in pieces]
        numel = sum(p.numel() for p in pieces)
        shapes_fit = (len(pieces) == 1 and tuple(pieces[0].shape) == slot.shape) or (
            len(pieces) > 1 and numel == math.prod(slot.shape))
        if any(p.dtype != slot.dtype for p in pieces) or not shapes_fit:
            got = [f"{dtype_name(p.dtype)} {list(p.shape)}" for p in pieces]
            raise CheckpointError(f"{name}: announced as {dtype_name(slot.dtype)} {list(slot.shape)}, "
                                  f"got {', '.join(got)}")
        self._written.add(name)
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            # Two writers: where one thread's pwrite into the page cache swings from run to run
            # (2-5 GB/s in docs/convert.md's measurements), two hold a steady ~4.8 GB/s.
            self._pool = ThreadPoolExecutor(max_workers=self.WORKERS, thread_name_prefix="mmparity-writer")
        # A column range of a matrix (a row-parallel TP part) is written row by row from where it
        # is; any other non-contiguous piece is copied here, on the producer's thread.
        pieces = [_writable(p) for p in pieces]
        self._inflight.append(self._pool.submit(self._write_one, name, slot, pieces))
        while len(self._inflight) > self._max_inflight:
            self._inflight.popleft().result()
        fault_point("tensor")

    def _write_one(self, name: str, slot: Slot, pieces: list) -> None:
        hasher = PieceHasher(slot.dtype, slot.shape)
        prefault(q for p in pieces for q in (p.parts if isinstance(p, ColumnJoin) else [p]))
        offset = slot.offset
        fd = self._fds[slot.file]
        if slot.head:
            pwrite_all(fd, slot.head, offset - len(slot.head))
        for piece in pieces:
            if not piece.numel():
                continue
            if isinstance(piece, torch.Tensor) and piece.is_contiguous():
                data = piece.reshape(-1).view(torch.uint8).numpy()
                found = self._locate(piece) if self._locate is not None else None
                if found is not None:
                    copy_file_range_all(found[0], found[1], fd, offset, data.nbytes)
                else:
                    pwrite_all(fd, data, offset)
                hasher.update_bytes(data)
                offset += data.nbytes
                continue
            # Row runs: of one column range, or of every part of a ColumnJoin side by side.
            parts = [_row_bytes(p) for p in (piece.parts if isinstance(piece, ColumnJoin) else [piece]) if p.numel()]
            step = max(1, _ROWS_PER_SYSCALL // len(parts))
            for first in range(0, parts[0].shape[0], step):
                chunk = [part[row] for row in range(first, min(first + step, parts[0].shape[0])) for part in parts]
                offset = _pwritev_all(fd, chunk, offset)
                for run in chunk:
                    hasher.update_bytes(run)
        if slot.tail:
            pwrite_all(fd, slot.tail, slot.offset + slot.nbytes)
        start_writeback(fd, slot.offset - len(slot.head), len(slot.head) + slot.nbytes + len(slot.tail))
        self.checksums[name] = hasher.result()
        with self._lock:
            self._remaining[slot.file] -= 1
            finished = self._remaining[slot.file] == 0
        if finished:
            self._finish_file(slot.file)

    def _finish_file(self, number: int) -> None:
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
        missing = sorted(set(self.slots) - set(self.checksums))
        self.abort()
        if missing:
            raise CheckpointError(f"{self.directory}: {len(missing)} announced tensor(s) never written, "
                                  f"e.g. {', '.join(missing[:4])}")

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


# --- safetensors output laid out in advance ------------------------------------------------------

# The inverse of _SAFETENSORS_DTYPES: what a writer puts in a header.
_SAFETENSORS_CODES = {dtype: code for code, dtype in _SAFETENSORS_DTYPES.items()}


class StreamingSafetensorsWriter:
    """HF safetensors shards written tensor by tensor, in any order, without buffering.

    Every tensor's name, dtype and shape is known before any is produced (the converter's dry run
    says so), so each shard's header and byte layout are fixed up front: tensors are assigned to
    shards greedily in the given order (HF's rule, a tensor larger than the limit gets a shard of
    its own), laid out inside a shard by decreasing alignment so every tensor's bytes stay aligned,
    and a `SlotWriter` puts each tensor (or its pieces) at its offset. Output names follow
    `save_pretrained`: `model.safetensors`, or `model-0000i-of-0000N.safetensors` plus
    `model.safetensors.index.json`.
    """

    def __init__(self, directory: str | os.PathLike, entries: Sequence[tuple[str, torch.dtype, tuple]], *,
                 max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, metadata: Mapping[str, str] | None = None,
                 locate=None):
        self.directory = Path(directory)
        limit = parse_size(max_shard_size)
        if not entries:
            raise CheckpointError(f"{self.directory}: refusing to write a checkpoint with no tensors")
        names = [name for name, _, _ in entries]
        if len(set(names)) != len(names):
            raise CheckpointError(f"{self.directory}: a tensor name appears twice")
        shards: list[list] = []
        size = 0
        for name, dtype, shape in entries:
            if dtype not in _SAFETENSORS_CODES:
                raise CheckpointError(f"{name}: dtype {dtype} cannot be stored in safetensors")
            nbytes = math.prod(shape) * dtype.itemsize
            if not shards or (shards[-1] and size + nbytes > limit):
                shards.append([])
                size = 0
            shards[-1].append((name, dtype, tuple(shape), nbytes))
            size += nbytes
        count = len(shards)
        self.files = ([SAFETENSORS_SINGLE_FILE] if count == 1 else
                      [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        self.weight_map: dict[str, str] = {}
        self.total_bytes = sum(e[3] for s in shards for e in s)
        self.total_parameters = sum(e[3] // e[1].itemsize for s in shards for e in s)
        header_metadata = {**_HF_FORMAT_METADATA, **{str(k): str(v) for k, v in (metadata or {}).items()}}
        fds: list[int] = []
        slots: dict[str, Slot] = {}
        try:
            for number, shard in enumerate(shards):
                ordered = sorted(shard, key=lambda e: (-e[1].itemsize, e[0]))
                header: dict = {"__metadata__": header_metadata}
                offset = 0
                for name, dtype, shape, nbytes in ordered:
                    header[name] = {"dtype": _SAFETENSORS_CODES[dtype], "shape": list(shape),
                                    "data_offsets": [offset, offset + nbytes]}
                    offset += nbytes
                blob = json.dumps(header, separators=(",", ":")).encode()
                blob += b" " * (-len(blob) % 8)  # so the byte buffer starts 8-aligned
                start = 8 + len(blob)
                fd = os.open(self.directory / self.files[number], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                fds.append(fd)
                pwrite_all(fd, len(blob).to_bytes(8, "little") + blob, 0)
                os.ftruncate(fd, start + offset)
                for name, dtype, shape, nbytes in ordered:
                    slots[name] = Slot(number, start + header[name]["data_offsets"][0], nbytes, dtype, shape)
                    self.weight_map[name] = self.files[number]
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._slots = SlotWriter(self.directory, fds, slots, locate=locate)
        self.checksums = self._slots.checksums

    def write(self, name: str, tensor: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """`tensor` may also be consecutive pieces of the tensor's C-order bytes."""
        self._slots.write(name, tensor)

    def close(self) -> list[str]:
        """Checks every announced tensor was written, writes the index if sharded; returns file names."""
        self._slots.close()
        if len(self.files) == 1:
            return list(self.files)
        index = {"metadata": {"total_parameters": self.total_parameters, "total_size": self.total_bytes},
                 "weight_map": dict(sorted(self.weight_map.items()))}
        with open(self.directory / SAFETENSORS_INDEX_FILE, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
        return list(self.files) + [SAFETENSORS_INDEX_FILE]

    def abort(self) -> None:
        self._slots.abort()


# --- heap -----------------------------------------------------------------------------------------

class HeapBudget:
    """Keeps freed heap memory from piling up while tensors stream through.

    Tensor-sized blocks freed back to glibc's heap are reused by later tensors, which is fast; but a
    stream of differently sized tensors fragments the heap, and the free part of it stays resident
    (measured: 800 MB free heap, all anonymous memory, after streaming a 0.9 GB checkpoint). Serving
    every large block from its own mapping instead (a fixed mmap threshold) bounds memory but pays
    fresh page faults on every tensor, which measured 2-3x slower. So: keep the heap, and when its
    free part exceeds `budget` bytes, `malloc_trim` hands the free pages back. No-op without glibc.
    """

    def __init__(self, budget: int = 128 * 2**20):
        self.budget = budget
        self._since_check = 0
        self._libc = None
        lib = libc()
        if lib is None:
            return
        try:
            class MallInfo2(ctypes.Structure):
                _fields_ = [(name, ctypes.c_size_t) for name in (
                    "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                    "fordblks", "keepcost")]

            lib.mallinfo2.restype = MallInfo2
            lib.malloc_trim.argtypes = [ctypes.c_size_t]
            self._libc = lib
        except AttributeError:  # a libc without mallinfo2 (not glibc, or glibc < 2.33)
            pass

    def check(self, nbytes: int) -> None:
        """Called after ``nbytes`` more bytes passed through the heap. mallinfo2 walks the free
        lists, and its cost grows with everything imported before it (a 0.9 GB conversion spent
        37 ms in it when called per tensor): the free part can only have grown by what passed
        through, so it is read once per ``budget / 8`` bytes."""
        if self._libc is None:
            return
        self._since_check += nbytes
        if self._since_check < self.budget // 8:
            return
        self._since_check = 0
        if self._libc.mallinfo2().fordblks > self.budget:
            self._libc.malloc_trim(0)


_HEAP = None


def heap_budget() -> HeapBudget:
    global _HEAP
    if _HEAP is None:
        _HEAP = HeapBudget()
    return _HEAP
