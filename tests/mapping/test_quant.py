"""Block-scaled FP8 sources: dequantize is bit-exact with transformers' own, quantize is its exact
inverse, and convert reads such a checkpoint as the values transformers would load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmparity.mapping import quant as Q

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
    for config, words in [({"quant_method": "compressed-tensors", "format": "pack-quantized"},
                           r"\(compressed-tensors\) is not supported: config_groups"),
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


# --------------------------------------------------------------------------------------------------
# end to end: a whole VLM whose language model is stored block-scaled FP8

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from mmparity.models import registry as families  # noqa: E402
from mmparity.models.core.inputs import random_like_state  # noqa: E402
from mmparity.io.manifest import read_manifest  # noqa: E402
from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict  # noqa: E402
from mmparity.io.fsio.safetensors_write import save_safetensors_checkpoint  # noqa: E402
from mmparity.convert import read_mcore_shards  # noqa: E402
from mmparity.cli.main import main  # noqa: E402

# Blocks that cut the tiny model's rows and columns into partial edge blocks.
E2E = Q.QuantScheme("fp8", (16, 24), modules_to_not_convert=("lm_head",))


def _is_quantized(key: str, value: torch.Tensor) -> bool:
    return "language_model" in key and value.ndim == 2 and key.endswith("proj.weight")


def _save(path: Path, state: dict, config: dict) -> Path:
    save_safetensors_checkpoint(path, state, max_shard_size="40KB",
                                extra_files={"config.json": json.dumps(config, indent=2)})
    return path


@pytest.fixture(scope="module")
def fp8_vlm(tmp_path_factory):
    """(FP8 source, the same model with the dequantized values stored plainly, its stored state)."""
    root = tmp_path_factory.mktemp("fp8")
    fam = families.get("mistral3")
    cfg = fam.tiny_config()
    model = fam.build_reference(cfg)
    model.load_state_dict(random_like_state(model.state_dict(), seed=11))
    model.save_pretrained(root / "plain0")
    state = {k: v.to(torch.bfloat16) for k, v in load_safetensors_state_dict(root / "plain0").items()}
    config = json.loads((root / "plain0" / "config.json").read_text())
    stored, dequantized = {}, {}
    for key, value in state.items():
        if _is_quantized(key, value):
            q, s = Q.quantize(value, E2E)
            stored[key], stored[key[: -len(".weight")] + ".weight_scale_inv"] = q, s
            dequantized[key] = Q.dequantize(q, s, E2E, torch.bfloat16)
        else:
            stored[key] = dequantized[key] = value
    assert sum(v.dtype == Q.FP8_DTYPE for v in stored.values()) >= 4
    src = _save(root / "fp8", stored, {**config, "quantization_config": {**E2E.to_json(), "fmt": "e4m3"}})
    plain = _save(root / "plain", dequantized, config)
    return src, plain, stored


def _run(*argv) -> int:
    return main([str(a) for a in argv])


def assert_imports_as_dequantized(src, plain, tmp_path) -> None:
    """A quantized source and the same model stored dequantized (``plain``) convert to the same
    mcore tensors bit for bit (``tmp_path/m`` and ``tmp_path/m-plain``)."""
    for path, name in ((src, "m"), (plain, "m-plain")):
        assert _run("convert", "--src", path, "--dst", tmp_path / name, "--to", "mcore", "--format", "legacy",
                    "--quiet") == 0
    _, _, got = read_mcore_shards(tmp_path / "m")
    _, _, want = read_mcore_shards(tmp_path / "m-plain")
    assert sorted(got[0]) == sorted(want[0])
    for key, value in want[0].items():
        assert _same(got[0][key], value), key


def assert_exports_round_trip(tmp_path, plain, stored: dict, count: int, capsys) -> None:
    """The mcore checkpoint ``tmp_path/m`` of a quantized source: exported plainly it is the
    dequantized model ``plain`` with no quantization_config; with ``--requantize`` every stored
    byte comes back (``hf-q``), ``count`` tensors re-quantized with zero error."""
    assert _run("convert", "--src", tmp_path / "m", "--dst", tmp_path / "hf", "--to", "hf", "--quiet") == 0
    back, plain_state = load_safetensors_state_dict(tmp_path / "hf"), load_safetensors_state_dict(plain)
    assert sorted(back) == sorted(plain_state) and all(_same(back[k], plain_state[k]) for k in plain_state)
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    capsys.readouterr()
    assert _run("convert", "--src", tmp_path / "m", "--dst", tmp_path / "hf-q", "--to", "hf", "--requantize") == 0
    line = [s for s in capsys.readouterr().out.splitlines() if "re-quantized" in s]
    assert line and f"re-quantized {count} tensors: max abs error 0, 0 not exact, 0 with bytes" in line[0]
    again = load_safetensors_state_dict(tmp_path / "hf-q")
    assert sorted(again) == sorted(stored)
    for key, value in stored.items():
        assert again[key].dtype == value.dtype and torch.equal(again[key].view(torch.uint8),
                                                               value.contiguous().view(torch.uint8)), key


def test_fp8_vlm_converts_as_its_dequantized_values_and_requantizes_exactly(fp8_vlm, tmp_path, capsys):
    src, plain, stored = fp8_vlm
    assert_imports_as_dequantized(src, plain, tmp_path)
    record = read_manifest(tmp_path / "m").provenance.extra["quantization"]
    quantized = [k for k in stored if k.endswith("_scale_inv")]
    assert record == {"method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 24],
                      "modules_to_not_convert": ["lm_head"], "dequantized": len(quantized), "dtype": "bfloat16",
                      "scales_file": "quant_scales.safetensors"}

    assert_exports_round_trip(tmp_path, plain, stored, len(quantized), capsys)
    config = json.loads((tmp_path / "hf-q" / "config.json").read_text())
    assert Q.parse_quantization_config(config["quantization_config"]) == E2E
    assert read_manifest(tmp_path / "hf-q").provenance.extra["requantized"] == {
        "tensors": len(quantized), "max_abs_error": 0.0, "inexact": 0, "bytes_changed": 0}
    # Re-quantizing a source that never was quantized is refused.
    assert _run("convert", "--src", tmp_path / "m-plain", "--dst", tmp_path / "x", "--to", "hf",
                "--requantize", "--quiet") == 2


@pytest.mark.slow  # starts three interpreters
def test_requantized_export_by_two_processes_is_the_one_process_export(fp8_vlm, tmp_path):
    """--requantize on several processes: a weight and its scale may land in shards of different
    ranks; the files and the re-quantization report are the one-process ones."""
    src, _, _ = fp8_vlm
    assert _run("convert", "--src", src, "--dst", tmp_path / "m", "--to", "mcore", "--quiet") == 0
    for workers in ("1", "2"):
        assert _run("convert", "--src", tmp_path / "m", "--dst", tmp_path / f"q{workers}", "--to", "hf",
                    "--requantize", "--max-shard-size", "20KB", "--workers", workers, "--quiet") == 0
    one, two = (sorted(p for p in (tmp_path / f"q{w}").iterdir()) for w in "12")
    assert len(one) > 4 and [p.name for p in one] == [p.name for p in two]
    assert [p.name for p, q in zip(one, two) if p.read_bytes() != q.read_bytes()] == []


def test_broken_scales_and_unknown_methods_exit_2_in_one_line(fp8_vlm, tmp_path, capsys):
    src, _, stored = fp8_vlm
    config = json.loads((src / "config.json").read_text())
    victim = sorted(k for k in stored if k.endswith("_scale_inv"))[0]
    broken = {**stored, victim: stored[victim][:, :-1].contiguous()}
    orphan = "model.language_model.layers.0.mlp.extra_proj.weight_scale_inv"
    broken[orphan] = torch.ones(1, 1)
    cases = [(_save(tmp_path / "broken", broken, config), [victim[: -len("_scale_inv")], orphan, "scale shape"]),
             (_save(tmp_path / "int4", stored, {**config, "quantization_config": {
                 "quant_method": "compressed-tensors", "format": "pack-quantized"}}),
              ["(compressed-tensors) is not supported", "config_groups"])]
    for path, words in cases:
        capsys.readouterr()
        assert _run("convert", "--src", path, "--dst", tmp_path / f"out-{path.name}", "--to", "mcore",
                    "--quiet") == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        for word in words:
            assert word in err, err
        assert not (tmp_path / f"out-{path.name}").exists()
