"""The Megatron side of ``check --impl megatron``: per family, how Megatron's own class
(:mod:`mmparity.upstream.models`) is fed and read.

Each family names one or more Megatron classes (:data:`CLASSES`; the first is the default). A
record says which builder the class uses (the converter's mcore state dict loads into it as is), which of the family's cases it accepts
(stock CLIP/SigLIP and ``ViTModel``'s learned positions take only their configured size,
``KimiViTModel`` has no temporal axis), how to run a case, and which of its submodules pair with
the HF reference's paired modules of the same name, so that a divergence is located exactly as in
the native check.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from transformers import LlavaConfig

from mmparity.cases import qwen3_5 as qwen_cases
from mmparity.cases.clip import conv_tokens
from mmparity.cases.core import Case, FamilyHooks, Pair, sbh_tokens_2d, tokens_2d
from mmparity.hfconfig import padded_vocab_size
from mmparity.reference import clip as clip_reference
from mmparity.reference import llava as llava_reference
from mmparity.upstream import models
from mmparity.upstream.te_stand_ins import cuda_calls_on_host


def _same_cases(hooks: FamilyHooks, cfg, seed: int, image_sizes) -> list[Case]:
    return hooks.cases(cfg, seed, image_sizes)


class UnsupportedInput(ValueError):
    """Megatron's class cannot take the inputs asked for (not a parity finding: a usage error)."""


def _configured_size(vision_cfg: Callable):
    """Cases at the tower's configured size only (its position table is fixed and not resampled)."""
    def cases(hooks: FamilyHooks, cfg, seed: int, image_sizes) -> list[Case]:
        side = vision_cfg(cfg).image_size
        other = sorted({f"{h}x{w}" for h, w in image_sizes or () if (h, w) != (side, side)})
        if other:
            raise UnsupportedInput(f"Megatron's class takes only the configured image size "
                                   f"{side}x{side} (fixed position table), not {', '.join(other)}")
        return hooks.cases(cfg, seed, image_sizes or [(side, side)] * 2)
    return cases


def _pixtral_large_cases(hooks: FamilyHooks, cfg, seed: int, image_sizes) -> list[Case]:
    """Even grids (4x6, 6x2 patches, which Megatron's merger takes) for the numbers, and odd ones
    (5x7, 3x5: HF drops the last row / column, Megatron's merger raises) as ``odd_*`` cases."""
    if image_sizes:
        return hooks.cases(cfg, seed, image_sizes)
    p = cfg.vision_config.patch_size
    even = hooks.cases(cfg, seed, [(4 * p, 6 * p), (6 * p, 2 * p)])
    odd = [dataclasses.replace(c, name=f"odd_{c.name}")
           for c in hooks.cases(cfg, seed, [(5 * p, 7 * p), (3 * p, 5 * p)])]
    return even + odd


def _kimi_cases(hooks: FamilyHooks, cfg, seed: int, image_sizes) -> list[Case]:
    return [c for c in hooks.cases(cfg, seed, image_sizes) if c.name != "video"]


def _image_groups(case: Case) -> list:
    images = case.data["images"]
    return [[img] for img in images] if case.data.get("per_image") else [images]


def _run_clip(model, case: Case, cfg) -> dict:
    return {"last_hidden_state": torch.cat([models.run_clip(model, g).tokens
                                            for g in _image_groups(case)])}


def _run_clip_as_vit(model, case: Case, cfg) -> dict:
    return {"last_hidden_state": torch.cat([models.run_vit(model, g).tokens
                                            for g in _image_groups(case)])}


def _run_pixtral(model, case: Case, cfg) -> dict:
    return {"last_hidden_state": models.run_vit(model, case.data["images"]).tokens}


def _run_pixtral_large(model, case: Case, cfg) -> dict:
    merged = models.run_vit(model.vision_model, case.data["images"]).tokens
    return {"merger": merged, "projector": model.vision_projection(merged)}


def _run_qwen(model, case: Case, cfg) -> dict:
    rows, grid_thw = qwen_cases.processor_rows(case, cfg)
    grids = [(h, w) for _, h, w in grid_thw.tolist()]
    if case.data["layout"] == "pixels":
        tokens, merged = models.run_qwen(model, grids, pixels=torch.stack(case.data["images"]))
    else:
        tokens, merged = models.run_qwen(model, grids, rows=rows)
    return {"last_hidden_state": tokens, "pooler_output": merged}


def _run_kimi(model, case: Case, cfg) -> dict:
    tower, projection = models.kimi_parts(model)
    if case.name == "projector":
        return {"image_embeds": projection(case.data["features"])}
    seen = {}
    handle = tower.final_ln.register_forward_hook(
        lambda module, args, out: seen.setdefault("x", out))
    try:
        merged, projected = models.run_kimi(model, case.data["images"])
    finally:
        handle.remove()
    out = {"pooler_output": merged,
           "last_hidden_state": seen["x"].reshape(-1, merged.shape[-1] // 4)}
    if projected is not None:
        out["image_embeds"] = projected
    return out


def _run_llava(model, case: Case, cfg) -> dict:
    """Stock ``LLaVAModel`` on the compact batch (one -200 placeholder per image): logits over the
    real vocabulary and, with labels, the per-token loss and the expanded loss mask, cut to HF's
    row length. Megatron's loss spans its padded vocabulary (see docs/megatron.md)."""
    images = torch.stack(case.data["images"]).to(next(model.parameters()).dtype)
    ids = case.data["input_ids"]
    tiles = torch.tensor(case.data["num_image_tiles"], dtype=torch.int)
    with cuda_calls_on_host():
        logits, _ = model(images, ids, None, None, num_image_tiles=tiles, runtime_gather_output=True)
        loss, mask = model(images, ids, None, None, labels=case.data["labels"],
                           loss_mask=case.data["loss_mask"], num_image_tiles=tiles)
    keep, vocab = case.data["length"], cfg.text_config.vocab_size
    mask = mask[:, :keep]
    return {"logits": logits[:, :keep, :vocab].reshape(-1, vocab),
            "loss_mask": mask.reshape(-1).float(),
            "token_loss": (loss[:, :keep] * mask).reshape(-1)}


def _clip_pairs(model, cfg) -> list[Pair]:
    out = [Pair("patch_embed", model.conv1, conv_tokens)]
    if model.ln_pre is not None:
        out.append(Pair("ln_pre", model.ln_pre, tokens_2d))
    out += [Pair(f"layer.{i}", layer, sbh_tokens_2d) for i, layer in enumerate(model.decoder.layers)]
    if model.ln_post is not None:
        out.append(Pair("ln_post", model.ln_post, tokens_2d))
    return out


def _vit_pairs(tower) -> list[Pair]:
    out = [Pair("patch_embed", tower.patch_embed, tokens_2d)]
    if tower.ln_pre is not None:
        out.append(Pair("ln_pre", tower.ln_pre, tokens_2d))
    return out + _layer_pairs(tower)


def _layer_pairs(tower) -> list[Pair]:
    return [Pair(f"layer.{i}", layer, sbh_tokens_2d) for i, layer in enumerate(tower.decoder.layers)]


def _pixtral_large_pairs(model, cfg) -> list[Pair]:
    tower = model.vision_model
    return _vit_pairs(tower) + [Pair("merger_norm", tower.merger.pre_norm, tokens_2d),
                                Pair("merger", tower.merger, tokens_2d),
                                Pair("projector", model.vision_projection, tokens_2d)]


def _qwen_pairs(model, cfg) -> list[Pair]:
    return _layer_pairs(model) + [Pair("merger.norm", model.merger.patch_norm, tokens_2d),
                                  Pair("merger.linear_fc1", model.merger.linear_fc1, tokens_2d),
                                  Pair("merger.linear_fc2", model.merger.linear_fc2, tokens_2d)]


def _kimi_pairs(model, cfg) -> list[Pair]:
    tower, projection = models.kimi_parts(model)
    out = [Pair("patch_embed", tower.patch_embed, tokens_2d)] + _layer_pairs(tower)
    out.append(Pair("final_layernorm", tower.final_ln, tokens_2d))
    if projection is not None:
        out.append(Pair("projector", projection, tokens_2d))
    return out


def _no_pairs(model, cfg) -> list[Pair]:
    return []


def keep_reference_pairs(pairs: list, cfg) -> list:
    return pairs


def _patch_rows_of_reference_ln_pre(pairs: list, cfg) -> list:
    """``ViTModel``'s CLIP mode normalises the patch rows alone: HF CLIP's ``ln_pre`` output
    (class token first) is cut to its patch rows to be set against it."""
    tokens = (cfg.image_size // cfg.patch_size) ** 2

    def patch_rows_only(pair):
        def extract(output, case):
            t = pair.extract(output, case)
            return t.view(-1, 1 + tokens, t.shape[-1])[:, 1:].reshape(-1, t.shape[-1])
        return Pair(pair.name, pair.module, extract)

    return [patch_rows_only(p) if p.name == "ln_pre" else p for p in pairs]


def keep_reference_outputs(outputs: dict, case: Case, cfg, tp: int) -> dict:
    return outputs


def _loss_over_padded_vocabulary(outputs: dict, case: Case, cfg, tp: int) -> dict:
    """HF's per-token loss recomputed over the vocabulary padded as Megatron-LM pads it at ``tp``:
    Megatron's cross entropy spans the pad rows, whose converted output weights are zero, so each
    adds a logit of 0 to the softmax. That is what Megatron computes for any padded checkpoint;
    HF's unpadded loss is not its function (docs/megatron.md, llava)."""
    labels = case.data["hf_labels"]
    batch, vocab = labels.shape[0], cfg.text_config.vocab_size
    logits = outputs["logits"].view(batch, -1, vocab)
    rows = padded_vocab_size(vocab, tp=tp)
    padded = F.pad(logits, (0, rows - vocab))
    shifted = F.cross_entropy(padded[:, :-1].reshape(-1, rows), labels[:, 1:].reshape(-1).to(padded.device),
                              ignore_index=llava_reference.IGNORE_INDEX, reduction="none").view(batch, -1)
    per_token = torch.cat([shifted, shifted.new_zeros(batch, 1)], dim=1)
    mask = outputs["loss_mask"].view(batch, -1)
    return {**outputs, "token_loss": (per_token * mask).reshape(-1)}


def llava_clip_config() -> LlavaConfig:
    """LLaVA with the CLIP tiny tower, which stock megatron-core's ``LLaVAModel`` builds (Megatron-LM
    main's cannot build any ``vit_model`` tower, see docs/megatron.md): features from the
    penultimate layer, class token dropped (``default``), the llava tiny text model."""
    base = llava_reference.tiny_config()
    return LlavaConfig(vision_config=clip_reference.tiny_config(), text_config=base.text_config,
                       image_token_index=base.image_token_index, projector_hidden_act="gelu",
                       vision_feature_layer=-2, vision_feature_select_strategy="default",
                       multimodal_projector_bias=True, tie_word_embeddings=False)


@dataclass(frozen=True)
class MegatronClass:
    """One Megatron class a family's converted weights load into.

    ``upstream``: its builder's name in :mod:`mmparity.upstream`;
    ``cases(hooks, cfg, seed, image_sizes)``: the family's cases it accepts;
    ``run(model, case, cfg)``: its outputs under the HF output names (an HF output it has no
    counterpart for is absent); ``pairs(model, cfg)``: its submodules named as the reference's pairs;
    ``reference_pairs(pairs, cfg)``: the reference's pairs as set against this class;
    ``reference_outputs(outputs, case, cfg, tp)``: the reference's outputs as this class computes
    them by design (``note`` says how, in each result's description);
    ``module_cases``: the cases whose per-module outputs are compared (Megatron's packed paths call
    some modules once per image, where HF calls them once);
    ``default_config``: the config ``check`` uses when none is given, where the family's tiny one
    has no Megatron class; ``renamed``: ``(mcore key, this class's key)`` pairs where a class other
    than the family's default spells a tensor differently (the converter writes the default's);
    ``pipelined``: Megatron builds the class in pipeline stages (``LLaVAModel``'s language model),
    so a PP > 1 checkpoint loads into it stage by stage."""

    upstream: str
    cases: Callable
    run: Callable
    pairs: Callable
    reference_pairs: Callable = keep_reference_pairs
    reference_outputs: Callable = keep_reference_outputs
    note: str = ""
    module_cases: tuple = ("static",)
    default_config: Optional[Callable[[], object]] = None
    renamed: tuple = ()
    pipelined: bool = False

    def state(self, mcore_state: Mapping) -> dict:
        """The family's mcore state dict as this class names it."""
        names = dict(self.renamed)
        return {names.get(key, key): value for key, value in mcore_state.items()}


CLASSES: dict[str, dict[str, MegatronClass]] = {
    "clip": {
        "CLIPViTModel": MegatronClass("clip", _configured_size(lambda cfg: cfg), _run_clip, _clip_pairs),
        "ViTModel": MegatronClass("clip_vit", _configured_size(lambda cfg: cfg), _run_clip_as_vit,
                                  lambda model, cfg: _vit_pairs(model),
                                  reference_pairs=_patch_rows_of_reference_ln_pre,
                                  renamed=(("conv1.weight", "patch_embed.proj.weight"),)),
    },
    "siglip": {"CLIPViTModel": MegatronClass("siglip", _configured_size(lambda cfg: cfg), _run_clip,
                                             _clip_pairs)},
    "llava": {"LLaVAModel": MegatronClass("llava", _configured_size(lambda cfg: cfg.vision_config),
                                          _run_llava, _no_pairs, default_config=llava_clip_config,
                                          reference_outputs=_loss_over_padded_vocabulary,
                                          note="token_loss against HF's loss over Megatron-LM's "
                                               "padded vocabulary (pad logits 0)", pipelined=True)},
    "pixtral": {"ViTModel": MegatronClass("pixtral", _same_cases, _run_pixtral,
                                          lambda model, cfg: _vit_pairs(model))},
    "pixtral_large": {"ViTModel+MultimodalProjector": MegatronClass(
        "pixtral_large", _pixtral_large_cases, _run_pixtral_large, _pixtral_large_pairs)},
    "qwen3_5": {"QwenVLViTModel": MegatronClass("qwen3_5", _same_cases, _run_qwen, _qwen_pairs)},
    "kimi_k25": {"KimiViTModel+MultimodalProjector": MegatronClass(
        "kimi_k25", _kimi_cases, _run_kimi, _kimi_pairs)},
}


class NoMegatronClass(KeyError):
    """The family (or the class asked for) has no Megatron class here."""

    def __str__(self) -> str:
        return str(self.args[0])


def megatron_class(family: str, name: Optional[str] = None) -> tuple[str, MegatronClass]:
    """``(class name, record)``: ``name`` or the family's default class."""
    if family not in CLASSES:
        raise NoMegatronClass(f"family {family!r} has no Megatron class; families with one: "
                              f"{', '.join(CLASSES)}")
    options = CLASSES[family]
    if name is None:
        name = next(iter(options))
    if name not in options:
        raise NoMegatronClass(f"family {family!r}: no Megatron class {name!r}; choose one of "
                              f"{', '.join(options)}")
    return name, options[name]
