"""Block-scaled FP8 sources: dequantize is bit-exact with transformers' own, quantize is its exact
inverse, and convert reads such a checkpoint as the values transformers would load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmparity.converters import quant as Q

fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
from transformers.utils.quantization_config import FineGrainedFP8Config  # noqa: E402

BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS.get(t.dtype, torch.uint8))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _hf_quantize(value: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    hq = SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=list(block)))
    out = fp8.Fp8Quantize(hq).convert({"x.weight": value})
    return out["x.weight"], out["x.weight_scale_inv"]


def _hf_dequantize(q: torch.Tensor, s: torch.Tensor, block, dtype) -> torch.Tensor:
    """transformers' dequantization in its loader's op order (float32 product, one cast). Its
    loader (``Fp8Dequantize``) derives the block from the scale grid, which only works for whole
    blocks; for edge blocks its backward-pass helper, asked for float32, computes the same float32
    products over a ceil-sized grid, and the one cast follows."""
    rows, cols = q.shape[-2:]
    if rows % block[0] == 0 and cols % block[1] == 0:
        return fp8.Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=dtype)
    return fp8._dequantize_fp8_weight(q, s, list(block), torch.float32).to(dtype)


def _data(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Columns of very different magnitude, so that blocks get different scales.
    return torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[-1])


SCHEME = Q.QuantScheme("fp8", (128, 128))
AWKWARD = [(200, 300), (129, 127), (1, 5), (3, 257, 130)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 384), *AWKWARD])
def test_dequantize_is_bit_exact_with_transformers(shape, dtype):
    value = _data(shape, 1)
    q, s = _hf_quantize(value, SCHEME.block) if shape == (256, 384) else Q.quantize(value, SCHEME)
    assert s.shape == Q.scale_shape(shape, SCHEME.block)
    assert _same(Q.dequantize(q, s, SCHEME, dtype), _hf_dequantize(q, s, SCHEME.block, dtype))


def test_quantize_matches_transformers_on_whole_blocks():
    value = _data((256, 384), 2)
    q, s = _hf_quantize(value, SCHEME.block)
    mine_q, mine_s = Q.quantize(value, SCHEME)
    assert _same(mine_q, q) and _same(mine_s, s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 384), *AWKWARD])
def test_quantize_inverts_dequantize(shape, dtype):
    q, s = Q.quantize(_data(shape, 3), SCHEME)
    again_q, again_s = Q.quantize(Q.dequantize(q, s, SCHEME, dtype), SCHEME, s)
    assert _same(again_q, q) and _same(again_s, s)
    error, exact = Q.requant_error(Q.dequantize(q, s, SCHEME, dtype), again_q, again_s, SCHEME)
    assert (error, exact) == (0.0, True)


def test_changed_block_takes_a_fresh_scale():
    q, s = Q.quantize(_data((130, 140), 4), SCHEME)
    value = Q.dequantize(q, s, SCHEME, torch.float32)
    value[0, 0] = float(s[0, 0]) * 1000  # past what the block's scale can hold
    new_q, new_s = Q.quantize(value, SCHEME, s)
    assert new_s[0, 0] > s[0, 0] and torch.equal(new_s[1:], s[1:]) and torch.equal(new_s[0, 1:], s[0, 1:])
    error, exact = Q.requant_error(value, new_q, new_s, SCHEME)
    assert not exact and error > 0


@settings(max_examples=60, deadline=None)
@given(lead=st.sampled_from([(), (2,)]), rows=st.integers(1, 150), cols=st.integers(1, 150),
       bm=st.sampled_from([1, 3, 16, 32, 128]), bn=st.sampled_from([1, 5, 16, 64, 128]),
       seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_property_dequantize_exact_and_inverted(lead, rows, cols, bm, bn, seed, dtype):
    scheme = Q.QuantScheme("fp8", (bm, bn))
    q, s = Q.quantize(_data((*lead, rows, cols), seed), scheme)
    value = Q.dequantize(q, s, scheme, dtype)
    assert _same(value, _hf_dequantize(q, s, (bm, bn), dtype))
    again_q, again_s = Q.quantize(value, scheme, s)
    assert _same(again_q, q) and _same(again_s, s)


def test_scheme_parsing_refuses_in_one_line():
    assert Q.parse_quantization_config(None) is None
    scheme = Q.parse_quantization_config({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 64],
                                          "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head"]})
    assert scheme.block == (128, 64) and scheme.skips("lm_head") and not scheme.skips("model.layers.0.mlp")
    assert Q.parse_quantization_config(scheme.to_json()) == scheme
    for config, words in [({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "'compressed-tensors'"),
                          ({"quant_method": "awq"}, "'awq'"),
                          ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
                          ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
                           "static")]:
        with pytest.raises(Q.QuantError, match=words) as info:
            Q.parse_quantization_config(config)
        assert "\n" not in str(info.value)


def test_group_keys_names_every_offender():
    f8, f32, bf = torch.float8_e4m3fn, torch.float32, torch.bfloat16
    scheme = Q.QuantScheme("fp8", (128, 128), modules_to_not_convert=("lm_head",))
    good = {"a.weight": (f8, (200, 300)), "a.weight_scale_inv": (f32, (2, 3)),
            "norm.weight": (bf, (300,)), "embed.weight": (bf, (10, 300)), "lm_head.weight": (bf, (10, 300))}
    layout = Q.group_keys(scheme, good)
    assert list(layout.groups) == ["a.weight"] and layout.groups["a.weight"].scale == "a.weight_scale_inv"
    assert layout.unquantized == ("embed.weight", "lm_head.weight", "norm.weight")
    assert Q.logical_infos(layout, good, bf)["a.weight"] == (bf, (200, 300))
    bad = {**good, "a.weight_scale_inv": (f32, (2, 2)), "orphan.weight_scale_inv": (f32, (1, 1)),
           "b.weight": (f8, (4, 4)), "lm_head.weight": (f8, (10, 300)), "lm_head.weight_scale_inv": (f32, (1, 3))}
    with pytest.raises(Q.QuantError) as info:
        Q.group_keys(scheme, bad)
    message = str(info.value)
    for name in ("a.weight: scale shape [2, 2]", "orphan.weight_scale_inv has no weight", "b.weight is float8_e4m3fn",
                 "modules_to_not_convert lists lm_head"):
        assert name in message, message
    assert "\n" not in message
