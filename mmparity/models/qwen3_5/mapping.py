"""Qwen3.5-MoE VL vision tower: HF ``Qwen3_5MoeVisionModel`` keys <-> native ``QwenVLViTModel``.

The HF side is a standalone vision checkpoint or a whole ``Qwen3_5MoeForConditionalGeneration``
(tower under ``model.visual.``; ``visual.`` in older exports). Of a whole checkpoint only the tower
is converted; the language model, LM head and MTP head are dropped explicitly.

HF's ``attn.qkv`` is fused ``[q; k; v]``; mcore's ``linear_qkv`` is ordered by query group, so
that a TP rank's row slice holds whole heads. RoPE is rotate-half on both sides: no q/k
permutation. The Conv3d kernel and the position table keep their shapes.
"""

from __future__ import annotations

from mmparity.mapping.blocks import fused_layer_norm_rules, linear_rules, normed_mlp_rules
from mmparity.mapping.ops import RegroupQKV
from mmparity.mapping.rules import ConverterSpec, Rule, RuleSet, rename
from mmparity.config import head_dim

FORMATS = ("hf",)

HF_PREFIXES = ("", "visual.", "model.visual.")
DROP_HF = (r"^(model\.)?language_model\.", r"^lm_head\.", r"^mtp\.")


def _vision(cfg):
    """Accept the vision config or a whole-VLM config that carries it (attribute access only)."""
    sub = getattr(cfg, "vision_config", None)
    return sub if sub is not None and hasattr(sub, "num_position_embeddings") else cfg


def tp_problems(cfg, tp: int) -> list[str]:
    sizes = {
        "num_heads (linear_qkv query groups, linear_proj input)": cfg.num_attention_heads,
        "intermediate_size (mlp.linear_fc1 / linear_fc2)": cfg.intermediate_size,
    }
    return [f"tp={tp} does not divide {name} = {value}" for name, value in sizes.items()
            if tp >= 1 and value % tp]


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    cfg = _vision(cfg)
    heads, d = cfg.num_attention_heads, head_dim(cfg)
    regroup = RegroupQKV(heads, heads, d)
    hf, native = "blocks.{i}.", "decoder.layers.{i}."
    qkv = native + "self_attention.linear_qkv."
    rules = (
        rename("patch_embed.proj.weight", "patch_embed.proj.weight"),
        rename("patch_embed.proj.bias", "patch_embed.proj.bias"),
        rename("pos_embed.weight", "pos_embed.weight"),
        *fused_layer_norm_rules(qkv, hf + "norm1"),
        Rule(qkv + "weight", hf + "attn.qkv.weight", regroup, "qkv"),
        Rule(qkv + "bias", hf + "attn.qkv.bias", regroup, "qkv"),
        *linear_rules(native + "self_attention.linear_proj", hf + "attn.proj", "row"),
        *normed_mlp_rules(native + "mlp.", hf + "norm2", hf + "mlp.linear_fc1", hf + "mlp.linear_fc2"),
        rename("merger.patch_norm.weight", "merger.norm.weight"),
        rename("merger.patch_norm.bias", "merger.norm.bias"),
        # Megatron's QwenPatchMerger keeps its linears whole (plain nn.Linear) on every TP rank.
        rename("merger.linear_fc1.weight", "merger.linear_fc1.weight"),
        rename("merger.linear_fc1.bias", "merger.linear_fc1.bias"),
        rename("merger.linear_fc2.weight", "merger.linear_fc2.weight"),
        rename("merger.linear_fc2.bias", "merger.linear_fc2.bias"),
    )
    return RuleSet(rules=rules, variables={"i": cfg.num_hidden_layers}, hf_prefixes=HF_PREFIXES,
                   drop_hf=DROP_HF, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp))


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set)
