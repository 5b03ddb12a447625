"""megatron-core `torch_dist` checkpoints, written on CPU under gloo, in Megatron-LM's layout.

    <root>/latest_checkpointed_iteration.txt
    <root>/iter_0000001/   {.metadata, __{rank}_0.distcp, common.pt (mcore < 0.19), metadata.json}
    <root>/mmparity.json

The state dict is what Megatron-LM saves minus optimizer/RNG:
`{"model": model.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": N}`, plus the
`common` entries a caller gives (the converter's `args`, see `megatron_args`) and its content
metadata. It loads with
`megatron.core.dist_checkpointing.load` at any TP size, because the files hold global tensors and
each loading rank reads its own slice.

Why not just `dist_checkpointing.save`: its torch_dist strategy always runs through the async
writer, even for a synchronous save. That path calls `torch.cuda.synchronize()` while staging
tensors ("Torch not compiled with CUDA enabled" on CPU builds, a useless device sync otherwise),
starts a `spawn` Manager process plus one forked writer process per bucket (which is what died
under torchrun on CPU), and `save_state_dict_async_finalize` puts its error flag on
`torch.cuda.current_device()`. `CpuTorchDistSaveStrategy` keeps everything mcore-specific (key
translation, replica de-duplication, mcore's save planner, `common.pt`, `metadata.json`, the
format/version config) and swaps only the I/O for torch's synchronous `dcp.save` with the plain
`FileSystemWriter` (one file per rank, fsynced), in-process. The result is the same DCP format the
async writer produces.

Every rank must call `save_torch_dist` (it is collective over the default process group). Errors
are agreed between ranks before anyone moves on, so a failure on one rank raises `CheckpointError`
on all of them instead of leaving the others blocked in a collective, and the staging directory is
removed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mmparity import errors
from mmparity.megatron import mcore_compat as mc
from mmparity.io import extra_state, torch_dist_files, torch_dist_layout
from mmparity.io.layout import CHECKPOINT_VERSION, RELEASE, iteration_dirname, resolve_iteration_dir
from mmparity.io.manifest import LAYOUT_TORCH_DIST, Manifest, Provenance, TensorRecord, write_mcore_root
from mmparity.io.fsio import faults, interrupts
from mmparity.io.fsio.checksums import tensor_checksum
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.pieces import joined, narrow_pieces
from mmparity.io.fsio.publish import discard_staging_directory, make_staging_directory, publish_staging_directory
from mmparity.io.fsio.slots import SlotWriter
from mmparity.io.fsio.syscalls import pwrite_all
from mmparity.parallel.axes import Grid

__all__ = [
    "CpuTorchDistSaveStrategy",
    "save_torch_dist",
    "load_torch_dist",
    "global_state_dict",
    "is_torch_dist_dir",
]

global_state_dict = torch_dist_files.global_state_dict
is_torch_dist_dir = torch_dist_files.is_torch_dist_dir

ShardedStateDict = dict[str, Any]

# mcore's validation messages list every shard and DCP's paste every rank's traceback: what
# crosses ranks and lands in one line is the root cause, short.
_one_line = errors.one_line


# A meta tensor's bytes, produced on demand: given a meta tensor (a view, reshape or detached alias
# of a placeholder that a state dict entry was built with), that placeholder and the real tensor
# of its shape as consecutive dim-0 pieces (see SlotWriter). Placeholders are told apart by their
# (meta) storage, which every alias shares.
Producer = Callable[[torch.Tensor], tuple]


class CpuTorchDistSaveStrategy(mc.TorchDistSaveShardedStrategy):
    """mcore's torch_dist save strategy with synchronous, in-process, device-agnostic I/O.

    Also records a checksum of every shard this rank writes (`self.shard_records`), computed from
    the exact bytes written. Shard data may be meta tensors when a `produce` callback supplies
    their bytes: DCP plans from shapes alone, and each tensor is produced only when written.
    """

    def __init__(self, checkpoint_name: str = "", produce: Producer | None = None, locate=None):
        super().__init__("torch_dist", 1)
        self.checkpoint_name = checkpoint_name
        self.produce = produce
        self.locate = locate
        self.shard_records: list[TensorRecord] = []

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir) -> None:
        from torch.distributed.checkpoint import save as dcp_save

        by_key, _, _ = mc.replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        record_shapes = {}
        for key_shards in by_key.values():
            for shard in key_shards:
                if not isinstance(shard, mc.ShardedTensor):
                    continue  # ShardedObjects (_extra_state, common_state) are pickles, not weights
                if shard.flattened_range is not None:
                    raise CheckpointError(f"{shard.key}: flattened (distributed-optimizer) shards are not supported")
                if shard.data.is_meta and self.produce is None:
                    raise CheckpointError(f"{shard.key}: meta tensor data and nothing to produce its bytes")
                # DCP indexes a shard by (key, offset); the manifest records it with the shard's own
                # shape, without the axes mcore prepends for stacked layers.
                record_shapes[shard.key, tuple(shard.global_offset)] = tuple(shard.data.shape)
        pyt_state_dict = mc.mcore_to_pyt_state_dict(by_key, False)
        writer = _InPlaceDcpWriter(str(checkpoint_dir), record_shapes, self.produce, self.locate)
        # One rank has nobody to agree plans with: DCP's gather/scatter of the plan (a pickle round
        # trip of every write item) is skipped.
        dcp_save(pyt_state_dict, storage_writer=writer, planner=mc.make_save_planner(),
                 no_dist=dist.get_world_size() == 1)
        self.shard_records = [TensorRecord(self.checkpoint_name, key, checksum, offset)
                              for (key, offset), checksum in writer.checksums.items()]


def _dcp_exception() -> type:
    """DCP reports a failed write as a `CheckpointException`, which derives from BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


class _InPlaceDcpWriter:
    """DCP's `FileSystemWriter` with the data file written by mmparity (one file for this rank).

    DCP plans (which items, which metadata) exactly as for its own writer; only `write_data`
    differs. Each tensor item is still a complete `torch.save` blob, as DCP's reader expects, but
    its frame (`torch_dist_files.torch_save_frame`) is written around a reserved range that a `SlotWriter` fills
    from where the bytes are: no per-item pickling of the data, no clone of views, no spill of
    produced tensors, and writing overlaps producing.
    """

    def __new__(cls, *args, **kwargs):
        from torch.distributed.checkpoint import FileSystemWriter

        # Subclassed lazily: importing DCP costs time that only a torch_dist save should pay.
        if not hasattr(cls, "_impl"):
            cls._impl = type("_InPlaceDcpWriterImpl", (FileSystemWriter,), {
                "__init__": _writer_init, "write_data": _writer_write_data})
        return cls._impl(*args, **kwargs)


def _writer_init(self, path: str, record_shapes: Mapping, produce: Producer | None, locate=None) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    FileSystemWriter.__init__(self, path, single_file_per_rank=True, sync_files=True, thread_count=1)
    self.record_shapes = dict(record_shapes)
    self.produce = produce
    self.locate = locate
    self.checksums: dict = {}


def _writer_write_data(self, plan, planner):
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
    directory = Path(self.path)
    fd = os.open(directory / file_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    results, jobs, slots = [], [], {}
    offset = 0
    try:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item).getbuffer()
                pwrite_all(fd, data, offset)
                length = len(data)
                if extra_state.is_extra_state(item.index.fqn):
                    # Certified like a tensor: the checksum of the exact (pickled) bytes written.
                    self.checksums[item.index.fqn, None] = tensor_checksum(extra_state.bytes_tensor(data))
            else:
                target = planner.resolve_data(item)  # this shard's tensor, meta or real, DCP's shape
                shape = tuple(target.shape)
                index = (item.index.fqn, tuple(item.index.offset))
                offset, slots[index], length = torch_dist_files.framed_slot(
                    offset, target.dtype, shape, self.record_shapes.get(index, shape))
                jobs.append((index, target))
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(file_name, offset, length)))
            offset += length
    except BaseException:
        os.close(fd)
        raise
    # Sized up front, as the other formats' files are: writers then fill a file of known length
    # instead of extending it from two threads out of order.
    os.ftruncate(fd, offset)
    writer = SlotWriter(directory, [fd], slots, locate=self.locate)
    try:
        for index, target in jobs:
            pieces = _bytes_of(target, self.produce)
            if len(pieces) == 1 and isinstance(pieces[0], torch.Tensor):
                # DCP's view of a shard has mcore's prepended axes; the record keeps the shard's shape.
                pieces = [pieces[0].reshape(slots[index].shape)]
            writer.write(index, pieces)
        writer.close()
    finally:
        writer.abort()
    self.checksums.update(writer.checksums)
    future = torch.futures.Future()
    future.set_result(results)
    return future


def _bytes_of(target: torch.Tensor, produce: Producer | None) -> list:
    """The pieces of `target`'s C-order bytes; a meta view is looked up in its produced base."""
    if not target.is_meta:
        return [target if target.is_contiguous() else target.contiguous()]
    # (pieces may hold a ColumnJoin: the whole base and row blocks of it keep it as it is)
    base, pieces = produce(target)
    row = math.prod(base.shape[1:]) if base.dim() else 1
    whole = target.numel() == base.numel() and target.storage_offset() == 0 and target.is_contiguous()
    if whole:
        return list(pieces)
    if target.is_contiguous() and base.dim() and row and target.storage_offset() % row == 0 \
            and target.numel() % row == 0:
        # A block of whole rows of the base (one half of a gated FC1, say): select, don't join.
        first = target.storage_offset() // row
        return narrow_pieces(pieces, 0, first, first + target.numel() // row)
    whole_base = joined(pieces).reshape(base.shape)
    return [whole_base.as_strided(target.shape, target.stride(), target.storage_offset()).contiguous()]


def extra_state_objects(keys: Sequence[str], tensor_keys: Sequence[str],
                        per_layer_stacks: Collection[str] = ()) -> dict:
    """Empty ``_extra_state`` ``ShardedObject``s under the keys, offsets and replica ids Megatron's
    classes give them at TP 1, for the global state-dict ``keys`` (see ``extra_state`` and
    ``torch_dist_layout.object_placements``, which places them; ``per_layer_stacks``: the layer
    stacks of a non-homogeneous block, keyed layer by layer). Only TP rank 0's copy is the main
    replica."""
    placed = torch_dist_layout.object_placements(keys, tensor_keys, per_layer_stacks)
    return {key: mc.ShardedObject(p.key, None, p.shape, p.offset, replica_id=(0, 0, 0)) for key, p in placed.items()}


# --------------------------------------------------------------------------------------------------
# cross-rank agreement


def _require_process_group() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise CheckpointError("torch_dist checkpoints need torch.distributed initialised (gloo works on CPU)")


def _agree(local_error: str | None, stage: str) -> None:
    """Collective: raises the same CheckpointError on every rank if any rank failed."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, local_error)
    failed = [(rank, error) for rank, error in enumerate(errors) if error is not None]
    if failed:
        detail = "; ".join(f"rank {rank}: {error}" for rank, error in failed)
        raise CheckpointError(f"torch_dist {stage} failed: {detail}")


def copy_containers(value):
    """A copy of the dict/list skeleton with shared leaves, for validation that edits in place."""
    if isinstance(value, dict):
        return {k: copy_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_containers(v) for v in value]
    return value


def _validate_sharding(state_dict: ShardedStateDict) -> None:
    """mcore's sharding-integrity check, made symmetric.

    `dist_checkpointing.save` validates on rank 0 only and raises there alone while the other ranks
    walk into the write collectives and wait forever. We run the same check first (on a skeleton
    copy: factories are applied in place) and share the verdict.
    """
    local_metadata, local_error = None, None
    try:
        probe = copy_containers(state_dict)
        mc.apply_factories(probe)
        _, probe = mc.extract_nonpersistent(probe)
        sharded_part, _ = mc.extract_sharded_base(probe)
        local_metadata = [value.without_data() for value in mc.nested_values(sharded_part)]
    except Exception as exc:
        local_error = _one_line(exc)
    _agree(local_error, "state dict preparation")
    global_metadata: list = [None] * dist.get_world_size()
    dist.all_gather_object(global_metadata, local_metadata)
    verdict = [None]
    if dist.get_rank() == 0:
        try:
            mc.validate_sharding_integrity(global_metadata)
        except Exception as exc:
            verdict = [_one_line(exc)]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(f"torch_dist sharding validation failed: {verdict[0]}")


# --------------------------------------------------------------------------------------------------
# save / load


def _initialised_grid() -> Grid:
    """The TP / PP / EP sizes of mcore's initialised parallel state (all 1 when there is none)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return Grid.of()
    return Grid.of(parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_pipeline_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_world_size())


def save_torch_dist(
    root: str | os.PathLike,
    sharded_state_dict: ShardedStateDict | Callable[[], ShardedStateDict],
    *,
    iteration: int | str = 1,
    provenance: Provenance | None = None,
    grid: Grid | None = None,
    content_metadata: Mapping | None = None,
    extra_files: Mapping[str, str | bytes] | None = None,
    force: bool = False,
    produce: Producer | None = None,
    locate=None,
    extra_records: Sequence[TensorRecord] = (),
    common: Mapping | None = None,
) -> Path:
    """Collective: writes a Megatron-LM style torch_dist checkpoint of a model, atomically.

    `sharded_state_dict` is the model's `sharded_state_dict()` on this rank (or a callable
    producing it, so a failure while producing it is agreed on like any other). The TP/PP/EP sizes
    the manifest records (`grid`) default to the initialised mcore parallel state's. `content_metadata` is passed to mcore
    as is: give it the `metadata` you passed to `sharded_state_dict(metadata=...)`, so Megatron-LM
    rebuilds the same key layout on load (none means mcore's defaults, stacked layer keys).
    `extra_files` (plain names) are written at the root by rank 0 in the same atomic step, and
    `extra_records` (checksums of tensors in such a file) join the manifest's records. The
    staging directory is created by rank 0 next to `root`, so all ranks must see the same
    filesystem (as Megatron-LM requires). Tensor data may be meta when `produce` gives the bytes of
    each meta base tensor on demand (a converter streaming from another checkpoint); `locate` says
    which of those are views of source files, so they are copied file to file. `common`: further
    entries of the common (non-sharded) state, such as Megatron-LM's `args` (`megatron_args`);
    `iteration` may be `"release"` (stored as iteration 0, as Megatron-LM's loader reads it).
    """
    _require_process_group()
    rank = dist.get_rank()
    root = Path(root).absolute()
    tp_size, pp_size, ep_size = (grid or _initialised_grid()).sizes
    iteration_name = iteration_dirname(iteration)

    announcement: list = [None]
    staging, created = None, []
    try:
        if rank == 0:
            try:
                with interrupts.deferred():  # made and recorded as one step (see make_staging_directory)
                    staging, created = make_staging_directory(root, force=force)
                faults.fault_point("staged")
                (staging / iteration_name).mkdir()
                announcement = [("ok", str(staging))]
            except Exception as exc:
                announcement = [("error", str(exc) if isinstance(exc, CheckpointError) else _one_line(exc))]
        dist.broadcast_object_list(announcement, src=0)
        status, detail = announcement[0]
        if status == "error":
            raise CheckpointError(detail)
        shared_staging = Path(detail)

        produced, error = None, None
        try:
            produced = sharded_state_dict() if callable(sharded_state_dict) else sharded_state_dict
            if not isinstance(produced, Mapping):
                raise TypeError(f"expected a sharded state dict, got {type(produced).__name__}")
        except Exception as exc:
            error = _one_line(exc)
        _agree(error, "producing the sharded state dict")

        _validate_sharding(produced)

        strategy = CpuTorchDistSaveStrategy(iteration_name, produce, locate)
        common_state = {**(common or {}), "checkpoint_version": CHECKPOINT_VERSION,
                        "iteration": 0 if iteration == RELEASE else iteration}
        error = None
        try:
            mc.dist_checkpointing.save(
                {"model": produced, **common_state},
                str(shared_staging / iteration_name),
                sharded_strategy=strategy,
                validate_access_integrity=False,  # done above, symmetrically
                content_metadata=dict(content_metadata) if content_metadata is not None else None,
            )
        except (Exception, _dcp_exception()) as exc:
            error = _one_line(exc)
        _agree(error, "write")

        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, strategy.shard_records)
        error = None
        if rank == 0:
            try:
                # What mcore < 0.19 puts in common.pt: the non-tensor entries, content metadata included.
                file_common = dict(common_state)
                if content_metadata is not None:
                    file_common["content_metadata"] = dict(content_metadata)
                mc.ensure_common_file(staging / iteration_name, file_common)
                write_mcore_root(
                    staging,
                    Manifest(
                        layout=LAYOUT_TORCH_DIST,
                        tensors=tuple(record for records in gathered for record in records) + tuple(extra_records),
                        provenance=provenance or Provenance(),
                        tensor_parallel_size=tp_size,
                        pipeline_parallel_size=pp_size,
                        expert_parallel_size=ep_size,
                        iteration=iteration,
                    ),
                    extra_files,
                )
                publish_staging_directory(staging, root, force=force)
            except Exception as exc:
                error = _one_line(exc)
        _agree(error, "publish")
    except BaseException:
        if rank == 0 and staging is not None:
            discard_staging_directory(staging, created)
        raise
    return root


def load_torch_dist(
    path: str | os.PathLike,
    sharded_state_dict: ShardedStateDict,
    *,
    iteration: int | str | None = None,
) -> dict:
    """Loads the `model` part of a torch_dist checkpoint into this rank's shards, as
    `dist_checkpointing.load` would, but with nothing unpickled beyond the allow-lists of
    `mmparity.io.unpickle` (see `mcore_compat`: mcore's own load cannot be made safe).

    `sharded_state_dict` is the receiving model's `sharded_state_dict()` under its own (any) TP
    size. Returns a plain state dict for `model.load_state_dict`. `path` is a root (its tracker
    picks the iteration) or an iteration directory. `.metadata` is read and decoded once; every
    object is decoded from the bytes DCP read for it.
    """
    _require_process_group()
    _, iteration_dir, _ = resolve_iteration_dir(path, iteration)
    if not torch_dist_files.is_torch_dist_dir(iteration_dir):
        raise CheckpointError(f"{iteration_dir}: not a torch_dist checkpoint (no .metadata / metadata.json)")
    metadata = torch_dist_files.load_metadata(iteration_dir)

    def decode(read_item, data: bytes):
        return torch_dist_files.decode_object(iteration_dir, read_item.storage_index.fqn, data, metadata)

    try:
        loaded = mc.load_sharded({"model": sharded_state_dict}, str(iteration_dir),
                                 torch_dist_files.storage_reader(iteration_dir, metadata), decode)
    except CheckpointError:
        raise
    except (Exception, _dcp_exception()) as exc:  # DCP's CheckpointException is a BaseException
        cause = errors.root_cause(exc)
        if isinstance(cause, CheckpointError):  # ours (a refused pickle, say), raised inside DCP
            raise cause.with_traceback(None) from None
        # DCP decodes tensor items itself and fails on one that is no tensor of the stated shape
        # with whatever that object lacks ("'list' object has no attribute 'size'"): the item is
        # named by reading the tensors as convert does, which checks each chunk against .metadata.
        damaged = _first_damaged_tensor(iteration_dir)
        if damaged is not None:
            raise damaged from None
        raise CheckpointError(f"{iteration_dir}: torch_dist load failed: {errors.one_line(cause)}") from None
    return loaded["model"]


def _first_damaged_tensor(iteration_dir: Path) -> CheckpointError | None:
    """The first tensor item whose stored chunk is not what ``.metadata`` says, as a refusal."""
    try:
        files = torch_dist_files.TorchDistFiles(iteration_dir)
        for key in files.tensors:
            files.read(key)
    except CheckpointError as exc:
        return exc
    return None
