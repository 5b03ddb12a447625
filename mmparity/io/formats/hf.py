"""HF safetensors: a ``save_pretrained`` directory (``model.safetensors`` or its index), itself the
checkpoint, with its ``config.json``.

Reading: the source runs the engine's ``StepRunner`` over the HF tensors it maps with
``SafetensorsCheckpoint.map``, planned from the file headers alone (``rules.plan_hf_to_mcore``: the
one totality check), dequantizing a quantized release on read. Writing: every mcore tensor is
inverted step by step into safetensors shards whose headers were laid out in advance, each tensor
put straight into its reserved byte range.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from mmparity.errors import ConvertError, from_conversion_error, problems_line
from mmparity.io import quantized as quant_io
from mmparity.io import team as team_mod
from mmparity.io.formats.base import (
    HF, Format, Output, PlanSources, Problem, Progress, Source, SourceUse, Stored, TensorFilter, VerifyReport,
    Written, compare_record, part_root, unexpected_tensors)
from mmparity.io.fsio.checksums import TensorChecksum
from mmparity.io.fsio.dtypes import check_source_dtypes
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.heap import heap_budget
from mmparity.io.fsio.pieces import joined, route_pieces
from mmparity.io.fsio.safetensors_format import (
    DEFAULT_MAX_SHARD_SIZE, SAFETENSORS_DTYPES, SAFETENSORS_SINGLE_FILE, has_hf_weights)
from mmparity.io.fsio.safetensors_read import SafetensorsCheckpoint
from mmparity.io.fsio.safetensors_write import StreamingSafetensorsWriter
from mmparity.io.hf import safetensors_capacity
from mmparity.io.manifest import LAYOUT_HF, Manifest, Provenance, TensorRecord, write_manifest
from mmparity.io.megatron_written import FROM_BASE, copy_base_files
from mmparity.mapping import quant as quant_mod
from mmparity.mapping import rules as R
from mmparity.mapping.ops import LayoutError
from mmparity.parallel.axes import Grid
from mmparity.parallel.tp import ShardError

__all__ = ["FORMAT", "CONFIG_FILE", "HFSource", "verify_safetensors"]

CONFIG_FILE = "config.json"


# --------------------------------------------------------------------------------------------------
# reading


def probe(path: Path, iteration=None) -> Stored:
    """The directory's safetensors headers, mapped; its config is ``config.json`` (or Mistral's
    ``params.json``, which the pipeline reads in its place)."""
    ckpt = SafetensorsCheckpoint(path)
    return Stored(path, path, path / CONFIG_FILE, safetensors_capacity(ckpt.infos()), handle=ckpt)


class HFSource(Source):
    layout = LAYOUT_HF

    def __init__(self, stored: Stored, model, hf_format: str | None, filt: TensorFilter, tp: int = 1,
                 vocab_multiple: int = R.VOCAB_MULTIPLE, part: str | None = None):
        path = stored.path
        self.path, self._filter = path, filt
        self.vocab_tp, self.vocab_multiple = tp, vocab_multiple
        self._take(model)
        family = self.family
        self.ckpt = stored.handle
        scheme = quant_io.read_scheme(self.config_bytes, path / CONFIG_FILE)
        if scheme is not None:
            # The logical tensors, dequantized on read; planned, like any source, from headers.
            self.ckpt = quant_io.DequantizingCheckpoint(self.ckpt, scheme, filt.dtype)
            self.quant_record = self.ckpt.record().to_json()
        infos = self.ckpt.infos()
        self.rules = self.whole_rules = self._rules(hf_format, infos, f"{path}: ")
        self.hf_format = self.rules.hf_format
        if part is not None:
            self.part = part_root(self.rules, family, part)
            self.rules = R.part_rules(self.rules, self.part)
        try:
            self.prefix = R.detect_prefix(self.rules, infos)
        except R.ConversionError as exc:
            raise from_conversion_error(exc, f"{path}: family {family!r}: ") from None
        # The engine's plan, made from the file headers alone: the one totality check.
        metas = infos if filt.dtype is None else {name: filt.meta(R.meta_of(info)) for name, info in infos.items()}
        try:
            # Planned for the target TP where it fits (vocabulary padding); a TP that does not fit
            # is reported, with every reason, by the writer's own check.
            fits = not (self.rules.validate_tp and self.rules.validate_tp(tp))
            self.plan = R.plan_hf_to_mcore(self.rules, metas, tp if fits else 1, self.prefix, vocab_multiple)
        except R.ConversionError as exc:
            raise ConvertError(problems_line(f"{path}: not a complete {family!r} checkpoint "
                                             f"({self.hf_format!r} layout)", exc.problems)) from None
        # The plan's own tables, not copies: nothing changes an HF source's shapes after planning.
        self.metas = self.plan.outputs
        self.hf_sources = PlanSources(self.plan)
        check_source_dtypes(path, {name: infos[name].dtype for name in self.plan.inputs})
        self.use = SourceUse.of(self.plan, {name: info.nbytes for name, info in infos.items()})
        if self.use.left_out:
            self.left_out_record = self.use.to_json()
        prefix = self.prefix
        self.runner = R.StepRunner(self.plan, lambda name: self._filter(name[len(prefix):], self.ckpt.map(name),
                                                                        self.path))

    def mcore_tensor(self, key: str) -> torch.Tensor:
        return joined(self.mcore_pieces(key))

    def quant_scales(self) -> dict[str, torch.Tensor]:
        return self.ckpt.scales() if isinstance(self.ckpt, quant_io.DequantizingCheckpoint) else {}

    def locate(self, piece) -> tuple[int, int] | None:
        return self.ckpt.file_ranges.locate(piece)

    def produce(self, key: str) -> tuple[list, list]:
        try:
            return self.runner.run(key)
        except (LayoutError, ShardError, RuntimeError) as exc:
            hf_keys = [k[len(self.prefix):] for k in self.plan.source_keys(key)]
            raise ConvertError(f"{self.path}: {', '.join(hf_keys)}: {exc}") from None

    def mcore_pieces(self, key: str) -> list[torch.Tensor]:
        return self.produce(key)[0]


def open_source(stored: Stored, model, hf_format, filt, tp, vocab_multiple, part=None) -> HFSource:
    return HFSource(stored, model, hf_format, filt, tp, vocab_multiple, part)


# --------------------------------------------------------------------------------------------------
# writing: safetensors shards streamed into place


def write(source: Source, out: Output, progress: Progress) -> Written:
    rules = out.hf_rules
    fmt = rules.hf_format
    prefix = source.prefix if source.prefix in rules.hf_prefixes else ""
    try:
        plan = R.plan_mcore_to_hf(rules, source.metas, prefix)
    except R.ConversionError as exc:
        raise ConvertError(problems_line(f"cannot lay out {source.family!r} as HF {fmt!r}", exc.problems)) from None
    entries = [(key, t.dtype, t.shape) for key, t in plan.outputs.items()]
    requant = _requant_plan(source, out, entries)
    if requant is not None:
        entries = requant.entries
    total = sum(R.Meta(d, s).nbytes for _, d, s in entries)
    progress.phase(f"{source.family} -> hf", len(entries), total)
    provenance = Provenance(family=source.family, source_layout=source.layout, source_format=fmt,
                            source_path=str(source.path), extra=source.provenance_extra() | {"hf_format": fmt, "hf_prefix": prefix})
    heap = heap_budget()
    heap.begin_stream()
    team = out.team or team_mod.solo()
    copied, from_base_hf, from_base_bytes = (), (), 0
    with team.staging(out.dst, force=out.force) as staging:
        writer = StreamingSafetensorsWriter(staging, entries, max_shard_size=out.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
                                            locate=source.locate, writes=team.mine, write_index=team.leader)

        def wanted(key: str) -> bool:
            if requant is not None and key in requant.scales:
                return any(writer.writes(name) for name in requant.stored_names[key])
            return writer.writes(key)

        def put(key: str, pieces: list) -> None:
            if requant is not None and key in requant.scales:
                pieces = requant.write(key, joined(pieces), writer)
            else:
                writer.write(key, pieces)
            nbytes = sum(p.numel() * p.element_size() for p in pieces)
            progress.advance(1, nbytes)
            heap.check(nbytes)

        try:
            # An op that only moves row blocks (a rename, q/k/v regrouping, a gated split) takes
            # its rows straight from the source's pieces, TP parts included (route_pieces).
            R.stream_to_hf(plan, source.mcore_pieces, put, route=route_pieces,
                           wanted=None if team.solo else wanted)
            writer.close()
        finally:
            writer.abort()
        # One process keeps its checksums as they are (see the legacy writer).
        gathered = [] if team.solo else team.gather("written", [[writer.weight_map[n], n, c.to_json()]
                                                                for n, c in writer.checksums.items()])
        if requant is not None:
            errors_of = team.gather("requantized", requant.error.to_json())
            if errors_of is not None:
                requant.error = quant_mod.RequantError.merged(errors_of)
        if not team.leader:
            return Written(len(entries), total, Grid.of())
        if requant is not None:
            config = quant_io.config_with_quantization(source.config_bytes, requant.scheme)
            provenance = dataclasses.replace(provenance, extra={**provenance.extra,
                                                                "requantized": requant.error.to_json()})
        else:
            config = quant_io.config_without_quantization(source.config_bytes)
        (staging / CONFIG_FILE).write_bytes(config)
        if out.base is not None:
            copied = tuple(copy_base_files(out.base, staging))
        from_base = set(source.from_base)
        if from_base:
            # The HF tensors made only of side tensors the base gave: Megatron never held them.
            from_base_hf = tuple(sorted(k for k in plan.outputs if set(plan.source_keys(k)) <= from_base))
            from_base_bytes = sum(plan.outputs[k].nbytes for k in from_base_hf)
            provenance = dataclasses.replace(provenance, extra={**provenance.extra, "from_base": {
                "base": str(out.base), "note": FROM_BASE, "tensors": list(from_base_hf)}})
        write_manifest(staging, Manifest(
            layout=LAYOUT_HF,
            tensors=(*(TensorRecord(writer.weight_map[n], n, c) for n, c in writer.checksums.items()),
                     *(TensorRecord(file, name, TensorChecksum.from_json(c))
                       for rank_records in gathered[1:] for file, name, c in rank_records)),
            provenance=provenance))
    return Written(len(entries), total, Grid.of(), requant.error if requant is not None else None, copied,
                   from_base_hf, from_base_bytes)


class _Requant:
    """``--requantize``: the weights a quantized source held, written back in its scheme, each
    block with its source scale where its values still fit it (``quant.quantize``)."""

    def __init__(self, scheme, scales: dict[str, torch.Tensor], entries: list):
        self.scheme, self.scales = scheme, scales
        self.entries = []
        self.stored_names: dict[str, list[str]] = {}
        for key, dtype, shape in entries:
            if key in scales:
                stored = scheme.stored_entries(key, shape, scales[key])
                self.stored_names[key] = [name for name, _, _ in stored]
                self.entries += stored
            else:
                self.entries.append((key, dtype, shape))
        self.error = quant_mod.RequantError()

    def write(self, key: str, value: torch.Tensor, writer) -> list:
        try:
            weight, scale = quant_mod.quantize(value, self.scheme, self.scales[key])
        except quant_mod.QuantError as exc:
            raise ConvertError(f"--requantize: {key}: {exc}; export without --requantize (the weights as they "
                               "are) or repair them") from None
        error, exact = quant_mod.requant_error(value, weight, scale, self.scheme)
        # With the source's scales kept and its values coming back exactly, the bytes are the
        # source's (quantize inverts dequantize, tests/mapping/test_quant.py); otherwise they changed.
        same = exact and torch.equal(scale, self.scales[key])
        if writer.writes(self.stored_names[key][0]):  # where several processes write, counted by one
            self.error = self.error.add(error, exact, same)
        if isinstance(self.scheme, quant_mod.PackedInt4Scheme):
            stored = self.scheme.stored_tensors(key, weight, scale, tuple(value.shape))
        else:
            stored = self.scheme.stored_tensors(key, weight, scale)
        stored = {name: tensor for name, tensor in stored.items() if writer.writes(name)}
        for name, tensor in stored.items():
            writer.write(name, [tensor])
        return list(stored.values())


def _requant_plan(source: Source, out: Output, entries: list) -> _Requant | None:
    if not out.requantize:
        return None
    if not source.quant_record:
        raise ConvertError(f"--requantize: {source.path} records no quantized source (only an mcore checkpoint "
                           "converted from a quantized HF release can be re-quantized)")
    try:
        record = quant_io.QuantRecord.from_json(source.quant_record, source.path)
    except CheckpointError as exc:
        raise ConvertError(str(exc)) from None
    scales = source.quant_scales()
    planned = {key: shape for key, _, shape in entries}
    problems = [f"{key} is not among the HF tensors written" for key in scales if key not in planned]
    problems += [f"{key}: scale {list(t.shape)} does not fit {list(planned[key])}" for key, t in scales.items()
                 if key in planned and tuple(t.shape) != record.scheme.scale_shape(planned[key])]
    if problems:
        raise ConvertError(problems_line(f"--requantize: the recorded scales do not fit the HF output "
                                         f"(--hf-format {out.hf_format or source.hf_format!r})", problems))
    return _Requant(record.scheme, scales, entries)


# --------------------------------------------------------------------------------------------------
# verifying


def verify_safetensors(root: Path, by_file: Mapping[str, list[TensorRecord]], report: VerifyReport) -> None:
    """Every record of safetensors files (an HF checkpoint's shards, an mcore checkpoint's side
    files): each header held to its records before a byte is read, then each tensor's checksum."""
    for file_name, records in sorted(by_file.items()):
        try:
            handle = safe_open(str(root / file_name), framework="pt", device="cpu")
            present = set(handle.keys())
        except Exception as exc:
            report.problems.append(Problem(file_name, None, f"unreadable ({' '.join(str(exc).split())}); {len(records)} tensor(s) not checked"))
            continue
        for record in records:
            if record.key not in present:
                report.problems.append(Problem(file_name, record.key, "missing from the file"))
                continue
            try:
                # What the header declares, before it is allocated: a header may declare a tensor of
                # any size (over a sparse file), and the record says what it must be.
                view = handle.get_slice(record.key)
                dtype = SAFETENSORS_DTYPES.get(view.get_dtype())
                declared = TensorChecksum(str(dtype).removeprefix("torch."), tuple(view.get_shape()), "")
                wrong = [d for d in record.checksum.differences(declared) if not d.endswith("differs")]
                if wrong:
                    report.checked += 1
                    report.problems += [Problem(file_name, record.key, f"its header declares {d}") for d in wrong]
                    continue
                found = handle.get_tensor(record.key)
            except Exception as exc:
                report.problems.append(Problem(file_name, record.key, f"unreadable ({' '.join(str(exc).split())})"))
                continue
            compare_record(report, record, found)
        unexpected_tensors(report, file_name, present - {r.key for r in records})


FORMAT = Format(
    name="hf", layout=LAYOUT_HF, kind=HF,
    what=f"an HF safetensors directory ({SAFETENSORS_SINGLE_FILE} or its index)",
    detect=has_hf_weights, probe=probe, open=open_source, write=write, verify=verify_safetensors)
