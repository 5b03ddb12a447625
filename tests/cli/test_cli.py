"""CLI: exit codes, one-line user errors, JSON schema, --hf on saved checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mmparity.models import registry as families
from mmparity.cli.main import main
from mmparity.models.core.inputs import random_like_state


def run_cli(capsys, *argv):
    capsys.readouterr()  # drop what the test's own setup printed (save_pretrained progress bars)
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def pixtral_dir(tmp_path_factory):
    fam = families.get("pixtral")
    cfg = fam.tiny_config()
    model = fam.build_reference(cfg)
    model.load_state_dict(random_like_state(model.state_dict(), seed=21))
    path = tmp_path_factory.mktemp("hf") / "pixtral"
    model.save_pretrained(path)
    return path


def test_list_shows_every_family(capsys):
    code, out, _ = run_cli(capsys, "list", "--json")
    assert code == 0
    listed = {row["family"] for row in json.loads(out)}
    assert listed == set(families.names())


def test_check_writes_the_documented_json_schema(capsys, tmp_path):
    path = tmp_path / "report.json"
    code, out, _ = run_cli(capsys, "check", "pixtral", "--json", str(path), "--seed", "3")
    assert code == 0 and "passed" in out
    report = json.loads(path.read_text())
    assert set(report["versions"]) >= {"mmparity", "torch", "transformers", "megatron-core"}
    assert report["device"] == "cpu" and report["dtype"] == "float32" and report["seed"] == 3
    assert report["results"]
    for result in report["results"]:
        assert {"family", "check", "passed", "metrics", "tolerance", "first_divergence"} <= set(result)
        assert set(result["metrics"]) == {"max_abs", "mean_abs", "rel_l2", "cosine"}
        assert isinstance(result["passed"], bool) and result["first_divergence"] is None


def test_check_hf_directory_passes(capsys, pixtral_dir, tmp_path):
    code, out, err = run_cli(capsys, "check", "pixtral", "--hf", str(pixtral_dir),
                             "--image-size", "16x40", "--image-size", "32x24")
    assert code == 0, err


def test_check_hf_sharded_directory(capsys, pixtral_dir, tmp_path):
    fam = families.get("pixtral")
    model = fam.build_reference(fam.tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=2))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    code, _, err = run_cli(capsys, "check", "pixtral", "--hf", str(tmp_path / "sharded"))
    assert code == 0, err


def _assert_usage_error(capsys, *argv, match):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and match in lines[0], err
    assert "Traceback" not in err + out


def test_unknown_family(capsys):
    _assert_usage_error(capsys, "check", "nope", match="valid families: ")


def test_missing_directory(capsys, tmp_path):
    _assert_usage_error(capsys, "check", "pixtral", "--hf", str(tmp_path / "absent"), match="no such directory")


def test_directory_without_config(capsys, tmp_path):
    _assert_usage_error(capsys, "check", "pixtral", "--hf", str(tmp_path), match="no config.json")


def test_corrupt_config(capsys, tmp_path, pixtral_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    _assert_usage_error(capsys, "check", "pixtral", "--hf", str(bad), match="config.json: unreadable config")


def test_truncated_safetensors(capsys, tmp_path, pixtral_dir):
    broken = tmp_path / "truncated"
    broken.mkdir()
    (broken / "config.json").write_bytes((pixtral_dir / "config.json").read_bytes())
    data = (pixtral_dir / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    before = sorted(os.listdir(broken))
    _assert_usage_error(capsys, "check", "pixtral", "--hf", str(broken), match=str(broken))
    assert sorted(os.listdir(broken)) == before


def test_config_of_another_family(capsys, tmp_path):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    cfg = CLIPVisionConfig(hidden_size=16, intermediate_size=20, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=8)
    CLIPVisionModel(cfg).save_pretrained(tmp_path / "clip")
    _assert_usage_error(capsys, "check", "pixtral", "--hf", str(tmp_path / "clip"),
                        match="is not a Pixtral model")


def test_missing_tensor_in_checkpoint(capsys, tmp_path, pixtral_dir):
    from safetensors.torch import load_file, save_file

    target = tmp_path / "missing"
    target.mkdir()
    (target / "config.json").write_bytes((pixtral_dir / "config.json").read_bytes())
    state = load_file(pixtral_dir / "model.safetensors")
    del state["transformer.layers.1.attention.q_proj.weight"]
    save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    _assert_usage_error(capsys, "check", "pixtral", "--hf", str(target),
                        match="missing source tensor transformer.layers.1.attention.q_proj.weight")


def test_bad_image_size(capsys):
    _assert_usage_error(capsys, "check", "pixtral", "--image-size", "20x16", match="not a positive multiple of 8")
    _assert_usage_error(capsys, "check", "pixtral", "--image-size", "big", match="HxW")


def test_cuda_requested_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    _assert_usage_error(capsys, "check", "pixtral", "--device", "cuda", match="CUDA is not available")


def test_json_to_missing_directory_is_a_usage_error(capsys, tmp_path):
    _assert_usage_error(capsys, "check", "pixtral", "--json", str(tmp_path / "no" / "r.json"),
                        match="does not exist")


def test_junit_report(capsys, tmp_path):
    path = tmp_path / "junit.xml"
    code, _, _ = run_cli(capsys, "check", "pixtral", "--junit", str(path), "--no-components")
    assert code == 0
    text = path.read_text()
    assert 'failures="0"' in text and "packed:last_hidden_state" in text


def test_module_entry_point_prints_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "mmparity", "check", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "unknown family 'nope'" in proc.stderr


def test_image_smaller_than_a_merge_block(capsys):
    _assert_usage_error(capsys, "check", "pixtral_large", "--image-size", "8x8",
                        match="smaller than one 2x2 merge block")


@pytest.mark.parametrize("family", ["siglip", "qwen3_5"])
def test_check_hf_directory_of_a_standalone_tower(capsys, tmp_path, family):
    fam = families.get(family)
    model = fam.build_reference(fam.tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=8))
    model.save_pretrained(tmp_path / family)
    code, out, err = run_cli(capsys, "check", family, "--hf", str(tmp_path / family), "--quiet")
    assert code == 0, err + out
