"""Pixtral vision encoder: HF ``PixtralVisionModel`` keys <-> native ``ViTModel`` keys."""

from __future__ import annotations

from mmparity.converters.ops import FuseQKV, RopeInterleave, fuse_gate_up
from mmparity.converters.rules import Rule, RuleSet, rename

FORMATS = ("hf",)

# A Pixtral tower also sits inside LLaVA / Mistral3 checkpoints; their other parts are not ours.
HF_PREFIXES = ("", "vision_tower.", "model.vision_tower.")
DROP_HF = (r"^(model\.)?language_model\.", r"^lm_head\.", r"^(model\.)?multi_modal_projector\.")


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def tp_problems(cfg, tp: int) -> list[str]:
    problems = []
    for name in ("num_attention_heads", "intermediate_size"):
        value = getattr(cfg, name)
        if value % tp:
            problems.append(f"tp={tp} does not divide {name}={value}")
    return problems


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    heads, d = cfg.num_attention_heads, head_dim(cfg)
    # HF checkpoints carry q/k permuted for rotate-half RoPE; mcore runs interleaved RoPE.
    unpermute = RopeInterleave(heads, d)
    layer = "transformer.layers.{i}."
    native = "decoder.layers.{i}."
    rules = (
        rename("patch_conv.conv.weight", "patch_conv.weight"),
        rename("ln_pre.weight", "ln_pre.weight"),
        rename(native + "self_attention.linear_qkv.layer_norm_weight", layer + "attention_norm.weight"),
        Rule(native + "self_attention.linear_qkv.weight",
             (layer + "attention.q_proj.weight", layer + "attention.k_proj.weight",
              layer + "attention.v_proj.weight"),
             FuseQKV(heads, heads, d, pre=(unpermute, unpermute, None)), "qkv"),
        rename(native + "self_attention.linear_proj.weight", layer + "attention.o_proj.weight", "row"),
        rename(native + "mlp.linear_fc1.layer_norm_weight", layer + "ffn_norm.weight"),
        Rule(native + "mlp.linear_fc1.weight",
             (layer + "feed_forward.gate_proj.weight", layer + "feed_forward.up_proj.weight"),
             fuse_gate_up(), "gated"),
        rename(native + "mlp.linear_fc2.weight", layer + "feed_forward.down_proj.weight", "row"),
    )
    return RuleSet(rules=rules, variables={"i": cfg.num_hidden_layers}, hf_prefixes=HF_PREFIXES,
                   drop_hf=DROP_HF, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp))
