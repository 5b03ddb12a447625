"""Kimi-K2.5 whole parity: two rows of text with three images of different sizes between the words
(one image token per merged patch, as Kimi's processor lays them out), logits at every position
and the per-token loss, and the paired modules of every part named by Megatron's tree:
``vision_model.layer.N`` …, ``vision_projection``, and for each decoder layer its norms, its
attention, its MoE router (the dense routing weights), the shared expert, the routed experts'
combined output, the whole MLP and the layer itself.

The router also gets its own verdict (:func:`mmparity.parity.router.agreement`): per MoE layer, the
fraction of tokens whose top-k expert set is HF's, and whether a different set is a tie.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F

from mmparity.models.core import inputs
from mmparity.models.core.inputs import next_tokens, token_mask
from mmparity.models.llava import megatron as llava
from mmparity.models.core import megatron_side
from mmparity.models.kimi_k25 import cases as tower_cases
from mmparity.models.kimi_k25.megatron import build_kimi_k25
from mmparity.models.spec import (
    Case, ConfigHooks, FamilyHooks, Pair, Parity, Side, no_problems, sbh_tokens_2d, tokens_2d)
from mmparity.models.kimi_k25_vl import mapping as converter
from mmparity.models.kimi_k25_vl import native
from mmparity.models.core.layers import numbered_layers
from mmparity.models.core import sublayers
from mmparity.models.kimi_k25_vl import reference

OUTPUTS = ("logits", "token_loss")
CHANNELS = 3


def _merged_tokens(cfg, size) -> int:
    p, (kh, kw) = tower_cases.patch_size(cfg), tuple(cfg.vision_config.merge_kernel_size)
    return (size[0] // p) * (size[1] // p) // (kh * kw)


def default_image_sizes(cfg) -> list[tuple[int, int]]:
    step = tower_cases.image_size_multiple(cfg)
    return [(2 * step, 3 * step), (3 * step, step), (step, 2 * step)]


def _text(cfg, count: int, gen) -> list[int]:
    vocab = cfg.text_config.vocab_size
    picks = torch.randint(0, vocab - 1, (count,), generator=gen).tolist()
    # Skip the image token so that text never reads as an image slot.
    return [t + (t >= cfg.image_token_id) for t in picks]


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    sizes = [tuple(s) for s in (image_sizes or default_image_sizes(cfg))]
    gen = inputs.generator(seed + 4099)
    first = (len(sizes) + 1) // 2
    rows = []
    for chunk in (sizes[:first], sizes[first:]):
        row = _text(cfg, 3, gen)
        for size in chunk:
            row += [cfg.image_token_id] * _merged_tokens(cfg, size) + _text(cfg, 2, gen)
        rows.append(row)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + _text(cfg, width - len(r), gen) for r in rows])
    data = {"images": inputs.images(sizes, CHANNELS, seed), "sizes": sizes, "frames": [1] * len(sizes),
            "input_ids": ids}
    described = ", ".join(f"{h}x{w}" for h, w in sizes)
    return [Case("sample", data, OUTPUTS,
                 description=f"2 rows of {width} tokens, images {described} between the text")]


# --- the reference side ----------------------------------------------------------------------------

def reference_run(model, case: Case) -> dict:
    param = next(model.parameters())
    pixels, grid_thw = tower_cases._pixel_values(case, case.data["patch"])
    ids = case.data["input_ids"].to(param.device)
    logits = model(input_ids=ids, pixel_values=pixels.to(param.device, param.dtype),
                   image_grid_thw=grid_thw.to(param.device)).logits.float()
    vocab = logits.shape[-1]
    mask = token_mask(case.data["input_ids"], model.config.image_token_id).to(param.device)
    loss = F.cross_entropy(logits.reshape(-1, vocab), next_tokens(ids).reshape(-1), reduction="none")
    return {"logits": logits.reshape(-1, vocab), "token_loss": (loss.view(ids.shape) * mask).reshape(-1)}


LANGUAGE_LAYER = "language_model.decoder.layers.{}"


def language_pairs(layers, part, *, hf: bool, names: sublayers.LayerNames = sublayers.HF_DECODER) -> list[Pair]:
    """The decoder's paired modules, by Megatron's names, on one side: each layer's norms,
    attention and MLP (:func:`~mmparity.models.core.sublayers.layer_pairs`; ``names``: where the
    HF layer class keeps them), and inside an MoE layer's MLP what the language ``part`` pairs
    there (router, shared and routed experts)."""
    extract = tokens_2d if hf else sbh_tokens_2d
    out = []
    for i, layer in layers:
        out += sublayers.layer_pairs(LANGUAGE_LAYER.format(i), layer, extract, names if hf else None,
                                     inner=partial(part.mlp_pairs(hf=hf), extract=extract))
    return out


def reference_pairs(model, cfg, languages) -> list[Pair]:
    out = [p.under("vision_model.")
           for p in tower_cases.reference_pairs(model.model.vision_tower, cfg.vision_config)]
    out.append(Pair("vision_projection", model.model.mm_projector, tokens_2d))
    out += language_pairs(enumerate(model.model.language_model.layers), languages(cfg), hf=True)
    out.append(Pair("language_model.decoder.final_layernorm", model.model.language_model.norm, tokens_2d))
    return out


# --- the native side ---------------------------------------------------------------------------------

def native_run(model, case) -> dict:
    param = next(model.parameters())
    rows = (tower_cases._rows(case.data["images"], model.patch_dim).to(param.device, param.dtype)
            if model.pre_process else None)
    ids = case.data["input_ids"].to(param.device)
    common = dict(imgs_sizes=case.data["sizes"], num_frames=case.data["frames"])
    logits = model(rows, ids, **common)
    loss = model(rows, ids, labels=next_tokens(ids), **common)
    if not model.post_process:
        return {}  # an earlier pipeline stage: the last one holds the outputs
    logits = logits[..., :model.vocab_size].float()
    mask = token_mask(case.data["input_ids"], model.image_token_id).to(param.device)
    return {"logits": logits.reshape(-1, model.vocab_size), "token_loss": (loss.float() * mask).reshape(-1)}


def native_pairs(model, cfg, languages, tower_pairs=tower_cases.native_pairs) -> list[Pair]:
    """The native whole model's pairs: on the first stage the tower's (``tower_pairs``, the tower
    family's) and the projector, then the decoder's and its final norm."""
    out = []
    if model.vision_model is not None:  # the first pipeline stage
        out += [p.under("vision_model.") for p in tower_pairs(model.vision_model, cfg.vision_config)]
        out.append(Pair("vision_projection", model.vision_projection, tokens_2d))
    out += language_pairs(numbered_layers(model.language_model.decoder), languages(cfg), hf=False)
    if model.post_process:
        out.append(Pair("language_model.decoder.final_layernorm", model.language_model.decoder.final_layernorm,
                        sbh_tokens_2d))
    return out


def no_component(name, model, cfg, seed):
    raise KeyError(name)


def random_config(pick):
    heads = pick([2, 4])
    experts = pick([4, 6, 8])
    groups = pick([g for g in (1, 2) if experts % g == 0])
    top_k = 2 * pick([1, 2]) if groups > 1 else pick([2, 3])
    text = dict(num_attention_heads=heads, num_key_value_heads=heads, hidden_size=heads * pick([6, 10]),
                num_hidden_layers=pick([2, 3]), first_k_dense_replace=pick([0, 1]),
                n_routed_experts=experts, num_experts_per_tok=top_k, n_group=groups,
                topk_group=top_k // 2 if groups > 1 else 1, q_lora_rank=pick([None, 8]),
                n_shared_experts=pick([1, 2]), moe_intermediate_size=pick([6, 10]))
    return reference.tiny_config(**text)


# Nothing keeps these whole models off pipeline stages, a tied head included (the last stage
# holds its own copy of the table, as Megatron's does); the families on this composition name it.
pipeline_problems = no_problems


def image_size_problems(cfg, sizes) -> list[str]:
    return []


# --- Megatron's own classes: its DeepSeek-V3 language model in stock GPTModel, its vision part in
# the kimi_k25 family's class -----------------------------------------------------------------------

MOE_LANGUAGE_MODEL = replace(
    llava.LANGUAGE_MODEL, why_part=llava.WHY_PARTS,
    note=f"the DeepSeek-V3 language model part (language_model.*) on text-only ids, stock GPTModel on "
         f"mcore's TE block spec for MLA + MoE (grouped-GEMM experts); {llava.PADDED_LOSS_NOTE}",
    unwritten_extra_state=())


def megatron_vision_cases(hooks: FamilyHooks, cfg, seed: int, image_sizes) -> list[Case]:
    """The kimi_k25 family's tower-and-projector cases on the whole model's config (its tower and
    projector are that family's), clips aside as for that family's class."""
    return [c for c in tower_cases.cases(cfg, seed, image_sizes) if c.name != "video"]


def megatron_reference_vision(model, case: Case, cfg) -> dict:
    """HF's whole model's ``vision_tower`` and ``mm_projector``, run as the kimi_k25 family runs
    its reference (the same modules, seen through that family's reference wrapper)."""
    from mmparity.models.kimi_k25.reference import KimiK25VisionReference

    view = KimiK25VisionReference(cfg)
    view.vision_tower, view.mm_projector = model.model.vision_tower, model.model.mm_projector
    return tower_cases.REFERENCE.run(view, case)


KIMI_VISION = megatron_side.MegatronClass(
    build_kimi_k25, megatron_vision_cases, tower_cases.megatron_run, tower_cases.megatron_pairs,
    module_cases=(), reference_run=megatron_reference_vision,
    note="the vision part (vision_model.*, vision_projection.*): the kimi_k25 family's class, on "
         "that family's cases",
    holds=("vision_model.", "vision_projection."), why_part=llava.WHY_PARTS)
MEGATRON = {"GPTModel": MOE_LANGUAGE_MODEL, "KimiViTModel+MultimodalProjector": KIMI_VISION}


def hooks(towers, languages) -> FamilyHooks:
    def build_native(cfg, params_dtype=torch.float32):
        return native.build_native(cfg, params_dtype, language=languages(cfg).native)

    def config_problems(cfg):
        # What Megatron's MLA + MoE layers cannot compute as HF does (its group-limited routing,
        # say): the language model part's own list, on the text config.
        problems = languages(cfg).native.config_problems(cfg.text_config)
        return [f"text_config: {p}" for p in problems]

    return FamilyHooks(
        config=ConfigHooks(tiny=reference.tiny_config, family_config=reference.vision_config, random=random_config,
                           problems=config_problems, image_size_multiple=tower_cases.image_size_multiple,
                           image_size_problems=image_size_problems, pipeline_problems=pipeline_problems),
        reference=Side(reference_run, partial(reference_pairs, languages=languages), no_component, reference.build),
        native=Side(native_run, partial(native_pairs, languages=languages), no_component, build_native), converter=converter.SPEC,
        parity=Parity(cases, tower_cases.prepare_case), megatron=llava.bind_language(MEGATRON, languages))

