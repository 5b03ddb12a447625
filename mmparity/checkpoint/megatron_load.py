"""``verify --load``: does a checkpoint on disk load strictly into Megatron's own class?

The class for the checkpoint's family (:mod:`mmparity.cases.megatron`) is built from the HF config
the checkpoint keeps beside its weights, at the checkpoint's TP size, one process per TP rank
(spawned, gloo). A legacy checkpoint: each rank's ``model`` state dict through
``load_state_dict(strict=True)`` (only TE's ``_extra_state`` may be missing, as Megatron's own
load hook allows). torch_dist: ``dist_checkpointing.load`` against the class's
``sharded_state_dict()``, then the same strict load of what it returns.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

from megatron.core.dist_checkpointing.mapping import ShardedTensor

from mmparity import families, runtime
from mmparity.cases import megatron as megatron_cases
from mmparity.checkpoint import torch_dist, torch_dist_files
from mmparity.checkpoint.fsio import CheckpointError
from mmparity.checkpoint.layout import resolve_iteration_dir
from mmparity.checkpoint.legacy import open_legacy
from mmparity.checkpoint.manifest import LAYOUT_LEGACY, LAYOUT_TORCH_DIST, read_manifest
from mmparity.checkpoint.streaming import HF_CONFIG_FILE, ConvertError, load_family_config
from mmparity.upstream import models


@dataclasses.dataclass
class RankLoad:
    rank: int
    ok: bool
    message: str = ""
    tolerated: int = 0  # missing ``_extra_state`` entries


@dataclasses.dataclass
class LoadReport:
    directory: Path
    layout: str
    family: str
    megatron_class: str
    tp: int
    ranks: list = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.ranks) and all(r.ok for r in self.ranks)

    def __str__(self) -> str:
        head = (f"{self.directory} ({self.layout}, TP {self.tp}): strict load into Megatron's "
                f"{self.megatron_class} ({self.family}, megatron-core {models.megatron_version()}, "
                f"{models.describe_te()})")
        lines = [f"{head}: {'all ranks load' if self.ok else 'FAILED'}"]
        for r in self.ranks:
            detail = (f"loads ({r.tolerated} TE _extra_state entries absent, as Megatron allows)"
                      if r.ok else r.message)
            lines.append(f"  rank {r.rank}: {'ok' if r.ok else 'FAIL'}: {detail}")
        return "\n".join(lines)


def _family_config(root: Path, family: str):
    """The family config Megatron's class is built from: read, and bounded by the weights present,
    exactly as `convert` reads it."""
    try:
        return load_family_config(root / HF_CONFIG_FILE, family, root)[0]
    except ConvertError as exc:
        raise CheckpointError(str(exc)) from None


@dataclasses.dataclass(frozen=True)
class _LoadJob:
    root: str
    layout: str
    upstream: str
    cfg: object


def _load_rank(rank: int, world_size: int, job: _LoadJob) -> RankLoad:
    runtime.init_parallel(world_size, 1)
    model = models.build(job.upstream, job.cfg)
    try:
        if job.layout == LAYOUT_LEGACY:
            state = open_legacy(job.root).load_rank(rank)
        else:
            # A converted checkpoint holds no TE FP8 metadata: ask only for the tensors.
            wanted = {k: v for k, v in model.sharded_state_dict().items()
                      if not k.endswith("._extra_state")}
            _compare_sharded_keys(job.root, wanted)
            state = torch_dist.load_torch_dist(job.root, wanted)
        tolerated = models.load_strict(model, state)
    except models.StrictLoadError as exc:
        return RankLoad(rank, False, str(exc))
    except CheckpointError as exc:
        return RankLoad(rank, False, str(exc))
    return RankLoad(rank, True, tolerated=len(tolerated))


def _compare_sharded_keys(root: str, wanted: dict) -> None:
    """Name every tensor the class asks for that the checkpoint lacks (or holds in another global
    shape), and every tensor it holds that the class has no place for, before DCP, which reports
    only the first."""
    stored = torch_dist_files.tensor_metadata(resolve_iteration_dir(root)[1])
    asked = {v.key: tuple(v.global_shape) for v in wanted.values() if isinstance(v, ShardedTensor)}
    missing = [k for k in asked if k not in stored]
    unexpected = [k for k in stored if k not in asked and "_extra_state" not in k]
    mismatched = [f"{k}: {stored[k][1]} vs {asked[k]}" for k in asked
                  if k in stored and stored[k][1] != asked[k]]
    if missing or unexpected or mismatched:
        raise models.StrictLoadError(missing, unexpected, mismatched)


def load_into_megatron(directory: str | os.PathLike, megatron_class: Optional[str] = None) -> LoadReport:
    """Build Megatron's class at the checkpoint's TP size and load every rank strictly.

    Raises :class:`CheckpointError` for a directory that is not an mmparity mcore checkpoint,
    :class:`~mmparity.cases.megatron.NoMegatronClass` for a family without a Megatron class and
    :class:`~mmparity.upstream.models.UpstreamUnavailable` when the class is not importable.
    A checkpoint that does not fit the class is a failed rank, not an exception.
    """
    root = Path(directory)
    manifest = read_manifest(root)
    if manifest.layout not in (LAYOUT_LEGACY, LAYOUT_TORCH_DIST):
        raise CheckpointError(f"{root}: --load needs an mcore checkpoint (legacy or torch_dist), "
                              f"this one is {manifest.layout}")
    family = manifest.provenance.family
    if family is None:
        raise CheckpointError(f"{root}: the manifest names no family")
    if manifest.pipeline_parallel_size != 1:
        raise CheckpointError(f"{root}: PP {manifest.pipeline_parallel_size}: --load builds Megatron's "
                              "vision classes without pipeline stages; convert with --pp 1")
    name, mclass = megatron_cases.megatron_class(family, megatron_class)
    models.require(mclass.upstream)
    cfg = _family_config(root, family)
    tp = manifest.tensor_parallel_size
    job = _LoadJob(str(root), manifest.layout, mclass.upstream, cfg)
    if tp == 1:
        ranks = [_load_rank(0, 1, job)]
    else:
        ranks = runtime.spawn(_load_rank, tp, job)
    return LoadReport(root, manifest.layout, family, name, tp, ranks)
