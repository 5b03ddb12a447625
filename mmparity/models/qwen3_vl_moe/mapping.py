"""Qwen3-VL-MoE whole: ``Qwen3VLMoeForConditionalGeneration`` <-> Megatron's ``LLaVAModel`` tree,
composed of tables not restated here:

* the tower with its main and DeepStack mergers, the embedding, attention with its q/k norms, the
  final norm and the output head: Qwen3-VL whole's table (``qwen3_vl_whole``), without its MLP rules;
* per layer its MLP, by the kind transformers builds there (:func:`~.config.moe_layers`): a dense
  layer's ``gate_proj``/``up_proj``/``down_proj`` as the dense decoder's ``linear_fc1``/``linear_fc2``
  with the post-attention norm fused in; an MoE layer's ``pre_mlp_layernorm``, ``mlp.router.weight``
  (HF's ``mlp.gate.weight``) and routed experts in TEGroupedMLP's names
  (``mlp.experts.linear_fc1.weight{e}`` / ``linear_fc2.weight{e}``, global numbers that the expert
  axis renumbers per EP rank), each one entry of HF's stacked ``gate_up_proj`` (``[E, 2F, H]``: its
  rows ``[gate; up]`` are SwiGLU's ``linear_fc1`` rows as they stand) and ``down_proj``
  (``[E, H, F]``). Written back stacked, as read.

The layer kinds are a set, not a range (``mlp_only_layers`` may name any layer), so the MLP rules
name their layers.
"""

from __future__ import annotations

from mmparity.mapping.rules import ConversionError, ConverterSpec, RuleSet, rename
from mmparity.models.parts.deepseek_v3.mapping import gated_mlp_rules, routed_expert_rules
from mmparity.models.qwen3_vl_moe.config import experts, moe_layers
from mmparity.models.qwen3_vl_whole import mapping as whole

FORMATS = ("hf",)
LM_ROOT = whole.LM_ROOT
_MC = "language_model.decoder.layers."


def _expert_problems(text, tp: int) -> list[str]:
    """Expert tensor parallelism is TP (Megatron's default): it splits each expert's width."""
    if tp < 1 or not experts(text) or not text.moe_intermediate_size % tp:
        return []
    return [f"tp={tp} does not divide text moe_intermediate_size={text.moe_intermediate_size}"]


def tp_problems(cfg, tp: int) -> list[str]:
    if tp < 1:
        return []
    return whole.tp_problems(cfg, tp) + _expert_problems(cfg.text_config, tp)


def _dense_mlp(hf: str, mc: str) -> tuple:
    return (rename(mc + "mlp.linear_fc1.layer_norm_weight", hf + "post_attention_layernorm.weight"),
            *gated_mlp_rules(hf + "mlp.", mc + "mlp."))


def _sparse_mlp(hf: str, mc: str, count: int) -> tuple:
    return (rename(mc + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"),
            rename(mc + "mlp.router.weight", hf + "mlp.gate.weight"), *routed_expert_rules(hf, mc, count))


def mlp_rules(text, lm_root: str = LM_ROOT) -> tuple:
    moe, count = set(moe_layers(text)), experts(text)
    rules = ()
    for i in range(text.num_hidden_layers):
        hf, mc = f"{lm_root}layers.{i}.", f"{_MC}{i}."
        rules += _sparse_mlp(hf, mc, count) if i in moe else _dense_mlp(hf, mc)
    return rules


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    if hf_format not in FORMATS:
        raise ConversionError("unknown HF layout for Qwen3-VL-MoE whole",
                              [f"got {hf_format!r}; this family knows {', '.join(FORMATS)}"])
    dense = whole.rule_set(cfg, "hf")
    # The dense table's MLP rules range over every layer; the MLPs here are per layer kind.
    kept = tuple(r for r in dense.rules if not any(k.startswith(_MC + "{i}.mlp.") for k in r.mcore))
    text = cfg.text_config
    language = dense.part_tp["language_model."]
    part_tp = {**dense.part_tp, "language_model.": lambda tp: language(tp) + _expert_problems(text, tp)}
    return RuleSet(rules=kept + mlp_rules(text), variables=dense.variables, hf_prefixes=dense.hf_prefixes,
                   drop_hf=dense.drop_hf, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp),
                   part_tp=part_tp)


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set)
