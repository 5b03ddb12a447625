"""Qwen3.5 whole parity: two rows of text with three images of different sizes between vision
start / end tokens (Qwen3-VL whole's cases: one image token per merged patch, as Qwen's processor
lays them out), then a short clip (its temporal patches apart after timestamp text) beside
images; logits at every position and the per-token loss, and the paired modules named by
Megatron's tree: the tower's (``vision_model.layer.N``, ``vision_model.merger.…``), then per
decoder layer its ``self_attention`` (Gated DeltaNet or gated attention), for MoE the router (its
own agreement verdict), shared and routed experts, the ``mlp``, the layer, and the final norm
(qwen3_5_lm's pairs). Which gated delta rule the native side ran is in each case's description."""

from __future__ import annotations

import torch

from mmparity.models.parts.qwen3_5_text.config import config_problems as text_problems
from mmparity.models.parts.qwen3_5_text.reference import on_own_delta_rule
from mmparity.models.qwen3_5 import cases as tower_cases
from mmparity.models.qwen3_5_lm import cases as language
from mmparity.models.qwen3_5_lm.cases import _build_problems
from mmparity.models.qwen3_5_whole import mapping as converter
from mmparity.models.qwen3_5_whole import native, reference
from mmparity.models.qwen3_vl_whole import cases as whole
from mmparity.models.spec import ConfigHooks, FamilyHooks, NoMegatron, Pair, Parity, Side

image_size_multiple = whole.image_size_multiple
image_size_problems = whole.image_size_problems
reference_run = on_own_delta_rule(whole.reference_run)
native_run = whole.native_run


def cases(cfg, seed: int, image_sizes=None) -> list:
    from mmparity.models.parts.qwen3_5_text import delta_rule

    out = whole.cases(cfg, seed, image_sizes, video=whole.FRAMES_APART)
    kernels = f"; gated delta rule: {delta_rule.kernel_for('cpu')} on CPU, {delta_rule.kernel_for('cuda')} on a GPU"
    for case in out:
        case.description += kernels
    return out


def reference_pairs(model, cfg) -> list[Pair]:
    out = [p.under("vision_model.") for p in tower_cases.reference_pairs(model.model.visual, cfg.vision_config)]
    return out + language.reference_language_pairs(model.model.language_model, cfg.text_config)


def native_pairs(model, cfg) -> list[Pair]:
    out = []
    if model.vision_model is not None:
        out += [p.under("vision_model.") for p in tower_cases.native_pairs(model.vision_model, cfg.vision_config)]
    return out + language.native_language_pairs(model.language_model, cfg.text_config)


no_component = language.no_component


def random_config(pick):
    return reference.tiny_config(**language.random_text_options(pick))


def config_problems(cfg) -> list[str]:
    text = [f"text_config: {p}" for p in text_problems(cfg.text_config) + native.text_config_problems(cfg.text_config)]
    n = cfg.vision_config.num_position_embeddings
    vision = ([] if round(n ** 0.5) ** 2 == n else
              [f"vision_config: num_position_embeddings={n} is not a perfect square (a g*g position table)"])
    return text + vision + _build_problems()


MEGATRON = NoMegatron("megatron-core's GatedDeltaNet needs fla to be built and fla's triton kernels (a GPU) "
                      "to run; Megatron-LM main has no Qwen3.5 VLM class (its QwenVLViTModel is the tower "
                      "alone, checked under family qwen3_5)")


def hooks(towers, languages) -> FamilyHooks:
    def build_native(cfg, params_dtype=torch.float32):
        return native.build_native(cfg, params_dtype, language=languages(cfg).native)

    return FamilyHooks(
        config=ConfigHooks(tiny=reference.tiny_config, family_config=reference.vision_config, random=random_config,
                           problems=config_problems, image_size_multiple=image_size_multiple,
                           image_size_problems=image_size_problems),
        reference=Side(reference_run, reference_pairs, no_component, reference.build),
        native=Side(native_run, native_pairs, no_component, build_native), converter=converter.SPEC,
        parity=Parity(cases), megatron=MEGATRON)
