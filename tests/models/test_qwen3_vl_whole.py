"""Qwen3-VL whole: detection and check on what save_pretrained writes, M-RoPE positions and angles
against transformers' own, DeepStack injection, conversion round trips, negative controls."""

from __future__ import annotations

import pytest
import torch

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state
from mmparity.models.qwen3_vl_whole import cases as whole_cases
from mmparity.models.qwen3_vl_whole import native as whole_native
from mmparity.models.qwen3_vl_whole import reference as whole_reference
from mmparity.parity import harness

FAMILY = "qwen3_vl_whole"


def fam():
    return families.get(FAMILY)


def _run(*argv) -> int:
    from mmparity.cli.main import main

    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Qwen3VLForConditionalGeneration with seeded weights, as save_pretrained writes it."""
    path = tmp_path_factory.mktemp("qwen3_vl_whole") / "hf"
    model = fam().build_reference(fam().tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=3))
    model.save_pretrained(path, max_shard_size="40KB")
    return path


def test_check_without_family_detects_the_whole_model_and_passes(saved, capsys):
    assert _run("check", "--hf", saved) == 0
    said = capsys.readouterr()
    assert "family: qwen3_vl_whole" in said.out + said.err


def test_bf16_within_policy():
    report = harness.check(FAMILY, dtype="bfloat16", seed=1)
    assert report.passed, [(r.check, r.metrics, r.tolerance) for r in report.failures()]


def test_position_ids_are_transformers_get_rope_index():
    cfg = fam().tiny_config()
    model = fam().build_reference(cfg)
    case = whole_cases.cases(cfg, seed=4)[0]
    ids = case.data["input_ids"]
    p = case.data["patch"]
    grids = [(h // p, w // p) for h, w in case.data["sizes"]]
    expected, _ = model.model.get_rope_index(ids, (ids == cfg.image_token_id).int(),
                                             image_grid_thw=torch.tensor([[1, h, w] for h, w in grids]))
    got = whole_native.mrope_position_ids(ids, cfg.image_token_id, grids, case.data["merge"])
    assert torch.equal(got, expected)
    # Not the plain 1D positions: the images make h and w differ, and the second row's 2x4
    # image advances the text after it by 4 positions for its 8 tokens.
    assert not torch.equal(got[1], got[2]) and got[0, 1, -1] < ids.shape[1] - 1


@pytest.mark.parametrize("section", [[2, 2, 2], [4, 1, 1], [1, 3, 2]])
def test_interleaved_mrope_angles_are_transformers(section):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    cfg = whole_reference.tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                             "mrope_section": section, "mrope_interleaved": True})
    text = cfg.text_config
    gen = torch.Generator().manual_seed(sum(section))
    positions = torch.randint(0, 50, (3, 2, 7), generator=gen)
    cos, sin = Qwen3VLTextRotaryEmbedding(text)(torch.zeros(1, dtype=torch.float32), positions)
    angles = whole_native.InterleavedMRoPE(text.head_dim, 5000.0)(positions, section)  # [s, b, 1, d]
    angles = angles[:, :, 0].transpose(0, 1)
    assert torch.allclose(angles.cos(), cos, atol=1e-6) and torch.allclose(angles.sin(), sin, atol=1e-6)


def _bump(key, index=(0, 0), by=0.5):
    def mutate(state):
        state[key] = state[key].clone()
        state[key][index] += by
    return mutate


@pytest.mark.parametrize("mutate, module", [
    (_bump("vision_model.deepstack_merger_list.1.linear_fc2.weight"), "vision_model.deepstack_merger_list.1.linear_fc2"),
    (_bump("language_model.decoder.layers.1.self_attention.q_layernorm.weight", (3,)),
     "language_model.decoder.layers.1.self_attention"),
    (_bump("language_model.decoder.layers.2.mlp.linear_fc2.weight"), "language_model.decoder.layers.2.mlp"),
])
def test_negative_controls_fail_and_name_the_part(mutate, module):
    report = harness.check(FAMILY, seed=2, mutate_native=mutate)
    failures = report.failures()
    assert failures and {r.first_divergence.module for r in failures} == {module}


def test_deepstack_features_reach_the_decoder(monkeypatch):
    """Without the injection the native model is another function: the check fails, first at the
    first module that reads the output the first feature is added to (the next layer's input norm)."""
    monkeypatch.setattr(whole_native.Qwen3VLModel, "_inject", lambda self, features, image: [])
    report = harness.check(FAMILY, seed=2)
    assert not report.passed
    assert {r.first_divergence.module for r in report.failures()} == {"language_model.decoder.layers.1.input_layernorm"}


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_convert_tp2_pp2_round_trip_of_what_save_pretrained_wrote_is_bit_exact(saved, tmp_path, fmt):
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
    from mmparity.io.verify import verify

    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert _run("convert", "--src", saved, "--dst", mcore, "--to", "mcore", "--tp", 2, "--pp", 2,
                "--format", fmt, "--quiet") == 0
    assert verify(mcore).ok
    assert _run("convert", "--src", mcore, "--dst", back, "--to", "hf", "--quiet") == 0
    expected, got = load_safetensors_state_dict(saved), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())


def test_pipeline_parallel_check_is_refused_only_where_the_features_leave_the_first_stage():
    cfg = fam().tiny_config()  # 3 decoder layers, 2 DeepStack features
    assert whole_cases.pipeline_problems(cfg, 2) == []  # [2, 1]: layers 0 and 1 on the first stage
    problems = whole_cases.pipeline_problems(cfg, 3)  # [1, 1, 1]
    assert len(problems) == 1 and "--pp 3" in problems[0] and "\n" not in problems[0]


@pytest.mark.slow
def test_check_pp2_passes():
    from mmparity.parallel import runtime

    report = runtime.spawn(_pp2, 2, None)[0]
    assert report.passed and (report.tp, report.pp) == (1, 2)


def _pp2(rank: int, world_size: int, _):
    report = harness.check(FAMILY, pp=2, seed=5)
    return report if rank == 0 else None
