"""qwen3_5_lm: ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` <-> Megatron's ``GPTModel`` at the
root (its own keys, as Megatron-LM's ``pretrain_gpt.py`` builds, loads and saves it: no
``language_model.``), the ``qwen3_5_text`` part's table over the whole checkpoint (``model.`` body,
``lm_head``). Layouts: ``hf`` (transformers' module names, experts stacked per layer) and
``hf_checkpoint`` (what ``save_pretrained`` writes and the releases ship: one tensor per expert)."""

from __future__ import annotations

import re
from typing import Iterable

from mmparity.config import tied_embeddings
from mmparity.mapping.rules import ConversionError, ConverterSpec, RuleSet, part_rules
from mmparity.models.parts.qwen3_5_text import mapping as language

FORMATS = language.LAYOUTS
HEAD = "lm_head.weight"


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    if hf_format not in FORMATS:
        raise ConversionError("unknown HF layout for family 'qwen3_5_lm'",
                              [f"got {hf_format!r}; this family knows {', '.join(FORMATS)}"])
    tied = tied_embeddings(cfg)
    # The part's table is written for whole VLMs (under ``language_model.``); the language model
    # alone is GPTModel at the root, as Megatron-LM trains it, so the table is taken without it.
    check = lambda tp: language.tp_problems(cfg, tp) if tp >= 1 else []  # noqa: E731
    whole = RuleSet(rules=language.language_rules(cfg, "model.", HEAD, tied=tied, layout=hf_format),
                    variables=language.variables(cfg), hf_prefixes=("",), hf_format=hf_format,
                    # the release's multi-token-prediction layers: no model here builds them
                    drop_hf=(r"^mtp\.",) + ((f"^{re.escape(HEAD)}$",) if tied else ()),
                    validate_tp=check, part_tp={language.MCORE_ROOT: check})
    return part_rules(whole, language.MCORE_ROOT)


def detect_format(keys: Iterable[str]) -> str:
    return "hf_checkpoint" if any(re.search(r"\.mlp\.experts\.\d+\.", k) for k in keys) else "hf"


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set, detect_format=detect_format)
