"""The rule-table engine: names -> layout -> tensor parallelism, total and loud.

A family's table is data: each :class:`Rule` ties mcore key pattern(s) to HF key pattern(s) with a
layout op (which knows its inverse) and a TP kind per mcore key. Patterns may hold ``{i}`` (layer
index) or other ``{name}`` variables whose ranges the :class:`RuleSet` declares, so the engine can
compute the complete expected key set of either side *before* converting. Conversion then demands
that every source key is consumed exactly once (or dropped by an explicit pattern) and every target
key is produced exactly once; otherwise one :class:`ConversionError` lists every offender with its
shape.

The reverse direction is not a second table: it runs the same rules through ``Op.invert`` and
``tp.merge``.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch

from mmparity.errors import ConversionError
from mmparity.parallel import tp as tp_mod
from mmparity.mapping.ops import Identity, LayoutError, Op
from mmparity.parallel.tp import ShardError

_VAR = re.compile(r"\{(\w+)\}")
# Megatron-LM's default --make-vocab-size-divisible-by.
VOCAB_MULTIPLE = 128


@dataclass(frozen=True)
class Rule:
    mcore: tuple
    hf: tuple
    op: Op = field(default_factory=Identity)
    tp: tuple = ("replicated",)
    # Kept aside: Megatron's class has no place for these tensors, so they never enter the mcore
    # state dict; they travel beside it (the checkpoint's side file, ``McoreShards.side``) so that
    # mcore -> HF stays exact. Consumed from HF exactly once like every other rule. "native": the
    # native model has a module for them (CLIP's ln_post, the SigLIP head); "unused": no model
    # reads them (LLaVA's tower layers past vision_feature_layer).
    side: str = ""

    def __post_init__(self):
        object.__setattr__(self, "mcore", _as_tuple(self.mcore))
        object.__setattr__(self, "hf", _as_tuple(self.hf))
        kinds = _as_tuple(self.tp)
        if len(kinds) == 1 and len(self.mcore) > 1:
            kinds = kinds * len(self.mcore)
        object.__setattr__(self, "tp", kinds)
        if len(self.tp) != len(self.mcore):
            raise ValueError(f"rule {self.mcore}: one TP kind per mcore key")
        for kind in self.tp:
            try:
                tp_mod.split_of(kind)
            except ShardError:
                raise ValueError(f"rule {self.mcore}: unknown TP kind {kind!r}") from None
        if self.side not in SIDE_KINDS:
            raise ValueError(f"rule {self.mcore}: side must be one of {SIDE_KINDS}, got {self.side!r}")


def _as_tuple(x) -> tuple:
    return (x,) if isinstance(x, str) else tuple(x)


def rename(mcore: str, hf: str, tp: str = "replicated") -> Rule:
    return Rule(mcore, hf, Identity(), tp)


SIDE_KINDS = ("", "native", "unused")


def aside(*rules: Rule, side: str = "native") -> tuple:
    """``rules`` as side rules: same names, ops and TP kinds, outside the mcore state dict."""
    return tuple(Rule(r.mcore, r.hf, r.op, r.tp, side=side) for r in rules)


class McoreShards(list):
    """One mcore state dict per TP rank (what Megatron's class loads), with ``side``: per rank, the
    tensors kept aside (side rules), split for TP like the rest, and ``unused``: those of them no
    model reads. The native model loads :func:`with_side`; mcore -> HF needs both."""

    def __init__(self, shards: Iterable[dict] = (), side: Sequence[dict] | None = None,
                 unused: Iterable[str] = ()):
        super().__init__(shards)
        self.side = list(side) if side is not None else [{} for _ in self]
        self.unused = frozenset(unused)


def with_side(shards: Sequence[Mapping[str, torch.Tensor]]) -> list[dict]:
    """Per rank, the mcore state plus the side tensors the native model has modules for: what the
    native model loads. Plain per-rank dicts (no side) come back as copies."""
    side = getattr(shards, "side", None) or [{} for _ in shards]
    unused = getattr(shards, "unused", frozenset())
    return [{**s, **{k: v for k, v in extra.items() if k not in unused}} for s, extra in zip(shards, side)]


def values(variable: int | range | tuple) -> range:
    """A :class:`RuleSet` variable's values as a range."""
    if isinstance(variable, range):
        return variable
    if isinstance(variable, tuple):
        start, stop = variable
        return range(start, stop)
    return range(variable)


@dataclass(frozen=True)
class RuleSet:
    """One family's table for one HF layout, with the variable ranges of its patterns."""

    rules: tuple
    # Each variable's values: a count (0 .. n-1), a ``range`` or a ``(start, stop)`` pair, so that
    # a table can say "layers k..N-1 are MoE" with one variable per kind of layer.
    variables: Mapping[str, int | range | tuple]
    hf_prefixes: tuple = ("",)
    # Whole-key regexes for HF tensors that are deliberately not converted (e.g. a language model
    # next to the vision tower). Everything else unconsumed is an error.
    drop_hf: tuple = ()
    hf_format: str = "hf"
    # Checked before converting, e.g. "tp must divide the query groups"; returns error messages.
    validate_tp: Callable[[int], list] | None = None
    # Where Megatron's class computes something other than HF with the tensors this table writes
    # (no exact Megatron equivalent): one line that ``convert --to mcore`` prints.
    mcore_note: str = ""
    # A whole VLM's TP checks per part (mcore root -> check): what a table of one part
    # (:func:`part_rules`) validates, so that a language model written alone is not held to its
    # tower's head count.
    part_tp: Mapping[str, Callable[[int], list]] = field(default_factory=dict)

    def bindings(self, patterns: Iterable[str]) -> list[dict]:
        names = sorted({v for p in patterns for v in _VAR.findall(p)})
        ranges = [values(self.variables[n]) for n in names]
        return [dict(zip(names, combo)) for combo in itertools.product(*ranges)]


@dataclass(frozen=True)
class TowerKeys:
    """How a whole VLM's table (LLaVA's) finds a vision tower's table and where it roots it: the
    ``vision_config.model_type`` that selects this table, and the extra root transformers 4 saved
    the tower under (``vision_model.`` for CLIP and SigLIP)."""

    model_type: str
    v4_checkpoint_root: str = ""


@dataclass(frozen=True)
class LanguageKeys:
    """What one language-model part's converter module offers a whole VLM's table: the decoder's
    rules (``rules(text_config, lm_root, head_key, tied=, layout=)``, mcore keys under
    ``language_model.``, layers over ``{i}``), the HF-side layouts it has names for (``hf`` and, e.g.,
    Mistral's own ``mistral``), and the sizes tensor parallelism must divide
    (``tp_problems(text_config, tp)``)."""

    layouts: tuple
    rules: Callable
    tp_problems: Callable
    # The ranges of the rules' variables (default: ``{i}`` over every layer), for a decoder whose
    # layers are of several kinds (dense then MoE) or that has experts (``{e}``).
    variables: Callable | None = None
    # Whole-key regexes of what a release stores beside the decoder and no model reads
    # (``drops(text_config, lm_root)``: DeepSeek's multi-token-prediction layers).
    drops: Callable | None = None
    # How many routed experts each MoE layer has (0: none), which the expert axis splits.
    experts: Callable | None = None

    def variables_of(self, text) -> dict:
        return dict(self.variables(text)) if self.variables else {"i": text.num_hidden_layers}

    def drops_of(self, text, lm_root: str) -> tuple:
        return tuple(self.drops(text, lm_root)) if self.drops else ()

    def experts_of(self, text) -> int:
        return int(self.experts(text)) if self.experts else 0


@dataclass(frozen=True)
class ConverterSpec:
    """What one family's converter module offers: its HF layouts and a rule table per layout.

    ``rule_set(cfg, hf_format)`` builds the table for a config; ``detect_format(keys)`` names the
    layout a key set is in (without it, every checkpoint is taken to be in ``formats[0]``);
    ``tower``, when the table also serves as a LLaVA vision tower, how LLaVA's table finds it.
    """

    formats: tuple
    rule_set: Callable[[object, str], RuleSet]
    detect_format: Callable[[list], str] | None = None
    tower: TowerKeys | None = None

    def __post_init__(self):
        if not self.formats:
            raise ValueError("a converter needs at least one HF layout")

    def detect(self, keys) -> str:
        """Which HF-side layout (e.g. ``hf`` or ``mistral``) a key set is in, from the keys alone."""
        if not self.detect_format:
            return self.formats[0]
        # Names with their shapes where the caller has them (a layout may differ by shape alone).
        return self.detect_format(keys if isinstance(keys, Mapping) else list(keys))

    def rules(self, cfg, hf_format: str | None = None, keys=None, *, family: str = "") -> RuleSet:
        """The table for ``cfg`` in ``hf_format``; detected from ``keys`` when not given.
        ``family`` names the family in errors."""
        if hf_format is None:
            hf_format = self.detect(keys) if keys is not None else self.formats[0]
        if hf_format not in self.formats:
            raise ConversionError(f"unknown HF layout for family {family!r}",
                                  [f"got {hf_format!r}; this family knows {', '.join(self.formats)}"])
        return self.rule_set(cfg, hf_format)


def _fill(pattern: str, binding: Mapping[str, int]) -> str:
    # Interned: a conversion keeps each name in several tables (the plan, the source's index, the
    # writer's records) and re-derives the table's keys more than once; one object serves them all.
    return sys.intern(_VAR.sub(lambda m: str(binding[m.group(1)]), pattern))


@dataclass(slots=True)  # one per tensor of a plan
class Step:
    """One rule under one binding: which keys it reads and writes."""

    rule: Rule
    hf_keys: tuple
    mcore_keys: tuple


def iter_steps(rule_set: RuleSet) -> Iterable[Step]:
    """:func:`plan_steps` one at a time, for a caller that keeps none of them."""
    for rule in rule_set.rules:
        for binding in rule_set.bindings(rule.hf + rule.mcore):
            yield Step(rule, tuple(_fill(p, binding) for p in rule.hf),
                       tuple(_fill(p, binding) for p in rule.mcore))


def plan_steps(rule_set: RuleSet) -> list[Step]:
    return list(iter_steps(rule_set))


def expected_keys(rule_set: RuleSet) -> tuple[list[str], list[str]]:
    """(HF keys without prefix, mcore keys) that a complete checkpoint of this config has; the
    mcore keys include the side keys (:func:`side_keys`)."""
    hf: list[str] = []
    mcore: list[str] = []
    for step in iter_steps(rule_set):
        hf += step.hf_keys
        mcore += step.mcore_keys
    return hf, mcore


def side_keys(rule_set: RuleSet, kind: str | None = None) -> list[str]:
    """The mcore-side names of the tensors kept aside (of one side ``kind`` if given), in table
    order."""
    return [k for s in iter_steps(rule_set) if s.rule.side and kind in (None, s.rule.side)
            for k in s.mcore_keys]


# --- parts of a whole VLM ---------------------------------------------------------------------

# Megatron's ``LLaVAModel`` holds a whole VLM as three modules, each a Megatron class of its own:
# the language model (``GPTModel``), the tower and the projector (``MultimodalProjector``). Where
# Megatron-LM cannot build the whole, a user trains one part alone, and its checkpoint holds that
# part's keys without the root.
PART_ROOTS = ("language_model.", "vision_model.", "vision_projection.")
PART_CLASSES = {"language_model.": "GPTModel", "vision_projection.": "MultimodalProjector"}


def part_roots(mcore_keys: Iterable[str]) -> tuple:
    """The :data:`PART_ROOTS` a table's mcore keys are laid out under, where they are all under
    such roots and there are several (a whole VLM, or a tower with its projector); () otherwise."""
    keys = list(mcore_keys)
    roots = tuple(r for r in PART_ROOTS if any(k.startswith(r) for k in keys))
    if len(roots) < 2 or not all(k.startswith(roots) for k in keys):
        return ()
    return roots


def rule_roots(rule_set: RuleSet) -> tuple:
    """:func:`part_roots` of a table, read off its patterns (no key is made)."""
    return part_roots(k for rule in rule_set.rules for k in rule.mcore)


def part_name(root: str) -> str:
    return root.rstrip(".")


def _hf_pattern(pattern: str, prefixes: Sequence[str]) -> str:
    """A whole-key regex for an HF key pattern under any of ``prefixes``, each ``{var}`` any number."""
    # re.split with a group alternates literal text (even places) and variable names (odd places).
    body = "".join(r"\d+" if odd else re.escape(piece)
                   for odd, piece in zip(itertools.cycle((False, True)), _VAR.split(pattern)))
    return f"^(?:{'|'.join(re.escape(p) for p in prefixes)}){body}$"


def part_rules(rule_set: RuleSet, root: str) -> RuleSet:
    """``rule_set`` restricted to the mcore keys under ``root`` (one of :func:`part_roots`), laid
    out without it: the table of a part trained alone (``language_model.`` -> ``GPTModel``'s own
    keys). Every HF key of the other parts is left out explicitly, so a plan of it is still the
    totality check and says, by module, what it did not convert."""
    kept, left = [], []
    for rule in rule_set.rules:
        inside = [k.startswith(root) for k in rule.mcore]
        if all(inside):
            kept.append(Rule(tuple(k[len(root):] for k in rule.mcore), rule.hf, rule.op, rule.tp, rule.side))
        elif any(inside):
            raise ValueError(f"rule {rule.mcore} spans parts: {root} and others")
        else:
            left.append(rule)
    if not kept:
        raise ConversionError(f"no part {part_name(root)!r} in this table",
                              [f"its parts: {', '.join(part_name(r) for r in rule_roots(rule_set))}"])
    drops = tuple(dict.fromkeys(_hf_pattern(p, rule_set.hf_prefixes) for rule in left for p in rule.hf))
    check = rule_set.part_tp.get(root)
    return RuleSet(rules=tuple(kept), variables=rule_set.variables, hf_prefixes=rule_set.hf_prefixes,
                   drop_hf=rule_set.drop_hf + drops, hf_format=rule_set.hf_format, validate_tp=check,
                   mcore_note=rule_set.mcore_note if root != "language_model." else "")


# --- mcore key spellings --------------------------------------------------------------------

_LOCAL_TO_TE = [
    (re.compile(r"(.*\.)input_layernorm\.(weight|bias)$"), r"\1self_attention.linear_qkv.layer_norm_\2"),
    (re.compile(r"(.*\.)pre_mlp_layernorm\.(weight|bias)$"), r"\1mlp.linear_fc1.layer_norm_\2"),
]
_TE_TO_LOCAL = [
    (re.compile(r"(.*\.)self_attention\.linear_qkv\.layer_norm_(weight|bias)$"), r"\1input_layernorm.\2"),
    (re.compile(r"(.*\.)mlp\.linear_fc1\.layer_norm_(weight|bias)$"), r"\1pre_mlp_layernorm.\2"),
]


def _respell(key: str, table) -> str:
    for pattern, repl in table:
        if pattern.match(key):
            return pattern.sub(repl, key)
    return key


# Layers whose norms are separate modules in Transformer Engine's spelling too: multi-latent
# attention (its first projections take the normed input unfused) and MoE MLPs (the router reads it).
_UNFUSED_NORM_LAYERS = re.compile(r"^(.*\.)(self_attention\.linear_kv_down_proj|mlp\.router)\.")
# Layers with layer scales (``ls1`` / ``ls2``, Megatron-LM's layer-scaling transformer layer) are
# built on plain linears after separate norms: both their norms stay as they are.
_LAYER_SCALED = re.compile(r"^(.*\.)ls[12]$")


def _unfused_norms(key: str) -> tuple:
    if m := _UNFUSED_NORM_LAYERS.match(key):
        return (m.group(1) + ("input_layernorm." if "attention" in m.group(2) else "pre_mlp_layernorm."),)
    m = _LAYER_SCALED.match(key)
    return (m.group(1) + "input_layernorm.", m.group(1) + "pre_mlp_layernorm.") if m else ()


def to_te_spelling(state: Mapping[str, torch.Tensor]) -> dict:
    """Read either spelling: local-spec norm keys become TE fused-norm keys; ``_extra_state`` goes."""
    unfused = {prefix for key in state for prefix in _unfused_norms(key)}
    out = {}
    for key, value in state.items():
        if key.endswith("._extra_state") or key.endswith("_extra_state"):
            continue
        keep = bool(unfused) and _under_unfused_norm(key, unfused)
        out[key if keep else _respell(key, _LOCAL_TO_TE)] = value
    return out


_UNFUSED_NORM_MARKERS = ("input_layernorm.", "pre_mlp_layernorm.")


def _under_unfused_norm(key: str, unfused: set[str]) -> bool:
    # Every prefix in ``unfused`` ends in a norm marker, so only the key's prefixes that end in one
    # can match: a set lookup per marker occurrence, where testing each prefix made a whole-model
    # respelling cost tensors x layers (seconds at a release's 70k tensors).
    for marker in _UNFUSED_NORM_MARKERS:
        at = key.find(marker)
        while at != -1:
            if key[:at + len(marker)] in unfused:
                return True
            at = key.find(marker, at + 1)
    return False


def to_local_spelling(state: Mapping[str, torch.Tensor]) -> dict:
    return {_respell(k, _TE_TO_LOCAL): v for k, v in state.items()}


# --- prefix detection -------------------------------------------------------------------------

def detect_prefix(rule_set: RuleSet, keys: Iterable[str]) -> str:
    """The one HF prefix under which this family's keys live; ambiguous or absent is an error."""
    keys = list(keys)
    hf_expected, _ = expected_keys(rule_set)
    expected = set(hf_expected)
    hits = {p: sum(1 for k in keys if k.startswith(p) and k[len(p):] in expected)
            for p in rule_set.hf_prefixes}
    found = [p for p, n in hits.items() if n]
    if not found:
        sample = ", ".join(sorted(keys)[:5])
        raise ConversionError(
            f"no {rule_set.hf_format!r}-layout tensors of this family found", [
                f"tried prefixes {', '.join(repr(p) for p in rule_set.hf_prefixes)}; "
                f"checkpoint keys start with: {sample}"])
    if len(found) > 1:
        raise ConversionError("ambiguous checkpoint: the family's tensors appear under several prefixes",
                              [f"{p!r}: {hits[p]} tensors" for p in found])
    return found[0]


# --- the engine: plan (the one totality check), then stream through a sink ---------------------

# Everything a layout op or a TP split raises for tensors that do not fit it.
_FIT_ERRORS = (LayoutError, ShardError, RuntimeError, ValueError)


def _shape(t) -> str:
    return str(tuple(t.shape)) if hasattr(t, "shape") else "?"


def _meta(t) -> torch.Tensor:
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


@dataclass(frozen=True, slots=True)  # shared by every tensor of one dtype and shape (shared_meta)
class Meta:
    """A tensor's dtype and shape: what a plan keeps of every tensor once its dry run is done (a
    meta tensor costs a C++ tensor besides; layout ops only run on those while planning)."""

    dtype: torch.dtype
    shape: tuple

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def dim(self) -> int:
        return len(self.shape)

    def tensor(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


@functools.lru_cache(maxsize=4096)  # a model has few distinct (dtype, shape) pairs
def _shared_meta(dtype: torch.dtype, shape: tuple) -> Meta:
    return Meta(dtype, shape)


def shared_meta(dtype: torch.dtype, shape) -> Meta:
    """The :class:`Meta` of ``dtype`` and ``shape``, one object for every tensor alike."""
    return _shared_meta(dtype, tuple(shape))


def meta_of(t) -> Meta:
    """The shared :class:`Meta` of anything with ``.dtype`` and ``.shape``."""
    return shared_meta(t.dtype, t.shape)


def _tp_problems(rule_set: RuleSet, tp_size: int) -> list[str]:
    problems = list(rule_set.validate_tp(tp_size)) if rule_set.validate_tp else []
    if tp_size < 1:
        problems.append(f"tp_size must be >= 1, got {tp_size}")
    return problems


@dataclass
class Plan:
    """A checked conversion: every output tensor (its shape and dtype at TP = 1, as a
    :class:`Meta`) and, for each, the step of the table that produces it and the source keys that
    step reads.

    Made before any byte is read, from the sources' shapes alone; whoever executes it (the
    in-memory API, the streaming checkpoint writers) only reads, applies and writes.
    """

    steps: list  # [Step] whose sources are all present, in table order
    sources: list  # per step (by index): its source keys, with the source prefix, as a tuple
    inputs: dict  # source key -> Meta
    outputs: dict  # output key -> Meta, in table order
    producer: dict  # output key -> step index
    kinds: dict  # mcore key -> TP kind
    prefix: str = ""
    # Step index -> its op for this plan's TP size, where that is not the rule's own op (vocabulary
    # padding): most steps need no entry.
    ops: dict = field(default_factory=dict)
    # Source key -> Meta of what the table's ``drop_hf`` leaves out: with ``inputs``, every
    # source tensor, each once (what a partial conversion reports it did not convert).
    dropped: dict = field(default_factory=dict)

    def op(self, index: int) -> Op:
        return self.ops.get(index, self.steps[index].rule.op)

    def source_keys(self, key: str) -> list[str]:
        return self.sources[self.producer[key]]


def plan_hf_to_mcore(rule_set: RuleSet, source: Mapping, tp_size: int = 1,
                     prefix: str | None = None, vocab_multiple: int = VOCAB_MULTIPLE) -> Plan:
    """The conversion of HF tensors ``source`` (anything with ``.shape`` and ``.dtype``, keyed by
    full HF name) to mcore at ``tp_size`` ranks, checked: every source tensor is consumed exactly
    once or dropped by an explicit pattern, every op and TP split fits its tensors. Vocabularies are
    padded to multiples of ``vocab_multiple × tp_size`` (Megatron-LM's rule). Raises one
    :class:`ConversionError` listing every problem."""
    problems = _tp_problems(rule_set, tp_size)
    if isinstance(vocab_multiple, bool) or not isinstance(vocab_multiple, int) or vocab_multiple < 1:
        problems.append(f"make_vocab_size_divisible_by must be a positive integer, got {vocab_multiple!r}")
    if problems:
        raise ConversionError("tensor-parallel size does not fit this model", problems)
    if prefix is None:
        prefix = detect_prefix(rule_set, source.keys())
    plan = Plan([], [], {}, {}, {}, {}, prefix)
    consumed: set[str] = set()
    for step in iter_steps(rule_set):
        keys = step.hf_keys if not prefix else tuple(sys.intern(prefix + k) for k in step.hf_keys)
        missing = [k for k in keys if k not in source]
        if missing:
            problems += [f"missing source tensor {k}" for k in missing]
            continue
        consumed.update(keys)
        inputs = [source[k] for k in keys]
        op = step.rule.op.at_tp(tp_size, vocab_multiple)
        try:
            outputs = op.apply([_meta(t) for t in inputs])
            for kind, t in zip(step.rule.tp, outputs):
                if tp_size > 1:
                    tp_mod.shard(t, kind, tp_size)
        except _FIT_ERRORS as exc:
            problems.append(f"{', '.join(f'{k} {_shape(t)}' for k, t in zip(keys, inputs))}: {exc}")
            continue
        index = len(plan.steps)
        plan.steps.append(step)
        plan.sources.append(keys)
        if op is not step.rule.op:
            plan.ops[index] = op
        plan.inputs.update(zip(keys, map(meta_of, inputs)))
        for key, kind, t in zip(step.mcore_keys, step.rule.tp, outputs):
            plan.outputs[key], plan.producer[key], plan.kinds[key] = meta_of(t), index, kind
    drops = [re.compile(p) for p in rule_set.drop_hf]
    for key, value in source.items():
        if key in consumed:
            continue
        if any(d.match(key) for d in drops):
            plan.dropped[key] = meta_of(value)
        else:
            problems.append(f"unconsumed source tensor {key} {_shape(value)}")
    if problems:
        raise ConversionError("HF -> mcore conversion is not total", problems)
    return plan


def module_of(hf_key: str) -> str:
    """The part of a checkpoint an HF key belongs to, as a report names it: its first name
    component (``lm_head``, ``language_model``, ``text_model``), or the first two under the
    ``model.`` wrapper transformers 5 puts around a whole model (``model.language_model``)."""
    parts = hf_key.split(".")
    if parts[0] == "model" and len(parts) > 2:
        return ".".join(parts[:2])
    return parts[0]


def plan_mcore_to_hf(rule_set: RuleSet, source: Mapping, prefix: str = "") -> Plan:
    """The conversion of whole (TP = 1) mcore tensors ``source`` to HF keys under ``prefix``,
    checked as :func:`plan_hf_to_mcore`: every mcore tensor has its place, every op fits."""
    problems: list[str] = []
    plan = Plan([], [], {}, {}, {}, {}, prefix)
    consumed: set[str] = set()
    for step in iter_steps(rule_set):
        missing = [k for k in step.mcore_keys if k not in source]
        if missing:
            problems += [f"missing mcore tensor {k}" for k in missing]
            continue
        consumed.update(step.mcore_keys)
        inputs = [source[k] for k in step.mcore_keys]
        try:
            outputs = step.rule.op.invert([_meta(t) for t in inputs])
        except _FIT_ERRORS as exc:
            problems.append(f"{', '.join(f'{k} {_shape(t)}' for k, t in zip(step.mcore_keys, inputs))}: {exc}")
            continue
        index = len(plan.steps)
        plan.steps.append(step)
        plan.sources.append(step.mcore_keys)
        plan.inputs.update(zip(step.mcore_keys, map(meta_of, inputs)))
        for key, kind in zip(step.mcore_keys, step.rule.tp):
            plan.kinds[key] = kind
        for key, t in zip(step.hf_keys, outputs):
            key = key if not prefix else sys.intern(prefix + key)
            plan.outputs[key], plan.producer[key] = meta_of(t), index
    problems += [f"unconsumed mcore tensor {k} {_shape(v)}" for k, v in source.items() if k not in consumed]
    if problems:
        raise ConversionError("mcore -> HF conversion is not total", problems)
    return plan


class StepRunner:
    """The mcore tensors of an HF -> mcore :class:`Plan`, one key at a time, as consecutive dim-0
    pieces (views of what ``read(hf_key)`` returns, where the op only moves row blocks).

    A step with several outputs runs once; its other outputs wait until they are asked for.
    """

    def __init__(self, plan: Plan, read: Callable[[str], torch.Tensor]):
        self.plan, self.read = plan, read
        self._waiting: dict[str, tuple] = {}

    def run(self, key: str) -> tuple[list, list]:
        """(the pieces of ``key``, the source tensors its step read)."""
        if key in self._waiting:
            return self._waiting.pop(key)
        index = self.plan.producer[key]
        step = self.plan.steps[index]
        sources = self.plan.source_keys(key)
        inputs = [self.read(k) for k in sources]
        try:
            produced = self.plan.op(index).apply_pieces(inputs)
        except LayoutError as exc:  # a value the op refuses (the plan checked the shapes): name it
            raise LayoutError(f"{', '.join(sources)}: {exc}") from None
        outputs = dict(zip(step.mcore_keys, produced))
        for other, pieces in outputs.items():
            if other != key:
                self._waiting[other] = (pieces, inputs)
        return outputs[key], inputs

    def pieces(self, key: str) -> list:
        return self.run(key)[0]


class MemorySink:
    """Collects streamed mcore tensors as one state dict per TP rank (TE key spelling)."""

    def __init__(self, tp_size: int):
        self.tp_size = tp_size
        self.shards: list[dict] = [{} for _ in range(tp_size)]

    def put(self, key: str, kind: str, pieces: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]):
        tensor = owned(pieces, storages(inputs))
        for rank, part in enumerate(tp_mod.shard(tensor, kind, self.tp_size)):
            self.shards[rank][key] = part


def join(pieces: Sequence) -> torch.Tensor:
    """Consecutive dim-0 pieces as one tensor (the piece itself when there is one)."""
    tensors = [tp_mod.as_tensor(p) for p in pieces]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


def owned(pieces: Sequence, source_storages: set[int]) -> torch.Tensor:
    """``join(pieces)``, copied if it would share memory with a source (``storages(sources)``):
    what the in-memory API returns never aliases what it was given."""
    tensor = join(pieces)
    if tensor.numel() and tensor.untyped_storage().data_ptr() in source_storages:
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def stream_to_mcore(keys: Iterable[str], kinds: Mapping[str, str], produce: Callable, put: Callable) -> None:
    """Every mcore tensor of ``keys`` in order: ``put(key, tp_kind, *produce(key))``, where
    ``produce`` gives (pieces, the source tensors they came from). The one loop that the in-memory
    API and the checkpoint writers run."""
    for key in keys:
        pieces, inputs = produce(key)
        put(key, kinds[key], pieces, inputs)


def split_side(rule_set: RuleSet, shards: Sequence[Mapping[str, torch.Tensor]]) -> McoreShards:
    """Per-rank dicts holding mcore and side keys -> :class:`McoreShards`."""
    aside_keys = set(side_keys(rule_set))
    return McoreShards([{k: v for k, v in s.items() if k not in aside_keys} for s in shards],
                       [{k: v for k, v in s.items() if k in aside_keys} for s in shards],
                       side_keys(rule_set, "unused"))


def convert_hf_to_mcore(rule_set: RuleSet, hf_state: Mapping[str, torch.Tensor], tp_size: int = 1,
                        prefix: str | None = None, vocab_multiple: int = VOCAB_MULTIPLE) -> McoreShards:
    """HF state dict -> ``tp_size`` mcore state dicts (TE spelling), side tensors beside them."""
    plan = plan_hf_to_mcore(rule_set, hf_state, tp_size, prefix, vocab_multiple)
    sink = MemorySink(tp_size)
    try:
        stream_to_mcore(plan.outputs, plan.kinds, StepRunner(plan, hf_state.__getitem__).run, sink.put)
    except _FIT_ERRORS as exc:  # value-dependent failures a shape-only plan cannot foresee
        raise ConversionError("HF -> mcore conversion is not total", [str(exc)]) from None
    return split_side(rule_set, sink.shards)


def stream_to_hf(plan: Plan, pieces_of: Callable[[str], list], put: Callable[[str, list], None], *,
                 route: Callable | None = None, wanted: Callable[[str], bool] | None = None) -> None:
    """Every HF tensor of an mcore -> HF ``plan``, in table order: ``put(hf_key, pieces)``. The one
    loop that the in-memory API and the HF checkpoint writer run.

    ``pieces_of(mcore_key)`` gives a whole (TP = 1) mcore tensor as dim-0 pieces. ``route(op,
    pieces, shape, dtype)``, where given, may take a one-input op's outputs straight from those
    pieces (None when the op does more than select rows); otherwise they are joined first.
    ``wanted(hf_key)``, where given, limits the output to those keys (a step none of whose outputs
    is wanted reads nothing): one process's share of a checkpoint several write.
    """
    for index, step in enumerate(plan.steps):
        if wanted is not None and not any(wanted(plan.prefix + key) for key in step.hf_keys):
            continue
        keys = plan.sources[index]
        outputs = full = None
        if len(keys) == 1:
            pieces = pieces_of(keys[0])
            meta = plan.inputs[keys[0]]
            if route is not None:
                outputs = route(step.rule.op.invert_pieces, pieces, tuple(meta.shape), meta.dtype)
            if outputs is None:
                full = [join(pieces)]
            del pieces
        else:
            full = [join(pieces_of(k)) for k in keys]
        if outputs is None:
            try:
                outputs = step.rule.op.invert_pieces(full)
            except _FIT_ERRORS as exc:
                raise ConversionError("mcore -> HF conversion is not total", [f"{', '.join(keys)}: {exc}"]) from None
        del full
        for key, pieces in zip(step.hf_keys, outputs):
            if wanted is None or wanted(plan.prefix + key):
                put(plan.prefix + key, pieces)
        del outputs


def _merged_meta(parts: Sequence[torch.Tensor], kind: str) -> torch.Tensor:
    """The meta tensor of ``tp.merge(parts, kind)``, checking replicated copies agree."""
    if tp_mod.split_of(kind).cut_dim(parts[0].dim()) is None:
        tp_mod.check_replicated(parts)
        return _meta(parts[0])
    return tp_mod.merge([_meta(p) for p in parts], kind)


def convert_mcore_to_hf(rule_set: RuleSet, shards: Sequence[Mapping[str, torch.Tensor]],
                        prefix: str = "", side: Sequence[Mapping[str, torch.Tensor]] | None = None) -> dict:
    """Per-rank mcore state dicts (either key spelling) plus the per-rank side tensors (by default
    ``shards.side`` of :class:`McoreShards`) -> one HF state dict."""
    if not shards:
        raise ConversionError("mcore -> HF conversion needs at least one shard", ["got none"])
    if side is None:
        side = getattr(shards, "side", None) or [{} for _ in shards]
    if len(side) != len(shards):
        raise ConversionError("mcore -> HF conversion needs the side tensors of every TP rank",
                              [f"got {len(side)} side dict(s) for {len(shards)} rank(s)"])
    ranks = [to_te_spelling({**s, **extra}) for s, extra in zip(shards, side)]
    problems = list(rule_set.validate_tp(len(ranks))) if rule_set.validate_tp else []
    kinds = {k: kind for step in iter_steps(rule_set) for k, kind in zip(step.mcore_keys, step.rule.tp)}
    merged: dict = {}
    for key, value in ranks[0].items():
        absent = [r for r, s in enumerate(ranks) if key not in s]
        if absent:
            problems += [f"missing mcore tensor {key} on TP rank {r}" for r in absent]
        elif key not in kinds:
            merged[key] = value  # no rule takes it: the plan reports it
        else:
            try:
                merged[key] = _merged_meta([s[key] for s in ranks], kinds[key])
            except _FIT_ERRORS as exc:
                problems.append(f"{key} {_shape(value)}: {exc}")
    for r, s in enumerate(ranks[1:], start=1):
        problems += [f"unconsumed mcore tensor {k} {_shape(v)} on TP rank {r}" for k, v in s.items()
                     if k not in ranks[0]]
    try:
        plan = plan_mcore_to_hf(rule_set, merged, prefix)
    except ConversionError as exc:
        problems += exc.problems
    if problems:
        raise ConversionError("mcore -> HF conversion is not total", problems)
    sources = storages(t for s in ranks for t in s.values() if isinstance(t, torch.Tensor))
    out: dict = {}

    def put(key: str, pieces: list) -> None:
        out[key] = owned(pieces, sources)

    stream_to_hf(plan, lambda key: tp_mod.merge_pieces([s[key] for s in ranks], kinds[key]), put)
    return out


# --- composing families -----------------------------------------------------------------------

def nested_rules(inner: RuleSet, mcore_prefix: str, hf_prefix: str,
                 variable_prefix: str) -> tuple[tuple, dict]:
    """``inner``'s rules moved under other roots, for a sub-model inside a larger checkpoint.

    A VLM reuses its vision family's table instead of restating it: every mcore key gains
    ``mcore_prefix``, every HF key ``hf_prefix``, and every pattern variable ``{x}`` becomes
    ``{<variable_prefix>x}`` so that its range (e.g. the vision layer count) cannot collide with
    the outer table's (the language layer count). Ops and TP kinds are kept as they are. Returns
    ``(rules, variables)`` to merge into the outer :class:`RuleSet`; ``inner``'s prefixes, drops
    and TP validation stay with the caller to decide.
    """
    def move(pattern: str, prefix: str) -> str:
        return prefix + _VAR.sub(lambda m: "{" + variable_prefix + m.group(1) + "}", pattern)

    rules = tuple(Rule(tuple(move(k, mcore_prefix) for k in rule.mcore),
                       tuple(move(k, hf_prefix) for k in rule.hf), rule.op, rule.tp, rule.side)
                  for rule in inner.rules)
    return rules, {variable_prefix + name: n for name, n in inner.variables.items()}
