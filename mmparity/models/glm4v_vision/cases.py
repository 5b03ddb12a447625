"""GLM-4.5V vision parity: each side's paired modules by Megatron's names (patch embedding, every
block's norms / attention / MLP, the merger's downsample convolution, projection, norm and
output), as the whole model (``glm4v_moe``) compares its tower."""

from __future__ import annotations

from mmparity.models.core import sublayers
from mmparity.models.core.layers import numbered_layers
from mmparity.models.qwen3_5 import cases as frames
from mmparity.models.spec import Pair, first_tensor, sbh_tokens_2d, tokens_2d


def conv_tokens(output, case):
    """The downsample convolution's (N, out, 1, 1): one row per merged token."""
    t = first_tensor(output)
    return t.reshape(t.shape[0], -1)


def reference_pairs(model, cfg) -> list[Pair]:
    out = [Pair("patch_embed", model.patch_embed, tokens_2d),
           Pair("post_conv_layernorm", model.post_conv_layernorm, tokens_2d)]
    for i, block in enumerate(model.blocks):
        out += sublayers.layer_pairs(f"layer.{i}", block, tokens_2d, sublayers.HF_VISION_BLOCK)
    return out + [Pair("final_layernorm", model.post_layernorm, tokens_2d),
                  Pair("merger.downsample", model.downsample, conv_tokens),
                  Pair("merger.linear_proj", model.merger.proj, tokens_2d),
                  Pair("merger.norm", model.merger.post_projection_norm, tokens_2d),
                  Pair("merger.linear_fc2", model.merger.down_proj, tokens_2d)]


def native_pairs(model, cfg) -> list[Pair]:
    out = []
    if model.pre_process:
        out += [Pair("patch_embed", model.patch_embed, frames._patch_embed_tokens),
                Pair("post_conv_layernorm", model.post_conv_layernorm, tokens_2d)]
    for i, layer in numbered_layers(model.decoder):
        out += sublayers.layer_pairs(f"layer.{i}", layer, sbh_tokens_2d)
    if model.merger is None:
        return out
    return out + [Pair("final_layernorm", model.decoder.final_layernorm, sbh_tokens_2d),
                  Pair("merger.downsample", model.merger.downsample, conv_tokens),
                  Pair("merger.linear_proj", model.merger.linear_proj, tokens_2d),
                  Pair("merger.norm", model.merger.norm, tokens_2d),
                  Pair("merger.linear_fc2", model.merger.linear_fc2, tokens_2d)]
