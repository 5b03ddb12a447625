"""Mistral3's HF configuration class as config.json is read without transformers, and what a
release in Mistral's own layout of this model is in HF terms."""

from __future__ import annotations

from mmparity.config import ConfigType
from mmparity.models.parts.mistral_params import NativeRelease

# A release in Mistral's layout (params.json beside consolidated.safetensors) is this model when
# its vision_encoder merges patches, as transformers' conversion script decides: the model types
# of the HF config its params.json translates to.
MISTRAL_NATIVE = NativeRelease(merges_patches=True, model_type="mistral3", vision_model_type="pixtral",
                               text_model_type="mistral")

# --- HF config tables ---
# The configuration class config.json is read with, without transformers (mmparity.config's
# ConfigView): transformers 5's defaults of Mistral3Config; its sub-configs are read with the
# tables of the Pixtral tower's and the dense decoder's packages.

HF_CONFIGS = {
    "mistral3": ConfigType({"vision_config": None, "text_config": None, "image_token_index": 10,
                            "projector_hidden_act": "gelu", "vision_feature_layer": -1,
                            "multimodal_projector_bias": False, "spatial_merge_size": 2,
                            "tie_word_embeddings": True},
                           aliases={"image_token_id": "image_token_index"},
                           subs={"text_config": ("mistral", True, {
                                     "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu",
                                     "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 32768,
                                     "max_position_embeddings": 131072, "model_type": "mistral",
                                     "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
                                     "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": None,
                                     "use_cache": True, "vocab_size": 131072}),
                                 "vision_config": ("pixtral", True, {
                                     "intermediate_size": 4096, "hidden_size": 1024, "patch_size": 14,
                                     "image_size": 1540, "num_hidden_layers": 24, "num_attention_heads": 16,
                                     "vocab_size": 32000, "head_dim": 64, "hidden_act": "gelu"})}),
}
