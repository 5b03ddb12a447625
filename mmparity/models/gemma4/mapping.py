"""Gemma 4 whole: ``Gemma4ForConditionalGeneration`` <-> Megatron's ``LLaVAModel`` tree
(``vision_model.``, ``vision_projection.``, ``language_model.``), composed of two registered
parts' tables, not restated here:

* the tower: the ``gemma4_vision`` family's table under ``vision_model.`` (HF
  ``model.vision_tower.``), its variables renamed ``{vision_…}``;
* the projector ``model.embed_vision`` (a weightless RMSNorm, then a bias-free linear) as
  ``vision_projection.encoder.linear_fc1.weight`` (``MultimodalProjector``'s affine name), whole
  on every TP rank;
* the language model: the ``gemma4_text`` part's table under ``model.language_model.``; the head is
  tied (``lm_head.weight``, where a state dict lists it, is dropped: the table's values are used).

E2B / E4B's per-layer inputs and shared layers: the part's :mod:`~mmparity.models.parts.gemma4_text.per_layer`
rules; key / value tensors a checkpoint carries for shared layers (no model reads them) are left out
by name and counted.

The audio tower and its embedder (``model.audio_tower.``, ``model.embed_audio.``) are out of scope:
dropped by name, and convert reports them in counts and bytes. transformers' module names are what
``save_pretrained`` writes for this class: one layout.
"""

from __future__ import annotations

import re

from mmparity.config import tied_embeddings
from mmparity.mapping.rules import ConversionError, ConverterSpec, RuleSet, nested_rules, rename
from mmparity.models.gemma4_vision import mapping as tower
from mmparity.models.parts.gemma4_text import mapping as language
from mmparity.models.parts.gemma4_text import per_layer
from mmparity.models.parts.gemma4_text.config import config_problems as language_problems
from mmparity.models.parts.gemma4_text.config import tp_problems as language_tp_problems

FORMATS = ("hf",)
TOWER_ROOT, LM_ROOT, HEAD = "model.vision_tower.", "model.language_model.", "lm_head.weight"
AUDIO = (r"^model\.audio_tower\.", r"^model\.embed_audio\.")


def tp_problems(cfg, tp: int) -> list[str]:
    if tp < 1:
        return []
    return tower.tp_problems(cfg.vision_config, tp) + language_tp_problems(cfg.text_config, tp)


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    if hf_format not in FORMATS:
        raise ConversionError("unknown HF layout for family 'gemma4'",
                              [f"got {hf_format!r}; this family knows {', '.join(FORMATS)}"])
    problems = language_problems(cfg.text_config)
    if problems:
        # Tensors no rule places (the MoE block's) would only show as
        # unconsumed: say which part of the model is not built instead.
        raise ConversionError("this Gemma 4 model has parts the family does not build", problems)
    vision, vision_vars = nested_rules(tower.rule_set(cfg.vision_config), "vision_model.", TOWER_ROOT, "vision_")
    text, tied = cfg.text_config, tied_embeddings(cfg)
    rules = (language.language_rules(text, LM_ROOT, HEAD, tied=tied) + vision
             + (rename("vision_projection.encoder.linear_fc1.weight", "model.embed_vision.embedding_projection.weight"),))
    drops = AUDIO + ((f"^{re.escape(HEAD)}$",) if tied else ()) + per_layer.unused_hf(text, LM_ROOT)
    return RuleSet(rules=rules, variables={**language.variables(text), **vision_vars}, hf_prefixes=("",),
                   drop_hf=drops, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp),
                   part_tp={"language_model.": lambda tp: language_tp_problems(text, tp),
                            "vision_model.": lambda tp: tower.tp_problems(cfg.vision_config, tp) if tp >= 1 else []})


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set)
