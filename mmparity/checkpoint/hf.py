"""HF `save_pretrained`-style safetensors output with an `mmparity.json` manifest, in one atomic step;
and the bound every HF config is held to before anything is built from it."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from mmparity.checkpoint.layout import LEGACY_FILE
from mmparity.checkpoint.manifest import LAYOUT_HF, MANIFEST_FILE, Manifest, Provenance, TensorRecord, write_manifest
from mmparity.checkpoint.fsio.errors import CheckpointError
from mmparity.checkpoint.fsio.paths import require_regular_file
from mmparity.checkpoint.fsio.publish import atomic_directory, write_extra_files
from mmparity.checkpoint.fsio.safetensors_format import DEFAULT_MAX_SHARD_SIZE, has_hf_weights
from mmparity.checkpoint.fsio.safetensors_read import SafetensorsCheckpoint
from mmparity.checkpoint.fsio.safetensors_write import write_safetensors_shards

__all__ = ["write_hf", "bound_config", "checkpoint_capacity"]


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
        writer = write_safetensors_shards(staging, tensors, max_shard_size=max_shard_size)
        write_extra_files(staging, extra_files, [*writer.written, MANIFEST_FILE])
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



# --------------------------------------------------------------------------------------------------
# bounding a config by the weights it describes

# Config fields that count layers: a model is built with one module (and the converter one rule)
# per layer, so these decide how much is allocated before any weight is read.
_LAYER_COUNT = re.compile(r"^(num_hidden_layers|num_layers|n_layers|depth|.*_layers)$")
# Config fields that size tensors.
_WIDTH = re.compile(r"^(.*_)?(hidden_size|intermediate_size|embed_dim|hidden_dim|head_dim|projection_dim|"
                    r"num_attention_heads|num_key_value_heads|num_heads|width)$")
# Ceilings beyond any model these encoders describe, whatever the checkpoint holds.
MAX_LAYERS = 10_000
MAX_WIDTH = 2**20


def checkpoint_capacity(path: str | os.PathLike) -> tuple[int, int]:
    """(tensors, elements) at most in the checkpoint at `path`: an HF directory, an mcore root or
    iteration directory. Read from safetensors headers, legacy zip directories and DCP metadata,
    never from the data; an upper bound (a legacy storage may be shared, its bytes count as
    elements), which is all a sanity bound needs. A torch_dist tensor of stacked layers counts once
    per layer."""
    from mmparity.checkpoint.torch_dist_files import is_torch_dist_dir, load_metadata

    path = Path(path)
    if has_hf_weights(path):
        with SafetensorsCheckpoint(path) as checkpoint:
            infos = checkpoint.infos().values()
            return len(infos), sum(math.prod(info.shape) for info in infos)
    tensors = elements = 0
    candidates = [path] + sorted(p for p in path.iterdir() if p.is_dir()) if path.is_dir() else []
    for directory in candidates:
        if is_torch_dist_dir(directory):
            for entry in load_metadata(directory).state_dict_metadata.values():
                size = tuple(getattr(entry, "size", ()) or ())
                if size:
                    tensors += max(1, int(size[0]))
                    elements += math.prod(int(n) for n in size)
        for rank_file in sorted(directory.glob(f"mp_rank_*/{LEGACY_FILE}")):
            require_regular_file(rank_file, "rank file")
            try:
                reader = torch._C.PyTorchFileReader(str(rank_file))
                records = [r for r in reader.get_all_records() if r.startswith("data/")]
                tensors += len(records)
                elements += sum(reader.get_record_size(r) for r in records)
            except RuntimeError as exc:
                raise CheckpointError(f"{rank_file}: not a torch.save file ({' '.join(str(exc).split())[:200]})") from None
    return tensors, elements


def bound_config(config, config_path: str | os.PathLike, checkpoint: str | os.PathLike) -> None:
    """Refuses a config whose sizes the weights in `checkpoint` cannot back, before anything is
    built from it: a layer count above the number of tensors present (every layer has at least
    one), a width above the number of elements present, or either above a ceiling no real model
    reaches. A `depth` of 1e9 would otherwise build a billion modules and rules (tens of GB) before
    a shape was ever compared."""
    tensors, elements = checkpoint_capacity(checkpoint)
    problems = []
    for key, value in _int_fields(config.to_dict() if hasattr(config, "to_dict") else dict(config)):
        name = key.rsplit(".", 1)[-1]
        if _LAYER_COUNT.match(name) and (value > tensors or value > MAX_LAYERS):
            problems.append(f"{key} = {value}, but the checkpoint holds {tensors} tensors" if value > tensors
                            else f"{key} = {value} is beyond the {MAX_LAYERS} layers mmparity accepts")
        elif _WIDTH.match(name) and (value > elements or value > MAX_WIDTH):
            problems.append(f"{key} = {value}, but the checkpoint holds {elements} weights in all" if value > elements
                            else f"{key} = {value} is beyond the width {MAX_WIDTH} mmparity accepts")
    if problems:
        raise CheckpointError(f"{config_path}: sizes the weights cannot back: {'; '.join(problems[:4])} "
                              "(a config from another model?)")


def _int_fields(data: dict, prefix: str = ""):
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _int_fields(value, f"{prefix}{key}.")
        elif isinstance(value, int) and not isinstance(value, bool):
            yield f"{prefix}{key}", value
