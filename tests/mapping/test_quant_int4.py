"""compressed-tensors "pack-quantized" INT4 sources (Kimi-K2 / K2.5 routed experts): dequantize is
bit-exact with the compressed_tensors package's own decompression, quantize (with the source's
scales) gives back the packed bytes, and convert reads a whole Kimi-K2.5 checkpoint whose routed
experts are INT4 as its dequantized values, and re-quantizes it to the source's bytes."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmparity.mapping import quant as Q

try:
    from compressed_tensors.compressors.pack_quantized import (
        PackedQuantizationCompressor, pack_to_int32, unpack_from_int32)
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
except ImportError:  # the tests that compare with it skip; the end-to-end ones need only mmparity
    PackedQuantizationCompressor = None

needs_ct = pytest.mark.skipif(PackedQuantizationCompressor is None, reason=(
    "the compressed_tensors package (the reference these tests compare with, bit for bit) is not installed: "
    "pip install compressed-tensors (the [test] extra)"))

BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
DTYPES = [torch.bfloat16, torch.float32]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS.get(t.dtype, torch.uint8)) if t.dtype.is_floating_point else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _ct_scheme(group: int) -> QuantizationScheme:
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group))


def _ct_dequantize(packed, scale, shape, group, dtype) -> torch.Tensor:
    """The package's decompression, then the cast transformers' loader applies (``.to(dtype)``)."""
    out = PackedQuantizationCompressor.decompress(
        {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor(list(shape))}, _ct_scheme(group))
    return out["weight"].to(dtype)


def _scheme(group: int) -> Q.PackedInt4Scheme:
    return Q.PackedInt4Scheme(group)


def _random_group(shape, group, scale_dtype, seed):
    """(packed by the package, scale, the int values): scales of very different magnitudes."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    *lead, rows, cols = shape
    scale = (torch.rand((*lead, rows, cols // group), generator=g) + 0.01) * torch.logspace(-4, 1, cols // group)
    return pack_to_int32(q, 4), scale.to(scale_dtype), q


# rows not multiples of 8; columns whole groups but not always whole int32 words (12, 20, 40)
SHAPES = [((64, 96), 32), ((13, 96), 32), ((5, 160), 32), ((7, 40), 8), ((3, 12), 4), ((9, 20), 4),
          ((2, 9, 64), 32)]


@needs_ct
@pytest.mark.parametrize("scale_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,group", SHAPES)
def test_dequantize_is_bit_exact_with_the_package(shape, group, dtype, scale_dtype):
    packed, scale, q = _random_group(shape, group, scale_dtype, 1)
    assert packed.shape == Q.PackedInt4Scheme(group).packed_shape(shape)
    mine = Q.dequantize(packed, scale, _scheme(group), dtype)
    assert _same(mine, _ct_dequantize(packed, scale, shape, group, dtype))
    assert torch.equal(Q.unpack_int4(packed, shape[-1]), q)


@needs_ct
def test_the_op_order_is_what_makes_it_exact():
    """A bfloat16 scale asked for float32: the package multiplies in bfloat16, then casts; the
    float32 product (the FP8 path's order) differs in the last bits for many elements."""
    packed, scale, q = _random_group((64, 96), 32, torch.bfloat16, 2)
    theirs = _ct_dequantize(packed, scale, (64, 96), 32, torch.float32)
    other = (q.float().unflatten(-1, (-1, 32)) * scale.float().unsqueeze(-1)).flatten(-2)
    assert not _same(other, theirs)
    assert _same(Q.dequantize(packed, scale, _scheme(32), torch.float32), theirs)


@needs_ct
@pytest.mark.parametrize("cols", [1, 7, 8, 12, 31, 32, 33, 96])
def test_pack_and_unpack_match_the_package(cols):
    q = torch.randint(-8, 8, (5, cols), generator=torch.Generator().manual_seed(cols), dtype=torch.int8)
    assert _same(Q.pack_int4(q), pack_to_int32(q, 4))
    packed = pack_to_int32(q, 4)
    assert torch.equal(Q.unpack_int4(packed, cols), unpack_from_int32(packed, 4, torch.Size([5, cols])))


@needs_ct
@pytest.mark.parametrize("scale_dtype", DTYPES)
def test_quantize_matches_the_package_compressor(scale_dtype):
    """Given the same scales, quantize packs the bytes the package's compressor packs (min-max
    scales ``amax / 8``: the group maxima clamp to 7, as the package clamps them)."""
    group = 32
    x = torch.randn(24, 128, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 1, 128)
    _, fresh = Q.quantize(x, Q.PackedInt4Scheme(group))
    scale = (x.unflatten(-1, (-1, group)).abs().amax(-1) / 8).to(scale_dtype)
    assert _same(fresh, scale.to(torch.bfloat16)) or scale_dtype != torch.bfloat16
    theirs = PackedQuantizationCompressor.compress({"weight": x, "weight_scale": scale}, _ct_scheme(group))
    packed, kept = Q.quantize(x, _scheme(group), scale)
    assert _same(packed, theirs["weight_packed"]) and _same(kept, scale)
    assert theirs["weight_shape"].tolist() == [24, 128] and theirs["weight_shape"].dtype == torch.int64


@needs_ct
@pytest.mark.parametrize("scale_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,group", SHAPES)
def test_quantize_inverts_dequantize(shape, group, dtype, scale_dtype):
    packed, scale, _ = _random_group(shape, group, scale_dtype, 4)
    value = Q.dequantize(packed, scale, _scheme(group), dtype)
    again, again_scale = Q.quantize(value, _scheme(group), scale)
    assert _same(again, packed) and _same(again_scale, scale)
    assert Q.requant_error(value, again, again_scale, _scheme(group)) == (0.0, True)


@needs_ct
def test_a_group_that_outgrew_its_scale_takes_a_fresh_one():
    packed, scale, _ = _random_group((6, 64), 32, torch.bfloat16, 5)
    value = Q.dequantize(packed, scale, _scheme(32), torch.float32)
    value[0, 0] = float(scale[0, 0]) * 100
    new_packed, new_scale = Q.quantize(value, _scheme(32), scale)
    assert new_scale[0, 0] > scale[0, 0] and torch.equal(new_scale.flatten()[1:], scale.flatten()[1:])
    error, exact = Q.requant_error(value, new_packed, new_scale, _scheme(32))
    assert not exact and error > 0


@needs_ct
@settings(max_examples=60, deadline=None)
@given(lead=st.sampled_from([(), (2,)]), rows=st.integers(1, 40), groups=st.integers(1, 5),
       group=st.sampled_from([4, 8, 12, 32, 128]), seed=st.integers(0, 2**16),
       dtype=st.sampled_from(DTYPES), scale_dtype=st.sampled_from(DTYPES))
def test_property_dequantize_exact_and_inverted(lead, rows, groups, group, seed, dtype, scale_dtype):
    shape = (*lead, rows, groups * group)
    packed, scale, _ = _random_group(shape, group, scale_dtype, seed)
    value = Q.dequantize(packed, scale, _scheme(group), dtype)
    assert _same(value, _ct_dequantize(packed, scale, shape, group, dtype))
    again, again_scale = Q.quantize(value, _scheme(group), scale)
    assert _same(again, packed) and _same(again_scale, scale)


@needs_ct
def test_a_partial_last_group_is_refused_as_the_package_refuses_it():
    q = torch.zeros(4, 40, dtype=torch.int8)
    with pytest.raises(ValueError, match="divisble|divisible"):
        PackedQuantizationCompressor.decompress({"weight_packed": pack_to_int32(q, 4), "weight_scale": torch.ones(4, 2),
                                                 "weight_shape": torch.tensor([4, 40])}, _ct_scheme(32))
    with pytest.raises(Q.QuantError, match="not a whole number of groups of 32"):
        Q.dequantize_int4(pack_to_int32(q, 4), torch.ones(4, 2), _scheme(32), shape=(4, 40))


# --------------------------------------------------------------------------------------------------
# the scheme and the key groups

# Kimi-K2-Thinking's quantization_config, as recalled (not read from the hub here): routed experts
# INT4 in groups of 32; attention, shared experts, the dense layers' MLP and lm_head stay bfloat16.
def kimi_config(group: int = 32, **weights) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": group, "dynamic": False,
                                                      "actorder": None, "block_structure": None,
                                                      "observer": "minmax", "observer_kwargs": {}} | weights}},
            "ignore": ["re:.*lm_head.*", "re:.*self_attn.*", "re:.*shared_experts.*",
                       r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]}


def test_kimi_scheme_parses_and_everything_else_is_refused_in_one_line():
    scheme = Q.parse_quantization_config(kimi_config())
    assert isinstance(scheme, Q.PackedInt4Scheme) and scheme.group_size == 32
    assert scheme.to_json() == kimi_config()
    assert scheme.skips("language_model.model.layers.3.self_attn.o_proj")
    assert scheme.skips("language_model.model.layers.0.mlp.down_proj")
    assert not scheme.skips("language_model.model.layers.3.mlp.experts.7.down_proj")
    two = kimi_config()
    two["config_groups"]["group_1"] = kimi_config(64)["config_groups"]["group_0"]
    act = kimi_config()
    act["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float"}
    for config, words in [(kimi_config() | {"format": "float-quantized"}, "format 'float-quantized'"),
                          (kimi_config() | {"format": "nvfp4-pack-quantized"}, "nvfp4-pack-quantized"),
                          (kimi_config(symmetric=False), "symmetric False"),
                          (kimi_config(num_bits=8), "num_bits 8"),
                          (kimi_config(type="float"), "type 'float'"),
                          (kimi_config(strategy="channel"), "strategy 'channel'"),
                          (kimi_config(actorder="group"), "actorder 'group'"),
                          (act, "input_activations is set"),
                          (two, "different group sizes [32, 64]"),
                          (kimi_config() | {"quantization_status": "frozen"}, "quantization_status 'frozen'")]:
        with pytest.raises(Q.QuantError, match=words.replace("[", r"\[").replace("]", r"\]")) as info:
            Q.parse_quantization_config(config)
        assert "\n" not in str(info.value) and "compressed-tensors" in str(info.value)


def test_group_keys_names_every_offender():
    i32, bf, i64 = torch.int32, torch.bfloat16, torch.int64
    scheme = Q.parse_quantization_config(kimi_config())
    e = "model.layers.1.mlp.experts.0."
    good = {e + "down_proj.weight_packed": (i32, (40, 12)), e + "down_proj.weight_scale": (bf, (40, 3)),
            e + "down_proj.weight_shape": (i64, (2,)), "model.norm.weight": (bf, (40,)),
            "model.layers.1.self_attn.o_proj.weight": (bf, (40, 40))}
    shapes = {e + "down_proj.weight_shape": (40, 96)}
    layout = Q.group_keys(scheme, good, shapes)
    assert list(layout.groups) == [e + "down_proj.weight"] and layout.scheme.shape_dtype == "int64"
    assert Q.logical_infos(layout, good, bf)[e + "down_proj.weight"] == (bf, (40, 96))
    bad = {**good, e + "gate_proj.weight_packed": (i32, (12, 5)),  # no scale
           e + "up_proj.weight_packed": (i32, (12, 5)), e + "up_proj.weight_scale": (bf, (12, 2)),  # 40 cols: 1.25 groups
           e + "up_proj.weight_shape": (i64, (2,)),
           "model.layers.2.mlp.experts.1.down_proj.weight_scale": (bf, (40, 3)),  # orphan scale
           e + "down_proj.weight_zero_point": (i32, (5, 3)),
           "model.layers.1.self_attn.q_proj.weight_packed": (i32, (40, 5)),
           "model.layers.1.self_attn.q_proj.weight_scale": (bf, (40, 1))}
    bad_shapes = {**shapes, e + "up_proj.weight_shape": (12, 40), e + "down_proj.weight_shape": (40, 64)}
    with pytest.raises(Q.QuantError) as info:
        Q.group_keys(scheme, bad, bad_shapes)
    assert "\n" not in str(info.value) and "more)" in str(info.value)
    # every offender is named; the message shows the first few (raise the limit to read them all)
    old, Q._MAX_SHOWN = Q._MAX_SHOWN, 100
    try:
        with pytest.raises(Q.QuantError) as info:
            Q.group_keys(scheme, bad, bad_shapes)
    finally:
        Q._MAX_SHOWN = old
    message = str(info.value)
    for words in (e + "gate_proj.weight_packed has no scale",
                  e + "up_proj.weight: 40 input columns are not a whole number of groups of 32",
                  e + "down_proj.weight: packed shape [40, 12] does not fit weight_shape [40, 64]",
                  e + "down_proj.weight: scale shape [40, 3] does not fit weight [40, 64]",
                  "experts.1.down_proj.weight_scale has no packed weight",
                  "weight_zero_point is a zero point, but the scheme is symmetric",
                  "q_proj.weight_packed is stored packed but the ignore list names"):
        assert words in message, message


# --------------------------------------------------------------------------------------------------
# end to end: a whole Kimi-K2.5 checkpoint in the release layout, routed experts INT4

from mmparity.models import registry as families  # noqa: E402
from mmparity.models.core.inputs import random_like_state  # noqa: E402
from mmparity.io.manifest import read_manifest  # noqa: E402
from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict  # noqa: E402
from mmparity.convert import read_mcore_shards  # noqa: E402
from mmparity.cli.main import main  # noqa: E402
from mmparity.mapping.rules import convert_mcore_to_hf  # noqa: E402
from mmparity.models.kimi_k25_vl import reference  # noqa: E402
from tests.mapping.test_quant import _save, assert_exports_round_trip, assert_imports_as_dequantized  # noqa: E402

# The tiny decoder's expert widths (hidden 40, moe_intermediate 12) in groups of 4: 40 and 12 input
# columns, i.e. 5 and 2 int32 words, the last of the 12-column rows half padding.
E2E_GROUP = 4


@pytest.fixture(scope="module")
def int4_kimi(tmp_path_factory):
    """(INT4 source, the same model with the dequantized values stored plainly, its stored state)."""
    root = tmp_path_factory.mktemp("int4")
    fam = families.get("kimi_k25_vl")
    cfg = reference.tiny_config()
    model = fam.build_reference(cfg)
    state = random_like_state(model.state_dict(), seed=13)
    release = convert_mcore_to_hf(fam.rule_set(cfg, "release"), fam.hf_to_mcore(state, cfg, hf_format="hf"))
    release = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in release.items()}
    config = json.loads(cfg.to_json_string())
    quant = kimi_config(E2E_GROUP)
    scheme = Q.parse_quantization_config(quant)
    stored, dequantized = {}, {}
    for key, value in release.items():
        base = key[: -len(".weight")]
        if ".mlp.experts." in key and key.endswith("proj.weight") and not scheme.skips(base):
            packed, scale = Q.quantize(value, scheme)
            stored |= {base + ".weight_packed": packed, base + ".weight_scale": scale,
                       base + ".weight_shape": torch.tensor(list(value.shape))}
            dequantized[key] = Q.dequantize(packed, scale, scheme, torch.bfloat16)
        else:
            stored[key] = dequantized[key] = value
    experts = cfg.text_config.n_routed_experts * 3 * (cfg.text_config.num_hidden_layers - 1)
    assert sum(k.endswith("_packed") for k in stored) == experts
    src = _save(root / "int4", stored, {**config, "quantization_config": quant})
    plain = _save(root / "plain", dequantized, config)
    return src, plain, stored


def _run(*argv) -> int:
    return main([str(a) for a in argv])


def test_int4_kimi_converts_as_its_dequantized_values_and_requantizes_to_its_bytes(int4_kimi, tmp_path, capsys):
    src, plain, stored = int4_kimi
    assert_imports_as_dequantized(src, plain, tmp_path)
    record = read_manifest(tmp_path / "m").provenance.extra["quantization"]
    packed = [k for k in stored if k.endswith("_packed")]
    assert record["method"] == "compressed-tensors" and record["format"] == "pack-quantized"
    assert (record["group_size"], record["num_bits"], record["shape_dtype"]) == (E2E_GROUP, 4, "int64")
    assert (record["dequantized"], record["dtype"]) == (len(packed), "bfloat16")
    assert record["quantization_config"] == kimi_config(E2E_GROUP)

    assert_exports_round_trip(tmp_path, plain, stored, len(packed), capsys)
    config = json.loads((tmp_path / "hf-q" / "config.json").read_text())
    assert config["quantization_config"] == kimi_config(E2E_GROUP)
    assert read_manifest(tmp_path / "hf-q").provenance.extra["requantized"] == {
        "tensors": len(packed), "max_abs_error": 0.0, "inexact": 0, "bytes_changed": 0}
    # Through an mcore -> mcore re-sharding (TP 2 x EP 2) the record and scales travel, and still
    # re-quantize to the source's bytes.
    assert _run("convert", "--src", tmp_path / "m", "--dst", tmp_path / "m-tp2", "--to", "mcore", "--format",
                "legacy", "--tp", "2", "--ep", "2", "--quiet") == 0
    assert _run("convert", "--src", tmp_path / "m-tp2", "--dst", tmp_path / "hf-q2", "--to", "hf", "--requantize",
                "--quiet") == 0
    again2 = load_safetensors_state_dict(tmp_path / "hf-q2")
    assert sorted(again2) == sorted(stored) and all(torch.equal(again2[k].view(torch.uint8),
                                                                v.contiguous().view(torch.uint8))
                                                    for k, v in stored.items())
    # The written INT4 checkpoint reads back as the same model.
    assert _run("convert", "--src", tmp_path / "hf-q", "--dst", tmp_path / "m2", "--to", "mcore", "--format",
                "legacy", "--quiet") == 0
    _, _, again_mcore = read_mcore_shards(tmp_path / "m2")
    _, _, want = read_mcore_shards(tmp_path / "m-plain")
    assert all(_same(again_mcore[0][k], v) for k, v in want[0].items())


def test_broken_int4_groups_exit_2_in_one_line(int4_kimi, tmp_path, capsys):
    src, _, stored = int4_kimi
    config = json.loads((src / "config.json").read_text())
    packed = sorted(k for k in stored if k.endswith("_packed"))
    no_scale = packed[0].replace("_packed", "_scale")
    bad_scale, bad_packed = packed[1].replace("_packed", "_scale"), packed[2]
    broken = {k: v for k, v in stored.items() if k != no_scale}
    broken[bad_scale] = stored[bad_scale][:, :-1].contiguous()
    broken[bad_packed] = stored[bad_packed][:, :-1].contiguous()
    asym = kimi_config(E2E_GROUP, symmetric=False)
    cases = [(_save(tmp_path / "broken", broken, config),
              [packed[0] + " has no scale", bad_scale.replace("_scale", "") + ": scale shape",
               bad_packed.replace("_packed", "") + ": packed shape"]),
             (_save(tmp_path / "asym", stored, {**config, "quantization_config": asym}), ["symmetric False"])]
    for path, words in cases:
        capsys.readouterr()
        assert _run("convert", "--src", path, "--dst", tmp_path / f"out-{path.name}", "--to", "mcore",
                    "--quiet") == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        for word in words:
            assert word in err, err
        assert not (tmp_path / f"out-{path.name}").exists()
