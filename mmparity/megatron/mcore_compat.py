"""The few megatron-core internals the torch_dist writer touches, and where they differ by version.

Checked against megatron-core 0.16.1 (Python 3.11) and 0.19.x (Python 3.12):

* `TorchDistSaveShardedStrategy` lives in `dist_checkpointing.strategies.torch` in both. In 0.16 it
  derives from `AsyncSaveShardedStrategy` and `save()` runs the async request synchronously; in
  0.19 the strategy base classes are gone, `dist_checkpointing.save` replaces any strategy that is
  not an instance of this class, and `save()` still goes through the same async machinery. Both
  versions' `save()` reach CUDA (see `torch_dist.CpuTorchDistSaveStrategy`), which is why we
  subclass it and override only `save()`.
* `_replace_state_dict_keys_with_sharded_keys`, `mcore_to_pyt_state_dict`, `MCoreSavePlanner`:
  same names and signatures in both. 0.19 passes `flatten_sharded_tensors=False` to the planner
  (a pure speed-up); we pass it whenever torch's planner accepts it.
* Validation helpers (`apply_factories`, `extract_nonpersistent`, `extract_sharded_base`,
  `nested_values`, `validate_sharding_integrity`, `is_main_replica`): same in both.
* Loading: `dist_checkpointing.load` cannot be made safe from outside. Its torch_dist strategy
  builds its own `FileSystemReader` (plain `pickle.load` of `.metadata`) and `MCoreLoadPlanner`
  (DCP's `load_bytes`: `torch.load(weights_only=False)` of every ShardedObject), and 0.19 reads the
  common state through another such reader with no strategy to swap. `load_sharded` composes the
  same steps from their pure parts (`load_preprocess`, `extract_sharded_base`, the key
  translations, `apply_factory_merges`: same names and signatures in both versions) around a
  reader and a planner of ours. The planner's keyword arguments follow the installed version
  (0.19 adds `stream_ckpt_dequant`, and flattens nothing).
* Common (non-tensor) state: 0.16 writes `common.pt`; 0.19 stores it as a `common_state` object
  inside the DCP files, still reads `common.pt` (preferring it), but 0.16 cannot read 0.19's
  checkpoints without it. `ensure_common_file` writes it when mcore did not, so a checkpoint
  converted with either version loads with both.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import merge, nested_values
from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor, apply_factories,
                                                      apply_factory_merges, is_main_replica)
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch_strategies
from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base
from megatron.core.dist_checkpointing.validation import validate_sharding_integrity

try:
    from megatron.core.package_info import __version__ as MCORE_VERSION
except ImportError:  # pragma: no cover - every supported release has package_info
    MCORE_VERSION = "unknown"

TorchDistSaveShardedStrategy = mcore_torch_strategies.TorchDistSaveShardedStrategy
MCoreSavePlanner = mcore_torch_strategies.MCoreSavePlanner
replace_state_dict_keys_with_sharded_keys = mcore_torch_strategies._replace_state_dict_keys_with_sharded_keys
mcore_to_pyt_state_dict = mcore_torch_strategies.mcore_to_pyt_state_dict
MCoreLoadPlanner = mcore_torch_strategies.MCoreLoadPlanner

__all__ = [
    "MCORE_VERSION",
    "ShardedObject",
    "ShardedTensor",
    "TorchDistSaveShardedStrategy",
    "apply_factories",
    "dist_checkpointing",
    "ensure_common_file",
    "extract_nonpersistent",
    "extract_sharded_base",
    "is_main_replica",
    "load_sharded",
    "make_save_planner",
    "mcore_to_pyt_state_dict",
    "nested_values",
    "replace_state_dict_keys_with_sharded_keys",
    "validate_sharding_integrity",
]


def make_save_planner() -> MCoreSavePlanner:
    """mcore's planner as its own strategy configures it: no torch-side dedup, no flattening."""
    kwargs = {"flatten_state_dict": False}
    from torch.distributed.checkpoint import DefaultSavePlanner

    if "flatten_sharded_tensors" in inspect.signature(DefaultSavePlanner.__init__).parameters:
        kwargs["flatten_sharded_tensors"] = False
    return MCoreSavePlanner(dedup_replicated_tensors=False, **kwargs)


class SafeBytesLoadPlanner(MCoreLoadPlanner):
    """MCoreLoadPlanner whose byte items are decoded by ``decode_bytes(read_item, data)``, a
    callable of ours, never by DCP's ``torch.load(weights_only=False)``."""

    decode_bytes = None

    def load_bytes(self, read_item, value) -> None:
        from torch.distributed.checkpoint._nested_dict import set_element

        decoded = self.decode_bytes(read_item, value.getvalue() if hasattr(value, "getvalue") else value.read())
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], decoded)
        else:
            self.state_dict[read_item.dest_index.fqn] = decoded


def make_load_planner(sharded_tensors, decode_bytes):
    """mcore's load planner configured as the installed version's own strategy configures it,
    with ``decode_bytes(read_item, data)`` decoding every byte item (ShardedObject)."""
    flexible = [t for t in sharded_tensors if not t.allow_shape_mismatch]
    mismatch_ok = {t.key: t for t in sharded_tensors if t.allow_shape_mismatch}
    kwargs = {"shapes_validation_sharded_tensors": flexible, "allow_shape_mismatch_sharded_tensors": mismatch_ok}
    if "stream_ckpt_dequant" in inspect.signature(MCoreLoadPlanner.__init__).parameters:
        kwargs.update(flatten_state_dict=False, flatten_sharded_tensors=False)
    planner = SafeBytesLoadPlanner(**kwargs)
    planner.decode_bytes = decode_bytes
    return planner


def load_sharded(sharded_state_dict: dict, checkpoint_dir: str, storage_reader, decode_bytes) -> dict:
    """What ``dist_checkpointing.load(sharded_state_dict, checkpoint_dir)`` returns for the
    sharded part (its common state is not read), with every byte read through ``storage_reader``
    and every ShardedObject decoded by ``decode_bytes``. No collective: each rank reads its own
    shards against the global metadata."""
    from torch.distributed.checkpoint import load as dcp_load

    sharded, nonpersistent, factories = load_preprocess(sharded_state_dict)
    sharded, _ = extract_sharded_base(sharded)
    tensors = [v for v in nested_values(sharded) if isinstance(v, ShardedTensor)]
    by_key, flat_mapping, rename_mapping = replace_state_dict_keys_with_sharded_keys(sharded)
    pyt_state_dict = mcore_to_pyt_state_dict(by_key, True)
    dcp_load(pyt_state_dict, storage_reader=storage_reader, planner=make_load_planner(tensors, decode_bytes),
             no_dist=True)
    loaded = {k: mcore_torch_strategies._unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
    loaded = mcore_torch_strategies._replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
    mcore_torch_strategies._restore_dict_types(loaded, sharded)
    merge(loaded, nonpersistent)
    return apply_factory_merges(loaded, factories)


COMMON_FILE = "common.pt"


def ensure_common_file(checkpoint_dir: str | os.PathLike, common_state: dict) -> None:
    """Writes mcore < 0.19's `common.pt` if this mcore version did not (call on one rank)."""
    import torch

    path = Path(checkpoint_dir) / COMMON_FILE
    if not path.exists():
        torch.save(common_state, path)
