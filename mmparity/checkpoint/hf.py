"""HF `save_pretrained`-style safetensors output with an `mmparity.json` manifest, in one atomic step."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from mmparity.checkpoint.manifest import LAYOUT_HF, MANIFEST_FILE, Manifest, Provenance, TensorRecord, write_manifest
from mmparity.checkpoint.fsio import (
    write_extra_files,
    DEFAULT_MAX_SHARD_SIZE,
    ShardedSafetensorsWriter,
    atomic_directory,
)

__all__ = ["write_hf"]


def write_hf(
    directory: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    provenance: Provenance | None = None,
    extra_files: Mapping[str, str | bytes] | None = None,
    force: bool = False,
) -> Path:
    """Writes tensors (a dict or a stream of pairs) as HF safetensors shards plus `mmparity.json`.

    `extra_files` (e.g. `config.json`) land in the same atomic step, so a reader never finds
    weights without their config.
    """
    with atomic_directory(directory, force=force) as staging:
        writer = ShardedSafetensorsWriter(staging, max_shard_size=max_shard_size)
        writer.add_all(tensors)
        written = writer.close()
        write_extra_files(staging, extra_files, [*written, MANIFEST_FILE])
        write_manifest(
            staging,
            Manifest(
                layout=LAYOUT_HF,
                tensors=tuple(
                    TensorRecord(writer.weight_map[name], name, checksum) for name, checksum in writer.checksums.items()
                ),
                provenance=provenance or Provenance(),
            ),
        )
    return Path(directory)

