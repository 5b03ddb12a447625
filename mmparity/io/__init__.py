"""Checkpoint formats: HF safetensors directories and Megatron-LM's legacy and torch_dist layouts.

Everything that writes also writes `mmparity.json` (layout, provenance, TP/PP sizes, per-tensor
checksums) and does so atomically; `verify(dir)` re-checks a written checkpoint against it.

Each format is one module of `mmparity.io.formats` behind one record (detect, source,
writer, verify, Megatron load), registered here. Importing this package does not import megatron: only `mmparity.io.torch_dist` (and the
`save_torch_dist` / `load_torch_dist` names, resolved on first use) need megatron-core.
"""

from __future__ import annotations

from mmparity.io.hf import write_hf
from mmparity.io.layout import (
    CHECKPOINT_VERSION, TRACKER_FILE, iteration_dirname, legacy_rank_dirname, read_tracker, resolve_iteration_dir)
from mmparity.io.legacy import LegacyCheckpoint, open_legacy, read_legacy, write_legacy
from mmparity.io.manifest import (
    LAYOUT_HF, LAYOUT_LEGACY, LAYOUT_TORCH_DIST, MANIFEST_FILE, Manifest, Provenance, TensorRecord, read_manifest)
from mmparity.io.verify import Problem, VerifyReport, verify
from mmparity.io.torch_dist_files import global_state_dict as torch_dist_global_state_dict
from mmparity.io.torch_dist_files import is_torch_dist_dir
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io import formats
from mmparity.io.formats import hf as _hf_format
from mmparity.io.formats import legacy as _legacy_format
from mmparity.io.formats import torch_dist as _torch_dist_format

# The formats, one module each (see mmparity.io.formats), in the order detection tries them.
formats.register(_hf_format.FORMAT, _legacy_format.FORMAT, _torch_dist_format.FORMAT)

__all__ = [
    "CHECKPOINT_VERSION",
    "CheckpointError",
    "LAYOUT_HF",
    "LAYOUT_LEGACY",
    "LAYOUT_TORCH_DIST",
    "LegacyCheckpoint",
    "MANIFEST_FILE",
    "Manifest",
    "Problem",
    "Provenance",
    "TRACKER_FILE",
    "TensorRecord",
    "VerifyReport",
    "is_torch_dist_dir",
    "iteration_dirname",
    "legacy_rank_dirname",
    "load_torch_dist",
    "open_legacy",
    "read_legacy",
    "read_manifest",
    "read_tracker",
    "resolve_iteration_dir",
    "save_torch_dist",
    "torch_dist_global_state_dict",
    "formats",
    "verify",
    "write_hf",
    "write_legacy",
]

_LAZY_MEGATRON_NAMES = {"save_torch_dist", "load_torch_dist", "CpuTorchDistSaveStrategy"}


def __getattr__(name: str):
    if name in _LAZY_MEGATRON_NAMES:
        from mmparity.io import torch_dist

        return getattr(torch_dist, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
