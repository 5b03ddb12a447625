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

import itertools
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch

from mmparity.converters import tp as tp_mod
from mmparity.converters.ops import Identity, LayoutError, Op
from mmparity.converters.tp import ShardError

_VAR = re.compile(r"\{(\w+)\}")


class ConversionError(ValueError):
    """Every reason a conversion cannot be total, listed at once."""

    def __init__(self, title: str, problems: Sequence[str]):
        self.title = title
        self.problems = list(problems)
        shown = self.problems[:60]
        more = len(self.problems) - len(shown)
        body = "\n".join(f"  - {p}" for p in shown) + (f"\n  … and {more} more" if more > 0 else "")
        super().__init__(f"{title} ({len(self.problems)} problem(s)):\n{body}")


@dataclass(frozen=True)
class Rule:
    mcore: tuple
    hf: tuple
    op: Op = field(default_factory=Identity)
    tp: tuple = ("replicated",)

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
            if kind not in tp_mod.KINDS:
                raise ValueError(f"rule {self.mcore}: unknown TP kind {kind!r}")


def _as_tuple(x) -> tuple:
    return (x,) if isinstance(x, str) else tuple(x)


def rename(mcore: str, hf: str, tp: str = "replicated") -> Rule:
    return Rule(mcore, hf, Identity(), tp)


@dataclass(frozen=True)
class RuleSet:
    """One family's table for one HF layout, with the variable ranges of its patterns."""

    rules: tuple
    variables: Mapping[str, int]
    hf_prefixes: tuple = ("",)
    # Whole-key regexes for HF tensors that are deliberately not converted (e.g. a language model
    # next to the vision tower). Everything else unconsumed is an error.
    drop_hf: tuple = ()
    hf_format: str = "hf"
    # Checked before converting, e.g. "tp must divide the query groups"; returns error messages.
    validate_tp: Callable[[int], list] | None = None

    def bindings(self, patterns: Iterable[str]) -> list[dict]:
        names = sorted({v for p in patterns for v in _VAR.findall(p)})
        ranges = [range(self.variables[n]) for n in names]
        return [dict(zip(names, combo)) for combo in itertools.product(*ranges)]


def _fill(pattern: str, binding: Mapping[str, int]) -> str:
    return _VAR.sub(lambda m: str(binding[m.group(1)]), pattern)


@dataclass
class Step:
    """One rule under one binding: which keys it reads and writes."""

    rule: Rule
    hf_keys: list
    mcore_keys: list


def plan(rule_set: RuleSet) -> list[Step]:
    steps = []
    for rule in rule_set.rules:
        for binding in rule_set.bindings(rule.hf + rule.mcore):
            steps.append(Step(rule, [_fill(p, binding) for p in rule.hf],
                              [_fill(p, binding) for p in rule.mcore]))
    return steps


def expected_keys(rule_set: RuleSet) -> tuple[list[str], list[str]]:
    """(HF keys without prefix, mcore keys) that a complete checkpoint of this config has."""
    steps = plan(rule_set)
    return ([k for s in steps for k in s.hf_keys], [k for s in steps for k in s.mcore_keys])


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


def to_te_spelling(state: Mapping[str, torch.Tensor]) -> dict:
    """Read either spelling: local-spec norm keys become TE fused-norm keys; ``_extra_state`` goes."""
    out = {}
    for key, value in state.items():
        if key.endswith("._extra_state") or key.endswith("_extra_state"):
            continue
        out[_respell(key, _LOCAL_TO_TE)] = value
    return out


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


# --- the two directions -----------------------------------------------------------------------

def _shape(t) -> str:
    return str(tuple(t.shape)) if hasattr(t, "shape") else "?"


def convert_hf_to_mcore(rule_set: RuleSet, hf_state: Mapping[str, torch.Tensor], tp_size: int = 1,
                        prefix: str | None = None) -> list[dict]:
    """HF state dict -> ``tp_size`` mcore state dicts (TE spelling)."""
    problems = list(rule_set.validate_tp(tp_size)) if rule_set.validate_tp else []
    if tp_size < 1:
        problems.append(f"tp_size must be >= 1, got {tp_size}")
    if problems:
        raise ConversionError("tensor-parallel size does not fit this model", problems)
    if prefix is None:
        prefix = detect_prefix(rule_set, hf_state.keys())
    steps = plan(rule_set)
    consumed: set[str] = set()
    shards: list[dict] = [{} for _ in range(tp_size)]
    for step in steps:
        keys = [prefix + k for k in step.hf_keys]
        missing = [k for k in keys if k not in hf_state]
        if missing:
            problems += [f"missing source tensor {k}" for k in missing]
            continue
        consumed.update(keys)
        tensors = [hf_state[k] for k in keys]
        try:
            outs = step.rule.op.apply(tensors)
            for key, kind, tensor in zip(step.mcore_keys, step.rule.tp, outs):
                for rank, part in enumerate(tp_mod.shard(tensor, kind, tp_size)):
                    shards[rank][key] = part
        except (LayoutError, ShardError, RuntimeError) as exc:
            problems.append(f"{', '.join(f'{k} {_shape(t)}' for k, t in zip(keys, tensors))}: {exc}")
    problems += _unconsumed(rule_set, hf_state, consumed)
    if problems:
        raise ConversionError("HF -> mcore conversion is not total", problems)
    return shards


def _unconsumed(rule_set: RuleSet, hf_state: Mapping, consumed: set) -> list[str]:
    drops = [re.compile(p) for p in rule_set.drop_hf]
    return [f"unconsumed source tensor {k} {_shape(v)}" for k, v in hf_state.items()
            if k not in consumed and not any(d.match(k) for d in drops)]


def convert_mcore_to_hf(rule_set: RuleSet, shards: Sequence[Mapping[str, torch.Tensor]],
                        prefix: str = "") -> dict:
    """Per-rank mcore state dicts (either key spelling) -> one HF state dict."""
    if not shards:
        raise ConversionError("mcore -> HF conversion needs at least one shard", ["got none"])
    ranks = [to_te_spelling(s) for s in shards]
    problems = list(rule_set.validate_tp(len(ranks))) if rule_set.validate_tp else []
    out: dict = {}
    consumed: set[str] = set()
    for step in plan(rule_set):
        missing = [(r, k) for k in step.mcore_keys for r, s in enumerate(ranks) if k not in s]
        if missing:
            problems += [f"missing mcore tensor {k} on TP rank {r}" for r, k in missing]
            continue
        consumed.update(step.mcore_keys)
        try:
            full = [tp_mod.merge([s[k] for s in ranks], kind)
                    for k, kind in zip(step.mcore_keys, step.rule.tp)]
            for key, tensor in zip(step.hf_keys, step.rule.op.invert(full)):
                out[prefix + key] = tensor
        except (LayoutError, ShardError, RuntimeError) as exc:
            shapes = ", ".join(f"{k} {_shape(ranks[0][k])}" for k in step.mcore_keys)
            problems.append(f"{shapes}: {exc}")
    for r, s in enumerate(ranks):
        problems += [f"unconsumed mcore tensor {k} {_shape(v)} on TP rank {r}"
                     for k, v in s.items() if k not in consumed]
    if problems:
        raise ConversionError("mcore -> HF conversion is not total", problems)
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
                       tuple(move(k, hf_prefix) for k in rule.hf), rule.op, rule.tp)
                  for rule in inner.rules)
    return rules, {variable_prefix + name: n for name, n in inner.variables.items()}
