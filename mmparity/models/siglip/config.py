"""SigLIP's HF configuration classes as config.json is read without transformers."""

from __future__ import annotations

from mmparity.config import ConfigType

# --- HF config tables ---
# The configuration classes config.json is read with, without transformers (mmparity.config's
# ConfigView): transformers 5's defaults of SigLIP's classes.

_VISION = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
           "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
           "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-06, "attention_dropout": 0.0,
           "vision_use_head": True}


def _text(v: dict, extra: dict) -> None:
    if v["projection_size"] is None:
        v["projection_size"] = v["hidden_size"]


HF_CONFIGS = {
    "siglip": ConfigType({"text_config": None, "vision_config": None, "initializer_factor": 1.0},
                         subs={"vision_config": ("siglip_vision_model", False, {}),
                               "text_config": ("siglip_text_model", False, {})}),
    "siglip_vision_model": ConfigType(_VISION),
    "siglip_text_model": ConfigType({"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 3072,
                                     "num_hidden_layers": 12, "num_attention_heads": 12,
                                     "max_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh",
                                     "layer_norm_eps": 1e-06, "attention_dropout": 0.0, "pad_token_id": 1,
                                     "bos_token_id": 49406, "eos_token_id": 49407, "projection_size": None},
                                    before=_text),
}
