"""Qwen3.5-MoE VL vision tower: conversion, layout facts, parity cases, limits, negative controls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mmparity.models import registry as families
from mmparity.models.qwen3_5 import cases as qwen_cases
from mmparity.models.qwen3_5 import native as native_qwen
from mmparity.mapping.ops import RegroupQKV
from mmparity.mapping.rules import ConversionError
from mmparity.parity import harness
from mmparity.models.core import inputs
from mmparity.models.core.inputs import random_like_state
from tests.strategies import family_configs, tp_sizes

FAMILY = "qwen3_5"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fam():
    return families.get(FAMILY)


def tiny():
    return fam().tiny_config()


def rel_l2(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def pair():
    """(cfg, HF model with seeded weights, native model loaded through the converter)."""
    cfg = tiny()
    ref = fam().build_reference(cfg)
    state = random_like_state(ref.state_dict(), seed=11)
    ref.load_state_dict(state)
    native = fam().build_native(cfg)
    native.load_state_dict(families.get(FAMILY).hf_to_mcore(state, cfg)[0], strict=True)
    return cfg, ref, native


# --- conversion ----------------------------------------------------------------------------------

# A whole Qwen3_5MoeForConditionalGeneration also holds these; none of them is the tower's.
NON_VISION = {"model.language_model.layers.0.mlp.experts.gate_up_proj": (2, 16, 8),
              "model.language_model.embed_tokens.weight": (11, 8),
              "lm_head.weight": (11, 8), "mtp.layers.0.fc.weight": (8, 16)}


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_round_trip_bit_exact_over_configs_tp_dtypes_and_vlm_prefixes(data):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    cfg = data.draw(family_configs(FAMILY))
    tp_size = data.draw(st.sampled_from(tp_sizes(FAMILY, cfg)))
    dtype = data.draw(st.sampled_from(DTYPES))
    prefix = data.draw(st.sampled_from(["", "visual.", "model.visual."]))
    shapes = Qwen3_5MoeVisionModel(cfg).state_dict()
    vision = {prefix + k: v.to(dtype) for k, v in
              random_like_state(shapes, data.draw(st.integers(0, 999))).items()}
    checkpoint = dict(vision)
    if prefix:
        checkpoint.update({k: torch.zeros(s) for k, s in NON_VISION.items()})
    shards = families.get(FAMILY).hf_to_mcore(checkpoint, cfg, tp_size=tp_size)
    assert len(shards) == tp_size
    back = families.get(FAMILY).mcore_to_hf(shards, cfg, prefix=prefix)
    assert set(back) == set(vision)
    for key, value in vision.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


@pytest.mark.parametrize("tp_size", [2, 4])
def test_every_parameter_kind_shards_as_mcore_expects(tp_size):
    cfg = tiny()
    heads, hd, layers = cfg.num_heads, cfg.hidden_size // cfg.num_heads, cfg.depth
    sd = random_like_state(fam().build_reference(cfg).state_dict(), seed=3)
    shards = families.get(FAMILY).hf_to_mcore(sd, cfg, tp_size=tp_size)
    per = heads // tp_size

    def rows(t, r):
        return t.chunk(tp_size, dim=0)[r]

    def cols(t, r):
        return t.chunk(tp_size, dim=1)[r]

    def same(mcore_key, hf_key, split=None):
        expected = sd[hf_key] if split is None else split(sd[hf_key], r)
        assert torch.equal(shard[mcore_key], expected), (r, mcore_key)

    for r, shard in enumerate(shards):
        for i in range(layers):
            hf, nat = f"blocks.{i}.", f"decoder.layers.{i}."
            attn, mlp = nat + "self_attention.", nat + "mlp."
            for kind in ("weight", "bias"):
                fused = sd[hf + f"attn.qkv.{kind}"]
                q, k, v = fused.view(3, heads, hd, *fused.shape[1:])
                # MHA: each query group is one head, laid out [q_h; k_h; v_h]; rank r owns whole heads.
                heads_r = range(r * per, (r + 1) * per)
                expect = torch.cat([torch.cat([q[h], k[h], v[h]]) for h in heads_r])
                assert torch.equal(shard[attn + f"linear_qkv.{kind}"], expect)
            same(attn + "linear_proj.weight", hf + "attn.proj.weight", cols)
            same(attn + "linear_proj.bias", hf + "attn.proj.bias")
            same(mlp + "linear_fc1.weight", hf + "mlp.linear_fc1.weight", rows)
            same(mlp + "linear_fc1.bias", hf + "mlp.linear_fc1.bias", rows)
            same(mlp + "linear_fc2.weight", hf + "mlp.linear_fc2.weight", cols)
            same(mlp + "linear_fc2.bias", hf + "mlp.linear_fc2.bias")
            for kind in ("weight", "bias"):
                same(attn + f"linear_qkv.layer_norm_{kind}", hf + f"norm1.{kind}")
                same(mlp + f"linear_fc1.layer_norm_{kind}", hf + f"norm2.{kind}")
        # Megatron's merger linears are whole on every rank.
        for key in ("merger.linear_fc1.weight", "merger.linear_fc1.bias", "merger.linear_fc2.weight",
                    "merger.linear_fc2.bias", "patch_embed.proj.weight", "patch_embed.proj.bias",
                    "pos_embed.weight"):
            same(key, key)
        same("merger.patch_norm.weight", "merger.norm.weight")
        same("merger.patch_norm.bias", "merger.norm.bias")
    qkv_key = "decoder.layers.0.self_attention.linear_qkv.weight"
    # The engine's op agrees with the explicit per-head layout above.
    assert torch.equal(RegroupQKV(heads, heads, hd).apply([sd["blocks.0.attn.qkv.weight"]])[0],
                       torch.cat([s[qkv_key] for s in shards]))


def test_whole_vlm_checkpoint_reads_only_the_tower_and_drops_the_rest():
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    vision = tiny()
    whole_cfg = Qwen3_5MoeConfig(vision_config=vision.to_dict(), text_config=dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=64, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        num_experts=2, num_experts_per_tok=1, linear_num_value_heads=2, linear_num_key_heads=1,
        layer_types=["full_attention"]))
    whole = Qwen3_5MoeForConditionalGeneration(whole_cfg).state_dict()
    whole["mtp.fc.weight"] = torch.zeros(4, 4)
    tower = {k[len("model.visual."):]: v for k, v in whole.items() if k.startswith("model.visual.")}
    assert any(k.startswith("model.language_model.") for k in whole) and "lm_head.weight" in whole

    class Recording(dict):
        read: set = set()

        def __getitem__(self, key):
            self.read.add(key)
            return super().__getitem__(key)

    recorded = Recording(whole)
    selected, prefix, _ = families.get(FAMILY).select_tensors(whole_cfg, recorded)
    assert prefix == "model.visual." and recorded.read == {"model.visual." + k for k in tower}
    assert set(selected) == set(tower)

    from_whole = families.get(FAMILY).hf_to_mcore(whole, whole_cfg, tp_size=2)
    from_tower = families.get(FAMILY).hf_to_mcore(tower, vision, tp_size=2)
    for a, b in zip(from_whole, from_tower):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    back = families.get(FAMILY).mcore_to_hf(from_whole, vision, prefix="model.visual.")
    assert set(back) == {"model.visual." + k for k in tower}

    stray = dict(whole, **{"model.visual.extra.weight": torch.zeros(2)})
    with pytest.raises(ConversionError, match=r"unconsumed source tensor model\.visual\.extra\.weight"):
        families.get(FAMILY).hf_to_mcore(stray, vision)


def test_tp_that_does_not_fit_names_the_sizes():
    sd = random_like_state(fam().build_reference(tiny()).state_dict(), seed=0)
    with pytest.raises(ConversionError, match=r"tp=5 does not divide num_heads.* = 4") as info:
        families.get(FAMILY).hf_to_mcore(sd, tiny(), tp_size=5)
    assert "intermediate_size (mlp.linear_fc1 / linear_fc2) = 44" in str(info.value)
    assert "merger" not in str(info.value)  # whole on every rank: any TP fits


# --- layout facts --------------------------------------------------------------------------------

def test_processor_rows_are_block_first_and_flattened_c_t_p_p():
    p, m, t = 2, 2, 2
    frames = torch.arange(t * 3 * 8 * 12, dtype=torch.float32).view(t, 3, 8, 12)
    rows = inputs.block_first_patch_rows(frames, p, m)
    expected = []
    for bi in range(8 // (p * m)):
        for bj in range(12 // (p * m)):
            for di in range(m):
                for dj in range(m):
                    y, x = (bi * m + di) * p, (bj * m + dj) * p
                    patch = frames[:, :, y:y + p, x:x + p]  # (T, C, P, P)
                    expected.append(patch.permute(1, 0, 2, 3).flatten())
    assert torch.equal(rows, torch.stack(expected))
    # The native token permutation applied to raster patches gives the same order.
    from mmparity.models.qwen3_5.native import block_first

    raster = inputs.patchify(frames[0], p).unsqueeze(0)
    assert torch.equal(block_first(raster, 4, 6, m)[0], inputs.block_first_patch_rows(frames[:1], p, m))


def test_patch_rows_of_both_widths_and_a_clear_error_otherwise(pair):
    cfg, ref, native = pair
    p, m, t = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
    img = inputs.images([(4 * p, 6 * p)], cfg.in_channels, seed=2)[0]
    still = inputs.block_first_patch_rows(img.unsqueeze(0).expand(t, -1, -1, -1), p, m)
    single = inputs.block_first_patch_rows(img.unsqueeze(0), p, m)
    with torch.no_grad():
        hf = ref.patch_embed(still)
        assert rel_l2(native.patch_embed(still.unsqueeze(0))[0], hf) < 1e-6
        assert rel_l2(native.patch_embed(single.unsqueeze(0))[0], hf) < 1e-6
        widths = r"C\*T\*P\*P = 3\*2\*5\*5 = 150 .* C\*P\*P = 75 .* got 74"
        with pytest.raises(ValueError, match=widths):
            native.patch_embed(single[:, :-1].unsqueeze(0))
        # (ΣN, D) rows, as the processor returns them, are accepted without a batch axis.
        out2d = native(still, imgs_sizes=[(4 * p, 6 * p)])
        out3d = native(still.unsqueeze(0), imgs_sizes=[(4 * p, 6 * p)])
        assert torch.equal(out2d, out3d)


def test_position_embedding_is_bilinear_align_corners_on_any_grid(pair):
    cfg, _, native = pair
    g = int(cfg.num_position_embeddings ** 0.5)
    table = native.pos_embed.weight.detach()
    image = table.view(1, g, g, -1).permute(0, 3, 1, 2)
    with torch.no_grad():
        assert torch.equal(native.pos_embed(g, g), table)  # corners and nodes hit exactly
        for h, w in [(2, 4), (1, 7), (g + 3, 2 * g + 1), (4 * g, 3)]:
            ours = native.pos_embed(h, w)
            theirs = F.interpolate(image, size=(h, w), mode="bilinear", align_corners=True)
            assert rel_l2(ours, theirs[0].flatten(1).T) < 1e-6, (h, w)


def test_rope_angles_follow_the_axial_formula(pair):
    cfg, _, native = pair
    hd = cfg.hidden_size // cfg.num_heads
    rows, cols = torch.tensor([0, 3, 17]), torch.tensor([5, 0, 40])
    freqs = native.rotary_pos_emb(rows, cols)[:, 0, 0]
    k = torch.arange(hd // 4, dtype=torch.float64)
    inv = 10000.0 ** (-2 * k / (hd // 2))
    half = torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=-1)
    assert freqs.shape == (3, hd)
    assert torch.allclose(freqs.double(), torch.cat([half, half], -1), rtol=1e-6)


def test_merger_is_hf_merger_with_exact_gelu(pair):
    cfg, ref, native = pair
    grids = [(2, 4), (6, 2)]
    x = inputs.token_probe(sum(h * w for h, w in grids), cfg.hidden_size, seed=9)
    with torch.no_grad():
        ours = native.merger(x.unsqueeze(0), [2, 6], [4, 2])[0]
        hf = ref.merger(x)
        assert rel_l2(ours, hf) < 1e-6
        # The check can tell erf from tanh GELU (the upstream merger's choice) at these scales.
        m = ref.merger
        grouped = m.norm(x).view(-1, 4 * cfg.hidden_size)
        tanh = m.linear_fc2(F.gelu(m.linear_fc1(grouped), approximate="tanh"))
        assert rel_l2(tanh, hf) > 1e-4
        with pytest.raises(ValueError, match="does not hold the 20 tokens"):
            native.merger(x[:-4].unsqueeze(0), [2, 6], [4, 2])


# --- the tower -----------------------------------------------------------------------------------

def test_check_passes_every_case_and_component():
    report = harness.check(FAMILY, seed=0)
    names = {r.check for r in report.results}
    outputs = {f"{c}:{o}" for c in ("static", "packed", "processor_rows")
               for o in ("last_hidden_state", "pooler_output")}
    parts = {f"component:{c}" for c in ("patch_embed", "pos_embed", "rope2d", "block_first", "merger")}
    assert names == outputs | parts
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
    assert all(r.metrics["rel_l2"] <= 1e-5 for r in report.results)
    # The packed case spans the learned table: one grid inside it, one beyond it on both axes.
    cfg = tiny()
    g, p = int(cfg.num_position_embeddings ** 0.5), cfg.patch_size
    grids = [(h // p, w // p) for h, w in qwen_cases.default_image_sizes(cfg)]
    assert len(set(grids)) >= 3
    assert any(h < g and w < g for h, w in grids) and any(h > g and w > g for h, w in grids)


def test_grids_far_beyond_the_table_and_nominal_size_work_like_hf(pair):
    cfg, _, native = pair
    p, g = cfg.patch_size, int(cfg.num_position_embeddings ** 0.5)
    # Decision: no cap. The nominal size (img_h/img_w = table side) is not a limit.
    assert native.img_w // native.patch_dim == g < 4 * g + 2
    sizes = [(4 * p, (4 * g + 2) * p), ((3 * g + 1) * p, 2 * p), (2 * p, 2 * p)]
    report = harness.check(FAMILY, seed=6, image_sizes=sizes, components=False)
    assert report.passed, [(r.check, r.metrics) for r in report.failures()]


def test_packed_images_attend_only_to_themselves(pair):
    cfg, _, native = pair
    p = cfg.patch_size
    sizes = [(2 * p, 4 * p), (6 * p, 2 * p), (4 * p, 4 * p)]
    imgs = inputs.images(sizes, cfg.in_channels, seed=4)
    rows = torch.cat([inputs.block_first_patch_rows(i.unsqueeze(0), p, 2) for i in imgs]).unsqueeze(0)
    with torch.no_grad():
        packed = native(rows, imgs_sizes=sizes)[0]
        alone = torch.cat([native(i.unsqueeze(0))[0] for i in imgs])
    assert packed.shape == alone.shape and rel_l2(packed, alone) < 1e-6


def test_bad_inputs_are_clear_errors(pair):
    cfg, _, native = pair
    p = cfg.patch_size
    with torch.no_grad():
        odd = "patch grid 3x4 is not a positive multiple of spatial_merge_size=2"
        with pytest.raises(ValueError, match=odd):
            native(torch.zeros(1, 3, 3 * p, 4 * p))
        with pytest.raises(ValueError, match="describe 8 patches but the input has 7 rows"):
            native(torch.zeros(1, 7, 75), imgs_sizes=[(2 * p, 4 * p)])
        with pytest.raises(ValueError, match="need imgs_sizes"):
            native(torch.zeros(1, 8, 75))
    bad = tiny()
    bad.num_position_embeddings = 24
    with pytest.raises(ValueError, match="num_position_embeddings=24 is not a perfect square"):
        native_qwen.build_native(bad)


def test_low_precision_within_policy():
    report = harness.check(FAMILY, dtype="bfloat16", seed=1, components=False)
    assert report.passed, [(r.check, r.metrics, r.tolerance) for r in report.failures()]


# --- negative controls ---------------------------------------------------------------------------

def _bump(key, index=(0, 0), by=0.5):
    def mutate(state):
        state[key] = state[key].clone()
        state[key][index] += by
    return mutate


def _swap_q_heads(state):
    key = "decoder.layers.0.self_attention.linear_qkv.weight"
    w, hd = state[key].clone(), tiny().hidden_size // tiny().num_heads
    # MHA: rows [q_0, k_0, v_0, q_1, ...]; q of head 1 starts at 3·hd.
    w[:hd], w[3 * hd:4 * hd] = state[key][3 * hd:4 * hd], state[key][:hd]
    state[key] = w


@pytest.mark.parametrize("mutate, module", [
    (_swap_q_heads, "layer.0.self_attention"),
    (_bump("decoder.layers.1.mlp.linear_fc1.bias", (3,)), "layer.1.mlp"),
    (_bump("patch_embed.proj.weight", (1, 0, 1, 2, 3)), "patch_embed"),
    (_bump("merger.linear_fc2.weight"), "merger.linear_fc2"),
])
def test_negative_controls_fail_and_name_the_module(mutate, module):
    report = harness.check(FAMILY, seed=2, mutate_native=mutate, components=False)
    failures = report.failures()
    assert failures and {r.first_divergence.module for r in failures} == {module}
    if module == "merger.linear_fc2":  # the pre-projector tokens are untouched
        assert all(r.check.endswith("pooler_output") for r in failures)


def test_perturbed_position_table_fails_its_component():
    report = harness.check(FAMILY, seed=2, mutate_native=_bump("pos_embed.weight", (0, 1)))
    failed = {r.check for r in report.failures()}
    assert "component:pos_embed" in failed and "component:rope2d" not in failed
    assert {r.first_divergence.module for r in report.failures() if ":" in r.check
            and not r.check.startswith("component")} == {"layer.0.input_layernorm"}
