"""CLIP: conversion (random configs, TP, whole-model checkpoints), resampled positions, parity."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig

from mmparity.models import registry as families
from mmparity.mapping.rules import ConversionError
from mmparity.parity import harness
from mmparity.models.core.inputs import random_like_state
from tests.strategies import config_and_tp


def tiny_state(seed: int = 0):
    fam = families.get("clip")
    cfg = fam.tiny_config()
    return cfg, random_like_state(fam.build_reference(cfg).state_dict(), seed)


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_shards_have_mcore_shapes_for_random_configs_and_tp(data):
    """Round trips are tests/mapping/test_converters.py's, for every family; here the per-rank shapes."""
    cfg, tp = data.draw(config_and_tp("clip"))
    sd = random_like_state(families.get("clip").build_reference(cfg).state_dict(), data.draw(st.integers(0, 999)))
    shards = families.get("clip").hf_to_mcore(sd, cfg, tp_size=tp)
    assert len(shards) == tp
    heads_per_rank = cfg.num_attention_heads // tp
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == (3 * heads_per_rank * head_dim, cfg.hidden_size)
    assert shards[-1]["class_token"].shape == (1, 1, cfg.hidden_size)


@pytest.mark.parametrize("prefix", ["vision_model.", "model.vision_model.", "vision_tower.",
                                    "model.vision_tower.", "vision_tower.vision_model."])
def test_vision_tower_found_under_every_vlm_prefix(prefix):
    cfg, sd = tiny_state()
    expected = families.get("clip").hf_to_mcore(sd, cfg)
    wrapped = {prefix + k: v for k, v in sd.items()}
    wrapped["language_model.model.embed_tokens.weight"] = torch.zeros(3, 2)
    wrapped["multi_modal_projector.linear_1.weight"] = torch.zeros(2, 2)
    shards = families.get("clip").hf_to_mcore(wrapped, cfg)
    for got, want in ((shards[0], expected[0]), (shards.side[0], expected.side[0])):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    back = families.get("clip").mcore_to_hf(shards, cfg, prefix=prefix)
    assert all(torch.equal(back[prefix + k], v) for k, v in sd.items())


def test_ambiguous_prefixes_and_stray_tensors_are_loud():
    cfg, sd = tiny_state()
    both = {**sd, **{"vision_model." + k: v for k, v in sd.items()}}
    with pytest.raises(ConversionError, match="ambiguous"):
        families.get("clip").hf_to_mcore(both, cfg)
    stray = {**sd, "embeddings.extra_token": torch.zeros(4)}
    with pytest.raises(ConversionError, match="unconsumed source tensor embeddings.extra_token"):
        families.get("clip").hf_to_mcore(stray, cfg)


def test_whole_clip_model_checkpoint_drops_text_side():
    vision = families.get("clip").tiny_config()
    text = CLIPTextConfig(hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                          num_attention_heads=4, vocab_size=50, max_position_embeddings=12)
    whole = CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=16)
    sd = random_like_state(CLIPModel(whole).state_dict(), seed=4)
    # transformers 4 checkpoints also carry the persistent position-id buffers
    sd["vision_model.embeddings.position_ids"] = torch.arange(26)[None]
    sd["text_model.embeddings.position_ids"] = torch.arange(12)[None]
    shard = families.get("clip").hf_to_mcore(sd, whole)[0]
    own = {k[len("vision_model."):]: v for k, v in sd.items()
           if k.startswith("vision_model.") and not k.endswith("position_ids")}
    expected = families.get("clip").hf_to_mcore(own, vision)[0]
    assert shard.keys() == expected.keys() and all(torch.equal(shard[k], expected[k]) for k in shard)


def test_cli_checks_a_saved_whole_clip_model(tmp_path, capsys):
    from mmparity.cli.main import main

    vision = families.get("clip").tiny_config()
    text = CLIPTextConfig(hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                          num_attention_heads=4, vocab_size=50, max_position_embeddings=12)
    model = CLIPModel(CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                 projection_dim=16))
    model.load_state_dict(random_like_state(model.state_dict(), seed=8))
    model.save_pretrained(tmp_path / "clip")
    capsys.readouterr()
    assert main(["check", "clip", "--hf", str(tmp_path / "clip"), "--quiet"]) == 0


@pytest.mark.parametrize("grid", [(3, 7), (8, 2), (1, 1), (5, 5), (6, 6)])
def test_learned_positions_resample_exactly_like_hf(grid):
    from mmparity.models.core.vit import LearnedPositionEmbedding
    from mmparity.models.clip import cases as ref_clip

    fam = families.get("clip")
    cfg = fam.tiny_config()
    ref = fam.build_reference(cfg)
    ref.load_state_dict(random_like_state(ref.state_dict(), seed=2))
    table = ref.embeddings.position_embedding.weight.detach()
    g = cfg.image_size // cfg.patch_size
    native = LearnedPositionEmbedding(g, g, cfg.hidden_size, class_token_len=1)
    with torch.no_grad():
        native.weight.copy_(table)
        expected = ref_clip.interpolated_positions(ref.embeddings, cfg, grid, 1)
        got = native(*grid)
    assert got.shape == (1 + grid[0] * grid[1], cfg.hidden_size)
    assert torch.equal(got, expected)
    assert torch.equal(got[0], table[0])  # the class row is never resampled


def test_hf_identity_shortcut_needs_a_square_image():
    """HF skips resampling only when the patch count matches *and* the image is square: a 2x8 grid
    on a 4x4 table has the table's 16 patches but must still be resampled."""
    cfg = CLIPVisionConfig(hidden_size=24, intermediate_size=20, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=8)
    report = harness.check("clip", cfg, image_sizes=[(16, 64), (32, 32)], seed=6)
    assert report.passed, [(r.check, r.metrics) for r in report.failures()]


def test_parity_at_user_image_sizes_bigger_and_smaller_than_the_table():
    report = harness.check("clip", image_sizes=[(48, 24), (16, 56), (8, 8)], seed=11,
                           components=False)
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
    assert {r.check for r in report.results} == {
        "static:last_hidden_state", "static:pooler_output", "packed:last_hidden_state",
        "packed:pooler_output"}


def _perturb(key):
    def mutate(state):
        state[key] = state[key].clone()
        state[key].view(-1)[5] += 0.5
    return mutate


@pytest.mark.parametrize("key, module", [("class_token", "ln_pre"),
                                         ("position_embeddings.weight", "ln_pre"),
                                         ("decoder.layers.0.mlp.linear_fc1.layer_norm_bias",
                                          "layer.0.pre_mlp_layernorm")])
def test_negative_controls_locate_the_embedding_stage(key, module):
    report = harness.check("clip", seed=1, components=False, mutate_native=_perturb(key))
    assert not report.passed
    assert {r.first_divergence.module for r in report.failures()} == {module}


def test_post_layernorm_only_touches_the_pooled_output():
    report = harness.check("clip", seed=1, components=False, mutate_native=_perturb("ln_post.weight"))
    failed = {r.check for r in report.failures()}
    assert failed == {"static:pooler_output", "packed:pooler_output"}
    assert {r.first_divergence.module for r in report.failures()} == {"ln_post"}
