"""Gemma 4 E2B / E4B: per-layer inputs (PLE) and layers sharing earlier layers' keys and values.

A tiny E2B-like whole model saved by transformers (per-layer inputs 6 wide, four layers of which
the last two share the first two's keys and values and have double-wide MLPs, a vocabulary that
needs padding, three images of different sizes) is told and passes ``check --hf`` in fp32 and
bf16; perturbed per-layer weights are named by part; ``save_pretrained`` writes no key / value
tensors for shared layers, and a checkpoint that has them gets them left out and counted; convert
-> verify -> convert --to hf --base is bit-exact at TP 2 x PP 2 in both formats; Megatron's
``GPTModel``, which has neither, is refused in one line."""

from __future__ import annotations

import pytest
import torch

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state
from mmparity.models.parts.gemma4_text import per_layer
from mmparity.parity import harness
from tests.hf_roundtrip import bump as _bump
from tests.hf_roundtrip import assert_round_trip
from tests.hf_roundtrip import run_cli as _run

LM = "language_model."


def _config():
    from mmparity.models.gemma4 import reference

    return reference.tiny_e2b_config()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny E2B-like model with seeded weights, as save_pretrained writes it (sharded)."""
    path = tmp_path_factory.mktemp("gemma4_e2b") / "hf"
    model = families.get("gemma4").build_reference(_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=5))
    model.save_pretrained(path, max_shard_size="60KB")
    return path


def test_the_tiny_config_is_e2b_like():
    text = _config().text_config
    assert text.hidden_size_per_layer_input and text.num_kv_shared_layers == 2 and text.use_double_wide_mlp
    # transformers' own assignment and ours: layers 2 and 3 read layers 0 (sliding) and 1 (full).
    assert text.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    assert per_layer.shared_from(text) == (None, None, 0, 1)
    assert text.hidden_size % text.hidden_size_per_layer_input  # awkward: divides nothing
    assert families.get("gemma4").hooks.config.problems(_config()) == []


def test_save_pretrained_writes_no_keys_or_values_for_shared_layers(saved):
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    state = load_safetensors_state_dict(saved)
    for i in (2, 3):
        assert not any(k.startswith(f"model.language_model.layers.{i}.self_attn.{n}")
                       for k in state for n in ("k_proj", "v_proj", "k_norm"))
        assert f"model.language_model.layers.{i}.self_attn.q_proj.weight" in state
    assert state["model.language_model.layers.3.mlp.gate_proj.weight"].shape[0] == 2 * _config().text_config.intermediate_size


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_without_family_tells_the_family_and_passes(saved, capsys, dtype):
    assert _run("check", "--hf", saved, "--dtype", dtype) == 0
    said = capsys.readouterr()
    assert "family: gemma4 " in said.out + said.err


@pytest.mark.parametrize("mutate, module", [
    # Row 0 is the pad token's, which every image position looks up.
    (_bump(LM + "embedding.per_layer.embeddings.weight", (0, 7)), LM + "embedding.per_layer.embeddings"),
    (_bump(LM + "embedding.per_layer.projection.weight", (5, 7)), LM + "embedding.per_layer.projection_norm"),
    (_bump(LM + "decoder.layers.1.per_layer_input_gate.weight", (3, 4)), LM + "decoder.layers.1.per_layer_input_gate"),
    (_bump(LM + "decoder.layers.2.per_layer_projection.weight", (3, 4)), LM + "decoder.layers.2"),
    # A shared layer's own query projection; its keys come from layer 1, whose perturbation shows there first.
    (_bump(LM + "decoder.layers.3.self_attention.linear_q.weight", (3, 4)), LM + "decoder.layers.3.self_attention"),
    (_bump(LM + "decoder.layers.1.self_attention.k_layernorm.weight", (3,)), LM + "decoder.layers.1.self_attention"),
])
def test_negative_controls_fail_and_name_the_part(mutate, module):
    report = harness.check("gemma4", cfg=_config(), seed=2, mutate_native=mutate)
    failures = report.failures()
    assert failures and {r.first_divergence.module for r in failures} == {module}


def test_shared_layers_attend_over_the_last_earlier_layer_of_their_type():
    """Layers sliding, sliding, full, sliding, full, the last two shared: layer 3 reads layer 1's
    keys and values (the last sliding one before the shared layers). Read from layer 0 (also
    sliding) instead, the logits leave the bound."""
    from mmparity.models.gemma4 import reference
    from mmparity.models.parts.gemma4_text import per_layer_native

    cfg = reference.tiny_e2b_config(num_hidden_layers=5, layer_types=["sliding_attention", "sliding_attention",
                                                                      "full_attention", "sliding_attention",
                                                                      "full_attention"])
    assert per_layer.shared_from(cfg.text_config) == (None, None, None, 1, 2)
    assert harness.check("gemma4", cfg=cfg, seed=1, components=False).passed
    init = per_layer_native.SharedKVSelfAttention.__init__

    def from_the_first(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.stores = self.stores or self.index == 0
        if self.source == 1:
            self.source = 0

    per_layer_native.SharedKVSelfAttention.__init__ = from_the_first
    try:
        assert not harness.check("gemma4", cfg=cfg, seed=1, components=False).passed
    finally:
        per_layer_native.SharedKVSelfAttention.__init__ = init


def test_shared_layers_key_values_in_a_checkpoint_are_left_out_and_counted(saved, tmp_path, capsys):
    """Some checkpoints carry the shared layers' key / value tensors, which transformers ignores on
    load: convert leaves them out by name and counts them."""
    model = families.get("gemma4").build_reference(_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=5))
    model.save_pretrained(tmp_path / "hf")
    from safetensors.torch import load_file, save_file

    (shard,) = (tmp_path / "hf").glob("*.safetensors")
    state = load_file(shard)
    extra = {f"model.language_model.layers.3.self_attn.{n}.weight": torch.ones(s)
             for n, s in (("k_proj", (32, 40)), ("v_proj", (32, 40)), ("k_norm", (16,)))}
    save_file(state | extra, shard, metadata={"format": "pt"})
    capsys.readouterr()
    assert _run("convert", "--src", tmp_path / "hf", "--dst", tmp_path / "mcore", "--to", "mcore") == 0
    said = capsys.readouterr()
    out = said.out + said.err
    # Counted under the module they belong to (the report groups layers' tensors by model).
    assert f"left out {len(extra)} of " in out and f"model.language_model ({len(extra)} tensors" in out, out


@pytest.mark.parametrize("argv", [("verify", "{mcore}", "--load"), ("check", "--hf", "{hf}", "--impl", "megatron")])
def test_megatrons_gpt_model_is_refused_in_one_line(saved, tmp_path, capsys, argv):
    mcore = tmp_path / "mcore"
    assert _run("convert", "--src", saved, "--dst", mcore, "--to", "mcore", "--quiet") == 0
    capsys.readouterr()
    assert _run(*(a.format(mcore=mcore, hf=saved) for a in argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "per-layer input embeddings" in err[0] and "num_kv_shared_layers" in err[0], err


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_convert_tp2_pp2_verify_and_back_with_base_is_bit_exact(saved, tmp_path, fmt):
    assert_round_trip(saved, tmp_path, "--tp", 2, "--pp", 2, fmt=fmt, check=False)


def test_legacy_tp2_pp2_places_the_per_layer_tables_on_the_first_stage_split_by_vocabulary(saved, tmp_path):
    mcore = tmp_path / "mcore"
    assert _run("convert", "--src", saved, "--dst", mcore, "--to", "mcore", "--tp", 2, "--pp", 2,
                "--format", "legacy", "--quiet") == 0
    ranks = {name: torch.load(mcore / "iter_0000001" / name / "model_optim_rng.pt", weights_only=False)["model"]
             for name in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001")}
    first, second, last = ranks["mp_rank_00_000"], ranks["mp_rank_01_000"], ranks["mp_rank_00_001"]
    table = LM + "embedding.per_layer.embeddings.weight"
    # Padded and split as the word embedding is (97 rows to 128 x TP, 128 a rank); 4 layers x 6 columns.
    rows = first[LM + "embedding.word_embeddings.weight"].shape[0]
    assert first[table].shape == second[table].shape == (rows, 24) and rows == 128
    assert not torch.equal(first[table], second[table])
    assert first[LM + "embedding.per_layer.projection.weight"].shape == (24, 40)
    assert not any(k.startswith(LM + "embedding.per_layer.") for k in last)
    # Layers 2 and 3 (the shared ones) are the last stage's 0 and 1: queries only, no key norm.
    assert LM + "decoder.layers.0.self_attention.linear_q.weight" in last
    assert LM + "decoder.layers.0.self_attention.linear_q.layer_norm_weight" in last
    assert not any("linear_qkv" in k or "k_layernorm" in k for k in last)
    for key in ("per_layer_input_gate.weight", "per_layer_projection.weight", "post_per_layer_input_norm.weight"):
        assert LM + "decoder.layers.1." + key in first and LM + "decoder.layers.1." + key in last


@pytest.mark.slow
def test_check_at_tp2_passes(saved, capsys):
    """The per-layer table split by vocabulary rows, a shared layer's queries split by heads."""
    assert _run("check", "--hf", saved, "--tp", 2) == 0


def test_pipeline_stages_are_refused_by_name_for_the_check():
    """Even untied (the tied head alone refuses stages): a stage would need the first stage's
    per-layer inputs and an earlier stage's keys."""
    cfg = _config()
    cfg.tie_word_embeddings = cfg.text_config.tie_word_embeddings = False
    problems = families.get("gemma4").hooks.config.pipeline_problems(cfg, 2)
    assert len(problems) == 2
    assert "hidden_size_per_layer_input" in problems[0] and "num_kv_shared_layers" in problems[1]
    assert families.get("gemma4").hooks.config.pipeline_problems(cfg, 1) == []


def test_with_an_audio_tower_as_e2b_has_check_passes_and_convert_counts_it(tmp_path, capsys):
    """The tower and its embedder are saved by transformers, left out by convert and counted, and
    not part of the model checked (audio is out of scope)."""
    from transformers import Gemma4AudioConfig, Gemma4ForConditionalGeneration

    cfg = _config()
    cfg.audio_config = Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         subsampling_conv_channels=[4, 4], conv_kernel_size=3, output_proj_dims=16)
    model = Gemma4ForConditionalGeneration(cfg)
    model.load_state_dict(random_like_state(model.state_dict(), seed=5))
    model.save_pretrained(tmp_path / "hf")
    audio = [k for k in model.state_dict() if k.startswith(("model.audio_tower.", "model.embed_audio."))]
    capsys.readouterr()
    assert _run("check", "--hf", tmp_path / "hf") == 0
    assert _run("convert", "--src", tmp_path / "hf", "--dst", tmp_path / "mcore", "--to", "mcore") == 0
    said = capsys.readouterr()
    assert f"left out {len(audio)} of " in said.out + said.err
