"""GLM-4.5V's one HF vision config -> Megatron ``TransformerConfig`` recipe, which the native tower
(:mod:`mmparity.models.glm4v_vision.native`) builds from, and the tower's HF configuration class as
config.json is read without transformers. Imports no framework."""

from __future__ import annotations

from mmparity.config import ConfigType, head_dim, num_heads


def transformer_fields(vc) -> dict:
    """The blocks' ``TransformerConfig`` fields: RMSNorm (the config's epsilon), a gated MLP without
    biases whose width is the tower's *output* size (``out_hidden_size``: transformers builds the
    blocks' MLP so; ``intermediate_size`` is the merger's), q/k/v biased as ``attention_bias`` says
    and the output projection never, rotate-half 2D RoPE. ``activation`` is the HF activation's
    name: each side turns it into its function."""
    return dict(num_layers=vc.num_hidden_layers, hidden_size=vc.hidden_size, num_attention_heads=num_heads(vc),
                kv_channels=head_dim(vc), ffn_hidden_size=vc.out_hidden_size, normalization="RMSNorm",
                norm_eps=vc.rms_norm_eps, activation=vc.hidden_act, gated=True, bias=False,
                add_qkv_bias=bool(vc.attention_bias), rotary_interleaved=False)


_TOWER = ConfigType({"depth": 24, "hidden_size": 1536, "hidden_act": "silu", "attention_bias": False,
                     "attention_dropout": 0.0, "num_heads": 12, "in_channels": 3, "image_size": 336, "patch_size": 14,
                     "rms_norm_eps": 1e-05, "spatial_merge_size": 2, "temporal_patch_size": 2,
                     "out_hidden_size": 4096, "intermediate_size": 13696, "initializer_range": 0.02,
                     "rope_parameters": None},
                    aliases={"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}, rope_type="axial")

# GLM-4.5V's tower class and GLM-4.1V's / GLM-4.6V's have the same fields and defaults.
HF_CONFIGS = {"glm4v_moe_vision": _TOWER, "glm4v_vision": _TOWER}
