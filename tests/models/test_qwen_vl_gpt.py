"""The Qwen-VL language models in Megatron's own ``GPTModel``, trained alone.

Megatron has no class for a whole Qwen3-VL or Qwen2.5-VL (DeepStack, M-RoPE, window attention), but
on text the three M-RoPE axes are equal, i.e. plain RoPE, so stock megatron-core ``GPTModel``
computes their language models: Qwen3's with ``qk_layernorm``, Qwen2's with q/k/v biases, Qwen3-MoE's
on mcore's TE block spec (softmax top-k router, grouped-GEMM experts, no shared expert).
``check --impl megatron`` runs it on seeded text ids against HF's text model and head (a perturbed
decoder weight is located in its layer); ``verify --load`` loads ``convert --part language_model``
output strictly (legacy and torch_dist; TP 2 spawns ranks: ``slow``), and a whole checkpoint loads
its language model with the rest counted as not loaded. Seeded tiny models with awkward sizes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmparity.cli.main import main
from mmparity.io.legacy import open_legacy
from mmparity.models import registry as families
from mmparity.models.core import megatron_classes as models
from mmparity.models.registry import megatron_class
from mmparity.parallel import runtime
from mmparity.parity import harness
from mmparity.parity.metrics import FP32_REL_L2
from tests.faults.test_faults import one_line_error, run_cli
from tests.mapping.test_convert_roundtrips import save_hf

FAMILIES = ["qwen3_vl_whole", "qwen2_5_vl_whole", "qwen3_vl_moe"]


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("qwen_vl_gpt")
    return {name: save_hf(name, root / name, seed=31 + i) for i, name in enumerate(FAMILIES)}


def _build(family: str):
    cfg = families.get(family).tiny_config()
    with runtime.parallel_context(1, 1):
        return models.build(megatron_class(family)[1].build, cfg)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_record_is_stock_gptmodel_on_the_language_model(family):
    name, record = megatron_class(family)
    assert name == "GPTModel" and list(families.get(family).hooks.megatron) == ["GPTModel"]
    assert record.holds == ("language_model.",) and record.root == "language_model." and record.pipelined
    assert "no Qwen" in record.why_part


def test_qwen3_has_per_head_qk_norm_and_no_biases():
    model = _build("qwen3_vl_whole")
    text = families.get("qwen3_vl_whole").tiny_config().text_config
    attention = model.decoder.layers[0].self_attention
    assert type(model).__name__ == "GPTModel" and model.config.qk_layernorm
    assert attention.q_layernorm.weight.shape == (text.head_dim,)
    assert not [k for k in model.state_dict() if k.endswith(".bias")]
    assert model.rotary_pos_emb.inv_freq[1].item() == pytest.approx(
        text.rope_parameters["rope_theta"] ** (-2 / text.head_dim), rel=1e-6)


def test_qwen3_moe_is_mcores_block_spec_with_grouped_experts():
    model = _build("qwen3_vl_moe")
    text = families.get("qwen3_vl_moe").tiny_config().text_config
    moe = [layer.mlp for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    assert moe and len(moe) < len(model.decoder.layers) and model.config.qk_layernorm
    assert type(moe[0].experts).__name__ == "TEGroupedMLP" and moe[0].shared_experts is None
    assert model.config.moe_router_score_function == "softmax" and model.config.moe_router_topk == \
        text.num_experts_per_tok


def test_qwen2_5_has_qkv_biases_and_no_qk_norm():
    model = _build("qwen2_5_vl_whole")
    own = model.state_dict()
    assert not model.config.qk_layernorm
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in own
    assert not [k for k in own if "linear_proj.bias" in k or "linear_fc" in k and k.endswith(".bias")]


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_is_the_part_checkpoints_keys(family, releases, tmp_path):
    part = tmp_path / "lm"
    assert main(["convert", "--src", str(releases[family]), "--dst", str(part), "--to", "mcore", "--format",
                 "legacy", "--part", "language_model", "--quiet"]) == 0
    stored = open_legacy(part).load_rank(0)
    own = _build(family).state_dict()
    assert sorted(stored) == sorted(own)
    assert [k for k, v in own.items() if torch.is_tensor(v) and v.shape != stored[k].shape] == []


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", FAMILIES)
def test_check_megatron_passes(family, tp):
    report = harness.check(family, impl="megatron", tp=tp, seed=5)
    results = [r for r in report.results if r.impl == "megatron"]
    assert {r.check for r in results} == {"text:logits", "text:token_loss"}
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in results]
    assert all(r.metrics["rel_l2"] <= FP32_REL_L2 for r in results)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_perturbed_decoder_weight_is_located_in_its_layer(family):
    layer = families.get(family).tiny_config().text_config.num_hidden_layers - 1

    def perturb(shard):
        # Every expert's down projection (an expert no token is routed to changes nothing).
        keys = [k for k in shard if f"decoder.layers.{layer}." in k and "linear_fc2.weight" in k]
        assert keys
        for key in keys:
            shard[key] = shard[key].flip(0)

    report = harness.check(family, impl="megatron", mutate_native=perturb)
    logits = next(r for r in report.results if r.impl == "megatron" and r.check == "text:logits")
    assert not logits.passed
    assert logits.first_divergence.module.startswith(f"language_model.decoder.layers.{layer}"), \
        logits.first_divergence


@pytest.mark.parametrize("family", FAMILIES)
def test_impl_both_is_refused_naming_impl_megatron(capsys, family):
    one_line_error(*run_cli(capsys, "check", family, "--impl", "both"),
                   "GPTModel holds only language_model.*", "--impl megatron")


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", FAMILIES)
def test_verify_load_of_the_language_model_part(capsys, releases, tmp_path, family, fmt, tp):
    part = tmp_path / "lm"
    assert run_cli(capsys, "convert", "--src", releases[family], "--dst", part, "--to", "mcore", "--format",
                   fmt, "--tp", tp, "--part", "language_model")[0] == 0
    at = ["--tp", str(tp)] if fmt == "torch_dist" else []
    code, out, err = run_cli(capsys, "verify", "--load", part, *at)
    assert code == 0, out + err
    assert "strict load into Megatron's GPTModel" in out and "all ranks load" in out and f"TP {tp}" in out
    assert all(f"rank {r}: ok" in out for r in range(tp)), out


def test_a_whole_checkpoint_loads_its_language_model_and_counts_the_rest(capsys, releases, tmp_path):
    whole = tmp_path / "whole"
    assert run_cli(capsys, "convert", "--src", releases["qwen3_vl_whole"], "--dst", whole, "--to", "mcore",
                   "--format", "legacy")[0] == 0
    code, out, err = run_cli(capsys, "verify", "--load", whole)
    assert code == 0, out + err
    assert "language_model.* -> GPTModel" in out and "has no Megatron class for it" in out
    assert "rank 0: ok: loads GPTModel" in out and "not loaded: the rest" in out


def test_a_class_the_family_lacks_is_refused_naming_gptmodel(capsys, releases, tmp_path):
    part = tmp_path / "lm"
    assert run_cli(capsys, "convert", "--src", releases["qwen3_vl_whole"], "--dst", part, "--to", "mcore",
                   "--part", "language_model")[0] == 0
    one_line_error(*run_cli(capsys, "verify", "--load", part, "--megatron-class", "LLaVAModel"),
                   "no Megatron class 'LLaVAModel'", "GPTModel")
