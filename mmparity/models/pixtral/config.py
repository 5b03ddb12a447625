"""Pixtral's HF configuration class as config.json is read without transformers."""

from __future__ import annotations

from mmparity.config import ConfigType

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
