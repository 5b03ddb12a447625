"""``verify --load``: does a checkpoint on disk load strictly into Megatron's own class?

The class for the checkpoint's family (the ``megatron`` record of its hooks) is built from the HF config
the checkpoint keeps beside its weights, at the checkpoint's TP size, one process per TP rank
(spawned, gloo). A legacy checkpoint: each rank's ``model`` state dict through
``load_state_dict(strict=True)``. torch_dist: ``dist_checkpointing.load`` against the class's whole
``sharded_state_dict()`` (its ``_extra_state`` objects included), then the same strict load of
what it returns. Nothing is tolerated but what the class's own load hooks drop (stock
``LLaVAModel`` ignores missing ``_extra_state``, so for it the output layer's, which ``GPTModel``
leaves out of its sharded state dict, needs none).

Where the family's default class holds only a part of the checkpoint (a whole VLM that
``LLaVAModel`` cannot hold), the family's other classes that hold the rest load beside it, each
under its own key prefix (``language_model.`` into ``GPTModel`` on every stage,
``vision_projection.`` into ``MultimodalProjector`` on the first); what only a class that cannot be
imported here holds is not loaded, and the report says so with its count and the reason.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import sharded_state_dict_default

from mmparity import errors, progress
from mmparity.convert.checks import check_shapes
from mmparity.convert.sources import model_config_for, open_source
from mmparity.errors import ConvertError
from mmparity.io import formats as ckpt_formats
from mmparity.io import torch_dist_files
from mmparity.io.formats.mcore import NOT_MODEL_KEYS, validate_tp
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.layout import resolve_iteration_dir
from mmparity.io.legacy import load_rank_payload, model_chunk_keys, open_legacy
from mmparity.io.manifest import LAYOUT_LEGACY, LAYOUT_TORCH_DIST, read_manifest
from mmparity.io.megatron_written import describe, read_common
from mmparity.io.unpickle import RefusedPickle
from mmparity.mapping.tables import padded_tables
from mmparity.megatron import torch_dist
from mmparity.megatron.torch_dist import copy_containers
from mmparity.models import registry
from mmparity.models.core import megatron_classes as models
from mmparity.models.core.megatron_side import MegatronClass, NoMegatron, default_refusal
from mmparity.parallel import pp as pp_mod
from mmparity.parallel import runtime
from mmparity.parallel.axes import Grid


# How a rank's count of a Megatron-written torch_dist checkpoint's optimizer / RNG items is named.
TRAINING_STATE = "training state"
# A legacy rank file's entries that are Megatron-LM's bookkeeping, not state: not listed as left out.
_BOOKKEEPING = ("checkpoint_version", "iteration")


@dataclasses.dataclass
class RankLoad:
    rank: int
    ok: bool
    message: str = ""
    refused: bool = False  # the checkpoint holds a pickle that is not plain data: a user error
    loaded: dict = dataclasses.field(default_factory=dict)  # class name -> entries loaded
    not_loaded: dict = dataclasses.field(default_factory=dict)  # prefix -> entries left in the checkpoint
    filled: int = 0  # empty _extra_state slots filled for modules the converter writes none for


@dataclasses.dataclass(frozen=True)
class LoadPart:
    """One Megatron class of a load and the checkpoint keys it holds (all of them: ``holds`` empty)."""

    name: str
    build: Callable  # the class's builder in mmparity.models.core.megatron_classes
    holds: tuple = ()
    root: str = ""  # the prefix the class's own keys sit under in the checkpoint
    pipelined: bool = False  # built on every stage; otherwise whole, on the first stage
    unwritten_extra_state: tuple = ()  # modules whose empty _extra_state slot the converter does not write

    def fills(self, key: str) -> bool:
        """Whether ``key`` (the class's own name, under ``root``) is an ``_extra_state`` slot of a
        module the converter writes none for (filled with the empty slot it writes elsewhere)."""
        if not key.endswith("._extra_state") or not key.startswith(self.root):
            return False
        module = key[: -len("._extra_state")]
        return any(module == name or module.endswith("." + name) for name in self.unwritten_extra_state)

    def holds_key(self, key: str) -> bool:
        return not self.holds or key.startswith(self.holds)


@dataclasses.dataclass(frozen=True)
class NotLoaded:
    """Checkpoint keys under ``prefixes`` (none: every key no class of the load holds) that are
    not loaded, and why."""

    prefixes: tuple
    reason: str

    @property
    def described(self) -> str:
        return _described(self.prefixes) if self.prefixes else "the rest"


def _described(prefixes: tuple) -> str:
    return ", ".join(f"{p}*" for p in prefixes)


@dataclasses.dataclass
class LoadReport:
    directory: Path
    layout: str
    family: str
    megatron_class: str
    grid: Grid
    ranks: list = dataclasses.field(default_factory=list)
    parts: tuple = ()  # LoadParts, where the load is split over several classes or holds a part
    not_loaded: tuple = ()
    notes: tuple = ()
    training_state: tuple = ()  # what of a Megatron-written checkpoint is not the model's (not loaded)

    @property
    def ok(self) -> bool:
        return bool(self.ranks) and all(r.ok for r in self.ranks)

    def __str__(self) -> str:
        tp, pp, ep = self.grid.sizes
        head = (f"{self.directory} ({self.layout}, TP {tp}"
                f"{f', PP {pp}' if pp > 1 else ''}{f', EP {ep}' if ep > 1 else ''}): "
                f"strict load into Megatron's "
                f"{self.megatron_class} ({self.family}, megatron-core {models.megatron_version()}, "
                f"{models.describe_te()})")
        lines = [f"{head}: {'all ranks load' if self.ok else 'FAILED'}"]
        if self.parts:
            lines.append("  parts: " + ", ".join(
                f"{_described(p.holds)} -> {p.name} ({'every stage' if p.pipelined else 'first stage'})"
                for p in self.parts))
        lines += [f"  not loaded: {n.described}: {n.reason}" for n in self.not_loaded]
        if self.training_state:
            lines.append(f"  not loaded, deliberately (Megatron's training state, not the model's): "
                         f"{', '.join(self.training_state)}")
        lines += [f"  note: {note}" for note in self.notes]
        for r in self.ranks:
            tp_rank, pp_rank, ep_rank = grid_ranks(r.rank, self.grid)
            where = ", ".join(([f"TP rank {tp_rank}"] if pp > 1 or ep > 1 else [])
                              + ([f"PP stage {pp_rank}"] if pp > 1 else [])
                              + ([f"EP rank {ep_rank}"] if ep > 1 else []))
            where = f" ({where})" if where else ""
            lines.append(f"  rank {r.rank}{where}: {'ok' if r.ok else 'FAIL'}: "
                         f"{self._loads(r) if r.ok else r.message}")
        return "\n".join(lines)

    def _loads(self, r: RankLoad) -> str:
        """What the rank loaded, counted, where the load is split; plain "loads" otherwise."""
        filled = (f"; filled {r.filled} empty _extra_state slots the converter does not write (TE modules of "
                  "MLA and grouped-GEMM experts)" if r.filled else "")
        if not self.parts:
            left = "; not loaded: " + ", ".join(f"{what} {count} {_LOAD_UNIT[self.layout]}"
                                               for what, count in r.not_loaded.items()) if r.not_loaded else ""
            # A Megatron-written checkpoint's rank: how much of it is the model that loaded.
            count = f" {sum(r.loaded.values())} model keys" if self.training_state else ""
            return "loads" + count + left + filled
        text = "loads " + (", ".join(f"{name} {count} keys" for name, count in r.loaded.items())
                           or "nothing on this stage")
        if r.not_loaded:
            unit = _LOAD_UNIT[self.layout]
            text += "; not loaded: " + ", ".join(f"{what} {count} {unit}" for what, count in r.not_loaded.items())
        return text + filled


@dataclasses.dataclass(frozen=True)
class LoadJob:
    root: str
    layout: str
    parts: tuple  # LoadParts
    cfg: object
    # TP x PP x EP the classes are built and loaded at (EP: Megatron's expert_model_parallel_size,
    # legacy: one rank file per EP rank)
    grid: Grid = dataclasses.field(default_factory=Grid.of)
    layer_counts: Optional[tuple] = None  # the pipelined stack's split, as the manifest records it
    divisible_by: Optional[int] = None  # the vocabulary divisor the checkpoint was padded with
    not_loaded: tuple = ()  # NotLoaded
    notes: tuple = ()  # why the load is split, where it is
    iteration: Optional[object] = None  # the iteration read (None: the tracker's)
    training_state: tuple = ()  # a Megatron-written checkpoint's non-model entries, described

    def skips(self, key: str) -> Optional[str]:
        """What of the checkpoint that is not loaded ``key`` belongs to (as the report names it),
        or None."""
        if self.training_state and NOT_MODEL_KEYS.match(key):
            return TRAINING_STATE
        for left in self.not_loaded:
            if not left.prefixes and not any(part.holds_key(key) for part in self.parts):
                return left.described
            hit = next((p for p in left.prefixes if key.startswith(p)), None)
            if hit is not None:
                return _described((hit,))
        return None

    @property
    def build_options(self) -> dict:
        """What Megatron's class is built with beyond its config, as the checkpoint records it."""
        return {"divisible_by": self.divisible_by} if self.divisible_by is not None else {}

    @property
    def world_size(self) -> int:
        return self.grid.world_size

    def init_parallel(self) -> None:
        """mcore's parallel state for this job (TP ranks fastest, as mcore orders them; the
        data-parallel size is EP, whose expert groups mcore lays over it)."""
        runtime.init_parallel(self.grid, layer_counts=self.layer_counts)


def grid_ranks(rank: int, grid: Grid) -> tuple[int, int, int]:
    """``(TP rank, PP stage, EP rank)`` of a global rank in a world of ``tp x ep x pp`` ranks laid
    out as mcore lays them (TP fastest, then data parallel, whose ranks are the EP ranks here, then
    pipeline)."""
    tp, _, ep = grid.sizes
    return rank % tp, rank // (tp * ep), (rank // tp) % ep


def _own_ranks(rank: int, job: "LoadJob") -> tuple[int, int, int]:
    """This rank's place in mcore's parallel state (what it builds and loads), checked against
    :func:`grid_ranks`."""
    from megatron.core import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        return grid_ranks(rank, job.grid)
    own = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
           ps.get_expert_model_parallel_rank() if job.grid.ep.size > 1 else 0)
    if own != grid_ranks(rank, job.grid):
        raise CheckpointError(f"rank {rank}: mcore places it at (TP, PP, EP) {own}, not "
                              f"{grid_ranks(rank, job.grid)}")
    return own


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


class Parts(torch.nn.Module):
    """Megatron's classes for the parts of one checkpoint, each under its prefix (``LLaVAModel``'s
    attribute names), so that the keys read as the checkpoint's; a part at the root (a plain
    container, :class:`~mmparity.models.core.megatron_classes.VisionWithProjection`) lends its children."""

    def __init__(self, built: list):
        super().__init__()
        for part, model in built:
            if part.root:
                self.add_module(part.root.rstrip("."), model)
            else:
                for name, child in model.named_children():
                    self.add_module(name, child)


def _build(rank: int, job: LoadJob) -> tuple[torch.nn.Module, list]:
    """This rank's stage of the job's classes, and ``[(part, model)]`` of the parts built."""
    first = _own_ranks(rank, job)[1] == 0
    built = [(part, models.build(part.build, job.cfg, **job.build_options))
             for part in job.parts if part.pipelined or first]
    if len(job.parts) == 1 and not job.parts[0].root:
        return built[0][1], built
    return Parts(built), built


def _load(rank: int, job: LoadJob) -> tuple[torch.nn.Module, dict, dict]:
    """``(model, {class: entries loaded}, {prefix: entries not loaded})`` for this rank."""
    progress.step(f"building {' + '.join(part.name for part in job.parts)}")
    model, built = _build(rank, job)
    progress.step("reading its state")
    state, not_loaded, filled = _LOAD_STATE[job.layout](rank, job, model, built)
    progress.step("loading it strictly")
    load_state_dict_strictly(model, state)
    loaded = {part.name: sum(1 for key in state if part.holds_key(key)) for part, _ in built}
    return model, loaded, not_loaded, filled


def legacy_state(rank: int, job: LoadJob, model: torch.nn.Module, built: list) -> tuple[dict, dict, int]:
    """``(state, {prefix: entries not loaded}, empty slots filled)``: this rank's file, as it is."""
    not_loaded: dict = {}
    filled = 0
    state = {}
    for key, value in open_legacy(job.root, iteration=job.iteration).load_rank(*_own_ranks(rank, job)).items():
        skipped = job.skips(key)
        if skipped is None:
            state[key] = value
        else:
            not_loaded[skipped] = not_loaded.get(skipped, 0) + 1
    for key in model.state_dict():
        if key not in state and any(part.fills(key) for part, _ in built):
            state[key] = None  # the empty slot the writer writes for every other TE module
            filled += 1
    return state, not_loaded, filled


def torch_dist_state(rank: int, job: LoadJob, model: torch.nn.Module, built: list) -> tuple[dict, dict, int]:
    """The same, read by DCP against the classes' own sharded state dict (a collective)."""
    wanted = sharded_state_dict(model)
    not_loaded = _compare_sharded_keys(job.root, wanted, job.skips, stages=job.grid.pp.size > 1,
                                       iteration=job.iteration)
    return torch_dist.load_torch_dist(job.root, wanted, iteration=job.iteration), not_loaded, 0


# What Megatron's class loads of each mcore format, by the layout its manifest records: this rank's
# state and how its report counts what it did not load (a legacy file's keys, torch_dist's stored
# items). A format not here does not load into Megatron's class.
_LOAD_STATE = {LAYOUT_LEGACY: legacy_state, LAYOUT_TORCH_DIST: torch_dist_state}
_LOAD_UNIT = {LAYOUT_LEGACY: "keys", LAYOUT_TORCH_DIST: "stored"}


def build_and_load(rank: int, world_size: int, job: LoadJob) -> torch.nn.Module:
    """Collective over the ranks of ``job.init_parallel()``: Megatron's class for ``job`` (this
    rank's pipeline stage of it; several classes, each under its key prefix, where the job loads
    parts), loaded strictly from the checkpoint (this rank's file, or DCP against the classes' own
    sharded state dicts). Raises :class:`~mmparity.models.core.megatron_classes.StrictLoadError` or
    :class:`CheckpointError`."""
    return _load(rank, job)[0]


def load_state_dict_strictly(model: torch.nn.Module, state: dict) -> None:
    """``model.load_state_dict(state, strict=True)`` (the class's own load hooks included), with
    every missing, unexpected and mis-shaped key named at once in a
    :class:`~mmparity.models.core.megatron_classes.StrictLoadError` instead of torch's first complaint."""
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
    if world_size > 1:
        progress.step("joining the other ranks")
    job.init_parallel()
    try:
        _model, loaded, not_loaded, filled = _load(rank, job)
    except RefusedPickle as exc:
        return RankLoad(rank, False, str(exc), refused=True)
    except (models.StrictLoadError, CheckpointError) as exc:
        return RankLoad(rank, False, str(exc))
    except Exception as exc:  # from inside Megatron's class or torch: the cause, on one line
        return RankLoad(rank, False, errors.one_line(exc))
    return RankLoad(rank, True, loaded=loaded, not_loaded=not_loaded, filled=filled)


def _compare_sharded_keys(root: str, wanted: dict, skips=lambda key: None, stages: bool = False,
                          iteration=None) -> dict:
    """Name every tensor and object the class asks for that the checkpoint lacks (or holds in
    another global shape where the class does not allow it), and every one it holds that the class
    has no place for, before DCP, which reports only the first. Stored items under a prefix
    ``skips`` names are not loaded and not unexpected: returns their count per prefix. ``stages``:
    the class is built in pipeline stages, each rank asking for its stage's (a collective)."""
    iteration_dir = resolve_iteration_dir(root, iteration)[1]
    stored = torch_dist_files.tensor_metadata(iteration_dir)
    stored_objects = torch_dist_files.object_keys(iteration_dir)
    not_loaded: dict = {}
    for key in list(stored) + list(stored_objects):
        skipped = skips(key)
        if skipped is not None:
            not_loaded[skipped] = not_loaded.get(skipped, 0) + 1
    stored = {k: v for k, v in stored.items() if skips(k) is None}
    stored_objects = [k for k in stored_objects if skips(k) is None]
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
    # Pipeline stages ask for their own slices: what the checkpoint holds is unexpected only when
    # no stage asks for it.
    everyone = _all_ranks((set(asked), set(asked_objects))) if stages else [(set(asked), set(asked_objects))]
    all_asked = set().union(*(a for a, _ in everyone))
    all_objects = set().union(*(o for _, o in everyone))
    unexpected = [k for k in stored if k not in all_asked] + [k for k in stored_objects if k not in all_objects]
    mismatched = [f"{k}: {stored[k][1]} vs {asked[k]}" for k in asked
                  if k in stored and stored[k][1] != asked[k] and k not in shape_may_differ]
    failed = bool(missing or unexpected or mismatched)
    # Every rank enters DCP's collective read or none does.
    if stages and any(_all_ranks(failed)) and not failed:
        raise CheckpointError("not read: the checkpoint does not fit another pipeline stage (see its rank)")
    if failed:
        raise models.StrictLoadError(missing, unexpected, mismatched)
    return not_loaded


def _all_ranks(value) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _part(name: str, record: MegatronClass) -> LoadPart:
    return LoadPart(name, record.build, record.holds, record.root, record.pipelined,
                    record.unwritten_extra_state)


def plan_parts(spec, megatron_class: Optional[str] = None, cfg=None) -> tuple[tuple, tuple, tuple]:
    """``(parts, not loaded, notes)`` of a load of a checkpoint of the family ``spec`` (of model ``cfg``).

    The class asked for holds its keys, and nothing else is loaded (the rest: not asked for).
    The family's default class (its first that can be built for ``cfg``) is completed by the
    family's other classes, in their order: each that holds none of the keys taken so far joins if
    it can be built for ``cfg`` and imported here; what only classes that cannot be imported hold is
    not loaded, with their reason. Raises :class:`~mmparity.models.core.megatron_classes.UpstreamUnavailable`
    when the first class cannot be imported, :class:`~mmparity.models.spec.NoMegatronClass` when the
    class asked for cannot be built for ``cfg``."""
    hooks = spec.hooks
    name, record = spec.megatron_class(megatron_class, cfg)
    models.require(record.build)
    parts, taken, unavailable = [_part(name, record)], list(record.holds), []
    fallback = default_refusal(hooks, cfg) if megatron_class is None else None
    notes = list(dict.fromkeys(n for n in (fallback, record.why_part) if n))
    if megatron_class is not None and record.holds:
        return tuple(parts), (NotLoaded((), f"not asked for (--megatron-class {name})"),), tuple(notes)
    for other_name, other in hooks.megatron.items():
        if (other_name == name or not record.holds or other.overlaps(tuple(taken))
                or other.refusal(cfg) is not None):
            continue
        try:
            models.require(other.build)
        except models.UpstreamUnavailable as exc:
            unavailable.append((other_name, other, str(exc)))
            continue
        parts.append(_part(other_name, other))
        taken += other.holds
    not_loaded = []
    for other_name, other, reason in unavailable:
        left = tuple(p for p in other.holds if not any(p.startswith(t) for t in taken))
        if left:
            not_loaded.append(NotLoaded(left, f"{other_name} holds it: {reason}"))
            taken += left
    if record.holds and len(hooks.megatron) == 1:
        # The family's one class holds a part (its language model): the rest of a whole
        # checkpoint has no Megatron class to load into; counted, not unexpected.
        not_loaded.append(NotLoaded((), f"family {spec.name!r} has no Megatron class for it"))
    return tuple(parts), tuple(not_loaded), tuple(notes)


def plan_held_part(spec, part: str, megatron_class: Optional[str], cfg, root) -> tuple[tuple, tuple, tuple]:
    """``(parts, not loaded, notes)`` of a load of a checkpoint holding one part of a whole VLM alone
    (its keys without the part's root ``part``): the family's class that holds exactly that part,
    built alone, its keys at the root. Another class asked for is refused by name: such a
    checkpoint must never be half loaded into a class laid out for the whole."""
    hooks = spec.hooks
    options = {} if isinstance(hooks.megatron, NoMegatron) else dict(hooks.megatron)
    holding = [(name, record) for name, record in options.items() if record.holds == (part,)]
    what = f"the {part.rstrip('.')} alone"
    if not holding:
        raise CheckpointError(f"{root}: holds {what}, and family {spec.name!r} has no Megatron class for it")
    name, record = holding[0]
    if megatron_class is not None and megatron_class != name:
        raise CheckpointError(f"{root}: holds {what}, laid out for Megatron's {name}; it does not load into "
                              f"{megatron_class} (pass --megatron-class {name} or leave it out)")
    models.require(record.build)
    part_load = LoadPart(name, record.build, (), "", record.pipelined, record.unwritten_extra_state)
    return (part_load,), (), (f"holds {what} (as Megatron-LM trains it: {name})",)


def _megatron_written(root: Path, family: Optional[str], base, hf_config, iteration) -> tuple:
    """A checkpoint Megatron's savers wrote (no manifest): ``(layout, family, model config, its
    description, a note saying where the model and sizes come from, TP, PP, EP, vocabulary divisor from its args or None, its training state
    described)``; the model is the one ``--base`` / ``--hf-config`` describe, as ``convert --to hf``
    reads it."""

    try:
        model_config = model_config_for(root, family, base, hf_config, iteration)
    except ConvertError as exc:
        raise CheckpointError(str(exc)) from None
    if model_config is None:
        raise CheckpointError(f"{root}: no mmparity.json: --load of a checkpoint Megatron wrote needs the model "
                              "it holds: --base HF_DIR (the HF release it was converted from) or --hf-config "
                              "FILE (with --family)")
    if model_config.side_tensors is None:
        # What Megatron has no place for (CLIP's ln_post) is what a config alone cannot give; a load
        # into Megatron's class never reads it, so --hf-config describes the load in full.
        model_config = dataclasses.replace(model_config, side_tensors=lambda keys: {})
    info = describe(root, iteration)
    if info.format == "legacy":

        ckpt = open_legacy(root, iteration=info.iteration)
        payload = load_rank_payload(ckpt.files[min(ckpt.files)], mmap=True)
        args = payload.get("args")
        chunks = set(model_chunk_keys(payload))
        left = [str(k) for k in payload if k not in chunks and k not in _BOOKKEEPING]
    else:
        iteration_dir = info.iteration_dir
        common = read_common(iteration_dir) or {}
        args = common.get("args")
        stored = list(torch_dist_files.tensor_metadata(iteration_dir)) + list(torch_dist_files.object_keys(iteration_dir))
        counts: dict = {}
        for key in stored:
            if NOT_MODEL_KEYS.match(key):
                group = key.split(".")[0].split("/")[0]
                counts[group] = counts.get(group, 0) + 1
        where = {group: [f"{count} sharded item{'s' if count > 1 else ''}"] for group, count in counts.items()}
        for key in common:
            if key not in ("model", *_BOOKKEEPING):
                where.setdefault(str(key), []).append("common state")
        left = [f"{group} ({' + '.join(parts)})" for group, parts in where.items()]
    divisor = (args.get if isinstance(args, dict) else lambda name: getattr(args, name, None))(
        "make_vocab_size_divisible_by") if args is not None else None
    divisor = divisor if isinstance(divisor, int) and not isinstance(divisor, bool) and divisor > 0 else None
    layout = LAYOUT_LEGACY if info.format == "legacy" else LAYOUT_TORCH_DIST
    note = (f"{info.written_by}, iteration {info.iteration}: the model as {model_config.origin} describes it, "
            f"its sizes from {info.parallelism_from}")
    return (layout, model_config.family, model_config, info, note, info.tp or 1, info.pp or 1,
            info.ep or 1, divisor, tuple(left))


def _check_args_divisor(source, divisor: int, tp: int, root: Path, stores_grid: bool) -> None:
    """Megatron's class is built with the vocabulary divisor the checkpoint's ``args`` record,
    checked before the class is built (a divisor of 1e9 would ask for the rows of a 160 GB
    table): rank files hold their tables as padded for their own TP, exactly; global tensors may
    be loaded at another TP, padded otherwise, but never past the bound ``--make-vocab-size-
    divisible-by`` is held to."""
    for key, padding in padded_tables(source.rules).items():
        meta = source.metas.get(key)
        if meta is None or not meta.shape:
            continue
        target = padding.at_tp(tp, divisor)
        if target.excessive or (stores_grid and target.padded != meta.shape[0]):
            raise CheckpointError(f"{root}: its args record make_vocab_size_divisible_by {divisor}, which pads {key} "
                                  f"from {padding.rows} to {target.padded} rows at TP {tp}, but the checkpoint "
                                  f"holds {meta.shape[0]}: these args are not the ones it was saved with")


def load_job(directory: str | os.PathLike, megatron_class: Optional[str] = None,
             tp: Optional[int] = None, pp: Optional[int] = None, *, base=None, hf_config=None,
             family: Optional[str] = None, iteration=None) -> tuple[LoadJob, str, str, int]:
    """What loading ``directory`` into Megatron takes: ``(job, family, class name, world size)``.
    A checkpoint Megatron wrote itself (no ``mmparity.json``) is described by ``base`` (an HF
    directory) or ``hf_config`` (with ``family``), its iteration ``iteration`` (default: the
    tracker's), its sizes by its ``args`` and rank layout; only its model entries are loaded.
    Raises as :func:`load_into_megatron`."""
    root = Path(directory)
    written = None
    if (root / "mmparity.json").is_file() or os.path.lexists(root / "mmparity.json"):
        if base is not None or hf_config is not None:
            raise CheckpointError(f"{root}: has its own mmparity.json; --base / --hf-config describe a "
                                  "checkpoint Megatron wrote")
        manifest = read_manifest(root)
        layout, family = manifest.layout, manifest.provenance.family
        recorded_tp, recorded_pp = manifest.tensor_parallel_size, manifest.pipeline_parallel_size
        recorded_ep, model_config, training_state = manifest.expert_parallel_size, None, ()
        layer_counts, args_divisor, iteration = manifest.pipeline_layer_counts, None, None
    else:
        (layout, family, model_config, written, written_note, recorded_tp, recorded_pp, recorded_ep, args_divisor,
         training_state) = _megatron_written(root, family, base, hf_config, iteration)
        layer_counts, iteration = None, written.iteration
    fmt = ckpt_formats.by_layout(layout)
    if fmt is None or layout not in _LOAD_STATE:
        raise CheckpointError(f"{root}: --load needs an mcore checkpoint (legacy or torch_dist), "
                              f"this one is {layout}")
    if family is None:
        raise CheckpointError(f"{root}: the manifest names no family")
    for axis, asked, recorded in (("TP", tp, recorded_tp), ("PP", pp, recorded_pp)):
        if asked is not None and asked < 1:
            raise CheckpointError(f"--{axis.lower()} must be >= 1, got {asked}")
        if asked is not None and fmt.stores_grid and asked != recorded:
            raise CheckpointError(f"{root}: a legacy checkpoint loads at its own {axis} size "
                                  f"({recorded}), not {asked}")
    spec = registry.resolve(family)
    spec.megatron_class(megatron_class)  # an unknown family or class, before the files
    tp = tp or recorded_tp
    pp = pp or recorded_pp
    try:
        # Opened and checked exactly as convert opens and checks a source, before anything is built
        # or spawned: the config bounded by the weights, the recorded TP, PP, layer split and
        # vocabulary divisor by what is present, every stored shape against the config. Missing and
        # foreign tensors are left to the strict load, which names them per rank.
        source = open_source(root, family, complete=False, model_config=model_config, iteration=iteration,
                             spec=spec)
        check_shapes(source)
        if args_divisor is not None:
            _check_args_divisor(source, args_divisor, tp, root, fmt.stores_grid)
        validate_tp(source.rules, tp)
    except ConvertError as exc:
        raise CheckpointError(str(exc)) from None
    if source.part:
        parts, not_loaded, notes = plan_held_part(source.model.spec, source.part, megatron_class, source.cfg, root)
    else:
        parts, not_loaded, notes = plan_parts(source.model.spec, megatron_class, source.cfg)
    if written is not None:
        notes = (written_note, *notes)
    if pp != 1:
        # Megatron-LM builds only a language model in stages; a class holding the pipelined stack
        # that is built whole (a tower) has no place for a stage's slice of it.
        layout_pp = pp_mod.pipeline_layout(source.order)
        whole = [p.name for p in parts if p.holds_key(layout_pp.layer_prefix) and not p.pipelined]
        if whole:
            raise CheckpointError(f"{root}: PP {pp}: Megatron's {' + '.join(whole)} is not built in pipeline "
                                  "stages (only a language model is: LLaVAModel's, GPTModel); convert "
                                  "with --pp 1")
        if not fmt.stores_grid:  # global tensors: stages split as convert --pp splits
            try:
                layer_counts = tuple(layout_pp.layer_counts(pp))
            except pp_mod.PipelineError as exc:
                raise CheckpointError(f"{root}: {exc}") from None
    ep = recorded_ep if fmt.stores_grid else 1
    divisor = args_divisor if args_divisor is not None else source.vocab_multiple
    job = LoadJob(str(root), layout, parts, source.cfg, Grid.of(tp, pp, ep), layer_counts=layer_counts,
                  divisible_by=divisor, not_loaded=not_loaded, notes=notes, iteration=iteration,
                  training_state=training_state)
    return job, family, " + ".join(p.name for p in parts), job.world_size


def load_into_megatron(directory: str | os.PathLike, megatron_class: Optional[str] = None,
                       tp: Optional[int] = None, pp: Optional[int] = None, *, base=None, hf_config=None,
                       family: Optional[str] = None, iteration=None) -> LoadReport:
    """Build Megatron's class at the checkpoint's TP and PP sizes (torch_dist: at TP ``tp`` and PP
    ``pp`` if given, as it holds global tensors) and load every rank strictly.

    A checkpoint Megatron wrote itself loads with ``base`` or ``hf_config`` (see :func:`load_job`);
    its optimizer, RNG and other training state are not loaded, and the report lists them.

    Raises :class:`CheckpointError` for a directory that is not an mcore checkpoint,
    :class:`~mmparity.models.core.megatron_side.NoMegatronClass` for a family without a Megatron class and
    :class:`~mmparity.models.core.megatron_classes.UpstreamUnavailable` when the class is not importable.
    A checkpoint that does not fit the class is a failed rank, not an exception.
    """
    job, family, name, world_size = load_job(directory, megatron_class, tp, pp, base=base, hf_config=hf_config,
                                             family=family, iteration=iteration)
    if world_size == 1:
        ranks = [_load_rank(0, 1, job)]
    else:
        progress.step(f"{name} on {world_size} ranks")
        ranks = runtime.spawn(_load_rank, world_size, job)
    refused = [r for r in ranks if r.refused]
    if refused:  # not a checkpoint that fails to fit the class: one that must not be loaded at all
        raise RefusedPickle(refused[0].message)
    partial = len(job.parts) > 1 or any(p.holds for p in job.parts)
    return LoadReport(Path(directory), job.layout, family, name, job.grid, ranks, parts=job.parts if partial else (),
                      not_loaded=job.not_loaded, notes=job.notes, training_state=job.training_state)
