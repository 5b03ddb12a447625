"""Qwen3.5 whole: ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` <->
Megatron's ``LLaVAModel`` tree, composed of tables not restated here:

* the tower and its merger: the ``qwen3_5`` family's table, its mcore side under ``vision_model.``,
  its HF side under ``model.visual.``, its variables renamed ``{vision_…}``;
* the decoder: the ``qwen3_5_text`` part's table (``model.language_model.``, ``lm_head``) in its
  two layouts: ``hf`` (transformers' module names, experts stacked per layer) and ``hf_checkpoint``
  (what ``save_pretrained`` writes and the releases ship: one tensor per expert).

A release's multi-token-prediction layers (``mtp.*``) are left out: no model here builds them;
conversion lists them with their count and bytes.
"""

from __future__ import annotations

import re

from mmparity.config import tied_embeddings
from mmparity.mapping.rules import ConversionError, ConverterSpec, RuleSet, nested_rules
from mmparity.models.parts.qwen3_5_text import mapping as language
from mmparity.models.qwen3_5 import mapping as tower
from mmparity.models.qwen3_5_lm.mapping import detect_format

FORMATS = language.LAYOUTS
LM_ROOT, HEAD = "model.language_model.", "lm_head.weight"
MTP = r"^mtp\."


def _language_tp(text, tp: int) -> list[str]:
    return language.tp_problems(text, tp) if tp >= 1 else []


def _tower_tp(vision, tp: int) -> list[str]:
    return tower.tp_problems(vision, tp) if tp >= 1 else []


def tp_problems(cfg, tp: int) -> list[str]:
    return _tower_tp(cfg.vision_config, tp) + _language_tp(cfg.text_config, tp)


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    if hf_format not in FORMATS:
        raise ConversionError("unknown HF layout for Qwen3.5 whole",
                              [f"got {hf_format!r}; this family knows {', '.join(FORMATS)}"])
    text, vision_cfg, tied = cfg.text_config, cfg.vision_config, tied_embeddings(cfg)
    vision, vision_vars = nested_rules(tower.rule_set(vision_cfg), "vision_model.", "model.visual.", "vision_")
    rules = language.language_rules(text, LM_ROOT, HEAD, tied=tied, layout=hf_format) + vision
    drops = (MTP,) + ((f"^{re.escape(HEAD)}$",) if tied else ())
    return RuleSet(rules=rules, variables={**language.variables(text), **vision_vars}, hf_prefixes=("",),
                   drop_hf=drops, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp),
                   part_tp={"language_model.": lambda tp: _language_tp(text, tp),
                            "vision_model.": lambda tp: _tower_tp(vision_cfg, tp)})


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set, detect_format=detect_format)
