"""``verify --load``: does a checkpoint on disk load strictly into Megatron's own class?

The class for the checkpoint's family (:mod:`mmparity.cases.megatron`) is built from the HF config
the checkpoint keeps beside its weights, at the checkpoint's TP size, one process per TP rank
(spawned, gloo). A legacy checkpoint: each rank's ``model`` state dict through
``load_state_dict(strict=True)``. torch_dist: ``dist_checkpointing.load`` against the class's whole
``sharded_state_dict()`` (its ``_extra_state`` objects included), then the same strict load of
what it returns. Nothing is tolerated but what the class's own load hooks drop (stock
``LLaVAModel`` ignores missing ``_extra_state``, so for it the output layer's, which ``GPTModel``
leaves out of its sharded state dict, needs none).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

import torch

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import sharded_state_dict_default

from mmparity import errors, runtime
from mmparity.cases.megatron import megatron_class as megatron_class_for
from mmparity.checkpoint import torch_dist, torch_dist_files
from mmparity.checkpoint.fsio.errors import CheckpointError
from mmparity.checkpoint.layout import resolve_iteration_dir
from mmparity.checkpoint.legacy import open_legacy
from mmparity.checkpoint.manifest import LAYOUT_LEGACY, LAYOUT_TORCH_DIST, read_manifest
from mmparity.checkpoint.torch_dist import copy_containers
from mmparity.checkpoint.streaming import HF_CONFIG_FILE, ConvertError, _check_shapes, _validate_tp, open_source
from mmparity.checkpoint.unpickle import RefusedPickle
from mmparity.upstream import models


@dataclasses.dataclass
class RankLoad:
    rank: int
    ok: bool
    message: str = ""
    refused: bool = False  # the checkpoint holds a pickle that is not plain data: a user error


@dataclasses.dataclass
class LoadReport:
    directory: Path
    layout: str
    family: str
    megatron_class: str
    tp: int
    ranks: list = dataclasses.field(default_factory=list)
    pp: int = 1

    @property
    def ok(self) -> bool:
        return bool(self.ranks) and all(r.ok for r in self.ranks)

    def __str__(self) -> str:
        head = (f"{self.directory} ({self.layout}, TP {self.tp}"
                f"{f', PP {self.pp}' if self.pp > 1 else ''}): strict load into Megatron's "
                f"{self.megatron_class} ({self.family}, megatron-core {models.megatron_version()}, "
                f"{models.describe_te()})")
        lines = [f"{head}: {'all ranks load' if self.ok else 'FAILED'}"]
        for r in self.ranks:
            where = f" (TP rank {r.rank % self.tp}, PP stage {r.rank // self.tp})" if self.pp > 1 else ""
            lines.append(f"  rank {r.rank}{where}: {'ok' if r.ok else 'FAIL'}: "
                         f"{'loads' if r.ok else r.message}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class LoadJob:
    root: str
    layout: str
    upstream: str
    cfg: object
    tp: int = 1
    pp: int = 1
    layer_counts: Optional[tuple] = None  # the pipelined stack's split, as the manifest records it
    divisible_by: Optional[int] = None  # the vocabulary divisor the checkpoint was padded with

    @property
    def build_options(self) -> dict:
        """What Megatron's class is built with beyond its config, as the checkpoint records it."""
        return {"divisible_by": self.divisible_by} if self.divisible_by is not None else {}

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def init_parallel(self) -> None:
        """mcore's parallel state for this job (TP ranks fastest, as mcore orders them)."""
        runtime.init_parallel(self.tp, self.pp, layer_counts=self.layer_counts)


def sharded_state_dict(model: torch.nn.Module) -> dict:
    """The model's ``sharded_state_dict()`` as Megatron-LM saves and loads it. A plain container of
    Megatron modules (``upstream.models.VisionWithProjection``: ``LLaVAModel``'s names without a
    language model) gets what ``LLaVAModel``'s inherited ``MegatronModule.sharded_state_dict``
    gives: each child's under its attribute name."""
    if isinstance(model, MegatronModule):
        return model.sharded_state_dict()
    if any(True for _ in model.parameters(recurse=False)) or any(True for _ in model.buffers(recurse=False)):
        raise TypeError(f"{type(model).__name__}: a container with tensors of its own has no "
                        "Megatron sharded state dict")
    state: dict = {}
    for name, child in model.named_children():
        state.update(sharded_state_dict_default(child, f"{name}."))
    return state


def build_and_load(rank: int, world_size: int, job: LoadJob) -> torch.nn.Module:
    """Collective over the ranks of ``job.init_parallel()``: Megatron's class for ``job`` (this
    rank's pipeline stage of it), loaded strictly from the checkpoint (this rank's file, or DCP
    against the class's own sharded state dict). Raises
    :class:`~mmparity.upstream.models.StrictLoadError` or :class:`CheckpointError`."""
    model = models.build(job.upstream, job.cfg, **job.build_options)
    if job.layout == LAYOUT_LEGACY:
        state = open_legacy(job.root).load_rank(rank % job.tp, rank // job.tp)
    else:
        wanted = sharded_state_dict(model)
        _compare_sharded_keys(job.root, wanted)
        state = torch_dist.load_torch_dist(job.root, wanted)
    load_state_dict_strictly(model, state)
    return model


def load_state_dict_strictly(model: torch.nn.Module, state: dict) -> None:
    """``model.load_state_dict(state, strict=True)`` (the class's own load hooks included), with
    every missing, unexpected and mis-shaped key named at once in a
    :class:`~mmparity.upstream.models.StrictLoadError` instead of torch's first complaint."""
    own = model.state_dict()
    mismatched = [f"{k}: {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in state
                  if k in own and torch.is_tensor(own[k]) and torch.is_tensor(state[k])
                  and own[k].shape != state[k].shape]
    if mismatched:  # torch raises on these even when not strict, before any hook has run
        raise models.StrictLoadError([k for k in own if k not in state],
                                     [k for k in state if k not in own], mismatched)
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise models.StrictLoadError(list(result.missing_keys), list(result.unexpected_keys), [])


def _load_rank(rank: int, world_size: int, job: LoadJob) -> RankLoad:
    job.init_parallel()
    try:
        build_and_load(rank, world_size, job)
    except RefusedPickle as exc:
        return RankLoad(rank, False, str(exc), refused=True)
    except (models.StrictLoadError, CheckpointError) as exc:
        return RankLoad(rank, False, str(exc))
    except Exception as exc:  # from inside Megatron's class or torch: the cause, on one line
        return RankLoad(rank, False, errors.one_line(exc))
    return RankLoad(rank, True)


def _compare_sharded_keys(root: str, wanted: dict) -> None:
    """Name every tensor and object the class asks for that the checkpoint lacks (or holds in
    another global shape where the class does not allow it), and every one it holds that the class
    has no place for, before DCP, which reports only the first."""
    iteration_dir = resolve_iteration_dir(root)[1]
    stored = torch_dist_files.tensor_metadata(iteration_dir)
    stored_objects = torch_dist_files.object_keys(iteration_dir)
    # Factories (a gated MLP's fc1 as its two halves, say) name the tensors they load as.
    built = copy_containers(wanted)
    apply_factories(built)
    asked, asked_objects, shape_may_differ = {}, [], set()
    for shard in nested_values(built):
        if isinstance(shard, ShardedTensor):
            asked[shard.key] = tuple(shard.global_shape)
            if shard.allow_shape_mismatch:  # a vocabulary padded for another TP size
                shape_may_differ.add(shard.key)
        elif isinstance(shard, ShardedObject):
            asked_objects.append(shard.unique_key)
    missing = [k for k in asked if k not in stored] + [k for k in asked_objects if k not in stored_objects]
    unexpected = [k for k in stored if k not in asked] + [k for k in stored_objects if k not in asked_objects]
    mismatched = [f"{k}: {stored[k][1]} vs {asked[k]}" for k in asked
                  if k in stored and stored[k][1] != asked[k] and k not in shape_may_differ]
    if missing or unexpected or mismatched:
        raise models.StrictLoadError(missing, unexpected, mismatched)


def load_job(directory: str | os.PathLike, megatron_class: Optional[str] = None,
             tp: Optional[int] = None) -> tuple[LoadJob, str, str, int]:
    """What loading ``directory`` into Megatron takes: ``(job, family, class name, world size)``.
    Raises as :func:`load_into_megatron`."""
    root = Path(directory)
    manifest = read_manifest(root)
    if manifest.layout not in (LAYOUT_LEGACY, LAYOUT_TORCH_DIST):
        raise CheckpointError(f"{root}: --load needs an mcore checkpoint (legacy or torch_dist), "
                              f"this one is {manifest.layout}")
    family = manifest.provenance.family
    if family is None:
        raise CheckpointError(f"{root}: the manifest names no family")
    if tp is not None and tp < 1:
        raise CheckpointError(f"--tp must be >= 1, got {tp}")
    if tp is not None and manifest.layout == LAYOUT_LEGACY and tp != manifest.tensor_parallel_size:
        raise CheckpointError(f"{root}: a legacy checkpoint loads at its own TP size "
                              f"({manifest.tensor_parallel_size}), not {tp}")
    name, mclass = megatron_class_for(family, megatron_class)
    pp = manifest.pipeline_parallel_size
    if pp != 1 and not mclass.pipelined:
        raise CheckpointError(f"{root}: PP {pp}: Megatron's {name} is not built in pipeline stages (only "
                              "LLaVAModel's language model is); convert with --pp 1")
    tp = tp or manifest.tensor_parallel_size
    try:
        # Opened and checked exactly as convert opens and checks a source, before anything is built
        # or spawned: the config bounded by the weights, the recorded TP, PP, layer split and
        # vocabulary divisor by what is present, every stored shape against the config. Missing and
        # foreign tensors are left to the strict load, which names them per rank.
        source = open_source(root, family, complete=False)
        _check_shapes(source)
        _validate_tp(source.rules, tp)
    except ConvertError as exc:
        raise CheckpointError(str(exc)) from None
    models.require(mclass.upstream)
    job = LoadJob(str(root), manifest.layout, mclass.upstream, source.cfg, tp=tp, pp=pp,
                  layer_counts=manifest.pipeline_layer_counts, divisible_by=source.vocab_multiple)
    return job, family, name, job.world_size


def load_into_megatron(directory: str | os.PathLike, megatron_class: Optional[str] = None,
                       tp: Optional[int] = None) -> LoadReport:
    """Build Megatron's class at the checkpoint's TP and PP sizes (torch_dist: at TP ``tp`` if given,
    as it holds global tensors) and load every rank strictly.

    Raises :class:`CheckpointError` for a directory that is not an mmparity mcore checkpoint,
    :class:`~mmparity.cases.megatron.NoMegatronClass` for a family without a Megatron class and
    :class:`~mmparity.upstream.models.UpstreamUnavailable` when the class is not importable.
    A checkpoint that does not fit the class is a failed rank, not an exception.
    """
    job, family, name, world_size = load_job(directory, megatron_class, tp)
    if world_size == 1:
        ranks = [_load_rank(0, 1, job)]
    else:
        ranks = runtime.spawn(_load_rank, world_size, job)
    refused = [r for r in ranks if r.refused]
    if refused:  # not a checkpoint that fails to fit the class: one that must not be loaded at all
        raise RefusedPickle(refused[0].message)
    return LoadReport(Path(directory), job.layout, family, name, job.tp, ranks, pp=job.pp)
