"""InternViT: HF ``InternVLVisionModel`` keys <-> Megatron's ``CLIPViTModel`` keys in its InternViT
configurations (``model_subtype`` ``internvit`` / ``internvit300M``, the layers of Megatron-LM's
InternViT layer specs).

``conv1`` (with a bias), ``class_token``, ``position_embeddings.weight`` (transformers keeps the
table as ``(1, positions, H)``, Megatron as an embedding table), then per layer the separate
``input_layernorm`` / ``pre_mlp_layernorm``, q/k/v fused into ``linear_qkv`` in Megatron's
per-group order, ``q_layernorm`` / ``k_layernorm`` (one weight over the whole width, split with
the heads under TP), ``linear_proj``, the MLP and the layer scales ``ls1`` / ``ls2``
(transformers' ``lambda_1`` / ``lambda_2``).

Kept aside (Megatron's class has no place for them): the final ``layernorm`` where transformers
has one (``use_mean_pooling`` off), as ``ln_post.*``; the masked-image-modelling ``mask_token``,
which no forward here reads.
"""

from __future__ import annotations

from mmparity.config import first_int, head_dim, tower_config_or_self
from mmparity.mapping.blocks import linear_rules
from mmparity.mapping.ops import FuseQKV, Reshape
from mmparity.mapping.rules import ConverterSpec, Rule, RuleSet, TowerKeys, aside, rename

FORMATS = ("hf",)
MODEL_TYPE = "internvl_vision"
# A bare tower, or the vision tower of a whole InternVL checkpoint (module names, saved files).
HF_PREFIXES = ("", "model.vision_tower.", "vision_tower.")
DROP_HF = (r"^(model\.)?language_model\.", r"^lm_head\.", r"^(model\.)?multi_modal_projector\.")


def tp_problems(cfg, tp: int) -> list[str]:
    return [f"tp={tp} does not divide {name}={getattr(cfg, name)}"
            for name in ("num_attention_heads", "intermediate_size") if getattr(cfg, name) % tp]


def _norm_rules(mcore: str, hf: str, with_bias: bool) -> tuple:
    rules = (rename(mcore + ".weight", hf + ".weight"),)
    return rules + ((rename(mcore + ".bias", hf + ".bias"),) if with_bias else ())


def layer_rules(cfg) -> tuple:
    heads, d = cfg.num_attention_heads, head_dim(cfg)
    fuse = FuseQKV(heads, heads, d)
    hf, mc = "encoder.layer.{i}.", "decoder.layers.{i}."
    attn, sa = hf + "attention.", mc + "self_attention."
    layer_norm = cfg.norm_type != "rms_norm"
    rules = (
        rename(mc + "ls1", hf + "lambda_1"),
        rename(mc + "ls2", hf + "lambda_2"),
        *_norm_rules(mc + "input_layernorm", hf + "layernorm_before", layer_norm),
        Rule(sa + "linear_qkv.weight", tuple(attn + p + ".weight" for p in ("q_proj", "k_proj", "v_proj")),
             fuse, "qkv"),
    )
    if cfg.attention_bias:
        rules += (Rule(sa + "linear_qkv.bias", tuple(attn + p + ".bias" for p in ("q_proj", "k_proj", "v_proj")),
                       fuse, "qkv"),)
    if cfg.use_qk_norm:
        # One weight over every head, in head order: each TP rank holds its heads' slice.
        rules += (rename(sa + "q_layernorm.weight", attn + "q_norm.weight", "column"),
                  rename(sa + "k_layernorm.weight", attn + "k_norm.weight", "column"))
    return rules + (
        *linear_rules(sa + "linear_proj", attn + "projection_layer", "row"),
        *_norm_rules(mc + "pre_mlp_layernorm", hf + "layernorm_after", layer_norm),
        *linear_rules(mc + "mlp.linear_fc1", hf + "mlp.fc1", "column"),
        *linear_rules(mc + "mlp.linear_fc2", hf + "mlp.fc2", "row"),
    )


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    cfg = tower_config_or_self(cfg, MODEL_TYPE)
    hidden = cfg.hidden_size
    positions = (first_int(cfg.image_size) // first_int(cfg.patch_size)) ** 2 + 1
    rules = (
        rename("class_token", "embeddings.cls_token"),
        rename("conv1.weight", "embeddings.patch_embeddings.projection.weight"),
        rename("conv1.bias", "embeddings.patch_embeddings.projection.bias"),
        Rule("position_embeddings.weight", "embeddings.position_embeddings",
             Reshape((1, positions, hidden), (positions, hidden))),
        *layer_rules(cfg),
    )
    if not cfg.use_mean_pooling:
        rules += aside(rename("ln_post.weight", "layernorm.weight"), rename("ln_post.bias", "layernorm.bias"))
    if cfg.use_mask_token:
        rules += aside(rename("mask_token", "embeddings.mask_token"), side="unused")
    return RuleSet(rules=rules, variables={"i": cfg.num_hidden_layers}, hf_prefixes=HF_PREFIXES,
                   drop_hf=DROP_HF, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp))


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set, tower=TowerKeys(MODEL_TYPE))
