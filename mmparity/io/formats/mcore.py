"""What the two Megatron formats (legacy rank files, torch_dist) share: a source's HF provenance,
side file and vocabulary re-padding, the checks of what its manifest records, and a writer's
plan, side files and provenance.

An mcore checkpoint mmparity writes keeps beside its iteration directory the HF config of its
model (``hf_config.json``), its manifest, and a side file of the tensors Megatron's class has no
place for (``mcore_side.safetensors``: CLIP's ``ln_post``, a LLaVA tower's layers past
``vision_feature_layer``), whole (TP = 1): a strict Megatron load never sees them, mcore -> HF
reads them back.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_save

from mmparity.errors import ConvertError, from_conversion_error, problems_line
from mmparity.io import quantized as quant_io
from mmparity.io.formats.base import Output, Source, Stored, TensorFilter, VerifyReport
from mmparity.io.formats.hf import verify_safetensors
from mmparity.io.fsio.checksums import TensorChecksum, tensor_checksum
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.pieces import joined, narrow_pieces
from mmparity.io.fsio.safetensors_format import MCORE_SIDE_FILE
from mmparity.io.fsio.safetensors_pread import RangeReader
from mmparity.io.layout import HF_CONFIG_FILE
from mmparity.io.manifest import MANIFEST_FILE, Manifest, Provenance, TensorRecord
from mmparity.mapping import rules as R
from mmparity.mapping.ops import PadRows
from mmparity.mapping.tables import mcore_order, padded_tables, tp_kinds
from mmparity.parallel import ep as ep_mod
from mmparity.parallel import pp as pp_mod
from mmparity.parallel import tp as tp_mod
from mmparity.parallel.axes import Grid
from mmparity.parallel.tp import ShardError

__all__ = ["SIDE_FILE", "NOT_MODEL_KEYS", "McoreSource", "manifest_of_iteration", "held_part", "read_side_file",
           "side_files", "mcore_plan", "validate_tp", "mcore_provenance", "verify_mcore"]

SIDE_FILE = MCORE_SIDE_FILE
# Sharded keys of a Megatron-LM torch_dist checkpoint that are not model weights (a chained
# optimizer's, e.g. dense + expert parameters under EP, under ``chained_N.``).
NOT_MODEL_KEYS = re.compile(r"^((chained_\d+\.)?optimizer\.|rng_state|rerun_state_machine_state|common_state)")


def manifest_of_iteration(manifest: Manifest | None, iteration) -> Manifest | None:
    """The root's manifest as it bears on ``iteration``: whole when it records that iteration (or
    none); else (Megatron-LM trained on and saved into the directory mmparity wrote) only what is
    beside the iterations (family, HF provenance, the side file), with no sizes or tensor records
    of the iteration it no longer describes."""
    if manifest is None or manifest.iteration is None or manifest.iteration == iteration:
        return manifest
    beside = tuple(r for r in manifest.tensors if "/" not in r.file and r.offset is None)
    return dataclasses.replace(manifest, tensors=beside, pipeline_layer_counts=None, iteration=None)


def held_part(rules: R.RuleSet, stored: Iterable[str], recorded: str | None, where: Path) -> str:
    """Which part of a whole VLM an mcore checkpoint holds ("" the whole), from the first name
    component of its stored keys: ``LLaVAModel``'s keys start with a part's root, those of a part
    trained alone (``GPTModel``'s ``embedding.``, ``decoder.``, ``output_layer.``) with what
    follows one root only. ``recorded``: the part its manifest names (checked against the keys)."""
    roots = R.rule_roots(rules)
    if not roots:
        return ""
    firsts = {key.split(".", 1)[0] for key in stored}
    if not firsts or firsts & {r.rstrip(".") for r in roots}:
        found = ""
    else:
        patterns = [k for rule in rules.rules for k in rule.mcore]
        heads = {r: {k[len(r):].split(".", 1)[0] for k in patterns if k.startswith(r)} for r in roots}
        fits = [r for r in roots if firsts <= heads[r]]
        found = fits[0] if len(fits) == 1 else ""
    if recorded is not None and recorded != R.part_name(found or "whole."):
        named = f"the {R.part_name(found)} alone" if found else "the whole model"
        raise ConvertError(f"{where / MANIFEST_FILE}: records part {recorded!r}, but the checkpoint's keys are "
                           f"{named}'s; the manifest is not this checkpoint's")
    return found


def validate_tp(rule_set: R.RuleSet, tp: int) -> None:
    problems = list(rule_set.validate_tp(tp)) if rule_set.validate_tp else []
    if problems:
        raise ConvertError(problems_line(f"--tp {tp} does not fit this model", problems))


# --------------------------------------------------------------------------------------------------
# side files


def read_side_file(root: Path, manifest: Manifest | None, keys: Sequence[str],
                   name: str = SIDE_FILE, expected: Mapping[str, tuple] | None = None) -> dict[str, torch.Tensor]:
    """The side tensors of an mcore checkpoint (or the tensors of another file beside it, ``name``),
    checked against the manifest's checksums. What the file's header declares is held to the
    manifest's records and to the shapes the config implies (``expected``) before a byte is read:
    a header may declare a tensor of any size (over a sparse file, say)."""
    if not keys:
        return {}
    records = {r.key: r for r in (manifest.tensors if manifest is not None else ()) if r.file == name}
    path = root / name
    if name != SIDE_FILE and not (records and path.is_file()):
        raise ConvertError(f"{root}: no {name} recorded in its {MANIFEST_FILE} (the scales of the quantized "
                           "source it was converted from)")
    if not records or not path.is_file():
        raise ConvertError(f"{root}: no side file {SIDE_FILE} recorded in its {MANIFEST_FILE} (it holds "
                           f"the tensors Megatron's class has no place for: {', '.join(keys[:4])}"
                           f"{' ...' if len(keys) > 4 else ''})")
    try:
        reader = RangeReader.of_file(path)
    except CheckpointError as exc:
        raise ConvertError(f"{path}: cannot read the side file: {exc}") from None
    with reader:
        return _checked_side_tensors(path, reader, records, keys, expected)


def _checked_side_tensors(path: Path, reader: RangeReader, records: Mapping, keys: Sequence[str],
                          expected: Mapping[str, tuple] | None) -> dict[str, torch.Tensor]:
    infos = reader.infos()
    problems = [f"missing side tensor {k}" for k in keys if k not in infos]
    problems += [f"unexpected side tensor {k} {list(infos[k].shape)}" for k in infos if k not in keys]
    for key, info in infos.items():
        want = (expected or {}).get(key)
        if want is not None and tuple(info.shape) != tuple(want):
            problems.append(f"{key}: its header declares {list(info.shape)}, the config implies {list(want)}")
        elif key in records:
            declared = TensorChecksum(str(info.dtype).removeprefix("torch."), tuple(info.shape), "")
            problems += [f"{key}: its header declares {d.replace('expected', 'the manifest records')}"
                         for d in records[key].checksum.differences(declared) if not d.endswith("differs")]
    if problems:  # nothing read yet
        raise ConvertError(problems_line(f"{path}: side file declares other tensors than its manifest and config "
                                         "describe (re-convert the checkpoint, or restore the file)", problems))
    try:
        tensors = {key: reader.read(key) for key in infos}
    except CheckpointError as exc:  # a short read
        raise ConvertError(f"{path}: cannot read the side file: {exc}") from None
    for key, t in tensors.items():
        if key not in records:
            problems.append(f"side tensor {key} is not in the manifest")
            continue
        checksum = records[key].checksum
        problems += [f"{key}: {d}" for d in checksum.differences(tensor_checksum(t, checksum.algorithm))]
    if problems:
        raise ConvertError(problems_line(f"{path}: side file does not match its manifest", problems))
    return tensors


def side_files(source: Source) -> tuple[dict[str, bytes], tuple, dict]:
    """(extra files, manifest records, manifest extra) for the side files of ``source``'s mcore
    output: its side tensors, and a quantized source's scales (for ``--requantize``); nothing for a
    family that keeps nothing aside from an unquantized source."""
    files, records, extra = _quant_scales(source)
    keys = R.side_keys(source.rules)
    if not keys:
        return files, records, extra
    tensors = {key: joined(source.mcore_pieces(key)).contiguous().clone() for key in keys}
    records += tuple(TensorRecord(SIDE_FILE, key, tensor_checksum(t)) for key, t in tensors.items())
    return {SIDE_FILE: safetensors_save(tensors), **files}, records, {"side_file": SIDE_FILE, **extra}


def _quant_scales(source: Source) -> tuple[dict[str, bytes], tuple, dict]:
    scales = source.quant_scales()
    if not scales:
        return {}, (), {}
    name = quant_io.QUANT_SCALES_FILE
    records = tuple(TensorRecord(name, key, tensor_checksum(t)) for key, t in scales.items())
    return {name: safetensors_save(scales)}, records, {}


# --------------------------------------------------------------------------------------------------
# the source


class McoreSource(Source):
    """Shared by the two mcore formats: HF provenance, the part held and the side tensors, from
    the root and the model the pipeline describes."""

    # The divisor the manifest records (None: none recorded, Megatron-LM's default is assumed).
    recorded_divisor: int | None = None
    # What --base / --hf-config say of a checkpoint Megatron-LM wrote (``convert.sources.ModelConfig``).
    model_config = None
    manifest_elsewhere = False  # the root's manifest records another iteration than the one read

    def _init_common(self, stored: Stored, model, filt: TensorFilter, complete: bool = True,
                     model_config=None) -> None:
        """``complete=False`` (``verify --load``): tensors missing or foreign to the family are left
        for the strict load to name, and the side file (which Megatron's class never reads) is
        checked only where present; the shapes of the tensors present, the records of the manifest
        and the TP size are checked all the same. ``model_config``: a checkpoint Megatron-LM wrote
        as ``--base`` or ``--hf-config`` describe it (its HF layout and prefix, its side tensors)."""
        root, manifest = stored.root, stored.manifest
        self.root, self.manifest, self._filter = root, manifest, filt
        self.iteration, self.manifest_elsewhere = stored.iteration, stored.manifest_elsewhere
        self.complete = complete
        self.model_config = model_config
        self._take(model)
        extra = dict(manifest.provenance.extra or {}) if manifest is not None else {}
        if isinstance(extra.get("left_out"), dict):
            self.left_out_record = extra["left_out"]
        if isinstance(extra.get("quantization"), dict):
            self.quant_record = extra["quantization"]
        recorded = extra.get("hf_format") or (manifest.provenance.source_format if manifest else None)
        self.hf_format = recorded if recorded in model.formats else model.formats[0]
        self.prefix = str(extra.get("hf_prefix") or "")
        if model_config is not None and (manifest is None or model_config.base is not None):
            self.hf_format, self.prefix = model_config.hf_format, model_config.prefix
        multiple = extra.get("make_vocab_size_divisible_by")
        if isinstance(multiple, int) and not isinstance(multiple, bool) and multiple > 0:
            self.vocab_multiple = self.recorded_divisor = multiple
        self.rules = self.whole_rules = self._rules(self.hf_format)
        recorded_part = extra.get("part") if isinstance(extra.get("part"), str) else None
        self.part = held_part(self.rules, stored.stored, recorded_part, root)
        if self.part:
            self.rules = R.part_rules(self.rules, self.part)
        self.kinds = tp_kinds(self.rules)
        self.order = mcore_order(self.rules)
        side_keys = R.side_keys(self.rules)
        if side_keys and model_config is not None and model_config.side_tensors is not None:
            # Megatron never held these: the base's own, by the family's rules, named in the output.
            self.side = model_config.side_tensors(side_keys)
            self.from_base = tuple(side_keys)
        elif side_keys and model_config is not None and manifest is None:
            raise ConvertError(f"{root}: Megatron's class has no place for {', '.join(side_keys[:4])}"
                               f"{' ...' if len(side_keys) > 4 else ''}, so a checkpoint Megatron wrote lacks them: "
                               f"pass --base HF_DIR (the release it was converted from) instead of "
                               f"{model_config.origin}")
        else:
            # The shapes are a whole plan's work (0.1 s at a few thousand tensors): only for side tensors.
            self.side = (read_side_file(root, manifest, side_keys, expected=model.expected_shapes())
                         if side_keys and (complete or (root / SIDE_FILE).is_file()) else {})
        if manifest is not None:
            # The weight files' records (one per stored tensor) are verify's to check, and nothing
            # here reads them again: held, they would be most of what a source costs per tensor for
            # the whole conversion. The side files' records stay (quant_scales reads them later).
            self.manifest = dataclasses.replace(manifest, tensors=tuple(
                r for r in manifest.tensors if r.file in (SIDE_FILE, quant_io.QUANT_SCALES_FILE)))
        self._repad: dict[str, PadRows] = {}  # mcore key -> the padding it is served with

    def repad_vocab(self, tp: int, multiple: int) -> None:
        """Serve every padded vocabulary table (LLaVA's embedding and output layer) as Megatron-LM
        pads it for ``tp`` ranks and ``--make-vocab-size-divisible-by multiple``: the real rows as
        stored, the stored padding (another TP size's, or another divisor's) stripped and zero rows
        appended, by the rule's own op and its inverse. A table already that size is served as
        stored. Call before reading any tensor."""
        self.vocab_tp, self.vocab_multiple = tp, multiple
        self._repad = {}
        for key, padding in padded_tables(self.rules).items():
            target, meta = padding.at_tp(tp, multiple), self.metas.get(key)
            if meta is not None and meta.shape[0] != target.padded:
                self._repad[key] = target
                self.metas[key] = R.shared_meta(meta.dtype, (target.padded, *meta.shape[1:]))

    def mcore_pieces(self, key: str) -> list[torch.Tensor]:
        pieces = self._stored_pieces(key)
        padding = self._repad.get(key)
        if padding is None:
            return pieces
        if not all(type(p) is torch.Tensor for p in pieces):
            pieces = [joined(pieces)]  # a column join: a table is split by rows, so never seen
        # The real rows as views of the stored pieces (TP parts included), the new zero rows a
        # piece of their own: joined and padded, a vocabulary table was two whole copies at once
        # (39 MB for a Kimi table scaled to 1/11, the peak of a legacy -> torch_dist re-layout).
        stored = sum(p.shape[0] for p in pieces)
        if stored < padding.rows:
            raise ConvertError(f"{self.root}: {key}: {padding!r}: a padded table needs at least {padding.rows} "
                               f"rows, got {stored}")
        return padding.pad_pieces(narrow_pieces(pieces, 0, 0, padding.rows))

    def mcore_tensor(self, key: str) -> torch.Tensor:
        return joined(self.mcore_pieces(key))

    def quant_scales(self) -> dict[str, torch.Tensor]:
        if not self.quant_record:
            return {}
        name = quant_io.QUANT_SCALES_FILE
        keys = [r.key for r in (self.manifest.tensors if self.manifest is not None else ()) if r.file == name]
        return read_side_file(self.root, self.manifest, keys or ["(none recorded)"], name)

    def _stored_pieces(self, key: str) -> list[torch.Tensor]:
        return [self._stored_tensor(key)]

    def _stored_tensor(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def _side_metas(self) -> dict:
        return {key: self._filter.meta(R.meta_of(t)) for key, t in self.side.items()}

    def _side_tensor(self, key: str) -> torch.Tensor:
        return self._filter(key, self.side[key], self.root)

    def _check_recorded_parallelism(self, stored_grid: Grid | None) -> None:
        """The TP, PP and EP sizes and the layer split the manifest records, bounded by what is
        present before anything is built or spawned from them: a legacy checkpoint's must be its
        rank directories' (``stored_grid``); torch_dist's (global tensors, ``stored_grid`` None)
        must fit the model as a ``--tp`` / ``--pp`` / ``--ep`` would; the layer counts must split
        the config's layers."""
        manifest = None if self.manifest_elsewhere else self.manifest
        if manifest is None:
            if stored_grid is not None and stored_grid.ep.size > 1:
                self._check_ep(stored_grid.ep.size, self.root)
            return
        where = self.root / MANIFEST_FILE
        tp, pp, counts = (manifest.tensor_parallel_size, manifest.pipeline_parallel_size,
                          manifest.pipeline_layer_counts)
        ep = manifest.expert_parallel_size
        if stored_grid is not None and (tp, pp, ep) != stored_grid.sizes:
            stored_tp, stored_pp, stored_ep = stored_grid.sizes
            recorded = f"TP {tp} and PP {pp}" + (f" and EP {ep}" if ep > 1 or stored_ep > 1 else "")
            held = f"{stored_tp} TP rank(s) x {stored_pp} pipeline stage(s)" + (
                f" x {stored_ep} EP rank(s)" if ep > 1 or stored_ep > 1 else "")
            raise ConvertError(f"{where}: records {recorded}, but the checkpoint holds {held} of rank directories; "
                               "the manifest is not this checkpoint's (re-create it with mmparity convert)")
        self._check_ep(ep, where)
        problems = (list(self.rules.validate_tp(tp)) if stored_grid is None and self.rules.validate_tp and tp > 1
                    else [])
        if problems:  # (a legacy checkpoint's own TP is checked against the model when merged)
            raise ConvertError(problems_line(f"{where}: the recorded TP {tp} does not fit this model", problems))
        layout = pp_mod.pipeline_layout(self.order)
        if pp > 1 and pp > layout.num_layers:
            raise ConvertError(f"{where}: records PP {pp}, more pipeline stages than the {layout.num_layers} "
                               f"layers of {layout.layer_prefix} its HF config describes")
        if counts is not None and (len(counts) != pp or sum(counts) != layout.num_layers):
            raise ConvertError(f"{where}: the recorded pipeline layer counts {list(counts)} do not split the "
                               f"{layout.num_layers} layers of {layout.layer_prefix} its HF config describes "
                               f"into its {pp} stage(s)")

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer, as the family's rule table names them (0: none)."""
        try:
            return ep_mod.expert_count(self.order)
        except R.ConversionError as exc:
            raise from_conversion_error(exc, f"{self.family!r}: ") from None

    def _check_ep(self, ep: int, where: Path) -> None:
        problems = Grid.of(ep=ep).problems(self.num_experts, self.family)
        if problems:
            raise ConvertError(f"{where}: records or holds EP {ep}: {problems[0]}")

    def _check_keys(self, present: Iterable[str], what: str) -> None:
        if not self.complete:
            return
        present = set(present)
        expected = set(self.order)
        problems = [f"missing mcore tensor {k}" for k in self.order if k not in present]
        problems += [f"unconsumed mcore tensor {k}" for k in sorted(present - expected)]
        if problems:
            raise ConvertError(problems_line(f"{self.root}: not a complete {self.family!r} {what} checkpoint",
                                             problems))


# --------------------------------------------------------------------------------------------------
# writing


def mcore_plan(source: Source, grid: Grid) -> tuple[list[str], dict[str, str]]:
    """(the mcore keys to write, in order, their TP kinds), checked for the ``grid`` (``--tp``,
    ``--pp``, ``--ep``); side keys are not among them (see :func:`side_files`)."""
    rules = source.rules
    tp = grid.tp.size
    validate_tp(rules, tp)
    order, kinds = mcore_order(rules), tp_kinds(rules)
    try:
        num_experts = ep_mod.expert_count(order)
    except R.ConversionError as exc:
        raise from_conversion_error(exc, f"{source.family!r}: ") from None
    grid_problems = grid.problems(num_experts, source.family)
    if grid_problems:
        raise ConvertError(grid_problems[0])
    problems = [f"missing mcore tensor {k}" for k in order if k not in source.metas]
    for key in order:
        if key in source.metas and tp > 1:
            try:
                tp_mod.shard(source.metas[key].tensor(), kinds[key], tp)
            except ShardError as exc:
                problems.append(f"{key} {list(source.metas[key].shape)}: {exc}")
    if problems:
        raise ConvertError(problems_line(f"cannot shard {source.family!r} for --tp {tp}", problems))
    return order, kinds


def mcore_provenance(source: Source, out: Output, **extra) -> Provenance:
    held = {"part": R.part_name(source.part)} if source.part else {}
    if out.megatron_class:
        held["megatron_class"] = out.megatron_class
    return Provenance(
        family=source.family, source_layout=source.layout, source_format=source.hf_format,
        source_path=str(Path(source.path).absolute()),
        extra={**source.provenance_extra(), "hf_config": HF_CONFIG_FILE,
               "dtype": out.dtype, **held, **extra})


# --------------------------------------------------------------------------------------------------
# verifying


def verify_mcore(own, root: Path, by_file: Mapping[str, list[TensorRecord]], report: VerifyReport) -> None:
    """An mcore format's records: its side files (tensors Megatron's class has no place for, a
    quantized source's scales) are safetensors, the rest its own files, checked by ``own``."""
    side = {f: r for f, r in by_file.items() if f.endswith(".safetensors")}
    verify_safetensors(root, side, report)
    own(root, {f: r for f, r in by_file.items() if f not in side}, report)
