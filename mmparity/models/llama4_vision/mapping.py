"""Llama 4's vision tower: HF ``Llama4VisionModel`` keys <-> the native tower's keys
(``CLIPViTModel``'s names, :mod:`mmparity.models.llama4_vision.native`).

The patch linear over unfolded patches is ``conv1``'s weight seen as a ``Conv2d`` (a reshape: both
flatten a patch in (C, P, P) order); the class token is a vector in transformers, ``(1, 1, H)``
here; the position table keeps transformers' row order (class token last). Per layer the
LayerNorms are fused into ``linear_qkv`` / ``linear_fc1`` (the TE spelling every CLIP-like tower
uses), q/k/v fused in Megatron's per-group order; no q/k permutation, since transformers' RoPE
rotates adjacent pairs as mcore's interleaved RoPE does. The adapter's two linears are whole on
every TP rank.
"""

from __future__ import annotations

from mmparity.config import first_int, tower_config_or_self
from mmparity.mapping.blocks import fused_layer_norm_rules, linear_rules, normed_mlp_rules
from mmparity.mapping.ops import FuseQKV, Reshape
from mmparity.mapping.rules import ConverterSpec, Rule, RuleSet, rename

FORMATS = ("hf",)
MODEL_TYPE = "llama4_vision_model"
# A bare tower, or the vision model of a whole Llama 4 checkpoint (saved files, module names).
HF_PREFIXES = ("", "vision_model.", "model.vision_model.")
DROP_HF = (r"^(model\.)?language_model\.", r"^lm_head\.", r"^(model\.)?multi_modal_projector\.")


def tp_problems(cfg, tp: int) -> list[str]:
    return [f"tp={tp} does not divide {name}={getattr(cfg, name)}"
            for name in ("num_attention_heads", "intermediate_size") if getattr(cfg, name) % tp]


def layer_rules(cfg) -> tuple:
    heads = cfg.num_attention_heads
    fuse = FuseQKV(heads, heads, cfg.hidden_size // heads)
    hf, mc = "model.layers.{i}.", "decoder.layers.{i}."
    attn, sa = hf + "self_attn.", mc + "self_attention."
    return (
        *fused_layer_norm_rules(sa + "linear_qkv.", hf + "input_layernorm"),
        *(Rule(sa + f"linear_qkv.{kind}", tuple(attn + p + f".{kind}" for p in ("q_proj", "k_proj", "v_proj")),
               fuse, "qkv") for kind in ("weight", "bias")),
        *linear_rules(sa + "linear_proj", attn + "o_proj", "row"),
        *normed_mlp_rules(mc + "mlp.", hf + "post_attention_layernorm", hf + "mlp.fc1", hf + "mlp.fc2"),
    )


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    cfg = tower_config_or_self(cfg, MODEL_TYPE)
    hidden, patch = cfg.hidden_size, first_int(cfg.patch_size)
    rules = (
        Rule("class_token", "class_embedding", Reshape((hidden,), (1, 1, hidden))),
        Rule("conv1.weight", "patch_embedding.linear.weight",
             Reshape((hidden, cfg.num_channels * patch * patch), (hidden, cfg.num_channels, patch, patch))),
        rename("position_embeddings.weight", "positional_embedding_vlm"),
        rename("ln_pre.weight", "layernorm_pre.weight"),
        rename("ln_pre.bias", "layernorm_pre.bias"),
        *layer_rules(cfg),
        rename("ln_post.weight", "layernorm_post.weight"),
        rename("ln_post.bias", "layernorm_post.bias"),
        rename("adapter.linear_fc1.weight", "vision_adapter.mlp.fc1.weight"),
        rename("adapter.linear_fc2.weight", "vision_adapter.mlp.fc2.weight"),
    )
    return RuleSet(rules=rules, variables={"i": cfg.num_hidden_layers}, hf_prefixes=HF_PREFIXES,
                   drop_hf=DROP_HF, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp))


# Not a LLaVA tower: transformers builds it only inside Llama 4, whose family reads this table.
SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set)
