"""Qwen3-VL vision tower with DeepStack: conversion, parity (fp32, bf16, mixed sizes), the order
of the DeepStack features, limits, negative controls."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmparity.mapping.rules import ConversionError
from mmparity.models import registry as families
from mmparity.models.core import inputs
from mmparity.models.core.inputs import random_like_state
from mmparity.models.qwen3_vl import cases as qwen_cases
from mmparity.models.qwen3_vl import native as native_qwen
from mmparity.models.qwen3_vl import reference as qwen_reference
from mmparity.parity import harness
from tests.strategies import family_configs, tp_sizes

FAMILY = "qwen3_vl"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MERGER_PARTS = ("norm.weight", "norm.bias", "linear_fc1.weight", "linear_fc1.bias",
                "linear_fc2.weight", "linear_fc2.bias")


def fam():
    return families.get(FAMILY)


def tiny():
    return fam().tiny_config()


def rel_l2(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def pair():
    """(cfg, HF model with seeded weights, native model loaded through the converter)."""
    cfg = tiny()
    ref = fam().build_reference(cfg)
    state = random_like_state(ref.state_dict(), seed=11)
    ref.load_state_dict(state)
    native = fam().build_native(cfg)
    native.load_state_dict(fam().hf_to_mcore(state, cfg)[0], strict=True)
    return cfg, ref, native


# --- conversion ----------------------------------------------------------------------------------

def _whole_config(vision):
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(vision_config=vision.to_dict(), text_config=dict(
        hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True}))


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_round_trip_bit_exact_over_configs_tp_dtypes_and_vlm_prefixes(data):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    cfg = data.draw(family_configs(FAMILY))
    tp_size = data.draw(st.sampled_from(tp_sizes(FAMILY, cfg)))
    dtype = data.draw(st.sampled_from(DTYPES))
    prefix = data.draw(st.sampled_from(["", "visual.", "model.visual."]))
    shapes = Qwen3VLVisionModel(cfg).state_dict()
    vision = {prefix + k: v.to(dtype) for k, v in
              random_like_state(shapes, data.draw(st.integers(0, 999))).items()}
    checkpoint = dict(vision)
    if prefix:
        checkpoint.update({"model.language_model.embed_tokens.weight": torch.zeros(11, 8),
                           "lm_head.weight": torch.zeros(11, 8)})
    shards = fam().hf_to_mcore(checkpoint, cfg, tp_size=tp_size)
    assert len(shards) == tp_size
    back = fam().mcore_to_hf(shards, cfg, prefix=prefix)
    assert set(back) == set(vision)
    for key, value in vision.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_deepstack_mergers_are_whole_on_every_rank_under_their_own_names(tp_size):
    cfg = tiny()
    sd = random_like_state(fam().build_reference(cfg).state_dict(), seed=3)
    shards = fam().hf_to_mcore(sd, cfg, tp_size=tp_size)
    for shard in shards:
        for j in range(len(cfg.deepstack_visual_indexes)):
            for part in MERGER_PARTS:
                mcore = f"deepstack_merger_list.{j}.{part.replace('norm.', 'patch_norm.')}"
                assert torch.equal(shard[mcore], sd[f"deepstack_merger_list.{j}.{part}"]), mcore
        # The post-shuffle norm is over the grouped width m²·H, unlike the main merger's.
        assert shard["deepstack_merger_list.0.patch_norm.weight"].shape == (4 * cfg.hidden_size,)
        assert shard["merger.patch_norm.weight"].shape == (cfg.hidden_size,)


def test_state_shapes_are_the_models():
    cfg = tiny()
    model = fam().build_reference(cfg)
    assert qwen_reference.state_shapes(cfg) == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_whole_vlm_checkpoint_reads_only_the_tower_and_drops_the_rest():
    from transformers import Qwen3VLForConditionalGeneration

    vision = tiny()
    whole_cfg = _whole_config(vision)
    whole = Qwen3VLForConditionalGeneration(whole_cfg).state_dict()
    tower = {k[len("model.visual."):]: v for k, v in whole.items() if k.startswith("model.visual.")}
    assert any(k.startswith("model.language_model.") for k in whole)
    assert any(k.startswith("deepstack_merger_list.1.") for k in tower)
    from_whole = fam().hf_to_mcore(whole, whole_cfg, tp_size=2)
    from_tower = fam().hf_to_mcore(tower, vision, tp_size=2)
    for a, b in zip(from_whole, from_tower):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    back = fam().mcore_to_hf(from_whole, vision, prefix="model.visual.")
    assert set(back) == {"model.visual." + k for k in tower}
    # A merger more than the config's taps is not silently dropped.
    stray = dict(tower, **{"deepstack_merger_list.2.norm.weight": torch.zeros(4 * vision.hidden_size)})
    with pytest.raises(ConversionError, match=r"deepstack_merger_list\.2\.norm\.weight"):
        fam().hf_to_mcore(stray, vision)


# --- parity --------------------------------------------------------------------------------------

def test_check_passes_every_case_output_and_component():
    report = harness.check(FAMILY, seed=0)
    names = {r.check for r in report.results}
    outputs = {f"{c}:{o}" for c in ("static", "packed", "processor_rows")
               for o in ("last_hidden_state", "pooler_output", "deepstack_0", "deepstack_1")}
    parts = {f"component:{c}" for c in ("patch_embed", "pos_embed", "rope2d", "block_first", "merger",
                                        "deepstack_merger")}
    assert names == outputs | parts
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
    assert all(r.metrics["rel_l2"] <= 1e-5 for r in report.results)


def test_bf16_within_policy_on_mixed_sizes():
    p = tiny().patch_size
    sizes = [(4 * p, 8 * p), (12 * p, 2 * p), (2 * p, 2 * p)]
    report = harness.check(FAMILY, dtype="bfloat16", seed=1, image_sizes=sizes, components=False)
    assert report.passed, [(r.check, r.metrics, r.tolerance) for r in report.failures()]
    assert {r.check for r in report.results} >= {"packed:deepstack_0", "packed:deepstack_1"}


def test_features_come_in_layer_order_each_through_its_listed_merger(pair):
    """The tiny config lists its taps [1, 0]: feature 0 is layer 0's hidden through merger 1 (the
    list entry naming layer 0), which is what HF emits and what the decoder's layer 0 adds."""
    cfg, ref, native = pair
    assert list(cfg.deepstack_visual_indexes) == [1, 0]
    p = cfg.patch_size
    sizes = [(4 * p, 2 * p), (2 * p, 6 * p)]
    imgs = inputs.images(sizes, cfg.in_channels, seed=5)
    rows = torch.cat([inputs.block_first_patch_rows(i.unsqueeze(0), p, 2) for i in imgs]).unsqueeze(0)
    hs = [h // p for h, _ in sizes], [w // p for _, w in sizes]
    with torch.no_grad():
        hidden, h, w, taps = native.encode_deepstack(rows, imgs_sizes=sizes)
        features = native.deepstack(taps, h, w)
        by_hand = [native.deepstack_merger_list[1](taps[0], *hs), native.deepstack_merger_list[0](taps[1], *hs)]
        swapped = native.deepstack_merger_list[0](taps[0], *hs)
    assert (h, w) == hs
    for got, expected in zip(features, by_hand):
        assert torch.equal(got, expected)
    assert rel_l2(swapped, features[0]) > 1e-2


def test_packed_images_attend_only_to_themselves_in_the_deepstack_features(pair):
    cfg, _, native = pair
    p = cfg.patch_size
    sizes = [(2 * p, 4 * p), (6 * p, 2 * p)]
    imgs = inputs.images(sizes, cfg.in_channels, seed=4)
    rows = torch.cat([inputs.block_first_patch_rows(i.unsqueeze(0), p, 2) for i in imgs]).unsqueeze(0)
    with torch.no_grad():
        hidden, h, w, taps = native.encode_deepstack(rows, imgs_sizes=sizes)
        packed = native.deepstack(taps, h, w)
        alone = []
        for img in imgs:
            hid, hh, ww, t = native.encode_deepstack(img.unsqueeze(0))
            alone.append(native.deepstack(t, hh, ww))
    for j, feature in enumerate(packed):
        expected = torch.cat([a[j][0] for a in alone])
        assert rel_l2(feature[0], expected) < 1e-6


# --- limits --------------------------------------------------------------------------------------

def test_taps_outside_the_tower_or_twice_are_refused():
    bad = tiny()
    bad.deepstack_visual_indexes = [0, 3]
    with pytest.raises(ValueError, match=r"name layers \[3\] outside the tower's 3 layers"):
        native_qwen.build_native(bad)
    assert qwen_cases.config_problems(bad)
    bad.deepstack_visual_indexes = [1, 1]
    assert any("tap a layer twice" in m for m in qwen_cases.config_problems(bad))


def test_check_under_pipeline_parallelism_is_refused_in_one_line():
    problems = qwen_cases.pipeline_problems(tiny(), 2)
    assert len(problems) == 1 and "--pp 2" in problems[0] and "\n" not in problems[0]
    assert qwen_cases.pipeline_problems(tiny(), 1) == []


# --- negative controls ---------------------------------------------------------------------------

def _bump(key, index=(0, 0), by=0.5):
    def mutate(state):
        state[key] = state[key].clone()
        state[key][index] += by
    return mutate


@pytest.mark.parametrize("mutate, module, failing", [
    # Merger 1 serves layer 0, whose feature is deepstack_0.
    (_bump("deepstack_merger_list.1.linear_fc2.weight"), "deepstack_merger_list.1.linear_fc2", {"deepstack_0"}),
    (_bump("deepstack_merger_list.0.patch_norm.weight", (5,)), "deepstack_merger_list.0.norm", {"deepstack_1"}),
    # The last layer is tapped by neither merger: only the main outputs move.
    (_bump("decoder.layers.2.mlp.linear_fc1.bias", (3,)), "layer.2.mlp", {"last_hidden_state", "pooler_output"}),
])
def test_negative_controls_fail_and_name_the_module(mutate, module, failing):
    report = harness.check(FAMILY, seed=2, mutate_native=mutate, components=False)
    failures = report.failures()
    assert failures and {r.first_divergence.module for r in failures} == {module}
    assert {r.check.split(":")[1] for r in failures} == failing


# --- convert on disk -----------------------------------------------------------------------------

def _run(*argv) -> int:
    from mmparity.cli.main import main

    return main([str(a) for a in argv])


def _same(back, src) -> None:
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    expected, got = load_safetensors_state_dict(src), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@pytest.fixture(scope="module")
def tower_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl_tower")
    model = fam().build_reference(tiny())
    model.load_state_dict(random_like_state(model.state_dict(), seed=7))
    model.save_pretrained(path, max_shard_size="20KB")
    return path


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_convert_round_trips_are_bit_exact(tower_dir, tmp_path, fmt, tp, pp):
    from mmparity.io.verify import verify

    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert _run("convert", "--src", tower_dir, "--dst", mcore, "--to", "mcore", "--tp", tp, "--pp", pp,
                "--format", fmt, "--quiet") == 0
    assert verify(mcore).ok
    assert _run("convert", "--src", mcore, "--dst", back, "--to", "hf", "--quiet") == 0
    _same(back, tower_dir)


def test_whole_model_saved_by_transformers_converts_its_tower_and_says_what_it_left_out(tmp_path, capsys):
    """Asked for the tower family, a whole checkpoint converts its tower, names the language model
    it leaves out, and exports the tower (detection alone gives it the whole family)."""
    from transformers import Qwen3VLForConditionalGeneration

    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    model = Qwen3VLForConditionalGeneration(_whole_config(tiny()))
    model.load_state_dict(random_like_state(model.state_dict(), seed=8))
    model.save_pretrained(tmp_path / "hf")
    assert _run("convert", "--family", FAMILY, "--src", tmp_path / "hf", "--dst", tmp_path / "mcore",
                "--to", "mcore", "--tp", 2, "--pp", 2, "--format", "legacy") == 0
    said = capsys.readouterr()
    assert "left out 14 of 71 source tensors" in said.out + said.err
    assert _run("convert", "--src", tmp_path / "mcore", "--dst", tmp_path / "back", "--to", "hf",
                "--base", tmp_path / "hf", "--quiet") == 0
    whole, back = load_safetensors_state_dict(tmp_path / "hf"), load_safetensors_state_dict(tmp_path / "back")
    assert sorted(back) == sorted(k for k in whole if k.startswith("model.visual."))
    assert all(torch.equal(back[k], whole[k]) for k in back)
