"""Reading a `save_pretrained` safetensors directory as `transformers` loads it.

A single `model.safetensors` wins over `model.safetensors.index.json` when both exist (that is HF's
precedence), and a sharded checkpoint is described by its index. Nothing is loaded at open time
beyond the safetensors headers, so listing a multi-GB checkpoint is cheap, and tensors (or the TP
slice of one) are read one at a time."""

from __future__ import annotations

import bisect
import dataclasses
import math
import mmap
import os
from array import array
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from mmparity.io.fsio.bounded import read_json_file
from mmparity.io.fsio.errors import MAX_NAMES_IN_MESSAGE, CheckpointError, name_list, one_line
from mmparity.io.fsio.json_members import object_members
from mmparity.io.fsio.paths import refuse_links_outside, require_regular_file
from mmparity.io.fsio.pieces import FileRanges, mapping_address
from mmparity.io.fsio import shared
from mmparity.io.fsio.safetensors_format import (
    MAX_INDEX_BYTES, MISTRAL_CONSOLIDATED_FILE, SAFETENSORS_DTYPES, SAFETENSORS_INDEX_FILE,
    SAFETENSORS_SINGLE_FILE, entry_data_offsets)


@dataclasses.dataclass(frozen=True, slots=True)  # one per source tensor, held for the whole conversion
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
        raise CheckpointError(f"{path}: not a readable safetensors file ({one_line(exc)})") from exc


def _header_infos(handle, path: Path, file_name: str) -> dict[str, TensorInfo]:
    infos = {}
    for name in handle.keys():
        # Interned, as the rule engine's keys are: the plan names each source tensor by this object.
        name = shared.name(name)
        view = handle.get_slice(name)
        dtype_code = view.get_dtype()
        if dtype_code not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype_code}")
        infos[name] = TensorInfo(name, SAFETENSORS_DTYPES[dtype_code], shared.shape(view.get_shape()), file_name)
    return infos


def _data_offsets(text: str) -> tuple[list[str], array]:
    """The tensor names of safetensors header ``text``, sorted, and their ``(begin, end)`` in its
    data section as ``spans[2 * i]``, ``spans[2 * i + 1]`` for ``names[i]``. Kept per file while the
    checkpoint is open: a dict of tuples of ints cost about 140 bytes a tensor, this 24."""
    names, spans = [], array("q")
    for key, entry in object_members(text):
        if key == "__metadata__":
            continue
        offsets = entry_data_offsets(entry)
        if offsets is None:
            raise ValueError(f"{key!r} has no data_offsets pair")
        names.append(shared.name(key))
        spans.extend(offsets)
    order = sorted(range(len(names)), key=names.__getitem__)
    names = [names[i] for i in order]
    return names, array("q", (spans[j] for i in order for j in (2 * i, 2 * i + 1)))


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
                hint = f"; found {name_list(others)} but no index naming them" if others else ""
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
        index = read_json_file(index_path, "index", MAX_INDEX_BYTES)
        try:
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: unreadable index ({one_line(exc)})") from exc
        self.index_metadata = dict(index.get("metadata") or {})

        names_by_file: dict[str, set[str]] = {}
        for name, file_name in weight_map.items():
            if not isinstance(file_name, str) or Path(file_name).name != file_name:
                # Refuse paths that would read outside the checkpoint directory.
                raise CheckpointError(f"{index_path}: shard name {file_name!r} is not a plain file name")
            names_by_file.setdefault(file_name, set()).add(name)

        missing = [f for f in names_by_file if not os.path.lexists(self.directory / f)]
        if missing:
            raise CheckpointError(f"{index_path}: index names missing shard file(s) {name_list(missing)}")

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
                    parts.append(f"index lists {name_list(not_in_shard)} but the shard lacks them")
                if not_in_index:
                    parts.append(f"shard holds {name_list(not_in_index)} that the index assigns elsewhere or omits")
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
                f"e.g. {name_list(self.keys()[:MAX_NAMES_IN_MESSAGE])}"
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
            raise CheckpointError(f"{self.directory}: cannot read {name!r} ({one_line(exc)})") from exc

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
        mapping, data_start, names, spans = self._mapping(info.file)
        at = bisect.bisect_left(names, name)
        if at == len(names) or names[at] != name:
            raise CheckpointError(f"{self.directory / info.file}: no {name!r} in its header (a changed file?)")
        begin, end = spans[2 * at], spans[2 * at + 1]
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
        """(mmap of the file, byte offset of its data section, ``_data_offsets``), made once."""
        cached = self._mappings.get(file_name)
        if cached is not None:
            return cached
        path = self.directory / file_name
        try:
            with open(path, "rb") as f:
                header_size = int.from_bytes(f.read(8), "little")
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            # Decoded from the mapping: the header's bytes stay file cache, never a copy of the
            # process's own beside their text while it is parsed.
            with memoryview(mapping) as view:
                names, spans = _data_offsets(str(view[8:8 + header_size], "utf-8"))
        except (OSError, ValueError, OverflowError) as exc:  # OverflowError: an offset past 2**63
            raise CheckpointError(f"{path}: not a readable safetensors file ({one_line(exc)})") from exc
        self.file_ranges.add(mapping_address(mapping), len(mapping), path)
        self._mappings[file_name] = cached = (mapping, 8 + header_size, names, spans)
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
            raise CheckpointError(f"{self.directory}: cannot read {name!r} ({one_line(exc)})") from exc

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
