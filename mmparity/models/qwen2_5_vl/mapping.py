"""Qwen2.5-VL vision tower: HF ``Qwen2_5_VisionTransformerPretrainedModel`` keys <-> native
``Qwen25VLViTModel``.

The layers as Qwen3.5's tower maps them (``blocks.N`` -> ``decoder.layers.N``, HF's fused
``attn.qkv`` regrouped per query group so that a TP rank's rows hold whole heads, rotate-half RoPE
on both sides: no q/k permutation), with RMSNorm weights only, and the gated MLP's gate and up
projections (weights and biases) fused into ``linear_fc1`` as [gate; up], split per TP rank by
halves. The merger's ``ln_q`` and ``mlp.0`` / ``mlp.2`` take the parent merger's names
(``patch_norm``, ``linear_fc1``, ``linear_fc2``), whole on every TP rank. The HF side is a
standalone tower or a whole ``Qwen2_5_VLForConditionalGeneration`` (``model.visual.``; ``visual.``
as transformers 4 saved it), whose language model is dropped.
"""

from __future__ import annotations

from mmparity.config import head_dim, num_heads
from mmparity.mapping.ops import RegroupQKV, fuse_gate_up
from mmparity.mapping.rules import ConverterSpec, Rule, RuleSet, rename

FORMATS = ("hf",)
HF_PREFIXES = ("", "visual.", "model.visual.")
DROP_HF = (r"^(model\.)?language_model\.", r"^lm_head\.")


def _vision(cfg):
    sub = getattr(cfg, "vision_config", None)
    return sub if sub is not None and hasattr(sub, "fullatt_block_indexes") else cfg


def tp_problems(cfg, tp: int) -> list[str]:
    cfg = _vision(cfg)
    sizes = {"num_heads (linear_qkv query groups, linear_proj input)": num_heads(cfg),
             "intermediate_size (mlp.linear_fc1 / linear_fc2)": cfg.intermediate_size}
    return [f"tp={tp} does not divide {name} = {value}" for name, value in sizes.items()
            if tp >= 1 and value % tp]


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    cfg = _vision(cfg)
    heads = num_heads(cfg)
    regroup = RegroupQKV(heads, heads, head_dim(cfg))
    hf, native = "blocks.{i}.", "decoder.layers.{i}."
    qkv, fc1, mlp = native + "self_attention.linear_qkv.", native + "mlp.linear_fc1.", hf + "mlp."
    rules = (
        rename("patch_embed.proj.weight", "patch_embed.proj.weight"),
        rename(qkv + "layer_norm_weight", hf + "norm1.weight"),
        Rule(qkv + "weight", hf + "attn.qkv.weight", regroup, "qkv"),
        Rule(qkv + "bias", hf + "attn.qkv.bias", regroup, "qkv"),
        rename(native + "self_attention.linear_proj.weight", hf + "attn.proj.weight", "row"),
        # Row-parallel biases are added after the all-reduce: every rank holds all of it.
        rename(native + "self_attention.linear_proj.bias", hf + "attn.proj.bias"),
        rename(fc1 + "layer_norm_weight", hf + "norm2.weight"),
        Rule(fc1 + "weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), fuse_gate_up(), "gated"),
        Rule(fc1 + "bias", (mlp + "gate_proj.bias", mlp + "up_proj.bias"), fuse_gate_up(), "gated"),
        rename(native + "mlp.linear_fc2.weight", mlp + "down_proj.weight", "row"),
        rename(native + "mlp.linear_fc2.bias", mlp + "down_proj.bias"),
        rename("merger.patch_norm.weight", "merger.ln_q.weight"),
        rename("merger.linear_fc1.weight", "merger.mlp.0.weight"),
        rename("merger.linear_fc1.bias", "merger.mlp.0.bias"),
        rename("merger.linear_fc2.weight", "merger.mlp.2.weight"),
        rename("merger.linear_fc2.bias", "merger.mlp.2.bias"),
    )
    return RuleSet(rules=rules, variables={"i": cfg.num_hidden_layers}, hf_prefixes=HF_PREFIXES,
                   drop_hf=DROP_HF, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp))


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set)
