"""Decoding the pickles inside checkpoints without ever running code from them.

A pickle names callables (``GLOBAL module name``) and the unpickler calls them: plain
``pickle.load`` or ``torch.load(weights_only=False)`` of a checkpoint is code execution by whoever
wrote the file. Checkpoints hold pickles in four places: DCP's ``.metadata``, each DCP byte item
(mcore's ``ShardedObject``s: ``_extra_state``, ``common_state``, RNG and optimizer objects),
``common.pt`` and legacy ``model_optim_rng.pt`` files. Every one of them mmparity reads goes
through :class:`RestrictedUnpickler`, which resolves only the names of an explicit allow-list (the
plain data classes each kind of file legitimately holds) and refuses anything else by module and
name before it is imported, let alone called.

Why not ``torch.load(weights_only=True)``: its allow-list is process-wide and grows with every
``torch.serialization.add_safe_globals`` any imported library makes (megatron-core registers
sixteen classes on import), so what it accepts depends on what else is loaded. The lists here are
the whole truth about what a checkpoint may name.

What is decoded is the very bytes that were checked: callers read a file (or a byte range) once
and decode that buffer, never reopen the path.
"""

from __future__ import annotations

import io
import pickle
import types
from collections.abc import Callable, Mapping

import torch

from mmparity.io.fsio.bounded import check_bounded
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.torch_archive import TorchArchive

__all__ = [
    "RefusedPickle",
    "RestrictedUnpickler",
    "DCP_METADATA_NAMES",
    "OBJECT_NAMES",
    "LEGACY_NAMES",
    "MEGATRON_INERT_MODULES",
    "Inert",
    "inert_values",
    "torch_pickle_module",
    "loads",
    "load_torch_archive",
]


class RefusedPickle(CheckpointError):
    """A pickle names something outside the allow-list, or decodes to a value no walk of it would
    finish (``fsio.bounded``); nothing it names was imported or run."""


# DCP's `.metadata`: its own dataclasses, torch.Size, dtypes, the memory-format enum and layout
# lookup, the checkpoint path; and what megatron-core's saver adds to it (`all_local_plans`, the
# SavePlans of every rank, so a later save can reuse them).
DCP_METADATA_NAMES: Mapping[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    }),
    "torch.distributed.checkpoint.planner": frozenset({
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData",
    }),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.distributed.checkpoint._extension": frozenset({"ExtensionRegistry", "StreamTransformExtension"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
}

# torch.save names a tensor's storage by its legacy typed-storage class; the element type is read
# off the name (asking the class warns that typed storages are deprecated).
_STORAGE_DTYPES = {
    "ByteStorage": torch.uint8, "CharStorage": torch.int8, "ShortStorage": torch.int16,
    "IntStorage": torch.int32, "LongStorage": torch.int64, "HalfStorage": torch.float16,
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "BFloat16Storage": torch.bfloat16,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128, "UntypedStorage": torch.uint8,
}
_STORAGES = frozenset(_STORAGE_DTYPES)

# torch.save'd objects: DCP byte items and common.pt. TE's `_extra_state` is None, a tensor or a
# BytesIO of its own serialised state; mcore's common state is a dict of numbers and strings (and
# Megatron-LM's `args` Namespace).
OBJECT_NAMES: Mapping[str, frozenset[str]] = {
    "torch._utils": frozenset({"_rebuild_tensor_v2", "_rebuild_tensor_v3"}),
    "torch": frozenset({"Size", *_STORAGES}),
    "torch.storage": frozenset({"UntypedStorage"}),
    "collections": frozenset({"OrderedDict"}),
    "_io": frozenset({"BytesIO"}),
    "io": frozenset({"BytesIO"}),
    "argparse": frozenset({"Namespace"}),
    "types": frozenset({"SimpleNamespace"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
}

# Legacy rank files: the same, and the numpy arrays of Megatron-LM's RNG state (rebuilt from a
# dtype, a shape and raw bytes; an object array's items go through this same unpickler).
_NUMPY = frozenset({"_reconstruct", "scalar"})
LEGACY_NAMES: Mapping[str, frozenset[str]] = {
    **OBJECT_NAMES,
    "numpy.core.multiarray": _NUMPY,
    "numpy._core.multiarray": _NUMPY,
    "numpy": frozenset({"ndarray", "dtype"}),
}


# Megatron-LM's own files (its `args` Namespace, RNG, optimizer and scheduler entries) name a few of
# Megatron's classes: enums (`AttnBackend`, `ModelType`, ...) and small records. Those names are
# never imported: each becomes an :class:`Inert` record of what the pickle said (module, name,
# arguments, state), which nothing calls. Anything outside these packages is still refused, and a
# model entry holding an Inert record is refused by its reader (weights are tensors).
MEGATRON_INERT_MODULES = ("megatron.core.", "megatron.training.", "megatron.legacy.")
# Outside Megatron, only these exact classes are kept inert where Megatron classes are: Megatron-LM's
# `args.exit_signal` is a `signal.Signals` member (the module's functions stay refused).
INERT_NAMES: Mapping[str, frozenset[str]] = {"signal": frozenset({"Signals"})}


class Inert:
    """What a pickle built from a class that was not imported: its name, the arguments it was
    called with and the state it was given. Compares equal by those; holds no behaviour."""

    __slots__ = ("module", "name", "args", "state")

    def __init__(self, module: str, name: str, args: tuple = ()):
        self.module, self.name, self.args, self.state = module, name, args, None

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"<not imported: {self.module}.{self.name}{self.args!r}>"

    def __eq__(self, other):
        return isinstance(other, Inert) and (self.module, self.name, self.args, self.state) == (
            other.module, other.name, other.args, other.state)

    def __hash__(self):
        return hash((self.module, self.name))


def _inert_factory(module: str, name: str):
    """A stand-in for ``module.name`` that a pickle may call (REDUCE), instantiate (NEWOBJ) and
    fill (BUILD); every path ends in an :class:`Inert`."""

    class _Factory:
        def __new__(cls, *args, **kwargs):
            return Inert(module, name, args)

    _Factory.__name__ = _Factory.__qualname__ = name
    _Factory.__module__ = "mmparity.io.unpickle.inert"
    return _Factory


def inert_values(value, path: str = "", depth: int = 0) -> list[str]:
    """The paths inside ``value`` (dicts, lists, tuples) that hold an :class:`Inert` record."""
    if isinstance(value, Inert):
        return [path or "(top)"]
    if depth > 64:
        return []
    found: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            found += inert_values(item, f"{path}.{key}" if path else str(key), depth + 1)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found += inert_values(item, f"{path}[{index}]", depth + 1)
    return found


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only ``allowed`` names (and torch dtypes); ``where`` is
    how a refusal names the file and item. ``storage(key, dtype, numel)`` serves torch's persistent
    storage references; without it a pickle that has any is refused. ``inert`` (module prefixes,
    e.g. :data:`MEGATRON_INERT_MODULES`): names under them become :class:`Inert` records instead
    of being refused, never imported. ``substitutes`` ((module, name) -> a callable of ours): an
    allowed name that resolves to our stand-in instead of being imported (``dcp_index``)."""

    def __init__(self, file, allowed: Mapping[str, frozenset[str]], where: str,
                 storage: Callable[[str, torch.dtype, int], object] | None = None,
                 inert: tuple[str, ...] = (), substitutes: Mapping[tuple[str, str], object] | None = None,
                 **kwargs):
        super().__init__(file, **kwargs)
        self.allowed, self.where, self.storage, self.inert = allowed, where, storage, inert
        self.substitutes = substitutes or {}
        # Assigned, not defined on the class: the C unpickler reads the hook through its own
        # descriptor, and torch.load installs its storage hook the same way.
        self.persistent_load = self._storage_reference
        try:  # the pickle's size, which bounds how much walking what it decodes to may cost
            at = file.tell()
            self.nbytes = file.seek(0, io.SEEK_END) - at
            file.seek(at)
        except (AttributeError, OSError, ValueError):
            self.nbytes = None

    def load(self):
        value = super().load()
        try:
            check_bounded(value, self.where, self.nbytes)
        except CheckpointError as exc:
            raise RefusedPickle(str(exc)) from None
        return value

    def find_class(self, module, name):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch._utils" and name in self.allowed.get(module, ()):
            return {"_rebuild_tensor_v2": self._rebuild_tensor, "_rebuild_tensor_v3": self._rebuild_tensor_of}[name]
        if (module, name) == ("_codecs", "encode"):
            return _latin1_bytes  # how protocol 2 spells a bytes object
        if name in self.allowed.get(module, ()):
            substitute = self.substitutes.get((module, name))
            return super().find_class(module, name) if substitute is None else substitute
        if self.inert and isinstance(module, str) and isinstance(name, str) and (
                (module.startswith(self.inert) and name.isidentifier()
                 and all(part.isidentifier() for part in module.split(".")))
                or name in INERT_NAMES.get(module, ())):
            return _inert_factory(module, name)
        raise RefusedPickle(f"{self.where}: refusing to unpickle {module}.{name} (not a plain data "
                            "class a checkpoint may hold; nothing from it was run)")

    def _rebuild_tensor(self, storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
        """torch's tensor rebuild, on a storage this unpickler made and nothing else: no backward
        hooks (callables to run later), no tensor metadata, bounds checked by ``set_``."""
        if not isinstance(storage, torch.storage.TypedStorage) or hooks or metadata:
            raise RefusedPickle(f"{self.where}: a tensor rebuilt from something other than its own "
                                "storage, or with hooks or metadata attached")
        tensor = torch.empty((0,), dtype=storage.dtype)
        try:
            tensor.set_(storage._untyped_storage, offset, torch.Size(size), tuple(stride))
        except (RuntimeError, TypeError) as exc:
            raise CheckpointError(f"{self.where}: a tensor outside its storage ({' '.join(str(exc).split())[:160]})") from None
        tensor.requires_grad_(bool(requires_grad))
        return tensor

    def _rebuild_tensor_of(self, storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
        """The same for dtypes without a legacy storage class (float8 …): an untyped storage."""
        if not isinstance(storage, torch.storage.TypedStorage) or not isinstance(dtype, torch.dtype):
            raise RefusedPickle(f"{self.where}: a tensor rebuilt from something other than its own storage")
        typed = torch.storage.TypedStorage(wrap_storage=storage._untyped_storage, dtype=dtype, _internal=True)
        return self._rebuild_tensor(typed, offset, size, stride, requires_grad, hooks, metadata)

    def _storage_reference(self, pid):
        if self.storage is None or not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")):
            raise RefusedPickle(f"{self.where}: refusing a persistent reference {str(pid)[:80]!r}")
        _, storage_type, key, _location, numel = pid
        dtype = _STORAGE_DTYPES.get(getattr(storage_type, "__name__", None)) if isinstance(storage_type, type) else None
        if dtype is None:
            raise RefusedPickle(f"{self.where}: a storage of unknown type {storage_type!r}")
        if not isinstance(numel, int) or numel < 0:
            raise RefusedPickle(f"{self.where}: a storage of {numel!r} elements")
        return self.storage(str(key.decode() if isinstance(key, bytes) else key), dtype, numel)


def torch_pickle_module(allowed: Mapping[str, frozenset[str]], where: str,
                        inert: tuple[str, ...] = ()) -> types.ModuleType:
    """A ``pickle_module`` for ``torch.load`` whose unpickler is restricted to ``allowed``: torch
    keeps its own storage handling (``mmap=True`` included) and every other name is ours to
    resolve. Use with ``weights_only=False``, which then means "not torch's allow-list"."""
    module = types.ModuleType("mmparity_restricted_pickle")

    class Unpickler(RestrictedUnpickler):
        def __init__(self, file, **kwargs):
            super().__init__(file, allowed, where, inert=inert, **kwargs)

    module.Unpickler = Unpickler
    module.UnpicklingError = pickle.UnpicklingError
    module.load = lambda file, **kwargs: Unpickler(file, **kwargs).load()
    return module


def _latin1_bytes(text, encoding="latin1"):
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise RefusedPickle(f"refusing _codecs.encode with {type(text).__name__}, {encoding!r} (only protocol 2's "
                            "latin-1 bytes are plain data)")
    return text.encode("latin-1")


def loads(data: bytes, allowed: Mapping[str, frozenset[str]], where: str, inert: tuple[str, ...] = (),
          substitutes: Mapping[tuple[str, str], object] | None = None):
    """A plain pickle (no tensor storages), decoded under ``allowed`` (and ``inert``, ``substitutes``)."""
    try:
        return RestrictedUnpickler(io.BytesIO(data), allowed, where, inert=inert, substitutes=substitutes).load()
    except CheckpointError:  # a refused name, or a value no walk could finish
        raise
    except Exception as exc:  # a truncated or malformed pickle raises many types
        raise CheckpointError(f"{where}: not a readable pickle ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:200]})") from None


_ZIP_MAGIC = b"PK\x03\x04"


def load_torch_archive(data: bytes, allowed: Mapping[str, frozenset[str]] = OBJECT_NAMES, where: str = "object",
                       inert: tuple[str, ...] = ()):
    """What ``torch.save`` wrote into ``data`` (its zip format), decoded under ``allowed``; tensor
    storages are copied out of the archive's records, sized as the pickle says and checked
    against the record. torch's older non-zip format is refused: nothing mmparity, mcore or
    Megatron-LM writes uses it."""
    if not data.startswith(_ZIP_MAGIC):
        raise CheckpointError(f"{where}: not a torch.save archive (no zip header)")
    try:
        reader = TorchArchive(data)
        pickled = reader.read("data.pkl")
    except Exception as exc:
        raise CheckpointError(f"{where}: unreadable torch.save archive ({' '.join(str(exc).split())[:200]})") from None
    made: dict[str, object] = {}

    def storage(key: str, dtype: torch.dtype, numel: int):
        if key in made:
            return made[key]
        record = f"data/{key}"
        try:
            size = reader.size(record)
        except Exception:
            raise CheckpointError(f"{where}: the pickle names storage {key!r}, which the archive lacks") from None
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if size != nbytes:
            raise CheckpointError(f"{where}: storage {key!r} holds {size} bytes, the pickle says {nbytes}")
        raw = bytearray(reader.read(record)) if nbytes else bytearray()
        flat = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        made[key] = typed = torch.storage.TypedStorage(wrap_storage=flat.untyped_storage(), dtype=dtype, _internal=True)
        return typed

    try:
        return RestrictedUnpickler(io.BytesIO(pickled), allowed, where, storage, inert=inert).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{where}: not a readable torch.save pickle ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:200]})") from None
