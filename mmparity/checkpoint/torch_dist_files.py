"""Reading a torch_dist checkpoint's global tensors without megatron and without a process group.

`megatron.core.dist_checkpointing` stores each ShardedTensor as one *global* tensor in
torch.distributed.checkpoint (DCP) files, whatever TP size wrote it: column-parallel weights are
whole, the swiglu factory stores `[gate; up]` over all ranks, fused QKV keeps mcore's per-group
order. So the global tensors are exactly a TP = 1 state dict, apart from one thing: a homogeneous
`TransformerBlock` stacks its layers along a prepended axis under a key without a layer number
(`decoder.layers.mlp.linear_fc1.weight` of shape `[num_layers, ...]`). `global_state_dict`
unstacks those into `decoder.layers.{i}.` keys, giving the TP = 1, PP = 1 state dict a converter
takes.

Trust: DCP's `.metadata` file is a pickle. We never hand it to plain `pickle.load` (which is what
torch's `FileSystemReader` does): `load_metadata` reads the file once and decodes those bytes with
`unpickle`'s allow-list of DCP's metadata and plan classes, `torch.Size` and dtypes, refusing
anything else. The tensor items themselves are read by DCP with `torch.load(weights_only=True)`
or mapped in place. Byte items (`_extra_state`, `common_state`) are pickles too: `object_bytes`
reads an item's raw bytes (to checksum them), and `load_object` decodes them under
`unpickle.OBJECT_NAMES`.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from mmparity import errors
from mmparity.checkpoint import unpickle
from mmparity.checkpoint.fsio.errors import CheckpointError
from mmparity.checkpoint.fsio.paths import is_plain_relative_path, require_regular_file
from mmparity.checkpoint.layout import DIST_CONFIG_FILE

__all__ = [
    "is_torch_dist_dir",
    "load_metadata",
    "TorchDistFiles",
    "tensor_metadata",
    "object_keys",
    "object_bytes",
    "read_tensor",
    "iter_tensors",
    "global_state_dict",
]

# mcore's container for non-sharded state in mcore >= 0.19 (a pickled object, not a tensor).
_COMMON_STATE_KEY = "common_state"


def is_torch_dist_dir(path: str | os.PathLike) -> bool:
    path = Path(path)
    # .metadata only has to be there: what it is (a FIFO, say) is load_metadata's to refuse, by name.
    return (path / DIST_CONFIG_FILE).is_file() and os.path.lexists(path / ".metadata")


def load_metadata(path: str | os.PathLike):
    """A torch_dist directory's DCP `Metadata`, unpickled with an allow-list (see the trust note)."""
    path = Path(path)
    if not is_torch_dist_dir(path):
        raise CheckpointError(f"{path}: not a torch_dist checkpoint directory (needs .metadata and {DIST_CONFIG_FILE})")
    require_regular_file(path / ".metadata", "DCP metadata")
    with open(path / ".metadata", "rb") as f:
        data = f.read()
    metadata = unpickle.loads(data, unpickle.DCP_METADATA_NAMES, f"{path / '.metadata'} (torch_dist metadata)")
    if not hasattr(metadata, "state_dict_metadata") or not hasattr(metadata, "storage_data"):
        raise CheckpointError(f"{path}: .metadata does not hold DCP checkpoint metadata")
    _check_storage(path, metadata)
    return metadata


def _check_storage(path: Path, metadata) -> None:
    """Every byte range `.metadata` names lies in a regular file inside the checkpoint directory.

    DCP's reader opens `path / relative_path` as it finds it: a `../..` path would read another
    checkpoint's data (and certify it), a FIFO would block the reader forever, a range past the end
    of its file fails deep inside DCP. All checked here from names and `stat`, before any open.
    """
    sizes: dict[str, int] = {}
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"{path / '.metadata'}: storage_data is a {type(storage).__name__}, not a dict")
    for index, info in storage.items():
        fqn = getattr(index, "fqn", index)
        relative = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not is_plain_relative_path(relative):
            raise CheckpointError(f"{path / '.metadata'}: {fqn!r} is stored in {relative!r}, a path outside the "
                                  "checkpoint directory; refusing to read it")
        if relative not in sizes:
            sizes[relative] = require_regular_file(path / relative, "data file").st_size
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (offset, length)):
            raise CheckpointError(f"{path / '.metadata'}: {fqn!r} has an invalid byte range {offset!r}+{length!r}")
        if offset + length > sizes[relative]:
            raise CheckpointError(f"{path / relative}: holds {sizes[relative]} bytes, but .metadata places {fqn!r} "
                                  f"at bytes {offset}..{offset + length} (a truncated file?)")


def _dcp_exception() -> type:
    """DCP reports a failed read as a `CheckpointException`, which derives from BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def storage_reader(path: Path, metadata=None):
    """DCP's `FileSystemReader` with `.metadata` decoded by `load_metadata`, or ``metadata`` (one
    decoded read, shared by everything a load does) served as is."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata = load_metadata(path) if fixed is None else fixed

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    fixed = metadata
    if not is_torch_dist_dir(path):
        raise CheckpointError(f"{path}: not a torch_dist checkpoint directory (needs .metadata and {DIST_CONFIG_FILE})")
    return SafeFileSystemReader(str(path))



def decode_object(path: str | os.PathLike, key: str, data: bytes, metadata=None):
    """One byte item (a ShardedObject's ``torch.save`` bytes, as read) decoded under the object
    allow-list; a refusal names the file that holds it and the key."""
    path = Path(path)
    where = f"{path}: object {key!r}"
    if metadata is not None:
        found = [info for index, info in metadata.storage_data.items() if getattr(index, "fqn", index) == key]
        if len(found) == 1:
            where = f"{path / found[0].relative_path}: object {key!r}"
    return unpickle.load_torch_archive(data, unpickle.OBJECT_NAMES, where)


def tensor_metadata(path: str | os.PathLike) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Sharded key -> (dtype, global shape) for every tensor; byte objects (`_extra_state`) are skipped."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = load_metadata(path)
    return {
        key: (entry.properties.dtype, tuple(entry.size))
        for key, entry in sorted(metadata.state_dict_metadata.items())
        if isinstance(entry, TensorStorageMetadata)
    }


def object_keys(path: str | os.PathLike, metadata=None) -> list[str]:
    """The DCP keys of the byte objects (mcore's ``ShardedObject`` unique keys,
    ``<key>/shard_<offset>_<shape>``), mcore's own ``common_state`` left out."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = load_metadata(path) if metadata is None else metadata
    return sorted(key for key, entry in metadata.state_dict_metadata.items()
                  if isinstance(entry, BytesStorageMetadata) and key.split("/")[0] != _COMMON_STATE_KEY)


def object_bytes(path: str | os.PathLike, key: str, metadata=None) -> bytes:
    """The stored (pickled, never unpickled here) bytes of one byte object."""
    path = Path(path)
    metadata = load_metadata(path) if metadata is None else metadata
    found = [info for index, info in metadata.storage_data.items() if getattr(index, "fqn", index) == key]
    if len(found) != 1:
        raise CheckpointError(f"{path}: {len(found)} stored items for the object {key!r}")
    info = found[0]
    # load_metadata checked the range lies inside a regular file of the directory.
    with open(path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    if len(data) != info.length:
        raise CheckpointError(f"{path / info.relative_path}: short read of the object {key!r}")
    return data


def read_tensor(path: str | os.PathLike, key: str, metadata: dict | None = None) -> torch.Tensor:
    """One global tensor, assembled from every rank's shards by DCP (only its bytes are read)."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    metadata = tensor_metadata(path) if metadata is None else metadata
    if key not in metadata:
        raise CheckpointError(f"{path}: no tensor {key!r} in the checkpoint")
    dtype, shape = metadata[key]
    target = {key: torch.empty(shape, dtype=dtype)}
    try:
        # no_dist: a plain local read, usable from any process with or without a process group
        # (torch warns that it assumes a single process, which is exactly the intent).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(target, storage_reader=storage_reader(path), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, _dcp_exception()) as exc:
        raise CheckpointError(f"{path}: cannot read {key!r} ({errors.one_line(exc, 300)})") from None
    return target[key]


def iter_tensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(sharded key, global tensor) one at a time, in key order."""
    metadata = tensor_metadata(path)
    for key in metadata:
        if key == _COMMON_STATE_KEY:
            continue
        yield key, read_tensor(path, key, metadata)


def global_state_dict(path: str | os.PathLike, *, layer_prefix: str = "decoder.layers.") -> dict[str, torch.Tensor]:
    """The TP = 1, PP = 1 state dict (sharded-key spelling, i.e. TE spelling) of a torch_dist dir.

    Keys under `layer_prefix` without a layer number carry the layer-stack axis first and are split
    into `{layer_prefix}{i}.` keys; keys that already carry a number (non-homogeneous blocks) pass
    through. The per-layer tensors are views of the stacked one.
    """
    stacked = re.compile(rf"^{re.escape(layer_prefix)}(?!\d+\.)(.+)$")
    state: dict[str, torch.Tensor] = {}
    for key, tensor in iter_tensors(path):
        match = stacked.match(key)
        if match is None:
            state[key] = tensor
            continue
        if tensor.dim() == 0:
            raise CheckpointError(f"{path}: {key!r} should carry a layer axis but is a scalar")
        for index, layer_tensor in enumerate(tensor.unbind(0)):
            state[f"{layer_prefix}{index}.{match.group(1)}"] = layer_tensor
    return state


def torch_save_frame(dtype: torch.dtype, shape: tuple) -> tuple[bytes, int, bytes, bytes]:
    """What `torch.save` (without CRC32) writes around one contiguous tensor's bytes:
    (head, nbytes, tail, the data.pkl record), cached per (dtype, shape).

    Made under `skip_data` in a sparse scratch file, so no tensor bytes are needed or read. DCP
    stores every tensor item as such a blob: a writer puts the frame around bytes it writes in
    place, a reader compares data.pkl to tell a plain contiguous tensor it may map directly.
    """
    key = (dtype, tuple(int(n) for n in shape))
    cached = _FRAMES.get(key)
    if cached is not None:
        return cached
    import tempfile

    from mmparity.checkpoint.fsio.slots import torch_save_without_crc32

    nbytes = _numel(key[1]) * dtype.itemsize
    # PyTorchFileWriter names the archive after the file: "archive", as torch.save into a stream
    # (what DCP does) names it, so the frames, and the checkpoints, are the same from run to run.
    with tempfile.TemporaryDirectory(prefix="mmparity-frame-") as scratch:
        name = os.path.join(scratch, "archive")
        with warnings.catch_warnings(), torch_save_without_crc32():
            warnings.simplefilter("ignore")  # skip_data is marked as a prototype
            with torch.serialization.skip_data():
                torch.save(torch.empty(key[1], dtype=dtype), name)
        reader = torch._C.PyTorchFileReader(name)
        if reader.get_record_size("data/0") != nbytes:
            raise CheckpointError(f"torch.save laid out a {dtype} {list(shape)} tensor unlike mmparity expects")
        start = reader.get_record_offset("data/0")
        pickled = reader.get_record("data.pkl")
        with open(name, "rb") as f:
            head = f.read(start)
            f.seek(start + nbytes)
            tail = f.read()
    _FRAMES[key] = cached = (head, nbytes, tail, pickled)
    return cached


_FRAMES: dict = {}


class _FileRegion(io.RawIOBase):
    """A byte range of a mapped file as a read-only stream: only the bytes read are touched."""

    def __init__(self, mapping, start: int, length: int):
        super().__init__()
        self.mapping, self.start, self.length, self.position = mapping, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = base + position
        return self.position

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self.length - self.position))
        begin = self.start + self.position
        data = self.mapping[begin:begin + count]
        buffer[:len(data)] = data
        self.position += len(data)
        return len(data)


class _RegionPlanner:
    """The two `LoadPlanner` calls `FileSystemReader.read_data` makes, aimed at one target tensor."""

    def __init__(self, target: torch.Tensor):
        self.target = target

    def resolve_tensor(self, read_item) -> torch.Tensor:
        view = self.target
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, read_item, tensor) -> None:
        pass

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"{read_item.storage_index.fqn}: a byte object, not a tensor")


class TorchDistFiles:
    """One torch_dist directory opened for many reads: metadata unpickled once (safely), and any
    rectangular region of a global tensor read without reading the rest.

    `read_region` is what makes per-layer reads of mcore's stacked layer tensors cheap: each layer
    was written as its own DCP chunk, so reading layer i touches only that chunk's bytes.
    """

    def __init__(self, path: str | os.PathLike):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = Path(path)
        self.metadata = load_metadata(self.path)
        self._reader = storage_reader(self.path)
        self._reader.set_up_storage_reader(self.metadata, True)
        self._files: dict = {}  # relative path -> copy-on-write mmap, made on first use
        from mmparity.checkpoint.fsio.pieces import FileRanges

        self.file_ranges = FileRanges()  # where mapped chunks live in the files
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            key: (entry.properties.dtype, tuple(entry.size))
            for key, entry in sorted(self.metadata.state_dict_metadata.items())
            if isinstance(entry, TensorStorageMetadata)
        }

    def covered(self, key: str, axes: int) -> set[tuple[int, ...]]:
        """The positions along the first ``axes`` axes of ``key``'s global tensor that its saved
        chunks cover: the layers of a stacked layer tensor (``axes=1``), the (layer, expert) pairs
        of a stacked expert tensor (``axes=2``). A stack of only some layers (MoE layers among
        dense ones) covers those layers alone."""
        import itertools

        positions: set[tuple[int, ...]] = set()
        for chunk in self.metadata.state_dict_metadata[key].chunks:
            ranges = [range(int(o), int(o) + int(n)) for o, n in zip(tuple(chunk.offsets)[:axes], tuple(chunk.sizes)[:axes])]
            positions.update(itertools.product(*ranges))
        return positions

    def read_region(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        if key not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor {key!r} in the checkpoint")
        dtype, shape = self.tensors[key]
        offsets, sizes = tuple(int(o) for o in offsets), tuple(int(n) for n in sizes)
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, shape)
        ):
            raise CheckpointError(f"{self.path}: region {list(offsets)}+{list(sizes)} is outside {key!r} {list(shape)}")
        if _numel(sizes):
            mapped = self._mapped_chunk(key, offsets, sizes, dtype)
            if mapped is not None:
                return mapped
        target = torch.empty(sizes, dtype=dtype)
        if target.numel() == 0:
            return target
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        items = create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
        covered = sum(_numel(item.lengths) for item in items)
        if covered != target.numel():
            raise CheckpointError(f"{self.path}: the saved chunks of {key!r} do not cover region {list(offsets)}+{list(sizes)}")
        try:
            self._reader.read_data(LoadPlan(items), _RegionPlanner(target)).wait()
        except CheckpointError:
            raise
        except (Exception, _dcp_exception()) as exc:
            raise CheckpointError(f"{self.path}: cannot read {key!r} ({errors.one_line(exc, 300)})") from None
        return target

    def _mapped_chunk(self, key: str, offsets: tuple, sizes: tuple, dtype: torch.dtype) -> torch.Tensor | None:
        """A region that is exactly one saved chunk, stored as a plain contiguous tensor, as a view
        of the file (page cache, copy-on-write, nothing read up front); None for anything else,
        which then goes through DCP's reader (two copies: a buffered read and torch.load's)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        chunks = self.metadata.state_dict_metadata[key].chunks
        if not any(tuple(c.offsets) == offsets and tuple(c.sizes) == sizes for c in chunks):
            return None
        info = self._reader.storage_data.get(MetadataIndex(key, torch.Size(offsets)))
        if info is None or getattr(info, "transform_descriptors", None):
            return None
        try:
            mapping = self._mapping(info.relative_path)
            blob = torch._C.PyTorchFileReader(_FileRegion(mapping, info.offset, info.length))
            pickled = blob.get_record("data.pkl")
            start = info.offset + blob.get_record_offset("data/0")
        except Exception:
            return None  # not the blob we know how to map: DCP's reader decides
        _head, nbytes, _tail, expected = torch_save_frame(dtype, sizes)
        # The same pickle as torch.save of a fresh contiguous tensor of this dtype and shape: no
        # storage offset, no strides of a transposed view, CPU. Anything else is read by DCP.
        if pickled != expected or start % dtype.itemsize or start + nbytes > info.offset + info.length:
            return None
        raw = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start)
        return raw.view(dtype).view(sizes)

    def _mapping(self, relative_path: str):
        mapping = self._files.get(relative_path)
        if mapping is None:
            import mmap

            from mmparity.checkpoint.fsio.pieces import mapping_address

            with open(self.path / relative_path, "rb") as f:
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._files[relative_path] = mapping
            self.file_ranges.add(mapping_address(mapping), len(mapping), self.path / relative_path)
        return mapping

    def read(self, key: str) -> torch.Tensor:
        if key not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor {key!r} in the checkpoint")
        shape = self.tensors[key][1]
        return self.read_region(key, (0,) * len(shape), shape)


def _numel(sizes) -> int:
    count = 1
    for n in sizes:
        count *= int(n)
    return count
