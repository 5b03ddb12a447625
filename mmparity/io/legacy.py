"""Megatron-LM's legacy (`torch` / non-distributed) checkpoint format, written and read on CPU.

One `torch.save` file per (TP rank, PP stage, EP rank):

    <root>/latest_checkpointed_iteration.txt
    <root>/iter_0000001/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt   (or release/)
        {"model": local state dict, ["args": Namespace,] "checkpoint_version": 3.0, "iteration": 1}

Each `model` dict holds that rank's TP shard of every tensor, with the layers of its pipeline stage
numbered from 0 and, under expert parallelism, only its EP rank's experts of each MoE layer,
numbered from 0 (`converters.ep`); everything else is in every EP rank's file. Megatron-LM also
stores optimizer and RNG state; we write only what a model load needs, plus, where the converter
gives it, the `args` Namespace of sizes its loader reads (`megatron_args`), and only objects that
Megatron's `safe_globals` and our allow-list both accept, which is also how everything is read
back: a checkpoint is data, never code. The iteration may be Megatron-LM's `release`.

The public functions take and return what the converters produce: one globally numbered state
dict per TP rank. Pipeline and expert splitting and merging happen here via `converters.pp` and
`converters.ep`.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from mmparity import errors
from mmparity.parallel import ep as ep_mod
from mmparity.parallel import pp
from mmparity.parallel.axes import AxisError, Grid
from mmparity.errors import ConversionError
from mmparity.io import extra_state, megatron_args, unpickle
from mmparity.io.fsio.checksums import tensor_checksum
from mmparity.io.fsio import shared
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.paths import require_regular_file
from mmparity.io.fsio.publish import atomic_directory
from mmparity.io.fsio.slots import Slot, SlotWriter, torch_save_without_crc32
from mmparity.io.fsio.torch_archive import TorchArchive
from mmparity.io.layout import (
    CHECKPOINT_VERSION, LEGACY_FILE, RELEASE, check_checkpoint_version, iteration_dirname, parse_rank_dirname,
    rank_dirname, resolve_iteration_dir)
from mmparity.io.manifest import (
    LAYOUT_LEGACY, MANIFEST_FILE, Manifest, Provenance, TensorRecord, read_manifest, write_mcore_root)

__all__ = ["write_legacy", "LegacyWriter", "finish_legacy", "open_legacy", "read_legacy", "LegacyCheckpoint",
           "load_rank_file", "load_rank_payload", "model_chunk_keys"]

# Values a weights_only load accepts, and therefore all we are willing to write.
_PLAIN_VALUES = (torch.Tensor, type(None), bool, int, float, str)


def _check_writable(tp_rank: int, state_dict: Mapping) -> None:
    if not isinstance(state_dict, Mapping) or not state_dict:
        raise CheckpointError(f"TP rank {tp_rank}: expected a non-empty state dict, got {type(state_dict).__name__}")
    bad = sorted(k for k, v in state_dict.items() if not isinstance(k, str) or not isinstance(v, _PLAIN_VALUES))
    if bad:
        raise CheckpointError(
            f"TP rank {tp_rank}: values of {', '.join(map(str, bad[:8]))} are not tensors or plain scalars "
            "and could not be read back with torch.load(weights_only=True)"
        )


def _plan_pipeline(
    tp_shards: Sequence[Mapping[str, torch.Tensor]],
    pp_size: int,
    layer_counts: Sequence[int] | None,
    layer_prefix: str,
) -> list[int]:
    if layer_counts is not None:
        counts = list(layer_counts)
        if len(counts) != pp_size:
            raise CheckpointError(f"{len(counts)} per-stage layer counts given for pipeline size {pp_size}")
        return counts
    try:
        (num_layers,) = pp.infer_layer_counts([tp_shards[0]], layer_prefix=layer_prefix)
        return pp.buildable_layer_counts(num_layers, pp_size)
    except pp.PipelineError as exc:
        raise CheckpointError(str(exc)) from None


class LegacyWriter:
    """Legacy rank files laid out before any tensor exists, then filled tensor by tensor.

    Each rank file is first written as a `torch.save` skeleton under `torch.serialization.skip_data`:
    the pickle, zip directory and a reserved (sparse) byte range per storage, from placeholder
    tensors that are allocated but never touched. The byte ranges are then read back from the zip
    directory and filled with `pwrite` through a `SlotWriter`, so every byte of the checkpoint is
    written once, straight from wherever the converter produced it, and nothing needs to hold a
    rank's tensors at once. The files are exactly what `torch.save` would write for the same dict,
    except for the zip CRC32 fields (left unset, as `torch_save_without_crc32` leaves them:
    `torch.load` ignores them, the manifest's per-tensor checksums replace them).

    `rank_entries[tp_rank]` maps every *globally numbered* key of that TP rank to a `(dtype, shape)`
    pair, or to a plain value (None, int, str …) that goes into the pickle as is. With EP > 1 in
    `grid` each (TP rank, PP stage) is one file per EP rank, holding its share of the `num_experts`
    experts of every MoE layer and a copy of everything else: a key's `write` fills every file
    that holds it.
    """

    def __init__(self, staging: Path, rank_entries: Sequence[Mapping], *, grid: Grid, layer_counts: Sequence[int],
                 layer_prefix: str, last_stage_prefixes: Sequence[str], iteration: int | str, locate=None,
                 num_experts: int = 0, common: Mapping | None = None,
                 writes: Callable[[Sequence[int]], Sequence[bool]] | None = None):
        """``writes(file byte sizes)`` says which rank files this process writes (default: all),
        where several processes write one checkpoint; the others are laid out the same but not
        created, and ``write`` skips them."""
        if not rank_entries:
            raise CheckpointError("no TP shards to write")
        reference_keys = set(rank_entries[0])
        for tp_rank, entries in enumerate(rank_entries):
            if not entries:
                raise CheckpointError(f"TP rank {tp_rank}: expected a non-empty state dict")
            if set(entries) != reference_keys:
                diff = sorted(set(entries) ^ reference_keys)
                raise CheckpointError(f"TP rank {tp_rank} and rank 0 hold different keys, e.g. {', '.join(diff[:8])}")
        if grid.tp.size != len(rank_entries):
            raise CheckpointError(f"{len(rank_entries)} TP shards to write for a grid of TP {grid.tp.size}")
        self.staging = Path(staging)
        problems = grid.problems(num_experts)
        if problems:
            raise CheckpointError(problems[0])
        self.files: list[str] = []
        self._slots_of: dict[tuple[int, str], list[str]] = {}  # (tp rank, global key) -> slot names
        self._local: dict[str, tuple[int, str]] = {}  # slot name -> (file number, local key)
        self._extra_states: list[tuple[int, str, object]] = []  # (file number, local key, value)
        self._elsewhere: set[tuple[int, str]] = set()  # (tp rank, global key) in files others write
        slots: dict[str, Slot] = {}
        fds: list[int] = []
        iteration_dir = iteration_dirname(iteration)
        planned = []  # (tp rank, pp rank, ep rank, {local key: global key}) of every rank file
        for tp_rank, entries in enumerate(rank_entries):
            # Splitting {key: key} tells where each global key lands, and under which local name.
            try:
                stages = pp.split_pipeline_stages({k: k for k in entries}, layer_counts, layer_prefix=layer_prefix,
                                                  last_stage_prefixes=last_stage_prefixes)
            except pp.PipelineError as exc:
                raise CheckpointError(str(exc)) from None
            # ... and splitting each stage's {local: global} over EP, in which EP rank's file.
            planned += [(tp_rank, pp_rank, ep_rank, local_to_global) for pp_rank, stage in enumerate(stages)
                        for ep_rank, local_to_global in enumerate(_expert_ranks(stage, grid, num_experts))]
        sizes = [sum(math.prod(rank_entries[tp_rank][key][1]) * rank_entries[tp_rank][key][0].itemsize
                     for key in local_to_global.values() if _is_tensor_entry(rank_entries[tp_rank][key]))
                 for tp_rank, _, _, local_to_global in planned]
        self.mine = list(writes(sizes)) if writes is not None else [True] * len(planned)
        try:
            for (tp_rank, pp_rank, ep_rank, local_to_global), mine in zip(planned, self.mine):
                entries = rank_entries[tp_rank]
                relative = Path(iteration_dir) / rank_dirname(grid, tp_rank, pp_rank, ep_rank) / LEGACY_FILE
                number = len(self.files)
                self.files.append(relative.as_posix())
                if not mine:
                    fds.append(None)
                    self._elsewhere.update((tp_rank, key) for key in local_to_global.values())
                    continue
                path = self.staging / relative
                # The iteration directory may be another process's (several writing one checkpoint).
                path.parent.parent.mkdir(exist_ok=True)
                path.parent.mkdir()
                tensor_keys = [local for local, key in local_to_global.items() if _is_tensor_entry(entries[key])]
                offsets = _write_skeleton(path, {local: entries[key] for local, key in local_to_global.items()},
                                          iteration, common)
                fds.append(os.open(path, os.O_WRONLY))
                for local, key in local_to_global.items():
                    if extra_state.is_extra_state(key) and not _is_tensor_entry(entries[key]):
                        if entries[key] is not None:
                            raise CheckpointError(f"{key}: an extra state is written empty (None) or "
                                                  f"as a tensor, not as a {type(entries[key]).__name__}")
                        self._extra_states.append((number, local, entries[key]))
                for local, (offset, nbytes) in zip(tensor_keys, offsets):
                    key = shared.name(local_to_global[local])
                    dtype, shape = entries[key]
                    # A tuple, not a formatted string: one name per slot of thousands, all held to the end.
                    name = (tp_rank, ep_rank, key)
                    self._slots_of.setdefault((tp_rank, key), []).append(name)
                    slots[name] = Slot(number, offset, nbytes, dtype, shared.shape(shape))
                    self._local[name] = (number, shared.name(local))
        except BaseException:
            for fd in fds:
                if fd is not None:
                    os.close(fd)
            raise
        self._writer = SlotWriter(self.staging, fds, slots, locate=locate)

    def holds(self, tp_rank: int, key: str) -> bool:
        """Whether a file this process writes holds TP rank ``tp_rank``'s tensor ``key``."""
        return (tp_rank, key) in self._slots_of

    def write(self, tp_rank: int, key: str, pieces) -> None:
        """TP rank `tp_rank`'s tensor of global key `key`, whole or as consecutive dim-0 pieces,
        into every file that holds it (one per EP rank for a tensor replicated over EP)."""
        names = self._slots_of.get((tp_rank, key))
        if names is None:
            if (tp_rank, key) in self._elsewhere:
                return
            raise CheckpointError(f"{self.staging}: tensor {key!r} of TP rank {tp_rank} was not announced")
        for name in names:
            self._writer.write(name, pieces)

    def close(self) -> list[TensorRecord]:
        """Waits for every write; returns the manifest records (per rank file, local key), the
        ``_extra_state`` entries' (over what they hold, see ``extra_state.as_bytes``) included."""
        self._writer.close()
        return [TensorRecord(self.files[number], local, self._writer.checksums[name])
                for name, (number, local) in self._local.items()] + [
                TensorRecord(self.files[number], local, tensor_checksum(extra_state.as_bytes(value)))
                for number, local, value in self._extra_states]

    def abort(self) -> None:
        self._writer.abort()


def _expert_ranks(stage: Mapping[str, str], grid: Grid, num_experts: int) -> list[Mapping[str, str]]:
    """A stage's {local key: global key} split over the grid's EP ranks (itself when EP = 1)."""
    if grid.ep.size == 1:
        return [stage]
    try:
        return ep_mod.split_expert_ranks(stage, grid.ep, num_experts)
    except ConversionError as exc:
        raise CheckpointError(exc.line()) from None
    except AxisError as exc:
        raise CheckpointError(str(exc)) from None


def _is_tensor_entry(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], torch.dtype)


def _untouched_tensor(dtype: torch.dtype, shape) -> torch.Tensor:
    """A CPU tensor whose bytes are never touched: under skip_data torch.save reads none of them.

    Its own anonymous mapping, not ``torch.empty``: malloc serves sizes under its mmap threshold
    (which rises to 32 MB as large blocks are freed) from the heap and writes a chunk header in
    each, so a rank file's thousands of placeholders faulted in a page apiece, about 4 kB of
    resident memory per tensor, only to be freed when the skeleton was written."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(tuple(shape))


def _write_skeleton(path: Path, model: Mapping, iteration: int | str,
                    common: Mapping | None = None) -> list[tuple[int, int]]:
    """`torch.save` of `{"model": model, ...}` with every tensor's bytes reserved, not written.
    `common`: further top-level entries (Megatron-LM's `args`, see `megatron_args`).

    Returns (offset, nbytes) of each tensor entry's storage in `model` order. torch numbers storages
    in the order the pickler meets them, which for one fresh storage per tensor is dict order; the
    sizes read back from the zip directory are checked against that assumption.
    """
    placeholders = {}
    for key, value in model.items():
        if _is_tensor_entry(value):
            placeholders[key] = _untouched_tensor(*value)
        elif isinstance(value, _PLAIN_VALUES):
            placeholders[key] = value
        else:
            raise CheckpointError(f"{key}: a {type(value).__name__} could not be read back with "
                                  "torch.load(weights_only=True)")
    import warnings

    with warnings.catch_warnings(), torch_save_without_crc32():
        warnings.simplefilter("ignore")  # skip_data is marked as a prototype
        with torch.serialization.skip_data():
            # A release checkpoint's iteration is 0, as Megatron-LM's loader reads it.
            torch.save({**(common or {}), "model": placeholders, "checkpoint_version": CHECKPOINT_VERSION,
                        "iteration": 0 if iteration == RELEASE else iteration}, path)
    reader = TorchArchive(path)
    records = set(reader.records())
    result = []
    tensors = [t for t in placeholders.values() if isinstance(t, torch.Tensor)]
    for number, tensor in enumerate(tensors):
        record = f"data/{number}"
        nbytes = tensor.numel() * tensor.element_size()
        if record not in records or reader.size(record) != nbytes:
            raise CheckpointError(f"{path}: torch.save laid out storage {number} unlike this writer expects "
                                  "(an unsupported torch version?)")
        result.append((reader.offset(record), nbytes))
    return result


def write_legacy(
    root: str | os.PathLike,
    tp_shards: Sequence[Mapping[str, torch.Tensor]],
    *,
    pp_size: int = 1,
    layer_counts: Sequence[int] | None = None,
    layer_prefix: str | None = None,
    last_stage_prefixes: Sequence[str] | None = None,
    iteration: int = 1,
    provenance: Provenance | None = None,
    extra_files: Mapping[str, str | bytes] | None = None,
    on_file: Callable[[str, int], None] | None = None,
    force: bool = False,
    ep_size: int = 1,
    num_experts: int | None = None,
) -> Path:
    """Writes one globally numbered state dict per TP rank as a Megatron-LM legacy checkpoint.

    `pp_size > 1` splits the layer stack evenly (or by `layer_counts`) with pre-process keys on the
    first stage and `last_stage_prefixes` keys on the last. `ep_size > 1` splits the experts of
    every MoE layer (`num_experts` each, by default read off the keys) over that many EP ranks,
    with Megatron's local numbering. `extra_files` (e.g. the HF config a
    converter keeps next to the weights) land at the root in the same atomic step; `on_file(path,
    nbytes)` is called once per rank file when everything is written (progress). Atomic: `root`
    appears complete or not at all. Returns `root`.
    """
    # Defaults resolved here, not at import: converters.pp imports this package (a cycle #13 removes).
    layer_prefix = pp.DEFAULT_LAYER_PREFIX if layer_prefix is None else layer_prefix
    last_stage_prefixes = pp.DEFAULT_LAST_STAGE_PREFIXES if last_stage_prefixes is None else last_stage_prefixes
    if not tp_shards:
        raise CheckpointError("no TP shards to write")
    for tp_rank, state_dict in enumerate(tp_shards):
        _check_writable(tp_rank, state_dict)
    counts = _plan_pipeline(tp_shards, pp_size, layer_counts, layer_prefix)
    if num_experts is None:
        try:
            num_experts = ep_mod.expert_count(tp_shards[0])
        except ConversionError as exc:
            raise CheckpointError(exc.line()) from None
    entries = [{k: (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else v for k, v in shard.items()}
               for shard in tp_shards]
    with atomic_directory(root, force=force) as staging:
        grid = Grid.of(len(tp_shards), pp_size, ep_size)
        writer = LegacyWriter(staging, entries, grid=grid, layer_counts=counts, layer_prefix=layer_prefix,
                              last_stage_prefixes=last_stage_prefixes, iteration=iteration, num_experts=num_experts)
        try:
            for tp_rank, state_dict in enumerate(tp_shards):
                for key, value in state_dict.items():
                    if isinstance(value, torch.Tensor):
                        writer.write(tp_rank, key, value)
            records = writer.close()
        finally:
            writer.abort()
        finish_legacy(staging, records, grid=grid, layer_counts=counts, iteration=iteration, provenance=provenance,
                      extra_files=extra_files)
    if on_file is not None:
        for relative in writer.files:
            on_file(relative, 0)
    return Path(root)


def finish_legacy(staging: Path, records: Sequence[TensorRecord], *, grid: Grid, layer_counts: Sequence[int],
                  iteration: int | str, provenance: Provenance | None,
                  extra_files: Mapping[str, str | bytes] | None) -> None:
    """The small files beside the rank files: extra files, the tracker and the manifest."""
    tp_size, pp_size, ep_size = grid.sizes
    write_mcore_root(
        staging,
        Manifest(
            layout=LAYOUT_LEGACY,
            tensors=tuple(records),
            provenance=provenance or Provenance(),
            tensor_parallel_size=tp_size,
            pipeline_parallel_size=pp_size,
            pipeline_layer_counts=tuple(layer_counts) if pp_size > 1 else None,
            expert_parallel_size=ep_size,
            iteration=iteration,
        ),
        extra_files,
    )


def load_rank_payload(path: str | os.PathLike, *, mmap: bool = False) -> dict:
    """Everything one `model_optim_rng.pt` holds, decoded under the legacy allow-list: the model,
    and what Megatron-LM's own `save_checkpoint` adds (`args`, `iteration`, `optimizer`,
    `opt_param_scheduler`, `rng_state`, ...), Megatron's classes among them as inert records
    (`unpickle.Inert`, never imported)."""
    path = Path(path)
    require_regular_file(path, "rank file")
    restricted = unpickle.torch_pickle_module(unpickle.LEGACY_NAMES, str(path), unpickle.MEGATRON_INERT_MODULES)
    try:
        # torch's own weights_only list is process-wide (megatron-core adds to it on import); ours
        # is the explicit one, with torch still handling storages and mmap.
        payload = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=restricted)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: missing") from exc
    except CheckpointError:  # a refused name (RefusedPickle), or a tensor outside its storage
        raise
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable as a torch.save file ({errors.one_line(exc, 300)})") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path}: expected a dict, found {type(payload).__name__}")
    return payload


def model_chunk_keys(payload: Mapping) -> list[str]:
    """`["model"]`, or Megatron-LM's virtual-pipeline chunks `["model0", "model1", ...]` in order."""
    if "model" in payload:
        return ["model"]
    chunks = sorted((int(k[5:]), k) for k in payload
                    if isinstance(k, str) and k.startswith("model") and k[5:].isascii() and k[5:].isdigit())
    return [k for _, k in chunks]


def load_rank_file(path: str | os.PathLike, *, mmap: bool = False, file_ranges=None, chunk: str = "model",
                   payload: dict | None = None) -> dict:
    """The `model` state dict of one `model_optim_rng.pt` (or virtual-pipeline chunk `chunk`,
    `model0` ...), decoded under the legacy allow-list (`load_rank_payload`; `payload`: what that
    returned for this file already, with the same `mmap`).

    `mmap=True` maps the file instead of reading it: tensors are backed by the page cache and only
    the bytes actually used are read, so a converter can stream through a rank file.
    """
    path = Path(path)
    payload = load_rank_payload(path, mmap=mmap) if payload is None else payload
    if chunk not in payload:
        chunks = model_chunk_keys(payload)
        if chunks and chunk == "model":
            raise CheckpointError(f"{path}: virtual-pipeline chunks ({', '.join(chunks)}) where a 'model' entry "
                                  "was expected")
        raise CheckpointError(f"{path}: no {chunk!r} entry (keys: {', '.join(sorted(map(str, payload))[:8])})")
    check_checkpoint_version(payload.get("checkpoint_version", 0), path)
    model = payload[chunk]
    if not isinstance(model, dict):
        raise CheckpointError(f"{path}: {chunk!r} is a {type(model).__name__}, not a state dict")
    odd = [key for key in model if not isinstance(key, str)]
    if odd:
        raise CheckpointError(f"{path}: {chunk!r} has keys that are no tensor names ({', '.join(map(repr, odd[:4]))}); "
                              "not a model state dict")
    inert = unpickle.inert_values(model)
    if inert:
        raise CheckpointError(f"{path}: {chunk!r} holds objects of Megatron's classes where weights belong "
                              f"({', '.join(inert[:4])}); not a model state dict")
    if mmap:
        base = _check_mapped_spans(path, model, payload)
        if file_ranges is not None and base is not None:
            # The file's tensors keep its mapping: those a merge drops (another EP rank's
            # replicated copies) would otherwise free it while it is registered.
            file_ranges.add(base, path.stat().st_size, path, keep=payload)
    return model


def _check_mapped_spans(path: Path, model: Mapping, payload: Mapping) -> int | None:
    """Checks that every tensor of ``model`` torch.load(mmap=True) made lies inside its own storage
    record, and returns the mapping's address (None when no tensor has bytes).

    A plain load reads each record and refuses a storage larger than it; a mapped load takes the
    storage size from the pickle and maps that many bytes at the record's offset, so a record
    shorter than its tensor would be filled from whatever follows it in the file. torch maps the
    whole file from offset 0 and each storage is a view at its record's offset: the mapping's
    address is recovered from the lowest storage of the whole file (``payload``: the first record
    may well be another entry's, an earlier virtual-pipeline chunk's or the RNG state's), and
    every storage of ``model`` must then start at a record and fit in it (torch itself checks that
    a tensor fits in its storage). Reads the zip directory, no data.
    """
    reader = TorchArchive(path)
    records = {reader.offset(r): (r, reader.size(r)) for r in reader.records() if r.startswith("data/")}
    storages = {k: v.untyped_storage() for k, v in model.items()
                if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes()}
    if not storages:
        return None
    lowest = min((r for r, (_, size) in records.items() if size), default=None)
    if lowest is None:
        raise CheckpointError(f"{path}: tensors with bytes but no storage records")
    base = min(s.data_ptr() for s in _storages_with_bytes(payload)) - lowest
    for key, storage in sorted(storages.items()):
        found = records.get(storage.data_ptr() - base)
        if found is None:
            raise CheckpointError(f"{path}: tensor {key!r} is not mapped at any storage record of the file")
        record, size = found
        if storage.nbytes() > size:
            raise CheckpointError(f"{path}: tensor {key!r} needs {storage.nbytes()} bytes but its storage record "
                                  f"{record} holds {size} (a truncated or altered file)")
    return base


def _storages_with_bytes(payload) -> list:
    """The storages (with bytes) of every tensor anywhere in a decoded rank file, each container
    visited once (a container that holds itself is walked once, not forever)."""
    found, seen, todo = [], set(), [payload]
    while todo:
        value = todo.pop()
        if isinstance(value, torch.Tensor):
            if value.untyped_storage().nbytes():
                found.append(value.untyped_storage())
        elif isinstance(value, (dict, list, tuple)) and id(value) not in seen:
            seen.add(id(value))
            todo.extend(value.values() if isinstance(value, dict) else value)
    return found


@dataclasses.dataclass(frozen=True)
class LegacyCheckpoint:
    root: Path
    iteration_dir: Path
    iteration: int | str
    tp_size: int
    pp_size: int
    files: Mapping[tuple[int, int, int], Path]  # (tp rank, pp stage, ep rank) -> model_optim_rng.pt
    manifest: Manifest | None
    ep_size: int = 1

    def load_rank(self, tp_rank: int, pp_rank: int = 0, ep_rank: int = 0, *, mmap: bool = False,
                  file_ranges=None, chunk: str = "model", loaded: Mapping | None = None) -> dict:
        """The locally numbered state dict of one (TP rank, PP stage, EP rank); `mmap` as in
        `load_rank_file`; `loaded`: payloads already read, by path (read with the same `mmap`)."""
        if (tp_rank, pp_rank, ep_rank) not in self.files:
            raise CheckpointError(
                f"{self.iteration_dir}: no TP rank {tp_rank} / PP stage {pp_rank} / EP rank {ep_rank} in a "
                f"TP={self.tp_size} PP={self.pp_size} EP={self.ep_size} checkpoint"
            )
        path = self.files[tp_rank, pp_rank, ep_rank]
        model = load_rank_file(path, mmap=mmap, file_ranges=file_ranges, chunk=chunk,
                               payload=(loaded or {}).get(path))
        if chunk == "model":
            self._check_identity(path, model)
        return model

    def _check_identity(self, path: Path, model: Mapping) -> None:
        """Refuses a rank file that holds another rank's tensors: a file copied over another.

        Rank files of one checkpoint hold the same key names (layers and experts are numbered
        locally), so a file copied over another (a hand repair, a botched sync) reads as a valid
        rank and converts to a silently wrong model. Where the manifest describes this iteration
        and grid, one tensor per file that differs from every other file's tensor of that name (the
        smallest such) is hashed: bytes the manifest records for another file are refused. Bytes
        it records for no file are a changed tensor, which is data (``check --mcore`` locates it,
        ``verify`` lists it), not a misplaced file. A cost of one small tensor per file."""
        try:
            relative = path.relative_to(self.root).as_posix()
        except ValueError:
            return
        probe = _identity_probes(self).get(relative)
        if probe is None:
            return
        record, others = probe
        tensor = model.get(record.key)
        if not isinstance(tensor, torch.Tensor):
            return
        found = tensor_checksum(tensor, record.checksum.algorithm)
        if found == record.checksum:
            return
        origin = others.get(found.digest)
        if origin is not None:
            raise CheckpointError(
                f"{path}: holds the tensors of {origin} ({record.key} has the bytes {MANIFEST_FILE} records "
                f"there): a rank file copied over another; put the right file back (`mmparity verify "
                f"{self.root}` lists what differs)")

    def stage_state(self, tp_rank: int, pp_rank: int = 0, *, num_experts: int | None = None, mmap: bool = False,
                    file_ranges=None, chunk: str = "model", loaded: Mapping | None = None) -> dict:
        """One (TP rank, PP stage)'s state dict, its EP ranks' experts merged back to global
        numbers (`converters.ep.merge_expert_ranks`: every expert once, replicated tensors equal
        on every EP rank); layers still numbered locally."""
        states = [self.load_rank(tp_rank, pp_rank, ep_rank, mmap=mmap, file_ranges=file_ranges, chunk=chunk,
                                 loaded=loaded)
                  for ep_rank in range(self.ep_size)]
        if self.ep_size == 1:
            return states[0]
        try:
            return ep_mod.merge_expert_ranks(states, num_experts)
        except (ConversionError, AxisError) as exc:
            where = rank_dirname(Grid.of(self.tp_size, self.pp_size, self.ep_size), tp_rank, pp_rank, 0)
            cause = exc.line() if isinstance(exc, ConversionError) else exc
            raise CheckpointError(f"{self.iteration_dir}: {where} and its EP ranks: {cause}") from None

    def tp_shards(
        self,
        layer_counts: Sequence[int] | None = None,
        *,
        layer_prefix: str | None = None,
        num_experts: int | None = None,
    ) -> list[dict]:
        """One globally numbered state dict per TP rank (the input `mcore_to_hf` takes): layers and
        experts under their global numbers."""
        layer_prefix = pp.DEFAULT_LAYER_PREFIX if layer_prefix is None else layer_prefix
        if layer_counts is None and self.manifest is not None and self.manifest.pipeline_layer_counts:
            layer_counts = self.manifest.pipeline_layer_counts
        shards = []
        for tp_rank in range(self.tp_size):
            stages = [self.stage_state(tp_rank, pp_rank, num_experts=num_experts) for pp_rank in range(self.pp_size)]
            try:
                shards.append(pp.merge_pipeline_stages(stages, layer_counts, layer_prefix=layer_prefix))
            except pp.PipelineError as exc:
                raise CheckpointError(str(exc)) from None
        return shards


_PROBES: dict[int, tuple[LegacyCheckpoint, dict]] = {}


def _identity_probes(ckpt: LegacyCheckpoint) -> dict:
    """File (relative to the root) -> (the manifest record that tells that file from the others,
    {the digest the manifest records for that key in another file: that file}), for a manifest
    that describes ``ckpt``'s iteration and grid; {} for any other."""
    cached = _PROBES.get(id(ckpt))
    if cached is not None and cached[0] is ckpt:
        return cached[1]
    manifest, probes = ckpt.manifest, {}
    if manifest is not None and manifest.iteration in (None, ckpt.iteration) and (
            manifest.tensor_parallel_size, manifest.pipeline_parallel_size, manifest.expert_parallel_size) == (
            ckpt.tp_size, ckpt.pp_size, ckpt.ep_size) and len(ckpt.files) > 1:
        by_key: dict[str, list] = {}
        for record in manifest.tensors:
            if record.file.endswith(LEGACY_FILE) and record.offset is None:
                by_key.setdefault(record.key, []).append(record)
        for key, records in by_key.items():
            for record in records:
                digest = record.checksum.digest
                if sum(other.checksum.digest == digest for other in records) != 1:
                    continue  # equal on another rank (a replicated tensor): it tells nothing apart
                best = probes.get(record.file)
                if best is None or math.prod(record.checksum.shape) < math.prod(best[0].checksum.shape):
                    probes[record.file] = (record, {other.checksum.digest: other.file for other in records
                                                    if other is not record})
    _PROBES.clear()  # one checkpoint at a time is read; the cache only spares re-deriving per file
    _PROBES[id(ckpt)] = (ckpt, probes)
    return probes


def open_legacy(path: str | os.PathLike, *, iteration: int | str | None = None) -> LegacyCheckpoint:
    """Finds and validates the rank files of a legacy checkpoint (a root or an iteration dir).

    A rank directory with one suffix (`mp_rank_00_001`) is a pipeline stage at PP > 1 and an
    expert rank at PP 1 x EP > 1: the name alone cannot tell (`layout.parse_rank_dirname`), so it
    is read with the sizes the rank files' `args` record (what Megatron-LM named them by), else
    those of a manifest that describes this iteration, else as a stage; two suffixes are always
    (stage, EP rank)."""
    root, iteration_dir, found_iteration = resolve_iteration_dir(path, iteration)
    manifest = read_manifest(root) if os.path.lexists(root / MANIFEST_FILE) else None
    entries = [entry for entry in sorted(iteration_dir.iterdir())
               if parse_rank_dirname(entry.name) is not None and entry.is_dir()]
    recorded = _naming_grid(entries, manifest, found_iteration)
    ranks: dict[tuple[int, int | None, int | None], Path] = {}
    for entry in entries:
        ranks[parse_rank_dirname(entry.name, recorded)] = entry / LEGACY_FILE
    if not ranks:
        raise CheckpointError(f"{iteration_dir}: no mp_rank_* directories; not a legacy checkpoint")
    slots = {(r[1] is not None, r[2] is not None) for r in ranks}
    if len(slots) > 1:
        raise CheckpointError(f"{iteration_dir}: mixes rank directories of different name patterns "
                              "(mp_rank_XX, mp_rank_XX_YYY, mp_rank_XX_YYY_ZZZ)")
    ((with_stage, with_expert),) = slots
    tp_size = max(r[0] for r in ranks) + 1
    pp_size = max(r[1] for r in ranks) + 1 if with_stage else 1
    ep_size = max(r[2] for r in ranks) + 1 if with_expert else 1
    files: dict[tuple[int, int, int], Path] = {}
    absent = []
    for tp_rank in range(tp_size):
        for pp_rank in range(pp_size):
            for ep_rank in range(ep_size):
                named = (tp_rank, pp_rank if with_stage else None, ep_rank if with_expert else None)
                path_of_rank = ranks.get(named)
                if path_of_rank is None or not path_of_rank.is_file():
                    # Named with the slots the directories have (a lone stage 000 included).
                    absent.append(f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if with_stage else "")
                                  + (f"_{ep_rank:03d}" if with_expert else "") + f"/{LEGACY_FILE}")
                else:
                    files[tp_rank, pp_rank, ep_rank] = path_of_rank
    if absent:
        sizes = f"TP={tp_size} PP={pp_size}" + (f" EP={ep_size}" if ep_size > 1 else "")
        raise CheckpointError(f"{iteration_dir}: incomplete {sizes} grid, missing {', '.join(absent[:8])}")
    return LegacyCheckpoint(root, iteration_dir, found_iteration, tp_size, pp_size, files, manifest, ep_size)


def _naming_grid(entries: Sequence[Path], manifest: Manifest | None, iteration: int | str) -> Grid | None:
    """The grid whose sizes say which axis a lone suffix of a rank directory's name is, when some
    name has one: the TP / PP / EP sizes the `args` of the first rank file record (one file is
    read, its tensors mapped, not read), else the manifest's if it describes ``iteration``
    (Megatron-LM may have saved another iteration into a directory mmparity wrote)."""
    named = [parse_rank_dirname(e.name) for e in entries]
    if not any(stage is not None and expert is None for _, stage, expert in named):
        return None
    first = next((e / LEGACY_FILE for e in entries if (e / LEGACY_FILE).is_file()), None)
    sizes = megatron_args.args_parallelism(megatron_args.read_legacy_args(first)) if first is not None else {}
    try:
        if "pp" in sizes or "ep" in sizes:
            return Grid.of(sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("ep", 1))
        if manifest is not None and manifest.iteration in (None, iteration):
            return Grid.of(manifest.tensor_parallel_size, manifest.pipeline_parallel_size,
                           manifest.expert_parallel_size)
    except ValueError:  # sizes below 1: the names are read as a stage, and the sizes refused later
        pass
    return None


def read_legacy(path: str | os.PathLike, *, iteration: int | str | None = None, layer_counts: Sequence[int] | None = None,
                num_experts: int | None = None) -> list[dict]:
    """One globally numbered state dict per TP rank from a legacy checkpoint."""
    return open_legacy(path, iteration=iteration).tp_shards(layer_counts, num_experts=num_experts)
