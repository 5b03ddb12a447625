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


def tower_output_refusal(cfg) -> str | None:
    """Why LLaVAModel cannot compute this InternVL: it reads its CLIPViTModel, which has no final
    norm, where transformers reads the tower's output (``vision_feature_layer`` -1) through one."""
    if cfg.vision_feature_layer == -1 and not cfg.vision_config.use_mean_pooling:
        return ("Megatron's LLaVAModel has no place for the tower's final LayerNorm, which InternVL "
                "applies to the features it reads (use_mean_pooling off, vision_feature_layer -1)")
    return None
