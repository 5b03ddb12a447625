"""``convert --to hf --base`` for the whole Qwen-VL models.

* Qwen3-VL whole at TP 2 x PP 2, legacy and torch_dist: the whole conversion, ``verify``, and back
  with ``--base``, bit for bit; the language model converted alone from a trained copy (as
  Megatron-LM trains it), back with ``--base``: its tensors the trained ones, the tower and
  DeepStack mergers the base's.
* Qwen3-VL-MoE as Qwen's release stores its experts (transposed stacks, ``[E, H, 2F]`` /
  ``[E, F, H]``): a checkpoint exported with such a release as ``--base`` stores its experts as
  the base does, whichever layout the checkpoint was converted from and whoever wrote it
  (mmparity, or Megatron's own savers), ``torch.equal`` to the base's own tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
from tests.cli.test_convert_cli import run_cli
from tests.io.test_megatron_written import check_export, make_pair, megatron_written
from tests.models.test_qwen3_vl_moe import _transposed_release


def _run(capsys, *argv) -> str:
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, out + err
    return out


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    """(base, trained): a seeded tiny Qwen3-VL release and a perturbed copy of every tensor."""
    return make_pair("qwen3_vl_whole", tmp_path_factory.mktemp("qwen3_vl_whole"))


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_qwen3_vl_whole_tp2_pp2_convert_verify_and_back_with_base(capsys, tmp_path, qwen3_vl, fmt):
    base, _trained = qwen3_vl
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    _run(capsys, "convert", "--src", base, "--dst", mcore, "--to", "mcore", "--tp", 2, "--pp", 2, "--format", fmt)
    out = _run(capsys, "verify", mcore)
    assert "all match" in out and ("tp=2 pp=2" in out or fmt == "torch_dist"), out  # torch_dist holds global tensors
    _run(capsys, "convert", "--src", mcore, "--dst", back, "--to", "hf", "--base", base)
    expected, got = load_safetensors_state_dict(base), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())
    assert (back / "config.json").read_bytes() == (base / "config.json").read_bytes()


@pytest.mark.slow
def test_qwen3_vl_whole_tp2_pp2_verify_load(capsys, tmp_path, qwen3_vl):
    """The whole checkpoint's language model loads strictly into Megatron's GPTModel on every
    rank (TP 2 x PP 2: four spawned ranks), the rest counted as not loaded."""
    base, _trained = qwen3_vl
    mcore = tmp_path / "mcore"
    _run(capsys, "convert", "--src", base, "--dst", mcore, "--to", "mcore", "--tp", 2, "--pp", 2, "--format", "legacy")
    out = _run(capsys, "verify", "--load", mcore)
    assert "all ranks load" in out and all(f"rank {r} " in out for r in range(4)), out


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_qwen3_vl_whole_language_model_trained_alone_back_with_base(capsys, tmp_path, qwen3_vl, fmt):
    base, trained = qwen3_vl
    part = tmp_path / "part"
    _run(capsys, "convert", "--src", trained, "--dst", part, "--to", "mcore", "--part", "language_model",
         "--tp", 2, "--pp", 2, "--format", fmt)
    _run(capsys, "verify", part)
    result = check_export(capsys, part, tmp_path / "back", base, trained)
    # Every tensor outside the language model is the base's (the tower, its DeepStack mergers).
    assert result["from_base"] and all(not k.startswith(("model.language_model.", "lm_head."))
                                       for k in result["from_base"])
    assert any(".deepstack_merger_list." in k for k in result["from_base"])


@pytest.fixture(scope="module")
def moe_release(tmp_path_factory):
    """(base, trained, base in the module's layout): Qwen3-VL-MoE stored as Qwen's release stores
    its experts, a perturbed copy stored the same way, and the base as save_pretrained writes it."""
    root = tmp_path_factory.mktemp("qwen3_vl_moe")
    base, trained = make_pair("qwen3_vl_moe", root)
    return _transposed_release(base, root / "release"), _transposed_release(trained, root / "release_trained"), base


def _stacked(path: Path) -> dict:
    state = load_safetensors_state_dict(path)
    return {k: v for k, v in state.items() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))}


@pytest.mark.parametrize("source", ["release", "module_layout"])
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_export_with_a_transposed_release_as_base_stores_its_experts_as_it_does(capsys, tmp_path, moe_release,
                                                                                fmt, source):
    release, _trained, module_layout = moe_release
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    _run(capsys, "convert", "--src", release if source == "release" else module_layout, "--dst", mcore, "--to",
         "mcore", "--tp", 2, "--ep", 2, "--format", fmt)
    _run(capsys, "convert", "--src", mcore, "--dst", back, "--to", "hf", "--base", release)
    expected, got = load_safetensors_state_dict(release), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())
    text = json.loads((release / "config.json").read_text())["text_config"]
    assert got["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape[1:] == (
        text["hidden_size"], 2 * text["moe_intermediate_size"])  # as the release: transposed


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_what_megatron_saved_exports_with_a_transposed_release_as_base(capsys, tmp_path, moe_release, fmt):
    """A directory Megatron's own savers wrote (no mmparity files), exported with the release as
    ``--base``: the trained weights, the experts stored transposed as the base stores them."""
    release, trained, _module_layout = moe_release
    ckpt = megatron_written(capsys, tmp_path, "qwen3_vl_moe", 1, fmt, release, trained)
    check_export(capsys, ckpt, tmp_path / "back", release, trained)
    got = _stacked(tmp_path / "back")
    assert got and all(torch.equal(v, _stacked(trained)[k]) for k, v in got.items())
