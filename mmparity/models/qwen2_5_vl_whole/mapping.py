"""Qwen2.5-VL whole: ``Qwen2_5_VLForConditionalGeneration`` <-> Megatron's ``LLaVAModel`` tree,
composed of tables not restated here:

* the tower with its merger: the ``qwen2_5_vl`` family's table, its mcore side under
  ``vision_model.``, its HF side under ``model.visual.``, its variables renamed ``{vision_…}``;
* the decoder: the dense decoder part's table for Qwen2 (``model.language_model.``, ``lm_head``,
  q/k/v biases fused with their weights' per-group order).
"""

from __future__ import annotations

import re

from mmparity.config import tied_embeddings
from mmparity.mapping.rules import ConversionError, ConverterSpec, RuleSet, nested_rules
from mmparity.models.parts.dense_decoder import mapping as language
from mmparity.models.qwen2_5_vl import mapping as tower
from mmparity.models.qwen2_5_vl_whole.config import Qwen2Text

FORMATS = ("hf",)
LM_ROOT, HEAD = "model.language_model.", "lm_head.weight"


def tp_problems(cfg, tp: int) -> list[str]:
    if tp < 1:
        return []
    return tower.tp_problems(cfg.vision_config, tp) + language.tp_problems(cfg.text_config, tp)


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    if hf_format not in FORMATS:
        raise ConversionError("unknown HF layout for Qwen2.5-VL whole",
                              [f"got {hf_format!r}; this family knows {', '.join(FORMATS)}"])
    text, tied = cfg.text_config, tied_embeddings(cfg)
    vision, vision_vars = nested_rules(tower.rule_set(cfg.vision_config), "vision_model.", "model.visual.",
                                       "vision_")
    rules = language.language_rules(Qwen2Text(text), LM_ROOT, HEAD, tied=tied) + vision
    drops = (f"^{re.escape(HEAD)}$",) if tied else ()
    return RuleSet(rules=rules, variables={"i": text.num_hidden_layers, **vision_vars}, hf_prefixes=("",),
                   drop_hf=drops, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp),
                   part_tp={"language_model.": lambda tp: language.tp_problems(text, tp) if tp >= 1 else [],
                            "vision_model.": lambda tp: tower.tp_problems(cfg.vision_config, tp) if tp >= 1 else []})


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set)
