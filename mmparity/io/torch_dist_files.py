"""Reading a torch_dist checkpoint's global tensors without megatron, DCP or a process group.

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
anything else; `load_index` decodes the same bytes into `dcp_index`'s plain records, so that
reading needs no import of torch.distributed.checkpoint (`load_metadata`'s DCP classes are for
megatron-core's loader alone). The tensor items themselves are mapped in place, or decoded under
`unpickle.OBJECT_NAMES` when a blob is not a plain contiguous tensor. Byte items (`_extra_state`, `common_state`) are pickles too: `object_bytes`
reads an item's raw bytes (to checksum them), and `load_object` decodes them under
`unpickle.OBJECT_NAMES`.
"""

from __future__ import annotations

import bisect
import io
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from mmparity.io import dcp_index, unpickle
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.paths import is_plain_relative_path, require_regular_file
from mmparity.io.fsio.pieces import FileRanges, mapping_address
from mmparity.io.fsio.slots import Slot, torch_save_without_crc32
from mmparity.io.fsio.torch_archive import TorchArchive
from mmparity.io.layout import DIST_CONFIG_FILE

__all__ = [
    "is_torch_dist_dir",
    "load_metadata",
    "load_index",
    "TorchDistFiles",
    "tensor_metadata",
    "object_keys",
    "object_bytes",
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
    """A torch_dist directory's DCP `Metadata` in DCP's own classes, unpickled with an allow-list
    (see the trust note): what DCP's reader (megatron-core's loader) is given. Everything else
    reads `load_index`, which needs no DCP import."""
    return _decode_metadata(Path(path), None)


def load_index(path: str | os.PathLike):
    """The same `.metadata` decoded into `dcp_index`'s plain records (same attributes), without
    importing torch.distributed.checkpoint."""
    return _decode_metadata(Path(path), dcp_index.substitutes())


def _decode_metadata(path: Path, substitutes):
    if not is_torch_dist_dir(path):
        raise CheckpointError(f"{path}: not a torch_dist checkpoint directory (needs .metadata and {DIST_CONFIG_FILE})")
    require_regular_file(path / ".metadata", "DCP metadata")
    with open(path / ".metadata", "rb") as f:
        data = f.read()
    metadata = unpickle.loads(data, unpickle.DCP_METADATA_NAMES, f"{path / '.metadata'} (torch_dist metadata)",
                              substitutes=substitutes)
    if not hasattr(metadata, "state_dict_metadata") or not hasattr(metadata, "storage_data"):
        raise CheckpointError(f"{path}: .metadata does not hold DCP checkpoint metadata")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{path / '.metadata'}: state_dict_metadata is a "
                              f"{type(metadata.state_dict_metadata).__name__}, not a dict")
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
            if not os.path.lexists(path / relative):
                # The usual cause: a checkpoint written with --node-local, its nodes not gathered.
                raise CheckpointError(f"{path / relative}: data file is missing (written on another node with "
                                      "convert --node-local? copy every node's directory into this one)")
            sizes[relative] = require_regular_file(path / relative, "data file").st_size
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (offset, length)):
            raise CheckpointError(f"{path / '.metadata'}: {fqn!r} has an invalid byte range {offset!r}+{length!r}")
        if offset + length > sizes[relative]:
            raise CheckpointError(f"{path / relative}: holds {sizes[relative]} bytes, but .metadata places {fqn!r} "
                                  f"at bytes {offset}..{offset + length} (a truncated file?)")


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


def tensor_metadata(path: str | os.PathLike, metadata=None) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Sharded key -> (dtype, global shape) for every tensor; byte objects (`_extra_state`) are skipped."""
    metadata = load_index(path) if metadata is None else metadata
    return {
        key: (entry.properties.dtype, tuple(entry.size))
        for key, entry in sorted(metadata.state_dict_metadata.items())
        if dcp_index.is_tensor_entry(entry)
    }


def object_keys(path: str | os.PathLike, metadata=None) -> list[str]:
    """The DCP keys of the byte objects (mcore's ``ShardedObject`` unique keys,
    ``<key>/shard_<offset>_<shape>``), mcore's own ``common_state`` left out."""
    metadata = load_index(path) if metadata is None else metadata
    return sorted(key for key, entry in metadata.state_dict_metadata.items()
                  if not dcp_index.is_tensor_entry(entry) and key.split("/")[0] != _COMMON_STATE_KEY)


def object_bytes(path: str | os.PathLike, key: str, metadata=None) -> bytes:
    """The stored (pickled, never unpickled here) bytes of one byte object."""
    path = Path(path)
    metadata = load_index(path) if metadata is None else metadata
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


def iter_tensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(sharded key, global tensor) one at a time, in key order."""
    files = TorchDistFiles(path)
    for key in files.tensors:
        if key == _COMMON_STATE_KEY:
            continue
        yield key, files.read(key)


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

    nbytes = _numel(key[1]) * dtype.itemsize
    # PyTorchFileWriter names the archive after the file: "archive", as torch.save into a stream
    # (what DCP does) names it, so the frames, and the checkpoints, are the same from run to run.
    with tempfile.TemporaryDirectory(prefix="mmparity-frame-") as scratch:
        name = os.path.join(scratch, "archive")
        with warnings.catch_warnings(), torch_save_without_crc32():
            warnings.simplefilter("ignore")  # skip_data is marked as a prototype
            with torch.serialization.skip_data():
                torch.save(torch.empty(key[1], dtype=dtype), name)
        reader = TorchArchive(name)
        if reader.size("data/0") != nbytes:
            raise CheckpointError(f"torch.save laid out a {dtype} {list(shape)} tensor unlike mmparity expects")
        start = reader.offset("data/0")
        pickled = reader.read("data.pkl")
        with open(name, "rb") as f:
            head = f.read(start)
            f.seek(start + nbytes)
            tail = f.read()
    _FRAMES[key] = cached = (head, nbytes, tail, pickled)
    return cached


_FRAMES: dict = {}

# torch.save aligns a tensor's bytes to 64 inside its archive; blobs are padded apart so that they
# stay so in the data file, and a reader can map them in place.
_BLOB_ALIGN = 64


def framed_slot(offset: int, dtype: torch.dtype, sizes: tuple, record_shape: tuple):
    """Where the ``torch.save`` blob of a ``sizes`` tensor goes at or after ``offset`` in a DCP
    data file (file 0 of a ``SlotWriter``): (blob start, the ``Slot`` its tensor bytes fill,
    framed by the blob's head and tail, recorded with ``record_shape``, blob length)."""
    head, nbytes, tail, _ = torch_save_frame(dtype, sizes)
    start = offset + (-(offset + len(head)) % _BLOB_ALIGN)
    slot = Slot(0, start + len(head), nbytes, dtype, tuple(record_shape), head, tail)
    return start, slot, len(head) + nbytes + len(tail)


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


class TorchDistFiles:
    """One torch_dist directory opened for many reads: its index unpickled once (safely, into
    `dcp_index`'s records), and any rectangular region of a global tensor read from the chunks
    that overlap it, without reading the rest and without DCP.

    `read_region` is what makes per-layer reads of mcore's stacked layer tensors cheap: each layer
    was written as its own DCP chunk, so reading layer i touches only that chunk's bytes.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.metadata = load_index(self.path)
        self._files: dict = {}  # relative path -> copy-on-write mmap, made on first use
        self.file_ranges = FileRanges()  # where mapped chunks live in the files
        # key -> (its chunks in offsets order, the largest chunk extent along each dim), made on
        # the key's first read (see _overlapping).
        self._chunk_order: dict[str, tuple[Sequence, tuple[int, ...]]] = {}
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            key: (entry.properties.dtype, tuple(entry.size))
            for key, entry in sorted(self.metadata.state_dict_metadata.items())
            if dcp_index.is_tensor_entry(entry)
        }

    def _chunks(self, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [(tuple(int(o) for o in c.offsets), tuple(int(n) for n in c.sizes))
                for c in self.metadata.state_dict_metadata[key].chunks]

    def _ordered(self, key: str) -> tuple[Sequence, tuple[int, ...]]:
        found = self._chunk_order.get(key)
        if found is None:
            chunks = self.metadata.state_dict_metadata[key].chunks
            dims = len(chunks[0].offsets) if chunks else 0
            extents = tuple(max(int(c.sizes[d]) for c in chunks) for d in range(dims))
            # The index's own list where its chunks come in offsets order (as every writer we
            # know puts them): nothing held per chunk; else a sorted list of references to them.
            if any(tuple(chunks[i].offsets) > tuple(chunks[i + 1].offsets) for i in range(len(chunks) - 1)):
                chunks = sorted(chunks, key=lambda c: tuple(c.offsets))
            found = self._chunk_order[key] = (chunks, extents)
        return found

    def _overlapping(self, key: str, offsets: tuple, sizes: tuple) -> list[tuple[tuple, tuple]]:
        """The saved chunks of ``key`` that overlap the region, as (offsets, sizes) in offsets
        order, found by bisection.

        A scan of every chunk per read made a torch_dist -> HF conversion quadratic in the experts
        of a stack: each of L x E expert reads looked at all L x E chunks of its stack (at
        Kimi-K2.5's 60 x 384, about 1.6 billion looks). In offsets order, the chunks that share
        their offsets on the dims before ``d`` are a run sorted on dim ``d``, and a chunk can only
        overlap the region if it starts less than ``extents[d]`` before it there; so each dim whose
        run still shares a prefix narrows by bisection, and a stacked layer's or expert's region
        costs a few comparisons whatever the stack's size."""
        chunks, extents = self._ordered(key)
        low, high = 0, len(chunks)
        for dim in range(len(offsets)):
            if low >= high or tuple(chunks[low].offsets[:dim]) != tuple(chunks[high - 1].offsets[:dim]):
                break
            start, count = offsets[dim], sizes[dim]
            along = lambda chunk, dim=dim: chunk.offsets[dim]  # noqa: E731
            low = bisect.bisect_left(chunks, start - extents[dim] + 1, low, high, key=along)
            high = bisect.bisect_left(chunks, start + count, low, high, key=along)
        found = []
        for chunk in chunks[low:high]:
            c, m = tuple(int(o) for o in chunk.offsets), tuple(int(n) for n in chunk.sizes)
            if len(c) == len(offsets) and all(ci < o + n and o < ci + mi for o, n, ci, mi in zip(offsets, sizes, c, m)):
                found.append((c, m))
        return found

    def covered(self, key: str, axes: int) -> set[tuple[int, ...]]:
        """The positions along the first ``axes`` axes of ``key``'s global tensor that its saved
        chunks cover: the layers of a stacked layer tensor (``axes=1``), the (layer, expert) pairs
        of a stacked expert tensor (``axes=2``). A stack of only some layers (MoE layers among
        dense ones) covers those layers alone."""
        import itertools

        positions: set[tuple[int, ...]] = set()
        for offsets, sizes in self._chunks(key):
            ranges = [range(o, o + n) for o, n in zip(offsets[:axes], sizes[:axes])]
            positions.update(itertools.product(*ranges))
        return positions

    def read_region(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        if key not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor {key!r} in the checkpoint")
        dtype, shape = self.tensors[key]
        offsets, sizes = tuple(int(o) for o in offsets), tuple(int(n) for n in sizes)
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, shape)
        ):
            raise CheckpointError(f"{self.path}: region {list(offsets)}+{list(sizes)} is outside {key!r} {list(shape)}")
        chunks = self._overlapping(key, offsets, sizes) if _numel(sizes) else []
        if (offsets, sizes) in chunks:
            return self._chunk_tensor(key, offsets, sizes, dtype)
        target = torch.empty(sizes, dtype=dtype)
        if target.numel() == 0:
            return target
        covered = 0
        for chunk_offsets, chunk_sizes in chunks:
            low = [max(o, c) for o, c in zip(offsets, chunk_offsets)]
            high = [min(o + n, c + m) for o, n, c, m in zip(offsets, sizes, chunk_offsets, chunk_sizes)]
            if any(lo >= hi for lo, hi in zip(low, high)):
                continue
            source = self._chunk_tensor(key, chunk_offsets, chunk_sizes, dtype)
            into, out_of = target, source
            for dim, (lo, hi) in enumerate(zip(low, high)):
                into = into.narrow(dim, lo - offsets[dim], hi - lo)
                out_of = out_of.narrow(dim, lo - chunk_offsets[dim], hi - lo)
            into.copy_(out_of)
            covered += into.numel()
        if covered != target.numel():
            raise CheckpointError(f"{self.path}: the saved chunks of {key!r} do not cover region {list(offsets)}+{list(sizes)}")
        return target

    def region_pieces(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> list[torch.Tensor] | None:
        """The region as the saved chunks it is made of, in C order, each a view where the file
        allows (no copy): where the chunks tile it along its first dimension longer than one (a
        gated FC1's gate and up halves, one expert of a stack). Each piece is shaped as a dim-0
        block of the region with its leading ones dropped. None where the region is not so made."""
        if key not in self.tensors:
            return None
        dtype, _ = self.tensors[key]
        offsets, sizes = tuple(int(o) for o in offsets), tuple(int(n) for n in sizes)
        split = next((d for d, n in enumerate(sizes) if n != 1), None)
        if split is None:
            return None
        inside = []
        for chunk_offsets, chunk_sizes in self._overlapping(key, offsets, sizes):
            if any((c, m) != (o, n) for d, (o, n, c, m) in enumerate(zip(offsets, sizes, chunk_offsets, chunk_sizes))
                   if d != split):
                return None  # cut along another dimension too: not consecutive bytes
            inside.append((chunk_offsets[split], chunk_sizes[split], chunk_offsets, chunk_sizes))
        inside.sort()
        position = offsets[split]
        for start, length, _, _ in inside:
            if start != position:
                return None
            position += length
        if position != offsets[split] + sizes[split] or len(inside) < 2:
            return None  # not covered, or one chunk (read_region maps that one already)
        rest = sizes[split + 1:]
        return [self._chunk_tensor(key, o, n, dtype).reshape(length, *rest) for _, length, o, n in inside]

    def _chunk_tensor(self, key: str, offsets: tuple, sizes: tuple, dtype: torch.dtype) -> torch.Tensor:
        """One saved chunk: a view of the file when it is stored as a plain contiguous tensor (page
        cache, copy-on-write, nothing read up front), else its blob decoded under
        ``unpickle.OBJECT_NAMES``."""
        # Looked up in the index itself: a second map of every chunk would hold as much again.
        info = self.metadata.storage_data.get(dcp_index.MetadataIndex.of(key, offsets))
        where = f"{self.path}: {key!r} chunk at {list(offsets)}"
        if info is None:
            raise CheckpointError(f"{where} has no stored bytes in .metadata")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{where} is stored with transforms {info.transform_descriptors!r}, which mmparity "
                                  "does not read")
        mapping = self._mapping(info.relative_path)
        region = _FileRegion(mapping, info.offset, info.length)
        mapped = self._mapped_chunk(mapping, region, info, sizes, dtype)
        if mapped is not None:
            return mapped
        # Decoded under our own allow-list (torch's weights_only list is process-wide and grows
        # with what else is imported); a refusal names the file, the chunk and the class.
        tensor = unpickle.load_torch_archive(bytes(mapping[info.offset:info.offset + info.length]),
                                             unpickle.OBJECT_NAMES, f"{self.path / info.relative_path}: "
                                             f"{key!r} chunk at {list(offsets)}")
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tuple(tensor.shape) != sizes:
            found = f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise CheckpointError(f"{where}: holds {found}, .metadata says {dtype} {list(sizes)}")
        return tensor

    @staticmethod
    def _mapped_chunk(mapping, region, info, sizes: tuple, dtype: torch.dtype) -> torch.Tensor | None:
        """The chunk as a view of the mapping when its blob is exactly what torch.save writes for a
        fresh contiguous tensor of this dtype and shape (no storage offset, no strides of a
        transposed view); None for anything else."""
        head, nbytes, tail, expected = torch_save_frame(dtype, sizes)
        end = info.offset + info.length
        if (info.length == len(head) + nbytes + len(tail) and mapping[info.offset:info.offset + len(head)] == head
                and mapping[end - len(tail):end] == tail and (info.offset + len(head)) % dtype.itemsize == 0):
            # Byte for byte the frame mmparity writes (CRC32 fields unset): the tensor's bytes are
            # where the frame puts them, no zip directory to parse (a few ms a chunk, which a
            # checkpoint of many experts has tens of thousands of).
            raw = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=info.offset + len(head))
            return raw.view(dtype).view(sizes)
        try:
            blob = torch._C.PyTorchFileReader(region)
            pickled = blob.get_record("data.pkl")
            start = info.offset + blob.get_record_offset("data/0")
        except Exception:
            return None  # not the blob we know how to map: the decoder decides
        if pickled != expected or start % dtype.itemsize or start + nbytes > info.offset + info.length:
            return None
        raw = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start)
        return raw.view(dtype).view(sizes)

    def _mapping(self, relative_path: str):
        mapping = self._files.get(relative_path)
        if mapping is None:
            import mmap

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
