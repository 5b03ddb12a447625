"""GLM-4.5V vision parity: a static batch, packed single-frame rows and packed HF-processor rows
(T distinct frames), at sizes around the tiny 5×5 position table (inside it, beyond it on both
axes, across it on one); HF's ``last_hidden_state`` (the downsampled tokens) and
``pooler_output`` (the merger's); each side's paired modules by Megatron's names (patch
embedding, post-conv norm, every block's norms / attention / MLP, the final norm, the merger's
downsample convolution, projection, norm and output). The whole model compares its tower with the
same pairs."""

from __future__ import annotations

import torch
from transformers import Glm4vMoeVisionConfig

from mmparity.config import first_int
from mmparity.models.core import sublayers
from mmparity.models.core.layers import numbered_layers
from mmparity.models.glm4v_vision import mapping as converter
from mmparity.models.glm4v_vision import native, reference
from mmparity.models.qwen3_5 import cases as frames
from mmparity.models.spec import (
    Case, FamilyHooks, NoMegatron, Pair, Parity, Side, first_tensor, module_hooks, sbh_tokens_2d, tokens_2d)


def default_image_sizes(cfg) -> list[tuple[int, int]]:
    """Three sizes (pixels), none square: inside the position table, beyond it on both axes, and
    across it on one axis only."""
    p, m = first_int(cfg.patch_size), cfg.spatial_merge_size
    side = first_int(cfg.image_size) // p
    beyond = (side // m + 1) * m
    grids = [(m, 2 * m), (beyond + m, beyond + 2 * m), (beyond, m)]
    return [(h * p, w * p) for h, w in grids]


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    """A static batch of two images, then the sizes as packed single-frame rows and as T-frame
    processor rows."""
    sizes = [tuple(s) for s in (image_sizes or default_image_sizes(cfg))]
    return frames.packed_cases(cfg, seed, sizes, [sizes[0]] * 2)


def reference_run(model, case: Case) -> dict:
    param = next(model.parameters())
    rows, grid_thw = frames.processor_rows(case, model.config)
    out = model(rows.to(param.device, param.dtype), grid_thw=grid_thw.to(param.device))
    return {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output}


def native_run(model, case) -> dict:
    param = next(model.parameters())
    if case.data["layout"] == "pixels":
        pixels, kwargs = torch.stack(case.data["images"]).to(param.device, param.dtype), {}
    else:
        pixels, kwargs = frames.patch_rows(model, case).to(param.device, param.dtype), {"imgs_sizes": case.data["sizes"]}
    if not model.post_process:
        model.encode(pixels, **kwargs)
        return {}  # an earlier pipeline stage: the last one holds the outputs
    tokens, pooled = model.features(pixels, **kwargs)
    return {"last_hidden_state": tokens, "pooler_output": pooled}


def conv_tokens(output, case):
    """The downsample convolution's (N, out, 1, 1): one row per merged token."""
    t = first_tensor(output)
    return t.reshape(t.shape[0], -1)


def reference_pairs(model, cfg) -> list[Pair]:
    out = [Pair("patch_embed", model.patch_embed, tokens_2d),
           Pair("post_conv_layernorm", model.post_conv_layernorm, tokens_2d),
           Pair("pos_embed", model.embeddings, tokens_2d)]
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
                Pair("post_conv_layernorm", model.post_conv_layernorm, tokens_2d),
                Pair("pos_embed", model.pos_embed, tokens_2d)]
    for i, layer in numbered_layers(model.decoder):
        out += sublayers.layer_pairs(f"layer.{i}", layer, sbh_tokens_2d)
    if model.merger is None:
        return out
    return out + [Pair("final_layernorm", model.decoder.final_layernorm, sbh_tokens_2d),
                  Pair("merger.downsample", model.merger.downsample, conv_tokens),
                  Pair("merger.linear_proj", model.merger.linear_proj, tokens_2d),
                  Pair("merger.norm", model.merger.norm, tokens_2d),
                  Pair("merger.linear_fc2", model.merger.linear_fc2, tokens_2d)]


def no_component(name, model, cfg, seed):
    raise KeyError(name)


def random_config(pick) -> Glm4vMoeVisionConfig:
    heads = pick([1, 2, 4])
    patch, merge = pick([2, 3]), pick([1, 2])
    return Glm4vMoeVisionConfig(
        depth=pick(range(1, 4)), hidden_size=heads * pick([4, 8, 12]), num_heads=heads,
        intermediate_size=pick(range(1, 5)) * 6, in_channels=pick([1, 3]), patch_size=patch,
        image_size=patch * pick([2, 3, 5]), temporal_patch_size=pick([1, 2]), spatial_merge_size=merge,
        out_hidden_size=pick(range(3, 21)), attention_bias=pick([False, True]))


MEGATRON = NoMegatron("megatron-core and Megatron-LM main have no GLM vision tower (its post-conv norm, "
                      "bicubic-resampled position table and downsample-conv merger have no place in "
                      "QwenVLViTModel)")


def hooks(towers) -> FamilyHooks:
    return module_hooks(reference, native, converter.SPEC, reference=Side(reference_run, reference_pairs, no_component),
                        native=Side(native_run, native_pairs, no_component), random_config=random_config,
                        parity=Parity(cases), megatron=MEGATRON)
