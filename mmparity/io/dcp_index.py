"""Plain records that DCP's ``.metadata`` pickle is decoded into when nothing needs DCP itself.

Reading a torch_dist checkpoint's tensors needs its index (which chunk of which tensor lies at
which byte range of which file), not DCP's classes: importing ``torch.distributed.checkpoint`` is
DTensor and sympy, half a CPU-second before a small conversion has read a byte. So
``unpickle`` resolves DCP's metadata class names to these stand-ins (never to DCP's modules); they
hold what the pickle gives them (a ``torch.Size`` as a plain tuple) and have the attributes DCP's
own classes have. A conversion keeps the index to its end, so the records made once per chunk or
item are kept small (``_Compact``). Only megatron-core's loader (``torch_dist.load_torch_dist``),
which is DCP's reader, decodes into DCP's real classes.
"""

from __future__ import annotations

import operator

__all__ = ["substitutes", "is_tensor_entry"]


class _Record:
    """A dataclass instance as the pickle fills it (``BUILD`` sets the attributes)."""

    __slots__ = ()  # subclasses that name no slots of their own keep an instance dict

    def __init__(self, *args, **kwargs):  # REDUCE of a record: nothing DCP pickles passes arguments
        if args or kwargs:
            raise TypeError(f"{type(self).__name__} takes no arguments here")

    def _fields(self) -> dict:
        return dict(vars(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._fields().items())})"

    def __eq__(self, other):
        return type(other) is type(self) and other._fields() == self._fields()

    __hash__ = None


class _Compact(_Record):
    """A record the index holds one of per chunk or per item (tens of thousands in a many-expert
    checkpoint): its fields in slots, since an instance dict each was most of what a conversion
    from torch_dist held per tensor. A field that another DCP version adds, and the class does not
    name, is kept in ``_extra``, a dict made only when a pickle has one, so nothing the pickle says
    is dropped (a ``__dict__`` slot would do the same at 32 bytes a record, used or not)."""

    __slots__ = ("_extra",)
    _names: tuple = ()  # the fields DCP's class has, in its order: each subclass's slots
    _defaults: dict = {}  # what DCP's dataclass defaults to when the pickle leaves a field out

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._names = cls._names + tuple(cls.__dict__.get("__slots__", ()))

    def __getattr__(self, name):  # reached only for a name that no slot holds
        if name != "_extra":
            try:
                return self._extra[name]
            except (AttributeError, KeyError):
                pass
            if name in self._defaults:
                return self._defaults[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setstate__(self, state):
        # As pickle's own BUILD fills an instance: its dict, or (dict, slot values). Run once per
        # record of the index, so the fields DCP's class has take the shortest path.
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        names = self._names
        for part in parts:
            if part is None:
                continue
            if not isinstance(part, dict):
                raise TypeError(f"{type(self).__name__}: state of type {type(part).__name__}")
            for name, value in part.items():
                if name in names:
                    setattr(self, name, value)
                elif not isinstance(name, str) or name.startswith("__"):
                    raise TypeError(f"{type(self).__name__}: a field named {name!r}")
                else:
                    try:
                        extra = self._extra
                    except AttributeError:
                        extra = self._extra = {}
                    extra[name] = value

    def __getstate__(self):
        return self._fields()

    def _fields(self) -> dict:
        found = {}
        for name in self._names:
            try:  # the slot itself: a field the pickle left out is not shown with its default
                found[name] = object.__getattribute__(self, name)
            except AttributeError:
                pass
        return {**found, **getattr(self, "_extra", {})}


class Metadata(_Record):
    planner_data = None
    storage_meta = None


class StorageMeta(_Record):
    pass


class TensorStorageMetadata(_Compact):
    __slots__ = ("properties", "size", "chunks")


class ChunkStorageMetadata(_Compact):
    __slots__ = ("offsets", "sizes")


class BytesStorageMetadata(_Compact):
    __slots__ = ()


class TensorProperties(_Compact):
    """DCP pickles its properties as a tuple (its own ``__getstate__``)."""

    __slots__ = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

    def __setstate__(self, state):
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state

    def __getstate__(self):
        return self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory


class MetadataIndex(_Compact):
    """A ``storage_data`` key: (tensor name, chunk offset), hashable as DCP's is."""

    __slots__ = ("fqn", "offset", "index")
    _defaults = {"index": None}

    @classmethod
    def of(cls, fqn: str, offset: tuple | None) -> MetadataIndex:
        """The key of ``fqn``'s chunk at ``offset`` (None for a byte item), to look one up."""
        key = cls()
        key.fqn, key.offset = fqn, offset
        return key

    def _identity(self):
        offset = getattr(self, "offset", None)
        return self.fqn, None if offset is None else tuple(offset)

    def __eq__(self, other):
        return type(other) is type(self) and self._identity() == other._identity()

    def __hash__(self):
        return hash(self._identity())


class _StorageInfo(_Compact):
    __slots__ = ("relative_path", "offset", "length", "transform_descriptors")
    _defaults = {"transform_descriptors": None}


class _StoragePrefix(_Record):
    pass


# What megatron-core adds to the index (every rank's save plans) and DCP's stream extensions.
class SavePlan(_Record):
    pass


class WriteItem(_Record):
    pass


class TensorWriteData(_Record):
    pass


class BytesIOWriteData(_Record):
    pass


class ExtensionRegistry(_Record):
    pass


class StreamTransformExtension(_Record):
    pass


def _enum_value(value):
    """DCP's enums (the memory format, a write item's type) pickle as ``Enum(value)``."""
    if not isinstance(value, (int, str)):
        raise TypeError(f"an enum value of type {type(value).__name__}")
    return value


def _shapes():
    """``torch.Size`` as one decode makes it: a plain tuple (what every reader of the index turns
    it into anyway), one object for all equal shapes (a stack of layers repeats its chunk sizes and
    low offsets in every chunk)."""
    made: dict[tuple, tuple] = {}

    def size(values=()):
        shape = tuple(map(int, map(operator.index, values)))  # ints, as torch.Size would refuse others
        return made.setdefault(shape, shape)

    return size


_METADATA = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
_RECORDS = {
    **{(_METADATA, c.__name__): c for c in (Metadata, StorageMeta, TensorStorageMetadata, ChunkStorageMetadata,
                                             BytesStorageMetadata, TensorProperties, MetadataIndex)},
    (_METADATA, "_MEM_FORMAT_ENCODING"): _enum_value,
    **{(_PLANNER, c.__name__): c for c in (SavePlan, WriteItem, TensorWriteData, BytesIOWriteData)},
    (_PLANNER, "WriteItemType"): _enum_value,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"): _StoragePrefix,
    ("torch.distributed.checkpoint._extension", "ExtensionRegistry"): ExtensionRegistry,
    ("torch.distributed.checkpoint._extension", "StreamTransformExtension"): StreamTransformExtension,
}


def substitutes() -> dict:
    """The (module, name) -> stand-in mapping for one decode of a ``.metadata`` (fresh each time:
    its shapes are shared within that decode only, so nothing outlives the index)."""
    return {**_RECORDS, ("torch", "Size"): _shapes()}


def is_tensor_entry(entry) -> bool:
    """A ``state_dict_metadata`` entry of a tensor (DCP's class or the stand-in), not a byte object."""
    return hasattr(entry, "chunks") and hasattr(entry, "properties")
