"""LLaVA's HF configuration class as config.json is read without transformers."""

from __future__ import annotations

from mmparity.config import ConfigType

# --- HF config tables ---
# The configuration class config.json is read with, without transformers (mmparity.config's
# ConfigView): transformers 5's defaults of LlavaConfig; its sub-configs are read with the tables
# of the tower's and the text model's packages.


def _tied_from_text(v: dict, extra: dict) -> None:
    # transformers forwards the text config's flag when the whole config's own is unset.
    if not v["tie_word_embeddings"] and v["text_config"].tie_word_embeddings:
        v["tie_word_embeddings"] = True


HF_CONFIGS = {
    "llava": ConfigType({"vision_config": None, "text_config": None, "image_token_index": 32000,
                         "image_seq_length": 576, "projector_hidden_act": "gelu",
                         "vision_feature_select_strategy": "default", "vision_feature_layer": -2,
                         "multimodal_projector_bias": True, "tie_word_embeddings": False},
                        aliases={"image_token_id": "image_token_index"},
                        subs={"vision_config": ("clip_vision_model", True, {
                                  "intermediate_size": 4096, "hidden_size": 1024, "patch_size": 14,
                                  "image_size": 336, "num_hidden_layers": 24, "num_attention_heads": 16,
                                  "vocab_size": 32000, "projection_dim": 768}),
                              "text_config": ("llama", True, {})},
                        after=_tied_from_text),
}
