"""Pixtral's one HF vision config -> Megatron ``TransformerConfig`` recipe: the native ``ViTModel``
(:mod:`mmparity.models.pixtral.native`) and Megatron-LM's own (:mod:`mmparity.models.pixtral.megatron`)
both build from it, and so do the Pixtral towers inside whole VLMs (Pixtral-Large's merged tower,
LLaVA and Pixtral-12B's). Below it, Pixtral's HF configuration class as config.json is read without
transformers."""

from __future__ import annotations

from mmparity.config import PIXTRAL_NORM_EPS, ConfigType, head_dim


def transformer_fields(vc) -> dict:
    """The tower's ``TransformerConfig`` fields: RMSNorm (HF's literal epsilon, not a config field),
    a gated MLP, no biases, interleaved 2D RoPE. ``activation`` is the HF activation's name: each
    side turns it into its function."""
    return dict(num_layers=vc.num_hidden_layers, hidden_size=vc.hidden_size,
                num_attention_heads=vc.num_attention_heads, kv_channels=head_dim(vc),
                ffn_hidden_size=vc.intermediate_size, normalization="RMSNorm", norm_eps=PIXTRAL_NORM_EPS,
                activation=vc.hidden_act, gated=True, bias=False, rotary_interleaved=True)


# --- HF config tables ---
# The configuration class config.json is read with, without transformers (mmparity.config's
# ConfigView): transformers 5's defaults of PixtralVisionConfig.


def _derived(v: dict, extra: dict) -> None:
    # Pixtral's class derives head_dim from the sizes, whatever the file says.
    v["head_dim"] = v["hidden_size"] // v["num_attention_heads"]


HF_CONFIGS = {
    "pixtral": ConfigType({"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                           "num_attention_heads": 16, "num_channels": 3, "image_size": 1024, "patch_size": 16,
                           "hidden_act": "gelu", "attention_dropout": 0.0, "rope_parameters": None,
                           "initializer_range": 0.02}, rope_type="axial", before=_derived),
}
