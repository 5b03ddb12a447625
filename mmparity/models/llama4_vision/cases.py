"""Llama 4 vision parity: batches of fixed-size tiles (the only input transformers' tower takes),
each side's paired modules, and the family's record."""

from __future__ import annotations

import torch
from transformers import Llama4VisionConfig

from mmparity.config import first_int
from mmparity.models.core import inputs, sublayers
from mmparity.models.core.layers import numbered_layers
from mmparity.models.core.sublayers import LayerNames
from mmparity.models.llama4_vision import mapping as converter
from mmparity.models.llama4_vision import native, reference
from mmparity.models.llama4_vision.reference import OUTPUTS, patch_size, vision_config
from mmparity.models.spec import (
    Bench, Case, NoMegatron, Pair, Parity, Side, module_hooks, recording_patch, sbh_tokens_2d, tokens_2d)

COMPONENTS = ()
HF_LAYER = LayerNames("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
WHY_NO_MEGATRON = ("Megatron-LM has no Llama 4 vision tower: its layers are CLIP's, but CLIPViTModel puts "
                   "the class token first, has no 2D RoPE and no pixel-shuffle adapter")


def tile_size(cfg) -> tuple[int, int]:
    size = first_int(vision_config(cfg).image_size)
    return size, size


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    """Two batches of tiles: 3 (one image's tiles) and 5 (a second image's, seeded apart)."""
    vc = vision_config(cfg)
    size = tile_size(vc)
    out = []
    for name, count, offset in (("static", 3, 1), ("tiles", 5, 2)):
        sizes = [size] * count
        out.append(Case(name, {"images": inputs.images(sizes, vc.num_channels, seed + offset), "sizes": sizes},
                        OUTPUTS, description=f"{count} tiles of {size[0]}x{size[1]} in one batch"))
    return out


def image_size_problems(cfg, sizes) -> list:
    size = tile_size(cfg)
    return [f"image size {h}x{w}: Llama 4 tiles are {size[0]}x{size[1]} (image_size)"
            for h, w in sizes if (h, w) != size]


prepare_case = recording_patch(patch_size)


# --- the reference side (transformers) -----------------------------------------------------------

def reference_run(model, case: Case) -> dict:
    parameter = next(model.parameters())
    pixels = torch.stack(case.data["images"]).to(parameter.device, parameter.dtype)
    hidden = model(pixels).last_hidden_state
    return {"last_hidden_state": hidden.reshape(-1, hidden.shape[-1])}


def reference_pairs(model, cfg) -> list:
    out = [Pair("patch_embed", model.patch_embedding, tokens_2d), Pair("ln_pre", model.layernorm_pre, tokens_2d)]
    for i, layer in enumerate(model.model.layers):
        out += sublayers.layer_pairs(f"layer.{i}", layer, tokens_2d, HF_LAYER)
    return out + [Pair("ln_post", model.layernorm_post, tokens_2d), Pair("adapter", model.vision_adapter, tokens_2d)]


def no_component(name: str, *unused):
    raise KeyError(name)


REFERENCE = Side(reference_run, reference_pairs, no_component)


# --- the native side (mcore) ---------------------------------------------------------------------

def native_run(model, case: Case) -> dict:
    images, _ = inputs.native_images(model, case, packed=False)
    hidden = model(images)
    if not model.post_process:
        return {}
    return {"last_hidden_state": hidden.reshape(-1, hidden.shape[-1])}


def native_pairs(model, cfg) -> list:
    out = []
    if model.pre_process:
        out += [Pair("patch_embed", model.patch_embedding, tokens_2d), Pair("ln_pre", model.ln_pre, tokens_2d)]
    out += [pair for i, layer in numbered_layers(model.decoder)
            for pair in sublayers.layer_pairs(f"layer.{i}", layer, sbh_tokens_2d)]
    if model.post_process:
        out += [Pair("ln_post", model.ln_post, tokens_2d), Pair("adapter", model.adapter, tokens_2d)]
    return out


NATIVE = Side(native_run, native_pairs, no_component)


# --- the registry's record -------------------------------------------------------------------------

def random_config(pick) -> Llama4VisionConfig:
    """Heads, head widths (multiples of 4 for the 2D RoPE), depth, patch and an even grid; the
    layers' MLP is 4 x hidden, as the pixel-shuffled adapter input must be."""
    heads, head_dim, patch = pick([1, 2, 3, 4]), pick([4, 8, 12]), pick([4, 8])
    hidden, out = heads * head_dim, pick([8, 20, 36])
    return Llama4VisionConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=pick([1, 2, 3]),
                              num_attention_heads=heads, image_size=patch * pick([2, 4, 6]), patch_size=patch,
                              vision_output_dim=out, projector_input_dim=out, projector_output_dim=out,
                              pixel_shuffle_ratio=0.5)


def hooks(towers):
    return module_hooks(reference, native, converter.SPEC, reference=REFERENCE, native=NATIVE,
                        random_config=random_config, image_size_problems=image_size_problems,
                        parity=Parity(cases, prepare_case, COMPONENTS), megatron=NoMegatron(WHY_NO_MEGATRON),
                        bench=Bench())
