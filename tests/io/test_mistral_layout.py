"""Mistral-native ``consolidated.safetensors`` layout for Pixtral and Pixtral-Large.

The Mistral-native state dicts here are built independently of the converter: names follow
transformers' ``convert_pixtral_weights_to_hf.py`` / ``convert_mistral3_weights_to_hf.py`` tables,
and the HF side is derived from them with those scripts' q/k permutation (``permute_for_rope``),
re-implemented below. Converting either layout must give the same mcore tensors, bit for bit.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from mmparity.models import registry as families
from mmparity.mapping.rules import ConversionError
from mmparity.parity import harness
from mmparity.models.core.inputs import random_like_state
from tests.strategies import family_configs, tp_sizes

DTYPES = (torch.float32, torch.bfloat16)

# Mistral-native -> HF names (the transformers conversion scripts' tables, vision + adapter part).
_TO_HF = [
    (r"^vision_encoder\.transformer\.layers\.(\d+)\.attention\.w([qkvo])\.weight$",
     r"vision_tower.transformer.layers.\1.attention.\2_proj.weight"),
    (r"^vision_encoder\.transformer\.layers\.(\d+)\.feed_forward\.w1\.weight$",
     r"vision_tower.transformer.layers.\1.feed_forward.gate_proj.weight"),
    (r"^vision_encoder\.transformer\.layers\.(\d+)\.feed_forward\.w2\.weight$",
     r"vision_tower.transformer.layers.\1.feed_forward.down_proj.weight"),
    (r"^vision_encoder\.transformer\.layers\.(\d+)\.feed_forward\.w3\.weight$",
     r"vision_tower.transformer.layers.\1.feed_forward.up_proj.weight"),
    (r"^vision_encoder\.", r"vision_tower."),
    (r"^vision_language_adapter\.w_in\.", r"multi_modal_projector.linear_1."),
    (r"^vision_language_adapter\.w_out\.", r"multi_modal_projector.linear_2."),
    (r"^patch_merger\.merging_layer\.weight$", r"multi_modal_projector.patch_merger.merging_layer.weight"),
    (r"^pre_mm_projector_norm\.weight$", r"multi_modal_projector.norm.weight"),
]
_TO_MISTRAL = [  # the same table read backwards, for naming random tensors
    (r"^vision_tower\.transformer\.layers\.(\d+)\.attention\.([qkvo])_proj\.weight$",
     r"vision_encoder.transformer.layers.\1.attention.w\2.weight"),
    (r"^vision_tower\.transformer\.layers\.(\d+)\.feed_forward\.gate_proj\.weight$",
     r"vision_encoder.transformer.layers.\1.feed_forward.w1.weight"),
    (r"^vision_tower\.transformer\.layers\.(\d+)\.feed_forward\.down_proj\.weight$",
     r"vision_encoder.transformer.layers.\1.feed_forward.w2.weight"),
    (r"^vision_tower\.transformer\.layers\.(\d+)\.feed_forward\.up_proj\.weight$",
     r"vision_encoder.transformer.layers.\1.feed_forward.w3.weight"),
    (r"^vision_tower\.", r"vision_encoder."),
    (r"^multi_modal_projector\.linear_1\.", r"vision_language_adapter.w_in."),
    (r"^multi_modal_projector\.linear_2\.", r"vision_language_adapter.w_out."),
    (r"^multi_modal_projector\.patch_merger\.", r"patch_merger."),
    (r"^multi_modal_projector\.norm\.", r"pre_mm_projector_norm."),
]


def _rename(key: str, table) -> str:
    for pattern, repl in table:
        new, n = re.subn(pattern, repl, key)
        if n:
            return new
    raise KeyError(key)


def permute_for_rope(t: torch.Tensor, heads: int) -> torch.Tensor:
    """The conversion scripts' q/k permutation: interleaved pairs -> rotate-half halves per head."""
    rows, cols = t.shape
    return t.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def mistral_to_hf(mistral: dict, heads: int) -> dict:
    out = {}
    for key, value in mistral.items():
        new = _rename(key, _TO_HF)
        if re.search(r"attention\.[qk]_proj\.weight$", new):
            value = permute_for_rope(value, heads)
        out[new] = value
    return out


def random_mistral_state(family: str, cfg, seed: int, dtype=torch.float32) -> dict:
    """Random Mistral-native tensors named and shaped after the HF reference's tensors."""
    ref = families.get(family).build_reference(cfg).state_dict()
    if family == "pixtral":
        ref = {"vision_tower." + k: v for k, v in ref.items()}
    return {_rename(k, _TO_MISTRAL): v.to(dtype) for k, v in random_like_state(ref, seed).items()}


def hf_state_of(family: str, mistral: dict, cfg) -> dict:
    vision = cfg if family == "pixtral" else cfg.vision_config
    hf = mistral_to_hf(mistral, vision.num_attention_heads)
    if family == "pixtral":  # a bare PixtralVisionModel has no vision_tower. prefix
        hf = {k[len("vision_tower."):]: v for k, v in hf.items()}
    return hf


def _assert_same_shards(a: list, b: list):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), key


def _check_layouts_agree(family, cfg, tp, dtype, seed):
    mistral = random_mistral_state(family, cfg, seed, dtype)
    hf = hf_state_of(family, mistral, cfg)
    from_mistral = families.get(family).hf_to_mcore(mistral, cfg, tp_size=tp)
    _assert_same_shards(from_mistral, families.get(family).hf_to_mcore(hf, cfg, tp_size=tp))
    back = families.get(family).mcore_to_hf(from_mistral, cfg, hf_format="mistral")
    assert back.keys() == mistral.keys()
    for key, value in mistral.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_pixtral_both_layouts_give_identical_mcore_and_mistral_round_trips(data):
    cfg = data.draw(family_configs("pixtral"))
    tps = [d for d in (1, 2, 3, 4, 6) if cfg.num_attention_heads % d == 0
           and cfg.intermediate_size % d == 0]
    _check_layouts_agree("pixtral", cfg, data.draw(st.sampled_from(tps)),
                         data.draw(st.sampled_from(DTYPES)), data.draw(st.integers(0, 999)))


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_pixtral_large_both_layouts_give_identical_mcore_and_mistral_round_trips(data):
    cfg = data.draw(family_configs("pixtral_large"))
    _check_layouts_agree("pixtral_large", cfg, data.draw(st.sampled_from(tp_sizes("pixtral_large", cfg))),
                         data.draw(st.sampled_from(DTYPES)), data.draw(st.integers(0, 999)))


def test_test_helpers_agree_with_the_converter_permutation():
    """Guard for the test itself: mistral -> HF here must be undone by the inverse naming."""
    cfg = families.get("pixtral_large").tiny_config()
    mistral = random_mistral_state("pixtral_large", cfg, 0)
    hf = hf_state_of("pixtral_large", mistral, cfg)
    assert {_rename(k, _TO_MISTRAL) for k in hf} == set(mistral)
    key = "vision_encoder.transformer.layers.0.attention.wq.weight"
    assert not torch.equal(hf["vision_tower.transformer.layers.0.attention.q_proj.weight"], mistral[key])


LM_KEYS = {"tok_embeddings.weight": (16, 8), "norm.weight": (8,), "output.weight": (16, 8),
           "layers.0.attention.wq.weight": (8, 8), "layers.0.attention_norm.weight": (8,),
           "layers.0.feed_forward.w1.weight": (4, 8)}


def test_detect_format_and_whole_consolidated_checkpoints():
    cfg = families.get("pixtral_large").tiny_config()
    mistral = random_mistral_state("pixtral_large", cfg, 1)
    consolidated = {**mistral, **{k: torch.zeros(s) for k, s in LM_KEYS.items()}}
    assert families.get("pixtral_large").hooks.converter.detect(consolidated) == "mistral"
    assert families.get("pixtral").hooks.converter.detect(consolidated) == "mistral"
    hf = hf_state_of("pixtral_large", mistral, cfg)
    assert families.get("pixtral_large").hooks.converter.detect(hf) == "hf"
    # the language model is dropped; the Pixtral family also drops the adapter and the merger
    _assert_same_shards(families.get("pixtral_large").hf_to_mcore(consolidated, cfg),
                        families.get("pixtral_large").hf_to_mcore(hf, cfg))
    hf_tower = {k[len("vision_tower."):]: v for k, v in hf.items() if k.startswith("vision_tower.")}
    _assert_same_shards(families.get("pixtral").hf_to_mcore(consolidated, cfg.vision_config),
                        families.get("pixtral").hf_to_mcore(hf_tower, cfg.vision_config))


def test_mixed_layouts_and_stray_tensors_are_loud():
    cfg = families.get("pixtral_large").tiny_config()
    mistral = random_mistral_state("pixtral_large", cfg, 1)
    hf = hf_state_of("pixtral_large", mistral, cfg)
    with pytest.raises(ConversionError, match="both Mistral-native and HF"):
        families.get("pixtral_large").hf_to_mcore({**mistral, **hf}, cfg)
    stray = {**mistral, "vision_encoder.transformer.layers.0.attention.wqkv.weight": torch.zeros(2)}
    with pytest.raises(ConversionError, match="unconsumed source tensor vision_encoder.transformer"):
        families.get("pixtral_large").hf_to_mcore(stray, cfg, hf_format="mistral")
    missing = dict(mistral)
    del missing["pre_mm_projector_norm.weight"]
    with pytest.raises(ConversionError, match="missing source tensor pre_mm_projector_norm.weight"):
        families.get("pixtral_large").hf_to_mcore(missing, cfg)


@pytest.mark.parametrize("family", ["pixtral", "pixtral_large"])
def test_parity_through_the_mistral_layout(family):
    fam = families.get(family)
    cfg = fam.tiny_config()
    mistral = random_mistral_state(family, cfg, 5)
    shards = families.get(family).hf_to_mcore(mistral, cfg, hf_format="mistral")
    report = harness.check(family, cfg, hf_state_of(family, mistral, cfg), seed=5,
                           native_shards=shards, components=False)
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]


def test_cli_detects_and_checks_mistral_native_tensors(tmp_path, capsys):
    """An HF config next to Mistral-native tensors: the CLI detects the layout from the keys and
    goes Mistral -> mcore -> HF before loading the reference."""
    from mmparity.cli.main import main

    cfg = families.get("pixtral_large").tiny_config()
    mistral = random_mistral_state("pixtral_large", cfg, 9)
    consolidated = {**mistral, **{k: torch.zeros(s) for k, s in LM_KEYS.items()}}
    cfg.save_pretrained(tmp_path)
    # Under Mistral's own file name, as the release ships it.
    save_file({k: v.contiguous() for k, v in consolidated.items()}, tmp_path / "consolidated.safetensors")
    capsys.readouterr()
    assert main(["check", "pixtral_large", "--hf", str(tmp_path), "--quiet"]) == 0


def test_mistral_release_directory_with_an_incomplete_params_json_is_a_clear_error(tmp_path, capsys):
    from mmparity.cli.main import main

    (tmp_path / "params.json").write_text("{}")
    save_file({"vision_encoder.ln_pre.weight": torch.ones(4)}, tmp_path / "consolidated.safetensors")
    capsys.readouterr()
    assert main(["check", "pixtral", "--hf", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "params.json: missing dim, n_layers" in err[0], err
