"""Megatron's own classes under test: the layouts they expect, strict loads into them, and parity
with HF.

Three kinds of test:

* always run (no Megatron-LM needed): the recorded layouts in ``tests/data/megatron_layout``
  against what the converter writes, for every registered family whose default Megatron class
  holds the whole model (read off the registry: a new such family without a recorded layout or
  pinned side tensors fails here), what it keeps aside, and its exact way back to HF; the
  stand-ins' parameter names and functions;
* stock classes of the installed megatron-core (``CLIPViTModel``, ``LLaVAModel``,
  ``MultimodalProjector``, ``GPTModel``): their layout against the recorded one at TP 1 and 2,
  strict loads and parity with HF at TP 1 and 2;
* Megatron-LM main's ``vit_model`` classes, skipped with the reason when that file is not
  importable: strict loads and parity at TP 1 and 2, and the four places where Megatron's code
  departs from HF, each reproduced and located.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from megatron.core.extensions import transformer_engine as te_ext
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_transformer_engine_spec
from megatron.core.transformer.enums import AttnMaskType

from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.models import registry as families
from mmparity.parallel import runtime
from mmparity.parity.metrics import compare
from mmparity.models.llava.cases import expected_loss_mask
from mmparity.config import PIXTRAL_NORM_EPS, padded_vocab_size
from mmparity.models.core import megatron_layout as layout, megatron_classes as models, te_stand_ins
from mmparity.models.llava import megatron as llava_megatron
from mmparity.models.pixtral import megatron as pixtral_megatron
from tests import megatron_interop as mi

LAYOUT_DIR = Path(__file__).parents[1] / "data" / "megatron_layout"
# Every family whose default Megatron class holds its whole mcore state dict, from the registry.
ALL_FAMILIES = tuple(mi.whole_class_families())


STOCK_FAMILIES, MAIN_FAMILIES = mi.stock_and_main_families()
HAVE_MAIN = models.available()
needs_main = pytest.mark.skipif(not HAVE_MAIN, reason=models.INSTALL_HINT)
# What Megatron must reach where its code computes HF's function: the project's fp32 policy.
TOL = mi.TOLERANCE


def recorded(family: str) -> dict:
    return json.loads((LAYOUT_DIR / f"{family}.json").read_text())


config_for = mi.layout_config


def converted(family: str, tp: int, seed: int = 0):
    cfg = config_for(family)
    ref = mi.hf_model(family, cfg, seed)
    shards = families.get(family).hf_to_mcore(ref.state_dict(), cfg, tp_size=tp)
    return cfg, shards


# --- always: recorded layout vs the converter ---------------------------------------------------

def assert_megatron_layout(family, tp, states):
    record = recorded(family)
    for rank, state in enumerate(states):
        expected = {k: (e["tp1"] if tp == 1 else e["tp2"][rank]) for k, e in record["tensors"].items()}
        got = {k: list(v.shape) for k, v in state.items()}
        assert got == expected, (family, tp, rank, sorted(set(got) ^ set(expected)),
                                 {k: (got[k], expected[k]) for k in set(got) & set(expected)
                                  if got[k] != expected[k]})


@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("tp", [1, 2])
def test_converter_writes_megatrons_layout(family, tp):
    """The converter's output is exactly the recorded Megatron state dict: same keys, same per-rank
    shapes at TP 1 and TP 2."""
    _, shards = converted(family, tp)
    assert_megatron_layout(family, tp, shards)


def test_recorded_layouts_cover_every_family():
    for family in ALL_FAMILIES:
        record = recorded(family)
        assert record["tp_sizes"] == [1, 2] and record["tensors"], family
        for key, entry in record["tensors"].items():
            split = entry["split_dim"]
            for shape in entry["tp2"]:
                want = [n // 2 if d == split else n for d, n in enumerate(entry["tp1"])]
                assert shape == want, (family, key, entry)


@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("tp", [1, 2])
def test_side_tensors_are_pinned(family, tp):
    cases = importlib.import_module(f"mmparity.models.{family}.cases")
    assert hasattr(cases, "SIDE_TENSORS"), f"pin in SIDE_TENSORS what {family}'s Megatron class has no place for"
    _, shards = converted(family, tp)
    assert all(set(side) == cases.SIDE_TENSORS for side in shards.side)
    assert all(not set(shard) & cases.SIDE_TENSORS for shard in shards)


def test_llava_keeps_aside_what_megatron_has_no_place_for():
    """CLIP tower: the converter writes ``conv1``, sets the layer past vision_feature_layer and
    ``ln_post`` aside, and pads the vocabulary to 128 x TP (256 at TP 2) with zero rows."""
    cfg = mi.llava_clip_config()
    hf = mi.hf_model("llava", cfg, 0).state_dict()
    for tp, rows in ((1, 128), (2, 256)):
        _, shards = converted("llava", tp)
        assert "vision_model.conv1.weight" in shards[0] and "vision_model.patch_conv.conv.weight" not in shards[0]
        assert {k.split(".")[3] for k in shards.side[0] if ".layers." in k} == {"1"}
        assert not any(k.startswith("vision_model.decoder.layers.1.") for k in shards[0])
        assert {"vision_model.ln_post.weight", "vision_model.ln_post.bias"} <= set(shards.side[0])
        assert all(not set(s) & set(side) for s, side in zip(shards, shards.side))
        emb = torch.cat([s["language_model.embedding.word_embeddings.weight"] for s in shards])
        assert emb.shape[0] == rows
        vocab = cfg.text_config.vocab_size
        assert torch.equal(emb[:vocab], hf["model.language_model.embed_tokens.weight"]) and not emb[vocab:].any()


@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("tp", [1, 2])
def test_megatrons_layout_and_side_give_hf_back_exactly(family, tp):
    cfg = config_for(family)
    hf = mi.hf_model(family, cfg, 0).state_dict()
    _, shards = converted(family, tp)
    back = families.get(family).mcore_to_hf(shards, cfg)
    prefix = next(p for p in ("", "model.") if all(p + k in hf for k in back))
    assert all(torch.equal(back[k], hf[prefix + k]) for k in back), family


def test_layout_differences_name_every_moved_key():
    record = recorded("qwen3_5")
    moved = json.loads(json.dumps(record))
    entry = moved["tensors"].pop("merger.linear_fc1.weight")
    entry["split_dim"], entry["tp2"] = 0, [[96, 192], [96, 192]]
    moved["tensors"]["merger.linear_fc1.weight"] = entry
    moved["tensors"]["merger.extra.weight"] = moved["tensors"].pop("merger.linear_fc2.bias")
    lines = layout.differences(record, moved)
    assert len(lines) == 3 and any("changed: merger.linear_fc1.weight" in x for x in lines)
    assert any("missing in Megatron now: merger.linear_fc2.bias" in x for x in lines)
    assert any("new in Megatron now: merger.extra.weight" in x for x in lines)


def test_strict_load_refuses_anything_but_missing_extra_state():
    module = torch.nn.Linear(3, 2)
    with pytest.raises(models.StrictLoadError, match="unexpected 1: extra.weight"):
        models.load_strict(module, {**module.state_dict(), "extra.weight": torch.zeros(1)})
    with pytest.raises(models.StrictLoadError, match="missing 1: bias"):
        models.load_strict(module, {"weight": module.weight.detach()})
    with pytest.raises(models.StrictLoadError, match=r"mis-shaped 1: weight: \(3, 3\) vs \(2, 3\)"):
        models.load_strict(module, {"weight": torch.zeros(3, 3), "bias": torch.zeros(2)})
    before = module.weight.detach().clone()
    with pytest.raises(models.StrictLoadError):
        models.load_strict(module, {"weight": torch.ones(2, 3)})
    assert torch.equal(module.weight, before), "nothing is loaded when anything is refused"


def test_compact_keys_fold_layer_numbers():
    keys = [f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(4)] + ["conv1.weight"]
    assert models.compact_keys(keys) == "decoder.layers.{0..3}.mlp.linear_fc1.weight, conv1.weight"


def test_padded_vocab_follows_megatron_lm():
    assert [padded_vocab_size(101, VOCAB_MULTIPLE, tp=tp) for tp in (1, 2, 4)] == [128, 256, 512]
    assert padded_vocab_size(256, VOCAB_MULTIPLE, tp=2) == 256 and padded_vocab_size(257, VOCAB_MULTIPLE, tp=1) == 384


# --- always: the stand-ins -----------------------------------------------------------------------

def _walk_pairs(original, substituted):
    """Yield (original leaf, substituted leaf) over two specs of the same structure."""
    if isinstance(original, functools.partial):
        yield from _walk_pairs(original.func, substituted.func)
        for a, b in zip(original.args, substituted.args):
            yield from _walk_pairs(a, b)
        for k in original.keywords:
            yield from _walk_pairs(original.keywords[k], substituted.keywords[k])
    elif dataclasses.is_dataclass(original) and not isinstance(original, type):
        assert type(original) is type(substituted)
        for f in dataclasses.fields(original):
            yield from _walk_pairs(getattr(original, f.name), getattr(substituted, f.name))
    elif isinstance(original, dict):
        assert original.keys() == substituted.keys()
        for k in original:
            yield from _walk_pairs(original[k], substituted[k])
    else:
        yield original, substituted


def test_vit_spec_is_megatrons_with_only_te_swapped():
    te_names = {id(getattr(te_ext, n)): n for n in ("TELayerNormColumnParallelLinear",
                                                    "TERowParallelLinear", "TEDotProductAttention")}
    swapped = set()
    for a, b in _walk_pairs(get_vit_layer_with_transformer_engine_spec(), te_stand_ins.vit_layer_spec()):
        if id(a) in te_names:
            assert b is te_stand_ins.te_class(te_names[id(a)])
            swapped.add(te_names[id(a)])
        else:
            assert a is b or a == b
    assert swapped == set(te_names.values())
    assert te_stand_ins.unresolved_te(te_stand_ins.vit_layer_spec()) == []


@pytest.mark.skipif(te_stand_ins.HAVE_TE, reason="Transformer Engine is installed: the real modules run")
def test_stand_ins_have_te_parameter_names_and_tp_shapes():
    runtime.init_parallel(1, 1)
    cfg = models.transformer_config(num_layers=1, hidden_size=12, num_attention_heads=2,
                                    ffn_hidden_size=10, normalization="LayerNorm", norm_eps=1e-5,
                                    activation=F.gelu, gated=False, bias=True)
    init = torch.nn.init.normal_
    fused = te_stand_ins.TELayerNormColumnParallelLinear(
        12, 10, config=cfg, init_method=init, gather_output=False, bias=True, skip_bias_add=False,
        is_expert=False)
    assert {k: tuple(v.shape) for k, v in fused.state_dict().items() if v is not None} == {
        "weight": (10, 12), "bias": (10,), "layer_norm_weight": (12,), "layer_norm_bias": (12,)}
    assert "_extra_state" in fused.state_dict()
    rms = dataclasses.replace(cfg, normalization="RMSNorm")
    norm = te_stand_ins.TENorm(rms, 12, eps=1e-6)
    assert set(norm.state_dict()) == {"weight"} and norm.eps == 1e-6
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(0))
    fused.layer_norm_weight.data.uniform_(0.5, 1.5)
    out, bias = fused(x)
    want = F.linear(F.layer_norm(x, (12,), fused.layer_norm_weight, fused.layer_norm_bias, 1e-5),
                    fused.weight, fused.bias)
    assert bias is None and torch.equal(out, want)


def test_stand_in_attention_packed_gqa_causal():
    runtime.init_parallel(1, 1)
    cfg = models.transformer_config(num_layers=1, hidden_size=16, num_attention_heads=4,
                                    num_query_groups=2, kv_channels=4, ffn_hidden_size=8,
                                    normalization="LayerNorm", norm_eps=1e-5, activation=F.gelu,
                                    gated=False, bias=True)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(7, 1, 4, 4, generator=gen)
    k, v = torch.randn(7, 1, 2, 4, generator=gen), torch.randn(7, 1, 2, 4, generator=gen)

    def plain(q, k, v, causal):
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # (s, h, d)
        scores = torch.einsum("qhd,khd->hqk", q, k) / 2.0
        if causal:
            above = ~torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
            scores = scores.masked_fill(above, -torch.inf)
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)

    bidir = te_stand_ins.TEDotProductAttention(cfg, 1, AttnMaskType.no_mask, "self")
    torch.testing.assert_close(bidir(q, k, v)[:, 0], plain(q[:, 0], k[:, 0], v[:, 0], False))
    causal = te_stand_ins.TEDotProductAttention(cfg, 1, AttnMaskType.causal, "self")
    torch.testing.assert_close(causal(q, k, v)[:, 0], plain(q[:, 0], k[:, 0], v[:, 0], True))
    packed = bidir(q[:, 0], k[:, 0], v[:, 0], packed_seq_params=models.packed_seq_params([3, 4]))
    want = torch.cat([plain(q[:3, 0], k[:3, 0], v[:3, 0], False), plain(q[3:, 0], k[3:, 0], v[3:, 0], False)])
    torch.testing.assert_close(packed, want)


@pytest.mark.skipif(HAVE_MAIN, reason="Megatron-LM main is importable here")
def test_missing_megatron_lm_names_what_to_install():
    with pytest.raises(models.UpstreamUnavailable, match="Megatron-LM.*PYTHONPATH.*triton"):
        models.build(mi.megatron_class("pixtral").build, families.get("pixtral").tiny_config())


# --- stock classes of the installed megatron-core ----------------------------------------------

@pytest.mark.slow  # measured at TP 1 and on two spawned TP 2 ranks
@pytest.mark.parametrize("family", STOCK_FAMILIES)
def test_stock_layout_matches_recorded(family):
    """A layout change in the installed megatron-core's classes fails here, listing every key."""
    measured = layout.measure(family, mi.megatron_class(family).build, config_for(family))
    assert layout.differences(recorded(family), measured) == []


@pytest.mark.parametrize("family", ["clip", "siglip"])
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_stock_tower_loads_strictly_and_matches_hf(family, tp):
    study = mi.study(family, tp=tp, modules=tp == 1)
    assert not study.errors and study.outputs
    assert all(k.endswith("._extra_state") for k in study.tolerated_missing)
    for name, m in study.outputs.items():
        assert m["rel_l2"] <= TOL, (family, tp, name, m)
    assert mi.first_divergence(study.modules) is None


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_stock_llava_loads_strictly_and_matches_hf_logits(tp):
    study = mi.study("llava", mi.llava_clip_config(), tp=tp, modules=False)
    assert not study.errors
    assert study.outputs["sample/logits"]["rel_l2"] <= TOL
    assert study.outputs["sample/loss_mask"]["max_abs"] == 0


def test_stock_llava_loss_spans_the_padded_vocabulary():
    """Megatron's per-token loss differs from HF's only by the padded vocabulary: the converted
    pad rows of the output layer are zero, so each adds a logit of 0 to the softmax. HF's loss
    recomputed over logits padded the same way matches Megatron's."""
    cfg = mi.llava_clip_config()
    runtime.init_parallel(1, 1)
    ref = mi.hf_model("llava", cfg, 0)
    shards, _ = mi.megatron_state("llava", cfg, ref.state_dict(), 1)
    model = models.build(mi.megatron_class("llava").build, cfg, parallel_output=False)
    mi.load_strict(model, shards[0])
    case = mi.family_cases("llava", cfg, 0)[0]
    mine = mi.megatron_outputs("llava", model, case, cfg)
    with torch.no_grad():
        out = ref(input_ids=case.data["hf_input_ids"], pixel_values=torch.stack(case.data["images"]))
    vocab, rows = cfg.text_config.vocab_size, padded_vocab_size(cfg.text_config.vocab_size, VOCAB_MULTIPLE, tp=1)
    logits = F.pad(out.logits.float(), (0, rows - vocab))
    labels = case.data["hf_labels"]
    shifted = F.cross_entropy(logits[:, :-1].reshape(-1, rows), labels[:, 1:].reshape(-1),
                              ignore_index=-100, reduction="none").view(labels.shape[0], -1)
    per_token = torch.cat([shifted, shifted.new_zeros(labels.shape[0], 1)], dim=1)
    mask = expected_loss_mask(case.data["hf_input_ids"], cfg.image_token_index)
    hf_padded = (per_token * mask).reshape(-1)
    assert compare(mine["token_loss"], hf_padded).rel_l2 <= TOL
    unpadded = mi.hf_outputs("llava", ref, case)["token_loss"]
    assert compare(mine["token_loss"], unpadded).rel_l2 > 1e-3


# --- Megatron-LM main's vit_model classes -------------------------------------------------------

@needs_main
@pytest.mark.slow  # measured at TP 1 and on two spawned TP 2 ranks
@pytest.mark.parametrize("family", MAIN_FAMILIES)
def test_main_layout_matches_recorded(family):
    measured = layout.measure(family, mi.megatron_class(family).build, config_for(family))
    assert layout.differences(recorded(family), measured) == []


@needs_main
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_pixtral_vit_matches_hf(tp):
    study = mi.study("pixtral", tp=tp, modules=tp == 1)
    assert not study.errors and set(study.outputs) == {"static/last_hidden_state",
                                                       "packed/last_hidden_state"}
    assert all(m["rel_l2"] <= TOL for m in study.outputs.values()), study.outputs
    assert mi.first_divergence(study.modules) is None


@needs_main
def test_vit_model_clip_mode_normalises_before_class_token_and_positions():
    """Discrepancy 1: ViTModel's CLIP mode applies ln_pre to the patch embeddings alone; HF CLIP
    after adding the class token and positions. The first divergence is ln_pre."""
    study = mi.study("clip_vit")
    assert mi.first_divergence(study.modules)["module"] == "ln_pre"
    assert [r["module"] for r in study.modules][:1] == ["patch_embed"] and study.modules[0]["rel_l2"] == 0
    assert all(0.05 < m["rel_l2"] < 0.5 for m in study.outputs.values()), study.outputs


@needs_main
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_pixtral_large_merger_norm_takes_the_vision_epsilon(tp):
    """Discrepancy 2: Megatron's merger pre_norm uses the vision config's epsilon (1e-5); HF
    Mistral3 the text config's rms_norm_eps (1e-3 in the tiny config). The tower matches, the
    merger norm is the first divergence, and with equal epsilons everything matches."""
    study = mi.study("pixtral_large", tp=tp, modules=tp == 1)
    for name in ("static/merger", "packed/merger", "static/projector", "packed/projector"):
        assert 1e-4 < study.outputs[name]["rel_l2"] < 1e-3, study.outputs
    if tp == 1:
        first = mi.first_divergence(study.modules)
        assert first["module"] == "merger_norm", study.modules
    cfg = families.get("pixtral_large").tiny_config()
    cfg.text_config.rms_norm_eps = PIXTRAL_NORM_EPS
    control = mi.study("pixtral_large", cfg, tp=tp, modules=False)
    assert all(m["rel_l2"] <= TOL for m in control.outputs.values()), control.outputs


@needs_main
def test_pixtral_large_merger_raises_on_odd_grids():
    """Discrepancy 4: HF's merger drops the last row / column of an odd grid (5x7); Megatron's
    reshape raises."""
    study = mi.study("pixtral_large", modules=False)
    assert set(study.errors) == {"odd_packed", "odd_static"}
    assert all("is invalid for input of size" in e for e in study.errors.values())


@needs_main
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_qwen_tower_matches_and_merger_uses_tanh_gelu(tp):
    """Discrepancy 3: the tower and the merger norm match HF; QwenPatchMerger.forward applies tanh
    GELU between linear_fc1 and linear_fc2 where HF applies erf GELU."""
    study = mi.study("qwen3_5", tp=tp, modules=tp == 1)
    assert not study.errors
    for name, m in study.outputs.items():
        if name.endswith("last_hidden_state"):
            assert m["rel_l2"] <= TOL, (name, m)
        else:
            assert 5e-5 < m["rel_l2"] < 1e-3, (name, m)
    if tp == 1:
        assert mi.first_divergence(study.modules)["module"] == "merger.linear_fc2", study.modules


@needs_main
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_kimi_tower_matches_projector_has_no_exact_place(tp):
    """The KimiViTModel tower matches HF; the closest Megatron projector (MultimodalProjector with
    TE's fused norm over the merged vector) does not: Kimi normalises each sub-token."""
    study = mi.study("kimi_k25", tp=tp, modules=tp == 1)
    assert not study.errors
    for name, m in study.outputs.items():
        if name.endswith("image_embeds"):
            assert m["rel_l2"] > 1e-3, (name, m)
        else:
            assert m["rel_l2"] <= TOL, (name, m)
    if tp == 1:
        assert mi.first_divergence(study.modules)["module"] == "projector"


@needs_main
def test_main_llava_cannot_build_a_vit_model_tower():
    """Discrepancy 5 (found here): Megatron-LM main's LLaVAModel dispatches pixtral-vit,
    pixtral-vit-large, qwen-vl and kimi-vit to vit_model, then asks clip_vit_model's
    get_num_image_embeddings for the tower's token count, which knows none of them."""
    with pytest.raises(NotImplementedError, match="unknown vision model type pixtral-vit"):
        models.build(llava_megatron.build_llava, families.get("llava").tiny_config(), vision_model_type="pixtral-vit",
                     tower_config=pixtral_megatron.transformer_config, vit_model=True)
