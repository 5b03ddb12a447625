"""Writing HF safetensors shards: streamed tensor by tensor into a layout fixed up front, or from
tensors in memory through the same writer."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from json.encoder import encode_basestring_ascii as _json_string
from pathlib import Path

import torch

from mmparity.io.fsio.checksums import TensorChecksum
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.publish import atomic_directory, write_extra_files
from mmparity.io.fsio.safetensors_format import (
    DEFAULT_MAX_SHARD_SIZE, HF_FORMAT_METADATA, SAFETENSORS_CODES, SAFETENSORS_INDEX_FILE,
    SAFETENSORS_SINGLE_FILE, parse_size)
from mmparity.io.fsio.slots import Slot, SlotWriter
from mmparity.io.fsio.syscalls import pwrite_all


def standalone_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning exactly its bytes (safetensors refuses shared storage)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.itemsize:
        tensor = tensor.contiguous().clone()
    return tensor


def _tensor_table(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict:
    """Names to standalone tensors, refusing what a safetensors file cannot hold."""
    table: dict[str, torch.Tensor] = {}
    for name, tensor in (tensors.items() if isinstance(tensors, Mapping) else tensors):
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"tensor names must be non-empty strings, got {name!r}")
        if name in table:
            raise CheckpointError(f"tensor {name!r} written twice")
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        table[name] = standalone_tensor(tensor)
    return table


def write_safetensors_shards(staging: str | os.PathLike,
                             tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                             max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                             metadata: Mapping[str, str] | None = None) -> "StreamingSafetensorsWriter":
    """`save_pretrained`-style shards of in-memory tensors in `staging`, through the one
    safetensors writer the converter uses too; returns the closed writer (files, weight map,
    checksums)."""
    table = _tensor_table(tensors)
    writer = StreamingSafetensorsWriter(staging, [(n, t.dtype, tuple(t.shape)) for n, t in table.items()],
                                        max_shard_size=max_shard_size, metadata=metadata)
    try:
        for name, tensor in table.items():
            writer.write(name, tensor)
        writer.written = writer.close()
    except BaseException:
        writer.abort()
        raise
    return writer


def save_safetensors_checkpoint(
    directory: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
    extra_files: Mapping[str, str | bytes] | None = None,
    force: bool = False,
) -> dict[str, TensorChecksum]:
    """Writes a `save_pretrained`-style safetensors directory atomically; returns per-tensor checksums.

    The tensors are held in memory (every shard's header is laid out before writing); the
    converter streams through `StreamingSafetensorsWriter` directly. `extra_files` (e.g.
    `config.json`) land in the same atomic step.
    """
    with atomic_directory(directory, force=force) as staging:
        writer = write_safetensors_shards(staging, tensors, max_shard_size=max_shard_size, metadata=metadata)
        write_extra_files(staging, extra_files, writer.written)
    return writer.checksums


# Header text is handed to the file in runs of about this many characters.
_HEADER_RUN = 1 << 20


def _write_header(fd: int, metadata: Mapping[str, str], ordered: Sequence[tuple],
                  run_length: int = _HEADER_RUN) -> tuple[int, list[int]]:
    """Writes a shard's header (``json.dumps`` of ``{"__metadata__": metadata, name: {"dtype",
    "shape", "data_offsets"}, ...}`` with ``(",", ":")`` separators, in ``ordered``'s order, padded
    with spaces to a multiple of 8 bytes) behind its 8-byte length. Returns where the data section
    starts and each tensor's offset in it, the section's length last.

    Made entry by entry and written in runs: as a dict of dicts put through ``json.dumps``, the
    header of a shard of 70k tensors (a one-file checkpoint of a release's key set) was a 38 MB
    transient at the top of the conversion's setup. The text is ASCII (names escaped as json does),
    so its length in characters is its length in bytes."""
    offsets = [0]
    run: list[str] = ["{" + _json_string("__metadata__") + ":" + json.dumps(dict(metadata), separators=(",", ":"))]
    buffered, written = len(run[0]), 0
    for name, dtype, shape, nbytes in ordered:
        begin = offsets[-1]
        offsets.append(begin + nbytes)
        text = (f',{_json_string(name)}:{{"dtype":"{SAFETENSORS_CODES[dtype]}","shape":['
                f'{",".join(map(str, shape))}],"data_offsets":[{begin},{begin + nbytes}]}}')
        run.append(text)
        buffered += len(text)
        if buffered >= run_length:
            pwrite_all(fd, "".join(run).encode("ascii"), 8 + written)
            written += buffered
            run, buffered = [], 0
    run.append("}")
    buffered += 1
    # So the byte buffer starts 8-aligned.
    run.append(" " * (-(written + buffered) % 8))
    tail = "".join(run).encode("ascii")
    pwrite_all(fd, tail, 8 + written)
    length = written + len(tail)
    pwrite_all(fd, length.to_bytes(8, "little"), 0)
    return 8 + length, offsets


class StreamingSafetensorsWriter:
    """HF safetensors shards written tensor by tensor, in any order, without buffering.

    Every tensor's name, dtype and shape is known before any is produced (the converter's dry run
    says so), so each shard's header and byte layout are fixed up front: tensors are assigned to
    shards greedily in the given order (HF's rule, a tensor larger than the limit gets a shard of
    its own), laid out inside a shard by decreasing alignment so every tensor's bytes stay aligned,
    and a `SlotWriter` puts each tensor (or its pieces) at its offset. Output names follow
    `save_pretrained`: `model.safetensors`, or `model-0000i-of-0000N.safetensors` plus
    `model.safetensors.index.json`.
    """

    def __init__(self, directory: str | os.PathLike, entries: Sequence[tuple[str, torch.dtype, tuple]], *,
                 max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, metadata: Mapping[str, str] | None = None,
                 locate=None, writes: Callable[[Sequence[int]], Sequence[bool]] | None = None,
                 write_index: bool = True):
        """``writes(shard byte sizes)`` says which shards this process writes (default: all), where
        several processes write one checkpoint; ``write_index``: whether this one writes the index.
        Every process lays out every shard the same way, so the files do not depend on who wrote
        them."""
        self.directory = Path(directory)
        limit = parse_size(max_shard_size)
        if not entries:
            raise CheckpointError(f"{self.directory}: refusing to write a checkpoint with no tensors")
        names = [name for name, _, _ in entries]
        if len(set(names)) != len(names):
            raise CheckpointError(f"{self.directory}: a tensor name appears twice")
        shards: list[list] = []
        size = 0
        for name, dtype, shape in entries:
            if dtype not in SAFETENSORS_CODES:
                raise CheckpointError(f"{name}: dtype {dtype} cannot be stored in safetensors")
            nbytes = math.prod(shape) * dtype.itemsize
            if not shards or (shards[-1] and size + nbytes > limit):
                shards.append([])
                size = 0
            shards[-1].append((name, dtype, tuple(shape), nbytes))
            size += nbytes
        count = len(shards)
        self.files = ([SAFETENSORS_SINGLE_FILE] if count == 1 else
                      [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        self.mine = (list(writes([sum(e[3] for e in shard) for shard in shards])) if writes is not None
                     else [True] * count)
        self._write_index = write_index
        self.weight_map: dict[str, str] = {}
        self.total_bytes = sum(e[3] for s in shards for e in s)
        self.total_parameters = sum(e[3] // e[1].itemsize for s in shards for e in s)
        header_metadata = {**HF_FORMAT_METADATA, **{str(k): str(v) for k, v in (metadata or {}).items()}}
        fds: list[int] = []
        slots: dict[str, Slot] = {}
        try:
            for number, shard in enumerate(shards):
                ordered = sorted(shard, key=lambda e: (-e[1].itemsize, e[0]))
                for name, *_ in ordered:
                    self.weight_map[name] = self.files[number]
                if not self.mine[number]:
                    fds.append(None)
                    continue
                fd = os.open(self.directory / self.files[number], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                fds.append(fd)
                start, offsets = _write_header(fd, header_metadata, ordered)
                os.ftruncate(fd, start + offsets[-1])
                for (name, dtype, shape, nbytes), offset in zip(ordered, offsets):
                    slots[name] = Slot(number, start + offset, nbytes, dtype, shape)
        except BaseException:
            for fd in fds:
                if fd is not None:
                    os.close(fd)
            raise
        self._slots = SlotWriter(self.directory, fds, slots, locate=locate)
        self.checksums = self._slots.checksums

    def writes(self, name: str) -> bool:
        """Whether tensor ``name`` goes to a shard this process writes."""
        return name in self._slots.slots

    def write(self, name: str, tensor: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """`tensor` may also be consecutive pieces of the tensor's C-order bytes."""
        self._slots.write(name, tensor)

    def close(self) -> list[str]:
        """Checks every announced tensor of this process's shards was written, writes the index if
        sharded (and ``write_index``); returns the names of the files this process wrote."""
        self._slots.close()
        files = [name for name, mine in zip(self.files, self.mine) if mine]
        if len(self.files) == 1 or not self._write_index:
            return files
        index = {"metadata": {"total_parameters": self.total_parameters, "total_size": self.total_bytes},
                 "weight_map": dict(sorted(self.weight_map.items()))}
        with open(self.directory / SAFETENSORS_INDEX_FILE, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
        return files + [SAFETENSORS_INDEX_FILE]

    def abort(self) -> None:
        self._slots.abort()
