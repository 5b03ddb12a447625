"""CLIP's one HF config -> Megatron ``TransformerConfig`` recipe: the native ``ViTModel``
(:mod:`mmparity.models.clip.native`) and Megatron's own classes (:mod:`mmparity.models.clip.megatron`)
both build from it, and so do SigLIP's towers, which are CLIP's architecture."""

from __future__ import annotations

from mmparity.config import head_dim


def transformer_fields(vc) -> dict:
    """The tower's ``TransformerConfig`` fields from a CLIP-architecture vision config: LayerNorm
    with biases, a plain MLP. ``activation`` is the HF activation's name: each side turns it into
    its function (the native model the exact HF one; Megatron's classes mcore's own ``quick_gelu``,
    as a Megatron-LM user configures it)."""
    return dict(num_layers=vc.num_hidden_layers, hidden_size=vc.hidden_size,
                num_attention_heads=vc.num_attention_heads, kv_channels=head_dim(vc),
                ffn_hidden_size=vc.intermediate_size, normalization="LayerNorm", norm_eps=vc.layer_norm_eps,
                activation=vc.hidden_act, gated=False, bias=True)
