"""Llama 4 whole parity: two rows of text with three images of 2, 3 and 1 tiles between the words
(every pixel-shuffled token of a tile one image token in the ids, each image between its start and
end tokens, a separator token between tiles, as transformers' processor lays them out), logits at
every position and the per-token loss, and the paired modules of every part named by Megatron's
tree: ``vision_model.layer.N`` …, ``vision_model.adapter``, ``vision_projection``, and for each
decoder layer its norms, its attention, its MoE router, the shared expert, the routed experts'
summed output, the whole MLP and the layer itself. The router also gets its own verdict (router
agreement per MoE layer).

transformers' whole ``forward`` raises in 5.24 (docs/megatron.md), so the reference runs its parts
as that forward would: the tower, the projector, the image tokens' embeddings replaced in order,
the language model.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from mmparity.config import first_int
from mmparity.models.core import inputs
from mmparity.models.core.inputs import next_tokens, token_mask
from mmparity.models.kimi_k25_vl import cases as whole
from mmparity.models.llama4 import mapping as converter
from mmparity.models.llama4 import native, reference
from mmparity.models.llama4.megatron import MEGATRON
from mmparity.models.llama4_vision import cases as tower_cases
from mmparity.models.llama4_vision.native import merge_size
from mmparity.models.parts.llama4_text.reference import HF_LAYER
from mmparity.models.spec import (
    Case, ConfigHooks, FamilyHooks, Pair, Parity, Side, recording_patch, tokens_2d)

OUTPUTS = ("logits", "token_loss")
CHANNELS = 3
# Tiles per image: different counts, as transformers' processor cuts images of different sizes.
TILES = (2, 3, 1)


def tokens_per_tile(cfg) -> int:
    vc = cfg.vision_config
    side = first_int(vc.image_size) // first_int(vc.patch_size) // merge_size(vc)
    return side * side


def _text(cfg, count: int, gen) -> list[int]:
    # Below the image, start and end tokens (the tiny config puts them last), so that text never
    # reads as an image slot.
    special = min(cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id)
    return torch.randint(0, special, (count,), generator=gen).tolist()


def _image(cfg, tiles: int, gen) -> list[int]:
    """One image's run: its start token, each tile's image tokens with a separator between tiles
    (text to the model), its end token."""
    run = [cfg.boi_token_id]
    for t in range(tiles):
        run += [cfg.image_token_id] * tokens_per_tile(cfg) + (_text(cfg, 1, gen) if t < tiles - 1 else [])
    return run + [cfg.eoi_token_id]


def cases(cfg, seed: int, image_sizes=None, tiles=TILES) -> list[Case]:
    gen = inputs.generator(seed + 4099)
    first = (len(tiles) + 1) // 2
    rows = []
    for chunk in (tiles[:first], tiles[first:]):
        row = _text(cfg, 3, gen)
        for count in chunk:
            row += _image(cfg, count, gen) + _text(cfg, 2, gen)
        rows.append(row)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + _text(cfg, width - len(r), gen) for r in rows])
    size = tower_cases.tile_size(cfg)
    data = {"images": inputs.images([size] * sum(tiles), CHANNELS, seed), "sizes": [size] * sum(tiles),
            "input_ids": ids}
    return [Case("sample", data, OUTPUTS,
                 description=f"2 rows of {width} tokens, images of {', '.join(map(str, tiles))} tiles "
                             f"of {size[0]}x{size[1]} between the text")]


prepare_case = recording_patch(lambda cfg: first_int(cfg.vision_config.patch_size))


def image_size_problems(cfg, sizes) -> list:
    return tower_cases.image_size_problems(cfg.vision_config, sizes)


# --- the reference side ----------------------------------------------------------------------------

def reference_run(model, case: Case) -> dict:
    param = next(model.parameters())
    ids = case.data["input_ids"].to(param.device)
    tiles = torch.stack(case.data["images"]).to(param.device, param.dtype)
    embeds = model.get_input_embeddings()(ids)
    features = model.vision_model(tiles).last_hidden_state
    projected = model.multi_modal_projector(features.reshape(-1, features.shape[-1])).to(embeds.dtype)
    image = (ids == model.config.image_token_id).unsqueeze(-1)
    embeds = embeds.masked_scatter(image, projected)
    logits = model.language_model(inputs_embeds=embeds).logits.float()
    vocab = logits.shape[-1]
    mask = token_mask(case.data["input_ids"], model.config.image_token_id).to(param.device)
    loss = F.cross_entropy(logits.reshape(-1, vocab), next_tokens(ids).reshape(-1), reduction="none")
    return {"logits": logits.reshape(-1, vocab), "token_loss": (loss.view(ids.shape) * mask).reshape(-1)}


def reference_pairs(model, cfg, languages) -> list[Pair]:
    out = [p.under("vision_model.") for p in tower_cases.reference_pairs(model.vision_model, cfg.vision_config)]
    out.append(Pair("vision_projection", model.multi_modal_projector, tokens_2d))
    out += whole.language_pairs(enumerate(model.language_model.model.layers), languages(cfg), hf=True,
                                names=HF_LAYER)
    out.append(Pair("language_model.decoder.final_layernorm", model.language_model.model.norm, tokens_2d))
    return out


# --- the native side ---------------------------------------------------------------------------------

def native_run(model, case) -> dict:
    param = next(model.parameters())
    tiles = torch.stack(case.data["images"]).to(param.device, param.dtype) if model.pre_process else None
    ids = case.data["input_ids"].to(param.device)
    logits = model(tiles, ids)
    loss = model(tiles, ids, labels=next_tokens(ids))
    if not model.post_process:
        return {}  # an earlier pipeline stage: the last one holds the outputs
    logits = logits[..., :model.vocab_size].float()
    mask = token_mask(case.data["input_ids"], model.image_token_id).to(param.device)
    return {"logits": logits.reshape(-1, model.vocab_size), "token_loss": (loss.float() * mask).reshape(-1)}


def native_pairs(model, cfg, languages) -> list[Pair]:
    return whole.native_pairs(model, cfg, languages, tower_pairs=tower_cases.native_pairs)


def random_config(pick):
    layers = pick([2, 3, 4])
    return reference.tiny_config(
        num_hidden_layers=layers, num_key_value_heads=pick([1, 2, 4]), interleave_moe_layer_step=pick([1, 2]),
        no_rope_layers=[pick([0, 1]) for _ in range(layers)], attention_chunk_size=pick([None, 5, 8]),
        num_local_experts=pick([2, 4]), use_qk_norm=pick([False, True]))


def hooks(towers, languages) -> FamilyHooks:
    def build_native(cfg, params_dtype=torch.float32):
        return native.build_native(cfg, params_dtype, language=languages(cfg).native)

    def config_problems(cfg):
        return [f"text_config: {p}" for p in languages(cfg).native.config_problems(cfg.text_config)]

    return FamilyHooks(
        config=ConfigHooks(tiny=reference.tiny_config, family_config=reference.vision_config, random=random_config,
                           problems=config_problems, image_size_problems=image_size_problems,
                           pipeline_problems=whole.pipeline_problems),
        reference=Side(reference_run, partial(reference_pairs, languages=languages), whole.no_component, reference.build),
        native=Side(native_run, partial(native_pairs, languages=languages), whole.no_component, build_native),
        converter=converter.SPEC, parity=Parity(cases, prepare_case), megatron=MEGATRON)
