"""The tower's parity cases and its hook record: CLIP's cases and sides, its own tiny config and
Megatron class (stock ``CLIPViTModel``)."""

from __future__ import annotations

from mmparity.models.clip import cases as clip
from mmparity.models.clip.megatron import build_clip
from mmparity.models.core import megatron_side
from mmparity.models.spec import Bench, FamilyHooks, Parity, module_hooks
from tests.models.throwaway.toy_tower import mapping, native, reference


def hooks(towers) -> FamilyHooks:
    megatron = {"CLIPViTModel": megatron_side.MegatronClass(
        build_clip, megatron_side.configured_size(lambda cfg: cfg), clip.megatron_run, clip.megatron_pairs)}
    return module_hooks(reference, native, mapping.SPEC, reference=clip.REFERENCE, native=clip.NATIVE,
                        random_config=clip.random_config, parity=Parity(clip.cases, clip.prepare_case, clip.COMPONENTS),
                        megatron=megatron, bench=Bench(clip.flop_shape, None))
