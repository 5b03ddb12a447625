"""Qwen2.5-VL's one HF vision config -> Megatron ``TransformerConfig`` recipe, which the native
tower (:mod:`mmparity.models.qwen2_5_vl.native`) builds from."""

from __future__ import annotations

from mmparity.config import head_dim, num_heads

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
