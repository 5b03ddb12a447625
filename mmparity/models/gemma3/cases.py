"""Gemma 3 whole parity: two rows of text, the first with two images and the second with one, each
image its run of ``mm_tokens_per_image`` image tokens between begin / end-of-image tokens (as
Gemma 3's processor writes them; every image at the tower's size, which the processor resizes to);
rows longer than the sliding window. Logits at every position and the per-token loss, both sides
run as in training (``token_type_ids`` given: the tokens of an image attend to each other both
ways). Paired modules, by Megatron's names: the tower's (``vision_model.…``), the projector
(``vision_projection``), then per decoder layer its input norm, its attention with the
post-attention norm, its pre-feedforward norm, its MLP with the post-feedforward norm, the layer,
and the final norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmparity.config import image_hw
from mmparity.models.clip import cases as tower_cases
from mmparity.models.core import inputs, sublayers
from mmparity.models.core.inputs import next_tokens, token_mask
from mmparity.models.core.layers import numbered_layers
from mmparity.models.gemma3 import mapping as converter
from mmparity.models.gemma3 import native, reference
from mmparity.models.gemma3.config import config_problems
from mmparity.models.gemma3.megatron import MEGATRON
from mmparity.models.qwen3_vl_whole import cases as whole
from mmparity.models.siglip import cases as siglip
from mmparity.models.spec import (
    Case, ConfigHooks, FamilyHooks, Pair, Parity, Side, sbh_tokens_2d, tokens_2d)

OUTPUTS = ("logits", "token_loss")
# HF's Gemma 3 layer, by the names of the tensors mcore's layer produces: its attention pair is
# the post-attention norm's output (the norm sits on linear_proj in mcore), its MLP pair the
# post-feedforward norm's.
HF_GEMMA = sublayers.LayerNames("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                "post_feedforward_layernorm")
IMAGES_PER_ROW = (2, 1)


def _text(cfg, count: int, gen) -> list[int]:
    special = {cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id}
    allowed = [t for t in range(cfg.text_config.vocab_size) if t not in special]
    return [allowed[p] for p in torch.randint(0, len(allowed), (count,), generator=gen).tolist()]


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    """``image_sizes`` may only repeat the tower's size: Gemma 3 takes no other."""
    side = image_hw(cfg.vision_config)
    count = len(image_sizes) if image_sizes else sum(IMAGES_PER_ROW)
    gen = inputs.generator(seed + 4099)
    split = [(count + 1) // 2, count // 2]
    rows = []
    for n in split:
        row = _text(cfg, 3, gen)
        for _ in range(n):
            row += [cfg.boi_token_id] + [cfg.image_token_id] * cfg.mm_tokens_per_image + [cfg.eoi_token_id]
            row += _text(cfg, 2, gen)
        rows.append(row)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + _text(cfg, width - len(r), gen) for r in rows])
    images = inputs.images([side] * count, cfg.vision_config.num_channels, seed)
    return [Case("sample", {"input_ids": ids, "images": images, "sizes": [side] * count}, OUTPUTS,
                 description=f"2 rows of {width} tokens with {split[0]} and {split[1]} images "
                             f"{side[0]}x{side[1]} between the text (window {cfg.text_config.sliding_window})")]


def image_size_problems(cfg, sizes) -> list[str]:
    side = image_hw(cfg.vision_config)
    bad = [tuple(s) for s in sizes if tuple(s) != side]
    return [f"image sizes {bad}: Gemma 3 takes {side[0]}x{side[1]} images only"] if bad else []


def image_size_multiple(cfg) -> int:
    return image_hw(cfg.vision_config)[0]


def _loss(logits, ids, cfg):
    vocab = logits.shape[-1]
    loss = F.cross_entropy(logits.reshape(-1, vocab), next_tokens(ids).to(logits.device).reshape(-1),
                           reduction="none")
    mask = token_mask(ids, cfg.image_token_id).to(logits.device)
    return (loss.view(ids.shape) * mask).reshape(-1)


def reference_run(model, case: Case) -> dict:
    cfg = model.config
    param = next(model.parameters())
    ids = case.data["input_ids"].to(param.device)
    pixels = torch.stack(case.data["images"]).to(param.device, param.dtype)
    types = (ids == cfg.image_token_id).long()  # what the processor returns as token_type_ids
    logits = model(input_ids=ids, pixel_values=pixels, token_type_ids=types).logits.float()
    return {"logits": logits.reshape(-1, logits.shape[-1]), "token_loss": _loss(logits, case.data["input_ids"], cfg)}


def native_run(model, case: Case) -> dict:
    param = next(model.parameters())
    ids = case.data["input_ids"].to(param.device)
    images = torch.stack(case.data["images"]).to(param.device, param.dtype) if model.pre_process else None
    logits = model(images, ids)
    loss = model(images, ids, labels=next_tokens(ids))
    if not model.post_process:
        return {}
    logits = logits[..., :model.vocab_size].float()
    mask = token_mask(case.data["input_ids"], model.image_token_id).to(param.device)
    return {"logits": logits.reshape(-1, model.vocab_size), "token_loss": (loss.float() * mask).reshape(-1)}


def reference_pairs(model, cfg) -> list[Pair]:
    out = [p.under("vision_model.") for p in siglip.reference_pairs(model.model.vision_tower, cfg.vision_config)]
    out.append(Pair("vision_projection", model.model.multi_modal_projector, tokens_2d))
    out += whole.language_pairs(enumerate(model.model.language_model.layers), hf=True, names=HF_GEMMA)
    out.append(Pair("language_model.decoder.final_layernorm", model.model.language_model.norm, tokens_2d))
    return out


def native_pairs(model, cfg) -> list[Pair]:
    out = []
    if model.vision_model is not None:
        out += [p.under("vision_model.") for p in tower_cases.native_pairs(model.vision_model, cfg.vision_config)]
        out.append(Pair("vision_projection", model.vision_projection, tokens_2d))
    out += whole.language_pairs(numbered_layers(model.language_model.decoder), hf=False)
    if model.post_process:
        out.append(Pair("language_model.decoder.final_layernorm", model.language_model.decoder.final_layernorm,
                        sbh_tokens_2d))
    return out


def random_config(pick):
    heads = pick([2, 4])
    groups = pick([g for g in (1, 2) if heads % g == 0])
    layers = pick([1, 2, 3])
    kinds = [pick(["sliding_attention", "full_attention"]) for _ in range(layers)]
    return reference.tiny_config(num_attention_heads=heads, num_key_value_heads=groups, head_dim=pick([8, 12]),
                                 hidden_size=pick([24, 40]), num_hidden_layers=layers, layer_types=kinds,
                                 sliding_window=pick([3, 5, 64]))


def hooks(towers) -> FamilyHooks:
    return FamilyHooks(
        config=ConfigHooks(tiny=reference.tiny_config, family_config=reference.vision_config, random=random_config,
                           problems=config_problems, image_size_multiple=image_size_multiple,
                           image_size_problems=image_size_problems),
        reference=Side(reference_run, reference_pairs, whole.no_component, reference.build),
        native=Side(native_run, native_pairs, whole.no_component, native.build_native), converter=converter.SPEC,
        parity=Parity(cases), megatron=MEGATRON)
