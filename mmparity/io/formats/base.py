"""What every checkpoint format shares: the format record, the checkpoint as found on disk before
its model is known, the model a reader is told of, the narrow record a writer is given, the source
every reader makes, and the report every verifier writes into.

A conversion reads one format and writes another, joined by the rule engine:

    source (HF dir | legacy dir | torch_dist dir)  --mcore_pieces(key)-->  target writer

Every source answers one question, "the full (TP = 1, globally numbered) mcore tensor of this key",
one key at a time, as *pieces*: views of the file mappings it reads from wherever it can, so that
most bytes go from the source's page cache to the destination's without a Python-side copy. What a
source is, is the model's business: a reader is handed the rule set and config (a :class:`Model`,
built once per conversion by ``mmparity.convert`` from the family's spec) and never looks a family
up; a writer is handed an :class:`Output`, never the command line's options.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

import torch

from mmparity.errors import ConvertError, from_conversion_error
from mmparity.io.fsio.checksums import tensor_checksum
from mmparity.io.manifest import Manifest, TensorRecord
from mmparity.mapping import rules as R
from mmparity.parallel.axes import Grid

__all__ = ["HF", "MCORE", "Format", "Written", "Stored", "Model", "Output", "Progress", "TensorFilter", "Source",
           "SourceUse", "PlanSources", "Problem", "VerifyReport", "compare_record", "unexpected_tensors",
           "part_root", "neither"]

HF, MCORE = "hf", "mcore"  # what a format holds: HF safetensors, or Megatron-Core state dicts


# --------------------------------------------------------------------------------------------------
# the format record


@dataclasses.dataclass(frozen=True)
class Written:
    """What a format's writer wrote: tensors, bytes, and the parallel sizes its files are laid
    out for (a format of global tensors: all 1); an HF writer's ``--requantize`` report and what it
    took from a base release (the files copied, the tensors made only of the base's)."""

    tensors: int
    nbytes: int
    grid: Grid
    requant: object = None
    copied: tuple = ()
    from_base: tuple = ()
    from_base_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Format:
    """One checkpoint format.

    ``kind`` is what it holds (:data:`HF`: a directory of safetensors, itself the checkpoint;
    :data:`MCORE`: a Megatron iteration directory, found through its root's tracker). ``detect``
    is asked of that directory. ``stores_grid``: its files are per rank (legacy), so a checkpoint
    keeps the TP/PP/EP sizes it was written at; otherwise it holds global tensors that load at any
    size.

    Reading is two steps, so that nothing of the model is needed to find what is on disk:
    ``probe(path, iteration) -> Stored`` finds the checkpoint (its root, manifest, config file,
    stored keys); the pipeline then reads the config and builds the :class:`Model`, and ``open``
    makes the source. An :data:`HF` format's ``open(stored, model, hf_format, filter, tp,
    vocab_multiple, part)`` plans it for ``tp`` ranks (vocabularies padded to ``vocab_multiple x
    tp``) and one ``part`` of a whole VLM where asked; an :data:`MCORE` format's ``open(stored,
    model, filter, complete, described_by)`` (``complete=False``: ``verify --load``, tensors missing
    or foreign left to the strict load; ``described_by``: what ``--base`` / ``--hf-config`` give a
    checkpoint Megatron-LM wrote).
    """

    name: str  # as --format names it
    layout: str  # as the manifest records it
    kind: str
    what: str  # a directory of it in words, for "neither ... nor ..." messages
    detect: Callable[[Path], bool]
    probe: Callable[..., "Stored"]
    open: Callable[..., "Source"]
    # (source, Output, Progress) -> Written
    write: Callable[..., Written]
    # (root, {file: [TensorRecord]}, VerifyReport): checks every record, appends the problems
    verify: Callable[[Path, Mapping[str, Sequence], "VerifyReport"], None]
    stores_grid: bool = False
    records_directories: bool = False  # a tensor record names a directory of files, not a file
    default: bool = False  # the output format of its kind when none is named (listed first)


def neither(whats: Sequence[str]) -> str:
    """``neither A nor B`` (``neither A, B nor C``) of directories described in words."""
    if len(whats) == 1:
        return f"not {whats[0]}"
    return f"neither {', '.join(whats[:-1])} nor {whats[-1]}"


@dataclasses.dataclass
class Stored:
    """A checkpoint as found on disk, before anything of the model it holds is known."""

    path: Path  # as given
    root: Path  # the checkpoint: an HF directory, an mcore root
    config: Path  # the HF config file that describes it (an mcore root's copy)
    # (tensors, elements) at most, from an index already read, to bound the config by; None: the
    # files are read for it when the config is (``hf.checkpoint_capacity``)
    capacity: tuple[int, int] | None = None
    # an mcore root's manifest as it bears on the iteration read (``manifest_elsewhere``: the root's
    # records another iteration, so only what is beside the iterations is kept)
    manifest: Manifest | None = None
    manifest_elsewhere: bool = False
    iteration: int | str | None = None
    stored: tuple = ()  # the model keys an mcore checkpoint holds, which tell a part of a VLM from the whole
    handle: object = None  # the format's own: the opened files


class Model(Protocol):
    """What a reader is told of the model a checkpoint holds (``mmparity.convert.model`` builds one
    per conversion from the family's spec): the family's name, for messages and manifests only; the
    HF layouts its tables know (the default first); its config; and its rule tables, each built
    once, raising :class:`~mmparity.errors.ConversionError`."""

    name: str
    formats: tuple
    cfg: object
    config_bytes: bytes

    # Megatron-LM arguments the family declares beyond the config's common facts (``args``).
    recorded_args: dict

    def rules(self, hf_format: str | None = None, keys=None) -> R.RuleSet: ...

    def expected_shapes(self, tp: int = 1, vocab_multiple: int = R.VOCAB_MULTIPLE, part: str = "") -> dict | None:
        """mcore shapes the config implies, by key (of ``part`` alone, without its root); None when
        they cannot be told."""


@dataclasses.dataclass(frozen=True)
class Output:
    """What a writer is asked to write, and nothing else of the command line."""

    dst: Path
    grid: Grid = dataclasses.field(default_factory=Grid.of)  # mcore output's TP / PP / EP sizes
    force: bool = False
    max_shard_size: int | str | None = None  # an HF shard's, a torch_dist data file's largest size
    release: bool = False  # Megatron-LM's release iteration instead of iteration 1
    team: object = None  # this process's share where several write (``io.team``); None: all of it
    node_local: bool = False  # torch_dist: each node's data files on its own disk
    expert_layout: str = "grouped"  # legacy: how the routed experts are named
    dtype: str | None = None  # the cast asked for, as the manifest records it
    megatron_class: str = ""  # the Megatron class mcore output is laid out for, as recorded
    # HF output: its table (the layout it is written in); what ``--requantize`` asks; the layout
    # asked for, for messages; the release whose tokenizer and processor files go beside it
    hf_rules: R.RuleSet | None = None
    requantize: bool = False
    hf_format: str | None = None
    base: Path | None = None


class Progress:
    """What the pipeline reports; the CLI draws it, the default ignores it."""

    def phase(self, description: str, tensors: int | None = None, nbytes: int | None = None,
              unit: str = "tensors") -> None:
        pass

    def advance(self, tensors: int = 0, nbytes: int = 0) -> None:
        pass


class TensorFilter:
    """Cast and NaN/Inf check applied to every source tensor as it is read."""

    def __init__(self, dtype: torch.dtype | None, check_finite: bool):
        self.dtype, self.check_finite = dtype, check_finite

    def meta(self, meta: R.Meta) -> R.Meta:
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


# --------------------------------------------------------------------------------------------------
# sources


@dataclasses.dataclass(frozen=True)
class SourceUse:
    """What an HF -> mcore conversion took of its source, from its plan: every source tensor was
    either converted or left out (a rule table's ``drop_hf``: the rest of a whole VLM, buffers),
    so the two add up to all of it. Bytes as stored in the source."""

    converted: int
    converted_bytes: int
    # (module, tensors, bytes) per part left out (``rules.module_of``), largest first.
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


class Source:
    """The full TP = 1 mcore tensors of one model, one key at a time."""

    layout: str
    path: Path
    model: Model
    family: str  # the model's name (messages, manifests)
    cfg: object
    config_bytes: bytes
    hf_format: str  # the HF layout the weights came from (and go back to by default)
    prefix: str  # the HF key prefix they came from
    metas: dict  # mcore key -> Meta, in plan order
    hf_sources: Mapping = MappingProxyType({})  # mcore key -> the HF keys it is made from
    use: SourceUse | None = None  # an HF source's
    detection: object = None  # an HF source's, when its family was told from its config
    # What the original HF -> mcore conversion left out (``SourceUse.to_json``), recorded in every
    # manifest down the line: a checkpoint made from part of a VLM says so.
    left_out_record: dict | None = None
    # A quantized source's record (``quantized.QuantRecord.to_json``), kept down the line like
    # ``left_out_record``: an mcore checkpoint of an FP8 release says it was dequantized.
    quant_record: dict | None = None
    # The mcore root of the part of a whole VLM this source gives, its keys without it
    # (``language_model.``); "" for the whole. ``rules`` is then that part's table, ``whole_rules``
    # the whole model's.
    part: str = ""
    rules: R.RuleSet
    whole_rules: R.RuleSet
    from_base: tuple = ()  # mcore keys taken from a base release, not from the checkpoint
    iteration: int | str | None = None

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

    def _take(self, model: Model) -> None:
        self.model, self.family, self.cfg, self.config_bytes = model, model.name, model.cfg, model.config_bytes

    def _rules(self, hf_format: str | None, keys=None, where: str = "") -> R.RuleSet:
        try:
            return self.model.rules(hf_format, keys)
        except R.ConversionError as exc:
            raise from_conversion_error(exc, where) from None


class PlanSources(Mapping):
    """mcore key -> the HF keys it is made from, read off a plan (no table of its own)."""

    def __init__(self, plan: R.Plan):
        self._plan = plan

    def __getitem__(self, key: str) -> tuple:
        return self._plan.source_keys(key)

    def __iter__(self):
        return iter(self._plan.outputs)

    def __len__(self) -> int:
        return len(self._plan.outputs)


def part_root(rules: R.RuleSet, family: str, part: str) -> str:
    """The mcore root of ``--part part`` in a ``family`` table (its whole model's)."""
    roots = R.rule_roots(rules)
    if not roots:
        raise ConvertError(f"--part {part}: family {family!r} is one model, not a whole VLM of parts; "
                           "leave --part out")
    names = [R.part_name(r) for r in roots]
    if part not in names:
        raise ConvertError(f"--part {part}: family {family!r} has the parts {', '.join(names)}")
    return roots[names.index(part)]


# --------------------------------------------------------------------------------------------------
# what verifying a checkpoint reports


@dataclasses.dataclass(frozen=True)
class Problem:
    file: str
    key: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.key}" if self.key is not None else self.file
        return f"{where}: {self.message}"


@dataclasses.dataclass
class VerifyReport:
    directory: Path
    layout: str
    checked: int = 0
    problems: list[Problem] = dataclasses.field(default_factory=list)
    # What the manifest says the conversion left out of its HF source (a tower family's checkpoint
    # made from a whole VLM), e.g. "left out 11 of 37 source tensors: language_model".
    partial: str = ""
    # An mcore checkpoint's parallel sizes as its manifest records them, e.g. "tp=2 pp=1 ep=2".
    parallel: str = ""
    # The Megatron class it is laid out for and the part of a whole VLM it holds, as recorded.
    held: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        layout = f"{self.layout} {self.parallel}" if self.parallel else self.layout
        layout = f"{layout}, {self.held}" if self.held else layout
        head = f"{self.directory} ({layout}): {self.checked} tensor records checked"
        if self.partial:
            head = f"{head} (made from part of its source: {self.partial})"
        if self.ok:
            return f"{head}, all match"
        return "\n".join([f"{head}, {len(self.problems)} problem(s)"] + [f"  {p}" for p in self.problems])


def compare_record(report: VerifyReport, record: TensorRecord, found: torch.Tensor) -> None:
    report.checked += 1
    for difference in record.checksum.differences(tensor_checksum(found, record.checksum.algorithm)):
        report.problems.append(Problem(record.file, record.key, difference))


def unexpected_tensors(report: VerifyReport, file: str, keys: Iterable[str]) -> None:
    for key in sorted(keys):
        report.problems.append(Problem(file, key, "tensor present in the checkpoint but not in the manifest"))
