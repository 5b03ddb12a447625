"""Kimi-K2.5's one HF vision config -> Megatron ``TransformerConfig`` recipe: the native
``KimiViTModel`` (:mod:`mmparity.models.kimi_k25.native`) and Megatron-LM's own
(:mod:`mmparity.models.kimi_k25.megatron`) both build from it."""

from __future__ import annotations

from mmparity.config import ConfigType, head_dim, renamed_sub

# The release hard-codes the epsilon of every vision LayerNorm instead of reading a config field.
NORM_EPS = 1e-5


def transformer_fields(vc) -> dict:
    """The tower's ``TransformerConfig`` fields: LayerNorm with biases, a plain MLP, interleaved 2D
    RoPE. ``activation`` is the HF activation's name: each side turns it into its function."""
    return dict(num_layers=vc.num_hidden_layers, hidden_size=vc.hidden_size,
                num_attention_heads=vc.num_attention_heads, kv_channels=head_dim(vc),
                ffn_hidden_size=vc.intermediate_size, normalization="LayerNorm", norm_eps=NORM_EPS,
                activation=vc.hidden_act, gated=False, bias=True, rotary_interleaved=True)


# --- HF config tables ---
# The configuration classes config.json is read with, without transformers (mmparity.config's
# ConfigView): transformers 5's defaults of Kimi-K2.5's classes; the text config is read with the
# DeepSeek-V3 part's table.

HF_CONFIGS = {
    "kimi_k25": ConfigType({"text_config": None, "vision_config": None, "projection_hidden_size": 1152,
                            "projection_layer_norm_eps": 1e-05, "image_token_id": 163605,
                            "video_token_id": 163840, "vision_start_token_id": 163602,
                            "vision_end_token_id": 163604, "tie_word_embeddings": True},
                           subs={"text_config": ("deepseek_v3", True, {}),
                                 "vision_config": ("kimi_k25_vision", False, {})},
                           # Old checkpoints name their text config after Kimi-K2.
                           before=renamed_sub("text_config", "kimi_k2", "deepseek_v3")),
    "kimi_k25_vision": ConfigType({"patch_size": 14, "pos_emb_height": 64, "pos_emb_width": 64,
                                   "pos_emb_time": 4, "num_attention_heads": 16, "num_hidden_layers": 27,
                                   "hidden_size": 1152, "intermediate_size": 4304,
                                   "hidden_act": "gelu_pytorch_tanh", "merge_kernel_size": [2, 2],
                                   "rope_parameters": None}, rope_type="axial"),
}
