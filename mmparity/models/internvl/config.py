"""InternVL's HF configuration class as config.json is read without transformers; its
sub-configs are read with the tables of the InternViT tower's and the dense decoder's packages."""

from __future__ import annotations

from mmparity.config import ConfigType

HF_CONFIGS = {
    "internvl": ConfigType({"vision_config": None, "text_config": None, "image_token_id": 151667,
                            "image_seq_length": 256, "downsample_ratio": 0.5, "projector_hidden_act": "gelu",
                            "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
                            "tie_word_embeddings": True},
                           subs={"vision_config": ("internvl_vision", False, {}),
                                 "text_config": ("qwen2", True, {})}),
}

