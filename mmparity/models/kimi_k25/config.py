"""Kimi-K2.5's one HF vision config -> Megatron ``TransformerConfig`` recipe: the native
``KimiViTModel`` (:mod:`mmparity.models.kimi_k25.native`) and Megatron-LM's own
(:mod:`mmparity.models.kimi_k25.megatron`) both build from it."""

from __future__ import annotations

from mmparity.config import head_dim

# The release hard-codes the epsilon of every vision LayerNorm instead of reading a config field.
NORM_EPS = 1e-5


def transformer_fields(vc) -> dict:
    """The tower's ``TransformerConfig`` fields: LayerNorm with biases, a plain MLP, interleaved 2D
    RoPE. ``activation`` is the HF activation's name: each side turns it into its function."""
    return dict(num_layers=vc.num_hidden_layers, hidden_size=vc.hidden_size,
                num_attention_heads=vc.num_attention_heads, kv_channels=head_dim(vc),
                ffn_hidden_size=vc.intermediate_size, normalization="LayerNorm", norm_eps=NORM_EPS,
                activation=vc.hidden_act, gated=False, bias=True, rotary_interleaved=True)
