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
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories, is_main_replica
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


COMMON_FILE = "common.pt"


def ensure_common_file(checkpoint_dir: str | os.PathLike, common_state: dict) -> None:
    """Writes mcore < 0.19's `common.pt` if this mcore version did not (call on one rank)."""
    import torch

    path = Path(checkpoint_dir) / COMMON_FILE
    if not path.exists():
        torch.save(common_state, path)
