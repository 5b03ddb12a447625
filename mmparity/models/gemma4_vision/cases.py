"""Gemma 4 vision parity: images of several sizes as the image processor hands them to the tower
(patch rows in raster order, padded to one ``max_patches`` with zero rows at position (-1, -1)),
each side's paired modules by Megatron's names, and the family's record."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import Gemma4VisionConfig

from mmparity.config import first_int
from mmparity.models.core import inputs, sublayers
from mmparity.models.core.layers import numbered_layers
from mmparity.models.gemma4_vision import mapping as converter
from mmparity.models.gemma4_vision import native, reference
from mmparity.models.gemma4_vision.config import config_problems
from mmparity.models.gemma4_vision.reference import OUTPUTS, vision_config
from mmparity.models.spec import Bench, Case, NoMegatron, Pair, Parity, Side, module_hooks, sbh_tokens_2d

COMPONENTS = ()
# transformers' layer, by the names of the tensors mcore's layer produces: its attention pair is
# the post-attention norm's output (the norm sits on linear_proj in mcore), its MLP pair the
# post-feedforward norm's.
HF_LAYER = sublayers.LayerNames("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                "post_feedforward_layernorm")
WHY_NO_MEGATRON = ("megatron-core and Megatron-LM main have no Gemma 4 vision tower (no axial RoPE over "
                   "processor positions, v norm, post-norms, clipped linears or position pooling)")
# Default images, in pooling windows (k x k patches) per side: none square, one filling the batch's
# max_patches, the others padded.
DEFAULT_WINDOWS = ((2, 3), (1, 4), (3, 3))


def window(cfg) -> int:
    """Image sides are multiples of this many pixels (the processor resizes them so)."""
    vc = vision_config(cfg)
    return first_int(vc.patch_size) * vc.pooling_kernel_size


def default_image_sizes(cfg) -> list[tuple[int, int]]:
    step = window(cfg)
    sizes = [(h * step, w * step) for h, w in DEFAULT_WINDOWS]
    return inputs.within(sizes, vision_config(cfg).position_embedding_size * first_int(vision_config(cfg).patch_size),
                         step)


def patch_rows(image: torch.Tensor, patch: int) -> torch.Tensor:
    """(C, H, W) -> (h·w, P·P·C) in raster order, each row in (P, P, C) order: the processor's."""
    channels, height, width = image.shape
    grid = image.reshape(channels, height // patch, patch, width // patch, patch)
    return grid.permute(1, 3, 2, 4, 0).reshape(-1, patch * patch * channels)


def processor_batch(images, patch: int, pooling: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images -> ``pixel_values`` (B, max_patches, P·P·C) and ``pixel_position_ids`` (B,
    max_patches, 2) as (column, row), padding rows zero at (-1, -1); ``max_patches`` the largest
    image's count rounded up to a multiple of pooling² (transformers' pooler needs one)."""
    rows = [patch_rows(image, patch) for image in images]
    most = max(r.shape[0] for r in rows)
    most = -(-most // pooling ** 2) * pooling ** 2
    values = torch.zeros(len(rows), most, rows[0].shape[1])
    positions = torch.full((len(rows), most, 2), -1, dtype=torch.long)
    for b, (image, r) in enumerate(zip(images, rows)):
        width = image.shape[2] // patch
        index = torch.arange(r.shape[0])
        values[b, : r.shape[0]] = r
        positions[b, : r.shape[0]] = torch.stack([index % width, index // width], dim=-1)
    return values, positions


def tower_inputs(cfg, sizes, seed: int) -> dict:
    """Seeded images of ``sizes`` as the tower takes them, for a case's data (a whole model's too:
    the pairs of the tower's layers read ``valid``): ``images`` (C, H, W) in [0, 1] (the processor
    rescales so; the tower maps them to [-1, 1]), ``pixel_values``, ``positions`` (the processor's
    ``pixel_position_ids``), ``valid`` (B, max_patches: the rows that are patches)."""
    vc = vision_config(cfg)
    images = [torch.sigmoid(i) for i in inputs.images(sizes, reference.CHANNELS, seed)]
    values, positions = processor_batch(images, first_int(vc.patch_size), vc.pooling_kernel_size)
    return {"images": images, "sizes": list(sizes), "pixel_values": values, "positions": positions,
            "valid": ~(positions == -1).all(dim=-1)}


def _case(name: str, cfg, sizes, seed: int, description: str) -> Case:
    return Case(name, tower_inputs(cfg, sizes, seed), OUTPUTS, description=description)


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    """Images of different sizes padded to one ``max_patches`` (the largest unpadded), and two of
    one size with no padding."""
    sizes = [tuple(s) for s in (image_sizes or default_image_sizes(cfg))]
    return [_case("padded", cfg, sizes, seed + 1,
                  f"{len(sizes)} images ({', '.join(f'{h}x{w}' for h, w in sizes)}) padded to one max_patches"),
            _case("static", cfg, [sizes[0]] * 2, seed + 2, f"2 images of {sizes[0][0]}x{sizes[0][1]}, no padding")]


def image_size_problems(cfg, sizes) -> list:
    vc = vision_config(cfg)
    step, patch = window(cfg), first_int(vc.patch_size)
    out = [f"image size {h}x{w}: sides must be multiples of patch_size x pooling_kernel_size = {step}"
           for h, w in sizes if h % step or w % step]
    return out + [f"image size {h}x{w}: {max(h, w) // patch} patches on a side; the position table has "
                  f"{vc.position_embedding_size} (position_embedding_size)"
                  for h, w in sizes if max(h, w) // patch > vc.position_embedding_size]


# --- the reference side (transformers) -----------------------------------------------------------

def valid_tokens(output, case: Case):
    """transformers' (B, max_patches, H) -> the real patches' rows (Σ patches, H), batch order."""
    t = output[0] if isinstance(output, (tuple, list)) else output
    t = getattr(t, "last_hidden_state", t)
    return t[case.data["valid"].to(t.device)]


def reference_run(model, case: Case) -> dict:
    param = next(model.parameters())
    out = model(pixel_values=case.data["pixel_values"].to(param.device, param.dtype),
                pixel_position_ids=case.data["positions"].to(param.device))
    return {"last_hidden_state": out.last_hidden_state}


def reference_pairs(model, cfg) -> list:
    out = [Pair("patch_embed", model.patch_embedder.input_proj, valid_tokens)]
    for i, layer in enumerate(model.encoder.layers):
        out += sublayers.layer_pairs(f"layer.{i}", layer, valid_tokens, HF_LAYER)
    return out


def no_component(name: str, *unused):
    raise KeyError(name)


REFERENCE = Side(reference_run, reference_pairs, no_component)


# --- the native side (mcore) ---------------------------------------------------------------------

def packed_tokens(output, case: Case):
    t = output[0] if isinstance(output, (tuple, list)) else output
    return t.reshape(-1, t.shape[-1])


def native_run(model, case: Case) -> dict:
    param = next(model.parameters())
    out = model(case.data["pixel_values"].to(param.device, param.dtype), case.data["positions"].to(param.device))
    if not model.post_process:
        return {}
    return {"last_hidden_state": out}


def native_pairs(model, cfg) -> list:
    out = [Pair("patch_embed", model.patch_embed, packed_tokens)] if model.pre_process else []
    return out + [pair for i, layer in numbered_layers(model.decoder)
                  for pair in sublayers.layer_pairs(f"layer.{i}", layer, sbh_tokens_2d)]


NATIVE = Side(native_run, native_pairs, no_component)


# --- the registry's record -------------------------------------------------------------------------

def random_config(pick) -> Gemma4VisionConfig:
    """Heads and key/value groups (GQA), head widths (multiples of 4 for the axial RoPE) apart from
    hidden / heads, depth, patch and pooling sizes, clipped linears and standardize on or off."""
    heads = pick([1, 2, 4])
    groups = pick([g for g in (1, 2, 4) if heads % g == 0])
    return Gemma4VisionConfig(
        hidden_size=pick([8, 12, 20]), intermediate_size=pick(range(1, 5)) * 6, num_hidden_layers=pick([1, 2, 3]),
        num_attention_heads=heads, num_key_value_heads=groups, head_dim=pick([4, 8, 12]), patch_size=pick([2, 3]),
        pooling_kernel_size=pick([2, 3]), position_embedding_size=pick([12, 16]),
        use_clipped_linears=pick([False, True]), standardize=pick([False, True]),
        hidden_activation=pick(["gelu_pytorch_tanh", "silu"]),
        rope_parameters={"rope_type": "axial", "rope_theta": pick([100.0, 10000.0])})


def problems(cfg) -> list:
    return config_problems(vision_config(cfg))


def hooks(towers):
    record = module_hooks(reference, native, converter.SPEC, reference=REFERENCE, native=NATIVE,
                          random_config=random_config, image_size_multiple=window,
                          image_size_problems=image_size_problems, parity=Parity(cases, components=COMPONENTS),
                          megatron=NoMegatron(WHY_NO_MEGATRON), bench=Bench())
    return replace(record, config=replace(record.config, problems=problems))
