"""Kimi-K2.5 whole (``kimi_k25_vl``): MoonViT + projector + a DeepSeek-V3 decoder (MLA, a leading
dense layer, routed experts with a shared expert), against transformers'
``Kimi_K25ForConditionalGeneration``; router agreement and its negative controls; the release
layout, multi-token-prediction layers and expert parallelism."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state
from mmparity.parallel import ep as ep_mod
from mmparity.parallel import pp as pp_mod
from mmparity.parallel.axes import AxisError, expert_axis
from mmparity.mapping.rules import ConversionError, convert_mcore_to_hf
from mmparity.parity import harness, router
from mmparity.models.kimi_k25_vl import reference

FAMILY = "kimi_k25_vl"
LAYER = "language_model.decoder.layers.{}"


@pytest.fixture(scope="module")
def fam():
    return families.get(FAMILY)


def _routers(result) -> dict:
    return {m["module"]: m["metrics"]["router"] for m in result.modules if router.is_router(m["module"])}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_whole_model_parity_and_router_agreement(dtype):
    report = harness.check(FAMILY, dtype=dtype, seed=4)
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
    for result in report.results:
        routers = _routers(result)
        assert set(routers) == {LAYER.format(i) + ".mlp.router" for i in (1, 2)}
        for verdict in routers.values():
            assert verdict["tokens"] == 32 and verdict["disagreements"] == 0
            if dtype == "float32":
                assert verdict["fraction"] == 1.0
        names = {m["module"] for m in result.modules}
        # Every part of a MoE layer is paired, so a fault is located inside the layer.
        assert {LAYER.format(2) + s for s in (".self_attention", ".mlp.shared_experts", ".mlp.experts")} <= names


@pytest.mark.parametrize("tp,pp,ep", [pytest.param(2, 1, 1, marks=pytest.mark.slow),
                                      pytest.param(1, 1, 2, marks=pytest.mark.slow), pytest.param(2, 1, 2, marks=pytest.mark.slow),
                                      pytest.param(1, 2, 2, marks=pytest.mark.slow)])
def test_parity_across_tensor_pipeline_and_expert_ranks(tp, pp, ep):
    report = harness.check(FAMILY, seed=1, tp=tp, pp=pp, ep=ep, components=False)
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
    assert all(r.metrics["rel_l2"] <= 1e-5 for r in report.results)


def test_expert_parallel_size_that_does_not_divide_the_experts_is_refused():
    with pytest.raises(harness.InputError, match="--ep 4 does not divide the 6 experts"):
        harness.check(FAMILY, ep=4, components=False)


# --- negative controls: each names the part of the MoE layer it breaks ------------------------------

def _swap_experts(state, layer=1, a=0, b=3):
    for fc in ("linear_fc1", "linear_fc2"):
        root = LAYER.format(layer) + f".mlp.experts.{fc}.weight"
        state[root + str(a)], state[root + str(b)] = state[root + str(b)], state[root + str(a)]


def _bias_router(state, layer=2):
    key = LAYER.format(layer) + ".mlp.router.expert_bias"
    state[key] = state[key].clone()
    state[key][torch.argmin(state[key])] += 1.0  # a sigmoid score is at most 1: now always chosen


def _drop_shared_expert(state, layer=1):
    key = LAYER.format(layer) + ".mlp.shared_experts.linear_fc2.weight"
    state[key] = torch.zeros_like(state[key])


@pytest.mark.parametrize("mutate,part", [
    (_swap_experts, LAYER.format(1) + ".mlp.experts"),
    (_bias_router, LAYER.format(2) + ".mlp.router"),
    (_drop_shared_expert, LAYER.format(1) + ".mlp.shared_experts"),
])
def test_negative_controls_name_the_part_of_the_moe_layer(mutate, part):
    report = harness.check(FAMILY, seed=2, mutate_native=mutate, components=False)
    assert not report.passed
    assert {r.first_divergence.module for r in report.failures()} == {part}
    if part.endswith("router"):
        verdict = _routers(report.results[0])[part]
        assert verdict["disagreements"] > 0 and verdict["worst_gap"] > verdict["tie_tolerance"]


def test_router_agreement_tells_a_tie_from_a_disagreement():
    scores = torch.tensor([[0.9, 0.5, 0.5, 0.1], [0.9, 0.6, 0.4, 0.1]])
    hf = torch.tensor([[0.6, 0.4, 0.0, 0.0], [0.6, 0.4, 0.0, 0.0]])
    other = torch.tensor([[0.6, 0.0, 0.4, 0.0], [0.6, 0.0, 0.4, 0.0]])
    expected = router.routing_tensor(hf, scores)
    verdict, same = router.agreement(router.routing_tensor(other), expected, torch.float32)
    # Token 0 picked expert 2 over the equally scored expert 1: a tie. Token 1 did not.
    assert same.tolist() == [False, False]
    assert (verdict.ties, verdict.passed) == (1, False)
    assert verdict.worst_gap == pytest.approx(0.2)
    tie_only = router.agreement(router.routing_tensor(other[:1]), expected[:1], torch.float32)[0]
    assert tie_only.passed and tie_only.fraction == 0.0


def test_a_tie_deep_in_a_low_precision_model_is_what_hfs_own_rounding_moves_there():
    # Token 1's gap (0.2) is far beyond bf16's own 8 ulps, but HF's bf16 model moved that layer's
    # scores by up to 0.15 against its float32 run: twice that closes the gap, so it is a tie.
    scores = torch.tensor([[0.9, 0.6, 0.4, 0.1], [0.9, 0.6, 0.4, 0.1]])
    hf = torch.tensor([[0.6, 0.4, 0.0, 0.0], [0.6, 0.4, 0.0, 0.0]])
    other = torch.tensor([[0.6, 0.4, 0.0, 0.0], [0.6, 0.0, 0.4, 0.0]])
    expected = router.routing_tensor(hf, scores)
    alone, _ = router.agreement(router.routing_tensor(other), expected, torch.bfloat16)
    assert (alone.ties, alone.disagreements) == (0, 1)
    hf_bf16 = router.routing_tensor(hf, scores + torch.tensor([[0.0, 0.15, 0.0, 0.0], [0.0, -0.05, 0.0, 0.0]]))
    deep, _ = router.agreement(router.routing_tensor(other), expected, torch.bfloat16, hf_bf16)
    assert (deep.ties, deep.disagreements, deep.tie_tolerance) == (1, 0, pytest.approx(0.3))
    # HF's own scores barely moving leaves the dtype's own rounding as the measure.
    still, _ = router.agreement(router.routing_tensor(other), expected, torch.bfloat16, expected)
    assert still.disagreements == 1 and still.tie_tolerance == router.tie_tolerance(torch.bfloat16)


# --- layouts ---------------------------------------------------------------------------------------

def test_release_layout_holds_each_expert_as_the_stacked_tensors_slice(fam):
    cfg = fam.tiny_config()
    model = fam.build_reference(cfg)
    state = random_like_state(model.state_dict(), seed=9)
    shards = fam.hf_to_mcore(state, cfg, hf_format="hf")
    release = convert_mcore_to_hf(fam.rule_set(cfg, "release"), shards)
    width = cfg.text_config.moe_intermediate_size
    for layer in (1, 2):
        stacked = state[f"model.language_model.layers.{layer}.mlp.experts.gate_up_proj"]
        down = state[f"model.language_model.layers.{layer}.mlp.experts.down_proj"]
        for e in range(cfg.text_config.n_routed_experts):
            root = f"language_model.model.layers.{layer}.mlp.experts.{e}."
            assert torch.equal(release[root + "gate_proj.weight"], stacked[e, :width])
            assert torch.equal(release[root + "up_proj.weight"], stacked[e, width:])
            assert torch.equal(release[root + "down_proj.weight"], down[e])
    assert torch.equal(release["language_model.lm_head.weight"], state["lm_head.weight"])
    again = fam.hf_to_mcore(release, cfg)  # the layout is detected from the keys
    assert sorted(again[0]) == sorted(shards[0])
    assert all(torch.equal(again[0][k], shards[0][k]) for k in shards[0])


def test_what_transformers_saves_is_read_through_its_own_mapping(fam, tmp_path):
    """The decoder as ``language_model.model.blocks.N``: no table of the family takes these keys,
    transformers' conversion mapping reads them all (tests/io/test_saved_layouts.py converts them)."""
    cfg = fam.tiny_config()
    model = fam.build_reference(cfg)
    model.save_pretrained(tmp_path)
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    saved = load_safetensors_state_dict(tmp_path)
    assert any(k.startswith("language_model.model.blocks.") for k in saved)
    assert fam.rule_set(cfg, keys=saved).hf_format == "transformers"
    assert fam.rule_set(cfg, keys=model.state_dict()).hf_format == "hf"


def _mtp_release(fam, tmp_path):
    """A release directory whose decoder stores one multi-token-prediction layer after its three."""
    from mmparity.io.fsio.safetensors_write import save_safetensors_checkpoint

    cfg = reference.tiny_config(num_nextn_predict_layers=1)
    model = fam.build_reference(cfg)
    state = random_like_state(model.state_dict(), seed=5)
    release = convert_mcore_to_hf(fam.rule_set(cfg, "release"), fam.hf_to_mcore(state, cfg, hf_format="hf"))
    mtp = {k.replace("layers.2.", "layers.3."): v.clone() for k, v in release.items()
           if k.startswith("language_model.model.layers.2.")}
    mtp["language_model.model.layers.3.enorm.weight"] = torch.ones(cfg.text_config.hidden_size)
    src = tmp_path / "release"
    save_safetensors_checkpoint(src, {**release, **mtp}, extra_files={"config.json": cfg.to_json_string()})
    return src, release, mtp


def test_multi_token_prediction_layers_are_dropped_and_reported(fam, tmp_path, capsys):
    from mmparity.cli.main import main
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    src, release, mtp = _mtp_release(fam, tmp_path)
    assert main(["convert", "--src", str(src), "--dst", str(tmp_path / "mcore"), "--to", "mcore",
                 "--format", "legacy", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert f"left out {len(mtp)} of {len(release) + len(mtp)} source tensors" in out, out
    assert main(["convert", "--src", str(tmp_path / "mcore"), "--dst", str(tmp_path / "back"), "--to", "hf",
                 "--hf-format", "release", "--quiet"]) == 0
    back = load_safetensors_state_dict(tmp_path / "back")
    assert sorted(back) == sorted(release)
    assert all(torch.equal(back[k], release[k]) for k in release)


def test_whole_checkpoint_is_detected_as_the_whole_family(fam, tmp_path):
    from mmparity.convert.configs import detect_family

    (tmp_path / "config.json").write_text(json.dumps(fam.tiny_config().to_dict() | {
        "architectures": ["Kimi_K25ForConditionalGeneration"]}))
    detection = detect_family(tmp_path)
    assert (detection.family, detection.whole) == (FAMILY, True)


# --- conversion over TP x EP, in memory -------------------------------------------------------------

@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_over_tensor_pipeline_and_expert_ranks_is_bit_exact(fam, data):
    cfg = fam.hooks.config.random(lambda options: data.draw(st.sampled_from(list(options))))
    text = cfg.text_config
    model_state = random_like_state(fam.build_reference(cfg).state_dict(), seed=data.draw(st.integers(0, 99)))
    tp = data.draw(st.sampled_from([t for t in (1, 2) if not fam.converter.rules(cfg, "hf").validate_tp(t)]))
    ep = data.draw(st.sampled_from([1, 2, 3, 4]))
    shards = fam.hf_to_mcore(model_state, cfg, tp_size=tp, hf_format="hf")
    experts = text.n_routed_experts
    if experts % ep:
        with pytest.raises(AxisError, match=f"--ep {ep} does not divide the {experts} experts"):
            ep_mod.split_expert_ranks(shards[0], expert_axis(ep), experts)
        return
    pp = data.draw(st.sampled_from([1, 2]))
    layout = pp_mod.pipeline_layout(list(shards[0]))
    counts = layout.layer_counts(pp)
    merged = []
    for shard in shards:
        # Each (TP, PP) rank's file holds its stage's layers, each EP rank's its local experts.
        stages = pp_mod.split_pipeline_stages(shard, counts, layer_prefix=layout.layer_prefix,
                                              last_stage_prefixes=layout.last_stage_keys)
        per_stage = [ep_mod.split_expert_ranks(stage, expert_axis(ep), experts) for stage in stages]
        for per_ep in per_stage:  # local numbering: every EP rank holds experts 0 .. E/ep - 1
            assert all(ep_mod.expert_count(list(s)) in (0, experts // ep) for s in per_ep)
        back_stages = [ep_mod.merge_expert_ranks(per_ep, experts) for per_ep in per_stage]
        merged.append(pp_mod.merge_pipeline_stages(back_stages, counts, layer_prefix=layout.layer_prefix)
                      if pp > 1 else back_stages[0])
    back = fam.mcore_to_hf(type(shards)(merged, shards.side, shards.unused), cfg, hf_format="hf")
    assert sorted(back) == sorted(model_state)
    assert all(torch.equal(back[k], model_state[k]) for k in model_state)


def test_sequential_expert_layout_writes_local_experts_and_reads_back_bit_exact(fam, tmp_path):
    """``--expert-layout sequential``: SequentialMLP's names in every EP rank file, locally
    numbered; the checkpoint converts back to the same HF tensors."""
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
    from mmparity.io.legacy import load_rank_file, open_legacy
    from mmparity.cli.main import main
    from tests.mapping.test_convert_roundtrips import save_hf

    src = save_hf(FAMILY, tmp_path / "hf", seed=3)
    mcore = tmp_path / "mcore"
    assert main(["convert", "--src", str(src), "--dst", str(mcore), "--to", "mcore", "--format", "legacy",
                 "--tp", "2", "--ep", "2", "--expert-layout", "sequential", "--quiet"]) == 0
    checkpoint = open_legacy(mcore)
    for (tp, pp, ep), path in checkpoint.files.items():
        keys = load_rank_file(path).keys()
        experts = sorted({k.split("local_experts.")[1].split(".")[0] for k in keys if ".local_experts." in k})
        assert experts == ["0", "1", "2"], (tp, ep, experts)
        assert not any(".mlp.experts.linear_fc" in k for k in keys)
    assert main(["convert", "--src", str(mcore), "--dst", str(tmp_path / "back"), "--to", "hf", "--quiet"]) == 0
    expected, got = load_safetensors_state_dict(src), load_safetensors_state_dict(tmp_path / "back")
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
