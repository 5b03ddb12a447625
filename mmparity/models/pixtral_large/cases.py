"""Pixtral-Large parity: packed and static cases through tower, merger and projector, each side's
paired modules, the merger component, and the family's hook record."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

from mmparity.models.core import inputs
from mmparity.models.pixtral import cases as pixtral
from mmparity.models.core import megatron_side
from mmparity.models.spec import (
    Bench, Case, FamilyHooks, Pair, Parity, Side, TowerShape, module_hooks, recording_patch, tokens_2d)
from mmparity.models.pixtral_large import mapping as converter
from mmparity.models.pixtral_large import native
from mmparity.models.pixtral_large import reference
from mmparity.models.pixtral_large.reference import OUTPUTS, patch_size, vision_config
from mmparity.models.core import megatron_classes as upstream

COMPONENTS = ("merger",)
# Components whose module lives on the last pipeline stage (the others run on the first).
LAST_STAGE_COMPONENTS = ("merger",)
# Grids of the merger component, the same on both sides: one odd (last row / column dropped),
# one even.
MERGER_GRIDS = (inputs.COMPONENT_GRID, (4, 6))


def image_size_problems(cfg, sizes) -> list[str]:
    """The merger needs at least one whole merge block per image (HF drops odd edge rows/cols);
    the tower takes no more patches per side than its config allows."""
    p, m = patch_size(cfg), cfg.spatial_merge_size
    return [f"image size {h}x{w} gives a {h // p}x{w // p} patch grid, smaller than one "
            f"{m}x{m} merge block (need at least {m * p}x{m * p} pixels)"
            for h, w in sizes if h // p < m or w // p < m] + pixtral.size_limit_problems(cfg.vision_config, sizes)


def default_image_sizes(cfg) -> list[tuple[int, int]]:
    """Odd grids (the merger drops their last row / column, as ``F.unfold`` does), non-square, cut
    to what the config allows."""
    p = patch_size(cfg)
    return inputs.within([(5 * p, 7 * p), (4 * p, 6 * p), (7 * p, 2 * p)],
                         pixtral.max_patches_per_side(cfg.vision_config) * p, p, least=cfg.spatial_merge_size)


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    cfg = vision_config(cfg)
    sizes = list(image_sizes or default_image_sizes(cfg))
    channels = cfg.vision_config.num_channels
    imgs = inputs.images(sizes, channels, seed)
    out = [Case("packed", {"images": imgs, "sizes": sizes}, OUTPUTS,
                description=f"{len(sizes)} images {', '.join(f'{h}x{w}' for h, w in sizes)} in one "
                            "packed pass, merged per image")]
    static_sizes = [sizes[0]] * 2
    static_imgs = inputs.images(static_sizes, channels, seed + 1)
    out.append(Case("static", {"images": static_imgs, "sizes": static_sizes}, OUTPUTS,
                    description=f"static batch of 2 images {static_sizes[0][0]}x{static_sizes[0][1]}"))
    return out


prepare_case = recording_patch(patch_size)


def merger_probe(hidden: int, seed: int) -> torch.Tensor:
    """Seeded packed tokens (ΣN, hidden) for the images of :data:`MERGER_GRIDS`."""
    n = sum(h * w for h, w in MERGER_GRIDS)
    return torch.randn(n, hidden, generator=inputs.generator(seed + 104729))


# --- the reference side (transformers) -----------------------------------------------------------


def reference_run(model, case: Case) -> dict:
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    batch, sizes = inputs.pad_batch(case.data["images"])
    image_sizes = torch.tensor(sizes)
    out = model.vision_tower(batch.to(device, dtype), image_sizes=image_sizes,
                             output_hidden_states=True)
    layer = model.config.vision_feature_layer
    if not isinstance(layer, int):
        raise NotImplementedError("several vision_feature_layer values are not supported")
    features = out.hidden_states[layer]
    seen = {}
    handle = model.multi_modal_projector.patch_merger.register_forward_hook(
        lambda module, args, output: seen.__setitem__("merger", output))
    try:
        projected = model.multi_modal_projector(features.squeeze(0), image_sizes)
    finally:
        handle.remove()
    return {"merger": seen["merger"], "projector": projected}


def reference_pairs(model, cfg) -> list[Pair]:
    proj = model.multi_modal_projector
    return pixtral.reference_pairs(model.vision_tower, cfg.vision_config) + [
        Pair("merger_norm", proj.norm, tokens_2d),
        Pair("merger", proj.patch_merger, tokens_2d),
        Pair("projector", proj, tokens_2d),
    ]


def reference_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    if name == "merger":
        merger = model.multi_modal_projector.patch_merger
        p = patch_size(cfg)
        tokens = merger_probe(cfg.vision_config.hidden_size, seed)
        sizes = torch.tensor([(h * p, w * p) for h, w in MERGER_GRIDS])
        return merger(inputs.like_model(tokens, model), sizes)
    raise KeyError(name)


REFERENCE = Side(reference_run, reference_pairs, reference_component)


# --- the native side (mcore) ---------------------------------------------------------------------


def native_run(model, case) -> dict:
    images, sizes = inputs.native_images(model, case, packed=case.name != "static")
    merged, projected = model(images, return_merged=True, **sizes)
    if not model.post_process:
        return {}  # an earlier pipeline stage: the last one holds the outputs
    return {"merger": merged.reshape(-1, merged.shape[-1]),
            "projector": projected.reshape(-1, projected.shape[-1])}


def native_pairs(model, cfg) -> list:
    vit = model.vision_model
    out = pixtral.native_pairs(vit, cfg.vision_config)
    if vit.merger is not None:
        out += [Pair("merger_norm", vit.merger.pre_norm, tokens_2d), Pair("merger", vit.merger, tokens_2d)]
    out.append(Pair("projector", model.vision_projection, tokens_2d))
    return out


def native_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    """The merger alone, without its norm: exactly what HF ``Mistral3PatchMerger`` computes."""
    if name == "merger":
        merger = model.vision_model.merger
        tokens = merger_probe(merger.hidden_size, seed)
        return merger.merge(inputs.like_model(tokens, model), MERGER_GRIDS)
    raise KeyError(name)


NATIVE = Side(native_run, native_pairs, native_component)


# --- the registry's record -------------------------------------------------------------------------

def random_config(pick) -> Mistral3Config:
    heads = pick([1, 2, 4, 6])
    head_dim = pick([4, 8, 12])
    vision = PixtralVisionConfig(hidden_size=heads * head_dim, intermediate_size=pick(range(1, 7)) * 12,
                                 num_hidden_layers=pick(range(1, 3)), num_attention_heads=heads,
                                 image_size=64, patch_size=8, hidden_act="silu")
    text = MistralConfig(hidden_size=pick([8, 12, 24, 40]), intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=4, vocab_size=16, rms_norm_eps=1e-5)
    return Mistral3Config(vision_config=vision, text_config=text, spatial_merge_size=pick([1, 2, 3]),
                          multimodal_projector_bias=pick([False, True]))


def flop_shape(cfg, base: TowerShape) -> TowerShape:
    m, text = cfg.spatial_merge_size, cfg.text_config.hidden_size
    # merger Linear(m²H -> H), then the projector's linear_1 (H -> text) and linear_2 (text -> text)
    return replace(base, gated=True, merge=m,
                   merger=((base.hidden * m * m, base.hidden), (base.hidden, text), (text, text)))


# --- Megatron's own class: ViTModel(use_merger=True) + MultimodalProjector ------------------------

def megatron_cases(hooks: FamilyHooks, cfg, seed: int, image_sizes) -> list[Case]:
    """Even grids (4x6, 6x2 patches, which Megatron's merger takes) for the numbers, and odd ones
    (5x7, 3x5: HF drops the last row / column, Megatron's merger raises) as ``odd_*`` cases."""
    if image_sizes:
        return hooks.parity.cases(cfg, seed, image_sizes)
    p = cfg.vision_config.patch_size
    even = hooks.parity.cases(cfg, seed, [(4 * p, 6 * p), (6 * p, 2 * p)])
    odd = [replace(c, name=f"odd_{c.name}") for c in hooks.parity.cases(cfg, seed, [(5 * p, 7 * p), (3 * p, 5 * p)])]
    return even + odd


def megatron_run(model, case: Case, cfg) -> dict:
    merged, projected = megatron_side.tower_and_projection(model, case)
    return {"merger": merged, "projector": projected}


def megatron_pairs(model, cfg) -> list[Pair]:
    tower = model.vision_model
    return megatron_side.vit_pairs(tower) + [Pair("merger_norm", tower.merger.pre_norm, tokens_2d),
                                             Pair("merger", tower.merger, tokens_2d),
                                             Pair("projector", model.vision_projection, tokens_2d)]


# What Megatron's default class has no place for, kept beside its state dict (the side file), on
# the config its layout is measured on: tests/models/test_upstream.py holds the converter to it.
SIDE_TENSORS = frozenset()
MEGATRON = {"ViTModel+MultimodalProjector": megatron_side.MegatronClass(
    upstream.build_pixtral_large, megatron_cases, megatron_run, megatron_pairs)}


def hooks(towers) -> FamilyHooks:
    return module_hooks(reference, native, converter.SPEC, reference=REFERENCE, native=NATIVE,
                        random_config=random_config, image_size_problems=image_size_problems,
                        parity=Parity(cases, prepare_case, COMPONENTS, LAST_STAGE_COMPONENTS),
                        megatron=MEGATRON, bench=Bench(flop_shape))
