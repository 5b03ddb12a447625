"""GLM-4.5V vision tower: HF ``Glm4vMoeVisionModel`` keys <-> native ``Glm4vViTModel``.

The blocks as the Qwen-VL towers map them (``blocks.N`` -> ``decoder.layers.N``, HF's fused
``attn.qkv`` regrouped per query group so that a TP rank's rows hold whole heads, rotate-half RoPE
on both sides: no q/k permutation), RMSNorm weights only, the gated MLP's gate and up fused into
``linear_fc1`` as [gate; up] (split per TP rank by halves). What Megatron's Qwen-VL layout has no
place for keeps HF's module name: ``post_conv_layernorm``; ``post_layernorm`` is the block's
``decoder.final_layernorm``; the position table is ``pos_embed``. The merger (HF's ``downsample``
and ``merger.*``) is ``merger.downsample``, ``merger.linear_proj``, ``merger.norm``,
``merger.linear_fc1`` ([gate; up]) and ``merger.linear_fc2``, whole on every TP rank. The HF side
is a standalone tower or a whole ``Glm4vMoeForConditionalGeneration`` (``model.visual.``), whose
language model is dropped.
"""

from __future__ import annotations

from mmparity.config import head_dim, num_heads
from mmparity.mapping.ops import RegroupQKV, fuse_gate_up
from mmparity.mapping.rules import ConverterSpec, Rule, RuleSet, rename

FORMATS = ("hf",)
HF_PREFIXES = ("", "model.visual.")
DROP_HF = (r"^(model\.)?language_model\.", r"^lm_head\.")


def _vision(cfg):
    sub = getattr(cfg, "vision_config", None)
    return sub if sub is not None else cfg


def tp_problems(cfg, tp: int) -> list[str]:
    cfg = _vision(cfg)
    sizes = {"num_heads (linear_qkv query groups, linear_proj input)": num_heads(cfg),
             "out_hidden_size (the blocks' mlp.linear_fc1 / linear_fc2)": cfg.out_hidden_size}
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
        rename("patch_embed.proj.bias", "patch_embed.proj.bias"),
        rename("post_conv_layernorm.weight", "post_conv_layernorm.weight"),
        rename("pos_embed.weight", "embeddings.position_embedding.weight"),
        rename(qkv + "layer_norm_weight", hf + "norm1.weight"),
        Rule(qkv + "weight", hf + "attn.qkv.weight", regroup, "qkv"),
        rename(native + "self_attention.linear_proj.weight", hf + "attn.proj.weight", "row"),
        rename(fc1 + "layer_norm_weight", hf + "norm2.weight"),
        Rule(fc1 + "weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), fuse_gate_up(), "gated"),
        rename(native + "mlp.linear_fc2.weight", mlp + "down_proj.weight", "row"),
        rename("decoder.final_layernorm.weight", "post_layernorm.weight"),
        rename("merger.downsample.weight", "downsample.weight"),
        rename("merger.downsample.bias", "downsample.bias"),
        rename("merger.linear_proj.weight", "merger.proj.weight"),
        rename("merger.norm.weight", "merger.post_projection_norm.weight"),
        rename("merger.norm.bias", "merger.post_projection_norm.bias"),
        Rule("merger.linear_fc1.weight", ("merger.gate_proj.weight", "merger.up_proj.weight"), fuse_gate_up()),
        rename("merger.linear_fc2.weight", "merger.down_proj.weight"),
    )
    if cfg.attention_bias:
        rules += (Rule(qkv + "bias", hf + "attn.qkv.bias", regroup, "qkv"),)
    return RuleSet(rules=rules, variables={"i": cfg.num_hidden_layers}, hf_prefixes=HF_PREFIXES,
                   drop_hf=DROP_HF, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp))


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set)
