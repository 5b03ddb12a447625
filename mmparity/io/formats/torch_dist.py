"""megatron.core's ``dist_checkpointing`` (torch_dist): global tensors in DCP files with their
``.metadata`` and ``metadata.json``, loadable at any TP/PP size.

Reading maps just one layer's (one expert's) chunk of mcore's stacked tensors (``torch_dist_files``);
writing places every tensor as Megatron's classes shard it (``torch_dist_layout``) and writes the DCP
blobs framed from that layout (``torch_dist_write``): no megatron, no torch.distributed, no model.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from mmparity.errors import ConvertError
from mmparity.io import extra_state, megatron_args, torch_dist_files, torch_dist_layout, torch_dist_write
from mmparity.io.formats.base import (
    MCORE, Format, Output, Problem, Progress, Source, Stored, TensorFilter, VerifyReport, Written, compare_record,
    unexpected_tensors)
from mmparity.io.formats.mcore import (
    NOT_MODEL_KEYS, McoreSource, manifest_of_iteration, mcore_plan, mcore_provenance, side_files, verify_mcore)
from mmparity.io.fsio.dtypes import check_source_dtypes
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.heap import heap_budget
from mmparity.io.hf import torch_dist_capacity
from mmparity.io.layout import HF_CONFIG_FILE, RELEASE, resolve_iteration_dir
from mmparity.io.manifest import LAYOUT_TORCH_DIST, MANIFEST_FILE, TensorRecord, read_manifest
from mmparity.io.megatron_written import read_common
from mmparity.io.torch_dist_files import TorchDistFiles, is_torch_dist_dir
from mmparity.mapping import rules as R
from mmparity.parallel import ep as ep_mod
from mmparity.parallel import pp as pp_mod
from mmparity.parallel import tp as tp_mod
from mmparity.parallel.axes import Grid

__all__ = ["FORMAT", "TorchDistSource", "torch_dist_index"]

# mcore's stacked layer tensors: `<root>decoder.layers.<name>` without a layer number.
_STACKED_KEY = re.compile(r"^((?:.*\.)?decoder\.layers\.)(?!\d+\.)(.+)$")
# MoE expert tensors, stacked over the global experts by both of mcore's experts modules, and over
# the layers too unless the block is non-homogeneous (dense and MoE layers, mcore then keeps each
# layer's number in the key): `<root>decoder.layers.[<n>.]mlp.experts.experts.linear_fc1.weight` of
# shape [layers, experts, ...] or [experts, ...].
_STACKED_EXPERT_KEY = re.compile(r"^(?P<stack>(?:.*\.)?decoder\.layers\.)(?:(?P<layer>\d+)\.)?"
                                 r"(?P<module>(?:.*\.)?mlp\.experts\.)experts\.(?P<rest>linear_fc[12]\.(?:weight|bias))$")


# --------------------------------------------------------------------------------------------------
# reading


def probe(path: Path, iteration: int | str | None = None) -> Stored:
    """The iteration's DCP index, decoded once, and the root's manifest as it bears on it."""
    root, iteration_dir, found = resolve_iteration_dir(path, iteration)
    manifest = read_manifest(root) if (root / MANIFEST_FILE).is_file() else None
    recorded = manifest
    manifest = manifest_of_iteration(manifest, found)
    read_common(iteration_dir)  # its checkpoint_version says whether this layout is the one read here
    files = TorchDistFiles(iteration_dir)
    return Stored(path, root, root / HF_CONFIG_FILE, torch_dist_capacity(files.metadata), manifest,
                  manifest is not recorded, found, tuple(k for k in files.tensors if not NOT_MODEL_KEYS.match(k)),
                  (iteration_dir, files))


def torch_dist_index(files: TorchDistFiles, order: Sequence[str],
                     kinds: Mapping[str, str] | None = None) -> dict[str, tuple]:
    """Where each mcore tensor of a torch_dist checkpoint is: TE-spelled, globally numbered local
    key -> (checkpoint key, its position along the stacked axes (layer, expert, or both) or None,
    Meta of the tensor there). Only the positions the saved chunks cover: a stack of MoE layers
    among dense ones holds those layers alone. Expert tensors are named in the layout ``order``
    (the rule table's keys) spells them in. Spelled all at once, so that a layer's own keys say
    whether its norms are fused (``rules.to_te_spelling``)."""
    raw: dict[str, tuple] = {}
    expert_layout = ep_mod.expert_key_layout(order) or ep_mod.GROUPED
    for ckpt_key, (dtype, shape) in files.tensors.items():
        if NOT_MODEL_KEYS.match(ckpt_key):
            continue
        experts = _STACKED_EXPERT_KEY.match(ckpt_key)
        stacked = _STACKED_KEY.match(ckpt_key)
        axes = 2 if experts and experts["layer"] is None else 1
        # A stack's layers (experts) share one Meta and their position tuples: the index is kept
        # for the whole conversion, one entry per tensor.
        if experts and len(shape) > axes:
            for position in sorted(files.covered(ckpt_key, axes)):
                layer = experts["layer"] if axes == 1 else position[0]
                local = ep_mod.ExpertKey(f"{experts['stack']}{layer}.{experts['module']}", position[-1],
                                         experts["rest"], expert_layout).spell()
                raw[local] = (ckpt_key, position, R.shared_meta(dtype, shape[axes:]))
        elif stacked and shape:
            for position in sorted(files.covered(ckpt_key, 1)):
                raw[f"{stacked.group(1)}{position[0]}.{stacked.group(2)}"] = (ckpt_key, position,
                                                                             R.shared_meta(dtype, shape[1:]))
        else:
            raw[ckpt_key] = (ckpt_key, None, R.shared_meta(dtype, shape))
    index = {key: raw[name] for key, name in R.to_te_spelling({name: name for name in raw}).items()}
    for key, kind in (kinds or {}).items():
        names = tp_mod.split_of(kind).section_names
        parts = [index.get(f"{key}.{name}") for name in names]
        if key in index or not names or None in parts or any(p[1] is not None for p in parts):
            continue
        # mcore's factory stored the named blocks of this tensor (Gated DeltaNet's in_proj) apart:
        # read back as one tensor, the blocks in order.
        for name in names:
            del index[f"{key}.{name}"]
        first = parts[0][2]
        rows = sum(p[2].shape[0] for p in parts)
        index[key] = (tuple(p[0] for p in parts), None, R.shared_meta(first.dtype, (rows, *first.shape[1:])))
    return index


class TorchDistSource(McoreSource):
    layout = LAYOUT_TORCH_DIST

    def __init__(self, stored: Stored, model, filt: TensorFilter, complete: bool = True, model_config=None):
        self.path = stored.path
        iteration_dir, self.files = stored.handle
        self._init_common(stored, model, filt, complete, model_config)
        self._check_recorded_parallelism(None)
        self.index = torch_dist_index(self.files, self.order, self.kinds)
        self._check_keys(self.index, "torch_dist")
        check_source_dtypes(iteration_dir, {k: meta.dtype for ckpt_key, _, meta in self.index.values()
                                            for k in (ckpt_key if isinstance(ckpt_key, tuple) else (ckpt_key,))})
        self.metas = {key: filt.meta(self.index[key][2]) for key in self.order if key in self.index} | self._side_metas()

    def _stored_pieces(self, key: str) -> list[torch.Tensor]:
        if key not in self.side:
            ckpt_key, position, meta = self.index[key]
            if isinstance(ckpt_key, tuple):  # named blocks stored apart
                return [self._filter(key, self.files.read(k), self.root) for k in ckpt_key]
            lead = len(position) if position is not None else 0
            region = (((position or ()) + (0,) * len(meta.shape)), (1,) * lead + tuple(meta.shape))
            pieces = self.files.region_pieces(ckpt_key, *region)
            if pieces is not None and all(tuple(p.shape[1:]) == tuple(meta.shape[1:]) for p in pieces):
                # Chunks that tile the tensor along dim 0 (gate and up halves): their views as
                # pieces, written from the file as they are, never joined.
                return [self._filter(key, p, self.root) for p in pieces]
        return [self._stored_tensor(key)]

    def _stored_tensor(self, key: str) -> torch.Tensor:
        if key in self.side:
            return self._side_tensor(key)
        ckpt_key, position, meta = self.index[key]
        if isinstance(ckpt_key, tuple):
            t = torch.cat([self.files.read(k) for k in ckpt_key])
        elif position is None:
            t = self.files.read(ckpt_key)
        else:
            # One layer's (one expert's) chunk of the stacked tensor: reading it never touches the
            # other layers.
            t = self.files.read_region(ckpt_key, position + (0,) * len(meta.shape),
                                       (1,) * len(position) + meta.shape)
            t = t.reshape(meta.shape)
        return self._filter(key, t, self.root)

    def locate(self, piece) -> tuple[int, int] | None:
        return self.files.file_ranges.locate(piece)


# --------------------------------------------------------------------------------------------------
# writing


def write(source: Source, out: Output, progress: Progress) -> Written:
    """The rule table's tensors placed as Megatron's classes shard them (``torch_dist_layout``)
    and written as megatron-core's ``dist_checkpointing`` writes them (``torch_dist_write``):
    no megatron and no model needed."""
    order, kinds = mcore_plan(source, out.grid)
    # torch_dist stores global tensors: the TP/PP/EP sizes only had to fit (checked above).
    pp_mod.pipeline_layout(order).layer_counts(out.grid.pp)
    total = sum(source.metas[k].nbytes for k in order)
    side, side_records, side_extra = side_files(source)
    args = megatron_args.checkpoint_args(source.cfg, {k: source.metas[k].shape for k in order},
                                         ckpt_format="torch_dist", grid=out.grid, vocab_multiple=source.vocab_multiple,
                                         declared=getattr(source.model, "recorded_args", None))
    try:
        layout = torch_dist_layout.plan(
            order, kinds, {k: source.metas[k].shape for k in order}, {k: source.metas[k].dtype for k in order},
            extra_state.sharded_extra_state_keys({k: kinds[k] for k in order}),
            heterogeneous=bool(getattr(args, "hetereogenous_dist_checkpoint", False)))
    except CheckpointError as exc:
        raise ConvertError(f"{source.family!r}: {exc}") from None
    progress.phase(f"{source.family} -> torch_dist", len(order), total)
    heap = heap_budget()
    heap.begin_stream()

    def produce(key: str) -> list:
        pieces = source.mcore_pieces(key)
        nbytes = sum(p.numel() * p.element_size() for p in pieces)
        progress.advance(1, nbytes)
        heap.check(nbytes)
        return pieces

    try:
        torch_dist_write.write_torch_dist(
            out.dst, layout, produce, iteration=RELEASE if out.release else 1,
            common={megatron_args.ARGS_KEY: args}, content_metadata=megatron_args.content_metadata(),
            provenance=mcore_provenance(source, out, **side_extra), extra_records=side_records,
            extra_files={HF_CONFIG_FILE: source.config_bytes, **side}, force=out.force,
            locate=source.locate, max_file_size=out.max_shard_size or torch_dist_write.DEFAULT_FILE_SIZE,
            team=out.team, node_local=out.node_local)
    except CheckpointError as exc:
        raise ConvertError(str(exc)) from None
    return Written(len(order), total, Grid.of())


# --------------------------------------------------------------------------------------------------
# verifying


def _shard_of(global_tensor: torch.Tensor, record: TensorRecord) -> torch.Tensor:
    """The region a record describes: leading offsets index prepended (layer) axes."""
    offset, shape = record.offset or (), record.checksum.shape
    prepended = len(offset) - len(shape)
    ends = [o + 1 for o in offset[:prepended]] + [o + n for o, n in zip(offset[prepended:], shape)]
    if prepended < 0 or global_tensor.dim() != len(offset) or any(
            end > size for end, size in zip(ends, global_tensor.shape)):
        raise CheckpointError(f"offset {list(offset)} does not fit global shape {list(global_tensor.shape)}")
    index = tuple(offset[:prepended]) + tuple(slice(o, o + n) for o, n in zip(offset[prepended:], shape))
    return global_tensor[index]


def _verify_dcp(root: Path, by_file: Mapping[str, list[TensorRecord]], report: VerifyReport) -> None:
    for dir_name, records in sorted(by_file.items()):
        path = root / dir_name
        try:
            files = torch_dist_files.TorchDistFiles(path)  # the index decoded once for every record
        except CheckpointError as exc:
            report.problems.append(Problem(dir_name, None, f"{exc}; {len(records)} shard record(s) not checked"))
            continue
        try:
            read_common(path)  # a checkpoint_version that is no version is damage, as in a legacy file
        except CheckpointError as exc:
            report.problems.append(Problem(dir_name, None, str(exc)))
        metadata = files.tensors
        objects = torch_dist_files.object_keys(path, files.metadata)
        by_key: dict[str, list[TensorRecord]] = defaultdict(list)
        for record in records:
            by_key[record.key].append(record)
        for key, key_records in sorted(by_key.items()):
            if key in objects:  # an _extra_state object: its stored bytes, never unpickled
                try:
                    found = extra_state.bytes_tensor(torch_dist_files.object_bytes(path, key, files.metadata))
                except CheckpointError as exc:
                    report.problems.append(Problem(dir_name, key, str(exc)))
                    continue
                for record in key_records:
                    compare_record(report, record, found)
                continue
            if key not in metadata:
                report.problems.append(Problem(dir_name, key, "missing from the checkpoint"))
                continue
            try:
                global_tensor = files.read(key)
            except CheckpointError as exc:
                report.problems.append(Problem(dir_name, key, str(exc)))
                continue
            for record in key_records:
                try:
                    found = _shard_of(global_tensor, record)
                except CheckpointError as exc:
                    report.problems.append(Problem(dir_name, key, str(exc)))
                    continue
                compare_record(report, record, found)
        unexpected_tensors(report, dir_name, (set(metadata) | set(objects)) - set(by_key) - {"common_state"})


def verify(root: Path, records: Mapping[str, list[TensorRecord]], report: VerifyReport) -> None:
    verify_mcore(_verify_dcp, root, records, report)


FORMAT = Format(
    name="torch_dist", layout=LAYOUT_TORCH_DIST, kind=MCORE,
    what="a torch_dist checkpoint (.metadata, metadata.json)",
    detect=is_torch_dist_dir, probe=probe, open=TorchDistSource, write=write, verify=verify,
    records_directories=True, default=True)
