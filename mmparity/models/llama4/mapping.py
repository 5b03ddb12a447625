"""Llama 4 whole: ``Llama4ForConditionalGeneration`` <-> Megatron's ``LLaVAModel`` tree
(``vision_model.``, ``vision_projection.``, ``language_model.``), composed of two registered
parts' tables, not restated here:

* the tower (with its pixel-shuffle adapter): the ``llama4_vision`` family's table, under
  ``vision_model.`` on both sides, its variables renamed ``{vision_…}``;
* the projector ``multi_modal_projector.linear_1`` (no bias) as
  ``vision_projection.encoder.linear_fc1.weight`` (``MultimodalProjector``'s affine name), whole
  on every TP rank;
* the language model: the ``llama4_text`` part's table, whose mcore side is ``language_model.``.

transformers' module names are what ``save_pretrained`` writes for this class: one layout.
"""

from __future__ import annotations

import re

from mmparity.config import tied_embeddings
from mmparity.mapping.rules import ConversionError, ConverterSpec, RuleSet, nested_rules, rename
from mmparity.models.llama4_vision import mapping as tower
from mmparity.models.parts.llama4_text import mapping as language

FORMATS = ("hf",)
LM_ROOT, HEAD = "language_model.model.", "language_model.lm_head.weight"


def tp_problems(cfg, tp: int) -> list[str]:
    if tp < 1:
        return []
    return tower.tp_problems(cfg.vision_config, tp) + language.tp_problems(cfg.text_config, tp)


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    if hf_format not in FORMATS:
        raise ConversionError("unknown HF layout for family 'llama4'",
                              [f"got {hf_format!r}; this family knows {', '.join(FORMATS)}"])
    vision, vision_vars = nested_rules(tower.rule_set(cfg.vision_config), "vision_model.", "vision_model.", "vision_")
    text, tied = cfg.text_config, tied_embeddings(cfg)
    rules = (language.language_rules(text, LM_ROOT, HEAD, tied=tied) + vision
             + (rename("vision_projection.encoder.linear_fc1.weight", "multi_modal_projector.linear_1.weight"),))
    drops = (f"^{re.escape(HEAD)}$",) if tied else ()
    return RuleSet(rules=rules, variables={**language.variables(text), **vision_vars}, hf_prefixes=("",),
                   drop_hf=drops, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp),
                   part_tp={"language_model.": lambda tp: language.tp_problems(text, tp) if tp >= 1 else [],
                            "vision_model.": lambda tp: tower.tp_problems(cfg.vision_config, tp) if tp >= 1 else []})


def experts(cfg) -> int:
    return language.experts(cfg.text_config)


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set)
