"""Qwen2.5-VL's one HF vision config -> Megatron ``TransformerConfig`` recipe, which the native
tower (:mod:`mmparity.models.qwen2_5_vl.native`) builds from."""

from __future__ import annotations

from mmparity.config import DECODER_FIELDS, ConfigType, head_dim, num_heads, renamed_sub
from mmparity.models.parts.dense_decoder.config import _qwen2 as qwen2_init

# HF hard-codes the epsilon of every RMSNorm of the tower (blocks and merger) instead of reading a
# config field.
NORM_EPS = 1e-6


def transformer_fields(vc) -> dict:
    """The tower's ``TransformerConfig`` fields: RMSNorm, a gated MLP with biases (gate/up/down
    all biased, as q/k/v and the output projection are), rotate-half 2D RoPE. ``activation`` is the
    HF activation's name: each side turns it into its function."""
    return dict(num_layers=vc.num_hidden_layers, hidden_size=vc.hidden_size, num_attention_heads=num_heads(vc),
                kv_channels=head_dim(vc), ffn_hidden_size=vc.intermediate_size, normalization="RMSNorm",
                norm_eps=NORM_EPS, activation=vc.hidden_act, gated=True, bias=True, rotary_interleaved=False)


# --- HF config tables ---
# Qwen2.5-VL's configuration classes as config.json is read without transformers (mmparity.config's
# ConfigView): transformers 5's defaults of the whole model's, the tower's and the text model's.

# The text class's own RoPE base, where a config.json names none.
TEXT_ROPE_THETA = 1000000.0
_TEXT_FIELDS = {**{k: v for k, v in DECODER_FIELDS.items() if k != "tie_word_embeddings"},
                "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568,
                "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "use_sliding_window": False,
                "sliding_window": 4096, "max_window_layers": 80, "layer_types": None,
                "bos_token_id": 151643, "eos_token_id": 151645}


def _text(v: dict, extra: dict) -> None:
    """Qwen2's init (sliding window, key/value heads, layer types), then the class's RoPE: a legacy
    ``rope_scaling`` of type ``mrope`` is the default RoPE with its sections, its base 1e6 unless
    named."""
    qwen2_init(v, extra)
    params = extra.pop("rope_scaling", None) or v["rope_parameters"]
    params = dict(params) if params else {}
    params.setdefault("rope_theta", extra.pop("rope_theta", TEXT_ROPE_THETA))
    if params.get("rope_type", params.get("type")) == "mrope":
        params["rope_type"] = "default"
    v["rope_parameters"] = params


def _whole(v: dict, extra: dict) -> None:
    """Releases keep the text model's fields at the root of config.json, as transformers 4 wrote
    them: they become the text config, as the class's init gathers them."""
    renamed_sub("vision_config", "qwen2_5_vl", "qwen2_5_vl_vision")(v, extra)
    if v["text_config"] is None:
        keys = set(_TEXT_FIELDS) | {"rope_scaling", "rope_theta"}
        v["text_config"] = {k: extra.pop(k) for k in list(extra) if k in keys}


HF_CONFIGS = {
    "qwen2_5_vl": ConfigType({"text_config": None, "vision_config": None, "image_token_id": 151655,
                              "video_token_id": 151656, "vision_start_token_id": 151652,
                              "vision_end_token_id": 151653, "tie_word_embeddings": False},
                             subs={"vision_config": ("qwen2_5_vl_vision", False, {}),
                                   "text_config": ("qwen2_5_vl_text", False, {})},
                             before=_whole),
    "qwen2_5_vl_vision": ConfigType({"depth": 32, "hidden_size": 3584, "hidden_act": "silu",
                                     "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
                                     "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                                     "tokens_per_second": 4, "window_size": 112, "out_hidden_size": 3584,
                                     "fullatt_block_indexes": [7, 15, 23, 31], "initializer_range": 0.02,
                                     "rope_parameters": None},
                                    aliases={"num_attention_heads": "num_heads", "num_hidden_layers": "depth"},
                                    rope_type="axial"),
    "qwen2_5_vl_text": ConfigType(_TEXT_FIELDS, rope_type="default", before=_text),
}
