"""What a rule set says of the mcore state dict it makes, read off its steps: the keys in table
order, the TP kind of each, and the vocabulary tables padded past the HF vocabulary. The readers
and writers of every format, the conversion's checks and Megatron's loads all read these three."""

from __future__ import annotations

from mmparity.mapping import rules as R
from mmparity.mapping.ops import PadRows

__all__ = ["tp_kinds", "padded_tables", "mcore_order"]


def tp_kinds(rule_set: R.RuleSet) -> dict[str, str]:
    """mcore key -> its TP split kind, for every key the table makes (side keys included)."""
    return {key: kind for step in R.iter_steps(rule_set) for key, kind in zip(step.mcore_keys, step.rule.tp)}


def padded_tables(rule_set: R.RuleSet) -> dict[str, PadRows]:
    """The mcore keys of vocabulary tables padded past the HF vocabulary, with their padding."""
    return {key: step.rule.op for step in R.iter_steps(rule_set) if isinstance(step.rule.op, PadRows)
            for key in step.mcore_keys}


def mcore_order(rule_set: R.RuleSet) -> list[str]:
    """The keys of the mcore state dict proper (what Megatron's class holds), in table order."""
    aside = set(R.side_keys(rule_set))
    return [key for step in R.iter_steps(rule_set) for key in step.mcore_keys if key not in aside]
