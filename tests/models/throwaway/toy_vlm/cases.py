"""The whole VLM's hook record: LLaVA's composition (placeholder image tokens), checked in
Megatron's classes part by part (stock LLaVAModel builds a dense decoder only)."""

from __future__ import annotations

from mmparity.models.llava import cases as llava
from mmparity.models.llava import megatron as llava_megatron
from mmparity.models.spec import FamilyHooks
from tests.models.throwaway.toy_vlm import reference


def hooks(towers, languages) -> FamilyHooks:
    megatron = llava_megatron.whole_vlm_parts(why="stock LLaVAModel builds a dense decoder, not one with experts")
    return llava.hooks(towers, languages, llava.Composition(megatron=megatron), reference)
