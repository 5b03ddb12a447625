"""Reading a torch_dist checkpoint's global tensors without megatron and without a process group.

`megatron.core.dist_checkpointing` stores each ShardedTensor as one *global* tensor in
torch.distributed.checkpoint (DCP) files, whatever TP size wrote it: column-parallel weights are
whole, the swiglu factory stores `[gate; up]` over all ranks, fused QKV keeps mcore's per-group
order. So the global tensors are exactly a TP = 1 state dict, apart from one thing: a homogeneous
`TransformerBlock` stacks its layers along a prepended axis under a key without a layer number
(`decoder.layers.mlp.linear_fc1.weight` of shape `[num_layers, ...]`). `global_state_dict`
unstacks those into `decoder.layers.{i}.` keys, giving the TP = 1, PP = 1 state dict a converter
takes.

Trust: DCP's `.metadata` file is a pickle, read by torch's own reader. Only open torch_dist
checkpoints you trust; the legacy reader in this package is the weights_only alternative.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from mmparity.converters.io import CheckpointError
from mmparity.checkpoint.layout import DIST_CONFIG_FILE

__all__ = [
    "is_torch_dist_dir",
    "tensor_metadata",
    "read_tensor",
    "iter_tensors",
    "global_state_dict",
]

# mcore's container for non-sharded state in mcore >= 0.19 (a pickled object, not a tensor).
_COMMON_STATE_KEY = "common_state"


def is_torch_dist_dir(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / DIST_CONFIG_FILE).is_file() and (path / ".metadata").is_file()


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    if not is_torch_dist_dir(path):
        raise CheckpointError(f"{path}: not a torch_dist checkpoint directory (needs .metadata and {DIST_CONFIG_FILE})")
    return FileSystemReader(str(path))


def tensor_metadata(path: str | os.PathLike) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Sharded key -> (dtype, global shape) for every tensor; byte objects (`_extra_state`) are skipped."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    try:
        metadata = _reader(path).read_metadata()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable torch_dist metadata ({' '.join(str(exc).split())})") from exc
    return {
        key: (entry.properties.dtype, tuple(entry.size))
        for key, entry in sorted(metadata.state_dict_metadata.items())
        if isinstance(entry, TensorStorageMetadata)
    }


def read_tensor(path: str | os.PathLike, key: str, metadata: dict | None = None) -> torch.Tensor:
    """One global tensor, assembled from every rank's shards by DCP (only its bytes are read)."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    metadata = tensor_metadata(path) if metadata is None else metadata
    if key not in metadata:
        raise CheckpointError(f"{path}: no tensor {key!r} in the checkpoint")
    dtype, shape = metadata[key]
    target = {key: torch.empty(shape, dtype=dtype)}
    try:
        # no_dist: a plain local read, usable from any process with or without a process group
        # (torch warns that it assumes a single process, which is exactly the intent).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(target, storage_reader=_reader(path), no_dist=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot read {key!r} ({' '.join(str(exc).split())[:300]})") from exc
    return target[key]


def iter_tensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(sharded key, global tensor) one at a time, in key order."""
    metadata = tensor_metadata(path)
    for key in metadata:
        if key == _COMMON_STATE_KEY:
            continue
        yield key, read_tensor(path, key, metadata)


def global_state_dict(path: str | os.PathLike, *, layer_prefix: str = "decoder.layers.") -> dict[str, torch.Tensor]:
    """The TP = 1, PP = 1 state dict (sharded-key spelling, i.e. TE spelling) of a torch_dist dir.

    Keys under `layer_prefix` without a layer number carry the layer-stack axis first and are split
    into `{layer_prefix}{i}.` keys; keys that already carry a number (non-homogeneous blocks) pass
    through. The per-layer tensors are views of the stacked one.
    """
    stacked = re.compile(rf"^{re.escape(layer_prefix)}(?!\d+\.)(.+)$")
    state: dict[str, torch.Tensor] = {}
    for key, tensor in iter_tensors(path):
        match = stacked.match(key)
        if match is None:
            state[key] = tensor
            continue
        if tensor.dim() == 0:
            raise CheckpointError(f"{path}: {key!r} should carry a layer axis but is a scalar")
        for index, layer_tensor in enumerate(tensor.unbind(0)):
            state[f"{layer_prefix}{index}.{match.group(1)}"] = layer_tensor
    return state
