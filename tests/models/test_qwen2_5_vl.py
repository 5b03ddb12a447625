"""Qwen2.5-VL vision tower: window order against transformers', parity with window attention
(fp32, bf16, mixed sizes with partial windows), conversion, negative controls in a window block
and in a full-attention block, round trips on disk."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state
from mmparity.models.qwen2_5_vl import cases as tower_cases
from mmparity.models.qwen2_5_vl import native as tower_native
from mmparity.models.qwen2_5_vl import reference as tower_reference
from mmparity.parity import harness
from tests.strategies import family_configs, tp_sizes

FAMILY = "qwen2_5_vl"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fam():
    return families.get(FAMILY)


def tiny():
    return fam().tiny_config()


def _whole_config(vision):
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(vision_config=vision.to_dict(), text_config=dict(
        hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}))


# --- the window order ----------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(grids=st.lists(st.tuples(st.integers(1, 7), st.integers(1, 7)), min_size=1, max_size=4),
       merge=st.sampled_from([1, 2]), side=st.integers(1, 4), patch=st.sampled_from([2, 3]))
def test_window_order_and_boundaries_are_transformers(grids, merge, side, patch):
    from transformers.vision_utils import get_vision_window_index

    grids = [(h * merge, w * merge) for h, w in grids]
    expected, cu = get_vision_window_index(torch.tensor([[1, h, w] for h, w in grids]), merge,
                                           side * merge * patch, patch)
    order, lengths = tower_native.window_order(grids, merge, side)
    assert torch.equal(order, expected)
    assert torch.equal(torch.tensor([0] + lengths).cumsum(0) * merge * merge, cu.long())


def test_default_sizes_have_partial_windows():
    cfg = tiny()
    side = tower_native.window_units(cfg.window_size, cfg.patch_size, cfg.spatial_merge_size)
    step = cfg.patch_size * cfg.spatial_merge_size
    units = [(h // step, w // step) for h, w in tower_cases.default_image_sizes(cfg)]
    assert side == 2 and any(h % side or w % side for h, w in units)
    assert any(not (h % side or w % side) for h, w in units)


# --- conversion ----------------------------------------------------------------------------------

@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_round_trip_bit_exact_over_configs_tp_dtypes_and_vlm_prefixes(data):
    cfg = data.draw(family_configs(FAMILY))
    tp_size = data.draw(st.sampled_from(tp_sizes(FAMILY, cfg)))
    dtype = data.draw(st.sampled_from(DTYPES))
    prefix = data.draw(st.sampled_from(["", "visual.", "model.visual."]))
    shapes = {k: torch.empty(s) for k, s in tower_reference.state_shapes(cfg).items()}
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


def test_state_shapes_are_the_models():
    cfg = tiny()
    model = fam().build_reference(cfg)
    assert tower_reference.state_shapes(cfg) == {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tp_size", [2, 4])
def test_gate_and_up_are_split_by_halves_per_rank(tp_size):
    cfg = tiny()
    cfg.intermediate_size = 48
    sd = random_like_state(fam().build_reference(cfg).state_dict(), seed=3)
    shards = fam().hf_to_mcore(sd, cfg, tp_size=tp_size)
    part = 48 // tp_size
    for rank, shard in enumerate(shards):
        fc1 = shard["decoder.layers.1.mlp.linear_fc1.bias"]
        assert torch.equal(fc1[:part], sd["blocks.1.mlp.gate_proj.bias"][rank * part:(rank + 1) * part])
        assert torch.equal(fc1[part:], sd["blocks.1.mlp.up_proj.bias"][rank * part:(rank + 1) * part])
        assert torch.equal(shard["merger.patch_norm.weight"], sd["merger.ln_q.weight"])


def test_whole_vlm_checkpoint_reads_only_the_tower():
    from transformers import Qwen2_5_VLForConditionalGeneration

    vision = tiny()
    whole = Qwen2_5_VLForConditionalGeneration(_whole_config(vision)).state_dict()
    tower = {k[len("model.visual."):]: v for k, v in whole.items() if k.startswith("model.visual.")}
    from_whole = fam().hf_to_mcore(whole, _whole_config(vision), tp_size=2)
    from_tower = fam().hf_to_mcore(tower, vision, tp_size=2)
    for a, b in zip(from_whole, from_tower):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- parity --------------------------------------------------------------------------------------

def test_check_passes_every_case_output_and_the_window_order():
    report = harness.check(FAMILY, seed=0)
    names = {r.check for r in report.results}
    assert names == {f"{c}:{o}" for c in ("static", "packed", "processor_rows")
                     for o in ("last_hidden_state", "pooler_output")} | {"component:window_order"}
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
    assert all(r.metrics["rel_l2"] <= 1e-5 for r in report.results)


def test_bf16_within_policy_on_mixed_sizes():
    p = tiny().patch_size
    sizes = [(6 * p, 10 * p), (14 * p, 2 * p), (2 * p, 2 * p), (4 * p, 8 * p)]
    report = harness.check(FAMILY, dtype="bfloat16", seed=1, image_sizes=sizes, components=False)
    assert report.passed, [(r.check, r.metrics, r.tolerance) for r in report.failures()]


def test_without_windows_the_first_window_block_diverges(monkeypatch):
    """The windows matter on these sizes: a tower whose every block attends to the whole image
    (the tokens still in window order) is another function, named at the first block's attention."""
    original = tower_native.Qwen25VLViTModel.__init__

    def everywhere_full(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.fullatt_block_indexes = frozenset(range(self.config.num_layers))
    monkeypatch.setattr(tower_native.Qwen25VLViTModel, "__init__", everywhere_full)
    report = harness.check(FAMILY, seed=0, components=False)
    assert not report.passed
    assert {r.first_divergence.module for r in report.failures()} == {"layer.0.self_attention"}


def test_window_order_is_undone_after_the_merger():
    cfg = tiny()
    model = fam().build_native(cfg)
    p = cfg.patch_size
    sizes = [(6 * p, 10 * p), (2 * p, 4 * p)]
    rows = torch.cat([torch.randn(1, (h // p) * (w // p), 3 * p * p, generator=torch.Generator().manual_seed(i))
                      for i, (h, w) in enumerate(sizes)], dim=1)
    with torch.no_grad():
        hidden, grids, order, _ = model.encode(rows, imgs_sizes=sizes)
        tokens, _ = model.features(rows, imgs_sizes=sizes)
        grouped = model.merger.encoder_tokens(hidden, [h for h, _ in grids], [w for _, w in grids])
    assert not torch.equal(order, torch.arange(order.numel()))
    assert torch.equal(tokens[0, order], grouped[0])


def test_window_smaller_than_a_merge_unit_is_refused():
    bad = tiny()
    bad.window_size = 9
    problems = tower_cases.config_problems(bad)
    assert len(problems) == 1 and "window_size=9" in problems[0]
    with pytest.raises(ValueError, match="window_size=9"):
        tower_native.build_native(bad)


# --- negative controls ---------------------------------------------------------------------------

def _bump(key, index=(0, 0), by=0.5):
    def mutate(state):
        state[key] = state[key].clone()
        state[key][index] += by
    return mutate


@pytest.mark.parametrize("mutate, module", [
    # Layer 0 attends inside windows, layer 1 over whole images (fullatt_block_indexes = [1]).
    (_bump("decoder.layers.0.self_attention.linear_qkv.weight", (7, 3)), "layer.0.self_attention"),
    (_bump("decoder.layers.1.self_attention.linear_qkv.weight", (7, 3)), "layer.1.self_attention"),
    (_bump("decoder.layers.2.mlp.linear_fc1.bias", (3,)), "layer.2.mlp"),
    (_bump("merger.patch_norm.weight", (5,)), "merger.norm"),
])
def test_negative_controls_fail_and_name_the_module(mutate, module):
    report = harness.check(FAMILY, seed=2, mutate_native=mutate, components=False)
    failures = report.failures()
    assert failures and {r.first_divergence.module for r in failures} == {module}


# --- convert on disk -----------------------------------------------------------------------------

def _run(*argv) -> int:
    from mmparity.cli.main import main

    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def tower_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl_tower")
    model = fam().build_reference(tiny())
    model.load_state_dict(random_like_state(model.state_dict(), seed=7))
    model.save_pretrained(path, max_shard_size="20KB")
    return path


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_convert_round_trips_are_bit_exact(tower_dir, tmp_path, fmt, tp, pp):
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
    from mmparity.io.verify import verify

    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert _run("convert", "--src", tower_dir, "--dst", mcore, "--to", "mcore", "--tp", tp, "--pp", pp,
                "--format", fmt, "--quiet") == 0
    assert verify(mcore).ok
    assert _run("convert", "--src", mcore, "--dst", back, "--to", "hf", "--quiet") == 0
    expected, got = load_safetensors_state_dict(tower_dir), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())
