"""Llama 4's vision tower: its one HF config -> Megatron ``TransformerConfig`` recipe, and
transformers' ``Llama4VisionConfig`` as config.json is read without transformers."""

from __future__ import annotations

from mmparity.config import ConfigType

# transformers builds every LayerNorm of the tower with torch's default epsilon and an exact (erf)
# GELU, whatever ``norm_eps`` and ``hidden_act`` say.
NORM_EPS = 1e-5
ACTIVATION = "gelu"


def transformer_fields(vc) -> dict:
    """LayerNorm layers with biases everywhere, a plain MLP, interleaved 2D RoPE (transformers
    rotates adjacent pairs, as complex numbers, on the weights as stored)."""
    return dict(num_layers=vc.num_hidden_layers, hidden_size=vc.hidden_size,
                num_attention_heads=vc.num_attention_heads, kv_channels=vc.hidden_size // vc.num_attention_heads,
                ffn_hidden_size=vc.intermediate_size, normalization="LayerNorm", norm_eps=NORM_EPS,
                activation=ACTIVATION, gated=False, bias=True, rotary_interleaved=True)


# --- HF config tables ---

VISION_FIELDS = {"hidden_size": 768, "hidden_act": "gelu", "num_hidden_layers": 34, "num_attention_heads": 16,
                 "num_channels": 3, "intermediate_size": 5632, "vision_output_dim": 7680, "image_size": 448,
                 "patch_size": 14, "norm_eps": 1e-5, "vision_feature_select_strategy": "default",
                 "initializer_range": 0.02, "pixel_shuffle_ratio": 0.5, "projector_input_dim": 4096,
                 "projector_output_dim": 4096, "multi_modal_projector_bias": False, "projector_dropout": 0.0,
                 "attention_dropout": 0.0, "rope_parameters": None}

HF_CONFIGS = {"llama4_vision_model": ConfigType(VISION_FIELDS, rope_type="default")}
