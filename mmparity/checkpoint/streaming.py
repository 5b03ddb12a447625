"""Checkpoint conversion on disk: HF safetensors <-> mcore legacy / torch_dist, streaming and atomic.

One pipeline, three kinds of source and three kinds of target, joined by the rule engine:

    source (HF dir | legacy dir | torch_dist dir)  --mcore_pieces(key)-->  target writer

The conversion itself is the engine of `mmparity.converters.rules`, the same one the in-memory
API runs: its plans (`plan_hf_to_mcore`, `plan_mcore_to_hf`) are the one totality check, and its
loops (`stream_to_mcore`, `stream_to_hf`) drive the writers here instead of an in-memory sink.
Every source answers one question, "the full (TP = 1, globally numbered) mcore tensor of this key",
one key at a time: an HF source runs the engine's `StepRunner` (`op.apply_pieces` on the HF
tensors it maps with `SafetensorsCheckpoint.map`); a legacy source memory-maps its rank files
(`torch.load(mmap=True, weights_only=True)`) and merges the key's TP parts; a torch_dist source
maps just that layer's chunk of mcore's stacked tensor. The HF writer inverts each step into
safetensors shards whose headers were laid out in advance; the mcore writers shard each tensor for
TP into legacy rank files (`checkpoint.LegacyWriter`), or places it as Megatron's classes shard it
into a DCP data file (`torch_dist_layout`, `torch_dist_write`: no megatron, no torch.distributed).

Everything that can be known before reading a byte is checked first, on `meta` tensors: missing,
unexpected and mis-shaped tensors (against the shapes the HF config implies, via the reference
model built on the meta device), layout-op failures, TP sizes that do not divide the heads,
pipeline splits. Only then is the destination's staging directory created; output becomes visible
by one rename when complete, and any failure leaves nothing behind.

Memory and bytes. No target holds more than a few tensors: each format's layout is fixed from the
dry run before any tensor exists (safetensors headers; a `torch.save` skeleton per legacy rank
file written under `skip_data`; the DCP blobs framed from the torch_dist layout), and a `SlotWriter` puts
every tensor straight into its reserved byte range. Sources hand tensors over as *pieces*, views
of the file mappings they read from: a layout op that only moves row blocks (renames, q/k/v
regrouping, gated halves), a TP split or a TP merge selects pieces instead of copying, so most
bytes go from the source's page cache to the destination's without passing through a Python-side
copy. Only ops that really permute elements (RoPE interleaving, a non-row-block TP split) copy.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_save

from mmparity import families
from mmparity.checkpoint import extra_state, megatron_args, torch_dist_layout, torch_dist_write
from mmparity.checkpoint import team as team_mod
from mmparity.checkpoint import formats as ckpt_formats
from mmparity.checkpoint.hf import (bound_config, detect_family, read_hf_config, safetensors_capacity,
                                    torch_dist_capacity)
from mmparity.families import UnknownFamilyError
from mmparity.checkpoint.layout import RELEASE, TRACKER_FILE, checkpoint_extent, iteration_dirname, resolve_iteration_dir
from mmparity.checkpoint.legacy import LegacyWriter, finish_legacy, load_rank_payload, model_chunk_keys, open_legacy
from mmparity.checkpoint.megatron_written import FROM_BASE, ModelConfig, args_parallelism, copy_base_files, read_common
from mmparity.checkpoint.manifest import (LAYOUT_HF, LAYOUT_LEGACY, LAYOUT_TORCH_DIST, MANIFEST_FILE, Manifest,
                                          Provenance, TensorRecord, read_manifest, write_manifest)
from mmparity.checkpoint.torch_dist_files import TorchDistFiles
from mmparity.converters import ep as ep_mod
from mmparity.converters import pp as pp_mod
from mmparity.converters.axes import Grid
from mmparity.converters.pp import PipelineError
from mmparity.converters import rules as R
from mmparity.converters import tp as tp_mod
from mmparity.checkpoint.fsio import shared
from mmparity.checkpoint.fsio.checksums import TensorChecksum, tensor_checksum
from mmparity.checkpoint.fsio.dtypes import check_source_dtypes
from mmparity.checkpoint.fsio.errors import CheckpointError
from mmparity.checkpoint.fsio.heap import heap_budget
from mmparity.checkpoint.fsio.pieces import FileRanges, joined, narrow_pieces, route_pieces
from mmparity.checkpoint.fsio.publish import recover_destination
from mmparity.checkpoint.fsio.safetensors_format import DEFAULT_MAX_SHARD_SIZE, MCORE_SIDE_FILE, has_hf_weights, parse_size
from mmparity.checkpoint.fsio.safetensors_pread import RangeReader
from mmparity.checkpoint.fsio.safetensors_read import SafetensorsCheckpoint
from mmparity.checkpoint.fsio.safetensors_write import StreamingSafetensorsWriter
from mmparity.checkpoint import quantized as quant_io
from mmparity.converters import quant as quant_mod
from mmparity.converters.ops import MAX_EXTRA_PAD_ROWS, LayoutError, PadRows
from mmparity.converters.tp import ShardError

__all__ = [
    "ConvertError",
    "ConvertOptions",
    "ConvertResult",
    "Progress",
    "SourceUse",
    "convert",
    "open_source",
    "read_mcore_shards",
    "HF_CONFIG_FILE",
    "DTYPES",
]

# An mcore checkpoint keeps its source's HF config under this name, so that converting back (and
# `check --mcore`) knows the shapes without the original directory.
HF_CONFIG_FILE = "hf_config.json"
CONFIG_FILE = "config.json"
# Tensors Megatron's class has no place for (the converters' side rules), whole (TP = 1), beside
# the checkpoint: a strict Megatron load never sees them, mcore -> HF reads them back. Checksummed
# in the manifest's records like every other tensor; ``extra["side_file"]`` names the file.
SIDE_FILE = MCORE_SIDE_FILE

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
TARGETS = ("mcore", "hf")

# Sharded keys of a Megatron-LM torch_dist checkpoint that are not model weights (a chained
# optimizer's, e.g. dense + expert parameters under EP, under ``chained_N.``).
_NOT_MODEL_KEYS = re.compile(r"^((chained_\d+\.)?optimizer\.|rng_state|rerun_state_machine_state|common_state)")
# mcore's stacked layer tensors: `<root>decoder.layers.<name>` without a layer number.
_STACKED_KEY = re.compile(r"^((?:.*\.)?decoder\.layers\.)(?!\d+\.)(.+)$")
# MoE expert tensors, stacked over the global experts by both of mcore's experts modules, and over
# the layers too unless the block is non-homogeneous (dense and MoE layers, mcore then keeps each
# layer's number in the key): `<root>decoder.layers.[<n>.]mlp.experts.experts.linear_fc1.weight` of
# shape [layers, experts, ...] or [experts, ...].
_STACKED_EXPERT_KEY = re.compile(r"^(?P<stack>(?:.*\.)?decoder\.layers\.)(?:(?P<layer>\d+)\.)?"
                                 r"(?P<module>(?:.*\.)?mlp\.experts\.)experts\.(?P<rest>linear_fc[12]\.(?:weight|bias))$")
_MAX_PROBLEMS_SHOWN = 4


class ConvertError(Exception):
    """Why a conversion cannot be done, in one line (the CLI prints it and exits 2)."""


def _problems_line(title: str, problems: Sequence[str]) -> str:
    shown = "; ".join(" ".join(p.split()) for p in problems[:_MAX_PROBLEMS_SHOWN])
    more = len(problems) - _MAX_PROBLEMS_SHOWN
    return f"{title}: {shown}" + (f" (+{more} more)" if more > 0 else "")


def _from_conversion_error(exc: R.ConversionError, where: str = "") -> ConvertError:
    return ConvertError(_problems_line(f"{where}{exc.title}", exc.problems))


# --------------------------------------------------------------------------------------------------
# options, progress, result


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    src: Path
    dst: Path
    to: str  # "mcore" or "hf"
    family: str | None = None  # None: an HF source's is detected from its config, an mcore one's recorded
    tp: int = 1
    pp: int = 1
    # Megatron's expert_model_parallel_size: legacy rank files hold their EP rank's experts (see
    # converters.ep); torch_dist's global tensors load at any EP that divides the experts.
    ep: int = 1
    # mcore target format (formats.writable()); default: the registry's default (torch_dist)
    format: str = dataclasses.field(default_factory=lambda: ckpt_formats.writable()[0])
    dtype: str | None = None  # cast floating tensors; None keeps every tensor's own dtype
    hf_format: str | None = None  # HF-side layout (of the source, or of HF output)
    # The largest output file: an HF shard (default 5GB), a torch_dist data file (default 2GB).
    max_shard_size: int | str | None = None
    check_finite: bool = False
    force: bool = False
    # Megatron-LM's --make-vocab-size-divisible-by: vocabularies (LLaVA's) are padded to a multiple
    # of it times --tp (legacy; torch_dist holds global tensors, padded as for TP 1, which
    # Megatron's vocabulary layers load at any TP). None: Megatron-LM's default for an HF source,
    # the divisor an mcore source records (its tables are re-padded for the target either way).
    make_vocab_size_divisible_by: int | None = None
    # --to hf from an mcore checkpoint of a quantized (FP8 or INT4) source: write the weights in the source's
    # scheme again, with its quantization_config (see mmparity.checkpoint.quantized).
    requantize: bool = False
    # How a legacy checkpoint names the routed experts: ``grouped`` as TEGroupedMLP does
    # (``linear_fc1.weight{e}``, Megatron-LM's ``--moe-grouped-gemm``), ``sequential`` as
    # SequentialMLP does (``local_experts.{e}.linear_fc1.weight``). torch_dist files are the same
    # either way (mcore shards both on one global expert axis).
    expert_layout: str = "grouped"
    # An mcore checkpoint Megatron-LM wrote (no mmparity.json, no hf_config.json, no side file):
    # the HF release it was converted from (config, tokenizer/processor files and the tensors
    # Megatron has no place for), or just an HF config file; and which iteration of several.
    base: Path | None = None
    hf_config: Path | None = None
    iteration: int | str | None = None
    # Write Megatron-LM's `release` iteration (tracker "release", directory release/): its loader
    # then starts at iteration 0 and looks for no RNG or optimizer state, so a plain --load works.
    release: bool = False
    # This process's share where several write one checkpoint (torchrun, --workers): None is one
    # process writing everything. The output is the same either way.
    team: team_mod.Team | None = None
    # torch_dist written by ranks on several machines, each node's data files to ``dst`` on its
    # own disk (no shared filesystem); rank 0's node gets the metadata (see team.staging).
    node_local: bool = False
    # One part of a whole VLM, laid out for the Megatron class that trains it alone
    # (``language_model``: ``GPTModel``'s own keys), the rest of the source left out and reported.
    # None: the whole (``LLaVAModel``'s layout), or for an mcore source the part it holds.
    part: str | None = None

    @property
    def grid(self) -> Grid:
        """The parallel axes of mcore output (``--tp``, ``--pp``, ``--ep``)."""
        return Grid.of(self.tp, self.pp, self.ep)


@dataclasses.dataclass(frozen=True)
class SourceUse:
    """What an HF -> mcore conversion took of its source, from its plan: every source tensor was
    either converted or left out (a rule table's ``drop_hf``: the rest of a whole VLM, buffers),
    so the two add up to all of it. Bytes as stored in the source."""

    converted: int
    converted_bytes: int
    # (module, tensors, bytes) per part left out (``converters.rules.module_of``), largest first.
    left_out: tuple = ()

    @property
    def left_out_tensors(self) -> int:
        return sum(n for _, n, _ in self.left_out)

    @property
    def left_out_bytes(self) -> int:
        return sum(b for _, _, b in self.left_out)

    @property
    def tensors(self) -> int:
        return self.converted + self.left_out_tensors

    @property
    def nbytes(self) -> int:
        return self.converted_bytes + self.left_out_bytes

    @classmethod
    def of(cls, plan: R.Plan, nbytes: Mapping[str, int]) -> "SourceUse":
        """From a plan and the stored size of every source tensor."""
        return cls.split(plan.inputs, plan.dropped, nbytes)

    @classmethod
    def split(cls, converted: Iterable[str], left_out: Iterable[str], nbytes: Mapping[str, int]) -> "SourceUse":
        """From the source keys converted and those left out, and the size of each."""
        converted = list(converted)
        groups: dict[str, list[int]] = {}
        for key in left_out:
            group = groups.setdefault(R.module_of(key), [0, 0])
            group[0] += 1
            group[1] += nbytes[key]
        parts = tuple(sorted(((m, n, b) for m, (n, b) in groups.items()), key=lambda g: (-g[2], g[0])))
        return cls(len(converted), sum(nbytes[k] for k in converted), parts)

    def to_json(self) -> dict:
        return {"converted": self.converted, "converted_bytes": self.converted_bytes,
                "left_out": [list(g) for g in self.left_out]}


@dataclasses.dataclass(frozen=True)
class ConvertResult:
    dst: Path
    layout: str
    family: str
    tensors: int
    nbytes: int
    seconds: float
    tp: int = 1
    pp: int = 1
    note: str = ""  # the rule table's ``mcore_note`` when writing mcore
    source_use: SourceUse | None = None  # an HF source's: what was converted, what left out
    detection: families.Detection | None = None  # how the family was told, when not given
    requant: quant_mod.RequantError | None = None  # --requantize: what re-quantizing changed
    ep: int = 1
    from_base: tuple = ()  # HF keys written from --base, not from the checkpoint (not trained)
    copied: tuple = ()  # files copied from --base (tokenizer, processor, ...)
    iteration: int | str | None = None  # the mcore source's iteration
    part: str = ""  # the part written, by name ("" the whole)
    megatron_class: str = ""  # the Megatron class the mcore output is laid out for, where known
    from_base_bytes: int = 0  # of ``from_base``, as written


class Progress:
    """What the pipeline reports; the CLI draws it, the default ignores it."""

    def phase(self, description: str, tensors: int | None = None, nbytes: int | None = None,
              unit: str = "tensors") -> None:
        pass

    def advance(self, tensors: int = 0, nbytes: int = 0) -> None:
        pass


# The engine's record of a tensor's dtype and shape; ``Meta(...)`` makes one of its own,
# ``R.shared_meta`` the one object every tensor alike shares (what a per-tensor table should hold).
Meta = R.Meta
_meta_of = R.meta_of


# --------------------------------------------------------------------------------------------------
# small shared pieces


def _te_key(key: str) -> str | None:
    """The TE spelling of an mcore key (None for `_extra_state`, which carries no weights)."""
    spelled = list(R.to_te_spelling({key: None}))
    return spelled[0] if spelled else None


class _TensorFilter:
    """Cast and NaN/Inf check applied to every source tensor as it is read."""

    def __init__(self, dtype: torch.dtype | None, check_finite: bool):
        self.dtype, self.check_finite = dtype, check_finite

    def meta(self, meta: Meta) -> Meta:
        if self.dtype is not None and meta.dtype.is_floating_point:
            return R.shared_meta(self.dtype, meta.shape)
        return meta

    def __call__(self, name: str, t: torch.Tensor, where: str) -> torch.Tensor:
        # Cast first, then check: what is written is what is certified finite (1e6 is finite in
        # float32 and Inf in float16).
        out = t.to(self.dtype) if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype else t
        if self.check_finite and out.is_floating_point() and out.numel():
            finite = torch.isfinite(out)
            if not bool(finite.all()):
                bad = int(out.numel() - finite.sum())
                stored = bad if out is t else int(t.numel() - torch.isfinite(t).sum())
                if stored == bad:
                    raise ConvertError(f"{where}: tensor {name} holds {bad} NaN/Inf value(s) (--check-finite)")
                largest = float(t.detach().abs().nan_to_num(0.0, 0.0, 0.0).max())
                raise ConvertError(f"{where}: tensor {name}: {bad - stored} value(s) overflow to Inf in the cast to "
                                   f"{str(self.dtype).removeprefix('torch.')} (largest magnitude {largest:g}, beyond "
                                   f"its {torch.finfo(self.dtype).max:g}) (--check-finite); choose a wider --dtype")
        return out


def load_family_config(config_path: Path, family: str, where: Path, capacity: tuple[int, int] | None = None):
    """(family config, raw bytes of the HF config file). A source directory's config.json may be
    Mistral's params.json instead (translated, its HF config.json bytes returned). ``capacity``:
    the source's (tensors, elements) from an index it already read (``hf.checkpoint_capacity``
    otherwise reads the index again: seconds at a release's tensor count)."""
    if config_path.name == HF_CONFIG_FILE and not config_path.is_file():
        raise ConvertError(f"{where}: no {HF_CONFIG_FILE} (the HF config an mcore checkpoint needs "
                           "to be converted; mmparity convert keeps the source's config.json there)")
    try:
        full, raw = read_hf_config(where, config_path.name)
    except CheckpointError as exc:
        raise ConvertError(str(exc)) from None
    try:
        cfg = families.get(family).family_config(full)
    except ValueError as exc:
        raise ConvertError(f"{where}: {exc} (family {family!r})") from None
    bound_config(cfg, config_path if config_path.is_file() else where / "params.json", where, capacity)
    return cfg, raw


def _rule_set(family: str, cfg, hf_format: str | None, keys=None, where: str = "") -> R.RuleSet:
    try:
        return families.get(family).rule_set(cfg, hf_format, keys=keys)
    except R.ConversionError as exc:
        raise _from_conversion_error(exc, where) from None


def _part_root(rules: R.RuleSet, family: str, part: str) -> str:
    """The mcore root of ``--part part`` in a ``family`` table (its whole model's)."""
    roots = R.rule_roots(rules)
    if not roots:
        raise ConvertError(f"--part {part}: family {family!r} is one model, not a whole VLM of parts; "
                           "leave --part out")
    names = [R.part_name(r) for r in roots]
    if part not in names:
        raise ConvertError(f"--part {part}: family {family!r} has the parts {', '.join(names)}")
    return roots[names.index(part)]


def part_megatron_class(root: str, whole_roots: Sequence[str]) -> str:
    """The Megatron class an mcore checkpoint of a whole VLM's part (``root``; "" the whole) is laid
    out for, where one class is known to hold exactly that ("" otherwise: a tower's class is its
    family's)."""
    if not root:
        return "LLaVAModel" if "language_model." in whole_roots else ""
    return R.PART_CLASSES.get(root, "")


def _held_part(rules: R.RuleSet, stored: Iterable[str], recorded: str | None, where: Path) -> str:
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


def _kinds(rule_set: R.RuleSet) -> dict[str, str]:
    return {key: kind for step in R.iter_steps(rule_set) for key, kind in zip(step.mcore_keys, step.rule.tp)}


def _padded_tables(rule_set: R.RuleSet) -> dict[str, PadRows]:
    """The mcore keys of vocabulary tables padded past the HF vocabulary, with their padding."""
    return {key: step.rule.op for step in R.iter_steps(rule_set) if isinstance(step.rule.op, PadRows)
            for key in step.mcore_keys}


def _mcore_order(rule_set: R.RuleSet) -> list[str]:
    """The keys of the mcore state dict proper (what Megatron's class holds), in table order."""
    aside = set(R.side_keys(rule_set))
    return [key for step in R.iter_steps(rule_set) for key in step.mcore_keys if key not in aside]


def _side_tensors(source: "_Source", rule_set: R.RuleSet) -> tuple[dict[str, bytes], tuple, dict]:
    """(extra files, manifest records, manifest extra) for the side file of ``source``: nothing
    when the family keeps nothing aside."""
    files, records, extra = _quant_scales(source)
    keys = R.side_keys(rule_set)
    if not keys:
        return files, records, extra
    tensors = {key: joined(source.mcore_pieces(key)).contiguous().clone() for key in keys}
    records += tuple(TensorRecord(SIDE_FILE, key, tensor_checksum(t)) for key, t in tensors.items())
    return {SIDE_FILE: safetensors_save(tensors), **files}, records, {"side_file": SIDE_FILE, **extra}


def _quant_scales(source: "_Source") -> tuple[dict[str, bytes], tuple, dict]:
    """The scales of a quantized source, kept beside the mcore checkpoint (checksummed in its
    manifest) for ``--requantize``: nothing for an unquantized one."""
    scales = source.quant_scales()
    if not scales:
        return {}, (), {}
    name = quant_io.QUANT_SCALES_FILE
    records = tuple(TensorRecord(name, key, tensor_checksum(t)) for key, t in scales.items())
    return {name: safetensors_save(scales)}, records, {}


def _read_side_file(root: Path, manifest: Manifest | None, keys: Sequence[str],
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
        raise ConvertError(_problems_line(f"{path}: side file declares other tensors than its manifest and config "
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
        raise ConvertError(_problems_line(f"{path}: side file does not match its manifest", problems))
    return tensors


def _validate_tp(rule_set: R.RuleSet, tp: int) -> None:
    problems = list(rule_set.validate_tp(tp)) if rule_set.validate_tp else []
    if problems:
        raise ConvertError(_problems_line(f"--tp {tp} does not fit this model", problems))


# --------------------------------------------------------------------------------------------------
# sources


class _Source:
    """The full TP = 1 mcore tensors of one family, one key at a time."""

    layout: str
    path: Path
    family: str
    cfg: object
    config_bytes: bytes
    hf_format: str  # the HF layout the weights came from (and go back to by default)
    prefix: str  # the HF key prefix they came from
    metas: dict  # mcore key -> Meta, in plan order
    hf_sources: Mapping = MappingProxyType({})  # mcore key -> the HF keys it is made from
    use: SourceUse | None = None  # an HF source's
    detection: families.Detection | None = None  # an HF source's, when its family was not given
    # What the original HF -> mcore conversion left out (``SourceUse.to_json``), recorded in every
    # manifest down the line: a checkpoint made from part of a VLM says so.
    left_out_record: dict | None = None
    # A quantized source's record (``quantized.QuantRecord.to_json``), kept down the line like
    # ``left_out_record``: an mcore checkpoint of an FP8 release says it was dequantized.
    quant_record: dict | None = None
    # The mcore root of the part of a whole VLM this source gives, its keys without it
    # (``language_model.``); "" for the whole. ``rules`` is then that part's table.
    part: str = ""
    rules: R.RuleSet

    def quant_scales(self) -> dict[str, torch.Tensor]:
        """The source's quantization scales by HF key (empty: not a quantized source)."""
        return {}

    def mcore_tensor(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def mcore_pieces(self, key: str) -> list[torch.Tensor]:
        """The same tensor as consecutive dim-0 pieces, where a source can avoid joining them."""
        return [self.mcore_tensor(key)]

    def produce(self, key: str) -> tuple[list, list]:
        """(``mcore_pieces(key)``, the source tensors they were made from) for the engine's loop."""
        return self.mcore_pieces(key), []

    def locate(self, piece) -> tuple[int, int] | None:
        """(fd, offset) of the source file bytes a piece shows, if it is a view of them."""
        return None

    # How the source's vocabularies are padded (Megatron-LM's rule at this TP size).
    vocab_tp: int = 1
    vocab_multiple: int = R.VOCAB_MULTIPLE

    def provenance_extra(self) -> dict:
        extra = {"hf_prefix": self.prefix, "hf_format": self.hf_format,
                 "make_vocab_size_divisible_by": self.vocab_multiple}
        if self.left_out_record:
            extra["left_out"] = self.left_out_record
        if self.quant_record:
            extra["quantization"] = self.quant_record
        return extra


class _HFSource(_Source):
    layout = LAYOUT_HF

    def __init__(self, path: Path, family: str, hf_format: str | None, filt: _TensorFilter,
                 tp: int = 1, vocab_multiple: int = R.VOCAB_MULTIPLE, part: str | None = None):
        self.path, self.family, self._filter = path, family, filt
        self.vocab_tp, self.vocab_multiple = tp, vocab_multiple
        self.ckpt = SafetensorsCheckpoint(path)
        self.cfg, self.config_bytes = load_family_config(path / CONFIG_FILE, family, path,
                                                         safetensors_capacity(self.ckpt.infos()))
        scheme = quant_io.read_scheme(self.config_bytes, path / CONFIG_FILE)
        if scheme is not None:
            # The logical tensors, dequantized on read; planned, like any source, from headers.
            self.ckpt = quant_io.DequantizingCheckpoint(self.ckpt, scheme, filt.dtype)
            self.quant_record = self.ckpt.record().to_json()
        infos = self.ckpt.infos()
        self.rules = _rule_set(family, self.cfg, hf_format, keys=infos, where=f"{path}: ")
        self.hf_format = self.rules.hf_format
        if part is not None:
            self.part = _part_root(self.rules, family, part)
            self.rules = R.part_rules(self.rules, self.part)
        try:
            self.prefix = R.detect_prefix(self.rules, infos)
        except R.ConversionError as exc:
            raise _from_conversion_error(exc, f"{path}: family {family!r}: ") from None
        # The engine's plan, made from the file headers alone: the one totality check.
        metas = infos if filt.dtype is None else {name: filt.meta(_meta_of(info)) for name, info in infos.items()}
        try:
            # Planned for the target TP where it fits (vocabulary padding); a TP that does not fit
            # is reported, with every reason, by the writer's own check.
            fits = not (self.rules.validate_tp and self.rules.validate_tp(tp))
            self.plan = R.plan_hf_to_mcore(self.rules, metas, tp if fits else 1, self.prefix, vocab_multiple)
        except R.ConversionError as exc:
            raise ConvertError(_problems_line(f"{path}: not a complete {family!r} checkpoint "
                                              f"({self.hf_format!r} layout)", exc.problems)) from None
        # The plan's own tables, not copies: nothing changes an HF source's shapes after planning.
        self.metas = self.plan.outputs
        self.hf_sources = _PlanSources(self.plan)
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


class _PlanSources(Mapping):
    """mcore key -> the HF keys it is made from, read off a plan (no table of its own)."""

    def __init__(self, plan: R.Plan):
        self._plan = plan

    def __getitem__(self, key: str) -> tuple:
        return self._plan.source_keys(key)

    def __iter__(self):
        return iter(self._plan.outputs)

    def __len__(self) -> int:
        return len(self._plan.outputs)


def _manifest_family(manifest: Manifest | None, family: str | None, where: Path) -> str:
    recorded = manifest.provenance.family if manifest is not None else None
    if family is None and recorded is None:
        raise ConvertError(f"{where}: no {MANIFEST_FILE} naming the family; pass --family")
    if family is not None and recorded is not None and family != recorded:
        raise ConvertError(f"{where}: holds a {recorded!r} checkpoint, not {family!r} (from its {MANIFEST_FILE})")
    name = family or recorded
    try:
        families.get(name)  # unknown names raise, listing the valid ones
    except families.UnknownFamilyError as exc:
        raise ConvertError(f"{where / MANIFEST_FILE}: records {exc}; pass --family" if family is None else str(exc)) from None
    return name


def _manifest_of_iteration(manifest: Manifest | None, iteration) -> Manifest | None:
    """The root's manifest as it bears on ``iteration``: whole when it records that iteration (or
    none); else (Megatron-LM trained on and saved into the directory mmparity wrote) only what is
    beside the iterations (family, HF provenance, the side file), with no sizes or tensor records
    of the iteration it no longer describes."""
    if manifest is None or manifest.iteration is None or manifest.iteration == iteration:
        return manifest
    beside = tuple(r for r in manifest.tensors if "/" not in r.file and r.offset is None)
    return dataclasses.replace(manifest, tensors=beside, pipeline_layer_counts=None, iteration=None)


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


class _McoreSource(_Source):
    """Shared by the two mcore formats: family, config and HF provenance from the root."""

    # The divisor the manifest records (None: none recorded, Megatron-LM's default is assumed).
    recorded_divisor: int | None = None

    # Set when the config and side tensors come from --base / --hf-config (see ModelConfig).
    model_config: ModelConfig | None = None
    manifest_elsewhere = False  # the root's manifest records another iteration than the one read
    from_base: tuple = ()  # mcore side keys taken from the base
    iteration: int | str | None = None

    def _init_common(self, root: Path, manifest: Manifest | None, family: str | None,
                     filt: _TensorFilter, complete: bool = True, model_config: ModelConfig | None = None,
                     capacity: tuple[int, int] | None = None, stored: Iterable[str] = ()) -> None:
        """``complete=False`` (``verify --load``): tensors missing or foreign to the family are left
        for the strict load to name, and the side file (which Megatron's class never reads) is
        checked only where present; the shapes of the tensors present, the records of the manifest
        and the TP size are checked all the same. ``stored``: the model keys the checkpoint holds
        (a legacy checkpoint's first rank file's), which tell a part trained alone from the whole."""
        self.root, self.manifest, self._filter = root, manifest, filt
        self.complete = complete
        self.model_config = model_config
        if model_config is not None:
            recorded = manifest.provenance.family if manifest is not None else None
            if recorded is not None and recorded != model_config.family:
                raise ConvertError(f"{root}: holds a {recorded!r} checkpoint (its {MANIFEST_FILE}), but "
                                   f"{model_config.origin} describes a {model_config.family!r} model")
            self.family = model_config.family
            self.cfg, self.config_bytes = model_config.cfg, model_config.config_bytes
        else:
            if manifest is None and not (root / HF_CONFIG_FILE).is_file():
                raise ConvertError(f"{root}: no {MANIFEST_FILE} and no {HF_CONFIG_FILE}: a checkpoint Megatron-LM "
                                   "wrote needs the model it was converted from: --base HF_DIR (the HF release: "
                                   "config, tokenizer and the tensors Megatron keeps no place for) or "
                                   "--hf-config FILE (with --family)")
            self.family = _manifest_family(manifest, family, root)
            self.cfg, self.config_bytes = load_family_config(root / HF_CONFIG_FILE, self.family, root, capacity)
        extra = dict(manifest.provenance.extra or {}) if manifest is not None else {}
        if isinstance(extra.get("left_out"), dict):
            self.left_out_record = extra["left_out"]
        if isinstance(extra.get("quantization"), dict):
            self.quant_record = extra["quantization"]
        recorded = extra.get("hf_format") or (manifest.provenance.source_format if manifest else None)
        formats = families.get(self.family).converter.formats
        self.hf_format = recorded if recorded in formats else formats[0]
        self.prefix = str(extra.get("hf_prefix") or "")
        if model_config is not None and (manifest is None or model_config.base is not None):
            self.hf_format, self.prefix = model_config.hf_format, model_config.prefix
        multiple = extra.get("make_vocab_size_divisible_by")
        if isinstance(multiple, int) and not isinstance(multiple, bool) and multiple > 0:
            self.vocab_multiple = self.recorded_divisor = multiple
        self.rules = _rule_set(self.family, self.cfg, self.hf_format)
        recorded_part = extra.get("part") if isinstance(extra.get("part"), str) else None
        self.part = _held_part(self.rules, stored, recorded_part, root)
        if self.part:
            self.rules = R.part_rules(self.rules, self.part)
        self.kinds = _kinds(self.rules)
        self.order = _mcore_order(self.rules)
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
            self.side = (_read_side_file(root, manifest, side_keys,
                                         expected=_expected_mcore_shapes(self.family, self.cfg))
                         if complete or (root / SIDE_FILE).is_file() else {})
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
        for key, padding in _padded_tables(self.rules).items():
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
        return _read_side_file(self.root, self.manifest, keys or ["(none recorded)"], name)

    def _stored_pieces(self, key: str) -> list[torch.Tensor]:
        return [self._stored_tensor(key)]

    def _stored_tensor(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def _side_metas(self) -> dict:
        return {key: self._filter.meta(_meta_of(t)) for key, t in self.side.items()}

    def _side_tensor(self, key: str) -> torch.Tensor:
        return self._filter(key, self.side[key], self.root)

    def _check_recorded_parallelism(self, stored_tp: int | None, stored_pp: int | None,
                                    stored_ep: int | None = None) -> None:
        """The TP, PP and EP sizes and the layer split the manifest records, bounded by what is
        present before anything is built or spawned from them: a legacy checkpoint's must be its
        rank directories' (``stored_tp`` x ``stored_pp`` x ``stored_ep``); torch_dist's (global
        tensors) must fit the model as a ``--tp`` / ``--pp`` / ``--ep`` would; the layer counts must
        split the config's layers."""
        manifest = None if self.manifest_elsewhere else self.manifest
        if manifest is None:
            if stored_ep is not None and stored_ep > 1:
                self._check_ep(stored_ep, self.root)
            return
        where = self.root / MANIFEST_FILE
        tp, pp, counts = (manifest.tensor_parallel_size, manifest.pipeline_parallel_size,
                          manifest.pipeline_layer_counts)
        ep = manifest.expert_parallel_size
        if stored_tp is not None and (tp, pp, ep) != (stored_tp, stored_pp, stored_ep or 1):
            recorded = f"TP {tp} and PP {pp}" + (f" and EP {ep}" if ep > 1 or (stored_ep or 1) > 1 else "")
            held = f"{stored_tp} TP rank(s) x {stored_pp} pipeline stage(s)" + (
                f" x {stored_ep} EP rank(s)" if ep > 1 or (stored_ep or 1) > 1 else "")
            raise ConvertError(f"{where}: records {recorded}, but the checkpoint holds {held} of rank directories; "
                               "the manifest is not this checkpoint's (re-create it with mmparity convert)")
        self._check_ep(ep, where)
        problems = (list(self.rules.validate_tp(tp)) if stored_tp is None and self.rules.validate_tp and tp > 1
                    else [])
        if problems:  # (a legacy checkpoint's own TP is checked against the model when merged)
            raise ConvertError(_problems_line(f"{where}: the recorded TP {tp} does not fit this model", problems))
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
            raise _from_conversion_error(exc, f"{self.family!r}: ") from None

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
            raise ConvertError(_problems_line(f"{self.root}: not a complete {self.family!r} {what} checkpoint",
                                              problems))


class _LegacySource(_McoreSource):
    layout = LAYOUT_LEGACY

    def __init__(self, path: Path, family: str | None, filt: _TensorFilter, complete: bool = True,
                 model_config: ModelConfig | None = None, iteration: int | str | None = None):
        self.path = path
        ckpt = open_legacy(path, iteration=iteration)
        self.iteration = ckpt.iteration
        manifest = _manifest_of_iteration(ckpt.manifest, ckpt.iteration)
        if manifest is not ckpt.manifest:
            ckpt = dataclasses.replace(ckpt, manifest=manifest)
            self.manifest_elsewhere = True
        first = load_rank_payload(ckpt.files[min(ckpt.files)], mmap=True)
        chunks = model_chunk_keys(first)
        stored = [str(k) for chunk in chunks[:1] if isinstance(first[chunk], Mapping) for k in first[chunk]]
        self._init_common(ckpt.root, manifest, family, filt, complete, model_config, stored=stored)
        self._check_recorded_parallelism(ckpt.tp_size, ckpt.pp_size, ckpt.ep_size)
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
            stages = [ckpt.stage_state(tp_rank, stage, num_experts=self.num_experts or None, mmap=True,
                                       file_ranges=self.file_ranges, chunk=chunk)
                      for chunk in chunks for stage in range(ckpt.pp_size)]
            merged = (pp_mod.merge_pipeline_stages(stages, counts if len(chunks) == 1 else None,
                                                   layer_prefix=layer_prefix)
                      if len(stages) > 1 else stages[0])
            state = {k: v for k, v in R.to_te_spelling(merged).items() if isinstance(v, torch.Tensor)}
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
            raise ConvertError(_problems_line(f"{self.root}: cannot merge the TP={self.tp} legacy checkpoint", problems))
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


def torch_dist_index(files: TorchDistFiles, order: Sequence[str]) -> dict[str, tuple]:
    """Where each mcore tensor of a torch_dist checkpoint is: TE-spelled, globally numbered local
    key -> (checkpoint key, its position along the stacked axes (layer, expert, or both) or None,
    Meta of the tensor there). Only the positions the saved chunks cover: a stack of MoE layers
    among dense ones holds those layers alone. Expert tensors are named in the layout ``order``
    (the rule table's keys) spells them in. Spelled all at once, so that a layer's own keys say
    whether its norms are fused (``rules.to_te_spelling``)."""
    raw: dict[str, tuple] = {}
    expert_layout = ep_mod.expert_key_layout(order) or ep_mod.GROUPED
    for ckpt_key, (dtype, shape) in files.tensors.items():
        if _NOT_MODEL_KEYS.match(ckpt_key):
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
    return {key: raw[name] for key, name in R.to_te_spelling({name: name for name in raw}).items()}


class _TorchDistSource(_McoreSource):
    layout = LAYOUT_TORCH_DIST

    def __init__(self, path: Path, family: str | None, filt: _TensorFilter, complete: bool = True,
                 model_config: ModelConfig | None = None, iteration: int | str | None = None):
        self.path = path
        root, iteration_dir, self.iteration = resolve_iteration_dir(path, iteration)
        manifest = read_manifest(root) if (root / MANIFEST_FILE).is_file() else None
        recorded = manifest
        manifest = _manifest_of_iteration(manifest, self.iteration)
        self.manifest_elsewhere = manifest is not recorded
        read_common(iteration_dir)  # its checkpoint_version says whether this layout is the one read here
        self.files = TorchDistFiles(iteration_dir)
        self._init_common(root, manifest, family, filt, complete, model_config,
                          torch_dist_capacity(self.files.metadata),
                          stored=[k for k in self.files.tensors if not _NOT_MODEL_KEYS.match(k)])
        self._check_recorded_parallelism(None, None)
        self.index = torch_dist_index(self.files, self.order)
        self._check_keys(self.index, "torch_dist")
        check_source_dtypes(iteration_dir, {ckpt_key: meta.dtype for ckpt_key, _, meta in self.index.values()})
        self.metas = {key: filt.meta(self.index[key][2]) for key in self.order if key in self.index} | self._side_metas()

    def _stored_pieces(self, key: str) -> list[torch.Tensor]:
        if key not in self.side:
            ckpt_key, position, meta = self.index[key]
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
        if position is None:
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


class _PartView:
    """A whole VLM's mcore source seen as one of its parts (``root``, e.g. ``language_model.``): its
    keys under the root, without it, and that part's table; everything else is the source's."""

    def __init__(self, inner: _Source, root: str):
        self._inner, self.part = inner, root
        self.rules = R.part_rules(inner.rules, root)
        self.metas = {key[len(root):]: meta for key, meta in inner.metas.items() if key.startswith(root)}
        self.kinds = _kinds(self.rules)
        self.order = _mcore_order(self.rules)
        # What it leaves of the whole, by part, as an HF source's plan says it.
        self.use = SourceUse.split([k for k in inner.metas if k.startswith(root)],
                                   [k for k in inner.metas if not k.startswith(root)],
                                   {key: meta.nbytes for key, meta in inner.metas.items()})

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def mcore_pieces(self, key: str) -> list[torch.Tensor]:
        return self._inner.mcore_pieces(self.part + key)

    def produce(self, key: str) -> tuple[list, list]:
        return self._inner.produce(self.part + key)

    def provenance_extra(self) -> dict:
        return {**self._inner.provenance_extra(), "left_out": self.use.to_json()}


class _WithBase:
    """An mcore checkpoint of one part of a whole VLM (a language model Megatron-LM trained as
    ``GPTModel``) made whole again for HF output: its part under its root, every other tensor from
    the base release (``--base``), which the trained model never held; ``from_base`` names those."""

    def __init__(self, inner: _Source, base: _Source):
        self._inner, self._base, root = inner, base, inner.part
        self.part = ""
        self.rules = _rule_set(inner.family, inner.cfg, inner.hf_format)
        self.metas = {**{key: meta for key, meta in base.metas.items() if not key.startswith(root)},
                      **{root + key: meta for key, meta in inner.metas.items()}}
        self.from_base = tuple(key for key in self.metas if not key.startswith(root)) + tuple(
            root + key for key in getattr(inner, "from_base", ()))

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def mcore_pieces(self, key: str) -> list[torch.Tensor]:
        root = self._inner.part
        if key.startswith(root):
            return self._inner.mcore_pieces(key[len(root):])
        return self._base.mcore_pieces(key)

    def produce(self, key: str) -> tuple[list, list]:
        return self.mcore_pieces(key), []

    def locate(self, piece) -> tuple[int, int] | None:
        return self._inner.locate(piece) or self._base.locate(piece)


def _held_alone(source: _Source) -> str:
    """How a message names what an mcore checkpoint of one part holds."""
    name = R.part_name(source.part)
    megatron_class = R.PART_CLASSES.get(source.part)
    return f"the {name} alone" + (f" (laid out for Megatron's {megatron_class})" if megatron_class else "")


def _as_target_part(source: _Source, options: ConvertOptions):
    """``source`` as the conversion in ``options`` writes it: a whole VLM's mcore checkpoint seen as
    the part ``--part`` asks for; one part made whole again from ``--base`` for HF output."""
    if not isinstance(source, _McoreSource):
        return source
    if options.to == "hf" and source.part:
        base = source.model_config.base_source if source.model_config is not None else None
        if base is None:
            raise ConvertError(f"{source.root}: holds {_held_alone(source)}; an HF release is the whole model: pass "
                               "--base HF_DIR (the release it was converted from) for the other parts, which it "
                               "never held")
        return _WithBase(source, base)
    if options.to == "mcore" and options.part is not None and R.part_name(source.part or "whole.") != options.part:
        if source.part:
            raise ConvertError(f"{source.root}: holds {_held_alone(source)}, not --part {options.part}")
        return _PartView(source, _part_root(source.rules, source.family, options.part))
    return source


def _source_kind(path: Path, iteration: int | str | None = None) -> ckpt_formats.Format:
    """The format of a source directory (see :mod:`mmparity.checkpoint.formats`)."""
    if not path.exists():
        raise ConvertError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise ConvertError(f"{path}: not a directory (expected an HF save_pretrained directory or an mcore checkpoint)")
    found = ckpt_formats.detect_directory(path)
    if found is not None:
        return found
    try:
        _, iteration_dir, _ = resolve_iteration_dir(path, iteration)
    except CheckpointError as exc:
        if (path / TRACKER_FILE).exists() or path.name.startswith("iter_"):
            raise ConvertError(str(exc)) from None
        whats = [f.what for f in ckpt_formats.formats(ckpt_formats.HF)] + [f"an mcore checkpoint ({TRACKER_FILE})"]
        raise ConvertError(f"{path}: {ckpt_formats.neither(whats)}") from None
    found = ckpt_formats.detect_iteration(iteration_dir)
    if found is not None:
        return found
    raise ConvertError(f"{iteration_dir}: "
                       f"{ckpt_formats.neither([f.what for f in ckpt_formats.formats(ckpt_formats.MCORE)])}")


def open_source(path, family: str | None = None, hf_format: str | None = None, *,
                dtype: torch.dtype | None = None, check_finite: bool = False, tp: int = 1,
                vocab_multiple: int = R.VOCAB_MULTIPLE, complete: bool = True,
                model_config: ModelConfig | None = None, iteration: int | str | None = None,
                part: str | None = None) -> _Source:
    """Opens and fully validates a source checkpoint (HF, legacy or torch_dist); reads no weights.
    An HF source is planned for ``tp`` ranks with vocabularies padded to ``vocab_multiple × tp``,
    and for one ``part`` of a whole VLM where asked (the rest left out). ``complete=False`` opens an
    mcore checkpoint that may lack tensors or hold foreign ones (see
    ``_McoreSource._init_common``); which part an mcore checkpoint holds is read off it."""
    path = Path(path)
    return _source_kind(path, iteration).open_source(path, family, hf_format, _TensorFilter(dtype, check_finite), tp,
                                                     vocab_multiple, complete, model_config=model_config,
                                                     iteration=iteration, part=part)


# --------------------------------------------------------------------------------------------------
# shape check against the config


def _expected_mcore_shapes(family: str, cfg, tp: int = 1, vocab_multiple: int = R.VOCAB_MULTIPLE,
                           part: str = "") -> dict | None:
    """mcore shapes the HF config implies: the reference model's state-dict shapes (read off the
    config, so no model is imported) as meta tensors, converted.

    The rule engine only sees shapes an op needs (q/k/v, gate/up); a renamed tensor of the wrong
    size (a norm, a position table) would otherwise pass. None when the config's shapes do not
    convert (then the op checks are all there is).
    """
    try:
        # Shape records, not meta tensors: a whole model's worth made while the source's plan is
        # held, at the conversion's planning peak.
        dtype = torch.get_default_dtype()
        state = {key: R.shared_meta(dtype, shape) for key, shape in families.get(family).state_shapes(cfg).items()}
        rules = families.get(family).rule_set(cfg, None)
        outputs = R.plan_hf_to_mcore(rules, state, tp, prefix="", vocab_multiple=vocab_multiple).outputs
    except Exception:
        return None
    # A part's keys are the whole model's under its root, without it.
    return {key[len(part):]: t.shape for key, t in outputs.items() if key.startswith(part)}


def _check_recorded_divisor(source: _Source) -> None:
    """The vocabulary divisor an mcore checkpoint's manifest records must be the one its stored
    tables were padded with: each padded table (at least the real vocabulary; a shorter one is a
    shape mismatch) holds exactly the rows the divisor implies at the TP size it was stored for
    (legacy: its own; torch_dist: global tensors, padded as for TP 1, or for the TP it records).
    So the padding stays below divisor x TP rows of what is present, and nothing sized by the
    divisor (a re-padded table, Megatron's class) can outgrow the checkpoint."""
    divisor = getattr(source, "recorded_divisor", None)
    if divisor is None:
        return
    if ckpt_formats.by_layout(source.layout).stores_grid:
        tps = {source.tp}
    else:
        tps = {1, source.manifest.tensor_parallel_size if source.manifest is not None else 1}
    for key, padding in _padded_tables(source.rules).items():
        meta = source.metas.get(key)
        if meta is None or not meta.shape or meta.shape[0] < padding.rows:
            continue  # absent (the key check names it) or too short (the shape check does)
        implied = {tp: padding.at_tp(tp, divisor).padded for tp in sorted(tps)}
        if meta.shape[0] not in implied.values():
            tp, rows = min(implied.items())
            raise ConvertError(f"{source.root / MANIFEST_FILE}: the recorded vocabulary divisor {divisor} is not "
                               f"plausible: it pads {padding.rows} rows to {rows}"
                               f"{f' at TP {tp}' if tp > 1 else ''} (stored: {meta.shape[0]}) in {key}; "
                               "its make_vocab_size_divisible_by is not the one this checkpoint was padded "
                               "with (re-create it with mmparity convert)")


def _check_shapes(source: _Source, label: str | None = None) -> None:
    """Every tensor of ``source`` against the shapes its HF config implies (and an mcore source's
    recorded vocabulary divisor against its tables), before any tensor is read or anything is
    built from the config: ``convert``, ``check --mcore`` and ``verify --load`` all call this, on
    the source as stored (an mcore source before ``repad_vocab``). ``label`` names the source in
    the message (``--base DIR``); an HF source's tensors are named with their files."""
    _check_recorded_divisor(source)
    expected = _expected_mcore_shapes(source.family, source.cfg, source.vocab_tp, source.vocab_multiple,
                                      source.part)
    if expected is None:
        return
    kinds = _kinds(source.rules)
    real_rows = {key: padding.rows for key, padding in _padded_tables(source.rules).items()}
    problems = []
    for key, meta in source.metas.items():
        want = expected.get(key)
        if (want is not None and ckpt_formats.by_layout(source.layout).kind == ckpt_formats.MCORE
                and kinds.get(key) == "vocab"
                and tuple(meta.shape[1:]) == want[1:] and meta.shape[0] >= real_rows.get(key, want[0])):
            # Padded for another TP size or divisor (a smaller one than assumed too: Megatron-LM's
            # --make-vocab-size-divisible-by 64): export trims it all the same.
            continue
        if want is not None and tuple(meta.shape) != want:
            origin = source.hf_sources.get(key)
            named = f"{', '.join(origin)} -> {key}" if origin else key
            problems.append((origin, f"{named} is {list(meta.shape)}, the config implies {list(want)}"))
    if problems:
        infos = source.ckpt.infos() if isinstance(source, _HFSource) else {}
        lines = [f"{', '.join(sorted({infos[k].file for k in origin if k in infos}))}: {line}"
                 if origin and any(k in infos for k in origin) else line for origin, line in problems]
        raise ConvertError(_problems_line(f"{label or source.path}: shape mismatch with its HF config", lines))


# --------------------------------------------------------------------------------------------------
# HF output: safetensors shards streamed into place


# --------------------------------------------------------------------------------------------------
# targets


MISTRAL_LAYOUT, HF_SAVE_LAYOUT = "mistral", "hf_checkpoint"


def _hf_target_format(source: _Source, requested: str | None) -> str:
    formats = families.get(source.family).converter.formats
    fmt = requested or source.hf_format
    if requested is None and fmt == MISTRAL_LAYOUT and HF_SAVE_LAYOUT in formats:
        # A whole model read from Mistral's own release goes out as transformers saves it, with
        # the config.json it was translated to: what a user exporting "to HF" can load. Mistral's
        # names stay one --hf-format away (beside a config.json, not a params.json).
        fmt = HF_SAVE_LAYOUT
    if fmt not in formats:
        raise ConvertError(f"--hf-format {fmt!r} is not a layout of family {source.family!r}; "
                           f"it knows {', '.join(formats)}")
    return fmt


def _write_hf(source: _Source, options: ConvertOptions, progress: Progress) -> tuple[int, int, object]:
    fmt = _hf_target_format(source, options.hf_format)
    rules = _rule_set(source.family, source.cfg, fmt)
    prefix = source.prefix if source.prefix in rules.hf_prefixes else ""
    try:
        plan = R.plan_mcore_to_hf(rules, source.metas, prefix)
    except R.ConversionError as exc:
        raise ConvertError(_problems_line(f"cannot lay out {source.family!r} as HF {fmt!r}", exc.problems)) from None
    entries = [(key, t.dtype, t.shape) for key, t in plan.outputs.items()]
    requant = _requant_plan(source, options, entries)
    if requant is not None:
        entries = requant.entries
    total = sum(Meta(d, s).nbytes for _, d, s in entries)
    progress.phase(f"{source.family} -> hf", len(entries), total)
    provenance = Provenance(family=source.family, source_layout=source.layout, source_format=fmt,
                            source_path=str(source.path), extra=source.provenance_extra() | {"hf_format": fmt, "hf_prefix": prefix})
    heap = heap_budget()
    heap.begin_stream()
    team = options.team or team_mod.solo()
    with team.staging(options.dst, force=options.force) as staging:
        writer = StreamingSafetensorsWriter(staging, entries, max_shard_size=options.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
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
        # One process keeps its checksums as they are (see _write_legacy).
        gathered = [] if team.solo else team.gather("written", [[writer.weight_map[n], n, c.to_json()]
                                                                for n, c in writer.checksums.items()])
        if requant is not None:
            errors_of = team.gather("requantized", requant.error.to_json())
            if errors_of is not None:
                requant.error = quant_mod.RequantError.merged(errors_of)
        if not team.leader:
            return len(entries), total, None
        if requant is not None:
            config = quant_io.config_with_quantization(source.config_bytes, requant.scheme)
            provenance = dataclasses.replace(provenance, extra={**provenance.extra,
                                                                "requantized": requant.error.to_json()})
        else:
            config = quant_io.config_without_quantization(source.config_bytes)
        (staging / CONFIG_FILE).write_bytes(config)
        model_config = getattr(source, "model_config", None)
        if model_config is not None and model_config.base is not None:
            source.copied = tuple(copy_base_files(model_config.base, staging))
        from_base = set(getattr(source, "from_base", ()))
        if from_base:
            # The HF tensors made only of side tensors the base gave: Megatron never held them.
            source.from_base_hf = tuple(sorted(k for k in plan.outputs if set(plan.source_keys(k)) <= from_base))
            source.from_base_bytes = sum(plan.outputs[k].nbytes for k in source.from_base_hf)
            provenance = dataclasses.replace(provenance, extra={**provenance.extra, "from_base": {
                "base": str(model_config.base), "note": FROM_BASE, "tensors": list(source.from_base_hf)}})
        write_manifest(staging, Manifest(
            layout=LAYOUT_HF,
            tensors=(*(TensorRecord(writer.weight_map[n], n, c) for n, c in writer.checksums.items()),
                     *(TensorRecord(file, name, TensorChecksum.from_json(c))
                       for rank_records in gathered[1:] for file, name, c in rank_records)),
            provenance=provenance))
    return len(entries), total, (requant.error if requant is not None else None)


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
        # source's (quantize inverts dequantize, tests/test_quant.py); otherwise they changed.
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


def _requant_plan(source: _Source, options: ConvertOptions, entries: list) -> _Requant | None:
    if not options.requantize:
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
        raise ConvertError(_problems_line(f"--requantize: the recorded scales do not fit the HF output "
                                          f"(--hf-format {options.hf_format or source.hf_format!r})", problems))
    return _Requant(record.scheme, scales, entries)


def _mcore_provenance(source: _Source, options: ConvertOptions, **extra) -> Provenance:
    held = {"part": R.part_name(source.part)} if source.part else {}
    megatron_class = _megatron_class_of(source)
    if megatron_class:
        held["megatron_class"] = megatron_class
    return Provenance(
        family=source.family, source_layout=source.layout, source_format=source.hf_format,
        source_path=str(Path(source.path).absolute()),
        extra={**source.provenance_extra(), "hf_config": HF_CONFIG_FILE,
               "dtype": options.dtype, **held, **extra})


def _megatron_class_of(source: _Source) -> str:
    """The Megatron class the mcore output of ``source`` is laid out for ("" where no one class is
    known to hold it: a tower's class is its family's)."""
    whole = _rule_set(source.family, source.cfg, source.hf_format) if source.part else source.rules
    return part_megatron_class(source.part, R.rule_roots(whole))


def _mcore_plan(source: _Source, grid: Grid) -> tuple[list[str], dict[str, str]]:
    """(the mcore keys to write, in order, their TP kinds), checked for the ``grid`` (``--tp``,
    ``--pp``, ``--ep``); side keys are not among them (see :func:`_side_tensors`)."""
    rules = source.rules
    tp = grid.tp.size
    _validate_tp(rules, tp)
    order, kinds = _mcore_order(rules), _kinds(rules)
    try:
        num_experts = ep_mod.expert_count(order)
    except R.ConversionError as exc:
        raise _from_conversion_error(exc, f"{source.family!r}: ") from None
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
        raise ConvertError(_problems_line(f"cannot shard {source.family!r} for --tp {tp}", problems))
    return order, kinds


def _write_legacy(source: _Source, options: ConvertOptions, progress: Progress) -> tuple[int, int]:
    grid = options.grid
    order, kinds = _mcore_plan(source, grid)
    tp = grid.tp.size
    layout = pp_mod.pipeline_layout(order)
    counts = layout.layer_counts(grid.pp)
    num_experts = ep_mod.expert_count(order)
    if options.expert_layout not in ep_mod.LAYOUTS:
        raise ConvertError(f"--expert-layout must be one of {', '.join(ep_mod.LAYOUTS)}, got {options.expert_layout!r}")
    spelled = ({k: k for k in order} if not num_experts or options.expert_layout == ep_mod.GROUPED
               else {k: (p.spell(options.expert_layout) if (p := ep_mod.parse_expert_key(k)) else k) for k in order})
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
    # Megatron's own legacy save writes the TE modules' (empty) extra states; its class demands
    # them back under strict=True.
    for key in extra_state.extra_state_keys({spelled[k]: kinds[k] for k in order}):
        for rank in range(tp):
            entries[rank][key] = None
    progress.phase(f"{source.family} -> legacy tp{tp} pp{grid.pp.size}"
                   + (f" ep{grid.ep.size}" if grid.ep.size > 1 else ""), len(order), total)
    side_files, side_records, side_extra = _side_tensors(source, source.rules)
    heap = heap_budget()
    heap.begin_stream()
    iteration = RELEASE if options.release else 1
    args = megatron_args.checkpoint_args(source.cfg, {k: source.metas[k].shape for k in order}, ckpt_format="torch",
                                         tp=options.tp, pp=options.pp, ep=options.ep,
                                         vocab_multiple=source.vocab_multiple)
    team = options.team or team_mod.solo()
    try:
        with team.staging(options.dst, force=options.force, inner=iteration_dirname(iteration)) as staging:
            writer = LegacyWriter(staging, entries, pp_size=options.pp, layer_counts=counts,
                                  layer_prefix=layout.layer_prefix, last_stage_prefixes=layout.last_stage_keys,
                                  iteration=iteration, locate=source.locate, ep_size=options.ep, num_experts=num_experts,
                                  common={megatron_args.ARGS_KEY: args}, writes=team.mine)
            def put(key: str, kind: str, pieces: list, inputs: list) -> None:
                shape = tuple(source.metas[key].shape)
                for rank in range(tp):
                    if not writer.holds(rank, spelled[key]):
                        continue  # another process's rank file
                    # tp.shard_slices names the rows / columns each rank holds (two row ranges
                    # for gated [gate_r; up_r]); their views go to the file as consecutive pieces.
                    ranges = tp_mod.shard_slices(shape, kind, tp, rank) if tp > 1 else []
                    writer.write(rank, spelled[key], [view for dim, start, stop in ranges
                                             for view in narrow_pieces(pieces, dim, start, stop)] or pieces)
                progress.advance(1, source.metas[key].nbytes)
                heap.check(source.metas[key].nbytes)

            mine = [k for k in order if any(writer.holds(rank, spelled[k]) for rank in range(tp))]
            try:
                R.stream_to_mcore(mine, kinds, source.produce, put)
                written = writer.close()
            finally:
                writer.abort()
            # One process keeps its records as they are (their JSON form is only for the wire: a
            # second copy of every record at the conversion's peak).
            gathered = [] if team.solo else team.gather("written", [r.to_json() for r in written])
            if not team.leader:
                return len(order), total
            records = [*written, *(TensorRecord.from_json(r) for part in gathered[1:] for r in part), *side_records]
            finish_legacy(staging, records, tp_size=options.tp, pp_size=options.pp, layer_counts=counts,
                          iteration=iteration, ep_size=options.ep, extra_files={HF_CONFIG_FILE: source.config_bytes, **side_files},
                          provenance=_mcore_provenance(source, options, pipeline_layer_prefix=layout.layer_prefix,
                                                       **side_extra))
    except CheckpointError as exc:
        raise ConvertError(str(exc)) from None
    return len(order), total


def _write_torch_dist(source: _Source, options: ConvertOptions, progress: Progress) -> tuple[int, int]:
    """The rule table's tensors placed as Megatron's classes shard them (``torch_dist_layout``)
    and written as megatron-core's ``dist_checkpointing`` writes them (``torch_dist_write``):
    no megatron and no model needed."""
    order, kinds = _mcore_plan(source, options.grid)
    # torch_dist stores global tensors: the TP/PP/EP sizes only had to fit (checked above).
    pp_mod.pipeline_layout(order).layer_counts(options.grid.pp)
    total = sum(source.metas[k].nbytes for k in order)
    side_files, side_records, side_extra = _side_tensors(source, source.rules)
    try:
        layout = torch_dist_layout.plan(
            order, kinds, {k: source.metas[k].shape for k in order}, {k: source.metas[k].dtype for k in order},
            extra_state.sharded_extra_state_keys({k: kinds[k] for k in order}))
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

    args = megatron_args.checkpoint_args(source.cfg, {k: source.metas[k].shape for k in order},
                                         ckpt_format="torch_dist", tp=options.tp, pp=options.pp, ep=options.ep,
                                         vocab_multiple=source.vocab_multiple)
    try:
        torch_dist_write.write_torch_dist(
            options.dst, layout, produce, iteration=RELEASE if options.release else 1,
            common={megatron_args.ARGS_KEY: args}, content_metadata=megatron_args.content_metadata(),
            provenance=_mcore_provenance(source, options, **side_extra), extra_records=side_records,
            extra_files={HF_CONFIG_FILE: source.config_bytes, **side_files}, force=options.force,
            locate=source.locate, max_file_size=options.max_shard_size or torch_dist_write.DEFAULT_FILE_SIZE,
            team=options.team, node_local=options.node_local)
    except CheckpointError as exc:
        raise ConvertError(str(exc)) from None
    return len(order), total


# --------------------------------------------------------------------------------------------------
# the entry point


def _check_options(options: ConvertOptions) -> torch.dtype | None:
    if options.to not in TARGETS:
        raise ConvertError(f"--to must be one of {', '.join(TARGETS)}, got {options.to!r}")
    if options.format not in ckpt_formats.writable():
        raise ConvertError(f"--format must be one of {', '.join(ckpt_formats.writable())}, got {options.format!r}")
    for name in ("tp", "pp", "ep", "make_vocab_size_divisible_by"):
        value = getattr(options, name)
        if value is None and name == "make_vocab_size_divisible_by":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConvertError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    if options.to == "hf" and (options.tp != 1 or options.pp != 1 or options.ep != 1):
        raise ConvertError("--tp/--pp/--ep shard mcore output; HF output is never sharded by TP/PP/EP")
    try:
        if options.max_shard_size is not None:
            parse_size(options.max_shard_size)
    except CheckpointError as exc:
        raise ConvertError(f"--max-shard-size: {exc}") from None
    if options.family is not None:
        families.get(options.family)
    if options.dtype is None:
        return None
    if options.dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {', '.join(DTYPES)}, got {options.dtype!r}")
    return DTYPES[options.dtype]


def _check_vocab_divisor(source: _Source, tp: int, multiple: int | None) -> None:
    """``--make-vocab-size-divisible-by``, before a padded table is made: the padding it implies
    for each of the source's vocabularies stays within what Megatron-LM could ask for."""
    if multiple is None:
        return
    for key, padding in _padded_tables(source.rules).items():
        target = padding.at_tp(tp, multiple)
        if target.excessive:
            raise ConvertError(f"--make-vocab-size-divisible-by {multiple}: pads {key} from {target.rows} to "
                               f"{target.padded} rows at TP {tp}, past twice its rows plus {MAX_EXTRA_PAD_ROWS}; "
                               "Megatron-LM pads to a multiple of its divisor (default 128) x TP: give the one "
                               "the model is trained with")


def _check_paths(src: Path, dst: Path, force: bool,
                 inputs: Mapping[str, Path | None] = MappingProxyType({})) -> None:
    """Refuses a destination that overlaps anything the conversion reads: the source, and the other
    ``inputs`` (flag -> path: ``--base``'s directory, ``--hf-config``'s file), symlinks resolved.
    Publishing replaces the destination whole, so a destination inside an input, or holding one,
    would destroy what the user converts from."""
    b = dst.resolve()
    a = checkpoint_extent(src)
    if a == b or a in b.parents or b in a.parents:
        raise ConvertError(f"destination {dst} overlaps the source {src} (which is read from {a}); "
                           "choose a separate directory")
    for flag, path in inputs.items():
        a = Path(path).resolve() if path is not None else None
        if a is not None and (a == b or b in a.parents or (a.is_dir() and a in b.parents)):
            raise ConvertError(f"--dst {dst} overlaps {flag} {path} (read from {a}), which a conversion never "
                               "replaces; choose a --dst outside it")
    recover_destination(dst)  # a killed earlier run may have left the old destination aside
    if os.path.lexists(dst) and not force:
        raise ConvertError(f"{dst}: already exists; pass --force to replace it")


def convert(options: ConvertOptions, progress: Progress | None = None) -> ConvertResult:
    """Converts `options.src` into `options.dst`; raises `ConvertError` (one line) on any problem."""
    # What is alive when a conversion starts (the imports of torch, transformers and megatron: about
    # a million objects) outlives it, yet a full collection mid-conversion walks all of it while the
    # producer waits: 57-178 ms of a 1.2-1.5 s conversion of the 0.89 GB tower, one such
    # collection per run. Frozen for the conversion (gen 0/1 still collect what it makes), and
    # handed back to the collector after it, so that nothing a caller holds is kept from it.
    gc.freeze()
    try:
        return _convert(options, progress)
    finally:
        gc.unfreeze()


def _convert(options: ConvertOptions, progress: Progress | None) -> ConvertResult:
    progress = progress or Progress()
    started = time.perf_counter()
    try:
        dtype = _check_options(options)
        src, dst = Path(options.src), Path(options.dst)
        if not src.exists():
            raise ConvertError(f"{src}: no such file or directory")
        _check_paths(src, dst, options.force, {"--base": options.base, "--hf-config": options.hf_config})
        target = ckpt_formats.target(options.to, options.format)
        # --hf-format names the HF side: the source's layout when converting from HF to mcore, the
        # output's when writing HF (the source's is then detected, or recorded in its manifest).
        source_format = (options.hf_format if target.kind == ckpt_formats.MCORE
                         and _source_kind(src).kind == ckpt_formats.HF else None)
        # Rank files (legacy) hold Megatron-LM's per-TP padding; global tensors (torch_dist) TP 1's.
        vocab_tp = options.tp if target.kind == ckpt_formats.MCORE and target.stores_grid else 1
        model_config = model_config_for(src, options.family, options.base, options.hf_config, options.iteration)
        source = open_source(src, options.family, source_format, dtype=dtype, check_finite=options.check_finite,
                             tp=vocab_tp, vocab_multiple=options.make_vocab_size_divisible_by or R.VOCAB_MULTIPLE,
                             model_config=model_config, iteration=options.iteration, part=options.part)
        _check_vocab_divisor(source, vocab_tp, options.make_vocab_size_divisible_by)
        _check_shapes(source)  # as stored, before the tables are re-padded from what it records
        if isinstance(source, _McoreSource) and options.to == "mcore":
            # Resharding: the tables are padded for the target, as Megatron-LM would pad them.
            source.repad_vocab(vocab_tp, options.make_vocab_size_divisible_by or source.vocab_multiple)
        if options.requantize and options.to != "hf":
            raise ConvertError("--requantize re-quantizes HF output; it does not apply to --to mcore")
        source = _as_target_part(source, options)
        written = target.write(source, options, progress)
    except (CheckpointError, PipelineError, UnknownFamilyError) as exc:
        raise ConvertError(str(exc)) from None
    except R.ConversionError as exc:
        raise _from_conversion_error(exc) from None
    tp, pp, ep = written.grid.sizes
    mcore = options.to == "mcore"
    return ConvertResult(dst, target.layout, source.family, written.tensors, written.nbytes,
                         time.perf_counter() - started, tp, pp,
                         source.rules.mcore_note if mcore else "", source.use, source.detection,
                         written.requant, ep, getattr(source, "from_base_hf", ()), getattr(source, "copied", ()),
                         getattr(source, "iteration", None), R.part_name(source.part) if mcore and source.part else "",
                         _megatron_class_of(source) if mcore else "", getattr(source, "from_base_bytes", 0))


def model_config_for(src: Path, family: str | None, base: Path | None, hf_config: Path | None,
                     iteration: int | str | None = None) -> ModelConfig | None:
    """The model of an mcore checkpoint at ``src`` as ``--base HF_DIR`` or ``--hf-config FILE``
    describe it (None: neither given, the checkpoint's own files describe it). The family is the
    one given, else the checkpoint's manifest's, else told from the base's (the file's) config."""
    if base is None and hf_config is None:
        return None
    if base is not None and hf_config is not None:
        raise ConvertError("--base and --hf-config both describe the model; pass one (--base also gives "
                           "the tensors Megatron has no place for)")
    if _source_kind(src, iteration).kind == ckpt_formats.HF:
        raise ConvertError(f"{src}: an HF source has its own config; --base / --hf-config describe an mcore "
                           "checkpoint that lacks one")
    root = resolve_iteration_dir(src, iteration)[0]
    if family is None and (root / MANIFEST_FILE).is_file():
        family = read_manifest(root).provenance.family
    if base is not None:
        base = Path(base)
        if not base.is_dir() or not has_hf_weights(base):
            raise ConvertError(f"--base {base}: not an HF save_pretrained directory (config.json and safetensors "
                               "weights: the release the checkpoint was converted from)")
        if family is None:
            try:
                family = detect_family(base).family
            except families.DetectError as exc:
                raise ConvertError(f"--base {base}: {exc}") from None
        families.get(family)
        try:
            hf = _HFSource(base, family, None, _TensorFilter(None, False))
        except ConvertError as exc:
            raise ConvertError(f"--base {exc}") from None
        # The base's own tensors against its config before any is taken: a mis-shaped one is the
        # base's fault, not the checkpoint's it would be copied beside.
        _check_shapes(hf, f"--base {base}")

        def side(keys: Sequence[str]) -> dict[str, torch.Tensor]:
            return {key: joined(hf.mcore_pieces(key)).contiguous() for key in keys}

        return ModelConfig(family, hf.cfg, hf.config_bytes, hf.hf_format, hf.prefix, f"--base {base}", base, side,
                           hf.hf_sources, hf)
    path = Path(hf_config)
    if not path.is_file():
        raise ConvertError(f"--hf-config {path}: no such file (an HF config.json of the model)")
    if family is None:
        if path.name != CONFIG_FILE:
            raise ConvertError(f"--hf-config {path}: pass --family too (the family is told only from a file "
                               f"named {CONFIG_FILE})")
        try:
            family = detect_family(path.parent).family
        except families.DetectError as exc:
            raise ConvertError(f"--hf-config {path}: {exc}") from None
    families.get(family)
    try:
        full, raw = read_hf_config(path.parent, path.name)
        cfg = families.get(family).family_config(full)
    except CheckpointError as exc:
        raise ConvertError(str(exc)) from None
    except ValueError as exc:
        raise ConvertError(f"--hf-config {path}: {exc} (family {family!r})") from None
    bound_config(cfg, path, root)
    formats = families.get(family).converter.formats
    fmt = HF_SAVE_LAYOUT if HF_SAVE_LAYOUT in formats else formats[0]
    return ModelConfig(family, cfg, raw, fmt, "", f"--hf-config {path}")


# --------------------------------------------------------------------------------------------------
# reading mcore checkpoints back (check --mcore, tests)


def read_mcore_shards(path, family: str | None = None, *, tp: int | None = None) -> tuple[str, Path, R.McoreShards]:
    """(family, HF config path, one TE-spelled, globally numbered state dict per TP rank, with the
    side file's tensors split for TP as ``.side``).

    Legacy checkpoints come as written (their TP size) unless `tp` asks for another; torch_dist
    holds global tensors, so it comes at TP = 1 unless `tp` is given. Resharding merges each tensor
    by its TP kind and splits it again, exactly.
    """
    path = Path(path)
    try:
        kind = _source_kind(path)
        if kind.kind != ckpt_formats.MCORE:
            raise ConvertError(f"{path}: an HF directory, not an mcore checkpoint")
        source = kind.open_source(path, family, None, _TensorFilter(None, False), 1, R.VOCAB_MULTIPLE, True)
        if source.part:
            raise ConvertError(f"{source.root}: holds {_held_alone(source)}; parity is checked on the whole model: "
                               "`mmparity verify --load` loads it into its class, `mmparity convert --to hf --base "
                               "HF_DIR` makes the whole release to check")
        _check_shapes(source)  # exactly as convert checks it, before any tensor is read
        aside = R.side_keys(source.rules)
        if kind.stores_grid and (tp is None or tp == source.tp):
            sink = R.MemorySink(source.tp)
            R.stream_to_mcore(aside, source.kinds, source.produce, sink.put)
            shards = R.McoreShards([{k: state[k] for k in source.order} for state in source.rank_states()],
                                   sink.shards, R.side_keys(source.rules, "unused"))
        else:
            target = tp or 1
            _validate_tp(source.rules, target)
            # Megatron-LM pads for the TP size it runs at, with the divisor the checkpoint records.
            source.repad_vocab(target, source.vocab_multiple)
            sink = R.MemorySink(target)
            R.stream_to_mcore(source.order + aside, source.kinds, source.produce, sink.put)
            shards = R.split_side(source.rules, sink.shards)
    except (CheckpointError, PipelineError, ShardError) as exc:
        raise ConvertError(str(exc)) from None
    return source.family, source.root / HF_CONFIG_FILE, shards
