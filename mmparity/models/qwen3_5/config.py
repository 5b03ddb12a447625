"""Qwen3.5's one HF vision config -> Megatron ``TransformerConfig`` recipe: the native
``QwenVLViTModel`` (:mod:`mmparity.models.qwen3_5.native`) and Megatron-LM's own
(:mod:`mmparity.models.qwen3_5.megatron`) both build from it."""

from __future__ import annotations

from mmparity.config import DECODER_FIELDS, ConfigType, head_dim, num_heads, renamed_sub

# HF hard-codes the epsilon of every LayerNorm of the tower instead of reading a config field.
NORM_EPS = 1e-6


def transformer_fields(vc) -> dict:
    """The tower's ``TransformerConfig`` fields: LayerNorm with biases, a plain MLP, rotate-half
    2D RoPE. ``activation`` is the HF activation's name: each side turns it into its function."""
    return dict(num_layers=vc.num_hidden_layers, hidden_size=vc.hidden_size, num_attention_heads=num_heads(vc),
                kv_channels=head_dim(vc), ffn_hidden_size=vc.intermediate_size, normalization="LayerNorm",
                norm_eps=NORM_EPS, activation=vc.hidden_act, gated=False, bias=True, rotary_interleaved=False)


# --- HF config tables ---
# The configuration classes config.json is read with, without transformers (mmparity.config's
# ConfigView): transformers 5's defaults of Qwen3.5-MoE's classes, the text model's included (a
# whole checkpoint's config carries it).


def _text(v: dict, extra: dict) -> None:
    extra.setdefault("partial_rotary_factor", 0.25)
    if v["layer_types"] is None:
        interval = extra.pop("full_attention_interval", 4)
        v["layer_types"] = ["linear_attention" if (i + 1) % interval else "full_attention"
                            for i in range(v["num_hidden_layers"])]


HF_CONFIGS = {
    "qwen3_5_moe": ConfigType({"text_config": None, "vision_config": None, "image_token_id": 248056,
                               "video_token_id": 248057, "vision_start_token_id": 248053,
                               "vision_end_token_id": 248054, "tie_word_embeddings": False},
                              subs={"vision_config": ("qwen3_5_moe_vision", False, {}),
                                    "text_config": ("qwen3_5_moe_text", False, {})},
                              before=renamed_sub("vision_config", "qwen3_5_moe", "qwen3_5_moe_vision")),
    "qwen3_5_moe_vision": ConfigType({"depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh",
                                      "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
                                      "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                                      "out_hidden_size": 3584, "num_position_embeddings": 2304,
                                      "initializer_range": 0.02, "rope_parameters": None},
                                     aliases={"num_attention_heads": "num_heads", "num_hidden_layers": "depth"},
                                     rope_type="axial"),
    "qwen3_5_moe_text": ConfigType({**DECODER_FIELDS, "vocab_size": 248320, "hidden_size": 2048,
                                    "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
                                    "max_position_embeddings": 32768, "attention_bias": False, "head_dim": 256,
                                    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                                    "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                                    "linear_num_value_heads": 32, "moe_intermediate_size": 512,
                                    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8,
                                    "num_experts": 256, "output_router_logits": False,
                                    "router_aux_loss_coef": 0.001, "layer_types": None, "bos_token_id": None,
                                    "eos_token_id": None},
                                   rope_type="default", before=_text),
}
