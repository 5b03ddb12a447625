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

Qwen's own Qwen3-VL-MoE releases store the stacked experts transposed (``[E, H, 2F]`` and
``[E, F, H]``); transformers' ``from_pretrained`` turns each stacked tensor whose shape is not the
module's (its conversion mapping's ``Transpose(1, 2, check_dims=True)``) and keeps one that has
the module's shape. That layout is ``hf_experts_transposed`` here, told from the stored shapes
(:func:`detect_format`), read and written back as stored. Where a tensor's shape is the same in
both layouts (hidden size = 2F for ``gate_up_proj``, = F for ``down_proj``) in a release that
stores the others transposed, transformers keeps that one unturned, a misreading: refused.

The layer kinds are a set, not a range (``mlp_only_layers`` may name any layer), so the MLP rules
name their layers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from mmparity.mapping.ops import AmbiguousLayout, UnstackTransposed
from mmparity.mapping.rules import ConversionError, ConverterSpec, RuleSet, Rule, rename
from mmparity.models.parts.deepseek_v3.mapping import gated_mlp_rules, routed_expert_rules
from mmparity.models.qwen3_vl_moe.config import experts, moe_layers
from mmparity.models.qwen3_vl_whole import mapping as whole

# The module's layout (what transformers' save_pretrained writes), and Qwen's releases'.
TRANSPOSED = "hf_experts_transposed"
FORMATS = ("hf", TRANSPOSED)
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


def _sparse_mlp(hf: str, mc: str, count: int, transposed: bool = False) -> tuple:
    head = (rename(mc + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"),
            rename(mc + "mlp.router.weight", hf + "mlp.gate.weight"))
    if not transposed:
        return head + routed_expert_rules(hf, mc, count)
    routed = mc + "mlp.experts."
    # As the module's stacks, each entry stored transposed.
    return head + (Rule(tuple(routed + f"linear_fc1.weight{e}" for e in range(count)),
                        hf + "mlp.experts.gate_up_proj", UnstackTransposed(count), "gated"),
                   Rule(tuple(routed + f"linear_fc2.weight{e}" for e in range(count)),
                        hf + "mlp.experts.down_proj", UnstackTransposed(count), "row"))


def mlp_rules(text, lm_root: str = LM_ROOT, transposed: bool = False) -> tuple:
    moe, count = set(moe_layers(text)), experts(text)
    rules = ()
    for i in range(text.num_hidden_layers):
        hf, mc = f"{lm_root}layers.{i}.", f"{_MC}{i}."
        rules += _sparse_mlp(hf, mc, count, transposed) if i in moe else _dense_mlp(hf, mc)
    return rules


_STACKED = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$")


def detect_format(keys) -> str:
    """The experts' layout, from the stored shapes (``keys``: name -> something with ``shape``;
    bare names say nothing about it: the module's). Per layer, a ``gate_up_proj`` ``[E, a, b]``
    and a ``down_proj`` ``[E, c, d]`` are the module's layout when ``a = 2d`` and ``b = c``,
    transposed when ``b = 2c`` and ``a = d`` (never both). Shapes that are neither are left to
    the shape check against the config, which names them."""
    if not isinstance(keys, Mapping):
        return FORMATS[0]
    layers: dict = {}
    for key in keys:
        found = _STACKED.match(key)
        shape = tuple(getattr(keys[key], "shape", ()) or ()) if found else ()
        if len(shape) == 3:
            layers.setdefault(found.group(1), {})[found.group(2)] = shape
    transposed, square = [], []
    for prefix, pair in sorted(layers.items()):
        if len(pair) != 2:
            continue
        (_, a, b), (_, c, d) = pair["gate_up_proj"], pair["down_proj"]
        if b == 2 * c and a == d:
            transposed.append(prefix)
        square += [(prefix + name, shape) for name, shape in sorted(pair.items()) if shape[1] == shape[2]]
    if not transposed:
        return FORMATS[0]
    if square:
        key, shape = square[0]
        raise AmbiguousLayout(
            "the stacked experts' layout cannot be told from their shapes",
            [f"{key} is {list(shape)} in the module's layout and transposed alike, while {transposed[0]}* "
             f"are stored transposed ([E, H, 2F] / [E, F, H]); transformers keeps such a tensor unturned, "
             f"a misreading: say which layout the files are in with --hf-format {TRANSPOSED} (every stack "
             f"transposed, as Qwen's releases) or --hf-format {FORMATS[0]} (the module's)"])
    return TRANSPOSED


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    if hf_format not in FORMATS:
        raise ConversionError("unknown HF layout for Qwen3-VL-MoE whole",
                              [f"got {hf_format!r}; this family knows {', '.join(FORMATS)}"])
    dense = whole.rule_set(cfg, "hf")  # the experts' layout is this table's only difference
    # The dense table's MLP rules range over every layer; the MLPs here are per layer kind.
    kept = tuple(r for r in dense.rules if not any(k.startswith(_MC + "{i}.mlp.") for k in r.mcore))
    text = cfg.text_config
    language = dense.part_tp["language_model."]
    part_tp = {**dense.part_tp, "language_model.": lambda tp: language(tp) + _expert_problems(text, tp)}
    return RuleSet(rules=kept + mlp_rules(text, transposed=hf_format == TRANSPOSED), variables=dense.variables, hf_prefixes=dense.hf_prefixes,
                   drop_hf=dense.drop_hf, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp),
                   part_tp=part_tp)


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set, detect_format=detect_format)
