"""Megatron's own classes a LLaVA-composed whole VLM's converted weights load into: stock
``LLaVAModel`` whole where it can hold the tower, else the parts (the language model's own class,
Megatron-LM main's ``ViTModel`` with the projector, the projector alone), and the records that bind
them to the tower and language model a config names."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from megatron.core.models.multimodal import llava_model
from megatron.core.models.vision import clip_vit_model
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers import LlavaConfig

from mmparity.config import (
    feature_layer_indices, first_int, has_patch_merger, image_hw, padded_vocab_size, pixel_shuffle_reduction, select_strategy, spatial_merge,
    tower_depth, vision_of)
from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.models.clip import reference as clip_reference
from mmparity.models.core import inputs, megatron_side, sublayers, te_stand_ins
from mmparity.models.core import megatron_classes as upstream
from mmparity.models.core.layers import numbered_layers
from mmparity.models.core.te_stand_ins import buildable_without_te, cuda_calls_on_host
from mmparity.models.llava import reference
from mmparity.models.llava.config import projection_fields
from mmparity.models.llava.reference import IGNORE_INDEX
from mmparity.models.parts.dense_decoder import megatron as dense_decoder
from mmparity.models.pixtral import cases as pixtral_cases
from mmparity.models.pixtral import megatron as pixtral_megatron
from mmparity.models.spec import (
    Case, FamilyHooks, MegatronClass, MegatronClasses, Pair, TowerLookup, first_tensor, tokens_2d)
from mmparity.parallel import runtime

# Paired modules are named by the part they belong to, in Megatron's ``LLaVAModel`` names.
VISION = "vision_model."
MERGER = "vision_model.merger"
PROJECTOR = "vision_projection"
LANGUAGE_LAYER = "language_model.decoder.layers.{}"
FINAL_NORM = "language_model.decoder.final_layernorm"


def language_tokens(output, case):
    """[s, b, h] language activations -> batch-major tokens of the first ``length`` positions."""
    t = first_tensor(output)[: case.data["length"]]
    return t.transpose(0, 1).reshape(-1, t.shape[-1])


# --- Megatron's own classes: stock LLaVAModel, or the parts of a whole VLM ---------------------

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


TEXT_ROWS, TEXT_LENGTH = 2, 17


def text_cases(hooks: FamilyHooks, cfg, seed: int, image_sizes, *, length: int = TEXT_LENGTH,
               why_length: str = "") -> list[Case]:
    """Text-only ids over the whole vocabulary (what a whole VLM runs on a prompt without images):
    the decoder from its embedding to its output layer, rows of ``length`` tokens (``why_length``:
    why a class takes them shorter than the default, said in the case's description). ``labels``
    are Megatron's pre-shifted ones; the last position, whose next token is not in the row, is
    masked."""
    if image_sizes:
        raise megatron_side.UnsupportedInput("Megatron's GPTModel is the language model part alone: it runs on "
                               "text-only ids, so --image-size does not apply")
    # Short rows are more rows, so that a class bound to short sequences still sees many tokens.
    rows = max(TEXT_ROWS, -(-TEXT_ROWS * TEXT_LENGTH // length))
    drawn = torch.randint(0, cfg.text_config.vocab_size, (rows, length + 1),
                          generator=inputs.generator(seed + 7919))
    ids = drawn[:, :-1]
    loss_mask = torch.ones(ids.shape)
    loss_mask[:, -1] = 0
    data = {"input_ids": ids, "labels": drawn[:, 1:], "loss_mask": loss_mask, "hf_labels": ids,
            "length": length}
    return [Case("text", data, ("logits", "token_loss"),
                 description=f"{rows} rows of {length} text-only token ids" + (f" ({why_length})" if why_length else ""))]


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


def language_pairs(model, mlp_pairs: Optional[Callable] = None) -> list[Pair]:
    """A ``GPTModel``'s layers (their norms, attention and MLP first) by their place in the whole
    model, and its final norm (last stage): the native language model's and Megatron's alike.
    ``mlp_pairs``: the language part's pairs inside a layer's MLP (its native side's
    ``mlp_pairs``); Megatron's own classes pair the MLP whole (TE's grouped experts have no
    routed-experts probe)."""
    inner = sublayers.no_inner_pairs if mlp_pairs is None else partial(mlp_pairs, extract=language_tokens)
    out = [pair for i, layer in numbered_layers(model.decoder)
           for pair in sublayers.layer_pairs(LANGUAGE_LAYER.format(i), layer, language_tokens, inner=inner)]
    if model.post_process:
        out.append(Pair(FINAL_NORM, model.decoder.final_layernorm, language_tokens))
    return out


def _language_pairs(model, cfg) -> list[Pair]:
    return language_pairs(model)


def _feature_width(cfg) -> int:
    # InternVL's pixel shuffle widens each feature by the patches it merges.
    return cfg.vision_config.hidden_size * len(feature_layer_indices(cfg)) * pixel_shuffle_reduction(cfg) ** 2


def _feature_cases(hooks: FamilyHooks, cfg, seed: int, image_sizes) -> list[Case]:
    if image_sizes:
        raise megatron_side.UnsupportedInput("Megatron's MultimodalProjector is the projector part alone: it runs on "
                               "seeded tower features, so --image-size does not apply")
    features = inputs.token_probe(29, _feature_width(cfg), seed)
    return [Case("features", {"features": features}, ("vision_projection",),
                 description=f"29 seeded tower features of width {features.shape[1]}")]


def _reference_projector(model, case: Case, cfg) -> dict:
    """HF's projector linears (``linear_1``, ``act``, ``linear_2``): all of LLaVA's projector, and
    Mistral3's after the norm and patch merger that Megatron holds in the tower."""
    proj = model.model.multi_modal_projector
    features = inputs.like_model(case.data["features"], model)
    if getattr(proj, "layer_norm", None) is not None:  # InternVL's, which Megatron's linear_fc1 holds
        features = proj.layer_norm(features)
    return {"vision_projection": proj.linear_2(proj.act(proj.linear_1(features)))}


def _run_projector(model, case: Case, cfg) -> dict:
    return {"vision_projection": model(inputs.like_model(case.data["features"], model))}


def _vision_cases(hooks: FamilyHooks, cfg, seed: int, image_sizes) -> list[Case]:
    """Images through the tower (and merger) and the projector: mixed sizes in one packed pass and
    a static batch of two; even patch grids by default (Megatron's merger raises on odd ones,
    discrepancy 4)."""
    if len(feature_layer_indices(cfg)) > 1:
        raise megatron_side.UnsupportedInput("Megatron's ViTModel gives one layer's features; the config "
                               f"concatenates several (vision_feature_layer {cfg.vision_feature_layer})")
    p = first_int(cfg.vision_config.patch_size)
    step = p * spatial_merge(cfg)
    side = pixtral_cases.max_patches_per_side(cfg.vision_config) * p
    sizes = [tuple(s) for s in image_sizes or inputs.within([(4 * p, 6 * p), (6 * p, 2 * p)], side, step)]
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
    tokens, projected = megatron_side.tower_and_projection(model, case)
    return {"vision_model": tokens, "vision_projection": projected}


def _vision_part_pairs(model, cfg) -> list[Pair]:
    """The tower's pairs under ``vision_model.``, its merger and the projector, as the whole
    model's reference names them."""
    tower = model.vision_model
    out = [p.under(VISION) for p in megatron_side.vit_pairs(tower)]
    if tower.merger is not None:
        out.append(Pair(MERGER, tower.merger, tokens_2d))
    return out + [Pair(PROJECTOR, model.vision_projection, tokens_2d)]


def _loss_over_padded_vocabulary(outputs: dict, case: Case, cfg, tp: int, *,
                                 divisible_by: int = VOCAB_MULTIPLE) -> dict:
    """HF's per-token loss recomputed over the vocabulary padded as Megatron-LM pads it at ``tp``
    with ``--make-vocab-size-divisible-by divisible_by``:
    Megatron's cross entropy spans the pad rows, whose converted output weights are zero, so each
    adds a logit of 0 to the softmax. That is what Megatron computes for any padded checkpoint;
    HF's unpadded loss is not its function (docs/megatron.md, llava)."""
    labels = case.data["hf_labels"]
    batch, vocab = labels.shape[0], cfg.text_config.vocab_size
    logits = outputs["logits"].view(batch, -1, vocab)
    rows = padded_vocab_size(vocab, divisible_by, tp)
    padded = F.pad(logits, (0, rows - vocab))
    shifted = F.cross_entropy(padded[:, :-1].reshape(-1, rows), labels[:, 1:].reshape(-1).to(padded.device),
                              ignore_index=IGNORE_INDEX, reduction="none").view(batch, -1)
    per_token = torch.cat([shifted, shifted.new_zeros(batch, 1)], dim=1)
    mask = outputs["loss_mask"].view(batch, -1)
    return {**outputs, "token_loss": (per_token * mask).reshape(-1)}


PADDED_LOSS_NOTE = "token_loss against HF's loss over Megatron-LM's padded vocabulary (pad logits 0)"


def llava_clip_config() -> LlavaConfig:
    """LLaVA with the CLIP tiny tower, which stock megatron-core's ``LLaVAModel`` builds (Megatron-LM
    main's cannot build any ``vit_model`` tower, see docs/megatron.md): features from the
    penultimate layer, class token dropped (``default``), the llava tiny text model."""
    base = reference.tiny_config()
    return LlavaConfig(vision_config=clip_reference.tiny_config(), text_config=base.text_config,
                       image_token_index=base.image_token_index, projector_hidden_act="gelu",
                       vision_feature_layer=-2, vision_feature_select_strategy="default",
                       multimodal_projector_bias=True, tie_word_embeddings=False)

def vlm_projection_config(cfg, params_dtype=torch.float32) -> TransformerConfig:
    """The projector's recipe (:func:`~mmparity.models.llava.config.projection_fields`) as
    Megatron's ``MultimodalProjector`` takes it."""
    fields = projection_fields(cfg)
    fields["activation"] = upstream.activation(fields["activation"])
    return upstream.projection_config(params_dtype, **fields)


def build_projector(cfg, params_dtype=torch.float32) -> MultimodalProjector:
    """A whole VLM's projector alone, as ``LLaVAModel`` builds its ``vision_projection``: its input
    is the tower's width times the feature layers HF concatenates (a merger keeps the width)."""
    return MultimodalProjector(vlm_projection_config(cfg, params_dtype),
                               te_stand_ins.projector_spec(normed=pixel_shuffle_reduction(cfg) > 1),
                               "mlp", _feature_width(cfg)).eval()


@upstream.needs_vit_model
def build_vlm_vision(cfg, params_dtype=torch.float32):
    """A whole VLM's vision part under ``LLaVAModel``'s names, for the VLMs ``LLaVAModel`` cannot
    hold: Megatron-LM main's Pixtral ``ViTModel`` built ``tower_depth`` layers deep as the
    converter writes it (with ``PixtralLargePatchMerger`` where the VLM merges patches, Mistral3),
    and the projector."""
    merger = (dict(use_merger=True, spatial_merge_size=cfg.spatial_merge_size)
              if has_patch_merger(cfg) else {})
    tower = pixtral_megatron.pixtral_vit(vision_of(cfg, pixtral_megatron.MODEL_TYPES), params_dtype,
                                         tower_depth(cfg), **merger)
    return upstream.VisionWithProjection(tower, build_projector(cfg, params_dtype)).eval()


def feature_layer_count(cfg) -> int:
    """Megatron builds a LLaVA tower only up to HF's ``vision_feature_layer``: the number of
    encoder layers HF's selected hidden state has gone through."""
    layer = cfg.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer={layer!r}: Megatron's LLaVAModel takes one layer")
    total = cfg.vision_config.num_hidden_layers
    return layer + total + 1 if layer < 0 else layer


def build_llava(cfg, params_dtype=torch.float32, divisible_by: int = VOCAB_MULTIPLE,
                parallel_output: bool = True, *, vision_model_type: str = "",
                tower_config: Optional[Callable] = None, vit_model: bool = False,
                tower_layer_spec: Optional[Callable] = None):
    """Stock ``LLaVAModel``: the tower Megatron's ``vision_model_type`` names (what the tower
    family's record states: stock CLIP/SigLIP, or Megatron-LM main's ``ViTModel`` where
    ``vit_model``), ``MultimodalProjector``, ``GPTModel`` with the dense decoder.
    ``tower_config(vc, params_dtype, num_layers)``: the tower family's recipe, ``tower_layer_spec(vc)``
    its layers' spec (Megatron-LM's ViT layer by default). The tower is built ``feature_layer_count``
    layers deep; the vocabulary is padded as Megatron-LM pads it. InternVL's pixel shuffle is
    ``LLaVAModel``'s own (2x2 only), its normed projector Megatron-LM's NVLM one."""
    vc = cfg.vision_config
    if not vision_model_type or tower_config is None:
        raise ValueError(f"no Megatron LLaVA tower for {vc.model_type!r}")
    if select_strategy(cfg) not in ("default", "full"):
        raise ValueError(f"unknown select strategy {select_strategy(cfg)!r}")
    layers = feature_layer_count(cfg)
    shuffle = pixel_shuffle_reduction(cfg)
    if shuffle not in (1, 2):
        raise ValueError(f"Megatron's LLaVAModel shuffles 2x2 patches only, not {shuffle}x{shuffle}")
    modules = [llava_model, clip_vit_model]
    if vit_model:
        modules.append(upstream.vit_model_module())
    vision_config = tower_config(vc, params_dtype, layers)
    vision_config.vision_model_type = vision_model_type
    language = dense_decoder.language_model_args(cfg, params_dtype, divisible_by)
    img_h, img_w = image_hw(vc)
    with buildable_without_te(*modules):
        model = llava_model.LLaVAModel(
            language_transformer_config=language.config,
            language_transformer_layer_spec=te_stand_ins.gpt_layer_spec(),
            language_vocab_size=language.vocab_size,
            language_max_sequence_length=language.max_sequence_length,
            vision_transformer_config=vision_config,
            vision_transformer_layer_spec=(te_stand_ins.vit_layer_spec() if tower_layer_spec is None
                                           else tower_layer_spec(vc)),
            drop_vision_class_token=select_strategy(cfg) == "default",
            vision_projection_config=vlm_projection_config(cfg, params_dtype),
            vision_projection_layer_spec=te_stand_ins.projector_spec(normed=shuffle > 1),
            vision_projection_type="mlp", pixel_shuffle=shuffle > 1,
            share_embeddings_and_output_weights=language.tied,
            language_position_embedding_type="rope", language_rotary_base=language.rotary_base,
            img_h=img_h, img_w=img_w, patch_dim=first_int(vc.patch_size),
            parallel_output=parallel_output,
            # Megatron-LM's LLaVA under pipeline parallelism: the encoder and the embedding on the
            # first stage, the output layer on the last, the language layers split between them.
            pre_process=runtime.is_first_stage(), post_process=runtime.is_last_stage(),
            add_encoder=runtime.is_first_stage())
    return model.eval()


def language_part_builder(languages: Callable, cfg, params_dtype=torch.float32, divisible_by: int = VOCAB_MULTIPLE,
                          parallel_output: bool = True):
    """Megatron's class for the language-model part ``languages(cfg)`` is (the builder its registry
    entry names), this pipeline stage of it. A record's ``build`` is this function until
    :func:`bind_language` gives it the family's part lookup."""
    return languages(cfg).megatron_build(cfg, params_dtype, divisible_by=divisible_by,
                                         parallel_output=parallel_output)


def bind_language(classes: MegatronClasses, languages: Callable) -> MegatronClasses:
    """``classes`` with each language-model record built by the part ``languages(cfg)`` names."""
    if not isinstance(classes, Mapping):
        return classes
    return {name: replace(record, build=partial(language_part_builder, languages))
            if record.build is language_part_builder else record for name, record in classes.items()}


# Where ``LLaVAModel`` cannot hold a whole VLM, one record per part; each holds its prefix of the
# whole model's keys (LLaVAModel's attribute names). The language model's is the part's own class.
LANGUAGE_MODEL = MegatronClass(
    language_part_builder, text_cases, _run_language_model, _language_pairs,
    reference_run=_reference_language_model, reference_outputs=_loss_over_padded_vocabulary,
    note=f"the language model part (language_model.*) on text-only ids; {PADDED_LOSS_NOTE}",
    module_cases=("text",), pipelined=True, stage_module=megatron_side.whole_model,
    holds=("language_model.",), root="language_model.")
PROJECTION = MegatronClass(
    build_projector, _feature_cases, _run_projector, megatron_side.no_pairs,
    reference_run=_reference_projector,
    note="the projector part (vision_projection.*) alone, on seeded tower features", module_cases=(),
    holds=("vision_projection.",), root="vision_projection.")
VISION_PART = MegatronClass(
    build_vlm_vision, _vision_cases, _run_vision_part, _vision_part_pairs,
    reference_run=_reference_vision_part,
    note="the vision part (vision_model.*, vision_projection.*) on images",
    holds=("vision_model.", "vision_projection."))
WHY_PARTS = ("Megatron-LM's LLaVAModel cannot be built with a vit_model tower (docs/megatron.md, "
             "discrepancy 5), so the whole model is checked and loaded part by part")
WHY_NO_WHOLE = ("the composition names no Megatron class for the whole model, so its language model and "
                "projector are checked and loaded part by part")


def whole_vlm_parts(vision: Optional[MegatronClass] = None, why: str = WHY_PARTS) -> dict[str, MegatronClass]:
    """A whole VLM's Megatron classes part by part, the language model first (stock megatron-core:
    it always runs): ``GPTModel``, the ``vision`` part where Megatron has a class for the tower
    (e.g. :func:`pixtral_vision_part`), and ``MultimodalProjector``; ``why`` the whole model has none."""
    named = [("GPTModel", LANGUAGE_MODEL)]
    if vision is not None:
        named.append(("ViTModel+MultimodalProjector", vision))
    named.append(("MultimodalProjector", PROJECTION))
    return {name: replace(record, why_part=why) for name, record in named}


def pixtral_vision_part(note: str = "") -> MegatronClass:
    """The vision part of a whole VLM on a Pixtral tower (Megatron-LM main's ``ViTModel``, with the
    merger where the VLM merges) and its projector; ``note``: what it computes otherwise than HF."""
    return replace(VISION_PART, note="; ".join(n for n in (VISION_PART.note, note) if n))


def _vit_model_tower(towers: TowerLookup, cfg) -> bool:
    return towers(cfg).llava_tower.vit_model


def llava_model_builder(towers: TowerLookup, cfg, params_dtype=torch.float32, divisible_by: int = VOCAB_MULTIPLE,
                        parallel_output: bool = True):
    """Stock ``LLaVAModel`` on the tower ``towers(cfg)`` is, selected by the Megatron
    ``vision_model_type`` its tower record names. A record's ``build`` is this function until
    :func:`bind_towers` gives it the family's tower lookup."""
    tower = towers(cfg).llava_tower
    return build_llava(cfg, params_dtype, divisible_by=divisible_by, parallel_output=parallel_output,
                       vision_model_type=tower.megatron_type, tower_config=tower.megatron_config,
                       vit_model=tower.vit_model, tower_layer_spec=tower.megatron_layer_spec)


def _refuse_a_vit_model_tower(towers: TowerLookup, cfg) -> str | None:
    return WHY_PARTS if _vit_model_tower(towers, cfg) else None


def _refuse_another_tower(towers: TowerLookup, cfg) -> str | None:
    return None if _vit_model_tower(towers, cfg) else (
        f"Megatron's ViTModel part holds a Pixtral tower, not {cfg.vision_config.model_type!r} "
        "(LLaVAModel holds that one)")


# What of a record reads the tower the config names: bound by :func:`bind_towers`.
_TOWER_READERS = (llava_model_builder, _refuse_a_vit_model_tower, _refuse_another_tower)


def bind_towers(classes: MegatronClasses, towers: TowerLookup) -> MegatronClasses:
    """``classes`` with each builder and refusal that reads the tower given the family's lookup."""
    if not isinstance(classes, Mapping):
        return classes
    bound = {}
    for name, record in classes.items():
        changes = {field: partial(value, towers) for field in ("build", "refuses")
                   if (value := getattr(record, field)) in _TOWER_READERS}
        bound[name] = replace(record, **changes) if changes else record
    return bound


# Stock LLaVAModel holds the whole of a LLaVA on a CLIP-like tower; the parts beside it.
LLAVA_MODEL = MegatronClass(llava_model_builder, megatron_side.configured_size(lambda cfg: cfg.vision_config),
                            _run_llava, megatron_side.no_pairs, default_config=llava_clip_config,
                            reference_outputs=_loss_over_padded_vocabulary, note=PADDED_LOSS_NOTE, pipelined=True,
                            refuses=_refuse_a_vit_model_tower)
# A LLaVA on a Pixtral tower is a whole VLM LLaVAModel cannot hold: its tower and projector load
# into Megatron-LM main's ViTModel and MultimodalProjector, beside GPTModel (as pixtral_12b's).
LLAVA_VISION_PART = replace(pixtral_vision_part(), why_part=WHY_PARTS, refuses=_refuse_another_tower)
MEGATRON = {"LLaVAModel": LLAVA_MODEL, "GPTModel": LANGUAGE_MODEL, "ViTModel+MultimodalProjector": LLAVA_VISION_PART,
            "MultimodalProjector": PROJECTION}
