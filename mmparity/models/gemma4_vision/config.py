"""Gemma 4's vision tower: its one HF config -> Megatron ``TransformerConfig`` recipe (the native
tower builds from it), and transformers' ``Gemma4VisionConfig`` as config.json is read without
transformers. Imports no framework."""

from __future__ import annotations

from mmparity.config import ConfigType, head_dim, num_heads, query_groups

# A clipped linear's four bounds, as transformers names its buffers (both sides read them here).
BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def transformer_fields(vc) -> dict:
    """RMSNorm layers without biases (transformers builds every linear of the tower bias-free,
    whatever ``attention_bias`` says), a gated MLP, GQA by ``num_key_value_heads``, the explicit
    ``head_dim``, attention logits unscaled (``softmax_scale`` 1: the q/k norms stand in for the
    1/sqrt(d) factor) and rotate-half RoPE over the whole head (the converter reorders q/k rows to
    it). ``activation`` is the HF activation's name: each side turns it into its function."""
    return dict(num_layers=vc.num_hidden_layers, hidden_size=vc.hidden_size, num_attention_heads=num_heads(vc),
                num_query_groups=query_groups(vc), kv_channels=head_dim(vc), ffn_hidden_size=vc.intermediate_size,
                normalization="RMSNorm", norm_eps=vc.rms_norm_eps, activation=vc.hidden_activation, gated=True,
                bias=False, rotary_interleaved=False, softmax_scale=1.0)


def config_problems(vc) -> list[str]:
    """What of a config is not checked. ``pooling_kernel_size`` 1: transformers 5.24's tower then
    skips pooling and keeps the rows its padding mask marks (the padding, not the patches), so it
    has no right answer to compare with (docs/families.md, transformers' own faults)."""
    if vc.pooling_kernel_size == 1:
        return ["pooling_kernel_size = 1: transformers' Gemma4VisionModel then returns the padding rows "
                "instead of the patches; not checked (transformers' default pools 3 x 3)"]
    return []


VISION_FIELDS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 16, "num_attention_heads": 12,
                 "num_key_value_heads": 12, "head_dim": 64, "hidden_activation": "gelu_pytorch_tanh",
                 "rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "attention_bias": False,
                 "attention_dropout": 0.0, "rope_parameters": None, "pooling_kernel_size": 3, "patch_size": 16,
                 "position_embedding_size": 10 * 1024, "use_clipped_linears": False, "standardize": False,
                 "initializer_range": 0.02}

HF_CONFIGS = {"gemma4_vision": ConfigType(VISION_FIELDS, rope_type="axial", rope_theta=100.0)}
