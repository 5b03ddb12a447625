"""SigLIP parity: CLIP's cases with SigLIP's outputs, paired modules and position check, and the
family's hook record."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import SiglipVisionConfig

from mmparity.models.core import sublayers
from mmparity.models.clip import cases as clip
from mmparity.models.clip import megatron as clip_megatron
from mmparity.models.core import inputs
from mmparity.models.core import megatron_side
from mmparity.models.spec import (
    Bench, Case, FamilyHooks, LlavaTower, Pair, Parity, Published, Side, TowerShape, module_hooks, tokens_2d)
from mmparity.models.siglip import megatron as siglip_megatron
from mmparity.models.siglip import mapping as converter
from mmparity.config import vision_sub_config
from mmparity.models.siglip import native
from mmparity.models.siglip import reference
from mmparity.models.siglip.reference import vision_config

COMPONENTS = clip.COMPONENTS


def outputs(cfg) -> tuple:
    cfg = vision_config(cfg)
    return ("last_hidden_state", "pooler_output") if cfg.vision_use_head else ("last_hidden_state",)


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    return clip.make_cases(vision_config(cfg), seed, image_sizes, outputs(cfg))


# --- the reference side (transformers) -------------------------------------------------------------

def reference_pairs(model, cfg) -> list[Pair]:
    out = [Pair("patch_embed", model.embeddings.patch_embedding, clip.conv_tokens)]
    for i, layer in enumerate(model.encoder.layers):
        out += sublayers.layer_pairs(f"layer.{i}", layer, tokens_2d, sublayers.HF_ENCODER)
    out.append(Pair("ln_post", model.post_layernorm, tokens_2d))
    if getattr(model, "head", None) is not None:
        out.append(Pair("head", model.head, tokens_2d))
    return out


def reference_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    cfg = vision_config(cfg)
    if name == "pos_embed":
        return clip.interpolated_positions(model.embeddings, cfg, inputs.COMPONENT_GRID, 0)
    return clip.reference_component(name, model, cfg, seed)


REFERENCE = Side(clip.reference_run, reference_pairs, reference_component)


# --- the registry's record -------------------------------------------------------------------------

def random_config(pick) -> SiglipVisionConfig:
    return clip.random_tower_config(pick, SiglipVisionConfig, vision_use_head=pick([False, True]))


PUBLISHED = Published(
    source="SigLIP so400m-patch14-384 vision tower (27 x 1152, pooling head)",
    vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                num_attention_heads=16, image_size=384, patch_size=14, num_channels=3,
                hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=True),
    # HF's stride-14 conv drops the last 6 pixels of 384: 378 is the same 27x27 grid, and the
    # native tower refuses sizes that are not a multiple of the patch.
    images=64, image_size=(378, 378),
    note="378x378 = the 27x27 patch grid HF makes of 384x384",
    # Released at one size; mixed sizes go through HF's position interpolation, one HF call per
    # image. 64 images, 45696 tokens (uniform: 46656).
    mixed=((378, 378), (224, 224), (448, 448), (434, 434), (280, 504), (504, 280), (336, 336),
           (308, 462)), mixed_images=64)


def flop_shape(cfg, base: TowerShape) -> TowerShape:
    return replace(base, head="attention_pool" if vision_sub_config(cfg).vision_use_head else None)


# What Megatron's default class has no place for, kept beside its state dict (the side file), on
# the config its layout is measured on: tests/models/test_upstream.py holds the converter to it.
SIDE_TENSORS = frozenset({
    "head.probe", "head.attention.linear_q.weight", "head.attention.linear_q.bias",
    "head.attention.linear_kv.weight", "head.attention.linear_kv.bias",
    "head.attention.linear_proj.weight", "head.attention.linear_proj.bias",
    "head.mlp.linear_fc1.layer_norm_weight", "head.mlp.linear_fc1.layer_norm_bias",
    "head.mlp.linear_fc1.weight", "head.mlp.linear_fc1.bias",
    "head.mlp.linear_fc2.weight", "head.mlp.linear_fc2.bias"})
# Stock CLIPViTModel as SigLIP (conv bias, ln_post on every token; the attention-pool head has no
# place there and is kept aside by the converter).
MEGATRON = {"CLIPViTModel": megatron_side.MegatronClass(
    siglip_megatron.build_siglip, megatron_side.configured_size(lambda cfg: cfg), clip.megatron_run, clip.megatron_pairs)}


def hooks(towers) -> FamilyHooks:
    return module_hooks(reference, native, converter.SPEC, reference=REFERENCE, native=clip.NATIVE,
                        random_config=random_config, parity=Parity(cases, clip.prepare_case, COMPONENTS),
                        megatron=MEGATRON, bench=Bench(flop_shape, PUBLISHED),
                        llava_tower=LlavaTower(model_type=converter.SPEC.tower.model_type, megatron_type=siglip_megatron.SUBTYPE,
                                               megatron_config=clip_megatron.transformer_config,
                                               v4_checkpoint_root=converter.SPEC.tower.v4_checkpoint_root))
