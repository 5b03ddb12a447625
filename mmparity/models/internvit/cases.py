"""InternViT parity: CLIP's cases (a static batch with the position table resampled, a packed pass
of mixed sizes that transformers runs one image per call), transformers' and the native tower's
paired modules, the patch embedding and resampled positions alone, and the family's record."""

from __future__ import annotations

import torch
from transformers import InternVLVisionConfig

from mmparity.models.clip import cases as clip
from mmparity.models.core import inputs, sublayers
from mmparity.models.core.sublayers import LayerNames
from mmparity.models.core import megatron_side
from mmparity.models.internvit import mapping as converter
from mmparity.models.internvit import megatron as internvit_megatron
from mmparity.models.internvit import native, reference
from mmparity.models.internvit.reference import CLASS_TOKEN_LEN, OUTPUTS, patch_size, vision_config
from mmparity.models.spec import (
    Bench, Case, FamilyHooks, LlavaTower, Pair, Parity, Published, Side, TowerShape,
    module_hooks, tokens_2d)

COMPONENTS = ("patch_embed", "pos_embed")
# LLaVAModel's vision_model_type for the tower: Megatron's LLaVAModel and CLIPViTModel build both
# InternViT subtypes alike (the layer spec, the tower's own, makes the difference).
MEGATRON_SUBTYPE = "internvit"
# transformers' InternVLVisionLayer.
HF_LAYER = LayerNames("layernorm_before", "attention", "layernorm_after", "mlp")


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    return clip.make_cases(vision_config(cfg), seed, image_sizes, OUTPUTS)


def prepare_case(case: Case, cfg) -> Case:
    return clip.prepare_case(case, vision_config(cfg))


# --- the reference side (transformers) -----------------------------------------------------------

def reference_run(model, case: Case) -> dict:
    """One call for a static batch, one per image for mixed sizes; transformers resamples the
    position table for any grid that is not its own."""
    parameter = next(model.parameters())
    if case.data.get("per_image"):
        calls = [img.unsqueeze(0) for img in case.data["images"]]
    else:
        calls = [torch.stack(case.data["images"])]
    hidden = [model(batch.to(parameter.device, parameter.dtype)).last_hidden_state for batch in calls]
    return {"last_hidden_state": torch.cat([h.reshape(-1, h.shape[-1]) for h in hidden])}


def reference_pairs(model, cfg) -> list[Pair]:
    out = [Pair("patch_embed", model.embeddings.patch_embeddings.projection, clip.conv_tokens)]
    for i, layer in enumerate(model.encoder.layer):
        out += sublayers.layer_pairs(f"layer.{i}", layer, tokens_2d, HF_LAYER)
    if not isinstance(model.layernorm, torch.nn.Identity):
        out.append(Pair("ln_post", model.layernorm, tokens_2d))
    return out


def reference_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    cfg = vision_config(cfg)
    p = patch_size(cfg)
    if name == "patch_embed":
        img = inputs.images([inputs.component_image_size(p)], cfg.num_channels, seed)[0]
        conv = model.embeddings.patch_embeddings.projection(inputs.like_model(img.unsqueeze(0), model))
        return conv.flatten(2).transpose(1, 2)[0]
    if name == "pos_embed":
        h, w = inputs.COMPONENT_GRID
        table = model.embeddings.position_embeddings
        probe = table.new_zeros(1, CLASS_TOKEN_LEN + h * w, table.shape[-1])
        return model.embeddings.interpolate_pos_encoding(probe, h * p, w * p)[0]
    raise KeyError(name)


REFERENCE = Side(reference_run, reference_pairs, reference_component)


# --- the registry's record -------------------------------------------------------------------------

def random_config(pick) -> InternVLVisionConfig:
    """Either kind of layer (RMSNorm or LayerNorm), q/k norms and q/k/v biases on or off, the final
    LayerNorm kept or not, on CLIP's random sizes."""
    return clip.random_tower_config(
        pick, InternVLVisionConfig, norm_type=pick(["rms_norm", "layer_norm"]),
        use_qk_norm=pick([False, True]), attention_bias=pick([False, True]),
        use_mean_pooling=pick([False, True]), layer_scale_init_value=pick([0.1, 1.0]))


def flop_shape(cfg, base: TowerShape) -> TowerShape:
    from dataclasses import replace

    return replace(base, class_tokens=CLASS_TOKEN_LEN)


PUBLISHED = Published(
    source="InternViT-300M-448px-V2.5 (InternVL3-1B's tower: 24 x 1024, patch 14, 448)",
    vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                image_size=448, patch_size=14, num_channels=3, hidden_act="gelu", norm_type="layer_norm",
                attention_bias=True, use_qk_norm=False, layer_norm_eps=1e-6, use_mean_pooling=True),
    images=16, image_size=(448, 448),
    # InternVL feeds 448x448 tiles; mixed sizes go through transformers' resampled positions, one
    # call per image. 16 images, 16720 tokens (uniform: 16400).
    mixed=((448, 448), (336, 336), (560, 560), (392, 532), (532, 392), (448, 336), (504, 504),
           (420, 448)), mixed_images=16)


# --- Megatron's own class (check --impl megatron, verify --load) ---------------------------------

def megatron_reference_run(model, case: Case, cfg) -> dict:
    """transformers' tower output as Megatron's class computes it: the last layer's hidden state,
    before the final LayerNorm its CLIPViTModel has no place for (Identity with
    ``use_mean_pooling``, so then the same tensor)."""
    parameter = next(model.parameters())
    hidden = [model(img.unsqueeze(0) if img.dim() == 3 else img, output_hidden_states=True).hidden_states[-1]
              for img in _calls(case, parameter)]
    return {"last_hidden_state": torch.cat([h.reshape(-1, h.shape[-1]) for h in hidden])}


def _calls(case: Case, parameter) -> list:
    images = [img.to(parameter.device, parameter.dtype) for img in case.data["images"]]
    return images if case.data.get("per_image") else [torch.stack(images)]


def without_ln_post(pairs: list, cfg) -> list:
    return [pair for pair in pairs if pair.name != "ln_post"]


# What Megatron's default class has no place for, kept beside its state dict (the side file), on
# the config its layout is measured on: tests/models/test_upstream.py holds the converter to it.
SIDE_TENSORS = frozenset({"ln_post.weight", "ln_post.bias"})
MEGATRON = {"CLIPViTModel": megatron_side.MegatronClass(
    internvit_megatron.build_internvit, megatron_side.configured_size(vision_config), clip.megatron_run,
    clip.megatron_pairs, reference_pairs=without_ln_post, reference_run=megatron_reference_run,
    note="transformers' output before its final LayerNorm (kept beside the checkpoint); Megatron-LM's "
         "InternViT layer spec")}


def hooks(towers) -> FamilyHooks:
    return module_hooks(reference, native, converter.SPEC, reference=REFERENCE, native=clip.NATIVE,
                        random_config=random_config, parity=Parity(cases, prepare_case, COMPONENTS),
                        megatron=MEGATRON, bench=Bench(flop_shape, PUBLISHED),
                        llava_tower=LlavaTower(model_type=converter.MODEL_TYPE, class_token_len=CLASS_TOKEN_LEN,
                                               megatron_type=MEGATRON_SUBTYPE,
                                               megatron_config=internvit_megatron.transformer_config,
                                               megatron_layer_spec=internvit_megatron.megatron_layer_spec))
