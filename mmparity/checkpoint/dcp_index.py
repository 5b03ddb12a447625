"""Plain records that DCP's ``.metadata`` pickle is decoded into when nothing needs DCP itself.

Reading a torch_dist checkpoint's tensors needs its index (which chunk of which tensor lies at
which byte range of which file), not DCP's classes: importing ``torch.distributed.checkpoint`` is
DTensor and sympy, half a CPU-second before a small conversion has read a byte. So
``unpickle`` resolves DCP's metadata class names to these stand-ins (never to DCP's modules); they
hold what the pickle gives them and have the attributes DCP's own classes have. Only megatron-core's
loader (``torch_dist.load_torch_dist``), which is DCP's reader, decodes into DCP's real classes.
"""

from __future__ import annotations

__all__ = ["SUBSTITUTES", "is_tensor_entry"]


class _Record:
    """A dataclass instance as the pickle fills it (``BUILD`` sets the attributes)."""

    def __init__(self, *args, **kwargs):  # REDUCE of a record: nothing DCP pickles passes arguments
        if args or kwargs:
            raise TypeError(f"{type(self).__name__} takes no arguments here")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def __eq__(self, other):
        return type(other) is type(self) and vars(other) == vars(self)

    __hash__ = None


class Metadata(_Record):
    planner_data = None
    storage_meta = None


class StorageMeta(_Record):
    pass


class TensorStorageMetadata(_Record):
    pass


class ChunkStorageMetadata(_Record):
    pass


class BytesStorageMetadata(_Record):
    pass


class TensorProperties(_Record):
    """DCP pickles its properties as a tuple (its own ``__getstate__``)."""

    def __setstate__(self, state):
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state


class MetadataIndex(_Record):
    """A ``storage_data`` key: (tensor name, chunk offset), hashable as DCP's is."""

    index = None

    def _identity(self):
        offset = getattr(self, "offset", None)
        return self.fqn, None if offset is None else tuple(offset)

    def __eq__(self, other):
        return type(other) is type(self) and self._identity() == other._identity()

    def __hash__(self):
        return hash(self._identity())


class _StorageInfo(_Record):
    transform_descriptors = None


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


_METADATA = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
SUBSTITUTES = {
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


def is_tensor_entry(entry) -> bool:
    """A ``state_dict_metadata`` entry of a tensor (DCP's class or the stand-in), not a byte object."""
    return hasattr(entry, "chunks") and hasattr(entry, "properties")
