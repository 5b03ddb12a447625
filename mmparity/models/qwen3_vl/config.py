"""Qwen3-VL's HF configuration classes as tables, so that config.json is read without
transformers (mmparity.config's ConfigView): transformers 5's defaults of the whole model's, the
tower's and the text model's classes. The tower's recipe is Qwen3.5-MoE's
(:func:`mmparity.models.qwen3_5.config.transformer_fields`), which both natives build from."""

from __future__ import annotations

from mmparity.config import DECODER_FIELDS, ConfigType, renamed_sub

# The text class's own RoPE base, where a config.json names none (the tower's is the usual 10000).
TEXT_ROPE_THETA = 500000.0


def _text_rope(v: dict, extra: dict) -> None:
    """A missing base is the class's, not the generic default; M-RoPE's sections stay inside."""
    if "rope_scaling" in extra:
        return
    params = dict(v["rope_parameters"] or {})
    params.setdefault("rope_theta", extra.pop("rope_theta", TEXT_ROPE_THETA))
    params.setdefault("rope_type", "default")
    v["rope_parameters"] = params
    if v["num_key_value_heads"] is None:
        v["num_key_value_heads"] = v["num_attention_heads"]


HF_CONFIGS = {
    "qwen3_vl": ConfigType({"text_config": None, "vision_config": None, "image_token_id": 151655,
                            "video_token_id": 151656, "vision_start_token_id": 151652,
                            "vision_end_token_id": 151653, "tie_word_embeddings": False},
                           subs={"vision_config": ("qwen3_vl_vision", False, {}),
                                 "text_config": ("qwen3_vl_text", False, {})},
                           before=renamed_sub("vision_config", "qwen3_vl", "qwen3_vl_vision")),
    "qwen3_vl_vision": ConfigType({"depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh",
                                   "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
                                   "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                                   "out_hidden_size": 3584, "num_position_embeddings": 2304,
                                   "deepstack_visual_indexes": [8, 16, 24], "initializer_range": 0.02,
                                   "rope_parameters": None},
                                  aliases={"num_attention_heads": "num_heads", "num_hidden_layers": "depth"},
                                  rope_type="axial"),
    # The text class declares no tie_word_embeddings of its own (the whole model's carries it).
    "qwen3_vl_text": ConfigType({**{k: v for k, v in DECODER_FIELDS.items() if k != "tie_word_embeddings"},
                                 "vocab_size": 151936, "intermediate_size": 22016,
                                 "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 128000,
                                 "attention_bias": False},
                                rope_type="default", before=_text_rope),
}
