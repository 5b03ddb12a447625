"""Kimi-K2.5 whole: ``Kimi_K25ForConditionalGeneration`` (MoonViT + projector + DeepSeek-V3
decoder) <-> Megatron's ``LLaVAModel`` tree (``vision_model.``, ``vision_projection.``,
``language_model.``), composed of two registered parts' tables, not restated here:

* the tower and projector: the ``kimi_k25`` family's table for a whole config (its mcore side is
  already rooted at ``vision_model.`` / ``vision_projection.``), its variables renamed
  ``{vision_…}`` and its HF keys put under the whole model's root;
* the language model: the ``deepseek_v3`` part's table, whose mcore side is ``language_model.``.

HF-side layouts (``FORMATS``), the decoder's names in brackets:

* ``hf``: transformers 5's module names, ``model.vision_tower.``, ``model.mm_projector.``,
  ``model.language_model.`` (experts stacked per layer), ``lm_head``;
* ``release``: the released checkpoints, ``vision_tower.encoder.blocks.N.wqkv`` …,
  ``mm_projector.proj.{0,2}``, ``language_model.model.layers.N.`` (one tensor per expert),
  ``language_model.lm_head``;
* ``kimi_vl``: the release with Kimi-VL's projector names (``multi_modal_projector.``).

What transformers' ``save_pretrained`` writes for this class (the decoder as
``language_model.model.blocks.N``, the projector norm under ``model.``) is no table here: the family
registry reads it through transformers' own conversion mapping (``families.TRANSFORMERS_LAYOUT``).
"""

from __future__ import annotations

import re
from typing import Iterable

from mmparity.models.parts.deepseek_v3 import mapping as language
from mmparity.models.kimi_k25 import mapping as tower
from mmparity.mapping.rules import ConversionError, ConverterSpec, RuleSet, nested_rules
from mmparity.config import tied_embeddings

FORMATS = ("hf", "release", "kimi_vl")

# Per layout: the whole model's root for tower and projector, the decoder body's root, the output
# head, and the decoder part's layout.
_ROOTS = {
    "hf": ("model.", "model.language_model.", "lm_head.weight", "hf"),
    "release": ("", "language_model.model.", "language_model.lm_head.weight", "hf_checkpoint"),
    "kimi_vl": ("", "language_model.model.", "language_model.lm_head.weight", "hf_checkpoint"),
}


def tp_problems(cfg, tp: int) -> list[str]:
    if tp < 1:
        return []
    return tower.tp_problems(cfg, tp) + language.tp_problems(cfg.text_config, tp)


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    if hf_format not in FORMATS:
        raise ConversionError("unknown HF layout for family 'kimi_k25_vl'",
                              [f"got {hf_format!r}; this family knows {', '.join(FORMATS)}"])
    root, lm_root, head_key, decoder = _ROOTS[hf_format]
    vision, vision_vars = nested_rules(tower.rule_set(cfg, hf_format), "", root, "vision_")
    text = cfg.text_config
    tied = tied_embeddings(cfg)
    rules = language.language_rules(text, lm_root, head_key, tied=tied, layout=decoder) + vision
    drops = language.drops(text, lm_root) + ((f"^{re.escape(head_key)}$",) if tied else ())
    return RuleSet(rules=rules, variables={**language.variables(text), **vision_vars}, hf_prefixes=("",),
                   drop_hf=drops, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp),
                   part_tp={"language_model.": lambda tp: language.tp_problems(text, tp) if tp >= 1 else [],
                            "vision_model.": lambda tp: tower.tp_problems(cfg, tp) if tp >= 1 else []},
                   mcore_note=tower.PROJECTOR_NOTE.format(m2=tower._merge_tokens(cfg)))


def detect_format(keys: Iterable[str]) -> str:
    found = tower.detect_format(keys)
    if found == "hf_saved":
        found = "release"
    return found


def experts(cfg) -> int:
    return language.routed_experts(cfg.text_config)


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set, detect_format=detect_format)
