"""Pixtral-Large (Mistral3): vision tower + multimodal projector <-> ``PixtralLargeVisionModel`` keys.

The HF unit is a whole ``Mistral3ForConditionalGeneration`` checkpoint. transformers 5 holds it
under ``model.`` in memory and writes the legacy names (no ``model.``) to disk; both are detected.
The language model is deliberately left out. The three spellings of each tensor
(mcore / HF / Mistral-native ``consolidated.safetensors``):

* tower: ``vision_model.`` / ``vision_tower.`` / ``vision_encoder.`` + the Pixtral tower's names
  (:func:`mmparity.models.pixtral.mapping.tower_rules`);
* merger norm: ``vision_model.merger.norm.weight`` / ``multi_modal_projector.norm.weight`` /
  ``pre_mm_projector_norm.weight``;
* merger: ``vision_model.merger.merging_layer.weight`` /
  ``multi_modal_projector.patch_merger.merging_layer.weight`` / ``patch_merger.merging_layer.weight``;
* projector: ``vision_projection.encoder.linear_fc1.*`` and ``linear_fc2.*`` /
  ``multi_modal_projector.linear_1.*`` and ``linear_2.*`` / ``vision_language_adapter.w_in.*`` and
  ``w_out.*`` (biases only with ``multimodal_projector_bias``).
"""

from __future__ import annotations

from mmparity.models.pixtral import mapping as pixtral
from mmparity.models.pixtral.mapping import detect_format  # noqa: F401  (same key evidence)
from mmparity.mapping.rules import ConversionError, ConverterSpec, RuleSet, rename

FORMATS = ("hf", "mistral")

HF_PREFIXES = ("", "model.")
HF_DROP_LM = (r"^(model\.)?language_model\.", r"^lm_head\.")


def tp_problems(cfg, tp: int) -> list[str]:
    problems = pixtral.tp_problems(cfg.vision_config, tp)
    text_hidden = cfg.text_config.hidden_size
    if text_hidden % tp:
        problems.append(f"tp={tp} does not divide the projector width text_config.hidden_size="
                        f"{text_hidden}")
    return problems


_PROJECTOR_NAMES = {
    "hf": ("multi_modal_projector.norm.weight",
           "multi_modal_projector.patch_merger.merging_layer.weight",
           "multi_modal_projector.linear_1.", "multi_modal_projector.linear_2."),
    "mistral": ("pre_mm_projector_norm.weight", "patch_merger.merging_layer.weight",
                "vision_language_adapter.w_in.", "vision_language_adapter.w_out."),
}


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    if getattr(cfg, "model_type", None) != "mistral3":
        raise ConversionError("Pixtral-Large conversion needs the whole Mistral3 config",
                              [f"got model_type {getattr(cfg, 'model_type', None)!r}"])
    if hf_format not in FORMATS:
        raise ConversionError("unknown Pixtral-Large layout", [f"got {hf_format!r}; known: {FORMATS}"])
    norm, merging, linear_1, linear_2 = _PROJECTOR_NAMES[hf_format]
    fc1, fc2 = "vision_projection.encoder.linear_fc1.", "vision_projection.encoder.linear_fc2."
    rules = [
        *pixtral.tower_rules(cfg.vision_config, hf_format,
                             hf_root="vision_tower." if hf_format == "hf" else "",
                             mcore_root="vision_model."),
        rename("vision_model.merger.pre_norm.weight", norm),
        rename("vision_model.merger.linear_fc1.weight", merging),
        rename(fc1 + "weight", linear_1 + "weight", "column"),
        rename(fc2 + "weight", linear_2 + "weight", "row"),
    ]
    if cfg.multimodal_projector_bias:
        rules += [rename(fc1 + "bias", linear_1 + "bias", "column"),
                  rename(fc2 + "bias", linear_2 + "bias")]
    if hf_format == "hf":
        prefixes, drops = HF_PREFIXES, HF_DROP_LM
    else:
        prefixes, drops = pixtral.MISTRAL_PREFIXES, pixtral.MISTRAL_DROP_LM
    return RuleSet(rules=tuple(rules), variables={"i": cfg.vision_config.num_hidden_layers},
                   hf_prefixes=prefixes, drop_hf=drops, hf_format=hf_format,
                   validate_tp=lambda tp: tp_problems(cfg, tp))


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set, detect_format=detect_format)
