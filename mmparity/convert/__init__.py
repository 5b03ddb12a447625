"""Checkpoint conversion on disk: HF safetensors <-> mcore legacy / torch_dist, streaming and atomic.

The pipeline, one step after another, each done once:

    options -> the family's spec (looked up once) -> its config (read once) -> its rule set (built
    once) -> the source, opened by its format -> checks (shapes, divisor, paths) -> the part written
    (``--part``, ``--base``) -> the target format's writer

:func:`convert` runs it (what ``mmparity convert`` runs); :func:`read_mcore_shards` reads an mcore
checkpoint back into memory the same way (``check --mcore``). The conversion itself is the engine of
:mod:`mmparity.mapping.rules`, the same one the in-memory API runs: its plans are the one totality
check, and its loops drive the writers of :mod:`mmparity.io.formats` instead of an in-memory sink.
Everything that can be known before reading a byte is checked first, on shapes alone; only then is
the destination's staging directory created, and output becomes visible by one rename when complete.

Memory and bytes. No target holds more than a few tensors: each format's layout is fixed from the
dry run before any tensor exists, and every tensor goes straight into its reserved byte range.
Sources hand tensors over as *pieces*, views of the file mappings they read from: a layout op that
only moves row blocks (renames, q/k/v regrouping, gated halves), a TP split or a TP merge selects
pieces instead of copying, so most bytes go from the source's page cache to the destination's
without passing through a Python-side copy. Only ops that really permute elements (RoPE
interleaving, a non-row-block TP split) copy.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path

import torch

from mmparity.convert.checks import check_paths, check_shapes, check_vocab_divisor
from mmparity.convert.parts import as_target_part, megatron_class_of, refuse_part_alone
from mmparity.convert.sources import MISTRAL_LAYOUT, HF_SAVE_LAYOUT, model_config_for, open_as, open_source
from mmparity.errors import ConvertError, from_conversion_error
from mmparity.io import formats as ckpt_formats
from mmparity.io import team as team_mod
from mmparity.io.formats.base import HF, MCORE, Output, Progress, Source, SourceUse, TensorFilter
from mmparity.io.formats.mcore import McoreSource, validate_tp
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.safetensors_format import parse_size
from mmparity.io.layout import HF_CONFIG_FILE
from mmparity.mapping import rules as R
from mmparity.models import registry
from mmparity.parallel.axes import Grid
from mmparity.parallel.pp import PipelineError
from mmparity.parallel.tp import ShardError

__all__ = ["ConvertOptions", "ConvertResult", "DTYPES", "TARGETS", "convert", "read_mcore_shards"]

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
TARGETS = ("mcore", "hf")


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    src: Path
    dst: Path
    to: str  # "mcore" or "hf"
    family: str | None = None  # None: an HF source's is detected from its config, an mcore one's recorded
    tp: int = 1
    pp: int = 1
    # Megatron's expert_model_parallel_size: legacy rank files hold their EP rank's experts (see
    # parallel.ep); torch_dist's global tensors load at any EP that divides the experts.
    ep: int = 1
    # mcore target format (formats.writable()); default: the format list's default (torch_dist)
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
    # scheme again, with its quantization_config (see mmparity.io.quantized).
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
class ConvertResult:
    dst: Path
    layout: str
    family: str
    tensors: int
    nbytes: int
    seconds: float
    grid: Grid = dataclasses.field(default_factory=Grid.of)  # what the files are laid out for
    note: str = ""  # the rule table's ``mcore_note`` when writing mcore
    source_use: SourceUse | None = None  # an HF source's: what was converted, what left out
    detection: object = None  # how the family was told (``registry.Detection``), when not given
    requant: object = None  # --requantize: what re-quantizing changed (``quant.RequantError``)
    from_base: tuple = ()  # HF keys written from --base, not from the checkpoint (not trained)
    copied: tuple = ()  # files copied from --base (tokenizer, processor, ...)
    iteration: int | str | None = None  # the mcore source's iteration
    part: str = ""  # the part written, by name ("" the whole)
    megatron_class: str = ""  # the Megatron class the mcore output is laid out for, where known
    from_base_bytes: int = 0  # of ``from_base``, as written


def check_options(options: ConvertOptions) -> None:
    """The options a conversion can be asked, before anything is read (the family named is looked
    up next, then :func:`cast_dtype`): a :class:`ConvertError` names the flag."""
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


def cast_dtype(options: ConvertOptions) -> torch.dtype | None:
    """The dtype ``--dtype`` casts floating tensors to (None: each keeps its own)."""
    if options.dtype is None:
        return None
    if options.dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {', '.join(DTYPES)}, got {options.dtype!r}")
    return DTYPES[options.dtype]


# --------------------------------------------------------------------------------------------------
# the pipeline


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
        check_options(options)
        spec = registry.resolve(options.family) if options.family is not None else None
        dtype = cast_dtype(options)
        src, dst = Path(options.src), Path(options.dst)
        if not src.exists():
            raise ConvertError(f"{src}: no such file or directory")
        check_paths(src, dst, options.force, {"--base": options.base, "--hf-config": options.hf_config})
        target = ckpt_formats.target(options.to, options.format)
        # --hf-format names the HF side: the source's layout when converting from HF to mcore, the
        # output's when writing HF (the source's is then detected, or recorded in its manifest).
        source_format = (options.hf_format if target.kind == MCORE
                         and ckpt_formats.source_format(src).kind == HF else None)
        # Rank files (legacy) hold Megatron-LM's per-TP padding; global tensors (torch_dist) TP 1's.
        vocab_tp = options.tp if target.kind == MCORE and target.stores_grid else 1
        model_config = model_config_for(src, options.family, options.base, options.hf_config, options.iteration,
                                        spec=spec)
        source = open_source(src, options.family, source_format, dtype=dtype, check_finite=options.check_finite,
                             tp=vocab_tp, vocab_multiple=options.make_vocab_size_divisible_by or R.VOCAB_MULTIPLE,
                             model_config=model_config, iteration=options.iteration, part=options.part, spec=spec)
        check_vocab_divisor(source, vocab_tp, options.make_vocab_size_divisible_by)
        check_shapes(source)  # as stored, before the tables are re-padded from what it records
        if isinstance(source, McoreSource) and options.to == "mcore":
            # Resharding: the tables are padded for the target, as Megatron-LM would pad them.
            source.repad_vocab(vocab_tp, options.make_vocab_size_divisible_by or source.vocab_multiple)
        if options.requantize and options.to != "hf":
            raise ConvertError("--requantize re-quantizes HF output; it does not apply to --to mcore")
        source = as_target_part(source, options.to, options.part)
        mcore = options.to == "mcore"
        megatron_class = megatron_class_of(source) if mcore else ""
        out = Output(dst, options.grid if mcore else Grid.of(), options.force, options.max_shard_size,
                     options.release, options.team, options.node_local, options.expert_layout, options.dtype,
                     megatron_class, None if mcore else _hf_rules(source, options.hf_format), options.requantize,
                     options.hf_format, model_config.base if model_config is not None else None)
        written = target.write(source, out, progress)
    except (CheckpointError, PipelineError, registry.UnknownFamilyError) as exc:
        raise ConvertError(str(exc)) from None
    except R.ConversionError as exc:
        raise from_conversion_error(exc) from None
    return ConvertResult(
        dst, target.layout, source.family, written.tensors, written.nbytes, time.perf_counter() - started,
        grid=written.grid, note=source.rules.mcore_note if mcore else "", source_use=source.use,
        detection=source.detection, requant=written.requant, from_base=written.from_base, copied=written.copied,
        iteration=source.iteration, part=R.part_name(source.part) if mcore and source.part else "",
        megatron_class=megatron_class, from_base_bytes=written.from_base_bytes)


def _hf_rules(source: Source, requested: str | None) -> R.RuleSet:
    """The table HF output is written by: the layout ``--hf-format`` asks for, else the source's."""
    formats = source.model.formats
    fmt = requested or source.hf_format
    if requested is None and fmt == MISTRAL_LAYOUT and HF_SAVE_LAYOUT in formats:
        # A whole model read from Mistral's own release goes out as transformers saves it, with
        # the config.json it was translated to: what a user exporting "to HF" can load. Mistral's
        # names stay one --hf-format away (beside a config.json, not a params.json).
        fmt = HF_SAVE_LAYOUT
    if fmt not in formats:
        raise ConvertError(f"--hf-format {fmt!r} is not a layout of family {source.family!r}; "
                           f"it knows {', '.join(formats)}")
    try:
        return source.model.rules(fmt)
    except R.ConversionError as exc:
        raise from_conversion_error(exc) from None


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
        kind = ckpt_formats.source_format(path)
        if kind.kind != MCORE:
            raise ConvertError(f"{path}: an HF directory, not an mcore checkpoint")
        source = open_as(kind, path, family, None, TensorFilter(None, False))
        refuse_part_alone(source, "parity is checked on the whole model: `mmparity verify --load` loads it into "
                                  "its class, `mmparity convert --to hf --base HF_DIR` makes the whole release to check")
        check_shapes(source)  # exactly as convert checks it, before any tensor is read
        aside = R.side_keys(source.rules)
        if kind.stores_grid and (tp is None or tp == source.tp):
            sink = R.MemorySink(source.tp)
            R.stream_to_mcore(aside, source.kinds, source.produce, sink.put)
            shards = R.McoreShards([{k: state[k] for k in source.order} for state in source.rank_states()],
                                   sink.shards, R.side_keys(source.rules, "unused"))
        else:
            target = tp or 1
            validate_tp(source.rules, target)
            # Megatron-LM pads for the TP size it runs at, with the divisor the checkpoint records.
            source.repad_vocab(target, source.vocab_multiple)
            sink = R.MemorySink(target)
            R.stream_to_mcore(source.order + aside, source.kinds, source.produce, sink.put)
            shards = R.split_side(source.rules, sink.shards)
    except (CheckpointError, PipelineError, ShardError) as exc:
        raise ConvertError(str(exc)) from None
    return source.family, source.root / HF_CONFIG_FILE, shards
