"""CLIP's one HF config -> Megatron ``TransformerConfig`` recipe: the native ``ViTModel``
(:mod:`mmparity.models.clip.native`) and Megatron's own classes (:mod:`mmparity.models.clip.megatron`)
both build from it, and so do SigLIP's towers, which are CLIP's architecture."""

from __future__ import annotations

from mmparity.config import ConfigType, head_dim


def transformer_fields(vc) -> dict:
    """The tower's ``TransformerConfig`` fields from a CLIP-architecture vision config: LayerNorm
    with biases, a plain MLP. ``activation`` is the HF activation's name: each side turns it into
    its function (the native model the exact HF one; Megatron's classes mcore's own ``quick_gelu``,
    as a Megatron-LM user configures it)."""
    return dict(num_layers=vc.num_hidden_layers, hidden_size=vc.hidden_size,
                num_attention_heads=vc.num_attention_heads, kv_channels=head_dim(vc),
                ffn_hidden_size=vc.intermediate_size, normalization="LayerNorm", norm_eps=vc.layer_norm_eps,
                activation=vc.hidden_act, gated=False, bias=True)


# --- HF config tables ---
# The configuration classes config.json is read with, without transformers (mmparity.config's
# ConfigView): transformers 5's defaults of CLIP's classes.

_VISION = {"hidden_size": 768, "intermediate_size": 3072, "projection_dim": 512, "num_hidden_layers": 12,
           "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 32,
           "hidden_act": "quick_gelu", "layer_norm_eps": 1e-05, "attention_dropout": 0.0,
           "initializer_range": 0.02, "initializer_factor": 1.0}

HF_CONFIGS = {
    "clip": ConfigType({"text_config": None, "vision_config": None, "projection_dim": 512,
                        "logit_scale_init_value": 2.6592, "initializer_factor": 1.0},
                       subs={"vision_config": ("clip_vision_model", False, {}),
                             "text_config": ("clip_text_model", False, {})}),
    "clip_vision_model": ConfigType(_VISION),
    "clip_text_model": ConfigType({"vocab_size": 49408, "hidden_size": 512, "intermediate_size": 2048,
                                   "projection_dim": 512, "num_hidden_layers": 12, "num_attention_heads": 8,
                                   "max_position_embeddings": 77, "hidden_act": "quick_gelu",
                                   "layer_norm_eps": 1e-05, "attention_dropout": 0.0, "initializer_range": 0.02,
                                   "initializer_factor": 1.0, "pad_token_id": 1, "bos_token_id": 49406,
                                   "eos_token_id": 49407}),
}
