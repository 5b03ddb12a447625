"""Gemma 4's vision tower: HF ``Gemma4VisionModel`` keys <-> the native tower's
(:mod:`mmparity.models.gemma4_vision.native`).

Megatron has no Gemma 4 tower; the layer keys are mcore's (``decoder.layers.N.self_attention.
linear_qkv`` …) with the norms where Gemma's other tables put them: the pre-norms fused into
``linear_qkv`` / ``linear_fc1`` (Transformer Engine's spelling), the post-attention and
post-feedforward norms on the row-parallel linear whose output they normalise
(``linear_proj.post_layernorm``, ``linear_fc2.post_layernorm``, Megatron-Bridge's names for
Gemma), q/k norms as ``q_layernorm`` / ``k_layernorm``.

One permutation: transformers rotates each half of a q/k head by its own axis (rotate-half within
the half); mcore rotates the whole head, so q and k rows and the q/k norm weights swap the middle
quarters of every head (:class:`~mmparity.mapping.ops.AxialRopeHalves`, its own inverse). v and o
are never permuted.

What Megatron's layout has no place for keeps its place on the module that uses it, named after
transformers' buffers, whole on every TP rank: a clipped linear's four bounds
(``input_min``, ``input_max``, ``output_min``, ``output_max``; on ``linear_qkv`` one set per
q / k / v, ``q_input_min`` …, on ``linear_fc1`` per gate / up), the 2-axis position table
(``position_embeddings.weight``, ``(2, size, hidden)`` as stored), the patch linear
(``patch_embed.proj.weight``, over transformers' (P, P, C) rows, as stored) and the standardize
vectors (``standardize.bias``, ``standardize.scale``: transformers' ``std_bias``, ``std_scale``).
"""

from __future__ import annotations

from mmparity.config import head_dim, num_heads, query_groups, tower_config_or_self
from mmparity.mapping.ops import AxialRopeHalves, FuseQKV, fuse_gate_up
from mmparity.mapping.rules import ConverterSpec, Rule, RuleSet, rename
from mmparity.models.gemma4_vision.config import BOUNDS
from mmparity.models.gemma4_vision.reference import MODEL_TYPES

FORMATS = ("hf",)
# A bare tower, or the vision tower of a whole Gemma 4 checkpoint (saved files and module names).
HF_PREFIXES = ("", "vision_tower.", "model.vision_tower.")
DROP_HF = (r"^(model\.)?language_model\.", r"^lm_head\.", r"^(model\.)?audio_tower\.",
           r"^(model\.)?embed_(vision|audio)\.")
# The clipped linears inside ``linear_qkv`` / ``linear_fc1``, by the part each one's rows hold.
QKV_PARTS = (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"))
FC1_PARTS = (("gate", "gate_proj"), ("up", "up_proj"))


def tp_problems(cfg, tp: int) -> list[str]:
    cfg = tower_config_or_self(cfg, MODEL_TYPES[0])
    sizes = {"num_key_value_heads (linear_qkv query groups)": query_groups(cfg),
             "num_attention_heads": num_heads(cfg),
             "intermediate_size (mlp.linear_fc1 / linear_fc2)": cfg.intermediate_size}
    return [f"tp={tp} does not divide {name} = {value}" for name, value in sizes.items() if tp >= 1 and value % tp]


def bound_rules(mcore: str, hf: str, part: str = "") -> tuple:
    """The four bounds of the clipped linear ``hf``, on the mcore linear ``mcore`` (``part``: which
    of its fused linears)."""
    prefix = f"{part}_" if part else ""
    return tuple(rename(f"{mcore}.{prefix}{bound}", f"{hf}.{bound}") for bound in BOUNDS)


def layer_rules(cfg) -> tuple:
    heads, groups, d = num_heads(cfg), query_groups(cfg), head_dim(cfg)
    qk = AxialRopeHalves(heads, d)
    hf, mc = "encoder.layers.{i}.", "decoder.layers.{i}."
    attn, sa, mlp, mm = hf + "self_attn.", mc + "self_attention.", hf + "mlp.", mc + "mlp."
    rules = (
        rename(sa + "linear_qkv.layer_norm_weight", hf + "input_layernorm.weight"),
        Rule(sa + "linear_qkv.weight", tuple(f"{attn}{p}.linear.weight" for _, p in QKV_PARTS),
             FuseQKV(heads, groups, d, pre=(qk, AxialRopeHalves(groups, d), None)), "qkv"),
        Rule(sa + "q_layernorm.weight", attn + "q_norm.weight", AxialRopeHalves(1, d)),
        Rule(sa + "k_layernorm.weight", attn + "k_norm.weight", AxialRopeHalves(1, d)),
        rename(sa + "linear_proj.weight", attn + "o_proj.linear.weight", "row"),
        rename(sa + "linear_proj.post_layernorm.weight", hf + "post_attention_layernorm.weight"),
        rename(mm + "linear_fc1.layer_norm_weight", hf + "pre_feedforward_layernorm.weight"),
        Rule(mm + "linear_fc1.weight", (mlp + "gate_proj.linear.weight", mlp + "up_proj.linear.weight"),
             fuse_gate_up(), "gated"),
        rename(mm + "linear_fc2.weight", mlp + "down_proj.linear.weight", "row"),
        rename(mm + "linear_fc2.post_layernorm.weight", hf + "post_feedforward_layernorm.weight"),
    )
    if cfg.use_clipped_linears:
        for part, linear in QKV_PARTS:
            rules += bound_rules(sa + "linear_qkv", attn + linear, part)
        rules += bound_rules(sa + "linear_proj", attn + "o_proj")
        for part, linear in FC1_PARTS:
            rules += bound_rules(mm + "linear_fc1", mlp + linear, part)
        rules += bound_rules(mm + "linear_fc2", mlp + "down_proj")
    return rules


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    cfg = tower_config_or_self(cfg, MODEL_TYPES[0])
    rules = (
        rename("patch_embed.proj.weight", "patch_embedder.input_proj.weight"),
        rename("position_embeddings.weight", "patch_embedder.position_embedding_table"),
        *layer_rules(cfg),
    )
    if cfg.standardize:
        rules += (rename("standardize.bias", "std_bias"), rename("standardize.scale", "std_scale"))
    return RuleSet(rules=rules, variables={"i": cfg.num_hidden_layers}, hf_prefixes=HF_PREFIXES,
                   drop_hf=DROP_HF, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp))


# Not a LLaVA tower: transformers builds it only inside Gemma 4, whose family reads this table.
SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set)
