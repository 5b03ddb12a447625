"""Writing a torch_dist checkpoint from a layout, with neither megatron nor torch.distributed.

What ``megatron.core.dist_checkpointing.save`` writes for a TP = 1 model, byte format for byte
format, in one process:

    <root>/latest_checkpointed_iteration.txt, mmparity.json, extra files
    <root>/iter_0000001/{.metadata, __0_0.distcp, common.pt, metadata.json}

``__0_0.distcp`` holds one ``torch.save`` blob per chunk of ``torch_dist_layout.plan`` (its frame
from ``torch_dist_files.torch_save_frame``, the tensor's bytes 64-byte aligned inside it and
written in place by a ``SlotWriter`` from wherever the source holds them), then the byte objects
(``torch.save([None])``, what mcore stores for an empty ``ShardedObject``). ``.metadata`` is DCP's
index of it (``dcp_metadata``), ``metadata.json`` mcore's format record, ``common.pt`` the common
state (Megatron-LM's ``args``, ``checkpoint_version``, ``iteration``, the content metadata), which
megatron-core reads from that file in every supported version.

The directory is staged and published atomically; any failure (or a kill) leaves the destination
as it was. ``tests/io/test_torch_dist_layout.py`` compares what this writes with what mcore's own
save of the family's Megatron model writes.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from mmparity.io import dcp_metadata, extra_state, torch_dist_files
from mmparity.io.fsio import shared
from mmparity.io.fsio.checksums import TensorChecksum, tensor_checksum
from mmparity.io.fsio.pieces import narrow_pieces
from mmparity.io.fsio.safetensors_format import parse_size
from mmparity.io.fsio.slots import SlotWriter
from mmparity.io.fsio.syscalls import pwrite_all
from mmparity.io.layout import CHECKPOINT_VERSION, DIST_CONFIG_FILE, RELEASE, iteration_dirname
from mmparity.io.manifest import LAYOUT_TORCH_DIST, Manifest, Provenance, TensorRecord, write_mcore_root
from mmparity.io.team import Team, solo
from mmparity.io.torch_dist_layout import Layout

__all__ = ["write_torch_dist", "data_file", "DATA_FILE", "COMMON_FILE", "DIST_CONFIG", "DEFAULT_FILE_SIZE"]

DATA_FILE = "__0_0.distcp"  # DCP's name for rank 0's first file: the only one of a small checkpoint
# Files of this size let several processes share the writing of a large checkpoint (one file is
# one process's unit) while a small one stays one file.
DEFAULT_FILE_SIZE = "2GB"
COMMON_FILE = "common.pt"
# mcore's CheckpointingConfig for torch_dist, as `metadata.json` records it.
DIST_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
               "common_backend": "torch", "common_backend_version": 1}


def _empty_object_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save([None], buffer)
    return buffer.getvalue()


def data_file(number: int) -> str:
    """DCP's name for a data file (``__<rank>_<thread>.distcp``); mmparity numbers its files so."""
    return shared.name(f"__{number}_0.distcp")


def _file_plan(layout: Layout, limit: int, empty: bytes):
    """Where every chunk's blob and every object's bytes go: (file lengths, slots {(key,
    offsets): (file number, Slot)}, DCP entries, objects {unique key: (file, offset, length)}).
    Blobs fill files in layout order, a new file when the next blob would pass ``limit`` (a blob
    larger than it gets a file of its own); the objects go at the end of the last file."""
    lengths = [0]
    slots, entries, objects = {}, [], {}
    for tensor in layout.tensors:
        chunks = []
        for chunk in tensor.chunks:
            start, slot, length = torch_dist_files.framed_slot(lengths[-1], tensor.dtype, chunk.sizes,
                                                               chunk.source_shape)
            if lengths[-1] and start + length > limit:
                lengths.append(0)
                start, slot, length = torch_dist_files.framed_slot(0, tensor.dtype, chunk.sizes, chunk.source_shape)
            number = len(lengths) - 1
            slots[tensor.key, chunk.offsets] = dataclasses.replace(slot, file=number, shape=shared.shape(slot.shape))
            chunks.append((chunk.offsets, chunk.sizes, (data_file(number), start, length)))
            lengths[-1] = start + length
        entries.append(dcp_metadata.TensorEntry(tensor.key, tensor.shape, tensor.dtype, tuple(chunks)))
    last = len(lengths) - 1
    for stored in layout.objects:
        objects[stored.unique_key] = (data_file(last), lengths[last], len(empty))
        lengths[last] += len(empty)
    return lengths, slots, entries, objects


def write_torch_dist(root: str | os.PathLike, layout: Layout, produce: Callable[[str], list], *,
                     iteration: int | str = 1, common: Mapping | None = None,
                     content_metadata: Mapping | None = None, provenance: Provenance | None = None,
                     extra_files: Mapping[str, str | bytes] | None = None,
                     extra_records: Sequence[TensorRecord] = (), force: bool = False, locate=None,
                     written: Callable[[str], None] | None = None,
                     max_file_size: int | str = DEFAULT_FILE_SIZE, team: Team | None = None,
                     node_local: bool = False) -> Path:
    """Writes ``layout`` as a torch_dist checkpoint at ``root``, atomically.

    ``produce(key)`` gives the pieces (consecutive dim-0 blocks, views where the source allows) of
    converter tensor ``key``; each is asked for once, in layout order, and dropped once its chunks
    are queued. ``locate`` tells which pieces are views of source files (copied file to file).
    ``written(key)`` is called after each tensor is handed to the writer. Data files hold up to
    ``max_file_size`` bytes each; with a ``team`` of several processes, each writes the files
    :func:`team.assign_units` gives it and only reads what they hold (the bytes are the same);
    ``node_local``: each node writes its ranks' files to ``root`` on its own disk (team.staging)."""
    root = Path(root).absolute()
    team = team or solo()
    iteration_name = iteration_dirname(iteration)
    empty = _empty_object_bytes()
    lengths, slots, entries, objects = _file_plan(layout, parse_size(max_file_size), empty)
    mine = team.mine(lengths)
    by_source: dict[str, list] = {}
    for tensor in layout.tensors:
        for chunk in tensor.chunks:
            if mine[slots[tensor.key, chunk.offsets].file]:
                by_source.setdefault(chunk.source, []).append((tensor, chunk))
    with team.staging(root, force=force, inner=iteration_name, node_local=node_local) as staging:
        directory = staging / iteration_name
        fds: list[int | None] = []
        try:
            for number, length in enumerate(lengths):
                if not mine[number]:
                    fds.append(None)
                    continue
                fd = os.open(directory / data_file(number), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                fds.append(fd)
                # Sized up front, so the writer threads fill a file of known length.
                os.ftruncate(fd, length)
            if mine[-1]:
                for file_name, offset, _ in objects.values():
                    pwrite_all(fds[-1], empty, offset)
        except BaseException:
            for fd in fds:
                if fd is not None:
                    os.close(fd)
            raise
        writer = SlotWriter(directory, fds, {name: slot for name, slot in slots.items() if mine[slot.file]},
                            locate=locate)
        try:
            for source, placed in by_source.items():
                pieces = produce(source)
                for tensor, chunk in placed:
                    part = list(pieces) if chunk.rows is None else narrow_pieces(pieces, 0, *chunk.rows)
                    if len(part) == 1 and isinstance(part[0], torch.Tensor):
                        part = [part[0].reshape(chunk.source_shape)]
                    writer.write((tensor.key, chunk.offsets), part)
                del pieces, part
                if written is not None:
                    written(source)
            writer.close()
        finally:
            writer.abort()
        # One process keeps its checksums as they are: their JSON form, only for the wire, would be a
        # second copy of every record at the conversion's peak.
        gathered = [] if team.solo else team.gather("written", [[key, list(offsets), checksum.to_json()]
                                                                for (key, offsets), checksum in writer.checksums.items()])
        if not team.leader:
            return root
        records = list(extra_records)
        # Certified like a tensor: the checksum of the exact (pickled) bytes written.
        checksum = tensor_checksum(extra_state.bytes_tensor(empty))
        records += [TensorRecord(iteration_name, stored.unique_key, checksum, None) for stored in layout.objects]
        records += [TensorRecord(iteration_name, key, checksum, offsets)
                    for (key, offsets), checksum in writer.checksums.items()]
        records += [TensorRecord(iteration_name, key, TensorChecksum.from_json(c), tuple(offsets))
                    for part in gathered[1:] for key, offsets, c in part]
        with open(directory / ".metadata", "wb") as index_file:
            dcp_metadata.encode_metadata(entries, objects, write=index_file.write)
        (directory / DIST_CONFIG_FILE).write_text(json.dumps(DIST_CONFIG))
        common_state = {**(common or {}), "checkpoint_version": CHECKPOINT_VERSION,
                        "iteration": 0 if iteration == RELEASE else iteration}
        if content_metadata is not None:
            common_state["content_metadata"] = dict(content_metadata)
        torch.save(common_state, directory / COMMON_FILE)
        write_mcore_root(staging, Manifest(
            layout=LAYOUT_TORCH_DIST, tensors=tuple(records), provenance=provenance or Provenance(),
            tensor_parallel_size=1, pipeline_parallel_size=1, expert_parallel_size=1, iteration=iteration,
        ), extra_files)
    return root
