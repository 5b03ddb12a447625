"""Fault injection: numbers that make no sense, blame put on the wrong file, and what is written
against what is checked.

Each class: a number a checkpoint or a config states (a NaN ``checkpoint_version``, a NaN or absurd
``params.json`` field, a ``config.json`` beside ``params.json`` that says otherwise, a vocabulary
divisor that pads a table to hundreds of GB, a side file that declares a 12 GiB tensor), a
non-floating target dtype of the live export, a ``--base`` tensor of the wrong shape, expert
problems, ±Inf weights through ``--requantize``, a ``--dtype`` cast that overflows under
``--check-finite``, a divisor a checkpoint records for ``--impl megatron``, NaN metrics in a
``--json`` report. The contract is tests/faults/test_faults.py's: the command gives a correct result, or
exits 2 with one stderr line naming the file (or flag, or argument) and the fix, never a
traceback, never numeric nonsense published.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch

from mmparity.cli.main import main

from tests.faults.test_faults import copy_tree, one_line_error, run_cli, run_subprocess, sources  # noqa: F401
# The FP8 (Mistral3) and INT4 (Kimi-K2.5 experts) sources of the quantization tests.
from tests.mapping.test_quant import fp8_vlm  # noqa: E402,F401
from tests.mapping.test_quant_int4 import int4_kimi  # noqa: E402,F401
# LLaVA on the CLIP tiny tower (which stock megatron-core builds), converted once per divisor.
from tests.faults.test_faults_recorded import VOCAB, converted, hf  # noqa: E402,F401

pytestmark = pytest.mark.fault

RANK_FILE = "iter_0000001/mp_rank_00/model_optim_rng.pt"


def _resave_rank_file(path: Path, edit) -> None:
    """A rank file of mmparity's own (tensors and Megatron-LM's args), loaded, edited and saved again."""
    # conftest allow-lists the Namespace for the whole run: a `safe_globals` block here would
    # remove it again on exit, for every test after this one.
    payload = torch.load(path, weights_only=True)
    edit(payload)
    torch.save(payload, path)


# --------------------------------------------------------------------------------------------------
# 1. a legacy rank file's checkpoint_version that is no version


@pytest.mark.parametrize("version", [math.nan, math.inf, -math.inf, -3.0, 0.5, 1e300, 4.0, True, "3.0", None])
def test_checkpoint_version_that_is_no_version_is_refused(capsys, sources, tmp_path, version):
    src = copy_tree(sources["legacy"], tmp_path / "src")
    _resave_rank_file(src / RANK_FILE, lambda p: p.__setitem__("checkpoint_version", version))
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / "hf", "--to", "hf", "--quiet")
    one_line_error(code, out, err, RANK_FILE.split("/")[-1], "checkpoint_version")
    assert not (tmp_path / "hf").exists()
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / "tp", "--to", "mcore", "--quiet")
    one_line_error(code, out, err, "checkpoint_version")
    # verify lists the damage (exit 1), no traceback.
    code, out, err = run_cli(capsys, "verify", src)
    assert code == 1 and "checkpoint_version" in out and "Traceback" not in out + err, (code, out, err)


@pytest.mark.parametrize("version", [3, 3.0, 3.5])
def test_checkpoint_version_of_the_current_layout_converts(capsys, sources, tmp_path, version):
    src = copy_tree(sources["legacy"], tmp_path / "src")
    _resave_rank_file(src / RANK_FILE, lambda p: p.__setitem__("checkpoint_version", version))
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / "hf", "--to", "hf", "--quiet")
    assert code == 0, err


@pytest.mark.parametrize("version", [math.nan, -math.inf, 0.5, 4.0, "3.0"])
def test_torch_dist_checkpoint_version_that_is_no_version_is_refused(capsys, sources, tmp_path, version):
    """The same number in a torch_dist checkpoint's common state (``common.pt``)."""
    src = copy_tree(sources["torch_dist"], tmp_path / "src")
    common = next(src.glob("iter_*/common.pt"))
    payload = torch.load(common, weights_only=True)
    assert payload["checkpoint_version"] == 3.0  # the harness's own file: the field is there to break
    payload["checkpoint_version"] = version
    torch.save(payload, common)
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / "hf", "--to", "hf", "--quiet")
    one_line_error(code, out, err, "common.pt", "checkpoint_version")
    assert not (tmp_path / "hf").exists()
    code, out, err = run_cli(capsys, "verify", src)
    assert code in (1, 2) and "checkpoint_version" in out + err and "Traceback" not in out + err, (code, out, err)


# --------------------------------------------------------------------------------------------------
# 2. Mistral's params.json: NaN and absurd numbers, and a config.json beside it that disagrees


@pytest.fixture(scope="module")
def mistral_release(tmp_path_factory):
    """A tiny Mistral3 as Mistral ships it (consolidated.safetensors + params.json), its params and
    the HF config they translate to."""
    from safetensors.torch import save_file

    from mmparity.models.parts.mistral_params import params_from_config
    from tests.models.test_whole_vlm import _mistral_native_state

    _, native, cfg = _mistral_native_state("mistral3", seed=23)
    path = tmp_path_factory.mktemp("mistral") / "release"
    path.mkdir()
    save_file({k: v.contiguous() for k, v in native.items()}, str(path / "consolidated.safetensors"))
    params = params_from_config(cfg)
    (path / "params.json").write_text(json.dumps(params))
    return path, params, cfg


def _release_with(release: Path, tmp_path: Path, params: dict | None = None, config: str | None = None) -> Path:
    src = tmp_path / "release"
    shutil.copytree(release, src)
    if params is not None:
        (src / "params.json").write_text(json.dumps(params, allow_nan=True))
    if config is not None:
        (src / "config.json").write_text(config)
    return src


def _edited(params: dict, key: str, value) -> dict:
    out = json.loads(json.dumps(params))
    section, _, name = key.rpartition(".")
    (out[section] if section else out)[name] = value
    return out


ABSURD_PARAMS = [("norm_eps", math.nan), ("norm_eps", 0.0), ("norm_eps", -1e-5), ("norm_eps", "1e-5"),
                 ("rope_theta", math.inf), ("rope_theta", 0.5), ("rope_theta", -10000.0),
                 ("vision_encoder.rope_theta", math.nan), ("dim", -40), ("dim", 0), ("dim", 40.0),
                 ("n_layers", True), ("n_layers", 10**9), ("hidden_dim", 2**40), ("n_heads", False),
                 ("n_kv_heads", 3), ("head_dim", -12), ("vocab_size", 10**12), ("vocab_size", 0),
                 ("max_position_embeddings", -1), ("tied_embeddings", "false"), ("tied_embeddings", 0),
                 ("vision_encoder.patch_size", -8), ("vision_encoder.patch_size", 1000),
                 ("vision_encoder.image_size", 10**9), ("vision_encoder.num_channels", 0),
                 ("vision_encoder.num_attention_heads", 0), ("vision_encoder.spatial_merge_size", 0),
                 ("vision_encoder.image_token_id", 10**6), ("vision_encoder.image_token_id", -1),
                 ("vision_encoder.adapter_bias", "yes"), ("vision_encoder.hidden_size", True)]


@pytest.mark.parametrize("key,value", ABSURD_PARAMS, ids=[f"{k}={v!r}" for k, v in ABSURD_PARAMS])
def test_absurd_number_in_params_json_is_refused_by_file_and_key(capsys, mistral_release, tmp_path, key, value):
    release, params, _ = mistral_release
    src = _release_with(release, tmp_path, _edited(params, key, value))
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / "mcore", "--to", "mcore")
    line = one_line_error(code, out, err, "params.json", key.rpartition(".")[2])
    assert str(tmp_path) in line
    assert not (tmp_path / "mcore").exists()


@pytest.mark.parametrize("key,value", [("norm_eps", math.nan), ("vocab_size", 10**12)])
def test_check_refuses_an_absurd_params_json_by_file_and_key(capsys, mistral_release, tmp_path, key, value):
    release, params, _ = mistral_release
    src = _release_with(release, tmp_path, _edited(params, key, value))
    code, out, err = run_cli(capsys, "check", "--hf", src, "--no-components")
    one_line_error(code, out, err, "params.json", key)


def test_nan_in_a_config_json_is_refused_by_file_and_key(capsys, sources, tmp_path):
    src = copy_tree(sources["hf"], tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    config["rope_parameters"] = {**(config.get("rope_parameters") or {}), "rope_theta": math.nan}
    (src / "config.json").write_text(json.dumps(config, allow_nan=True))
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / "mcore", "--to", "mcore")
    one_line_error(code, out, err, "config.json", "rope_parameters.rope_theta")


ABSURD_CONFIG = [("text_config.num_hidden_layers", -2), ("text_config.hidden_size", 0),
                 ("text_config.hidden_size", 40.5), ("text_config.num_attention_heads", True),
                 ("text_config.rms_norm_eps", -1.0), ("text_config.rms_norm_eps", 0.0), ("text_config.rms_norm_eps", 2.0),
                 ("vision_config.patch_size", 0), ("vision_config.image_size", -32), ("vision_config.num_channels", "3"),
                 ("text_config.vocab_size", 10**12), ("text_config.num_key_value_heads", -4)]


@pytest.mark.parametrize("key,value", ABSURD_CONFIG, ids=[f"{k}={v!r}" for k, v in ABSURD_CONFIG])
def test_absurd_number_in_a_config_json_is_refused_by_file_and_key(capsys, hf, tmp_path, key, value):
    src = copy_tree(hf, tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    section, name = key.split(".")
    config[section][name] = value
    (src / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / "mcore", "--to", "mcore")
    one_line_error(code, out, err, "config.json", key)
    assert not (tmp_path / "mcore").exists()


DISAGREEMENTS = [("dim", 48), ("n_layers", 3), ("norm_eps", 1e-6), ("rope_theta", 1e6), ("vocab_size", 98),
                 ("n_kv_heads", 8), ("tied_embeddings", True), ("vision_encoder.patch_size", 12),
                 ("vision_encoder.rope_theta", 20000.0), ("vision_encoder.spatial_merge_size", 1),
                 ("vision_encoder.image_token_id", 11)]


@pytest.mark.parametrize("key,value", DISAGREEMENTS, ids=[f"{k}={v!r}" for k, v in DISAGREEMENTS])
def test_config_json_beside_a_params_json_that_disagrees_is_refused(capsys, mistral_release, tmp_path, key, value):
    """config.json is read (as transformers reads it); a params.json beside it that states one of
    the same fields otherwise is refused, naming both files and the field, not silently outvoted."""
    release, params, cfg = mistral_release
    src = _release_with(release, tmp_path, _edited(params, key, value), cfg.to_json_string())
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / "mcore", "--to", "mcore")
    one_line_error(code, out, err, "config.json", "params.json", key, "disagree")
    assert not (tmp_path / "mcore").exists()


def test_config_json_beside_a_params_json_that_agrees_converts(capsys, mistral_release, tmp_path):
    """Both files describing the same model: config.json is read, the result is the params.json
    release's, bit for bit."""
    from mmparity.convert import read_mcore_shards

    release, params, cfg = mistral_release
    for name, config in (("both", cfg.to_json_string()), ("params_only", None)):
        src = _release_with(release, tmp_path / name, config=config)
        code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / name / "mcore", "--to",
                                 "mcore", "--format", "legacy", "--quiet")
        assert code == 0, err
    (_, _, both), (_, _, alone) = (read_mcore_shards(tmp_path / n / "mcore") for n in ("both", "params_only"))
    assert sorted(both[0]) == sorted(alone[0])
    assert all(torch.equal(both[0][k], alone[0][k]) for k in alone[0])


# --------------------------------------------------------------------------------------------------
# 3. the live export's target dtype: floating weight dtypes only


@pytest.fixture(scope="module")
def live_pixtral():
    """mmparity's native pixtral (Megatron's names) with seeded weights, in a one-rank group."""
    from mmparity.models import registry as families
    from mmparity.parallel import runtime
    from mmparity.models.core.inputs import random_like_state

    fam = families.get("pixtral")
    cfg = fam.tiny_config()
    if runtime.current_layout() is None:
        runtime.init_parallel(1, 1)
    reference = random_like_state(fam.build_reference(cfg).state_dict(), seed=31)
    model = fam.build_native(cfg)
    result = model.load_state_dict(fam.hf_to_mcore(reference, cfg)[0], strict=False)
    assert not result.unexpected_keys and all(k.endswith("_extra_state") for k in result.missing_keys), result
    return model, cfg


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
                                   torch.float8_e4m3fn, torch.complex64, "float16", 16],
                         ids=str)
def test_live_export_refuses_a_dtype_that_is_no_weight_dtype(live_pixtral, dtype):
    from mmparity.megatron import live

    model, cfg = live_pixtral
    with pytest.raises(ValueError, match=r"export_hf: dtype=.* is not a weight dtype") as info:
        live.export_hf(model, "pixtral", cfg, dtype=dtype)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_live_export_casts_to_a_floating_dtype(live_pixtral, dtype):
    from mmparity.megatron import live

    model, cfg = live_pixtral
    own = dict(live.export_hf(model, "pixtral", cfg))
    cast = dict(live.export_hf(model, "pixtral", cfg, dtype=dtype))
    assert cast.keys() == own.keys()
    for key, value in own.items():
        assert cast[key].dtype == dtype and torch.equal(cast[key], value.to(dtype)), key


# --------------------------------------------------------------------------------------------------
# 4. a --base tensor of the wrong shape is the base's fault


@pytest.fixture(scope="module")
def clip_sources(tmp_path_factory):
    """A tiny CLIP (whose ln_post Megatron's class has no place for: it comes from --base) as an HF
    release and as Megatron-LM would have saved it (no mmparity files)."""
    from mmparity.models import registry as families
    from mmparity.models.core.inputs import random_like_state

    root = tmp_path_factory.mktemp("clip")
    fam = families.get("clip")
    model = fam.build_reference(fam.tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=29))
    model.save_pretrained(root / "hf")
    assert main(["convert", "--family", "clip", "--src", str(root / "hf"), "--dst", str(root / "legacy"),
                 "--to", "mcore", "--format", "legacy", "--quiet"]) == 0
    megatron = copy_tree(root / "legacy", root / "megatron")
    for name in ("mmparity.json", "hf_config.json", "mcore_side.safetensors"):
        (megatron / name).unlink()
    return {"hf": root / "hf", "legacy": root / "legacy", "megatron": megatron}


def _base_with(hf: Path, dst: Path, key: str, reshape) -> Path:
    from safetensors.torch import load_file, save_file

    base = copy_tree(hf, dst)
    state = load_file(str(base / "model.safetensors"))
    state[key] = reshape(state[key])
    save_file(state, str(base / "model.safetensors"), metadata={"format": "pt"})
    return base


BAD_BASE = {
    "side tensor, extra rows": ("post_layernorm.weight", lambda t: torch.cat([t, t[:3]])),
    "side tensor, extra dim": ("post_layernorm.bias", lambda t: t[None]),
    "side tensor, empty": ("post_layernorm.weight", lambda t: t[:0]),
    "trained tensor, extra rows": ("encoder.layers.0.mlp.fc1.weight", lambda t: torch.cat([t, t[:3]])),
    "trained tensor, transposed": ("encoder.layers.1.self_attn.out_proj.weight", lambda t: t[:, :-2].T.contiguous()),
    "a tensor an op reshapes": ("embeddings.class_embedding", lambda t: torch.cat([t, t[:3]])),
}


@pytest.mark.parametrize("case", sorted(BAD_BASE))
def test_base_tensor_of_a_bad_shape_is_blamed_on_the_base(capsys, clip_sources, tmp_path, case):
    key, reshape = BAD_BASE[case]
    base = _base_with(clip_sources["hf"], tmp_path / "base", key, reshape)
    src = clip_sources["megatron"]
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / "out", "--to", "hf",
                             "--base", base, "--quiet")
    line = one_line_error(code, out, err, f"--base {base}", key)
    assert f"{src}:" not in line, line  # the checkpoint is not what is wrong
    assert not (tmp_path / "out").exists()


def test_base_of_the_right_shapes_exports_bit_exact(capsys, clip_sources, tmp_path):
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    code, out, err = run_cli(capsys, "convert", "--src", clip_sources["megatron"], "--dst", tmp_path / "out",
                             "--to", "hf", "--base", clip_sources["hf"], "--quiet")
    assert code == 0, err
    got, want = load_safetensors_state_dict(tmp_path / "out"), load_safetensors_state_dict(clip_sources["hf"])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# --------------------------------------------------------------------------------------------------
# 5. expert problems: one line, however many


@pytest.fixture(scope="module")
def kimi_ep2(tmp_path_factory):
    """A tiny whole Kimi-K2.5 (routed experts) as a legacy checkpoint at EP 2."""
    from tests.mapping.test_convert_roundtrips import save_hf

    root = tmp_path_factory.mktemp("kimi")
    save_hf("kimi_k25_vl", root / "hf", seed=5)
    assert main(["convert", "--src", str(root / "hf"), "--dst", str(root / "ep2"), "--to", "mcore", "--format",
                 "legacy", "--ep", "2", "--quiet"]) == 0
    return root / "ep2"


EXPERT_KEY = "language_model.decoder.layers.1.mlp.experts.linear_fc{}.weight{}"
FINAL_NORM = "language_model.decoder.final_layernorm.weight"


def _drop(*keys):
    def edit(model):
        for key in keys:
            del model[key]
    return edit


def _renumber(old: int, new: int):
    def edit(model):
        for fc in (1, 2):
            model[EXPERT_KEY.format(fc, new)] = model.pop(EXPERT_KEY.format(fc, old))
    return edit


def _perturb(key: str):
    def edit(model):
        model[key] = model[key] + 1
    return edit


EXPERT_FAULTS = {
    "an expert missing": (_drop(EXPERT_KEY.format(1, 1), EXPERT_KEY.format(2, 1)), "expert"),
    "an expert lacking a linear": (_drop(EXPERT_KEY.format(2, 1)), "expert"),
    "an expert beyond the rank's share": (_renumber(2, 3), "expert"),
    "a replicated tensor absent on one rank": (_drop(FINAL_NORM), FINAL_NORM),
    "a replicated tensor that differs on one rank": (_perturb(FINAL_NORM), FINAL_NORM),
    "every replicated tensor differs": (None, "replicated over EP"),
}


@pytest.mark.parametrize("command", ["convert --to hf", "convert --to mcore --ep 1", "check --mcore"])
@pytest.mark.parametrize("case", sorted(EXPERT_FAULTS))
def test_expert_problems_are_one_line(capsys, kimi_ep2, tmp_path, case, command):
    edit, needle = EXPERT_FAULTS[case]
    src = copy_tree(kimi_ep2, tmp_path / "src")
    rank1 = src / "iter_0000001/mp_rank_00_001/model_optim_rng.pt"
    if edit is None:  # every replicated tensor of EP rank 1 from another model
        def edit(model):
            for key, value in list(model.items()):
                if torch.is_tensor(value) and ".experts." not in key:
                    model[key] = value.flip(0) if value.dim() else value + 1
    _resave_rank_file(rank1, lambda payload: edit(payload["model"]))
    if command == "check --mcore":
        argv = ["check", "--mcore", src, "--no-components"]
    else:
        argv = ["convert", "--src", src, "--dst", tmp_path / "out", *command.split()[1:], "--quiet"]
    code, out, err = run_cli(capsys, *argv)
    one_line_error(code, out, err, "EP", needle)
    assert not (tmp_path / "out").exists()


def test_a_user_error_that_spans_lines_is_printed_as_one(capsys, monkeypatch):
    """The last guard: whatever text a refusal carries (a tool's multi-line message passed
    through), stderr gets one line."""
    from mmparity.cli import list_cmd
    from mmparity.cli.common import UsageError

    def refuse(args):
        raise UsageError("first reason:\n  - one\n\n  - two\n")

    monkeypatch.setattr(list_cmd, "run", refuse)
    code, out, err = run_cli(capsys, "list")
    assert one_line_error(code, out, err, "first reason:", "- one", "- two")


# --------------------------------------------------------------------------------------------------
# 6. --requantize of weights that hold ±Inf or NaN


def _quantized_checkpoint(src: Path, dst: Path) -> Path:
    assert main(["convert", "--src", str(src), "--dst", str(dst), "--to", "mcore", "--format", "legacy",
                 "--quiet"]) == 0
    return dst


NON_FINITE = {"+Inf": [math.inf], "-Inf": [-math.inf], "NaN": [math.nan], "+Inf and NaN": [math.inf, math.nan]}


def _poison(key: str, values: list):
    def edit(payload):
        tensor = payload["model"][key].clone()
        for i, value in enumerate(values):
            tensor[i, (3 * i + 1) % tensor.shape[1]] = value
        payload["model"][key] = tensor
    return edit


@pytest.mark.parametrize("values", sorted(NON_FINITE))
@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_requantize_refuses_weights_it_cannot_hold(capsys, request, tmp_path, scheme, values):
    """±Inf has no encoding in float8_e4m3fn or INT4, and one such value made its whole block NaN
    (the scale of Inf is NaN) while the summary said "max abs error 0": refused by tensor."""
    fixture, key, hf_key = {
        "fp8": ("fp8_vlm", "language_model.decoder.layers.0.self_attention.linear_proj.weight", "o_proj.weight"),
        "int4": ("int4_kimi", "language_model.decoder.layers.1.mlp.experts.linear_fc2.weight0",
                 "experts.0.down_proj.weight"),
    }[scheme]
    src = request.getfixturevalue(fixture)[0]
    mcore = _quantized_checkpoint(src, tmp_path / "m")
    _resave_rank_file(mcore / RANK_FILE, _poison(key, NON_FINITE[values]))
    code, out, err = run_cli(capsys, "convert", "--src", mcore, "--dst", tmp_path / "hf-q", "--to", "hf",
                             "--requantize")
    one_line_error(code, out, err, "--requantize", hf_key, values.split()[0], "without --requantize")
    assert not (tmp_path / "hf-q").exists()
    # Exported as they are, the values are kept, ±Inf and NaN included.
    code, out, err = run_cli(capsys, "convert", "--src", mcore, "--dst", tmp_path / "hf", "--to", "hf", "--quiet")
    assert code == 0, err


def test_requant_error_counts_non_finite_changes():
    from mmparity.mapping import quant as Q

    scheme = Q.QuantScheme("fp8", (2, 2))
    raw = torch.tensor([[1.0, -2.5], [3.0, 4.25]], dtype=torch.bfloat16)
    value = Q.dequantize(*Q.quantize(raw, scheme), scheme, torch.bfloat16)  # values the scheme holds
    weight, scale = Q.quantize(value, scheme)
    assert Q.requant_error(value, weight, scale, scheme) == (0.0, True)
    for bad in (math.inf, -math.inf, math.nan):
        changed = value.clone()
        changed[0, 0] = bad  # what comes back is finite: an infinite change, whatever its sign
        error, exact = Q.requant_error(changed, weight, scale, scheme)
        assert error == math.inf and not exact, (bad, error)
    # NaN where a finite value was exported: not exact, and not a NaN that a maximum drops.
    nan_weight = weight.clone()
    nan_weight[0, 0] = torch.tensor(math.nan).to(Q.FP8_DTYPE)
    error, exact = Q.requant_error(value, nan_weight, scale, scheme)
    assert error == math.inf and not exact
    assert Q.RequantError().add(error, exact, False).max_abs_error == math.inf
    with pytest.raises(Q.QuantError, match="1 value.*NaN"):
        Q.quantize(torch.where(value > 4, math.nan, value), scheme)


# --------------------------------------------------------------------------------------------------
# 7. --check-finite certifies what is written: after the --dtype cast


BIG = {"float16": (1e6, "float16"), "float16 max+": (65520.0, "float16"),
       "bfloat16": (torch.finfo(torch.float32).max, "bfloat16")}


@pytest.fixture(scope="module")
def overflowing(sources, tmp_path_factory):
    """pixtral in float32 with one finite value per case that the cast to a narrower dtype makes
    Inf, as an HF directory and a legacy mcore checkpoint."""
    from safetensors.torch import load_file, save_file

    out = {}
    for case, (value, _) in BIG.items():
        root = tmp_path_factory.mktemp("overflow")
        hf = copy_tree(sources["hf"], root / "hf")
        state = load_file(str(hf / "model.safetensors"))
        key = sorted(k for k in state if k.endswith("feed_forward.down_proj.weight"))[0]
        assert state[key].dtype == torch.float32
        state[key][1, 2] = value
        save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})
        assert main(["convert", "--family", "pixtral", "--src", str(hf), "--dst", str(root / "legacy"), "--to",
                     "mcore", "--format", "legacy", "--quiet"]) == 0
        out[case] = (hf, root / "legacy", key)
    return out


@pytest.mark.parametrize("direction", ["hf->mcore", "mcore->hf"])
@pytest.mark.parametrize("case", sorted(BIG))
def test_check_finite_looks_at_the_values_after_the_cast(capsys, overflowing, tmp_path, case, direction):
    hf, legacy, key = overflowing[case]
    dtype = BIG[case][1]
    argv = (["--family", "pixtral", "--src", hf, "--to", "mcore"] if direction == "hf->mcore"
            else ["--src", legacy, "--to", "hf"])
    code, out, err = run_cli(capsys, "convert", *argv, "--dst", tmp_path / "out", "--dtype", dtype,
                             "--check-finite")
    name = key if direction == "hf->mcore" else "linear_fc2.weight"
    one_line_error(code, out, err, name, "--check-finite", f"cast to {dtype}", "1 value(s) overflow")
    assert not (tmp_path / "out").exists()
    # In float32 the same source is finite and certified so.
    code, out, err = run_cli(capsys, "convert", *argv, "--dst", tmp_path / "f32", "--dtype", "float32",
                             "--check-finite", "--quiet")
    assert code == 0, err


# --------------------------------------------------------------------------------------------------
# 8. a side file whose header declares what no config implies (a sparse 12 GiB tensor)

# Under this address-space limit an allocation of what a bad header declares fails at once instead
# of taking the shared machine's memory (and a mapping of the whole sparse file fails too).
MEMORY_LIMIT = 8 * 2**30
HUGE = 3 * 2**30  # float32 elements: 12 GiB


def _write_side_file(path: Path, entries: dict) -> None:
    """A safetensors file of ``entries`` (name -> (dtype code, shape, bytes or None)), the bytes
    of a None entry left as a hole: the file is as long as its header says, and sparse."""
    header, offset, data = {}, 0, []
    sizes = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2}
    for name, (code, shape, raw) in entries.items():
        nbytes = math.prod(shape) * sizes[code]
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        data.append((offset, raw))
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for at, raw in data:
            if raw is not None:
                f.seek(8 + len(text) + at)
                f.write(raw)
        f.truncate(8 + len(text) + offset)


def _side_entries(clip_legacy: Path) -> dict:
    from safetensors.torch import load_file

    side = load_file(str(clip_legacy / "mcore_side.safetensors"))
    assert sorted(side) == ["ln_post.bias", "ln_post.weight"]
    return {k: ("F32", tuple(v.shape), v.numpy().tobytes()) for k, v in side.items()}


HUGE_SIDE_FILES = {
    "a sparse 12 GiB tensor in its place": lambda e: {**e, "ln_post.weight": ("F32", (HUGE,), None)},
    "a sparse 12 GiB tensor beside it": lambda e: {**e, "ln_post.extra": ("F32", (HUGE,), None)},
}
SIDE_FILES = {
    "a longer tensor": lambda e: {**e, "ln_post.weight": ("F32", (50,), None)},
    "a 2-d tensor of the right count": lambda e: {**e, "ln_post.weight": ("F32", (8, 6), e["ln_post.weight"][2])},
    "another dtype": lambda e: {**e, "ln_post.bias": ("F16", (96,), None)},
    "a tensor missing": lambda e: {k: v for k, v in e.items() if k != "ln_post.bias"},
}


@pytest.mark.slow  # child processes under an address-space limit
@pytest.mark.parametrize("case", sorted(HUGE_SIDE_FILES))
def test_side_file_declaring_12_gib_is_refused_from_its_header(clip_sources, tmp_path, case):
    src = copy_tree(clip_sources["legacy"], tmp_path / "src")
    _write_side_file(src / "mcore_side.safetensors", HUGE_SIDE_FILES[case](_side_entries(clip_sources["legacy"])))
    for argv in (["check", "--mcore", src, "--hf", clip_sources["hf"], "--no-components"],
                 ["convert", "--src", src, "--dst", tmp_path / "out", "--to", "hf"]):
        code, out, err = run_subprocess(*argv, memory_limit=MEMORY_LIMIT)
        one_line_error(code, out, err, "mcore_side.safetensors", "ln_post.", str(HUGE))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", sorted(SIDE_FILES))
def test_side_file_of_other_shapes_or_dtypes_is_refused_by_tensor(capsys, clip_sources, tmp_path, case):
    src = copy_tree(clip_sources["legacy"], tmp_path / "src")
    _write_side_file(src / "mcore_side.safetensors", SIDE_FILES[case](_side_entries(clip_sources["legacy"])))
    for argv in (["check", "--mcore", src, "--hf", clip_sources["hf"], "--no-components"],
                 ["convert", "--src", src, "--dst", tmp_path / "out", "--to", "hf"]):
        code, out, err = run_cli(capsys, *argv)
        one_line_error(code, out, err, "mcore_side.safetensors", "ln_post.")
    assert not (tmp_path / "out").exists()
    code, out, err = run_cli(capsys, "verify", src)
    assert code == 1 and "mcore_side.safetensors" in out and "Traceback" not in out + err, (code, out, err)


def test_verify_holds_a_header_to_its_record_before_reading(clip_sources, tmp_path, monkeypatch):
    """verify maps the file (no address-space limit on a big machine): the declared 12 GiB are
    refused from the header; the tensor is never read."""
    import importlib

    verify_mod = importlib.import_module("mmparity.io.verify")  # the package exports a function of that name
    from mmparity.io.formats import hf as safetensors_verifier  # verifies side files as HF shards
    src = copy_tree(clip_sources["legacy"], tmp_path / "src")
    entries = HUGE_SIDE_FILES["a sparse 12 GiB tensor in its place"](_side_entries(clip_sources["legacy"]))
    _write_side_file(src / "mcore_side.safetensors", entries)
    opened = safetensors_verifier.safe_open

    class Guarded:
        def __init__(self, *args, **kwargs):
            self._handle = opened(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._handle, name)

        def get_tensor(self, key):
            if list(self._handle.get_slice(key).get_shape()) == [HUGE]:
                raise AssertionError(f"verify read the {HUGE}-element tensor {key} its header declares")
            return self._handle.get_tensor(key)

    monkeypatch.setattr(safetensors_verifier, "safe_open", Guarded)
    report = verify_mod.verify(src)
    assert not report.ok and any("ln_post.weight" in str(p) and "its header declares shape" in str(p)
                                 for p in report.problems), str(report)


# --------------------------------------------------------------------------------------------------
# 9. the vocabulary divisor: bounded where typed, and the recorded one is what Megatron's class is
#    built with



@pytest.mark.parametrize("divisor", [10**6, 2**17, 131_000])
@pytest.mark.parametrize("target", ["torch_dist", "legacy --tp 2", "re-pad an mcore source"])
def test_a_divisor_that_pads_past_any_megatron_run_is_refused_by_flag(capsys, hf, converted, tmp_path, target,
                                                                        divisor):
    src = converted("legacy") if target == "re-pad an mcore source" else hf
    extra = ["--format", "legacy", "--tp", "2"] if target == "legacy --tp 2" else []
    code, out, err = run_cli(capsys, "convert", "--family", "llava", "--src", src, "--dst", tmp_path / "out",
                             "--to", "mcore", *extra, "--make-vocab-size-divisible-by", divisor)
    one_line_error(code, out, err, f"--make-vocab-size-divisible-by {divisor}", f"from {VOCAB} to")
    assert not (tmp_path / "out").exists()


def test_a_divisor_given_to_an_export_is_refused_not_ignored(capsys, hf, converted, tmp_path):
    code, out, err = run_cli(capsys, "convert", "--src", converted("legacy"), "--dst", tmp_path / "out",
                             "--to", "hf", "--make-vocab-size-divisible-by", 64)
    one_line_error(code, out, err, "--make-vocab-size-divisible-by", "--to hf", "drop the flag")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a child process under an address-space limit
def test_a_typed_divisor_of_a_billion_is_refused_before_allocating(hf, tmp_path):
    code, out, err = run_subprocess("convert", "--family", "llava", "--src", hf, "--dst", tmp_path / "out",
                                    "--to", "mcore", "--make-vocab-size-divisible-by", 10**9,
                                    memory_limit=MEMORY_LIMIT)
    one_line_error(code, out, err, "--make-vocab-size-divisible-by 1000000000")


@pytest.mark.parametrize("divisor", [1, 7, 256, 2**16])
def test_a_divisor_within_the_bound_converts(capsys, hf, tmp_path, divisor):
    from mmparity.convert import read_mcore_shards

    code, out, err = run_cli(capsys, "convert", "--family", "llava", "--src", hf, "--dst", tmp_path / "out",
                             "--to", "mcore", "--format", "legacy", "--make-vocab-size-divisible-by", divisor,
                             "--quiet")
    assert code == 0, err
    table = read_mcore_shards(tmp_path / "out")[2][0]["language_model.embedding.word_embeddings.weight"]
    assert table.shape[0] == -(-VOCAB // divisor) * divisor


def _megatron_written(converted_dir: Path, dst: Path, args_divisor: int | None = None) -> Path:
    """convert's legacy output as Megatron-LM leaves it (no mmparity files), its args' divisor
    replaced when given."""
    src = copy_tree(converted_dir, dst)
    for name in ("mmparity.json", "hf_config.json", "mcore_side.safetensors"):
        (src / name).unlink(missing_ok=True)
    if args_divisor is not None:
        _resave_rank_file(src / RANK_FILE, lambda p: setattr(p["args"], "make_vocab_size_divisible_by", args_divisor))
    return src


def test_megatron_written_with_a_small_divisor_exports_and_loads(capsys, hf, converted, tmp_path):
    """Megatron-LM run with --make-vocab-size-divisible-by 7 pads 101 rows to 105, fewer than the
    default 128 would: its checkpoint exports with --base and loads, the args' divisor taken."""
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    src = _megatron_written(converted("legacy", divisor=7), tmp_path / "megatron")
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / "out", "--to", "hf",
                             "--base", hf, "--quiet")
    assert code == 0, err
    got, want = load_safetensors_state_dict(tmp_path / "out"), load_safetensors_state_dict(hf)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    code, out, err = run_cli(capsys, "verify", "--load", src, "--base", hf)
    assert code == 0 and "rank 0: ok" in out, out + err


@pytest.mark.parametrize("args_divisor", [10**9, 64, 2**20])
def test_megatron_args_with_another_divisor_are_refused_before_building(capsys, hf, converted, tmp_path,
                                                                        args_divisor):
    src = _megatron_written(converted("legacy", divisor=7), tmp_path / "megatron", args_divisor)
    code, out, err = run_cli(capsys, "verify", "--load", src, "--base", hf)
    one_line_error(code, out, err, str(src), f"make_vocab_size_divisible_by {args_divisor}", "holds 105")


@pytest.mark.parametrize("impl", ["megatron", "both"])
@pytest.mark.parametrize("divisor", [7, 256])
def test_check_mcore_impl_megatron_builds_with_the_recorded_divisor(capsys, converted, impl, divisor):
    """The divisor convert recorded (101 rows padded to 105, or to 256) is the one Megatron's
    LLaVAModel is built with, and the reference's loss is taken over the same padded rows."""
    code, out, err = run_cli(capsys, "check", "--mcore", converted("legacy", divisor=divisor), "--impl", impl,
                             "--no-components", "--quiet")
    assert code == 0, out + err
    assert "Traceback" not in out + err


# --------------------------------------------------------------------------------------------------
# 10. --json: strict JSON, a non-finite metric as null and named


def _strict_loads(text: str):
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _nan_report():
    from mmparity.parity.report import Divergence, Report, Result

    bad = {"max_abs": math.nan, "mean_abs": math.inf, "rel_l2": math.nan, "cosine": -math.inf}
    result = Result("pixtral", "static:output", False, dict(bad), {"rel_l2": 1e-5},
                    Divergence("layer.0", {"rel_l2": math.nan, "max_abs": 0.5}, {"rel_l2": 1e-5}),
                    modules=[{"module": "layer.0", "metrics": {"rel_l2": math.inf, "cosine": 1.0}, "passed": False}])
    good = Result("pixtral", "component:rope", True, {"max_abs": 0.0, "mean_abs": 0.0, "rel_l2": 0.0,
                                                      "cosine": 1.0}, {"rel_l2": 1e-5})
    return Report(device="cpu", dtype="float32", seed=0, attention_backend="sdpa", results=[result, good])


def test_check_json_report_with_a_nan_metric_is_strict_json(capsys, tmp_path, monkeypatch):
    from mmparity.parity import harness

    monkeypatch.setattr(harness, "check", lambda *args, **kwargs: _nan_report())
    path = tmp_path / "report.json"
    code, out, err = run_cli(capsys, "check", "pixtral", "--json", path, "--no-components")
    assert code == 1, out + err  # a failed check, reported
    data = _strict_loads(path.read_text())
    bad, good = data["results"]
    assert bad["metrics"] == {"max_abs": None, "mean_abs": None, "rel_l2": None, "cosine": None,
                              "non_finite": {"max_abs": "NaN", "mean_abs": "Infinity", "rel_l2": "NaN",
                                             "cosine": "-Infinity"}}
    assert bad["first_divergence"]["metrics"] == {"rel_l2": None, "max_abs": 0.5, "non_finite": {"rel_l2": "NaN"}}
    assert bad["modules"][0]["metrics"] == {"rel_l2": None, "cosine": 1.0, "non_finite": {"rel_l2": "Infinity"}}
    assert "non_finite" not in good["metrics"] and good["metrics"]["cosine"] == 1.0


def test_strict_json_names_list_elements_and_leaves_finite_values():
    from mmparity.parity.report import strict_json

    data = {"times_ms": [1.0, math.nan, 3.0], "ratio": math.inf, "n": 3, "ok": True, "name": "NaN",
            "nested": [{"x": -math.inf}]}
    assert _strict_loads(strict_json(data)) == {
        "times_ms": [1.0, None, 3.0], "ratio": None, "n": 3, "ok": True, "name": "NaN",
        "nested": [{"x": None, "non_finite": {"x": "-Infinity"}}],
        "non_finite": {"times_ms[1]": "NaN", "ratio": "Infinity"}}


def test_bench_json_report_is_strict_json():
    from mmparity.parity.bench import BenchReport, BenchResult, SideTiming

    result = BenchResult("pixtral", "tiny", "cfg", "uniform", 2, [[32, 32]], 32, {"native": 1.0},
                         native=SideTiming(0.0, [0.0, math.nan], math.inf, None),
                         hf=SideTiming(1.0, [1.0], 2.0, None), rel_l2=math.nan)
    report = BenchReport(device="cpu", device_name="cpu", dtype="float32", size="tiny", attention_backend="sdpa",
                         timer="wall", warmup=0, repeats=1, results=[result])
    data = _strict_loads(report.to_json())
    got = data["results"][0]
    assert got["rel_l2"] is None and got["non_finite"]["rel_l2"] == "NaN"
    assert got["native"]["images_per_s"] is None and got["native"]["non_finite"] == {
        "images_per_s": "Infinity", "times_ms[1]": "NaN"}


# --------------------------------------------------------------------------------------------------
# mmparity.json's numbers: an iteration no Megatron-LM run has, a shard offset past any tensor


def _edit_manifest(src: Path, edit) -> None:
    manifest = json.loads((src / "mmparity.json").read_text())
    edit(manifest)
    (src / "mmparity.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("iteration", [-5, 10**30, "7", 1.0, True])
def test_a_manifest_iteration_that_is_none_is_refused(capsys, sources, tmp_path, fmt, iteration):
    src = copy_tree(sources[fmt], tmp_path / "src")
    _edit_manifest(src, lambda m: m.__setitem__("iteration", iteration))
    for argv in (["verify", src], ["convert", "--src", src, "--dst", tmp_path / "hf", "--to", "hf", "--quiet"]):
        code, out, err = run_cli(capsys, *argv)
        one_line_error(code, out, err, "mmparity.json", "iteration is")
    assert not (tmp_path / "hf").exists()


def _first_offset_record(manifest: dict) -> dict:
    return next(r for r in manifest["tensors"] if r.get("offset") and len(r["offset"]) >= 2)


@pytest.mark.parametrize("offset", [[10**30, 0], [-1, 0], [2**63, 0]])
def test_a_shard_offset_past_any_tensor_is_refused(capsys, sources, tmp_path, offset):
    src = copy_tree(sources["torch_dist"], tmp_path / "src")
    _edit_manifest(src, lambda m: _first_offset_record(m).__setitem__("offset", offset + _first_offset_record(m)
                                                                        ["offset"][2:]))
    code, out, err = run_cli(capsys, "verify", src)
    one_line_error(code, out, err, "mmparity.json", "offset")


def test_a_shard_offset_outside_its_tensor_is_damage(capsys, sources, tmp_path):
    """Within 64 bits but past the tensor's rows: verify lists the record (exit 1), no traceback."""
    src = copy_tree(sources["torch_dist"], tmp_path / "src")
    _edit_manifest(src, lambda m: _first_offset_record(m)["offset"].__setitem__(0, 10**6))
    code, out, err = run_cli(capsys, "verify", src)
    assert code == 1 and "does not fit global shape" in out and "Traceback" not in out + err, (code, out, err)
