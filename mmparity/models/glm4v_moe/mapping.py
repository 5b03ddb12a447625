"""GLM-4.5V whole: ``Glm4vMoeForConditionalGeneration`` <-> Megatron's ``LLaVAModel`` tree, composed
of tables not restated here:

* the tower with its merger: the GLM tower's table (:mod:`mmparity.models.glm4v_vision.mapping`),
  its mcore side under ``vision_model.``, its HF side under ``model.visual.``, its variables renamed
  ``{vision_…}``;
* the decoder's attention, embedding, final norm and output head: the dense decoder part's table
  (``model.language_model.``, ``lm_head``; q/k/v and their biases fused per query group; rotate-half
  order on both sides, partial rotary included: no permutation), without its MLP rules;
* each layer's MLP: the DeepSeek-V3 part's (the ``first_k_dense_replace`` dense layers ``{d}`` with
  the post-attention norm fused into ``linear_fc1``; the MoE layers ``{m}`` with ``pre_mlp_layernorm``,
  ``mlp.router.weight`` / ``expert_bias`` (HF's ``e_score_correction_bias``), ``shared_experts`` and
  the routed experts in TEGroupedMLP's names, from transformers' stacked module tensors).

``hf`` is transformers' module names; what ``save_pretrained`` writes (one
``mlp.experts.{e}.{gate,up,down}_proj.weight`` per expert) is read and written back through
transformers' own conversion mapping by the registry, as stored.
"""

from __future__ import annotations

import re

from mmparity.config import tied_embeddings
from mmparity.mapping.rules import ConversionError, ConverterSpec, RuleSet, nested_rules
from mmparity.models.glm4v_vision import mapping as tower
from mmparity.models.parts.deepseek_v3 import mapping as experts
from mmparity.models.parts.dense_decoder import mapping as dense

FORMATS = ("hf",)
LM_ROOT, HEAD = "model.language_model.", "lm_head.weight"
_MLP = dense.MCORE_ROOT + "decoder.layers.{i}.mlp."


def language_problems(text, tp: int) -> list[str]:
    if tp < 1:
        return []
    sizes = {"text num_attention_heads": text.num_attention_heads,
             "text num_key_value_heads": text.num_key_value_heads,
             "text intermediate_size": text.intermediate_size,
             "text moe_intermediate_size": text.moe_intermediate_size}
    return [f"tp={tp} does not divide {name}={value}" for name, value in sizes.items() if value % tp]


def tp_problems(cfg, tp: int) -> list[str]:
    if tp < 1:
        return []
    return tower.tp_problems(cfg.vision_config, tp) + language_problems(cfg.text_config, tp)


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    if hf_format not in FORMATS:
        raise ConversionError("unknown HF layout for GLM-4.5V whole",
                              [f"got {hf_format!r}; this family knows {', '.join(FORMATS)}"])
    text, tied = cfg.text_config, tied_embeddings(cfg)
    vision, vision_vars = nested_rules(tower.rule_set(cfg.vision_config), "vision_model.", "model.visual.",
                                       "vision_")
    # The dense table's MLP rules range over every layer; here they are per layer kind.
    body = tuple(r for r in dense.language_rules(text, LM_ROOT, HEAD, tied=tied)
                 if not any(k.startswith(_MLP) for k in r.mcore))
    rules = body + experts.mlp_rules(text, LM_ROOT) + vision
    drops = experts.drops(text, LM_ROOT) + ((f"^{re.escape(HEAD)}$",) if tied else ())
    variables = {**experts.variables(text), **vision_vars}
    return RuleSet(rules=rules, variables=variables, hf_prefixes=("",), drop_hf=drops, hf_format=hf_format,
                   validate_tp=lambda tp: tp_problems(cfg, tp),
                   part_tp={"language_model.": lambda tp: language_problems(text, tp),
                            "vision_model.": lambda tp: tower.tp_problems(cfg.vision_config, tp) if tp >= 1 else []})


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set)
