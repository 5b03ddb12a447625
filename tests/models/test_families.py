"""Generic checks every registered family must pass; a new family needs no new test here."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from transformers import LlavaConfig

from mmparity.models import registry as families
from mmparity.mapping.rules import expected_keys, with_side
from mmparity.parity import harness
from mmparity.models.core.inputs import random_like_state
from tests.strategies import family_configs

FAMILIES = families.names()


def test_unknown_family_lists_valid_names():
    with pytest.raises(KeyError) as info:
        families.get("no_such_family")
    message = str(info.value)
    assert "no_such_family" in message and all(n in message for n in FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_registry_entry_is_complete(family):
    hooks = families.get(family).hooks  # loading checks every hook's presence and type
    assert hooks.converter.formats
    assert set(hooks.parity.last_stage_components) <= set(hooks.parity.components)


@pytest.mark.parametrize("family", FAMILIES)
def test_native_loads_converted_weights_strictly(family):
    fam = families.get(family)
    cfg = fam.tiny_config()
    sd = random_like_state(fam.build_reference(cfg).state_dict(), seed=1)
    # The mcore state plus what Megatron's class has no place for but the native model has
    # modules for (CLIP's ln_post, the SigLIP head).
    shard = with_side(families.get(family).hf_to_mcore(sd, cfg))[0]
    native = fam.build_native(cfg)
    native.load_state_dict(shard, strict=True)
    loaded = native.state_dict()
    for key, value in shard.items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_parity_within_policy(family):
    report = harness.check(family, seed=5)
    failures = [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
    assert report.passed, failures
    for result in report.results:
        if "router" not in result.metrics:  # a router check's numbers are a deep module's, which locate
            assert result.metrics["rel_l2"] <= 1e-5


def _layer_key(state: dict, layer: int, suffix: str) -> str:
    matches = [k for k in state if f"layers.{layer}." in k and k.endswith(suffix)]
    assert matches, f"no key for layers.{layer}.*{suffix}"
    return matches[0]


def layer_pair(key: str, layer: int, family: str) -> str:
    """The paired module a perturbed layer key must be reported as: named by its part in a whole
    model (the language model's decoder, the vision model), plainly in a tower."""
    fam = families.get(family)
    # A language model alone stores GPTModel's keys at the root (as Megatron-LM's pretrain_gpt.py
    # builds it) and is reported, as in a whole model, under ``language_model.``.
    if key.startswith("language_model.") or (key.startswith("decoder.") and fam.with_language):
        return f"language_model.decoder.layers.{layer}"
    if key.startswith("vision_model.") and (fam.composed or fam.with_language):
        return f"vision_model.layer.{layer}"
    return f"layer.{layer}"


def located_in(located: set, pair: str) -> bool:
    """One divergence, at ``pair`` or at one of its own paired submodules (a layer's attention,
    router or experts, where the family pairs those)."""
    return len(located) == 1 and (next(iter(located)) == pair or next(iter(located)).startswith(pair + "."))


@pytest.mark.parametrize("family", FAMILIES)
def test_negative_control_perturbed_weight_is_located(family):
    perturbed = []

    def perturb(state):
        key = _layer_key(state, 1, "linear_fc2.weight")
        perturbed.append(key)
        state[key] = state[key].clone()
        state[key][0, 0] += 0.5

    report = harness.check(family, seed=2, mutate_native=perturb, components=False)
    assert not report.passed
    located = {r.first_divergence.module for r in report.failures()}
    assert located_in(located, layer_pair(perturbed[0], 1, family)), located


@pytest.mark.parametrize("family", FAMILIES)
def test_negative_control_swapped_query_heads_is_located(family):
    fam = families.get(family)
    config = fam.build_native(fam.tiny_config()).config
    heads, groups = config.num_attention_heads, config.num_query_groups
    head_dim = config.kv_channels

    swapped = []

    def swap_q_heads(state):
        key = _layer_key(state, 0, "linear_qkv.weight")
        swapped.append(key)
        w = state[key].clone()
        per = heads // groups
        # mcore rows per group: [q_0 .. q_{per-1}, k, v]; swap q of head 0 with the first q
        # head of the next group (or the next head of the same group).
        a = slice(0, head_dim)
        second = head_dim if per > 1 else (per + 2) * head_dim
        b = slice(second, second + head_dim)
        w[a], w[b] = state[key][b].clone(), state[key][a].clone()
        state[key] = w

    report = harness.check(family, seed=3, mutate_native=swap_q_heads, components=False)
    assert not report.passed
    located = {r.first_divergence.module for r in report.failures()}
    assert located_in(located, layer_pair(swapped[0], 0, family)), located


def _meta_shapes(fam, cfg) -> dict:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in fam.build_reference(cfg).state_dict().items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_state_shapes_are_what_the_reference_model_holds(family):
    """What convert checks a checkpoint's shapes against, read off the config without the model."""
    fam = families.get(family)
    assert fam.state_shapes(fam.tiny_config()) == _meta_shapes(fam, fam.tiny_config())

    @settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(cfg=family_configs(family))
    def property_(cfg):
        assert fam.state_shapes(cfg) == _meta_shapes(fam, cfg)

    property_()


@pytest.mark.parametrize("tower", [f for f in FAMILIES if families.get(f).converter.tower is not None])
def test_llava_state_shapes_take_each_registered_tower(tower):
    fam, text = families.get("llava"), families.get("llava").tiny_config().text_config
    cfg = LlavaConfig(vision_config=families.get(tower).tiny_config(), text_config=text,
                      vision_feature_layer=[-2, -1], tie_word_embeddings=True)
    assert fam.state_shapes(cfg) == _meta_shapes(fam, cfg)


@pytest.mark.parametrize("family", FAMILIES)
def test_conversion_and_the_hooks_read_one_config_and_one_table(family):
    """convert reads the config and tables without the hooks; the hooks must hold the same."""
    fam = families.get(family)
    cfg = fam.tiny_config()
    assert fam.hooks.config.tiny().to_dict() == cfg.to_dict()
    assert fam.hooks.config.family_config(cfg).to_dict() == fam.family_config(cfg).to_dict()
    # The registry adds the layout transformers' own mapping gives to the family's tables.
    assert fam.converter.formats == fam.hooks.converter.formats + (families.TRANSFORMERS_LAYOUT,)
    for fmt in fam.hooks.converter.formats:
        assert expected_keys(fam.hooks.converter.rule_set(cfg, fmt)) == expected_keys(fam.converter.rule_set(cfg, fmt))
