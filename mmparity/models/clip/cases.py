"""CLIP parity: a static batch (position table resampled) and a packed mixed-size pass (HF: one
call per image), each side's paired modules and components, and the family's hook record.
SigLIP's cases reuse these."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import CLIPVisionConfig

from mmparity.config import first_int
from mmparity.models.core import inputs
from mmparity.models.core import megatron_side
from mmparity.models.core import sublayers
from mmparity.models.spec import (
    Bench, Case, FamilyHooks, LlavaTower, Pair, Parity, Published, Side, TowerShape, first_tensor, module_hooks,
    recording_patch, sbh_tokens_2d, tokens_2d)
from mmparity.models.clip import mapping as converter
from mmparity.models.clip import megatron as clip_megatron
from mmparity.models.clip import native
from mmparity.models.core.layers import numbered_layers
from mmparity.models.clip import reference
from mmparity.models.clip.reference import CLASS_TOKEN_LEN, OUTPUTS, patch_size
from mmparity.models.core import megatron_classes as upstream

COMPONENTS = ("patch_embed", "pos_embed")


def default_image_sizes(cfg) -> list[tuple[int, int]]:
    """Odd, non-square grids, one down- and one up-sampling; the last is the table's own grid."""
    p = patch_size(cfg)
    g = first_int(cfg.image_size) // p  # InternViT's config holds (h, w)
    return [(3 * p, 7 * p), (7 * p, 2 * p), (g * p, g * p)]


def make_cases(cfg, seed: int, image_sizes, outputs) -> list[Case]:
    sizes = list(image_sizes or default_image_sizes(cfg))
    static_sizes = [sizes[0]] * 3
    static_imgs = inputs.images(static_sizes, cfg.num_channels, seed + 1)
    h, w = static_sizes[0]
    out = [Case("static", {"images": static_imgs, "sizes": static_sizes}, outputs,
                description=f"static batch of 3 images {h}x{w}, position table resampled")]
    imgs = inputs.images(sizes, cfg.num_channels, seed)
    out.append(Case("packed", {"images": imgs, "sizes": sizes, "per_image": True}, outputs,
                    description=f"{len(sizes)} images {', '.join(f'{a}x{b}' for a, b in sizes)} "
                                "in one packed pass (HF: one call per image)"))
    return out


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    return make_cases(cfg, seed, image_sizes, OUTPUTS)


prepare_case = recording_patch(patch_size)


# --- the reference side (transformers) -----------------------------------------------------------


def reference_run(model, case: Case) -> dict:
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    if case.data.get("per_image"):
        calls = [img.unsqueeze(0) for img in case.data["images"]]
    else:
        calls = [torch.stack(case.data["images"])]
    hidden, pooled = [], []
    for batch in calls:
        out = model(batch.to(device, dtype), interpolate_pos_encoding=True)
        hidden.append(out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1]))
        if out.pooler_output is not None:
            pooled.append(out.pooler_output)
    result = {"last_hidden_state": torch.cat(hidden)}
    if pooled:
        result["pooler_output"] = torch.cat(pooled)
    return result


def conv_tokens(output, case: Case):
    """Conv output (B, H, h, w) -> (B·h·w, H) raster tokens."""
    conv = first_tensor(output)
    return conv.flatten(2).transpose(1, 2).reshape(-1, conv.shape[1])


def reference_pairs(model, cfg) -> list[Pair]:
    out = [Pair("patch_embed", model.embeddings.patch_embedding, conv_tokens),
           Pair("ln_pre", model.pre_layrnorm, tokens_2d)]
    for i, layer in enumerate(model.encoder.layers):
        out += sublayers.layer_pairs(f"layer.{i}", layer, tokens_2d, sublayers.HF_ENCODER)
    out.append(Pair("ln_post", model.post_layernorm, tokens_2d))
    return out


def reference_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    p = patch_size(cfg)
    if name == "patch_embed":
        img = inputs.images([inputs.component_image_size(p)], cfg.num_channels, seed)[0]
        conv = model.embeddings.patch_embedding(inputs.like_model(img.unsqueeze(0), model))
        return conv.flatten(2).transpose(1, 2)[0]
    if name == "pos_embed":
        return interpolated_positions(model.embeddings, cfg, inputs.COMPONENT_GRID,
                                      CLASS_TOKEN_LEN)
    raise KeyError(name)


def interpolated_positions(embeddings, cfg, grid, class_token_len: int) -> torch.Tensor:
    """HF's own ``interpolate_pos_encoding`` for a (h, w) patch grid -> (class + h·w, H)."""
    h, w = grid
    p = patch_size(cfg)
    weight = embeddings.position_embedding.weight
    probe = weight.new_zeros(1, class_token_len + h * w, weight.shape[-1])
    return embeddings.interpolate_pos_encoding(probe, h * p, w * p)[0]


REFERENCE = Side(reference_run, reference_pairs, reference_component)


# --- the native side (mcore) ---------------------------------------------------------------------


def native_run(model, case) -> dict:
    images, sizes = inputs.native_images(model, case, packed=bool(case.data.get("per_image")))
    hidden, pooled = model(images, return_pooled=True, **sizes)
    if not model.post_process:
        return {}  # an earlier pipeline stage: the last one holds the outputs
    out = {"last_hidden_state": hidden.reshape(-1, hidden.shape[-1])}
    if pooled is not None:
        out["pooler_output"] = pooled
    return out


def last_image(kind: str, model, to_2d):
    """Extractor: the whole tensor, or for a packed case only its last image's rows.

    ``kind`` is ``patch`` (h·w rows per image), ``tokens`` (class + h·w) or ``pooled`` (one).
    The HF side of a packed case runs one call per image, so its hooks hold the last image only.
    """

    def extract(output, case):
        t = to_2d(output, case)
        if not case.data.get("per_image"):
            return t
        h, w = case.data["sizes"][-1]
        p = model.patch_dim
        rows = {"patch": (h // p) * (w // p),
                "tokens": model.class_token_len + (h // p) * (w // p),
                "pooled": 1}[kind]
        return t[-rows:]

    return extract


def native_pairs(model, cfg) -> list:
    out = [Pair("patch_embed", model.patch_embedding, last_image("patch", model, tokens_2d))]
    if model.ln_pre is not None:
        out.append(Pair("ln_pre", model.ln_pre, last_image("tokens", model, tokens_2d)))
    out += [pair for i, layer in numbered_layers(model.decoder)
            for pair in sublayers.layer_pairs(f"layer.{i}", layer, last_image("tokens", model, sbh_tokens_2d))]
    if model.ln_post is not None:
        kind = "pooled" if model.ln_post_scope == "pooled" else "tokens"
        out.append(Pair("ln_post", model.ln_post, last_image(kind, model, tokens_2d)))
    if model.head is not None:
        out.append(Pair("head", model.head, last_image("pooled", model, tokens_2d)))
    return out


def native_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    if name == "patch_embed":
        img = inputs.images([inputs.component_image_size(model.patch_dim)], model.in_channels,
                            seed)[0]
        tokens, _, _ = model.patch_embedding(inputs.like_model(img.unsqueeze(0), model))
        return tokens[0]
    if name == "pos_embed":
        return model.position_embeddings(*inputs.COMPONENT_GRID)
    raise KeyError(name)


NATIVE = Side(native_run, native_pairs, native_component)


# --- the registry's record -------------------------------------------------------------------------

def random_tower_config(pick, config_class, **extra):
    """A random CLIP-like tower config (CLIP, SigLIP): heads, widths, depth, patch and grid."""
    heads, head_dim, patch = pick([1, 2, 3, 4, 6]), pick([4, 8, 12]), pick([4, 8])
    return config_class(hidden_size=heads * head_dim, intermediate_size=pick(range(1, 8)) * 12,
                        num_hidden_layers=pick(range(1, 4)), num_attention_heads=heads,
                        image_size=patch * pick(range(2, 6)), patch_size=patch, **extra)


def random_config(pick) -> CLIPVisionConfig:
    return random_tower_config(pick, CLIPVisionConfig, hidden_act=pick(["quick_gelu", "gelu"]))


def flop_shape(cfg, base: TowerShape) -> TowerShape:
    return replace(base, class_tokens=CLASS_TOKEN_LEN)


PUBLISHED = Published(
    source="CLIP ViT-L/14 vision tower (24 x 1024, patch 14, 224)",
    vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                num_attention_heads=16, image_size=224, patch_size=14, num_channels=3,
                hidden_act="quick_gelu", layer_norm_eps=1e-5, projection_dim=768),
    images=64, image_size=(224, 224),
    # As SigLIP: interpolated positions, one HF call per image. 17120 tokens (uniform: 16448).
    mixed=((224, 224), (168, 168), (280, 280), (196, 308), (308, 196), (252, 252), (140, 280),
           (224, 168)), mixed_images=64)


# --- Megatron's own classes (check --impl megatron, verify --load) --------------------------------

def image_groups(case: Case) -> list:
    """The case's images as stock ``CLIPViTModel`` takes them: one batch per call HF makes."""
    images = case.data["images"]
    return [[img] for img in images] if case.data.get("per_image") else [images]


def megatron_run(model, case: Case, cfg) -> dict:
    return {"last_hidden_state": torch.cat([upstream.run_clip(model, g).tokens for g in image_groups(case)])}


def megatron_run_as_vit(model, case: Case, cfg) -> dict:
    return {"last_hidden_state": torch.cat([upstream.run_vit(model, g).tokens for g in image_groups(case)])}


def megatron_pairs(model, cfg) -> list[Pair]:
    """Stock ``CLIPViTModel``'s modules (SigLIP's too) under the reference's pair names."""
    out = [Pair("patch_embed", model.conv1, conv_tokens)]
    if model.ln_pre is not None:
        out.append(Pair("ln_pre", model.ln_pre, tokens_2d))
    for i, layer in enumerate(model.decoder.layers):
        out += sublayers.layer_pairs(f"layer.{i}", layer, sbh_tokens_2d)
    if model.ln_post is not None:
        out.append(Pair("ln_post", model.ln_post, tokens_2d))
    return out


def patch_rows_of_reference_ln_pre(pairs: list, cfg) -> list:
    """``ViTModel``'s CLIP mode normalises the patch rows alone: HF CLIP's ``ln_pre`` output
    (class token first) is cut to its patch rows to be set against it."""
    tokens = (cfg.image_size // cfg.patch_size) ** 2

    def patch_rows_only(pair):
        def extract(output, case):
            t = pair.extract(output, case)
            return t.view(-1, 1 + tokens, t.shape[-1])[:, 1:].reshape(-1, t.shape[-1])
        return replace(pair, extract=extract)

    return [patch_rows_only(p) if p.name == "ln_pre" else p for p in pairs]


# What Megatron's default class has no place for, kept beside its state dict (the side file), on
# the config its layout is measured on: tests/models/test_upstream.py holds the converter to it.
SIDE_TENSORS = frozenset({"ln_post.weight", "ln_post.bias"})
MEGATRON = {
    "CLIPViTModel": megatron_side.MegatronClass(clip_megatron.build_clip, megatron_side.configured_size(lambda cfg: cfg),
                                                megatron_run, megatron_pairs),
    "ViTModel": megatron_side.MegatronClass(clip_megatron.build_clip_as_vit, megatron_side.configured_size(lambda cfg: cfg),
                                            megatron_run_as_vit, lambda model, cfg: megatron_side.vit_pairs(model),
                                            reference_pairs=patch_rows_of_reference_ln_pre,
                                            renamed=(("conv1.weight", "patch_embed.proj.weight"),)),
}


def hooks(towers) -> FamilyHooks:
    return module_hooks(reference, native, converter.SPEC, reference=REFERENCE, native=NATIVE,
                        random_config=random_config, parity=Parity(cases, prepare_case, COMPONENTS),
                        megatron=MEGATRON, bench=Bench(flop_shape, PUBLISHED),
                        llava_tower=LlavaTower(model_type=converter.SPEC.tower.model_type, megatron_type=clip_megatron.SUBTYPE,
                                               megatron_config=clip_megatron.transformer_config,
                                               class_token_len=CLASS_TOKEN_LEN,
                                               v4_checkpoint_root=converter.SPEC.tower.v4_checkpoint_root))
