"""Checkpoint conversion between HF and mcore state dicts: pure tensors and names.

This package imports neither transformers nor megatron. Each family has one module here holding
its rule table(s); :mod:`mmparity.families` says which module belongs to which family.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from mmparity.converters.rules import (ConversionError, RuleSet, convert_hf_to_mcore,
                                       convert_mcore_to_hf, detect_prefix, to_local_spelling)

__all__ = ["ConversionError", "hf_to_mcore", "mcore_to_hf", "rule_set_for", "detect_hf_format"]


def _module(name: str):
    from mmparity import families

    return families.get(name).converter()


def detect_hf_format(name: str, keys) -> str:
    """Which HF-side layout (e.g. ``hf`` or ``mistral``) a key set is in, from the keys alone."""
    module = _module(name)
    detect = getattr(module, "detect_format", None)
    return detect(list(keys)) if detect else module.FORMATS[0]


def rule_set_for(name: str, cfg, hf_format: str | None = None, keys=None) -> RuleSet:
    module = _module(name)
    if hf_format is None:
        hf_format = detect_hf_format(name, keys) if keys is not None else module.FORMATS[0]
    if hf_format not in module.FORMATS:
        raise ConversionError(f"unknown HF layout for family {name!r}",
                              [f"got {hf_format!r}; this family knows {', '.join(module.FORMATS)}"])
    return module.rule_set(cfg, hf_format)


def hf_to_mcore(name: str, hf_state_dict: Mapping[str, torch.Tensor], cfg, tp_size: int = 1,
                hf_format: str | None = None, spelling: str = "te") -> list[dict]:
    """HF state dict -> one mcore state dict per TP rank (Transformer Engine key spelling by default).

    ``hf_format`` picks the HF-side layout; by default it is detected from the keys. Prefixes of
    whole-VLM checkpoints (``model.vision_tower.`` …) are detected; the other parts of such a
    checkpoint are dropped explicitly, anything unexpected is an error.
    """
    rules = rule_set_for(name, cfg, hf_format, keys=hf_state_dict.keys())
    shards = convert_hf_to_mcore(rules, hf_state_dict, tp_size)
    if spelling == "local":
        return [to_local_spelling(s) for s in shards]
    if spelling != "te":
        raise ValueError(f"spelling must be 'te' or 'local', got {spelling!r}")
    return shards


def mcore_to_hf(name: str, shards: Sequence[Mapping[str, torch.Tensor]], cfg,
                hf_format: str | None = None, prefix: str = "") -> dict:
    """Per-rank mcore state dicts (either key spelling) -> HF state dict, keys under ``prefix``."""
    rules = rule_set_for(name, cfg, hf_format)
    return convert_mcore_to_hf(rules, shards, prefix=prefix)


def select_family_tensors(name: str, cfg, state: Mapping[str, torch.Tensor],
                          hf_format: str | None = None) -> tuple[dict, str, str]:
    """From a (possibly whole-VLM) HF state dict, the family's tensors with the prefix stripped.

    Returns ``(tensors, prefix, hf_format)``. Missing tensors are not an error here (conversion
    reports them); tensors outside the family are simply not selected.
    """
    from mmparity.converters.rules import expected_keys

    rules = rule_set_for(name, cfg, hf_format, keys=state.keys())
    prefix = detect_prefix(rules, state.keys())
    hf_keys, _ = expected_keys(rules)
    return ({k: state[prefix + k] for k in hf_keys if prefix + k in state}, prefix, rules.hf_format)
