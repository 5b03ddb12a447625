"""Whole Gemma 4: a tiny model saved by transformers (three images of different sizes, padded, in
rows longer than the sliding window) is told and passes ``check --hf`` in fp32 and bf16; perturbed
weights are named by part; the mask (an image's tokens see each other on sliding layers only) is
shown to matter; an audio tower is dropped by name and counted; what is not built is refused by
name; convert -> verify -> convert --to hf --base is bit-exact at TP 2 x PP 2 in both formats
(``verify --load`` loads the language model strictly into Megatron's ``GPTModel``, the rest
counted: tests/models/test_gemma4_gpt.py)."""

from __future__ import annotations

import pytest
import torch

from mmparity.models import registry as families
from mmparity.parity import harness
from tests.hf_roundtrip import bump as _bump
from tests.hf_roundtrip import run_cli as _run
from tests.hf_roundtrip import save_tiny


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Gemma4ForConditionalGeneration with seeded weights, as save_pretrained writes it (sharded)."""
    return save_tiny(tmp_path_factory, "gemma4", "60KB")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_without_family_tells_the_family_and_passes(saved, capsys, dtype):
    assert _run("check", "--hf", saved, "--dtype", dtype) == 0
    said = capsys.readouterr()
    assert "family: gemma4 " in said.out + said.err


@pytest.mark.parametrize("mutate, module", [
    (_bump("vision_model.decoder.layers.1.self_attention.linear_qkv.weight", (7, 3)),
     "vision_model.layer.1.self_attention"),
    (_bump("vision_projection.encoder.linear_fc1.weight", (2, 5)), "vision_projection"),
    (_bump("language_model.decoder.layers.0.self_attention.k_layernorm.weight", (3,)),
     "language_model.decoder.layers.0.self_attention"),
    # A full layer's wider q/k/v.
    (_bump("language_model.decoder.layers.1.self_attention.linear_qkv.weight", (70, 4)),
     "language_model.decoder.layers.1.self_attention"),
    (_bump("language_model.decoder.layers.1.self_attention.linear_proj.post_layernorm.weight", (4,)),
     "language_model.decoder.layers.1.self_attention"),
    (_bump("language_model.decoder.layers.1.mlp.linear_fc2.post_layernorm.weight", (1,)),
     "language_model.decoder.layers.1.mlp"),
    # A layer scalar changes nothing inside the layer's modules, only the layer's output (the last
    # layer's would change nothing at all: the final norm divides a scale out).
    (_bump("language_model.decoder.layers.0.layer_scalar", (0,)), "language_model.decoder.layers.0"),
    (_bump("language_model.decoder.final_layernorm.weight", (9,)), "language_model.decoder.final_layernorm"),
])
def test_negative_controls_fail_and_name_the_part(mutate, module):
    report = harness.check("gemma4", seed=2, mutate_native=mutate)
    failures = report.failures()
    assert failures and {r.first_divergence.module for r in failures} == {module}


def test_images_see_themselves_both_ways_on_sliding_layers_only():
    """With the native model's mask taken away (every layer causal), or given to the full layers
    too (as Gemma 3 does), the logits leave the bound; as built they pass."""
    from mmparity.models.gemma4 import native
    from mmparity.models.parts.gemma4_text import native as text_native

    assert harness.check("gemma4", seed=1, components=False).passed
    saved = native.Gemma4Model.attention_mask
    native.Gemma4Model.attention_mask = lambda self, ids: None
    try:
        assert not harness.check("gemma4", seed=1, components=False).passed
    finally:
        native.Gemma4Model.attention_mask = saved
    forward = text_native.Gemma4CoreAttention.forward

    def everywhere(self, query, key, value, attention_mask=None, *args, **kwargs):
        return text_native.WindowedCoreAttention.forward(
            self, query, key, text_native.rms_norm(value, None, self.eps), attention_mask, *args, **kwargs)

    text_native.Gemma4CoreAttention.forward = everywhere
    try:
        assert not harness.check("gemma4", seed=1, components=False).passed
    finally:
        text_native.Gemma4CoreAttention.forward = forward


def test_keys_as_values_full_layers_pass():
    """The larger releases' full layers take their values from the key projection."""
    from mmparity.models.gemma4 import reference

    cfg = reference.tiny_config(attention_k_eq_v=True, num_global_key_value_heads=1)
    assert harness.check("gemma4", cfg=cfg, seed=3, components=False).passed


def test_the_cases_hold_images_of_different_sizes_padded_and_longer_rows_than_the_window():
    fam = families.get("gemma4")
    cfg = fam.tiny_config()
    (case,) = fam.hooks.parity.cases(cfg, 0)
    assert len(set(case.data["sizes"])) == len(case.data["sizes"]) == 3
    assert not case.data["valid"].all()  # the smaller images are padded
    assert case.data["input_ids"].shape[1] > cfg.text_config.sliding_window
    runs = (case.data["input_ids"] == cfg.image_token_id).sum().item()
    assert runs == case.data["valid"].sum().item() // cfg.vision_config.pooling_kernel_size ** 2


@pytest.mark.parametrize("overrides, named", [
    ({"enable_moe_block": True, "num_experts": 2, "top_k_experts": 3, "moe_intermediate_size": 8}, "top_k_experts=3"),
    # Every layer shared: none computes the keys and values (E2B / E4B's partial sharing is built:
    # tests/models/test_gemma4_ple.py).
    ({"num_kv_shared_layers": 2}, "num_kv_shared_layers"),
])
def test_what_is_not_built_is_refused_by_name(overrides, named, tmp_path, capsys):
    from mmparity.models.gemma4 import reference

    fam = families.get("gemma4")
    problems = fam.hooks.config.problems(reference.tiny_config(**overrides))
    assert len(problems) == 1 and problems[0].startswith("text_config: ") and named in problems[0]
    model = fam.build_reference(reference.tiny_config(**overrides))
    model.save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    assert _run("check", "--hf", tmp_path / "hf") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0]
    assert _run("convert", "--src", tmp_path / "hf", "--dst", tmp_path / "mcore", "--to", "mcore", "--quiet") == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "mcore").exists()


def test_a_model_without_a_tower_is_refused_by_name():
    from mmparity.models.gemma4 import reference

    cfg = reference.tiny_config()
    cfg.vision_config = None
    assert any("vision_config is missing" in p for p in families.get("gemma4").hooks.config.problems(cfg))


def test_an_audio_tower_is_dropped_by_name_and_counted(tmp_path, capsys):
    """transformers builds and saves it; the model checked has none (audio is out of scope)."""
    from transformers import Gemma4AudioConfig, Gemma4ForConditionalGeneration

    from mmparity.models.gemma4 import reference

    cfg = reference.tiny_config()
    cfg.audio_config = Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         subsampling_conv_channels=[4, 4], conv_kernel_size=3, output_proj_dims=16)
    model = Gemma4ForConditionalGeneration(cfg)
    audio = {k: v for k, v in model.state_dict().items() if k.startswith(("model.audio_tower.", "model.embed_audio."))}
    assert audio
    assert not any(k.startswith(("model.audio_tower.", "model.embed_audio."))
                   for k in families.get("gemma4").build_reference(cfg).state_dict())
    model.save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    assert _run("convert", "--src", tmp_path / "hf", "--dst", tmp_path / "mcore", "--to", "mcore") == 0
    said = capsys.readouterr()
    out = said.out + said.err
    towers = sum(k.startswith("model.audio_tower.") for k in audio)
    assert f"model.audio_tower ({towers} tensors" in out and "model.embed_audio (1 tensor" in out, out
    assert f"left out {len(audio)} of " in out, out


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_convert_tp2_pp2_verify_and_back_with_base_is_bit_exact(saved, tmp_path, fmt, capsys):
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert _run("convert", "--src", saved, "--dst", mcore, "--to", "mcore", "--tp", 2, "--pp", 2,
                "--format", fmt, "--quiet") == 0
    assert _run("verify", mcore) == 0
    # Megatron's GPTModel holds the language model; the tower and embedder have no class.
    capsys.readouterr()
    assert _run("verify", mcore, "--load") == 0
    out = capsys.readouterr().out
    assert "language_model.* -> GPTModel" in out and "not loaded: the rest" in out, out
    assert _run("convert", "--src", mcore, "--dst", back, "--to", "hf", "--base", saved, "--quiet") == 0
    expected, got = load_safetensors_state_dict(saved), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())


def test_legacy_tp2_pp2_holds_the_layer_scalars_and_megatron_bridge_names(saved, tmp_path):
    mcore = tmp_path / "mcore"
    assert _run("convert", "--src", saved, "--dst", mcore, "--to", "mcore", "--tp", 2, "--pp", 2,
                "--format", "legacy", "--quiet") == 0
    stage0 = torch.load(mcore / "iter_0000001" / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False)["model"]
    layer = "language_model.decoder.layers.0."
    for key in ("self_attention.linear_qkv.layer_norm_weight", "self_attention.q_layernorm.weight",
                "self_attention.linear_proj.post_layernorm.weight", "mlp.linear_fc1.layer_norm_weight",
                "mlp.linear_fc2.post_layernorm.weight", "layer_scalar"):
        assert layer + key in stage0, key
