"""InternViT's one HF config -> Megatron ``TransformerConfig`` recipe (the native tower and
Megatron's ``CLIPViTModel`` build from it), and transformers' ``InternVLVisionConfig`` as
config.json is read without transformers."""

from __future__ import annotations

from mmparity.config import ConfigType, head_dim

# Megatron-LM's names of the two InternViT configurations (``CLIPViTModel``'s ``model_subtype``,
# ``LLaVAModel``'s ``vision_model_type``): the 6B tower (RMSNorm, q/k norms over the whole width)
# and the 300M one (LayerNorm, q/k/v biases).
SUBTYPE_6B = "internvit"
SUBTYPE_300M = "internvit300M"
# transformers' q/k norms are built with their own epsilon, never the config's layer_norm_eps.
QK_NORM_EPS = 1e-6


def subtype(vc) -> str:
    """Which of Megatron-LM's InternViT layer specs holds this tower's layers."""
    return SUBTYPE_6B if vc.norm_type == "rms_norm" else SUBTYPE_300M


def normalization(vc) -> str:
    return "RMSNorm" if vc.norm_type == "rms_norm" else "LayerNorm"


def transformer_fields(vc) -> dict:
    """The tower's ``TransformerConfig`` fields: its layer norm kind, biased output projection and
    MLP (always, in transformers' layer), q/k/v biases as ``attention_bias`` says, q/k norms as
    ``use_qk_norm``. ``activation`` is the HF activation's name."""
    return dict(num_layers=vc.num_hidden_layers, hidden_size=vc.hidden_size,
                num_attention_heads=vc.num_attention_heads, kv_channels=head_dim(vc),
                ffn_hidden_size=vc.intermediate_size, normalization=normalization(vc),
                norm_eps=vc.layer_norm_eps, activation=vc.hidden_act, gated=False, bias=True,
                add_qkv_bias=bool(vc.attention_bias), qk_layernorm=bool(vc.use_qk_norm))


# --- HF config tables ---

def _pairs(v: dict, extra: dict) -> None:
    # The class stores image and patch sizes as pairs.
    for key in ("image_size", "patch_size"):
        if not isinstance(v[key], (list, tuple)):
            v[key] = [v[key], v[key]]
        else:
            v[key] = list(v[key])


VISION_FIELDS = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                 "attention_bias": False, "use_qk_norm": False, "intermediate_size": 4096,
                 "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "attention_dropout": 0.0,
                 "projection_dropout": 0.0, "initializer_range": 0.02, "norm_type": "layer_norm",
                 "layer_norm_eps": 1e-06, "image_size": [448, 448], "patch_size": [14, 14],
                 "num_channels": 3, "use_mask_token": False, "use_absolute_position_embeddings": True,
                 "layer_scale_init_value": 0.1, "use_mean_pooling": True}

HF_CONFIGS = {"internvl_vision": ConfigType(VISION_FIELDS, before=_pairs)}
