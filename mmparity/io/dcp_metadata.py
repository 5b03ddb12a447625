"""DCP's ``.metadata`` file, encoded without importing ``torch.distributed.checkpoint``.

The file is a pickle of DCP's ``Metadata`` dataclass tree. Pickling the real objects would need
DCP's modules imported (half a CPU-second of DTensor and sympy at start-up, for a command that
only writes bytes): ``pickle`` resolves every class it writes to check that the name leads back
to it. So this module writes the opcodes itself, naming each class by module and name, exactly as
``pickle`` would for these objects (``NEWOBJ`` and a ``BUILD`` of the instance dict; a state
tuple for ``TensorProperties``, which defines ``__setstate__``; ``REDUCE`` for ``torch.Size``, the
layout lookup and the memory-format enum). Every name used is in
``unpickle.DCP_METADATA_NAMES``, so our own reader takes the file, and DCP's reader (Megatron-LM's
loader) unpickles it into the same objects its writer would have made; the tests compare the two.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["TensorEntry", "encode_metadata"]

_DCP = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
# DCP's `_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT`: every tensor mmparity stores is contiguous.
_CONTIGUOUS = 0
# `Metadata.version` as the DCP this was checked against (torch 2.13) writes it.
DCP_VERSION = "1.0.0"


@dataclass(frozen=True)
class _Global:
    module: str
    name: str


@dataclass(frozen=True)
class _Call:
    """``func(*args)`` on load: ``REDUCE``."""
    func: _Global
    args: tuple


@dataclass(frozen=True)
class _Object:
    """An instance of ``cls`` made without ``__init__`` and given ``state`` (``NEWOBJ`` + ``BUILD``)."""
    cls: _Global
    state: object = None


class _Pairs(list):
    """A dict as (key, value) pairs: DCP's storage_data is keyed by objects, which cannot be
    dict keys here before they exist."""


class _LazyPairs:
    """(key, value) pairs made one at a time as the encoder reaches them, encoded as a dict: the
    index of a checkpoint of many thousand tensors is never a tree of objects in memory at once."""

    def __init__(self, count: int, make):
        self.count, self.make = count, make

    def __bool__(self) -> bool:
        return self.count > 0

    def __iter__(self):
        return iter(self.make())


@dataclass(frozen=True)
class _Recurring:
    """A value that recurs verbatim (a dtype's tensor properties, a shape every expert shares):
    its bytes are kept once made and copied after, instead of being walked again. ``key`` names
    it (equal keys, equal values): the encoder's table is keyed by it, not by the value's tree."""
    key: tuple
    value: object


class _Encoder:
    def __init__(self, write=None, flush_bytes: int = 1 << 20):
        self.out = bytearray(b"\x80\x02")  # PROTO 2: no framing, every reader since Python 2.3
        # With ``write``, the bytes made so far go out whenever more than ``flush_bytes`` are
        # buffered at a point where nothing still refers back into the buffer (see _pairs).
        self.write, self.flush_bytes = write, flush_bytes
        self._recurring_open = 0
        # Class names and keys recur for every chunk: written once, then fetched from the memo
        # (as pickle itself does), which keeps a many-expert model's index a third the size.
        self.memo: dict = {}
        # The bytes of each _Recurring value whose encoding added nothing to the memo: every name
        # it holds was memoized before, and memo entries never change, so it encodes the same
        # every time. Only recurring values, so the table grows with the distinct shapes, not
        # with the chunks.
        self.recurring: dict = {}
        self._by_type = {type(None): self._none, bool: self._bool, int: self._int, str: self._str,
                         tuple: self._tuple, dict: self._pairs, _Pairs: self._pairs, _LazyPairs: self._pairs,
                         list: self._list, _Global: self._global, _Call: self._call, _Recurring: self._recurring,
                         _Object: self._object}
        # Subclasses of the plain types (an IntEnum, a str subclass) by the first base they have.
        self._by_base = (bool, int, str, tuple, dict, list)

    def _memoized(self, v) -> bool:
        index = self.memo.get((type(v), v))
        if index is not None:
            self.out += b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)
            return True
        return False

    def _memoize(self, v) -> None:
        index = self.memo[(type(v), v)] = len(self.memo)
        self.out += b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)

    def value(self, v) -> None:
        encode = self._by_type.get(type(v))
        if encode is None:
            base = next((base for base in self._by_base if isinstance(v, base)), None)
            if base is None:
                raise TypeError(f"cannot encode a {type(v).__name__} in DCP metadata")
            encode = self._by_type[base]
        encode(v)

    def _none(self, v) -> None:
        self.out += b"N"

    def _bool(self, v) -> None:
        self.out += b"\x88" if v else b"\x89"

    def _int(self, v) -> None:
        if -(1 << 31) <= v < (1 << 31):
            self.out += b"J" + struct.pack("<i", v)
        else:  # file offsets of a large checkpoint
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(raw)]) + raw

    def _str(self, v) -> None:
        if not self._memoized(v):
            raw = v.encode("utf-8")
            self.out += b"X" + struct.pack("<I", len(raw)) + raw
            self._memoize(v)

    def _tuple(self, v) -> None:
        self.out += b"("
        for item in v:
            self.value(item)
        self.out += b"t"

    def _pairs(self, v) -> None:
        self.out += b"}"
        if v:
            self.out += b"("
            lazy = isinstance(v, _LazyPairs)
            for key, item in (v.items() if isinstance(v, dict) else v):
                self.value(key)
                self.value(item)
                # Between two entries of the index: a _Recurring being encoded slices the
                # buffer from where it began, so the buffer is handed out only outside one.
                if lazy and self.write is not None and not self._recurring_open \
                        and len(self.out) >= self.flush_bytes:
                    self.flush()
            self.out += b"u"

    def _list(self, v) -> None:
        self.out += b"]"
        if v:
            self.out += b"("
            for item in v:
                self.value(item)
            self.out += b"e"

    def _global(self, v) -> None:
        if not self._memoized(v):
            self.out += b"c" + v.module.encode() + b"\n" + v.name.encode() + b"\n"
            self._memoize(v)

    def _call(self, v) -> None:
        self.value(v.func)
        self.value(tuple(v.args))
        self.out += b"R"

    def _recurring(self, v) -> None:
        made = self.recurring.get(v.key)
        if made is not None:
            self.out += made
            return
        start, memo_size = len(self.out), len(self.memo)
        self._recurring_open += 1
        try:
            self.value(v.value)
        finally:
            self._recurring_open -= 1
        if len(self.memo) == memo_size:
            self.recurring[v.key] = bytes(self.out[start:])

    def flush(self) -> None:
        self.write(self.out)
        self.out = bytearray()

    def _object(self, v) -> None:
        self.value(v.cls)
        self.out += b")\x81"  # EMPTY_TUPLE, NEWOBJ
        if v.state is not None:
            self.value(v.state)
            self.out += b"b"


def _size(values: Sequence[int], recurring: bool = False) -> _Call:
    values = tuple(int(n) for n in values)
    call = _Call(_Global("torch", "Size"), (values,))
    return _Recurring(("torch.Size", values), call) if recurring else call


def _dtype(dtype) -> _Global:
    module, _, name = str(dtype).rpartition(".")  # "torch.bfloat16"
    if module != "torch":
        raise TypeError(f"{dtype!r} is not a torch dtype")
    return _Global("torch", name)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as DCP records it: global shape, dtype, and per chunk its offsets, sizes and
    where its ``torch.save`` blob lies (relative file, offset, length)."""

    key: str
    shape: tuple[int, ...]
    dtype: object
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[str, int, int]], ...]


def encode_metadata(tensors: Sequence[TensorEntry], objects: Mapping[str, tuple[str, int, int]],
                    write: Callable[[bytearray], object] | None = None, flush_bytes: int = 1 << 20) -> bytearray | None:
    """The ``.metadata`` bytes of a DCP checkpoint holding ``tensors`` and the byte ``objects``
    (item key -> (relative file, offset, length)), as DCP's ``FileSystemWriter`` under mcore's
    save planner would write them (no planner data).

    With ``write``, the bytes are handed to it in consecutive runs of about ``flush_bytes`` as
    they are made, and nothing is returned: the index is made at the end of a conversion, when
    everything else that grows with the tensor count is still held, and it is about 280 bytes a
    tensor (19 MB at a Kimi-K2.5 release's 70,310 tensors), so it should not be whole in memory
    as well. The bytes are the same either way.

    The same contents give the same bytes: DCP's writer records the directory it wrote to and a
    random save id, which no reader uses; here the path is left out and the id is a digest of the
    contents, so a checkpoint is reproducible wherever and however often it is written."""
    tensors, objects = list(tensors), dict(objects)

    def tensor_metadata():
        for entry in tensors:
            yield entry.key, _tensor_metadata(entry)
        for key in objects:
            yield key, _Object(_Global(_DCP, "BytesStorageMetadata"))

    def storage_data():
        for entry in tensors:
            for index, (offsets, _, where) in enumerate(entry.chunks):
                yield _index(entry.key, _size(offsets), index), _storage(where)
        for key, where in objects.items():
            yield _index(key, None, None), _storage(where)

    state_dict_metadata = _LazyPairs(len(tensors) + len(objects), tensor_metadata)
    storage_pairs = _LazyPairs(sum(len(e.chunks) for e in tensors) + len(objects), storage_data)
    # The digest of repr((list(tensors), dict(objects))), its text made one entry at a time.
    hasher = hashlib.sha256()
    hasher.update(b"([")
    for number, entry in enumerate(tensors):
        hasher.update(((", " if number else "") + repr(entry)).encode())
    hasher.update(b"], {")
    for number, (key, where) in enumerate(objects.items()):
        hasher.update(((", " if number else "") + f"{key!r}: {where!r}").encode())
    hasher.update(b"})")
    digest = hasher.digest()
    storage_meta = _Object(_Global(_DCP, "StorageMeta"), {
        "checkpoint_id": None, "save_id": str(uuid.UUID(bytes=digest[:16])), "load_id": None, "modules": []})
    metadata = _Object(_Global(_DCP, "Metadata"), {
        "state_dict_metadata": state_dict_metadata, "planner_data": None, "storage_data": storage_pairs,
        "storage_meta": storage_meta, "version": DCP_VERSION})
    encoder = _Encoder(write, flush_bytes)
    encoder.value(metadata)
    encoder.out += b"."
    if write is None:
        # The buffer itself, not a bytes copy of it (see ``write``).
        return encoder.out
    encoder.flush()
    return None


@functools.lru_cache(maxsize=None)
def _properties(dtype) -> _Recurring:
    return _Recurring(("TensorProperties", str(dtype)), _Object(_Global(_DCP, "TensorProperties"), (
        _dtype(dtype),
        _Call(_Global("torch.serialization", "_get_layout"), ("torch.strided",)),
        False,
        _Call(_Global(_DCP, "_MEM_FORMAT_ENCODING"), (_CONTIGUOUS,)),
        False,
    )))


def _tensor_metadata(entry: TensorEntry) -> _Object:
    # Offsets are nearly all distinct (not worth keeping); shapes and properties recur.
    chunks = [_Object(_Global(_DCP, "ChunkStorageMetadata"),
                      {"offsets": _size(offsets), "sizes": _size(sizes, recurring=True)})
              for offsets, sizes, _ in entry.chunks]
    return _Object(_Global(_DCP, "TensorStorageMetadata"), {
        "properties": _properties(entry.dtype), "size": _size(entry.shape, recurring=True), "chunks": chunks})


def _index(fqn: str, offset, index) -> _Object:
    return _Object(_Global(_DCP, "MetadataIndex"), {"fqn": fqn, "offset": offset, "index": index})


def _storage(where: tuple[str, int, int]) -> _Object:
    relative_path, offset, length = where
    return _Object(_Global(_FILESYSTEM, "_StorageInfo"),
                   {"relative_path": relative_path, "offset": int(offset), "length": int(length)})
