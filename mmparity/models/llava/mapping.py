"""LLaVA: a whole HF ``LlavaForConditionalGeneration`` checkpoint <-> Megatron's ``LLaVAModel`` keys.

The vision tower is built, as Megatron builds it, only as deep as ``vision_feature_layer`` reads;
the layers past it (and what the tower's family keeps aside, e.g. CLIP's ``ln_post``) are side
tensors.

Three parts, each under its own root on both sides:

* the vision tower: the registered vision family's own table (Pixtral, CLIP, SigLIP, picked by
  ``vision_config.model_type``), moved under ``vision_model.`` / the tower's HF root with
  :func:`rules.nested_rules`, not restated here;
* the projector: ``multi_modal_projector.linear_1`` / ``linear_2`` <-> mcore
  ``MultimodalProjector`` ``vision_projection.encoder.linear_fc1`` / ``linear_fc2`` (InternVL's
  ``layer_norm`` before them as ``linear_fc1.layer_norm_weight`` / ``_bias``);
* the Llama-style language model <-> mcore ``GPTModel`` under ``language_model.``, with the
  embedding and the output layer padded as Megatron-LM pads them, to a multiple of
  ``make_vocab_size_divisible_by × TP`` (:func:`padded_vocab_size`; the table states TP 1's and the
  engine re-pads for the TP size it converts to). Export trims the padding. Tied embeddings have no
  ``output_layer`` on the mcore side; HF's ``lm_head.weight`` (the same tensor) is then dropped.

HF layouts:

* ``hf``: the module names of transformers >= 4.52 (``model.vision_tower.``,
  ``model.multi_modal_projector.``, ``model.language_model.``, ``lm_head``), i.e. what
  ``LlavaForConditionalGeneration.state_dict()`` returns;
* ``hf_checkpoint``: what transformers 5 writes with ``save_pretrained`` (and maps back on load):
  ``vision_tower.``, ``multi_modal_projector.``, ``language_model.model.``,
  ``language_model.lm_head``;
* ``hf_v4_checkpoint``: files written by transformers 4 (most hub checkpoints): as
  ``hf_checkpoint``, but CLIP and SigLIP towers one level deeper, under
  ``vision_tower.vision_model.``.

The language-model rules come first in the table, so converted state dicts list the language
model first, as the native module does.

Which vision family a config uses is the registry's business: :func:`converter` takes a lookup.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from mmparity.mapping.rules import (
    ConversionError, ConverterSpec, LanguageKeys, Rule, RuleSet, aside, nested_rules, rename)
from mmparity.config import has_patch_merger, pixel_shuffle_reduction, projector_bias, tied_embeddings, tower_depth
from mmparity.mapping.blocks import fused_layer_norm_rules

FORMATS = ("hf", "hf_checkpoint", "hf_v4_checkpoint", "mistral")


@dataclass(frozen=True)
class Layout:
    """Where one HF-side layout keeps each part: the tower's root and the format of the tower
    family's table to nest there, the projector's tensors (Mistral3's merger norm and merging
    layer, then the two linears' prefixes), the decoder's body root and names, the output head."""

    tower_root: str
    projector: tuple  # (merger norm key, merging layer key, linear_1 prefix, linear_2 prefix)
    lm_root: str
    head_key: str
    tower_format: str = "hf"
    decoder: str = "hf"
    # InternVL's projector LayerNorm (before linear_1), where the layout has one.
    projector_norm: str = ""


def _hf_projector(root: str) -> tuple:
    return (root + "norm.weight", root + "patch_merger.merging_layer.weight", root + "linear_1.",
            root + "linear_2.")


LAYOUTS = {
    "hf": Layout("model.vision_tower.", _hf_projector("model.multi_modal_projector."),
                 "model.language_model.", "lm_head.weight",
                 projector_norm="model.multi_modal_projector.layer_norm."),
    "hf_checkpoint": Layout("vision_tower.", _hf_projector("multi_modal_projector."),
                            "language_model.model.", "language_model.lm_head.weight",
                            projector_norm="multi_modal_projector.layer_norm."),
    # Mistral's own consolidated.safetensors (Pixtral-12B, Mistral-Small-3.1): everything at the
    # top level, the tower under vision_encoder. (the tower family's "mistral" table).
    "mistral": Layout("", ("pre_mm_projector_norm.weight", "patch_merger.merging_layer.weight",
                           "vision_language_adapter.w_in.", "vision_language_adapter.w_out."),
                      "", "output.weight", tower_format="mistral", decoder="mistral"),
}
LAYOUTS["hf_v4_checkpoint"] = LAYOUTS["hf_checkpoint"]

# Deliberately not converted: persistent buffers older releases saved (CLIP position ids, Llama
# rotary frequencies); both are recomputed from the config.
_DROP_BUFFERS = (r"^(.*\.)?embeddings\.position_ids$", r"^(.*\.)?rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class Tower:
    """What the LLaVA table needs of its vision tower's family: that family's converter, and the
    extra root transformers 4 nested that tower under (``vision_model.`` for CLIP and SigLIP)."""

    converter: ConverterSpec
    v4_checkpoint_root: str = ""


def _vision_rule_set(cfg, tower: Tower, tower_format: str = "hf") -> RuleSet:
    if tower_format not in tower.converter.formats:
        raise ConversionError(f"no {tower_format!r} layout for a "
                              f"{getattr(cfg.vision_config, 'model_type', None)!r} tower",
                              [f"that tower's layouts: {', '.join(tower.converter.formats)}"])
    return tower.converter.rule_set(cfg.vision_config, tower_format)


def _vision_tp_problems(cfg, tp: int, tower: Tower) -> list[str]:
    if tp < 1:
        return []  # the engine reports a non-positive size itself
    validate_vision = _vision_rule_set(cfg, tower).validate_tp
    return list(validate_vision(tp)) if validate_vision else []


def tp_problems(cfg, tp: int, tower: Tower, language: LanguageKeys) -> list[str]:
    if tp < 1:
        return []
    return _vision_tp_problems(cfg, tp, tower) + language.tp_problems(cfg.text_config, tp)


def merger_rules(cfg, norm_key: str, merging_key: str) -> tuple:
    """Mistral3's pre-merge RMSNorm and 2x2 patch merger, which HF keeps in its projector and
    Megatron in the tower (``vision_model.merger``, as the Pixtral-Large family lays it out)."""
    if not has_patch_merger(cfg):
        return ()
    return (rename("vision_model.merger.pre_norm.weight", norm_key),
            rename("vision_model.merger.linear_fc1.weight", merging_key))


def projector_rules(cfg, linear_1: str, linear_2: str, norm: str = "") -> tuple:
    mc = "vision_projection.encoder."
    rules = ()
    if pixel_shuffle_reduction(cfg) > 1:
        # InternVL's LayerNorm over the shuffled vector, fused into linear_fc1 as Megatron-LM's
        # normed projector (TELayerNormColumnParallelLinear) holds it; every rank needs all of it.
        if not norm:
            raise ConversionError("this layout has no place for InternVL's projector LayerNorm", [])
        rules = fused_layer_norm_rules(mc + "linear_fc1.", norm.rstrip("."))
    rules += (rename(mc + "linear_fc1.weight", linear_1 + "weight", "column"),
              rename(mc + "linear_fc2.weight", linear_2 + "weight", "row"))
    if projector_bias(cfg):
        rules += (rename(mc + "linear_fc1.bias", linear_1 + "bias", "column"),
                  rename(mc + "linear_fc2.bias", linear_2 + "bias"))
    return rules


_TOWER_LAYER = "{vision_i}"


def _tower_depth(cfg, vision: tuple, variables: dict) -> tuple[tuple, dict]:
    """The tower as Megatron builds it: only as deep as the deepest hidden state LLaVA reads
    (``vision_feature_layer``). The layers past it are set aside (no model reads them), each under
    its own number, so that mcore -> HF gives them back."""
    depth = tower_depth(cfg)
    total = variables["vision_i"]
    layered = [r for r in vision if any(_TOWER_LAYER in p for p in r.mcore)]
    dropped = tuple(rule for layer in range(depth, total) for rule in aside(*(
        Rule(tuple(p.replace(_TOWER_LAYER, str(layer)) for p in r.mcore),
             tuple(p.replace(_TOWER_LAYER, str(layer)) for p in r.hf), r.op, r.tp)
        for r in layered), side="unused"))
    return vision + dropped, {**variables, "vision_i": depth}


def rule_set(cfg, hf_format: str, tower: Tower, language: LanguageKeys) -> RuleSet:
    if hf_format not in FORMATS:
        raise ConversionError("unknown LLaVA layout", [f"got {hf_format!r}; known: {FORMATS}"])
    layout = LAYOUTS[hf_format]
    tower_root = layout.tower_root + (tower.v4_checkpoint_root if hf_format == "hf_v4_checkpoint" else "")
    vision, vision_vars = nested_rules(_vision_rule_set(cfg, tower, layout.tower_format), "vision_model.",
                                       tower_root, "vision_")
    vision, vision_vars = _tower_depth(cfg, vision, vision_vars)
    norm, merging, linear_1, linear_2 = layout.projector
    if layout.decoder not in language.layouts:
        raise ConversionError(f"no {layout.decoder!r} layout for a "
                              f"{getattr(cfg.text_config, 'model_type', None)!r} language model",
                              [f"that language model's layouts: {', '.join(language.layouts)}"])
    rules = (language.rules(cfg.text_config, layout.lm_root, layout.head_key, tied=tied_embeddings(cfg),
                            layout=layout.decoder)
             + vision + merger_rules(cfg, norm, merging)
             + projector_rules(cfg, linear_1, linear_2, layout.projector_norm))
    head_key = layout.head_key
    drops = (_DROP_BUFFERS + ((f"^{re.escape(head_key)}$",) if tied_embeddings(cfg) else ())
             + language.drops_of(cfg.text_config, layout.lm_root))
    return RuleSet(rules=rules,
                   variables={**language.variables_of(cfg.text_config), **vision_vars},
                   hf_prefixes=("",), drop_hf=drops, hf_format=hf_format,
                   validate_tp=lambda tp: tp_problems(cfg, tp, tower, language),
                   part_tp={"language_model.": lambda tp: language.tp_problems(cfg.text_config, tp) if tp >= 1 else [],
                            "vision_model.": lambda tp: _vision_tp_problems(cfg, tp, tower)})


def detect_format(keys) -> str:
    """The layout of a key set: module names (``model.language_model.*``), a transformers 5
    checkpoint (``language_model.model.*``), a transformers 4 one (the same, with a nested
    ``vision_tower.vision_model.*``) or Mistral's own (``vision_encoder.*``, ``tok_embeddings.*``)."""
    keys = list(keys)
    if any(k.startswith(("vision_encoder.", "tok_embeddings.")) for k in keys):
        return "mistral"
    files = any(k.startswith("language_model.model.") for k in keys)
    modules = any(k.startswith("model.language_model.") for k in keys)
    if files and modules:
        raise ConversionError("ambiguous checkpoint: two LLaVA key layouts present", [
            "checkpoint files: language_model.model.*", "module names: model.language_model.*",
            f"pass hf_format explicitly (one of {', '.join(FORMATS)})"])
    if not files:
        return "hf"
    nested = any(k.startswith("vision_tower.vision_model.") for k in keys)
    return "hf_v4_checkpoint" if nested else "hf_checkpoint"


def converter(tower_of: Callable[[object], Tower],
              language_of: Callable[[object], LanguageKeys], formats: tuple = FORMATS) -> ConverterSpec:
    """LLaVA's converter, given how to find the tower and the language model of a config (the
    family registry knows: each is a registered part); ``formats``: the HF layouts of
    :data:`LAYOUTS` the composed VLM has (a reference module's ``HF_LAYOUTS``; all by default)."""
    return ConverterSpec(formats=formats,
                         rule_set=lambda cfg, fmt: rule_set(cfg, fmt, tower_of(cfg), language_of(cfg)),
                         detect_format=detect_format)
