"""Qwen2.5-VL whole parity: Qwen3-VL whole's batches (two rows of text with images of different
sizes between vision start / end tokens, one image token per merged patch; then a short clip and
images, the clip one run of video tokens), here at the tower's sizes whose windows are partial;
logits at every position and the per-token loss; the paired
modules named by Megatron's tree: the tower's (``vision_model.layer.N.…``,
``vision_model.merger.…``), then per decoder layer its norms, attention, MLP and the layer, and
the final norm.
"""

from __future__ import annotations

from mmparity.models.qwen2_5_vl import cases as tower_cases
from mmparity.models.qwen2_5_vl_whole import mapping as converter
from mmparity.models.qwen2_5_vl_whole import native, reference
from mmparity.models.qwen2_5_vl_whole.megatron import MEGATRON
from mmparity.models.qwen3_vl_whole import cases as whole
from mmparity.models.core.layers import numbered_layers
from mmparity.models.spec import (
    ConfigHooks, FamilyHooks, Pair, Parity, Side, sbh_tokens_2d, tokens_2d)


# A clip is one run of video tokens; 0.7 s per temporal patch at the tiny tower's 4 tokens per
# second steps its temporal position by 2.8, truncated to 0, 2, 5: unequal steps, so a rounding or
# a step taken in another precision shows.
VIDEO = whole.VideoLayout(frames_apart=False, seconds=0.7)


def cases(cfg, seed: int, image_sizes=None):
    return whole.cases(cfg, seed, image_sizes or tower_cases.default_image_sizes(cfg.vision_config), video=VIDEO)


def reference_pairs(model, cfg) -> list[Pair]:
    out = [p.under("vision_model.") for p in tower_cases.reference_pairs(model.model.visual, cfg.vision_config)]
    out += whole.language_pairs(enumerate(model.model.language_model.layers), hf=True)
    out.append(Pair("language_model.decoder.final_layernorm", model.model.language_model.norm, tokens_2d))
    return out


def native_pairs(model, cfg) -> list[Pair]:
    out = []
    if model.vision_model is not None:
        out += [p.under("vision_model.") for p in tower_cases.native_pairs(model.vision_model, cfg.vision_config)]
    out += whole.language_pairs(numbered_layers(model.language_model.decoder), hf=False)
    if model.post_process:
        out.append(Pair("language_model.decoder.final_layernorm", model.language_model.decoder.final_layernorm,
                        sbh_tokens_2d))
    return out


def random_config(pick):
    heads = pick([2, 4])
    groups = pick([g for g in (1, 2) if heads % g == 0])
    hidden = heads * pick([6, 8, 10])
    half = hidden // heads // 2
    h_sec = pick(range(1, half // 2 + 1))
    w_sec = pick(range(1, half - h_sec))
    return reference.tiny_config(
        num_attention_heads=heads, num_key_value_heads=groups, hidden_size=hidden,
        num_hidden_layers=pick([1, 2, 3]),
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                         "mrope_section": [half - h_sec - w_sec, h_sec, w_sec]})


def config_problems(cfg) -> list[str]:
    problems = [f"text_config: {p}" for p in native.text_config_problems(cfg.text_config)]
    return problems + [f"vision_config: {p}" for p in tower_cases.config_problems(cfg.vision_config)]


def hooks(towers) -> FamilyHooks:
    return FamilyHooks(
        config=ConfigHooks(tiny=reference.tiny_config, family_config=reference.vision_config, random=random_config,
                           problems=config_problems, image_size_multiple=whole.image_size_multiple,
                           image_size_problems=whole.image_size_problems),
        reference=Side(whole.reference_run, reference_pairs, whole.no_component, reference.build),
        native=Side(whole.native_run, native_pairs, whole.no_component, native.build_native),
        converter=converter.SPEC, parity=Parity(cases), megatron=MEGATRON)
