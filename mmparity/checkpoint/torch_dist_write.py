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
as it was. ``tests/test_torch_dist_layout.py`` compares what this writes with what mcore's own
save of the family's Megatron model writes.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from mmparity.checkpoint import dcp_metadata, extra_state, torch_dist_files
from mmparity.checkpoint.fsio.checksums import tensor_checksum
from mmparity.checkpoint.fsio.pieces import narrow_pieces
from mmparity.checkpoint.fsio.publish import atomic_directory
from mmparity.checkpoint.fsio.slots import SlotWriter
from mmparity.checkpoint.fsio.syscalls import pwrite_all
from mmparity.checkpoint.layout import CHECKPOINT_VERSION, DIST_CONFIG_FILE, RELEASE, iteration_dirname
from mmparity.checkpoint.manifest import LAYOUT_TORCH_DIST, Manifest, Provenance, TensorRecord, write_mcore_root
from mmparity.checkpoint.torch_dist_layout import Layout

__all__ = ["write_torch_dist", "DATA_FILE", "COMMON_FILE", "DIST_CONFIG"]

DATA_FILE = "__0_0.distcp"  # DCP's name for rank 0's single file
COMMON_FILE = "common.pt"
# mcore's CheckpointingConfig for torch_dist, as `metadata.json` records it.
DIST_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
               "common_backend": "torch", "common_backend_version": 1}


def _empty_object_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save([None], buffer)
    return buffer.getvalue()


def write_torch_dist(root: str | os.PathLike, layout: Layout, produce: Callable[[str], list], *,
                     iteration: int | str = 1, common: Mapping | None = None,
                     content_metadata: Mapping | None = None, provenance: Provenance | None = None,
                     extra_files: Mapping[str, str | bytes] | None = None,
                     extra_records: Sequence[TensorRecord] = (), force: bool = False, locate=None,
                     written: Callable[[str], None] | None = None) -> Path:
    """Writes ``layout`` as a torch_dist checkpoint at ``root``, atomically.

    ``produce(key)`` gives the pieces (consecutive dim-0 blocks, views where the source allows) of
    converter tensor ``key``; each is asked for once, in layout order, and dropped once its chunks
    are queued. ``locate`` tells which pieces are views of source files (copied file to file).
    ``written(key)`` is called after each tensor is handed to the writer."""
    root = Path(root).absolute()
    iteration_name = iteration_dirname(iteration)
    by_source: dict[str, list] = {}
    for tensor in layout.tensors:
        for chunk in tensor.chunks:
            by_source.setdefault(chunk.source, []).append((tensor, chunk))
    with atomic_directory(root, force=force) as staging:
        directory = staging / iteration_name
        directory.mkdir()
        fd = os.open(directory / DATA_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        slots, entries, objects, records = {}, [], {}, list(extra_records)
        offset = 0
        try:
            for tensor in layout.tensors:
                chunks = []
                for chunk in tensor.chunks:
                    offset, slots[tensor.key, chunk.offsets], length = torch_dist_files.framed_slot(
                        offset, tensor.dtype, chunk.sizes, chunk.source_shape)
                    chunks.append((chunk.offsets, chunk.sizes, (DATA_FILE, offset, length)))
                    offset += length
                entries.append(dcp_metadata.TensorEntry(tensor.key, tensor.shape, tensor.dtype, tuple(chunks)))
            empty = _empty_object_bytes()
            checksum = tensor_checksum(extra_state.bytes_tensor(empty))
            for stored in layout.objects:
                pwrite_all(fd, empty, offset)
                objects[stored.unique_key] = (DATA_FILE, offset, len(empty))
                # Certified like a tensor: the checksum of the exact (pickled) bytes written.
                records.append(TensorRecord(iteration_name, stored.unique_key, checksum, None))
                offset += len(empty)
            # Sized up front, so the writer threads fill a file of known length.
            os.ftruncate(fd, offset)
        except BaseException:
            os.close(fd)
            raise
        writer = SlotWriter(directory, [fd], slots, locate=locate)
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
        records += [TensorRecord(iteration_name, key, checksum, offsets)
                    for (key, offsets), checksum in writer.checksums.items()]
        (directory / ".metadata").write_bytes(dcp_metadata.encode_metadata(entries, objects))
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

