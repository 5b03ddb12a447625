"""Gemma 4 whole parity: two rows of text with three images of different sizes between the words
(each image its run of soft tokens between begin / end-of-image tokens, as Gemma 4's processor
writes them; the images padded to one ``max_patches`` as the processor pads them), rows longer
than the sliding window. Logits at every position and the per-token loss, both sides run as in
training (``mm_token_type_ids`` given: on sliding layers an image's tokens attend to each other
both ways). Paired modules, by Megatron's names: the tower's (``vision_model.…``), the embedder
(``vision_projection``), each decoder layer's norms, attention, MLP and the layer, the final norm.
Audio is out of scope: no case carries any."""

from __future__ import annotations

from functools import partial

import torch

from mmparity.config import first_int
from mmparity.models.core import inputs
from mmparity.models.core.inputs import next_tokens, token_mask
from mmparity.models.gemma3.cases import _loss
from mmparity.models.gemma4 import mapping as converter
from mmparity.models.gemma4 import native, per_layer_pairs, reference
from mmparity.models.gemma4.megatron import MEGATRON
from mmparity.models.gemma4_vision import cases as tower_cases
from mmparity.models.core.layers import numbered_layers
from mmparity.models.kimi_k25_vl import cases as whole
from mmparity.models.parts.gemma4_text import per_layer
from mmparity.models.parts.gemma4_text.moe import reference_moe_pairs, with_moe_pairs
from mmparity.models.parts.gemma4_text.moe_native import native_moe_pairs
from mmparity.models.parts.gemma4_text.reference import HF_LAYER
from mmparity.models.spec import Case, ConfigHooks, FamilyHooks, Pair, Parity, Side, tokens_2d

OUTPUTS = ("logits", "token_loss")
# Image sizes in pooling windows (patch · pooling pixels a side): three sizes and aspect ratios,
# padded to one max_patches, small (the tiny config's note says why the fp32 margin matters).
WINDOWS = ((1, 2), (2, 1), (1, 3))

def _text(cfg, count: int, gen) -> list[int]:
    # Below every special token (the tiny config puts them last), so text never reads as an image slot.
    special = min(cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id, cfg.audio_token_id, cfg.video_token_id)
    return torch.randint(0, special, (count,), generator=gen).tolist()


def soft_tokens(cfg, size) -> int:
    vc = cfg.vision_config
    step = first_int(vc.patch_size) * vc.pooling_kernel_size
    return (size[0] // step) * (size[1] // step)


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    step = tower_cases.window(cfg)
    sizes = [tuple(s) for s in (image_sizes or [(h * step, w * step) for h, w in WINDOWS])]
    gen = inputs.generator(seed + 4099)
    first = (len(sizes) + 1) // 2
    rows = []
    for chunk in (sizes[:first], sizes[first:]):
        row = _text(cfg, 3, gen)
        for size in chunk:
            row += [cfg.boi_token_id] + [cfg.image_token_id] * soft_tokens(cfg, size) + [cfg.eoi_token_id]
            row += _text(cfg, 2, gen)
        rows.append(row)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + _text(cfg, width - len(r), gen) for r in rows])
    data = {"input_ids": ids, **tower_cases.tower_inputs(cfg, sizes, seed)}
    return [Case("sample", data, OUTPUTS,
                 description=f"2 rows of {width} tokens with images {', '.join(f'{h}x{w}' for h, w in sizes)} "
                             f"between the text (window {cfg.text_config.sliding_window})")]


def image_size_problems(cfg, sizes) -> list:
    return tower_cases.image_size_problems(cfg, sizes)


def image_size_multiple(cfg) -> int:
    return tower_cases.window(cfg)


# --- the reference side ----------------------------------------------------------------------------

def reference_run(model, case: Case) -> dict:
    cfg = model.config
    param = next(model.parameters())
    ids = case.data["input_ids"].to(param.device)
    types = (ids == cfg.image_token_id).long()  # what the processor returns as mm_token_type_ids
    out = model(input_ids=ids, pixel_values=case.data["pixel_values"].to(param.device, param.dtype),
                image_position_ids=case.data["positions"].to(param.device), mm_token_type_ids=types)
    logits = out.logits.float()
    return {"logits": logits.reshape(-1, logits.shape[-1]), "token_loss": _loss(logits, case.data["input_ids"], cfg)}


def reference_pairs(model, cfg, languages) -> list[Pair]:
    out = [p.under("vision_model.") for p in tower_cases.reference_pairs(model.model.vision_tower, cfg.vision_config)]
    out.append(Pair("vision_projection", model.model.embed_vision, tokens_2d))
    out += whole.language_pairs(enumerate(model.model.language_model.layers), languages(cfg), hf=True,
                                names=HF_LAYER)
    out.append(Pair("language_model.decoder.final_layernorm", model.model.language_model.norm, tokens_2d))
    return with_moe_pairs(per_layer_pairs.reference_pairs(out, model.model.language_model, cfg.text_config),
                          reference_moe_pairs)


# --- the native side ---------------------------------------------------------------------------------

def native_run(model, case: Case) -> dict:
    param = next(model.parameters())
    ids = case.data["input_ids"].to(param.device)
    images = None
    if model.pre_process:
        images = (case.data["pixel_values"].to(param.device, param.dtype), case.data["positions"].to(param.device))
    logits = model(images, ids)
    loss = model(images, ids, labels=next_tokens(ids))
    if not model.post_process:
        return {}
    logits = logits[..., :model.vocab_size].float()
    mask = token_mask(case.data["input_ids"], model.image_token_id).to(param.device)
    return {"logits": logits.reshape(-1, model.vocab_size), "token_loss": (loss.float() * mask).reshape(-1)}


def native_pairs(model, cfg, languages) -> list[Pair]:
    out = whole.native_pairs(model, cfg, languages, tower_pairs=tower_cases.native_pairs)
    out = per_layer_pairs.native_pairs(out, model.language_model, cfg.text_config,
                                       numbered_layers(model.language_model.decoder))
    if not getattr(cfg.text_config, "enable_moe_block", False):
        return out
    return with_moe_pairs(out, native_moe_pairs)


def pipeline_problems(cfg, pp: int) -> list:
    return whole.pipeline_problems(cfg, pp) + per_layer.pipeline_problems(cfg.text_config, pp)


def random_config(pick):
    heads = pick([2, 4])
    layers = pick([1, 2, 3])
    kinds = [pick(["sliding_attention", "full_attention"]) for _ in range(layers - 1)] + ["full_attention"]
    moe = {}
    if pick([False, True]):  # the MoE block beside every layer's MLP
        moe = dict(enable_moe_block=True, num_experts=pick([2, 4, 6]), top_k_experts=pick([1, 2]),
                   moe_intermediate_size=pick([6, 10]))
    return reference.tiny_config(**moe,
                                 num_attention_heads=heads, num_key_value_heads=pick([g for g in (1, 2) if heads % g == 0]),
                                 head_dim=pick([8, 12]), global_head_dim=pick([8, 16]), hidden_size=pick([24, 40]),
                                 num_hidden_layers=layers, layer_types=kinds, sliding_window=pick([3, 5, 64]),
                                 use_bidirectional_attention=pick([None, "vision"]), **_e2b(pick, kinds, bool(moe)))


def _e2b(pick, kinds, moe: bool) -> dict:
    """E2B / E4B's additions, drawn: per-layer inputs or none, the last layer sharing the keys and
    values of an earlier full one where there is one (its MLP doubled or not, but never beside the
    MoE block: that is refused)."""
    out = {"hidden_size_per_layer_input": pick([0, 6]), "vocab_size_per_layer_input": 97}
    if "full_attention" in kinds[:-1] and pick([0, 1]):
        out |= {"num_kv_shared_layers": 1, "use_double_wide_mlp": not moe and pick([False, True])}
    return out


def hooks(towers, languages) -> FamilyHooks:
    def build_native(cfg, params_dtype=torch.float32):
        return native.build_native(cfg, params_dtype, language=languages(cfg).native)

    def config_problems(cfg):
        problems = [f"text_config: {p.removeprefix('text_config: ')}"
                    for p in languages(cfg).native.config_problems(cfg.text_config)]
        if getattr(cfg, "vision_config", None) is None:
            return problems + ["vision_config is missing: this family checks images with text (a Gemma 4 "
                               "without a tower is its gemma4_text language model)"]
        return problems + tower_cases.problems(cfg)

    return FamilyHooks(
        config=ConfigHooks(tiny=reference.tiny_config, family_config=reference.vision_config, random=random_config,
                           problems=config_problems, image_size_multiple=image_size_multiple,
                           image_size_problems=image_size_problems, pipeline_problems=pipeline_problems),
        reference=Side(reference_run, partial(reference_pairs, languages=languages), whole.no_component, reference.build),
        native=Side(native_run, partial(native_pairs, languages=languages), whole.no_component, build_native),
        converter=converter.SPEC, parity=Parity(cases), megatron=MEGATRON)
