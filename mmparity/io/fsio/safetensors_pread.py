"""Reading single tensors of a safetensors directory with ``pread`` into fresh memory, never
mapping a file.

:class:`~mmparity.io.fsio.safetensors_read.SafetensorsCheckpoint` opens every file
through ``safe_open``, which maps the whole file: under an address-space limit smaller than a
shard (``check --low-memory`` on a model larger than the machine) that mapping alone fails. Here
opening reads only the headers, and each read allocates exactly the bytes of the tensor (or of a
dim-0 range of it) asked for, so what is resident is what the caller holds.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from mmparity.io.fsio.bounded import read_json_file
from mmparity.io.fsio.errors import CheckpointError, name_list, one_line
from mmparity.io.fsio.json_members import object_members
from mmparity.io.fsio.paths import refuse_links_outside, require_regular_file
from mmparity.io.fsio.safetensors_format import (
    MAX_INDEX_BYTES, SAFETENSORS_DTYPES, SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE, entry_data_offsets)
from mmparity.io.fsio.safetensors_read import TensorInfo

# A header larger than this is not one save_pretrained writes; refusing it keeps a corrupt length
# field from asking for gigabytes before anything is parsed.
MAX_HEADER_BYTES = 100 * 2**20


class RangeReader:
    """Tensors of a ``save_pretrained`` directory (one file or an index and its shards), read one
    at a time by byte range. ``infos()`` describes them all from the headers alone."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory")
        refuse_links_outside(self.directory, root_names=sorted(
            n for n in os.listdir(self.directory) if n == SAFETENSORS_INDEX_FILE or n.endswith(".safetensors")))
        self._infos: dict[str, TensorInfo] = {}
        self._where: dict[str, tuple[int, int]] = {}  # name -> (absolute begin, end) in its file
        self._fds: dict[str, int] = {}
        try:
            single = self.directory / SAFETENSORS_SINGLE_FILE
            index = self.directory / SAFETENSORS_INDEX_FILE
            if single.is_file():
                self._read_header(single.name, None)
            elif index.is_file():
                self._open_index(index)
            else:
                raise CheckpointError(f"{self.directory}: no {SAFETENSORS_SINGLE_FILE} or {SAFETENSORS_INDEX_FILE}")
        except BaseException:
            self.close()
            raise

    @classmethod
    def of_file(cls, path: str | os.PathLike) -> "RangeReader":
        """One safetensors file of any name (a side file beside a checkpoint), its header read and
        checked against its size, nothing else: a caller holds the declared dtypes and shapes to
        what it expects before a read allocates them (a header may declare a tensor of any size
        over a sparse file, and a mapping of that file would not fail)."""
        path = Path(path)
        reader = cls.__new__(cls)
        reader.directory, reader._infos, reader._where, reader._fds = path.parent, {}, {}, {}
        try:
            reader._read_header(path.name, None)
        except BaseException:
            reader.close()
            raise
        return reader

    def _open_index(self, index_path: Path) -> None:
        index = read_json_file(index_path, "index", MAX_INDEX_BYTES)
        try:
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: unreadable index ({one_line(exc)})") from exc
        by_file: dict[str, set] = {}
        for name, file_name in weight_map.items():
            if not isinstance(file_name, str) or Path(file_name).name != file_name:
                raise CheckpointError(f"{index_path}: shard name {file_name!r} is not a plain file name")
            by_file.setdefault(file_name, set()).add(name)
        for file_name in sorted(by_file):
            self._read_header(file_name, by_file[file_name])

    def _read_header(self, file_name: str, expected: set | None) -> None:
        path = self.directory / file_name
        require_regular_file(path, "safetensors file")
        fd = os.open(path, os.O_RDONLY)
        self._fds[file_name] = fd
        try:
            size = os.fstat(fd).st_size
            length = int.from_bytes(os.pread(fd, 8, 0), "little")
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"header length {length} does not fit a file of {size} bytes")
            text = os.pread(fd, length, 8).decode("utf-8")
            start = 8 + length
            names = set()
            # Member by member (json_members): a one-file checkpoint of a release's key set has a
            # header of 70k entries, which json.loads would make whole beside what is kept.
            for name, entry in object_members(text):
                if name == "__metadata__":
                    continue
                names.add(name)
                self._add(path, file_name, size, start, name, entry)
            del text
        except CheckpointError:
            raise
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file ({one_line(exc)})") from exc
        if expected is not None and names != expected:
            raise CheckpointError(f"{path}: index/shard key mismatch "
                                  f"({name_list(sorted(names ^ expected))} in one but not the other)")

    def _add(self, path: Path, file_name: str, size: int, start: int, name: str, entry) -> None:
        code = entry.get("dtype") if isinstance(entry, dict) else None
        if code not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {code}")
        shape, offsets = entry.get("shape"), entry_data_offsets(entry)
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape) and offsets is not None):
            raise CheckpointError(f"{path}: tensor {name!r} has no valid shape and data_offsets")
        info = TensorInfo(name, SAFETENSORS_DTYPES[code], tuple(shape), file_name)
        begin, end = offsets
        if begin < 0 or end - begin != info.nbytes or start + end > size:
            raise CheckpointError(f"{path}: {name!r} lies at bytes {begin}..{end} of a data section of "
                                  f"{size - start}, its header says {info.nbytes} bytes (a truncated file?)")
        self._infos[name] = info
        self._where[name] = (start + begin, start + end)

    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"{self.directory}: no tensor {name!r}") from None

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name`` (rows ``start:stop`` of dim 0 when given), in memory of its own."""
        info = self.info(name)
        begin, end = self._where[name]
        shape = list(info.shape)
        if start is not None or stop is not None:
            if not shape:
                raise CheckpointError(f"{self.directory}: {name!r} is a scalar and has no rows")
            lo, hi = start or 0, shape[0] if stop is None else stop
            if not 0 <= lo <= hi <= shape[0]:
                raise CheckpointError(f"{self.directory}: rows {lo}:{hi} out of range for {name!r} {shape}")
            row = math.prod(shape[1:]) * info.dtype.itemsize
            begin, end, shape[0] = begin + lo * row, begin + hi * row, hi - lo
        out = torch.empty(end - begin, dtype=torch.uint8)
        if end > begin:
            view = memoryview(out.numpy())
            fd = self._fds.get(info.file)
            if fd is None:
                raise CheckpointError(f"{self.directory}: checkpoint is closed")
            done = 0
            while done < end - begin:  # pread may return short on large reads
                got = os.preadv(fd, [view[done:]], begin + done)
                if got <= 0:
                    raise CheckpointError(f"{self.directory / info.file}: {name!r} ends early (a truncated file?)")
                done += got
        return out.view(info.dtype).view(shape)

    def nonfinite(self, name: str, max_bytes: int = 64 * 2**20) -> int:
        """How many NaN/Inf values tensor ``name`` holds (0 for integer tensors), read a range of
        rows at a time so that at most about ``max_bytes`` of it (and at least one row) is
        resident: a stacked experts tensor holds a whole layer's experts, far more than the one
        unit ``check --low-memory`` keeps resident."""
        info = self.info(name)
        if not info.dtype.is_floating_point:
            return 0
        if len(info.shape) < 2:
            value = self.read(name)
            return int(value.numel() - torch.isfinite(value).sum())
        rows = info.shape[0]
        step = max(1, max_bytes // max(1, info.nbytes // max(1, rows)))
        count = 0
        for start in range(0, rows, step):
            value = self.read(name, start, min(rows, start + step))
            count += int(value.numel() - torch.isfinite(value).sum())
            del value
        return count

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
