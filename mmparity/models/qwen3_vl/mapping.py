"""Qwen3-VL vision tower: HF ``Qwen3VLVisionModel`` keys <-> native ``Qwen3VLViTModel``.

Qwen3.5-MoE's tower table (the same modules under the same names: ``blocks.N`` -> mcore layers with
q/k/v regrouped per query group, the main merger whole on every rank) and, after it, one merger per
DeepStack tap: ``deepstack_merger_list.{j}.norm`` -> ``.patch_norm`` (as the main merger's norm),
fc1 and fc2 by name, whole on every TP rank. The HF side is a standalone tower or a whole
``Qwen3VLForConditionalGeneration`` (``model.visual.``), whose language model is dropped.
"""

from __future__ import annotations

from dataclasses import replace

from mmparity.mapping.rules import ConverterSpec, RuleSet, rename
from mmparity.models.qwen3_5 import mapping as tower

FORMATS = ("hf",)


def _vision(cfg):
    sub = getattr(cfg, "vision_config", None)
    return sub if sub is not None and hasattr(sub, "deepstack_visual_indexes") else cfg


def tp_problems(cfg, tp: int) -> list[str]:
    return tower.tp_problems(_vision(cfg), tp)


def deepstack_rules(root: str = "") -> tuple:
    """The DeepStack mergers' rules, their mcore keys under ``root`` (``vision_model.`` in a VLM)."""
    native, hf = root + "deepstack_merger_list.{d}.", "deepstack_merger_list.{d}."
    return (rename(native + "patch_norm.weight", hf + "norm.weight"),
            rename(native + "patch_norm.bias", hf + "norm.bias"),
            rename(native + "linear_fc1.weight", hf + "linear_fc1.weight"),
            rename(native + "linear_fc1.bias", hf + "linear_fc1.bias"),
            rename(native + "linear_fc2.weight", hf + "linear_fc2.weight"),
            rename(native + "linear_fc2.bias", hf + "linear_fc2.bias"))


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    vc = _vision(cfg)
    base = tower.rule_set(vc, hf_format)
    # Planned after the layers, so a pipeline puts the DeepStack mergers on the last stage.
    return replace(base, rules=base.rules + deepstack_rules(),
                   variables={**base.variables, "d": len(vc.deepstack_visual_indexes)},
                   validate_tp=lambda tp: tp_problems(vc, tp))


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set)
