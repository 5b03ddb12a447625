"""Qwen2.5-VL whole: detection and check on what save_pretrained writes (fp32, bf16), M-RoPE
positions and contiguous-section angles against transformers' own, sub-layer pairs, negative
controls, conversion round trips at TP 2 x PP 2 in both formats."""

from __future__ import annotations

import pytest
import torch

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state
from mmparity.models.qwen2_5_vl_whole import cases as whole_cases
from mmparity.models.qwen2_5_vl_whole import native as whole_native
from mmparity.models.qwen2_5_vl_whole import reference as whole_reference
from mmparity.models.qwen3_vl_whole.native import mrope_position_ids
from mmparity.parity import harness
from tests.hf_roundtrip import assert_round_trip

FAMILY = "qwen2_5_vl_whole"


def fam():
    return families.get(FAMILY)


def _run(*argv) -> int:
    from mmparity.cli.main import main

    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Qwen2_5_VLForConditionalGeneration with seeded weights, as save_pretrained writes it."""
    path = tmp_path_factory.mktemp("qwen2_5_vl_whole") / "hf"
    model = fam().build_reference(fam().tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=3))
    model.save_pretrained(path, max_shard_size="40KB")
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_without_family_detects_the_whole_model_and_passes(saved, capsys, dtype):
    assert _run("check", "--hf", saved, "--dtype", dtype) == 0
    said = capsys.readouterr()
    assert "family: qwen2_5_vl_whole" in said.out + said.err


def test_logits_at_every_position_and_the_loss_are_compared_with_sub_layer_pairs():
    cfg = fam().tiny_config()
    case = whole_cases.cases(cfg, seed=0)[0]
    assert case.outputs == ("logits", "token_loss")
    names = [p.name for p in whole_cases.reference_pairs(fam().build_reference(cfg), cfg)]
    for sub in ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp"):
        assert f"language_model.decoder.layers.2.{sub}" in names
    assert "vision_model.layer.1.self_attention" in names and "vision_model.merger.linear_fc2" in names
    report = harness.check(FAMILY, seed=0)
    assert report.passed and {r.check for r in report.results} == {
        f"{case}:{output}" for case in ("sample", "video") for output in ("logits", "token_loss")}
    assert all(r.metrics["rel_l2"] <= 1e-5 for r in report.results)


def test_position_ids_are_transformers_get_rope_index():
    cfg = fam().tiny_config()
    model = fam().build_reference(cfg)
    case = whole_cases.cases(cfg, seed=4)[0]
    ids = case.data["input_ids"]
    p = case.data["patch"]
    grids = [(h // p, w // p) for h, w in case.data["sizes"]]
    expected, _ = model.model.get_rope_index(ids, (ids == cfg.image_token_id).int(),
                                             image_grid_thw=torch.tensor([[1, h, w] for h, w in grids]))
    got = mrope_position_ids(ids, cfg.image_token_id, grids, case.data["merge"])
    assert torch.equal(got, expected)
    assert not torch.equal(got[1], got[2])


@pytest.mark.parametrize("section", [[1, 2, 2], [3, 1, 1], [2, 0, 3]])
def test_sectioned_mrope_angles_are_transformers(section):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    cfg = whole_reference.tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                       "mrope_section": section})
    text = cfg.text_config
    gen = torch.Generator().manual_seed(sum(section) + section[0])
    positions = torch.randint(0, 50, (3, 2, 7), generator=gen)
    cos, sin = Qwen2_5_VLRotaryEmbedding(text)(torch.zeros(1, dtype=torch.float32), positions)
    angles = whole_native.SectionedMRoPE(10, 5000.0)(positions, section)[:, :, 0].transpose(0, 1)
    assert torch.allclose(angles.cos(), cos, atol=1e-6) and torch.allclose(angles.sin(), sin, atol=1e-6)


def test_mrope_sections_that_miss_the_head_are_refused():
    cfg = whole_reference.tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                       "mrope_section": [2, 2, 2]})
    problems = whole_cases.config_problems(cfg)
    assert len(problems) == 1 and "mrope_section [2, 2, 2]" in problems[0]


def _bump(key, index=(0, 0), by=0.5):
    def mutate(state):
        state[key] = state[key].clone()
        state[key][index] += by
    return mutate


@pytest.mark.parametrize("mutate, module", [
    (_bump("vision_model.decoder.layers.0.self_attention.linear_qkv.weight", (7, 3)),
     "vision_model.layer.0.self_attention"),
    (_bump("language_model.decoder.layers.1.self_attention.linear_qkv.bias", (3,)),
     "language_model.decoder.layers.1.self_attention"),
    (_bump("language_model.decoder.layers.2.mlp.linear_fc2.weight"), "language_model.decoder.layers.2.mlp"),
])
def test_negative_controls_fail_and_name_the_part(mutate, module):
    report = harness.check(FAMILY, seed=2, mutate_native=mutate)
    failures = report.failures()
    assert failures and {r.first_divergence.module for r in failures} == {module}


def test_swapped_mrope_sections_are_located_at_the_first_attention(monkeypatch):
    """The M-RoPE split matters: Qwen3-VL's interleaved assignment of the same sections is another
    function, named at the first decoder layer's attention."""
    from mmparity.models.qwen3_vl_whole.native import InterleavedMRoPE

    monkeypatch.setattr(whole_native.SectionedMRoPE, "axes", staticmethod(InterleavedMRoPE.axes))
    report = harness.check(FAMILY, seed=2)
    assert {r.first_divergence.module for r in report.failures()} == {"language_model.decoder.layers.0.self_attention"}


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_convert_tp2_pp2_verify_and_back_with_base_is_bit_exact(saved, tmp_path, fmt):
    assert_round_trip(saved, tmp_path, "--tp", 2, "--pp", 2, fmt=fmt, check=False)


@pytest.mark.slow
def test_check_pp2_passes():
    from mmparity.parallel import runtime

    report = runtime.spawn(_pp2, 2, None)[0]
    assert report.passed and (report.tp, report.pp) == (1, 2)


def _pp2(rank: int, world_size: int, _):
    report = harness.check(FAMILY, pp=2, seed=5)
    return report if rank == 0 else None
