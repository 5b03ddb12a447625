"""Qwen3-VL whole: ``Qwen3VLForConditionalGeneration`` <-> Megatron's ``LLaVAModel`` tree, composed
of tables not restated here:

* the tower with its main and DeepStack mergers: the ``qwen3_vl`` family's table, its mcore side
  under ``vision_model.``, its HF side under ``model.visual.``, its variables renamed ``{vision_…}``;
* the decoder: the dense decoder part's table (``model.language_model.``, ``lm_head``) plus Qwen3's
  per-head q/k RMSNorm weights in mcore's ``self_attention.{q,k}_layernorm``.
"""

from __future__ import annotations

import re

from mmparity.config import tied_embeddings
from mmparity.mapping.rules import ConversionError, ConverterSpec, RuleSet, nested_rules, rename
from mmparity.models.parts.dense_decoder import mapping as language
from mmparity.models.qwen3_vl import mapping as tower

FORMATS = ("hf",)
LM_ROOT, HEAD = "model.language_model.", "lm_head.weight"


def tp_problems(cfg, tp: int) -> list[str]:
    if tp < 1:
        return []
    return tower.tp_problems(cfg.vision_config, tp) + language.tp_problems(cfg.text_config, tp)


def qk_norm_rules(lm_root: str = LM_ROOT) -> tuple:
    hf, mc = lm_root + "layers.{i}.self_attn.", language.MCORE_ROOT + "decoder.layers.{i}.self_attention."
    return (rename(mc + "q_layernorm.weight", hf + "q_norm.weight"),
            rename(mc + "k_layernorm.weight", hf + "k_norm.weight"))


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    if hf_format not in FORMATS:
        raise ConversionError("unknown HF layout for Qwen3-VL whole",
                              [f"got {hf_format!r}; this family knows {', '.join(FORMATS)}"])
    text, tied = cfg.text_config, tied_embeddings(cfg)
    vision, vision_vars = nested_rules(tower.rule_set(cfg.vision_config), "vision_model.", "model.visual.",
                                       "vision_")
    rules = language.language_rules(text, LM_ROOT, HEAD, tied=tied) + qk_norm_rules() + vision
    drops = (f"^{re.escape(HEAD)}$",) if tied else ()
    return RuleSet(rules=rules, variables={"i": text.num_hidden_layers, **vision_vars}, hf_prefixes=("",),
                   drop_hf=drops, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp),
                   part_tp={"language_model.": lambda tp: language.tp_problems(text, tp) if tp >= 1 else [],
                            "vision_model.": lambda tp: tower.tp_problems(cfg.vision_config, tp) if tp >= 1 else []})


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set)
