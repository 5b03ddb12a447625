"""The Megatron side of ``check --impl megatron``: per family, how Megatron's own class
(:mod:`mmparity.upstream.models`) is fed and read.

Each family names one or more Megatron classes (:data:`CLASSES`; the first is the default). A
record says which builder the class uses (the converter's mcore state dict loads into it as is), which of the family's cases it accepts
(stock CLIP/SigLIP and ``ViTModel``'s learned positions take only their configured size,
``KimiViTModel`` has no temporal axis), how to run a case, and which of its submodules pair with
the HF reference's paired modules of the same name, so that a divergence is located exactly as in
the native check.

A record may hold a part of the family's mcore state dict only (``holds``, under ``root``): whole
VLMs whose ``vit_model`` tower Megatron-LM's ``LLaVAModel`` cannot be built with (mistral3,
pixtral_12b; docs/megatron.md, discrepancy 5) are checked and loaded part by part, the language
model in stock ``GPTModel`` on text-only ids, the projector in stock ``MultimodalProjector``, the
tower and projector in Megatron-LM main's ``ViTModel`` where that is importable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from transformers import LlavaConfig

from mmparity.cases import inputs
from mmparity.cases import qwen3_5 as qwen_cases
from mmparity.cases.clip import conv_tokens
from mmparity.cases.core import Case, FamilyHooks, Pair, sbh_tokens_2d, tokens_2d
from mmparity.cases.llava import FINAL_NORM, LANGUAGE_LAYER, MERGER, PROJECTOR, VISION, language_tokens
from mmparity.hfconfig import feature_layer_indices, first_int, padded_vocab_size
from mmparity.native.core.layers import numbered_layers
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


def _tower_and_projection(model, case: Case) -> tuple:
    tokens = models.run_vit(model.vision_model, case.data["images"]).tokens
    return tokens, model.vision_projection(tokens)


def _run_pixtral_large(model, case: Case, cfg) -> dict:
    merged, projected = _tower_and_projection(model, case)
    return {"merger": merged, "projector": projected}


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


# --- parts of a whole VLM ------------------------------------------------------------------------

TEXT_ROWS, TEXT_LENGTH = 2, 17


def _text_cases(hooks: FamilyHooks, cfg, seed: int, image_sizes) -> list[Case]:
    """Text-only ids over the whole vocabulary (what a whole VLM runs on a prompt without images):
    the decoder from its embedding to its output layer. ``labels`` are Megatron's pre-shifted
    ones; the last position, whose next token is not in the row, is masked."""
    if image_sizes:
        raise UnsupportedInput("Megatron's GPTModel is the language model part alone: it runs on "
                               "text-only ids, so --image-size does not apply")
    drawn = torch.randint(0, cfg.text_config.vocab_size, (TEXT_ROWS, TEXT_LENGTH + 1),
                          generator=inputs.generator(seed + 7919))
    ids = drawn[:, :-1]
    loss_mask = torch.ones(ids.shape)
    loss_mask[:, -1] = 0
    data = {"input_ids": ids, "labels": drawn[:, 1:], "loss_mask": loss_mask, "hf_labels": ids,
            "length": TEXT_LENGTH}
    return [Case("text", data, ("logits", "token_loss"),
                 description=f"{TEXT_ROWS} rows of {TEXT_LENGTH} text-only token ids")]


def _reference_language_model(model, case: Case, cfg) -> dict:
    """HF's text model and head (``model.model.language_model``, ``lm_head``) on the ids: the
    decoder a whole VLM runs, without its vision path."""
    device = next(model.parameters()).device
    hidden = model.model.language_model(input_ids=case.data["input_ids"].to(device)).last_hidden_state
    logits = model.lm_head(hidden).float()
    return {"logits": logits.reshape(-1, logits.shape[-1]), "loss_mask": case.data["loss_mask"].reshape(-1)}


def _run_language_model(model, case: Case, cfg) -> dict:
    """Stock ``GPTModel`` (this pipeline stage of it) on the ids: logits over the real vocabulary
    and Megatron's per-token loss (over its padded vocabulary)."""
    device = next(model.parameters()).device
    ids = case.data["input_ids"].to(device)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
    with cuda_calls_on_host():
        logits = model(ids, positions, None, runtime_gather_output=True)
        loss = model(ids, positions, None, labels=case.data["labels"].to(device))
    if not model.post_process:
        return {}  # an earlier pipeline stage: the last one holds the outputs
    vocab = cfg.text_config.vocab_size
    return {"logits": logits[..., :vocab].reshape(-1, vocab),
            "token_loss": (loss * case.data["loss_mask"].to(device)).reshape(-1)}


def _language_pairs(model, cfg) -> list[Pair]:
    """``GPTModel``'s layers by their place in the whole model, and its final norm (last stage)."""
    out = [Pair(LANGUAGE_LAYER.format(i), layer, language_tokens) for i, layer in numbered_layers(model.decoder)]
    if model.post_process:
        out.append(Pair(FINAL_NORM, model.decoder.final_layernorm, language_tokens))
    return out


def _feature_width(cfg) -> int:
    return cfg.vision_config.hidden_size * len(feature_layer_indices(cfg))


def _feature_cases(hooks: FamilyHooks, cfg, seed: int, image_sizes) -> list[Case]:
    if image_sizes:
        raise UnsupportedInput("Megatron's MultimodalProjector is the projector part alone: it runs on "
                               "seeded tower features, so --image-size does not apply")
    features = inputs.token_probe(29, _feature_width(cfg), seed)
    return [Case("features", {"features": features}, ("vision_projection",),
                 description=f"29 seeded tower features of width {features.shape[1]}")]


def _reference_projector(model, case: Case, cfg) -> dict:
    """HF's projector linears (``linear_1``, ``act``, ``linear_2``): all of LLaVA's projector, and
    Mistral3's after the norm and patch merger that Megatron holds in the tower."""
    proj = model.model.multi_modal_projector
    return {"vision_projection": proj.linear_2(proj.act(proj.linear_1(inputs.like_model(case.data["features"], model))))}


def _run_projector(model, case: Case, cfg) -> dict:
    return {"vision_projection": model(inputs.like_model(case.data["features"], model))}


def _vision_cases(hooks: FamilyHooks, cfg, seed: int, image_sizes) -> list[Case]:
    """Images through the tower (and merger) and the projector: mixed sizes in one packed pass and
    a static batch of two; even patch grids by default (Megatron's merger raises on odd ones,
    discrepancy 4)."""
    if len(feature_layer_indices(cfg)) > 1:
        raise UnsupportedInput("Megatron's ViTModel gives one layer's features; the config "
                               f"concatenates several (vision_feature_layer {cfg.vision_feature_layer})")
    p = first_int(cfg.vision_config.patch_size)
    sizes = [tuple(s) for s in image_sizes or [(4 * p, 6 * p), (6 * p, 2 * p)]]
    channels = cfg.vision_config.num_channels
    outputs = ("vision_model", "vision_projection")
    static = [sizes[0]] * 2
    return [Case("packed", {"images": inputs.images(sizes, channels, seed), "sizes": sizes}, outputs,
                 description=f"images {', '.join(f'{h}x{w}' for h, w in sizes)} in one packed pass"),
            Case("static", {"images": inputs.images(static, channels, seed + 1), "sizes": static},
                 outputs, description=f"static batch of 2 images {static[0][0]}x{static[0][1]}")]


def _reference_vision_part(model, case: Case, cfg) -> dict:
    """HF's vision path of the whole model as ``get_image_features`` runs it: the tower's hidden
    state at ``vision_feature_layer``, then the projector (Mistral3's with its norm and patch
    merger, whose output is the tower part's)."""
    vlm = model.model
    param = next(model.parameters())
    batch, sizes = inputs.pad_batch(case.data["images"])
    image_sizes = torch.tensor(sizes)
    hidden = vlm.vision_tower(batch.to(param.device, param.dtype), image_sizes=image_sizes,
                              output_hidden_states=True).hidden_states[cfg.vision_feature_layer]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    proj = vlm.multi_modal_projector
    merger = getattr(proj, "patch_merger", None)
    if merger is None:
        return {"vision_model": hidden, "vision_projection": proj(hidden)}
    seen = {}
    handle = merger.register_forward_hook(lambda module, args, out: seen.setdefault("merged", out))
    try:
        projected = proj(hidden, image_sizes)
    finally:
        handle.remove()
    return {"vision_model": seen["merged"], "vision_projection": projected}


def _run_vision_part(model, case: Case, cfg) -> dict:
    tokens, projected = _tower_and_projection(model, case)
    return {"vision_model": tokens, "vision_projection": projected}


def _vision_part_pairs(model, cfg) -> list[Pair]:
    """The tower's pairs under ``vision_model.``, its merger and the projector, as the whole
    model's reference names them."""
    tower = model.vision_model
    out = [Pair(VISION + p.name, p.module, p.extract) for p in _vit_pairs(tower)]
    if tower.merger is not None:
        out.append(Pair(MERGER, tower.merger, tokens_2d))
    return out + [Pair(PROJECTOR, model.vision_projection, tokens_2d)]


def _whole_model(model):
    return model


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


PADDED_LOSS_NOTE = "token_loss against HF's loss over Megatron-LM's padded vocabulary (pad logits 0)"


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
    so a PP > 1 checkpoint loads into it stage by stage; a class that is not is built whole on the
    first stage; ``stage_module(model)``: where ``check --pp`` runs the class in stages, the
    module whose input comes from the previous stage (None: not run in stages);
    ``holds``: the prefixes of the family's mcore keys the class holds (empty: all of them), and
    ``root`` the prefix its own keys sit under there (``language_model.`` for ``GPTModel``);
    ``reference_run(model, case, cfg)``: the HF model's run for a class that holds a part, in place
    of the family's whole run; ``why_part``: why the family's whole model has no Megatron class
    here (shown wherever the part is checked or loaded); ``unwritten_extra_state``: modules (by the
    last parts of their names) of the class whose TE ``_extra_state`` slot mmparity's converter
    does not write yet: ``verify --load`` fills exactly those with the empty slot the writer writes
    for every other TE module (``None``) and says how many it filled."""

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
    stage_module: Optional[Callable] = None
    holds: tuple = ()
    root: str = ""
    reference_run: Optional[Callable] = None
    why_part: str = ""
    unwritten_extra_state: tuple = ()

    def holds_key(self, key: str) -> bool:
        return not self.holds or key.startswith(self.holds)

    def overlaps(self, prefixes: tuple) -> bool:
        """Whether this class holds any key under ``prefixes`` (empty: everything)."""
        if not self.holds or not prefixes:
            return True
        return any(a.startswith(b) or b.startswith(a) for a in self.holds for b in prefixes)

    def state(self, mcore_state: Mapping) -> dict:
        """The keys of the family's mcore state dict this class holds, as it names them."""
        names = dict(self.renamed)
        return {names.get(key[len(self.root):], key[len(self.root):]): value
                for key, value in mcore_state.items() if self.holds_key(key)}

    @property
    def notes(self) -> str:
        return "; ".join(n for n in (self.note, self.why_part) if n)


# Where ``LLaVAModel`` cannot hold a whole VLM, one record per part; each holds its prefix of the
# whole model's keys (LLaVAModel's attribute names).
LANGUAGE_MODEL = MegatronClass(
    "language_model", _text_cases, _run_language_model, _language_pairs,
    reference_run=_reference_language_model, reference_outputs=_loss_over_padded_vocabulary,
    note=f"the language model part (language_model.*) on text-only ids; {PADDED_LOSS_NOTE}",
    module_cases=("text",), pipelined=True, stage_module=_whole_model,
    holds=("language_model.",), root="language_model.")
PROJECTION = MegatronClass(
    "projector", _feature_cases, _run_projector, _no_pairs, reference_run=_reference_projector,
    note="the projector part (vision_projection.*) alone, on seeded tower features", module_cases=(),
    holds=("vision_projection.",), root="vision_projection.")
VISION_PART = MegatronClass(
    "vlm_vision", _vision_cases, _run_vision_part, _vision_part_pairs,
    reference_run=_reference_vision_part,
    note="the vision part (vision_model.*, vision_projection.*) on images",
    holds=("vision_model.", "vision_projection."))
WHY_PARTS = ("Megatron-LM's LLaVAModel cannot be built with a vit_model tower (docs/megatron.md, "
             "discrepancy 5), so the whole model is checked and loaded part by part")


def _whole_vlm_parts(vision_note: str = "") -> dict[str, MegatronClass]:
    """A whole VLM's Megatron classes, the language model first (stock megatron-core: it always
    runs); ``vision_note``: what the vision part computes otherwise than HF, by design."""
    vision = dataclasses.replace(VISION_PART, note="; ".join(n for n in (VISION_PART.note, vision_note) if n))
    return {name: dataclasses.replace(record, why_part=WHY_PARTS)
            for name, record in (("GPTModel", LANGUAGE_MODEL), ("ViTModel+MultimodalProjector", vision),
                                 ("MultimodalProjector", PROJECTION))}


MOE_LANGUAGE_MODEL = dataclasses.replace(
    LANGUAGE_MODEL, upstream="moe_language_model", why_part=WHY_PARTS,
    note=f"the DeepSeek-V3 language model part (language_model.*) on text-only ids, stock GPTModel on "
         f"mcore's TE block spec for MLA + MoE (grouped-GEMM experts); {PADDED_LOSS_NOTE}",
    unwritten_extra_state=())


def _kimi_vl_vision_cases(hooks: FamilyHooks, cfg, seed: int, image_sizes) -> list[Case]:
    """The kimi_k25 family's tower-and-projector cases on the whole model's config (its tower and
    projector are that family's), clips aside as for that family's class."""
    from mmparity.cases import kimi_k25

    return [c for c in kimi_k25.cases(cfg, seed, image_sizes) if c.name != "video"]


def _reference_kimi_vl_vision(model, case: Case, cfg) -> dict:
    """HF's whole model's ``vision_tower`` and ``mm_projector``, run as the kimi_k25 family runs
    its reference (the same modules, seen through that family's reference wrapper)."""
    from mmparity.cases import kimi_k25
    from mmparity.reference.kimi_k25 import KimiK25VisionReference

    view = KimiK25VisionReference(cfg)
    view.vision_tower, view.mm_projector = model.model.vision_tower, model.model.mm_projector
    return kimi_k25.REFERENCE.run(view, case)


KIMI_VL_VISION = MegatronClass(
    "kimi_k25", _kimi_vl_vision_cases, _run_kimi, _kimi_pairs, module_cases=(),
    reference_run=_reference_kimi_vl_vision,
    note="the vision part (vision_model.*, vision_projection.*): the kimi_k25 family's class, on "
         "that family's cases",
    holds=("vision_model.", "vision_projection."), why_part=WHY_PARTS)


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
                                          note=PADDED_LOSS_NOTE, pipelined=True),
              "GPTModel": LANGUAGE_MODEL, "MultimodalProjector": PROJECTION},
    "pixtral": {"ViTModel": MegatronClass("pixtral", _same_cases, _run_pixtral,
                                          lambda model, cfg: _vit_pairs(model))},
    "pixtral_large": {"ViTModel+MultimodalProjector": MegatronClass(
        "pixtral_large", _pixtral_large_cases, _run_pixtral_large, _pixtral_large_pairs)},
    "qwen3_5": {"QwenVLViTModel": MegatronClass("qwen3_5", _same_cases, _run_qwen, _qwen_pairs)},
    "kimi_k25": {"KimiViTModel+MultimodalProjector": MegatronClass(
        "kimi_k25", _kimi_cases, _run_kimi, _kimi_pairs)},
    "mistral3": _whole_vlm_parts("Megatron's merger norm takes the vision epsilon, HF the text "
                                 "rms_norm_eps (discrepancy 2)"),
    "pixtral_12b": _whole_vlm_parts(),
    "kimi_k25_vl": {"GPTModel": MOE_LANGUAGE_MODEL, "KimiViTModel+MultimodalProjector": KIMI_VL_VISION},
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


def class_notes(family: str, name: str) -> str:
    """What a check with Megatron's ``name`` says beside its numbers: the record's notes and, for a
    class holding a part, the family's other classes (and whether they can be imported here)."""
    record = CLASSES[family][name]
    notes = [record.notes] if record.notes else []
    if record.holds:
        others = [f"--megatron-class {other}" + ("" if models.available(rec.upstream) else
                                                 " (needs Megatron-LM main's vit_model, not importable here)")
                  for other, rec in CLASSES[family].items() if other != name]
        notes.append(f"{name} holds {', '.join(p + '*' for p in record.holds)}; the family's other "
                     f"Megatron classes: {', '.join(others)}")
    return "; ".join(notes)
