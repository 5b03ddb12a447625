"""Megatron-LM's legacy layout: one ``torch.save`` file per rank (``mp_rank_TT[_PPP][_EEE]``) in an
iteration directory, at the TP/PP/EP sizes it was written for.

Reading memory-maps the rank files (``torch.load(mmap=True, weights_only=True)``, under the
allow-list of ``io.unpickle``) and merges each key's TP parts as pieces, its EP ranks' experts and
pipeline stages back to global numbers. Writing lays every rank file out from the dry run, a
``torch.save`` skeleton written under ``skip_data`` (``io.legacy.LegacyWriter``), and puts every
tensor's TP shards straight into their reserved byte ranges.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import torch

from mmparity.errors import ConvertError, problems_line
from mmparity.io import extra_state, megatron_args
from mmparity.io import team as team_mod
from mmparity.io.formats.base import (
    MCORE, Format, Output, Problem, Progress, Source, Stored, TensorFilter, VerifyReport, Written, compare_record,
    unexpected_tensors)
from mmparity.io.formats.mcore import (
    McoreSource, manifest_of_iteration, mcore_plan, mcore_provenance, side_files, verify_mcore)
from mmparity.io.fsio.dtypes import check_source_dtypes
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.heap import heap_budget
from mmparity.io.fsio.pieces import FileRanges, narrow_pieces
from mmparity.io.layout import HF_CONFIG_FILE, LEGACY_FILE, RELEASE, iteration_dirname, parse_rank_dirname
from mmparity.io.legacy import (
    LegacyWriter, finish_legacy, load_rank_file, load_rank_payload, model_chunk_keys, open_legacy)
from mmparity.io.manifest import LAYOUT_LEGACY, TensorRecord
from mmparity.io.megatron_args import args_parallelism
from mmparity.mapping import rules as R
from mmparity.parallel import ep as ep_mod
from mmparity.parallel import pp as pp_mod
from mmparity.parallel import tp as tp_mod
from mmparity.parallel.axes import Grid
from mmparity.parallel.tp import ShardError

__all__ = ["FORMAT", "LegacySource"]

_ABSENT = object()


def detect(iteration_dir: Path) -> bool:
    return any(parse_rank_dirname(p.name) for p in iteration_dir.iterdir())


# --------------------------------------------------------------------------------------------------
# reading


def probe(path: Path, iteration: int | str | None = None) -> Stored:
    """The rank files of one iteration, the root's manifest as it bears on it, and the model keys
    of the first rank file (its header pickle read, its tensors mapped)."""
    ckpt = open_legacy(path, iteration=iteration)
    manifest = manifest_of_iteration(ckpt.manifest, ckpt.iteration)
    elsewhere = manifest is not ckpt.manifest
    if elsewhere:
        ckpt = dataclasses.replace(ckpt, manifest=manifest)
    first = load_rank_payload(ckpt.files[min(ckpt.files)], mmap=True)
    chunks = model_chunk_keys(first)
    stored = tuple(str(k) for chunk in chunks[:1] if isinstance(first[chunk], Mapping) for k in first[chunk])
    return Stored(path, ckpt.root, ckpt.root / HF_CONFIG_FILE, None, manifest, elsewhere, ckpt.iteration, stored,
                  (ckpt, first))


def _check_megatron_args(ckpt, payload=None) -> list[str]:
    """The model entries of a legacy checkpoint's rank files (``model``, or the virtual-pipeline
    chunks ``model0`` ...), and the TP / PP / EP sizes its ``args`` record (a checkpoint Megatron-LM
    wrote) against its rank directories: one rank file is read (mapped) for both (``payload``, where
    the caller has it already)."""
    first = ckpt.files[min(ckpt.files)]
    payload = load_rank_payload(first, mmap=True) if payload is None else payload
    chunks = model_chunk_keys(payload)
    if not chunks:
        raise ConvertError(f"{first}: no 'model' entry (keys: {', '.join(sorted(map(str, payload))[:8])})")
    recorded = args_parallelism(payload.get("args"))
    held = {"tp": ckpt.tp_size, "pp": ckpt.pp_size, "ep": ckpt.ep_size}
    wrong = [f"{axis.upper()} {recorded[axis]}" for axis in held if axis in recorded and recorded[axis] != held[axis]]
    if wrong:
        raise ConvertError(f"{first}: its args record {' and '.join(wrong)}, but {ckpt.iteration_dir} holds "
                           f"TP {ckpt.tp_size} x PP {ckpt.pp_size} x EP {ckpt.ep_size} of rank directories")
    vpp = recorded.get("vpp")
    if vpp is not None and len(chunks) != vpp and not (vpp == 1 and chunks == ["model"]):
        raise ConvertError(f"{first}: its args record {vpp} virtual-pipeline chunks, it holds {', '.join(chunks)}")
    return chunks


class LegacySource(McoreSource):
    layout = LAYOUT_LEGACY

    def __init__(self, stored: Stored, model, filt: TensorFilter, complete: bool = True, model_config=None):
        self.path = stored.path
        ckpt, first = stored.handle
        self._init_common(stored, model, filt, complete, model_config)
        self._check_recorded_parallelism(Grid.of(ckpt.tp_size, ckpt.pp_size, ckpt.ep_size))
        chunks = _check_megatron_args(ckpt, first)
        self.file_ranges = FileRanges()
        self.tp = ckpt.tp_size
        extra = dict(ckpt.manifest.provenance.extra or {}) if ckpt.manifest else {}
        layout = pp_mod.pipeline_layout(self.order)
        layer_prefix = extra.get("pipeline_layer_prefix") or layout.layer_prefix
        counts = ckpt.manifest.pipeline_layer_counts if ckpt.manifest else None
        self.ranks: list[dict] = []
        for tp_rank in range(ckpt.tp_size):
            # mmap: only the header pickle is read now; tensor bytes come from the page cache when
            # a step needs them.
            # Each stage's EP ranks merged first: their experts back to global numbers.
            # Virtual-pipeline chunks (model0, model1, ...) are further stages, chunk-major: chunk c
            # of stage p holds the (c * PP + p)-th slice of the layer stack.
            # The first rank file was read (mapped) by `probe`: it is not read twice.
            stages = [ckpt.stage_state(tp_rank, stage, num_experts=self.num_experts or None, mmap=True,
                                       file_ranges=self.file_ranges, chunk=chunk,
                                       loaded={ckpt.files[min(ckpt.files)]: first})
                      for chunk in chunks for stage in range(ckpt.pp_size)]
            merged = (pp_mod.merge_pipeline_stages(stages, counts if len(chunks) == 1 else None,
                                                   layer_prefix=layer_prefix)
                      if len(stages) > 1 else stages[0])
            state = {k: v for k, v in R.to_te_spelling(merged).items() if isinstance(v, torch.Tensor)}
            _drop_tied_copy(state, pp_mod.tied_head(self.order, ckpt.pp_size), self.root, tp_rank)
            # Experts saved in the other layout (``--expert-layout``, or Megatron-LM run without
            # grouped GEMM) are read under the rule table's names.
            wanted = ep_mod.expert_key_layout(self.order)
            if wanted and ep_mod.expert_key_layout(state) not in (None, wanted):
                state = ep_mod.respell(state, wanted)
            self.ranks.append(state)
        self._check_keys(set().union(*self.ranks), "legacy")
        check_source_dtypes(ckpt.iteration_dir, {k: t.dtype for state in self.ranks for k, t in state.items()})
        problems = list(self.rules.validate_tp(self.tp)) if self.rules.validate_tp else []
        self.metas = {}
        for key in self.order:
            shapes = []
            if not complete and not all(key in state for state in self.ranks):
                continue  # the strict load names it
            for rank, state in enumerate(self.ranks):
                if key not in state:
                    problems.append(f"missing mcore tensor {key} on TP rank {rank}")
                else:
                    shapes.append(tuple(state[key].shape))
            if len(shapes) != self.tp:
                continue
            if len(set(shapes)) != 1:
                problems.append(f"{key}: TP ranks hold different shapes {shapes}")
                continue
            self.metas[key] = filt.meta(R.shared_meta(self.ranks[0][key].dtype, tp_mod.split_of(self.kinds[key]).merged_shape(shapes[0], self.tp)))
        if problems:
            raise ConvertError(problems_line(f"{self.root}: cannot merge the TP={self.tp} legacy checkpoint", problems))
        self.metas.update(self._side_metas())

    def _parts(self, key: str) -> list[torch.Tensor]:
        parts = [self._filter(key, state[key], self.root) for state in self.ranks]
        if len(parts) > 1 and tp_mod.split_of(self.kinds[key]).cut_dim(parts[0].dim()) is None:
            try:
                tp_mod.check_replicated(parts)
            except ShardError as exc:
                raise ConvertError(f"{self.root}: {key}: {exc}") from None
        return parts

    def _stored_pieces(self, key: str) -> list[torch.Tensor]:
        if key in self.side:
            return [self._side_tensor(key)]
        parts = self._parts(key)
        if len(parts) == 1:
            return parts
        try:
            return tp_mod.merge_pieces(parts, self.kinds[key])
        except ShardError as exc:
            raise ConvertError(f"{self.root}: {key}: {exc}") from None

    def rank_states(self) -> list[dict]:
        return self.ranks

    def locate(self, piece) -> tuple[int, int] | None:
        return self.file_ranges.locate(piece)


# --------------------------------------------------------------------------------------------------
# writing


def _drop_tied_copy(state: dict, tied, root, tp_rank: int) -> None:
    """The last stage's copy of a tied table (``pp.tied_head``), taken out of ``state`` once it is
    found equal to the table: the model has one tensor there. A copy that differs (a last stage
    trained apart from the first) is refused, never dropped."""
    if not tied or tied[1] not in state:
        return
    table, head = tied
    if table in state and not tp_mod.same_bytes(state[table], state.pop(head)):
        raise ConvertError(f"{root}: TP rank {tp_rank}: the last stage's {head} differs from {table}, which "
                           "this model ties it to (Megatron keeps the two equal); was the head untied in training?")


def write(source: Source, out: Output, progress: Progress) -> Written:
    grid = out.grid
    order, kinds = mcore_plan(source, grid)
    tp = grid.tp.size
    layout = pp_mod.pipeline_layout(order)
    counts = layout.layer_counts(grid.pp)
    num_experts = ep_mod.expert_count(order)
    if out.expert_layout not in ep_mod.LAYOUTS:
        raise ConvertError(f"--expert-layout must be one of {', '.join(ep_mod.LAYOUTS)}, got {out.expert_layout!r}")
    spelled = ({k: k for k in order} if not num_experts or out.expert_layout == ep_mod.GROUPED
               else {k: (p.spell(out.expert_layout) if (p := ep_mod.parse_expert_key(k)) else k) for k in order})
    total = sum(source.metas[k].nbytes for k in order)
    entries = [{} for _ in range(tp)]
    alike: dict[tuple, tuple] = {}  # one (dtype, shape) entry for every rank's tensor alike
    for key in order:
        meta = source.metas[key]
        for rank in range(tp):
            ranges = tp_mod.shard_slices(tuple(meta.shape), kinds[key], tp, rank) if tp > 1 else []
            shape = list(meta.shape)
            if ranges:  # every range of one rank lies along the same dim (gated has two on dim 0)
                shape[ranges[0][0]] = sum(stop - start for _, start, stop in ranges)
            entry = (meta.dtype, tuple(shape))
            entries[rank][spelled[key]] = alike.setdefault(entry, entry)
    # A tied head at PP > 1: the last stage's own copy of the table, as Megatron's class keeps it.
    tied = pp_mod.tied_head(order, grid.pp.size)
    if tied:
        for rank in range(tp):
            entries[rank][tied[1]] = entries[rank][spelled[tied[0]]]
    # Megatron's own legacy save writes the TE modules' (empty) extra states; its class demands
    # them back under strict=True.
    for key in extra_state.extra_state_keys({spelled[k]: kinds[k] for k in order}):
        for rank in range(tp):
            entries[rank][key] = None
    progress.phase(f"{source.family} -> legacy tp{tp} pp{grid.pp.size}"
                   + (f" ep{grid.ep.size}" if grid.ep.size > 1 else ""), len(order), total)
    side, side_records, side_extra = side_files(source)
    heap = heap_budget()
    heap.begin_stream()
    iteration = RELEASE if out.release else 1
    args = megatron_args.checkpoint_args(source.cfg, {k: source.metas[k].shape for k in order}, ckpt_format="torch",
                                         grid=grid, vocab_multiple=source.vocab_multiple,
                                         declared=getattr(source.model, "recorded_args", None))
    team = out.team or team_mod.solo()
    try:
        with team.staging(out.dst, force=out.force, inner=iteration_dirname(iteration)) as staging:
            writer = LegacyWriter(staging, entries, grid=grid, layer_counts=counts,
                                  layer_prefix=layout.layer_prefix,
                                  last_stage_prefixes=layout.last_stage_keys + ((tied[1],) if tied else ()),
                                  iteration=iteration, locate=source.locate, num_experts=num_experts,
                                  common={megatron_args.ARGS_KEY: args}, writes=team.mine)

            def names(key: str) -> tuple:
                return (spelled[key], tied[1]) if tied and key == tied[0] else (spelled[key],)

            def put(key: str, kind: str, pieces: list, inputs: list) -> None:
                shape = tuple(source.metas[key].shape)
                for rank in range(tp):
                    held = [name for name in names(key) if writer.holds(rank, name)]
                    if not held:
                        continue  # another process's rank file
                    # tp.shard_slices names the rows / columns each rank holds (two row ranges
                    # for gated [gate_r; up_r]); their views go to the file as consecutive pieces.
                    ranges = tp_mod.shard_slices(shape, kind, tp, rank) if tp > 1 else []
                    views = [view for dim, start, stop in ranges for view in narrow_pieces(pieces, dim, start, stop)]
                    for name in held:
                        writer.write(rank, name, views or pieces)
                progress.advance(1, source.metas[key].nbytes)
                heap.check(source.metas[key].nbytes)

            mine = [k for k in order if any(writer.holds(rank, name) for rank in range(tp) for name in names(k))]
            try:
                R.stream_to_mcore(mine, kinds, source.produce, put)
                written = writer.close()
            finally:
                writer.abort()
            # One process keeps its records as they are (their JSON form is only for the wire: a
            # second copy of every record at the conversion's peak).
            gathered = [] if team.solo else team.gather("written", [r.to_json() for r in written])
            if not team.leader:
                return Written(len(order), total, grid)
            records = [*written, *(TensorRecord.from_json(r) for part in gathered[1:] for r in part), *side_records]
            finish_legacy(staging, records, grid=grid, layer_counts=counts, iteration=iteration,
                          extra_files={HF_CONFIG_FILE: source.config_bytes, **side},
                          provenance=mcore_provenance(source, out, pipeline_layer_prefix=layout.layer_prefix,
                                                      **side_extra))
    except CheckpointError as exc:
        raise ConvertError(str(exc)) from None
    return Written(len(order), total, grid)


# --------------------------------------------------------------------------------------------------
# verifying


def _verify_rank_files(root: Path, by_file: Mapping[str, list[TensorRecord]], report: VerifyReport) -> None:
    for file_name, records in sorted(by_file.items()):
        try:
            model = load_rank_file(root / file_name)
        except CheckpointError as exc:
            report.problems.append(Problem(file_name, None, f"{exc}; {len(records)} tensor(s) not checked"))
            continue
        for record in records:
            found = model.get(record.key, _ABSENT)
            if not isinstance(found, torch.Tensor) and (found is _ABSENT or not extra_state.is_extra_state(record.key)):
                report.problems.append(Problem(file_name, record.key, "missing from the file"))
                continue
            try:
                compare_record(report, record, found if isinstance(found, torch.Tensor) else extra_state.as_bytes(found))
            except TypeError as exc:
                report.problems.append(Problem(file_name, record.key, str(exc)))
        certifiable = {k for k, v in model.items() if isinstance(v, torch.Tensor) or extra_state.is_extra_state(k)}
        unexpected_tensors(report, file_name, certifiable - {r.key for r in records})


def verify(root: Path, records: Mapping[str, list[TensorRecord]], report: VerifyReport) -> None:
    verify_mcore(_verify_rank_files, root, records, report)


FORMAT = Format(
    name="legacy", layout=LAYOUT_LEGACY, kind=MCORE,
    what=f"legacy rank directories (mp_rank_*/{LEGACY_FILE})",
    detect=detect, probe=probe, open=LegacySource, write=write, verify=verify, stores_grid=True)
