"""Gemma 4 with the MoE block (``enable_moe_block``, the 26B-A4B layout) on a tiny whole model saved
by transformers: 4 experts (EP 2 divides them), top-2, experts 10 wide (TP 2 divides, nothing else
does), a vocabulary of 97 that needs padding, three images of different sizes. It is told and
passes ``check --hf`` with no family in fp32 and bf16 with router agreement per layer; a perturbed
expert, router weight or per-expert scale is named by part; the experts round-trip through
convert -> verify -> convert --to hf --base bit for bit at TP 2 x PP 2 x EP 2 in both formats, read
and written back stacked as transformers saves them; Megatron's GPTModel holds the block
(``TEGroupedMLP`` experts), loads it strictly and passes ``check --impl megatron``."""

from __future__ import annotations

import pytest
import torch

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state
from mmparity.models.gemma4 import reference
from mmparity.parity import harness, router
from tests.hf_roundtrip import bump as _bump
from tests.hf_roundtrip import run_cli as _run

MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=10)
LAYER = "language_model.decoder.layers.{}"


def tiny_moe():
    return reference.tiny_config(**MOE)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny MoE Gemma4ForConditionalGeneration with seeded weights, as save_pretrained writes it (sharded)."""
    path = tmp_path_factory.mktemp("gemma4_moe") / "hf"
    model = families.get("gemma4").build_reference(tiny_moe())
    model.load_state_dict(random_like_state(model.state_dict(), seed=3))
    model.save_pretrained(path, max_shard_size="60KB")
    return path


def test_transformers_saves_the_experts_stacked(saved):
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    state = load_safetensors_state_dict(saved)
    layer = "model.language_model.layers.1."
    assert state[layer + "experts.gate_up_proj"].shape == (4, 20, 40)
    assert state[layer + "experts.down_proj"].shape == (4, 40, 10)
    assert state[layer + "router.per_expert_scale"].shape == (4,)
    assert not any(".experts.0." in k for k in state)


def test_reference_shapes_are_what_transformers_builds():
    from mmparity.models.parts.gemma4_text import reference as decoder

    cfg = tiny_moe()
    model = families.get("gemma4").build_reference(cfg)
    root = "model.language_model."
    state = {k[len(root):]: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith(root)}
    assert state == decoder.decoder_shapes(cfg.text_config)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_without_family_passes_with_router_agreement(saved, capsys, dtype):
    assert _run("check", "--hf", saved, "--dtype", dtype) == 0
    said = capsys.readouterr()
    out = said.out + said.err
    assert "family: gemma4 " in out and "router" in out, out


def test_every_layer_routes_every_token_as_transformers_does():
    report = harness.check("gemma4", cfg=tiny_moe(), seed=2)
    assert report.passed
    (case,) = [r for r in report.results if r.check.endswith(":logits")]
    routers = {m["module"]: m["metrics"]["router"] for m in case.modules if router.is_router(m["module"])}
    assert sorted(routers) == [LAYER.format(i) + ".mlp.router" for i in range(2)]
    assert all(r["disagreements"] == 0 and r["tokens"] == 30 for r in routers.values())
    # Each part of the block is paired on its own, before the block's sum.
    names = [m["module"] for m in case.modules]
    block = [LAYER.format(0) + s for s in (".pre_mlp_layernorm", ".mlp.router", ".mlp.shared_experts",
                                            ".mlp.experts", ".mlp")]
    assert [n for n in names if n in block] == block


@pytest.mark.parametrize("mutate, module", [
    # One expert's gate row, and one of its down-projection entries.
    (_bump(LAYER.format(0) + ".mlp.experts.linear_fc1.weight1", (3, 4)), LAYER.format(0) + ".mlp.experts"),
    (_bump(LAYER.format(1) + ".mlp.experts.linear_fc2.weight2", (5, 7)), LAYER.format(1) + ".mlp.experts"),
    # The router reads its input scaled down (its per-channel scale times hidden ** -0.5): a weight
    # moved far enough to send tokens elsewhere.
    (_bump(LAYER.format(0) + ".mlp.router.weight", (2, 0), by=50.0), LAYER.format(0) + ".mlp.router"),
    (_bump(LAYER.format(1) + ".mlp.router.per_expert_scale", (1,)), LAYER.format(1) + ".mlp.router"),
    (_bump(LAYER.format(0) + ".mlp.shared_experts.linear_fc1.weight", (4, 5)), LAYER.format(0) + ".mlp.shared_experts"),
    (_bump(LAYER.format(1) + ".mlp.post_layernorm.weight", (3,)), LAYER.format(1) + ".mlp"),
])
def test_negative_controls_fail_and_name_the_part(mutate, module):
    report = harness.check("gemma4", cfg=tiny_moe(), seed=2, mutate_native=mutate)
    failures = report.failures()
    assert failures and {r.first_divergence.module for r in failures} == {module}


@pytest.mark.parametrize("overrides, named", [
    ({"num_experts": 2, "top_k_experts": 3}, "top_k_experts=3 above num_experts=2"),
])
def test_a_block_that_cannot_be_built_is_refused_by_name(overrides, named):
    problems = families.get("gemma4").hooks.config.problems(reference.tiny_config(**(MOE | overrides)))
    assert len(problems) == 1 and named in problems[0]


def test_tensor_parallelism_must_divide_the_experts_width():
    from mmparity.models.parts.gemma4_text.config import tp_problems

    text = reference.tiny_config(**(MOE | {"moe_intermediate_size": 9})).text_config
    assert tp_problems(text, 2) == ["tp=2 does not divide text moe_intermediate_size=9"]


def _megatron(report) -> dict:
    return {r.check: r for r in report.results if r.impl == "megatron"}


def test_megatrons_gpt_model_holds_the_block_with_grouped_gemm_experts():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from mmparity.models.core import megatron_classes as models
    from mmparity.models.registry import megatron_class
    from mmparity.parallel import runtime

    with runtime.parallel_context(1, 1):
        model = models.build(megatron_class("gemma4")[1].build, tiny_moe())
    mlps = [layer.mlp for layer in model.decoder.layers]
    assert len(mlps) == 2 and all(isinstance(m, MoELayer) for m in mlps)
    assert {type(m.experts).__name__ for m in mlps} == {"TEGroupedMLP"}
    assert model.config.moe_grouped_gemm and model.config.num_moe_experts == 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_megatron_passes(dtype):
    report = harness.check("gemma4", cfg=tiny_moe(), impl="megatron", seed=5, dtype=dtype)
    assert report.passed, [(r.check, r.metrics) for r in _megatron(report).values()]


@pytest.mark.parametrize("key", ["mlp.experts.linear_fc1.weight1", "mlp.router.per_expert_scale"])
def test_a_perturbed_block_weight_in_megatrons_class_is_located_in_its_layer(key):
    def perturb(shard):
        keys = [k for k in shard if "decoder.layers.0." + key in k]
        assert keys
        for k in keys:
            shard[k] = shard[k].flip(0) * 3

    logits = _megatron(harness.check("gemma4", cfg=tiny_moe(), impl="megatron", mutate_native=perturb))["text:logits"]
    assert not logits.passed
    assert logits.first_divergence.module.startswith("language_model.decoder.layers.0"), logits.first_divergence


@pytest.mark.slow
def test_check_at_tp2_ep2_passes_with_router_agreement(saved, capsys):
    """The native model over 4 ranks, each holding half of the experts' rows of half of the experts."""
    assert _run("check", "--hf", saved, "--tp", 2, "--ep", 2) == 0
    out = capsys.readouterr().out
    assert "EP 2" in out and "60 of 60 token routings" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_convert_tp2_pp2_ep2_verify_and_back_with_base_is_bit_exact(saved, tmp_path, fmt):
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert _run("convert", "--src", saved, "--dst", mcore, "--to", "mcore", "--tp", 2, "--pp", 2, "--ep", 2,
                "--format", fmt, "--quiet") == 0
    assert _run("verify", mcore, "--quiet") == 0
    # Megatron's GPTModel loads the language model strictly, the block included.
    assert _run("verify", mcore, "--load", "--quiet") == 0
    assert _run("convert", "--src", mcore, "--dst", back, "--to", "hf", "--base", saved, "--quiet") == 0
    expected, got = load_safetensors_state_dict(saved), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())


def test_legacy_ep2_rank_files_hold_their_own_experts_and_the_block_beside_them(saved, tmp_path):
    from mmparity.io.megatron_args import read_legacy_args

    mcore = tmp_path / "mcore"
    assert _run("convert", "--src", saved, "--dst", mcore, "--to", "mcore", "--ep", 2, "--format", "legacy",
                "--quiet") == 0
    ranks = sorted((mcore / "iter_0000001").glob("mp_rank_*"))
    assert len(ranks) == 2
    mlp = LAYER.format(0) + ".mlp."
    for rank in ranks:
        state = torch.load(rank / "model_optim_rng.pt", weights_only=False)["model"]
        assert sorted(k for k in state if k.startswith(mlp + "experts.") and "_extra_state" not in k) == [
            mlp + f"experts.linear_fc{fc}.weight{e}" for fc in (1, 2) for e in (0, 1)]
        for key in ("router.weight", "router.scale", "router.per_expert_scale", "pre_experts_layernorm.weight",
                    "post_experts_layernorm.weight", "post_layernorm.weight",
                    "shared_experts.linear_fc1.layer_norm_weight", "shared_experts.linear_fc2.post_layernorm.weight"):
            assert mlp + key in state, key
    args = read_legacy_args(ranks[0] / "model_optim_rng.pt")
    assert args.num_experts == 4 and args.moe_router_topk == 2 and args.moe_ffn_hidden_size == 10
    assert args.moe_layer_freq == [1, 1]


def test_an_expert_parallel_size_that_does_not_divide_the_experts_is_refused(saved, tmp_path, capsys):
    assert _run("convert", "--src", saved, "--dst", tmp_path / "m", "--to", "mcore", "--ep", 3, "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert "--ep 3" in err and "\n" not in err and not (tmp_path / "m").exists()


@pytest.mark.slow
def test_the_language_model_part_alone_loads_strictly_at_tp2_pp2_ep2(saved, tmp_path):
    mcore = tmp_path / "lm"
    assert _run("convert", "--src", saved, "--dst", mcore, "--to", "mcore", "--part", "language_model",
                "--tp", 2, "--pp", 2, "--ep", 2, "--format", "legacy", "--quiet") == 0
    assert _run("verify", "--load", mcore, "--quiet") == 0


def _moe_e2b(**extra):
    return reference.tiny_config(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=6,
                                 num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"],
                                 hidden_size_per_layer_input=6, vocab_size_per_layer_input=97,
                                 num_kv_shared_layers=1, **extra)


def test_the_moe_block_composes_with_per_layer_inputs_and_shared_keys_values():
    """No release has both, but nothing keeps them apart: the per-layer builder's layers take the
    block as the plain builder's do."""
    report = harness.check("gemma4", cfg=_moe_e2b(), seed=3)
    assert report.passed, [(r.check, r.metrics) for r in report.failures()]


def test_the_moe_block_beside_doubled_shared_layer_mlps_is_refused_by_name():
    problems = families.get("gemma4").hooks.config.problems(_moe_e2b(use_double_wide_mlp=True))
    assert any("enable_moe_block with use_double_wide_mlp" in p for p in problems), problems
