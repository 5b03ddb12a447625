"""GLM-4.6V whole parity: GLM-4.5V whole's cases, runs and pairs (``glm4v_moe``), on
``Glm46VForConditionalGeneration``; a text model other than GLM-4.5's MoE one is refused by name."""

from __future__ import annotations

from mmparity.models.glm46v import reference
from mmparity.models.glm46v.config import DENSE_TEXT_MODEL_TYPE
from mmparity.models.glm4v_moe import cases as glm4v_moe


def config_problems(cfg) -> list[str]:
    kind = getattr(cfg.text_config, "model_type", None)
    if kind != reference.MOE_TEXT_MODEL_TYPE:
        dense = " (GLM-4's dense decoder with its post-attention and post-MLP norms)" if kind == DENSE_TEXT_MODEL_TYPE else ""
        return [f"text_config: model_type {kind!r}{dense}; only {reference.MOE_TEXT_MODEL_TYPE!r} is taken"]
    return glm4v_moe.config_problems(cfg)


def hooks(towers, languages):
    return glm4v_moe.family_hooks(reference, config_problems)
