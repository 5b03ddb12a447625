"""SigLIP: conversion incl. the attention-pooling head (random configs, TP), parity on both outputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import SiglipConfig, SiglipModel

from mmparity.models import registry as families
from mmparity.models.siglip.mapping import SplitInProj
from mmparity.parity import harness
from mmparity.models.core.inputs import random_like_state
from tests.strategies import config_and_tp


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_pooling_head_is_converted_exactly_when_configured(data):
    """Round trips are tests/mapping/test_converters.py's, for every family; here the head's presence."""
    cfg, tp = data.draw(config_and_tp("siglip"))
    sd = random_like_state(families.get("siglip").build_reference(cfg).state_dict(), data.draw(st.integers(0, 999)))
    shards = families.get("siglip").hf_to_mcore(sd, cfg, tp_size=tp)
    assert len(shards) == tp
    # Stock CLIPViTModel (siglip) has no head: it is kept aside, never in the mcore state dict.
    assert not any(k.startswith("head.") for k in shards[0])
    assert any(k.startswith("head.") for k in shards.side[0]) == cfg.vision_use_head


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_pooling_head_kv_rows_shard_as_whole_heads(tp):
    """mcore's CrossAttention reads linear_kv as [k_h; v_h] per head: each TP rank must hold the
    k and v rows of exactly its own heads, next to the q rows of the same heads."""
    heads, hd, hidden = 4, 3, 5
    q, k, v = (torch.randn(heads * hd, hidden) for _ in range(3))
    fam = families.get("siglip")
    cfg = fam.tiny_config()
    sd = random_like_state(fam.build_reference(cfg).state_dict(), seed=0)
    op = SplitInProj(heads, hd)
    linear_q, linear_kv = op.apply([torch.cat([q, k, v])])
    assert torch.equal(op.invert([linear_q, linear_kv])[0], torch.cat([q, k, v]))
    per = heads // tp
    for rank in range(tp):
        kv = linear_kv.chunk(tp)[rank].view(per, 2, hd, hidden)
        mine = slice(rank * per * hd, (rank + 1) * per * hd)
        assert torch.equal(kv[:, 0].reshape(-1, hidden), k[mine])
        assert torch.equal(kv[:, 1].reshape(-1, hidden), v[mine])
        assert torch.equal(linear_q.chunk(tp)[rank], q[mine])
    shards = families.get("siglip").hf_to_mcore(sd, cfg, tp_size=tp)
    assert shards.side[0]["head.attention.linear_kv.weight"].shape == (2 * cfg.hidden_size // tp, cfg.hidden_size)


def test_whole_siglip_model_checkpoint_drops_text_and_logit_parameters():
    vision = families.get("siglip").tiny_config()
    whole = SiglipConfig(vision_config=vision.to_dict(), text_config=dict(
        hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
        vocab_size=50, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    sd = random_like_state(SiglipModel(whole).state_dict(), seed=4)
    assert "logit_bias" in sd and any(k.startswith("text_model.") for k in sd)
    shard = families.get("siglip").hf_to_mcore(sd, whole)[0]
    own = {k[len("vision_model."):]: v for k, v in sd.items() if k.startswith("vision_model.")}
    expected = families.get("siglip").hf_to_mcore(own, vision)[0]
    assert shard.keys() == expected.keys() and all(torch.equal(shard[k], expected[k]) for k in shard)


def test_parity_without_the_pooling_head():
    cfg = families.get("siglip").tiny_config()
    cfg.vision_use_head = False
    report = harness.check("siglip", cfg, seed=3, image_sizes=[(24, 40), (48, 16)])
    assert report.passed, [(r.check, r.metrics) for r in report.failures()]
    assert {r.check for r in report.results if not r.check.startswith("component")} == {
        "static:last_hidden_state", "packed:last_hidden_state"}


def test_parity_of_both_outputs_at_sizes_off_the_table():
    report = harness.check("siglip", image_sizes=[(56, 24), (16, 16), (40, 48)], seed=12)
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
    outputs = {r.check.split(":")[1] for r in report.results if not r.check.startswith("component")}
    assert outputs == {"last_hidden_state", "pooler_output"}


def _swap_probe_query_heads(state):
    key = "head.attention.linear_q.weight"
    w = state[key].clone()
    hd = w.shape[0] // 4
    w[:hd], w[hd:2 * hd] = state[key][hd:2 * hd].clone(), state[key][:hd].clone()
    state[key] = w


def _perturb(key):
    def mutate(state):
        state[key] = state[key].clone()
        state[key].view(-1)[7] += 0.5
    return mutate


@pytest.mark.parametrize("mutate", [_swap_probe_query_heads, _perturb("head.probe"),
                                    _perturb("head.mlp.linear_fc1.layer_norm_weight")],
                         ids=["swapped-probe-q-heads", "probe", "head-norm"])
def test_head_negative_controls_fail_only_the_pooled_output(mutate):
    report = harness.check("siglip", seed=2, components=False, mutate_native=mutate)
    assert {r.check for r in report.failures()} == {"static:pooler_output", "packed:pooler_output"}
    assert {r.first_divergence.module for r in report.failures()} == {"head"}


def test_post_layernorm_is_part_of_the_token_output():
    report = harness.check("siglip", seed=2, components=False, mutate_native=_perturb("ln_post.bias"))
    assert {r.check for r in report.failures()} == {
        "static:last_hidden_state", "static:pooler_output", "packed:last_hidden_state",
        "packed:pooler_output"}
    assert {r.first_divergence.module for r in report.failures()} == {"ln_post"}


def test_position_table_negative_control_is_located_at_the_first_layer():
    report = harness.check("siglip", seed=2, components=False,
                           mutate_native=_perturb("position_embeddings.weight"))
    # The first module whose output sees the positions: layer 0's input norm.
    assert {r.first_divergence.module for r in report.failures()} == {"layer.0.input_layernorm"}
