"""Kimi-K2.5 specifics: parity cases, negative controls, the three checkpoint layouts, the adapter.

The generic checks (strict loading, fp32 parity, TP=2, the two standard negative controls) live in
``test_families.py`` / ``test_multirank.py``; this file covers what only this family has.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mmparity.models import registry as families
from mmparity.models.kimi_k25 import mapping as conv
from mmparity.mapping.rules import ConversionError
from mmparity.parity import harness
from mmparity.models.core.inputs import random_like_state
from tests.strategies import family_configs

FAMILY = "kimi_k25"
DTYPES = [torch.float32, torch.bfloat16]


def _fam():
    return families.get(FAMILY)


def _state(cfg, seed=0, dtype=torch.float32):
    ref = _fam().build_reference(cfg)
    return {k: v.to(dtype) for k, v in random_like_state(ref.state_dict(), seed).items()}


def _equal_shards(a: list, b: list) -> None:
    assert len(a) == len(b)
    for rank, (x, y) in enumerate(zip(a, b)):
        assert set(x) == set(y), (rank, set(x) ^ set(y))
        for key in x:
            assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), (rank, key)


def _equal_states(a: dict, b: dict) -> None:
    assert set(a) == set(b), set(a) ^ set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


# --- an independent statement of the release layout (not the converter's ops) -----------------

def _interleave_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rotate-half q/k rows -> release rows: within a head, row 2j is HF row j, row 2j+1 HF row hd/2+j."""
    hd = t.shape[0] // heads
    index = [h * hd + (j // 2 if j % 2 == 0 else hd // 2 + j // 2) for h in range(heads) for j in range(hd)]
    return t[torch.tensor(index)]


_TOWER_RENAMES = [
    (r"^patch_embed\.pos_emb\.position_embeddings$", "patch_embed.pos_emb.weight"),
    (r"^layers\.(\d+)\.norm1\.", r"encoder.blocks.\1.norm0."),
    (r"^layers\.(\d+)\.norm2\.", r"encoder.blocks.\1.norm1."),
    (r"^layers\.(\d+)\.attn\.proj\.", r"encoder.blocks.\1.wo."),
    (r"^layers\.(\d+)\.mlp\.fc1\.", r"encoder.blocks.\1.mlp.fc0."),
    (r"^layers\.(\d+)\.mlp\.fc2\.", r"encoder.blocks.\1.mlp.fc1."),
    (r"^final_layernorm\.", "encoder.final_layernorm."),
]
_PROJECTOR_RENAMES = {
    "release": {"pre_norm": "mm_projector.pre_norm", "in_proj": "mm_projector.proj.0",
                "out_proj": "mm_projector.proj.2"},
    "kimi_vl": {"pre_norm": "multi_modal_projector.pre_norm", "in_proj": "multi_modal_projector.linear_1",
                "out_proj": "multi_modal_projector.linear_2"},
    "hf_saved": {"pre_norm": "model.mm_projector.pre_norm", "in_proj": "mm_projector.proj.0",
                 "out_proj": "mm_projector.proj.2"},
}


def release_layout(hf: dict, cfg, variant: str = "release") -> dict:
    """The same weights in the original remote-code layout (or a projector-name variant)."""
    whole = conv.has_projector(cfg)
    heads = conv.vision_cfg(cfg).num_attention_heads
    out = {}
    for key, value in hf.items():
        if key.startswith("mm_projector."):
            module, param = key[len("mm_projector."):].rsplit(".", 1)
            out[f"{_PROJECTOR_RENAMES[variant][module]}.{param}"] = value
            continue
        name = key[len("vision_tower."):] if whole else key
        qkv = re.match(r"^layers\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)$", name)
        if qkv:
            if qkv.group(2) != "q":
                continue
            i, param = qkv.group(1), qkv.group(3)
            parts = [hf[key.replace("q_proj", f"{x}_proj")] for x in "qkv"]
            name = f"encoder.blocks.{i}.wqkv.{param}"
            value = torch.cat([_interleave_rows(parts[0], heads), _interleave_rows(parts[1], heads),
                               parts[2]])
        else:
            for pattern, repl in _TOWER_RENAMES:
                name = re.sub(pattern, repl, name)
            if variant == "hf_saved" and name.startswith("patch_embed.proj."):
                name = "encoder." + name
        out[("vision_tower." if whole else "") + name] = value
    return out


# --- configs -------------------------------------------------------------------------------

@st.composite
def config_and_tp(draw):
    cfg = draw(family_configs(FAMILY))
    return cfg, draw(st.sampled_from([t for t in (1, 2, 3, 4) if not conv.tp_problems(cfg, t)]))


# --- parity --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def report():
    return harness.check(FAMILY)


def test_check_passes_every_case_and_component(report):
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
    got = {r.check: r.metrics["rel_l2"] for r in report.results}
    for case in ("static", "packed", "video"):
        for output in ("pooler_output", "last_hidden_state", "image_embeds"):
            assert got[f"{case}:{output}"] <= 1e-5
    assert got["projector:image_embeds"] <= 1e-5
    for name in ("patch_embed", "pos_embed", "rope2d", "merger"):
        assert got[f"component:{name}"] <= 1e-5
    # Every paired module was compared in every image case.
    static = next(r for r in report.results if r.check == "static:pooler_output")
    assert [m["module"] for m in static.modules] == [
        "patch_embed", "pos_embed",
        *[f"layer.{i}{sub}" for i in (0, 1)
          for sub in (".input_layernorm", ".self_attention", ".pre_mlp_layernorm", ".mlp", "")],
        "final_layernorm", "projector"]


def test_cases_cover_the_resampling_identity_and_video_paths():
    cfg = _fam().tiny_config()
    vc = cfg.vision_config
    table = (vc.pos_emb_height, vc.pos_emb_width)
    p = vc.patch_size
    by_name = {c.name: c for c in _fam().hooks.parity.cases(cfg, 0)}
    grids = lambda case: [(h // p, w // p) for h, w in case.data["sizes"]]  # noqa: E731
    static = grids(by_name["static"])
    assert static[0][0] != static[0][1] and all(a != b for a, b in zip(static[0], table))
    assert table in grids(by_name["packed"]) and len(set(grids(by_name["packed"]))) == 3
    assert by_name["video"].data["frames"][0] == 3 and by_name["video"].data["images"][0].shape[0] == 3
    for case in ("static", "packed", "video"):
        for h, w in grids(by_name[case]):  # merged grids with an odd side
            assert h % 2 == 0 and w % 2 == 0 and ((h // 2) % 2 or (w // 2) % 2)


def test_user_image_sizes_and_low_precision_pass():
    assert _fam().hooks.config.image_size_multiple(_fam().tiny_config()) == 10
    sized = harness.check(FAMILY, image_sizes=[(20, 30), (40, 10)], components=False)
    assert sized.passed, [(r.check, r.metrics) for r in sized.failures()]
    bf16 = harness.check(FAMILY, dtype="bfloat16")
    assert bf16.passed, [(r.check, r.metrics, r.tolerance) for r in bf16.failures()]


def _perturb(key):
    def mutate(state):
        noise = torch.randn(state[key].shape, generator=torch.Generator().manual_seed(9))
        state[key] = state[key] + 0.05 * noise
    return mutate


def _swap_q_heads(state):
    key = "vision_model.decoder.layers.0.self_attention.linear_qkv.weight"
    hd = 12  # tiny config: 4 heads of 12; MHA rows per head are [q_h, k_h, v_h]
    w = state[key].clone()
    w[0:hd], w[3 * hd:4 * hd] = state[key][3 * hd:4 * hd], state[key][0:hd]
    state[key] = w


@pytest.mark.parametrize("mutate, module", [
    (_perturb("vision_model.patch_embed.proj.weight"), "patch_embed"),
    (_perturb("vision_model.pos_embed.weight"), "pos_embed"),
    (_swap_q_heads, "layer.0.self_attention"),
    (_perturb("vision_model.decoder.layers.1.mlp.linear_fc2.weight"), "layer.1.mlp"),
    (_perturb("vision_model.final_ln.bias"), "final_layernorm"),
    (_perturb("vision_projection.encoder.linear_fc1.weight"), "projector"),
    # Kimi's pre-norm, tiled into the fused norm of Megatron's linear_fc1: the native model reads it.
    (_perturb("vision_projection.encoder.linear_fc1.layer_norm_bias"), "projector"),
], ids=["patch_embed", "pos_embed", "swapped_q_heads", "layer1_fc2", "final_norm", "projector",
        "projector_norm"])
def test_negative_controls_name_the_module(mutate, module):
    result = harness.check(FAMILY, seed=1, mutate_native=mutate, components=False)
    assert not result.passed
    assert {r.first_divergence.module for r in result.failures()} == {module}


# --- checkpoint layouts ------------------------------------------------------------------------

@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_layouts_give_identical_mcore_tensors_and_round_trip_bit_exact(data):
    cfg, tp_size = data.draw(config_and_tp())
    dtype = data.draw(st.sampled_from(DTYPES))
    hf = _state(cfg, data.draw(st.integers(0, 999)), dtype)
    layouts = {"hf": hf, "release": release_layout(hf, cfg)}
    if conv.has_projector(cfg):
        layouts["kimi_vl"] = release_layout(hf, cfg, "kimi_vl")
        layouts["hf_saved"] = release_layout(hf, cfg, "hf_saved")
    shards = {}
    for fmt, state in layouts.items():
        assert conv.detect_format(state) == fmt
        shards[fmt] = families.get(FAMILY).hf_to_mcore(state, cfg, tp_size=tp_size)
        _equal_shards(shards[fmt], shards["hf"])
    for fmt, state in layouts.items():  # mcore -> either layout, from any source layout
        _equal_states(families.get(FAMILY).mcore_to_hf(shards["release"], cfg, hf_format=fmt), state)


def _whole_model(cfg, seed=0):
    from transformers import Kimi_K25ForConditionalGeneration

    model = Kimi_K25ForConditionalGeneration(cfg).eval()
    model.load_state_dict(random_like_state(model.state_dict(), seed))
    return model


def test_whole_model_checkpoint_drops_the_language_model_explicitly():
    cfg = _fam().tiny_config()
    full = _whole_model(cfg).state_dict()
    assert any(k.startswith("model.language_model.") for k in full) and "lm_head.weight" in full
    ours = {k[len("model."):]: v for k, v in full.items()
            if k.startswith(("model.vision_tower.", "model.mm_projector."))}
    _equal_shards(families.get(FAMILY).hf_to_mcore(full, cfg, tp_size=2),
                  families.get(FAMILY).hf_to_mcore(ours, cfg, tp_size=2))
    # A vision config reads the tower out of the same checkpoint and drops the projector too.
    tower = families.get(FAMILY).hf_to_mcore(full, cfg.vision_config)[0]
    assert not any(k.startswith("vision_projection.") for k in tower)
    assert tower["pos_embed.weight"].shape == (6, 6, 48)
    back = families.get(FAMILY).mcore_to_hf([tower], cfg.vision_config, prefix="model.vision_tower.")
    assert all(torch.equal(v, full[k]) for k, v in back.items())

    stray = dict(full, **{"model.vision_tower.extra.weight": torch.zeros(3)})
    del stray["model.mm_projector.in_proj.bias"]
    with pytest.raises(ConversionError) as info:
        families.get(FAMILY).hf_to_mcore(stray, cfg)
    text = str(info.value)
    assert "missing source tensor model.mm_projector.in_proj.bias" in text
    assert "unconsumed source tensor model.vision_tower.extra.weight (3,)" in text
    with pytest.raises(ConversionError, match="tp=3 does not divide num_attention_heads=4"):
        families.get(FAMILY).hf_to_mcore(full, cfg, tp_size=3)


def test_release_layout_is_what_transformers_loads(tmp_path):
    """Our mcore -> release output, saved as a checkpoint, loads in transformers to the same model."""
    from safetensors.torch import save_file
    from transformers import Kimi_K25ForConditionalGeneration

    cfg = _fam().tiny_config()
    model = _whole_model(cfg, seed=4)
    full = model.state_dict()
    shards = families.get(FAMILY).hf_to_mcore(full, cfg, tp_size=2)
    release = families.get(FAMILY).mcore_to_hf(shards, cfg, hf_format="release")
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in release
    assert "mm_projector.proj.0.weight" in release
    release.update({"language_model.model." + k[len("model.language_model."):]: v
                    for k, v in full.items() if k.startswith("model.language_model.")})
    release["language_model.lm_head.weight"] = full["lm_head.weight"]
    save_file({k: v.contiguous() for k, v in release.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    cfg.save_pretrained(tmp_path)
    loaded = Kimi_K25ForConditionalGeneration.from_pretrained(tmp_path).state_dict()
    _equal_states(loaded, full)
    # A vision config takes the tower out of the same release checkpoint.
    _equal_shards(families.get(FAMILY).hf_to_mcore(release, cfg.vision_config, tp_size=2),
                  families.get(FAMILY).hf_to_mcore(full, cfg.vision_config, tp_size=2))


def test_transformers_save_pretrained_output_converts_and_checks(tmp_path):
    """transformers 5.24 saves Kimi-K2.5 in a near-release layout (``hf_saved``); read it as is."""
    from safetensors.torch import load_file

    from mmparity.cli.main import main

    cfg = _fam().tiny_config()
    model = _whole_model(cfg, seed=6)
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert conv.detect_format(saved) == "hf_saved"
    shards = families.get(FAMILY).hf_to_mcore(saved, cfg)
    _equal_shards(shards, families.get(FAMILY).hf_to_mcore(model.state_dict(), cfg))
    written = families.get(FAMILY).mcore_to_hf(shards, cfg, hf_format="hf_saved")
    _equal_states(written, {k: v for k, v in saved.items() if not k.startswith("language_model.")})
    assert main(["check", FAMILY, "--hf", str(tmp_path), "--quiet", "--no-components"]) == 0


# --- the KimiVL state-dict adapter -------------------------------------------------------------

_SUFFIXES = st.lists(st.from_regex(r"[a-z_]{1,6}(\.[0-9a-z_]{1,4}){0,3}", fullmatch=True),
                     min_size=1, max_size=6, unique=True)


@settings(max_examples=40, deadline=None)
@given(prefixes=st.lists(st.sampled_from(conv.KimiVLStateDictAdapter.HF_PREFIXES), min_size=1, max_size=6),
       suffixes=_SUFFIXES)
def test_adapter_round_trip_is_key_identical(prefixes, suffixes):
    adapter = conv.KimiVLStateDictAdapter()
    hf = {p + s: torch.tensor(float(i)) for i, (p, s) in enumerate(zip(prefixes * len(suffixes), suffixes))}
    native = adapter.from_hf(hf)
    assert all(k.startswith("model.") for k in native)
    back = adapter.to_hf(native)
    assert list(back) == list(hf) and all(back[k] is hf[k] for k in hf)
    assert list(adapter.from_hf(back)) == list(native)


def test_adapter_keeps_the_head_in_place_and_refuses_what_it_cannot_place():
    adapter = conv.KimiVLStateDictAdapter()
    head = torch.zeros(2)
    native = adapter.from_hf({"language_model.lm_head.weight": head,
                              "language_model.model.embed_tokens.weight": head,
                              "multi_modal_projector.linear_1.weight": head})
    assert set(native) == {"model.language_model.lm_head.weight",
                           "model.language_model.model.embed_tokens.weight",
                           "model.multi_modal_projector.linear_1.weight"}
    assert "language_model.lm_head.weight" in adapter.to_hf(native)
    with pytest.raises(ConversionError) as info:
        adapter.from_hf({"lm_head.weight": head, "visual.x": head, "vision_tower.ok": head})
    assert len(info.value.problems) == 2 and "lm_head.weight" in str(info.value)
    with pytest.raises(ConversionError, match="vision_tower.y"):
        adapter.to_hf({"vision_tower.y": head})
    assert adapter.to_hf({"model.vision_tower.a": head, "model.language_model.b": head},
                         exclude_key_regex=r"model\.language_model\.") == {"vision_tower.a": head}


def test_adapter_output_feeds_the_converter():
    cfg = _fam().tiny_config()
    hf = _state(cfg, seed=7)
    kimi_vl = release_layout(hf, cfg, "kimi_vl")
    adapter = conv.KimiVLStateDictAdapter(cfg)
    native = adapter.from_hf(dict(kimi_vl, **{"language_model.lm_head.weight": torch.zeros(4, 40)}))
    restored = adapter.to_hf(native)
    assert conv.detect_format(restored) == "kimi_vl"
    _equal_shards(families.get(FAMILY).hf_to_mcore(restored, cfg), families.get(FAMILY).hf_to_mcore(hf, cfg))


# --- native building blocks --------------------------------------------------------------------

@pytest.fixture(scope="module")
def native():
    cfg = _fam().tiny_config()
    model = _fam().build_native(cfg)
    model.load_state_dict(families.get(FAMILY).hf_to_mcore(_state(cfg, seed=8), cfg)[0], strict=True)
    return model


def test_position_table_identity_bicubic_and_temporal_rows(native):
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionPositionEmbeddings

    pos = native.vision_model.pos_embed
    table = pos.weight.detach()
    assert torch.equal(pos(6, 6, "cpu"), table.flatten(0, 1))  # identity: no resampling at all
    expected = F.interpolate(table.permute(2, 0, 1)[None], size=(4, 10), mode="bicubic",
                             align_corners=False)[0].permute(1, 2, 0).flatten(0, 1)
    assert torch.allclose(pos(4, 10, "cpu"), expected, atol=1e-6)
    hf_time = Kimi_K25VisionPositionEmbeddings(_fam().tiny_config().vision_config).compute_pos_embed()
    assert torch.equal(pos.temporal(4, "cpu"), hf_time[1:])  # HF's row 0 is the still-image pad
    clip = pos.positions(4, 6, 3, "cpu").view(3, 24, -1)
    still = pos.positions(4, 6, 1, "cpu")
    # Frame 0 of a clip also gets its row, sin(0)‖cos(0); a still image gets none.
    assert torch.equal(pos.temporal(3, "cpu")[0], torch.cat([torch.zeros(24), torch.ones(24)]))
    for frame in range(3):
        assert torch.equal(clip[frame], still + pos.temporal(3, "cpu")[frame])
    with pytest.raises(ValueError, match="temporal table of 4 frames"):
        pos.positions(4, 6, 5, "cpu")


def test_rope_angles_are_column_first_pairs(native):
    rope = native.vision_model.rotary_pos_emb  # head_dim 12: three frequencies per axis
    inv = 1.0 / 10000 ** (torch.arange(3) * 4 / 12.0)
    freqs = rope(torch.tensor([2]), torch.tensor([5]))[0, 0, 0]
    expected = torch.stack([5 * inv, 2 * inv], dim=-1).flatten().repeat_interleave(2)
    assert freqs.shape == (12,) and torch.allclose(freqs, expected.float(), rtol=1e-6)


def test_merger_layout_and_temporal_mean(native):
    merger = native.vision_model.merger
    x = torch.arange(24.0).view(1, 24, 1)  # a 4x6 grid, one channel
    assert merger(x, 4, 6)[0].tolist() == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11],
                                           [12, 13, 18, 19], [14, 15, 20, 21], [16, 17, 22, 23]]
    clip = torch.randn(1, 2 * 24, 3)
    mean = (merger(clip[:, :24], 4, 6) + merger(clip[:, 24:], 4, 6)) / 2
    assert torch.allclose(merger(clip, 4, 6, num_frames=2), mean, atol=1e-6)
    with pytest.raises(ValueError, match="divisible by 2"):
        merger(torch.zeros(1, 15, 3), 3, 5)


def test_packed_parts_match_the_per_item_computation(native):
    """The batched RoPE ids, bicubic taps, temporal rows and merger gather give what the per-item
    computation gives: RoPE and merger bit for bit, positions within fp32 rounding (exact at the
    table's own size)."""
    vit = native.vision_model
    pos, rope, merger = vit.pos_embed, vit.rotary_pos_emb, vit.merger
    table = pos.weight.detach()
    grids = [(6, 6), (4, 10), (12, 2), (2, 2), (8, 14), (6, 6)]

    def resampled(h, w):
        if (h, w) == (6, 6):
            return table.flatten(0, 1)
        grid = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bicubic", align_corners=False)
        return grid[0].permute(1, 2, 0).flatten(0, 1)

    with torch.no_grad():
        for frames in ([1] * 6, [3, 1, 2, 1, 4, 1]):
            expected = torch.cat([(resampled(h, w)[None] + (pos.temporal(t, "cpu")[:, None] if t > 1 else 0)
                                   ).flatten(0, 1) for (h, w), t in zip(grids, frames)])
            got = pos.packed(grids, frames)
            assert got.shape == expected.shape and torch.allclose(got, expected, rtol=0, atol=1e-6)
            assert torch.equal(got[:36], expected[:36])  # the table's own grid: no resampling
            assert torch.equal(rope.packed(grids, frames, "cpu"),
                               torch.cat([rope.for_grid(h, w, t, "cpu") for (h, w), t in zip(grids, frames)]))
        x = torch.randn(1, sum(h * w for h, w in grids), 3)
        per_item = [merger(p, h, w) for p, (h, w) in zip(torch.split(x, [h * w for h, w in grids], 1), grids)]
        assert torch.equal(merger.merge_packed(x, grids, [1] * 6), torch.cat(per_item, 1))
    with pytest.raises(ValueError, match="divisible by 2"):
        merger.merge_packed(torch.zeros(1, 4 + 15, 3), [(2, 2), (3, 5)], [1, 1])


# Ops that only make views or read a host scalar: no kernel on a GPU.
_VIEW_OPS = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "slice", "select",
             "unsqueeze", "squeeze", "expand", "split", "split_with_sizes", "unbind", "alias",
             "as_strided", "detach", "_local_scalar_dense"}


def _count_ops(model, run):
    """(ops outside the transformer block, ops inside it), as Counters of aten op names."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    counts, where = (Counter(), Counter()), [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[min(where[0], 1)][str(func.overloadpacket).removeprefix("aten.")] += 1
            return func(*args, **(kwargs or {}))

    decoder = model.vision_model.decoder
    hooks = [decoder.register_forward_pre_hook(lambda *_: where.__setitem__(0, where[0] + 1)),
             decoder.register_forward_hook(lambda *_: where.__setitem__(0, where[0] - 1))]
    try:
        with torch.no_grad(), Count():
            run()
    finally:
        for h in hooks:
            h.remove()
    return counts


def _kernels(ops) -> int:
    return sum(n for op, n in ops.items() if op not in _VIEW_OPS)


def test_packed_mixed_path_op_count_does_not_grow_with_images(native):
    """The packed mixed-size path must not loop over images outside the transformer block: the
    RoPE table, position resampling, temporal rows and merger run as a fixed number of ops for
    any number of items, on a new layout as on a repeated one, and read no tensor on the host (on
    a GPU each such read is a synchronisation). Inside the block the only per-image work that
    launches anything is attention's one SDPA call per distinct length per layer (mcore's THD
    RoPE slices per image, views only)."""
    from mmparity.models.core import inputs
    from mmparity.models.kimi_k25 import native as nat

    patch, layers = native.vision_model.patch_dim, native.vision_model.config.num_layers
    # Distinct token counts (one SDPA call each), table-sized and resampled grids, both ways.
    grids = [(6, 6), (2, 6), (6, 4), (2, 2), (8, 6), (4, 10), (10, 10), (2, 4)]
    runs = {}
    for n in (2, 8):
        sizes = [(h * patch, w * patch) for h, w in grids[:n]]
        rows = inputs.packed_rows(inputs.images(sizes, 3, n), patch)
        runs[n] = lambda rows=rows, sizes=sizes: native(rows, imgs_sizes=sizes)
    for fn in (nat._host_token_ids, nat.packed_patch_ids, nat.packed_bicubic_taps, nat.packed_merge_order):
        fn.cache_clear()
    cold = {n: _count_ops(native, run) for n, run in runs.items()}
    warm = {n: _count_ops(native, run) for n, run in runs.items()}
    for counts in (cold, warm):
        outside = {n: c[0] for n, c in counts.items()}
        assert sum(outside[2].values()) == sum(outside[8].values()), (outside[2], outside[8])
        assert outside[8]["_local_scalar_dense"] == 0
    for op in ("upsample_bicubic2d", "cat"):  # the old per-image resampling and concatenations
        assert warm[8][0][op] == 0, op
    inside_growth = (_kernels(warm[8][1]) - _kernels(warm[2][1])) / 6
    assert inside_growth <= layers, (warm[2][1], warm[8][1])  # one SDPA call per image per layer
    all_growth = (sum(warm[8][1].values()) - sum(warm[2][1].values())) / 6
    assert all_growth <= 20 * layers, all_growth


def test_static_and_packed_inputs_agree(native):
    from mmparity.models.kimi_k25.cases import _rows

    gen = torch.Generator().manual_seed(3)
    images = torch.randn(2, 3, 20, 30, generator=gen)
    clips = torch.randn(2, 3, 3, 20, 30, generator=gen)
    with torch.no_grad():
        static = native(images)
        packed = native(_rows(list(images), 5), imgs_sizes=[(20, 30)] * 2)
        static_clips = native(clips)
        packed_clips = native(_rows(list(clips), 5), imgs_sizes=[(20, 30)] * 2, num_frames=[3, 3])
    assert static.shape == (2, 6, 40)
    assert torch.allclose(static.reshape(1, 12, 40), packed, atol=1e-5)
    assert torch.allclose(static_clips.reshape(1, 12, 40), packed_clips, atol=1e-5)
    # A clip is one attention segment: its frames see each other, so frame order matters.
    with torch.no_grad():
        reordered = native(_rows([clips[0].flip(0)], 5), imgs_sizes=[(20, 30)], num_frames=[3])
        first_frames = native(_rows([clips[0, :1]], 5), imgs_sizes=[(20, 30)])
    assert not torch.allclose(first_frames, packed_clips[:, :6], atol=1e-3)
    assert not torch.allclose(reordered, packed_clips[:, :6], atol=1e-3)


def test_native_refuses_inputs_it_cannot_place(native):
    with pytest.raises(ValueError, match="divisible by 2"):
        native(torch.zeros(1, 3, 15, 30))
    with pytest.raises(ValueError, match="describe 24 patches but the input has 20 rows"):
        native(torch.zeros(1, 20, 75), imgs_sizes=[(20, 30)])
    with pytest.raises(ValueError, match="one count >= 1 per item"):
        native(torch.zeros(1, 24, 75), imgs_sizes=[(20, 30)], num_frames=[1, 1])
    with pytest.raises(ValueError, match="temporal table"):
        native(torch.zeros(1, 5 * 24, 75), imgs_sizes=[(20, 30)], num_frames=[5])


def test_projector_reads_merged_tokens_in_either_shape(native):
    x = torch.randn(5, 4, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = native.vision_projection(x)
        b = native.vision_projection(x.reshape(5, 192))
    assert a.shape == (5, 40) and torch.equal(a, b)
    assert math.isclose(native.vision_projection.encoder.linear_fc1.norm_eps, 1e-5)
