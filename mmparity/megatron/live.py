"""Weights to and from a live Megatron model, inside an initialised process group.

``export_hf(model, family, cfg)`` yields the HF state dict of a model that Megatron built (its
own ``GPTModel`` / ``LLaVAModel`` / tower classes, or mmparity's native ones, which share their
names) one tensor at a time, gathered across its tensor-, pipeline- and expert-parallel ranks:
what an RL loop sends to an inference engine every few steps. ``import_hf(model, hf_dir)`` loads
an HF checkpoint straight into such a model, each rank reading only the bytes of its own shard.

One engine, the one ``mmparity convert`` runs: the family's rule table (``mapping.rules``),
its TP kinds (``parallel.tp``), pipeline renumbering (``parallel.pp``) and expert renumbering
(``parallel.ep``). What differs is only where tensors come from and go to: the model's
parameters instead of checkpoint files. Both directions are planned before any tensor moves, and
the plan is the conversion's totality check: every tensor of the model has its place in the
table, every HF tensor is produced (or loaded) exactly once; otherwise one
:class:`~mmparity.errors.ConversionError` lists every offender, raised on every rank
alike (each rank plans from the same gathered names, so none is left waiting in a collective).

Every collective is preceded by an agreement on problems: what a rank does alone before it (read a
config, a base, its headers, its own module) is caught, and the ranks exchange an ok flag or the
failure in the same ``all_gather_object`` that carries their data (or one of its own, before data
moves), so a rank that fails alone (its own unreadable path, say) makes every rank raise the same
error at once, never leaves the others waiting in a collective until the process group's timeout.

How ranks are told apart: megatron-core's ``parallel_state`` (TP, PP and EP ranks and sizes). The
layers each pipeline stage holds and the experts each EP rank holds are read off the model's own
state-dict keys, gathered once from every rank, so uneven pipelines need no hint.

Export moves one mcore tensor at a time: each TP shard is broadcast from one rank holding it to
all ranks (replicated tensors once), merged by its TP kind, and the step's HF tensors are made by
the op's inverse; every rank yields the same tensors in the same order. Memory: the step's whole
tensors, never the model. Tensors Megatron's class has no place for (CLIP's ``ln_post``, a
LLaVA tower's layers past ``vision_feature_layer``) come from ``base=`` (the HF release the model
was converted from) or are left out with ``omit_aside=True`` (an inference engine that already
holds them); without either they are an error naming them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from mmparity import errors
from mmparity.convert import configs
from mmparity.convert.model import Model
from mmparity.convert.sources import open_source
from mmparity.io.fsio.pieces import narrow_pieces
from mmparity.parallel import ep as ep_mod
from mmparity.parallel import pp as pp_mod
from mmparity.mapping import rules as R
from mmparity.models import registry
from mmparity.parallel import tp as tp_mod
from mmparity.errors import ConversionError

__all__ = ["LiveLayout", "export_hf", "import_hf", "ImportReport", "EXPORT_DTYPES"]

# What ``export_hf(dtype=...)`` casts floating weights to: the dtypes HF checkpoints hold weights
# in. Anything else (an integer dtype, float8 without its scales) is no value-preserving target.
EXPORT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclasses.dataclass(frozen=True)
class _Coords:
    tp_rank: int
    tp: int
    pp_rank: int
    pp: int
    ep_rank: int
    ep: int


def _coords() -> _Coords:
    from megatron.core import parallel_state as ps

    if not dist.is_initialized() or not ps.model_parallel_is_initialized():
        raise RuntimeError("the live-model API needs torch.distributed and megatron-core's model-parallel "
                           "groups initialised (parallel_state.initialize_model_parallel)")
    return _Coords(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                   ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
                   ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())


def _failure(exc: Exception) -> tuple[str, list[str]]:
    """What a rank tells the others of its failure: a title and one-line problems."""
    if isinstance(exc, ConversionError):
        return exc.title, list(exc.problems)
    return errors.one_line(exc), []


def _raise_agreed(failures: Sequence, what: str, own: Exception | None) -> None:
    """Raises, on every rank alike, the failure any rank reported (``failures``: per rank, None or
    what :func:`_failure` made; ``own``: this rank's exception). A failure every rank shares (the
    same bad directory everywhere) is raised as it is."""
    failed = [(rank, failure) for rank, failure in enumerate(failures) if failure is not None]
    if not failed:
        return
    first = failed[0][1]
    if len(failed) == len(failures) and all((f[0], tuple(f[1])) == (first[0], tuple(first[1])) for _, f in failed):
        raise own
    ranks = ", ".join(str(rank) for rank, _ in failed)
    raise ConversionError(f"{what} failed on rank {ranks} of {len(failures)}",
                          [f"rank {rank}: {title}" + (f": {p}" if p else "")
                           for rank, (title, problems) in failed for p in (problems or [""])])


def _agreed(step, what: str):
    """``step()`` on every rank, then agreed (collective): every rank learns whether any failed,
    and raises the same error if one did; else ``step()``'s value."""
    value, own = None, None
    try:
        value = step()
    except Exception as exc:
        own = exc
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, _failure(own) if own is not None else None)
    _raise_agreed(gathered, what, own)
    return value


def _module(model) -> torch.nn.Module:
    """The one module of this rank (Megatron-LM hands models around as a list of chunks)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ConversionError("the live-model API takes one model chunk per rank",
                                  [f"got {len(model)} (virtual pipeline stages are not supported)"])
        model = model[0]
    # Megatron-LM's DDP and Float16Module wrappers hold the model as .module.
    while type(model).__name__ in ("DistributedDataParallel", "Float16Module") and hasattr(model, "module"):
        model = model.module
    if not isinstance(model, torch.nn.Module):
        raise ConversionError("the live-model API takes a torch module", [f"got {type(model).__name__}"])
    return model


def _local_tensors(module: torch.nn.Module, expert_layout: str | None) -> dict[str, torch.Tensor]:
    """This rank's tensors keyed as the rule table spells them (Transformer Engine norm names, the
    table's expert layout), locally numbered; extra states left out."""
    state = module.state_dict(keep_vars=True)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    respelled = R.to_te_spelling({k: k for k in tensors})
    if expert_layout is not None:
        respelled = ep_mod.respell(respelled, expert_layout)
    return {table_key: tensors[model_key] for table_key, model_key in respelled.items()}


class LiveLayout:
    """Where every mcore tensor of a live model lives: gathered once from every rank (collective).

    ``metas``: global (TP = 1, globally numbered) key -> meta tensor of the whole tensor;
    ``owners``: global key -> per TP rank, (the lowest global rank holding that shard, its local
    key); ``local``: on this rank, global key -> the model's own tensor."""

    def __init__(self, model, rule_set: R.RuleSet):
        self.coords = c = _coords()
        tensors, entries, own = {}, {}, None
        try:  # this rank's own part, agreed in the gather below: a rank failing alone stalls none
            module = _module(model)
            order = [k for step in R.plan_steps(rule_set) for k in step.mcore_keys]
            self.kinds = {k: kind for step in R.plan_steps(rule_set) for k, kind in zip(step.mcore_keys, step.rule.tp)}
            self.expert_layout = ep_mod.expert_key_layout(order)
            self.layout = pp_mod.pipeline_layout([k for k in order if k not in set(R.side_keys(rule_set))])
            tensors = _local_tensors(module, self.expert_layout)
            entries = {k: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in tensors.items()}
        except Exception as exc:
            own = exc
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (dataclasses.astuple(c), entries, _failure(own) if own is not None else None))
        _raise_agreed([failure for _, _, failure in gathered], "reading the live model", own)
        gathered = [(coords, rank_entries) for coords, rank_entries, _ in gathered]
        self.num_experts = ep_mod.expert_count(order)
        problems: list[str] = []
        # One holder per (TP, PP, EP) coordinate: data-parallel replicas hold the same tensors.
        holders: dict[tuple, tuple[int, dict]] = {}
        for rank, (coords, rank_entries) in enumerate(gathered):
            holders.setdefault((coords[0], coords[2], coords[4]), (rank, rank_entries))
        stages = [[holders[(t, p, e)][1] for e in range(c.ep)] for t in range(c.tp) for p in range(c.pp)]
        counts = pp_mod.infer_layer_counts([s[0] for s in stages[: c.pp]], layer_prefix=self.layout.layer_prefix)
        self.layer_counts = counts
        per_tp: list[dict] = []
        self.owners: dict[str, list] = {}
        for t in range(c.tp):
            stage_states = []
            for p in range(c.pp):
                ranks = [holders[(t, p, e)] for e in range(c.ep)]
                try:
                    merged = (ep_mod.merge_expert_ranks([r[1] for r in ranks], self.num_experts or None)
                              if c.ep > 1 else ranks[0][1])
                except ConversionError as exc:
                    problems += [f"PP stage {p}, TP rank {t}: {q}" for q in exc.problems]
                    merged = ranks[0][1]
                stage_states.append(merged)
                for e, (rank, rank_entries) in enumerate(ranks):
                    for local in rank_entries:
                        key = self._global_key(local, p, e, counts)
                        owners = self.owners.setdefault(key, [None] * c.tp)
                        if owners[t] is None:
                            owners[t] = (rank, local)
            try:
                per_tp.append(pp_mod.merge_pipeline_stages(stage_states, counts, layer_prefix=self.layout.layer_prefix))
            except pp_mod.PipelineError as exc:
                problems.append(str(exc))
                per_tp.append({})
        self.metas: dict[str, torch.Tensor] = {}
        for key, first in (per_tp[0] if per_tp else {}).items():
            parts = [shard.get(key) for shard in per_tp]
            absent = [t for t, part in enumerate(parts) if part is None]
            if absent:
                problems += [f"mcore tensor {key} missing on TP rank {t}" for t in absent]
                continue
            metas = [torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for shape, dtype in parts]
            kind = self.kinds.get(key, "replicated")
            try:
                if tp_mod.split_of(kind).cut_dim(metas[0].dim()) is None:
                    if any(m.shape != metas[0].shape or m.dtype != metas[0].dtype for m in metas):
                        raise tp_mod.ShardError("replicated tensor has other shapes or dtypes on other TP ranks")
                    self.metas[key] = metas[0]
                else:
                    self.metas[key] = tp_mod.merge(metas, kind)
            except (tp_mod.ShardError, RuntimeError, ValueError) as exc:
                problems.append(f"{key} {list(metas[0].shape)}: {exc}")
        for t, shard in enumerate(per_tp[1:], start=1):
            problems += [f"mcore tensor {k} on TP rank {t} only" for k in shard if k not in self.metas and k not in per_tp[0]]
        if problems:
            raise ConversionError("the live model's tensors do not fit together", problems)
        # What this rank holds, by global key (a data-parallel replica holds what its holder does).
        self.local = {self._global_key(local, c.pp_rank, c.ep_rank, counts): tensor for local, tensor in tensors.items()}

    def _global_key(self, local: str, stage: int, ep_rank: int, counts: Sequence[int]) -> str:
        """A local key of (pipeline stage, EP rank) -> its global name: the inverse of the splits
        ``parallel.pp`` and ``parallel.ep`` make."""
        key = local
        parts = pp_mod.layer_key_parts(key)
        if parts is not None and parts[0] == self.layout.layer_prefix and len(counts) > 1:
            key = f"{parts[0]}{pp_mod.local_to_global(stage, parts[1], counts)}.{parts[2]}"
        expert = ep_mod.parse_expert_key(key)
        if expert is not None and self.coords.ep > 1:
            per_rank = self.num_experts // self.coords.ep
            key = expert.spell(expert=ep_rank * per_rank + expert.expert)
        return key


def _without_absent_side(rule_set: R.RuleSet, present: Mapping) -> tuple[R.RuleSet, list[str]]:
    """The table less its side rules none of whose tensors are present, and those tensors' keys."""
    kept, dropped = [], []
    steps_of: dict[int, list] = {}
    for step in R.plan_steps(rule_set):
        steps_of.setdefault(id(step.rule), []).append(step)
    for rule in rule_set.rules:
        keys = [k for s in steps_of.get(id(rule), []) for k in s.mcore_keys]
        if rule.side and keys and not any(k in present for k in keys):
            dropped += keys
        else:
            kept.append(rule)
    return dataclasses.replace(rule_set, rules=tuple(kept)), dropped


def export_hf(model, family: str, cfg, *, base: str | os.PathLike | None = None, omit_aside: bool = False,
              dtype: torch.dtype | None = None, hf_format: str | None = None,
              prefix: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF state dict of a live Megatron model as ``(name, tensor)`` pairs, one at a time, on
    every rank (collective: every rank must iterate to the end, in step).

    ``family`` / ``cfg``: the mmparity family and the HF config the model was built from.
    ``base``: an HF checkpoint of the same model, for the tensors Megatron's class has no place
    for; ``omit_aside=True`` leaves them out instead. ``dtype`` casts floating tensors (default:
    the model's own). ``hf_format`` / ``prefix``: the HF layout and key prefix to write (default:
    the base's, else the family's first). Planned before this returns: a model that does
    not fit the table raises here, on every rank, listing every problem. A ``dtype`` that is not
    one of the floating dtypes a checkpoint holds is a ``ValueError`` (an integer cast would
    truncate every weight, a float8 one without scales saturate them)."""
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"export_hf: dtype={dtype!r} is not a weight dtype; pass one of "
                         f"{', '.join(map(str, EXPORT_DTYPES))}, or None for the model's own")

    def prepare():
        spec = registry.resolve(family)
        # The base's own layout and prefix, unless asked otherwise: its tensors and ours agree.
        aside = open_source(Path(base), hf_format=hf_format, spec=spec) if base is not None else None
        return aside, Model(spec, cfg, b"").rules(aside.hf_format if aside is not None and hf_format is None
                                                 else hf_format)

    _coords()
    aside_source, rules = _agreed(prepare, "reading the base" if base is not None else "planning")
    live = LiveLayout(model, rules)
    source: dict[str, torch.Tensor] = dict(live.metas)
    missing_aside = [k for k in R.side_keys(rules) if k not in source]
    if missing_aside:
        if aside_source is not None:
            absent = [k for k in missing_aside if k not in aside_source.metas]
            if absent:
                raise ConversionError(f"{base}: the base lacks tensors the live model has no place for",
                                      [f"missing {k}" for k in absent])
            source.update({k: aside_source.metas[k].tensor() for k in missing_aside})
        elif omit_aside:
            rules, _ = _without_absent_side(rules, source)
        else:
            raise ConversionError(
                f"the live {family!r} model has no place for {len(missing_aside)} tensor(s) of the HF checkpoint; "
                "pass base=HF_DIR (the release it was converted from) or omit_aside=True",
                [f"{k}" for k in missing_aside])
    # Written under the base's prefix when there is a base, so that its tensors and ours agree.
    out_prefix = prefix if prefix is not None else aside_source.prefix if aside_source else rules.hf_prefixes[0]
    plan = R.plan_mcore_to_hf(rules, source, out_prefix)
    device = next((t.device for t in live.local.values()), torch.device("cpu"))
    return _stream(plan, live, aside_source, dtype, device)


def _stream(plan: R.Plan, live: LiveLayout, aside_source, dtype, device) -> Iterator[tuple[str, torch.Tensor]]:
    me = dist.get_rank()
    own = R.storages(live.local.values())

    def whole(key: str) -> torch.Tensor:
        if key not in live.metas:  # kept aside: read from the base on every rank, agreed
            return _agreed(lambda: aside_source.mcore_tensor(key), f"reading {key} from the base")
        meta, kind = live.metas[key], live.kinds.get(key, "replicated")
        owners = live.owners[key]
        cut = tp_mod.split_of(kind).cut_dim(meta.dim()) is not None
        parts = []
        for t in range(live.coords.tp if cut else 1):
            src, _ = owners[t]
            if src == me:
                buffer = live.local[key].detach().contiguous()
            else:
                shape = meta.shape if not cut else _part_shape(meta, kind, live.coords.tp, t)
                buffer = torch.empty(shape, dtype=meta.dtype, device=device)
            dist.broadcast(buffer, src)
            parts.append(buffer)
        return R.join(tp_mod.merge_pieces(parts, kind)) if cut else parts[0]

    produced = set()
    with torch.no_grad():
        for index, step in enumerate(plan.steps):
            inputs = [whole(k) for k in plan.sources[index]]
            outputs = step.rule.op.invert_pieces(inputs)
            del inputs
            for hf_key, pieces in zip(step.hf_keys, outputs):
                name = plan.prefix + hf_key
                if name in produced:
                    raise ConversionError("mcore -> HF export is not total", [f"{name} produced twice"])
                produced.add(name)
                tensor = R.owned(pieces, own)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                yield name, tensor
            del outputs
    missing = [k for k in plan.outputs if k not in produced]
    if missing:
        raise ConversionError("mcore -> HF export is not total", [f"{k} never produced" for k in missing])


def _part_shape(meta: torch.Tensor, kind: str, tp: int, rank: int) -> tuple:
    shape = list(meta.shape)
    ranges = tp_mod.shard_slices(tuple(meta.shape), kind, tp, rank)
    shape[ranges[0][0]] = sum(stop - start for _, start, stop in ranges)
    return tuple(shape)


@dataclasses.dataclass(frozen=True)
class ImportReport:
    """What ``import_hf`` did: tensors loaded on this rank and on all ranks, and the HF checkpoint's
    tensors Megatron's class has no place for (kept aside by the table, loaded nowhere)."""

    family: str
    loaded_here: int
    loaded: int
    aside: tuple


def import_hf(model, hf_dir: str | os.PathLike, family: str | None = None, *, hf_format: str | None = None,
              make_vocab_size_divisible_by: int = R.VOCAB_MULTIPLE) -> ImportReport:
    """Loads the HF checkpoint ``hf_dir`` into a live Megatron model, each rank its own shard
    (collective). The checkpoint is planned from its headers as ``mmparity convert`` plans it (the
    family told from its config unless given), every shape is checked on every rank and the
    problems agreed before any parameter is written: either every tensor of the model is
    replaced, or none is and one :class:`ConversionError` lists why (the same on every rank,
    also when one rank alone cannot read the checkpoint). Each rank reads the bytes of its shard
    through the file mapping, not the whole file; a read failing then (a file cut short since it
    was planned) is raised on every rank alike, with the model partly loaded."""

    c = _coords()
    source = _agreed(lambda: open_source(Path(hf_dir), family, hf_format, tp=c.tp,
                                         vocab_multiple=make_vocab_size_divisible_by), "reading the HF checkpoint")
    live = LiveLayout(model, source.rules)
    problems: list[str] = []
    todo: list[tuple[str, torch.Tensor, list]] = []
    for key, tensor in live.local.items():
        if key not in source.metas:
            problems.append(f"the model's {key} {list(tensor.shape)} has no tensor in {hf_dir}")
            continue
        shape = tuple(source.metas[key].shape)
        kind = live.kinds.get(key, "replicated")
        try:
            ranges = tp_mod.shard_slices(shape, kind, c.tp, c.tp_rank) if c.tp > 1 else []
        except (tp_mod.ShardError, ValueError) as exc:
            problems.append(f"{key} {list(shape)}: {errors.one_line(exc)}")
            continue
        want = list(shape)
        if ranges:
            want[ranges[0][0]] = sum(stop - start for _, start, stop in ranges)
        if tuple(want) != tuple(tensor.shape):
            problems.append(f"{key}: the model's shard on TP rank {c.tp_rank} is {list(tensor.shape)}, "
                            f"the checkpoint gives {want}")
            continue
        todo.append((key, tensor, ranges))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (problems, sorted(live.local)))
    held = set().union(*(set(keys) for _, keys in gathered))
    aside = set(R.side_keys(source.rules))
    all_problems = [p for rank_problems, _ in gathered for p in rank_problems]
    all_problems += [f"{k} of {hf_dir} has no place in the model on any rank" for k in source.metas
                     if k not in held and k not in aside]
    if all_problems:
        raise ConversionError(f"{hf_dir} does not fit the live {source.family!r} model",
                              sorted(set(all_problems)))
    def copy():
        with torch.no_grad():
            for key, tensor, ranges in todo:
                pieces = source.mcore_pieces(key)
                views = [v for dim, start, stop in ranges for v in narrow_pieces(pieces, dim, start, stop)] or pieces
                tensor.copy_(R.join(views))
                del pieces, views

    # A read failing here (a file cut short since it was planned) is raised on every rank.
    _agreed(copy, "loading the HF checkpoint")
    return ImportReport(source.family, len(todo), sum(len(keys) for _, keys in gathered),
                        tuple(sorted(k for k in source.metas if k not in held)))


def family_config(hf_dir: str | os.PathLike, family: str):
    """The config ``family``'s model is built from, read from an HF directory as ``convert`` reads
    it (a whole VLM's config for a whole-VLM family, a tower's for a tower family)."""

    path = Path(hf_dir)
    return configs.family_config(registry.resolve(family), path / configs.HF_CONFIG, path)[0]
