"""Converter engine: ops and their inverses, TP shard/merge, totality errors, family round trips."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmparity.models import registry as families
from mmparity.mapping import ops
from mmparity.parallel import tp
from mmparity.errors import ConversionError
from mmparity.mapping.rules import Rule, RuleSet, convert_hf_to_mcore, rename, to_te_spelling
from mmparity.mapping import rules as R
from mmparity.models.core.inputs import random_like_state
from tests.strategies import config_and_tp

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def seeded(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@settings(max_examples=40, deadline=None)
@given(heads=st.integers(1, 6), half=st.integers(1, 8), cols=st.integers(0, 5),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_rope_interleave_inverse_and_pairing(heads, half, cols, dtype, seed):
    head_dim = 2 * half
    shape = (heads * head_dim,) + ((cols,) if cols else ())
    t = seeded(shape, seed, dtype)
    op = ops.RopeInterleave(heads, head_dim)
    mcore = op.apply([t])[0]
    assert torch.equal(op.invert([mcore])[0], t)
    # HF row t of a head holds the first element of pair t; row hd/2+t the second.
    per_head = t.reshape(heads, head_dim, *t.shape[1:])
    out = mcore.reshape(heads, head_dim, *t.shape[1:])
    assert torch.equal(out[:, 0::2], per_head[:, :half])
    assert torch.equal(out[:, 1::2], per_head[:, half:])


@settings(max_examples=40, deadline=None)
@given(heads=st.integers(1, 6), quarter=st.integers(1, 4), cols=st.integers(0, 5),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_axial_rope_halves_swaps_the_middle_quarters_and_is_its_own_inverse(heads, quarter, cols, dtype, seed):
    head_dim = 4 * quarter
    shape = (heads * head_dim,) + ((cols,) if cols else ())
    t = seeded(shape, seed, dtype)
    op = ops.AxialRopeHalves(heads, head_dim)
    mcore = op.apply([t])[0]
    assert torch.equal(op.invert([mcore])[0], t) and torch.equal(op.apply([mcore])[0], t)
    # Per head, HF's quarters [A, B, C, D] (pairs (A, B) and (C, D)) become [A, C, B, D] (pairs j, j + hd/2).
    a, b, c, d = t.reshape(heads, 4, quarter, *t.shape[1:]).unbind(1)
    assert torch.equal(mcore.reshape(heads, 4, quarter, *t.shape[1:]), torch.stack([a, c, b, d], dim=1))


@settings(max_examples=40, deadline=None)
@given(groups=st.integers(1, 4), per=st.integers(1, 3), head_dim=st.integers(1, 6),
       width=st.integers(0, 7), seed=st.integers(0, 2**16))
def test_fuse_qkv_groups_and_inverse(groups, per, head_dim, width, seed):
    heads = groups * per
    rest = (width,) if width else ()
    q = seeded((heads * head_dim, *rest), seed)
    k = seeded((groups * head_dim, *rest), seed + 1)
    v = seeded((groups * head_dim, *rest), seed + 2)
    op = ops.FuseQKV(heads, groups, head_dim)
    fused = op.apply([q, k, v])[0]
    back = op.invert([fused])
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    block = fused.reshape(groups, per + 2, head_dim, *rest)
    assert torch.equal(block[1 % groups, per], k.reshape(groups, head_dim, *rest)[1 % groups])
    regroup = ops.RegroupQKV(heads, groups, head_dim)
    assert torch.equal(regroup.apply([torch.cat([q, k, v])])[0], fused)
    assert torch.equal(regroup.invert([fused])[0], torch.cat([q, k, v]))


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["replicated", "column", "row", "qkv", "gated", "vocab"]),
       tp_size=st.sampled_from([1, 2, 3, 4]), rows=st.integers(1, 3), cols=st.integers(1, 3),
       seed=st.integers(0, 2**16), dtype=st.sampled_from(DTYPES))
def test_shard_then_merge_is_identity(kind, tp_size, rows, cols, seed, dtype):
    t = seeded((2 * tp_size * rows, tp_size * cols), seed, dtype)
    parts = tp.shard(t, kind, tp_size)
    assert len(parts) == tp_size
    assert torch.equal(tp.merge(parts, kind), t)
    assert all(p.dtype == dtype for p in parts)
    pieces = tp.merge_pieces(parts, kind)
    assert torch.equal(torch.cat([tp.as_tensor(p) for p in pieces]), t)


def test_gated_shard_pairs_gate_and_up_per_rank():
    gate = torch.arange(8.0).view(4, 2)
    up = 100 + torch.arange(8.0).view(4, 2)
    parts = tp.shard(torch.cat([gate, up]), "gated", 2)
    assert torch.equal(parts[0], torch.cat([gate[:2], up[:2]]))
    assert torch.equal(parts[1], torch.cat([gate[2:], up[2:]]))


def test_merge_refuses_diverging_replicas_and_bad_split():
    with pytest.raises(tp.ShardError, match="rank 1"):
        tp.merge([torch.zeros(3), torch.ones(3)], "replicated")
    with pytest.raises(tp.ShardError, match="not divisible"):
        tp.shard(torch.zeros(5, 2), "column", 2)


def test_replicas_compare_bytes_not_values():
    # A NaN is byte-identical to its copy but never equal to it; -0.0 equals +0.0 but its bytes differ.
    nan = torch.tensor([float("nan"), 1.0], dtype=torch.bfloat16)
    tp.check_replicated([nan, nan.clone()])
    with pytest.raises(tp.ShardError, match="rank 1"):
        tp.check_replicated([torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])])
    assert tp.same_bytes(torch.randn(3, 2, dtype=torch.complex128), torch.zeros(3, 2, dtype=torch.complex128)) is False
    strided = torch.randn(5, 4).t()
    assert tp.same_bytes(strided, strided.contiguous())
    assert not tp.same_bytes(torch.arange(3), torch.arange(3).int())  # same values, other dtype


def _toy_rules():
    return RuleSet(rules=(rename("a.{i}.w", "hf.{i}.weight", "column"),
                          Rule("fc.weight", ("gate.weight", "up.weight"), ops.fuse_gate_up(), "gated")),
                   variables={"i": 2})


def test_conversion_lists_every_offender_at_once():
    good = {"hf.0.weight": torch.zeros(4, 2), "hf.1.weight": torch.zeros(4, 2),
            "gate.weight": torch.zeros(4, 2), "up.weight": torch.zeros(4, 2)}
    bad = dict(good)
    del bad["hf.1.weight"]
    bad["stray.bias"] = torch.zeros(7)
    bad["up.weight"] = torch.zeros(3, 2)
    with pytest.raises(ConversionError) as info:
        convert_hf_to_mcore(_toy_rules(), bad)
    text = str(info.value)
    assert "missing source tensor hf.1.weight" in text
    assert "unconsumed source tensor stray.bias (7,)" in text
    assert "gate.weight (4, 2), up.weight (3, 2)" in text
    assert len(info.value.problems) == 3
    assert set(convert_hf_to_mcore(_toy_rules(), good)[0]) == {"a.0.w", "a.1.w", "fc.weight"}


def test_mcore_reader_accepts_local_spelling_and_ignores_extra_state():
    fam = families.get("pixtral")
    cfg = fam.tiny_config()
    sd = random_like_state(fam.build_reference(cfg).state_dict(), seed=3)
    shard = families.get("pixtral").hf_to_mcore(sd, cfg, spelling="local")[0]
    assert any(k.endswith("input_layernorm.weight") for k in shard)
    shard["decoder.layers.0.self_attention.linear_proj._extra_state"] = None
    back = families.get("pixtral").mcore_to_hf([shard], cfg)
    assert all(torch.equal(back[k], v) for k, v in sd.items())


def test_tp_that_does_not_divide_heads_is_a_clear_error():
    cfg = families.get("pixtral").tiny_config()
    sd = random_like_state(families.get("pixtral").build_reference(cfg).state_dict(), seed=0)
    with pytest.raises(ConversionError, match="tp=3 does not divide num_attention_heads=4"):
        families.get("pixtral").hf_to_mcore(sd, cfg, tp_size=3)


def _scale_within_exact_shift(key: str, value: torch.Tensor) -> torch.Tensor:
    """A norm scale kept in [0.5, 2): where HF stores a norm's scale and Megatron its offset from
    one (Qwen3.5's DeltaNet output norm), only those offsets are exact in every dtype, and the
    converter refuses the rest (tests/models/test_qwen3_5_text.py); the draws' 1 +- 0.2 leave the
    range a few times in a thousand, which made this property fail by chance."""
    if value.dim() == 1 and "norm" in key and key.endswith("weight"):
        return value.clamp(0.5, 1.9)
    return value


@pytest.mark.parametrize("family", families.names())
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_round_trip_bit_exact_for_random_configs_and_tp(family, data):
    """The one round-trip property, over every registered family: HF -> mcore at a TP size the
    converter accepts -> HF is the identity, bit for bit, in every dtype."""
    cfg, tp_size = data.draw(config_and_tp(family))
    dtype = data.draw(st.sampled_from(DTYPES))
    fam = families.get(family)
    reference = fam.build_reference(cfg)
    sd = {k: _scale_within_exact_shift(k, v).to(dtype)
          for k, v in random_like_state(reference.state_dict(), data.draw(st.integers(0, 999))).items()}
    shards = families.get(family).hf_to_mcore(sd, cfg, tp_size=tp_size)
    assert len(shards) == tp_size
    back = families.get(family).mcore_to_hf(shards, cfg)
    # What the table drops on purpose (e.g. a tied lm_head, the same tensor as the embedding) does
    # not come back; everything else does, bit for bit.
    drops = [re.compile(p) for p in fam.rule_set(cfg, keys=sd.keys()).drop_hf]
    kept = {k: v for k, v in sd.items() if not any(d.match(k) for d in drops)}
    assert set(back) == set(kept)
    for key, value in kept.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


@pytest.mark.parametrize("family", families.names())
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_piece_forms_of_every_rule_join_to_the_op(family, data):
    """Writers put `apply_pieces` / `invert_pieces` output straight into files: joined along dim 0
    the pieces must be exactly what `apply` / `invert` give, for every rule of every family."""
    from mmparity.mapping import rules as R

    cfg = data.draw(config_and_tp(family))[0]
    reference = families.get(family).build_reference(cfg)
    sd = {k: _scale_within_exact_shift(k, v)
          for k, v in random_like_state(reference.state_dict(), data.draw(st.integers(0, 999))).items()}
    rule_set = families.get(family).rule_set(cfg, None)
    prefix = R.detect_prefix(rule_set, {k: None for k in sd})
    for step in R.plan_steps(rule_set):
        hf = [sd[prefix + k] for k in step.hf_keys]
        mcore = step.rule.op.apply(hf)
        for joined, pieces in zip(mcore, step.rule.op.apply_pieces(hf)):
            assert torch.equal(torch.cat([p.reshape(-1) for p in pieces]), joined.reshape(-1)), step.mcore_keys
        for joined, pieces in zip(step.rule.op.invert(mcore), step.rule.op.invert_pieces(mcore)):
            assert torch.equal(torch.cat([p.reshape(-1) for p in pieces]), joined.reshape(-1)), step.hf_keys


@pytest.mark.parametrize("shapes, dim", [([(3, 4), (5, 4)], 0), ([(2, 3, 4), (2, 1, 4), (2, 2, 4)], 1),
                                         ([(2, 3), (2, 5)], -1), ([(4,)], 0)])
def test_cat_on_meta_is_torch_cat_by_shape(shapes, dim):
    """Planning joins meta tensors by shape alone (tp.cat); the result is what torch.cat gives."""
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16][:len(shapes)]
    real = torch.cat([torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes)], dim=dim)
    meta = tp.cat([torch.empty(s, dtype=d, device="meta") for s, d in zip(shapes, dtypes)], dim=dim)
    assert meta.is_meta and meta.shape == real.shape and meta.dtype == real.dtype and meta.is_contiguous()
    assert torch.equal(tp.cat([torch.ones(s) for s in shapes], dim=dim), torch.cat([torch.ones(s) for s in shapes], dim=dim))


def test_cat_on_meta_refuses_what_torch_cat_refuses():
    with pytest.raises(RuntimeError, match="Sizes of tensors must match except in dimension 0"):
        tp.cat([torch.empty(3, 4, device="meta"), torch.empty(3, 5, device="meta")])


def _dense_then_moe() -> RuleSet:
    """Layers 0..1 dense, 2..4 "MoE" under another key: one variable per kind of layer, the second
    starting at 2."""
    from mmparity.mapping.rules import values

    mc, hf = "decoder.layers.", "model.layers."
    rules = (
        rename(mc + "{i}.mlp.linear_fc1.weight", hf + "{i}.mlp.up.weight", "column"),
        rename(mc + "{i}.mlp.linear_fc2.weight", hf + "{i}.mlp.down.weight", "row"),
        rename(mc + "{m}.mlp.router.weight", hf + "{m}.moe.gate.weight"),
        rename(mc + "{m}.mlp.experts.linear_fc1.weight", hf + "{m}.moe.up.weight", "column"),
        rename("decoder.final_layernorm.weight", "model.norm.weight"),
    )
    assert list(values((2, 5))) == [2, 3, 4] and values(range(2, 5)) == range(2, 5)
    return RuleSet(rules, variables={"i": 2, "m": (2, 5)})


def _dense_then_moe_hf() -> dict:
    g = torch.Generator().manual_seed(0)
    state = {"model.norm.weight": torch.randn(4, generator=g)}
    for i in range(2):
        state[f"model.layers.{i}.mlp.up.weight"] = torch.randn(6, 4, generator=g)
        state[f"model.layers.{i}.mlp.down.weight"] = torch.randn(4, 6, generator=g)
    for m in range(2, 5):
        state[f"model.layers.{m}.moe.gate.weight"] = torch.randn(3, 4, generator=g)
        state[f"model.layers.{m}.moe.up.weight"] = torch.randn(8, 4, generator=g)
    return state


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_range_from_k_round_trips_bit_exact(tp_size):
    from mmparity.mapping.rules import convert_mcore_to_hf, expected_keys

    rule_set, hf_state = _dense_then_moe(), _dense_then_moe_hf()
    hf_keys, mcore_keys = expected_keys(rule_set)
    assert sorted(hf_keys) == sorted(hf_state)
    assert "decoder.layers.2.mlp.router.weight" in mcore_keys
    assert "decoder.layers.1.mlp.router.weight" not in mcore_keys
    assert "decoder.layers.2.mlp.linear_fc1.weight" not in mcore_keys
    shards = convert_hf_to_mcore(rule_set, hf_state, tp_size)
    assert shards[-1]["decoder.layers.4.mlp.experts.linear_fc1.weight"].shape == (8 // tp_size, 4)
    back = convert_mcore_to_hf(rule_set, shards)
    assert back.keys() == hf_state.keys()
    assert all(tp.same_bytes(back[k], hf_state[k]) for k in hf_state)


def test_a_range_from_k_splits_over_pipeline_stages():
    from mmparity.parallel import pp

    shards = convert_hf_to_mcore(_dense_then_moe(), _dense_then_moe_hf(), 1)
    layout = pp.pipeline_layout(list(shards[0]))
    assert layout.layer_ranges(2) == [range(0, 3), range(3, 5)]
    stages = pp.split_pipeline_stages(shards[0], layout.layer_counts(2))
    assert sorted(stages[0]) == [
        "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
        "decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc2.weight",
        "decoder.layers.2.mlp.experts.linear_fc1.weight", "decoder.layers.2.mlp.router.weight"]
    # Global MoE layers 3 and 4 are the last stage's local 0 and 1, with the final norm.
    assert sorted(stages[1]) == [
        "decoder.final_layernorm.weight",
        "decoder.layers.0.mlp.experts.linear_fc1.weight", "decoder.layers.0.mlp.router.weight",
        "decoder.layers.1.mlp.experts.linear_fc1.weight", "decoder.layers.1.mlp.router.weight"]
    merged = pp.merge_pipeline_stages(stages)
    assert merged.keys() == shards[0].keys()
    assert all(merged[k] is shards[0][k] for k in merged)


_SPELLING_SEGMENTS = ["decoder.", "layers.", "1.", "12.", "mtp.", "input_layernorm.", "pre_mlp_layernorm.",
                      "self_attention.", "mlp.", "experts."]
_SPELLING_TAILS = ["self_attention.linear_kv_down_proj.weight", "mlp.router.weight", "mlp.router.expert_bias",
                   "input_layernorm.weight", "input_layernorm.bias", "pre_mlp_layernorm.weight",
                   "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.weight",
                   "self_attention.linear_qkv._extra_state"]


def _te_spelling_by_scan(state):
    """The first definition of ``to_te_spelling``: every key tested against every unfused prefix."""
    unfused = {m.group(1) + ("input_layernorm." if "attention" in m.group(2) else "pre_mlp_layernorm.")
               for key in state if (m := R._UNFUSED_NORM_LAYERS.match(key))}
    return {key if any(key.startswith(p) for p in unfused) else R._respell(key, R._LOCAL_TO_TE): value
            for key, value in state.items() if not key.endswith("_extra_state")}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.sampled_from(_SPELLING_SEGMENTS), max_size=5),
                          st.lists(st.sampled_from(_SPELLING_TAILS), min_size=1, max_size=4)), max_size=8))
def test_te_spelling_keeps_unfused_norms_like_a_scan_of_every_prefix(layers):
    # Layer prefixes made of norm segments too, so a norm marker can occur in a key before the one
    # that ends an unfused prefix, and one layer's prefix can be the start of another's.
    state = {"".join(prefix) + tail: i for i, (prefix, tails) in enumerate(layers) for tail in tails}
    assert to_te_spelling(state) == _te_spelling_by_scan(state)


def test_te_spelling_respells_fused_layers_and_keeps_mla_and_moe_norms():
    state = {"decoder.layers.0.input_layernorm.weight": 0, "decoder.layers.0.pre_mlp_layernorm.weight": 1,
             "decoder.layers.1.input_layernorm.weight": 2, "decoder.layers.1.pre_mlp_layernorm.weight": 3,
             "decoder.layers.1.self_attention.linear_kv_down_proj.weight": 4,
             "decoder.layers.1.mlp.router.weight": 5, "decoder.layers.10.input_layernorm.weight": 6,
             "decoder.layers.0.self_attention.linear_qkv._extra_state": 7}
    assert to_te_spelling(state) == {
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": 0,
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": 1,
        "decoder.layers.1.input_layernorm.weight": 2, "decoder.layers.1.pre_mlp_layernorm.weight": 3,
        "decoder.layers.1.self_attention.linear_kv_down_proj.weight": 4,
        "decoder.layers.1.mlp.router.weight": 5,
        # layer 10 shares layer 1's text but not its prefix: it is fused
        "decoder.layers.10.self_attention.linear_qkv.layer_norm_weight": 6}
