"""CLIP vision encoder: HF ``CLIPVisionModel`` keys <-> Megatron's ``CLIPViTModel`` keys.

The mcore side is exactly the stock ``clip_vit_model.CLIPViTModel`` (``vision_model_type``
``clip``) state dict, which the native ``ViTModel`` shares. HF's ``post_layernorm`` (applied to
the pooled class token) has no place there: it is kept aside (side file) as ``ln_post.*``.

HF keys are relative to the vision model: transformers 5 saves a ``CLIPVisionModel`` without a
prefix, older releases and whole ``CLIPModel`` checkpoints under ``vision_model.``, LLaVA
checkpoints under ``vision_tower.`` / ``model.vision_tower.`` (old LLaVA: ``vision_tower.vision_model.``).
SigLIP (:mod:`mmparity.models.siglip.mapping`) is this table plus overrides.
"""

from __future__ import annotations

from mmparity.mapping.blocks import fused_layer_norm_rules, linear_rules, normed_mlp_rules
from mmparity.mapping.ops import FuseQKV, Reshape
from mmparity.mapping.rules import ConverterSpec, Rule, RuleSet, TowerKeys, aside, rename
from mmparity.config import head_dim, tower_config_or_self

FORMATS = ("hf",)

HF_PREFIXES = ("", "vision_model.", "model.vision_model.", "vision_tower.", "model.vision_tower.",
               "vision_tower.vision_model.", "model.vision_tower.vision_model.")
# The rest of a whole CLIP / SigLIP / LLaVA checkpoint is deliberately not ours.
DROP_HF = (r"^(model\.)?text_model\.", r"^text_projection\.", r"^visual_projection\.",
           r"^logit_scale$", r"^logit_bias$", r"^(model\.)?language_model\.", r"^lm_head\.",
           r"^(model\.)?multi_modal_projector\.", r"^(model\.)?image_newline$",
           # persistent position-id buffers of checkpoints written by transformers 4
           r"^(.*\.)?embeddings\.position_ids$")


def tp_problems(cfg, tp: int) -> list[str]:
    return [f"tp={tp} does not divide {name}={getattr(cfg, name)}"
            for name in ("num_attention_heads", "intermediate_size") if getattr(cfg, name) % tp]


def encoder_layer_rules(cfg) -> tuple:
    """Pre-norm encoder layers with biases (``CLIPEncoderLayer`` / ``SiglipEncoderLayer``)."""
    heads, d = cfg.num_attention_heads, head_dim(cfg)
    fuse = FuseQKV(heads, heads, d)
    hf = "encoder.layers.{i}."
    mc = "decoder.layers.{i}."
    attn = hf + "self_attn."
    return (
        *fused_layer_norm_rules(mc + "self_attention.linear_qkv.", hf + "layer_norm1"),
        Rule(mc + "self_attention.linear_qkv.weight",
             (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"), fuse, "qkv"),
        Rule(mc + "self_attention.linear_qkv.bias",
             (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"), fuse, "qkv"),
        *linear_rules(mc + "self_attention.linear_proj", attn + "out_proj", "row"),
        *normed_mlp_rules(mc + "mlp.", hf + "layer_norm2", hf + "mlp.fc1", hf + "mlp.fc2"),
    )


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    cfg = tower_config_or_self(cfg, "clip_vision_model")
    hidden = cfg.hidden_size
    rules = (
        # HF keeps one class token as a vector; mcore as (1, class_token_len, H).
        Rule("class_token", "embeddings.class_embedding", Reshape((hidden,), (1, 1, hidden))),
        rename("conv1.weight", "embeddings.patch_embedding.weight"),
        rename("position_embeddings.weight", "embeddings.position_embedding.weight"),
        rename("ln_pre.weight", "pre_layrnorm.weight"),
        rename("ln_pre.bias", "pre_layrnorm.bias"),
        *encoder_layer_rules(cfg),
        *aside(rename("ln_post.weight", "post_layernorm.weight"),
               rename("ln_post.bias", "post_layernorm.bias")),
    )
    return RuleSet(rules=rules, variables={"i": cfg.num_hidden_layers}, hf_prefixes=HF_PREFIXES,
                   drop_hf=DROP_HF, hf_format=hf_format, validate_tp=lambda tp: tp_problems(cfg, tp))


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set,
                    tower=TowerKeys("clip_vision_model", v4_checkpoint_root="vision_model."))
