"""`mmparity convert` / `verify` / `check --mcore` as a user meets them: exit codes, one-line errors
without tracebacks, nothing left behind on failure, sources untouched, no unpickling of untrusted
data, progress only on a terminal."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmparity.cli.main import main
from tests.mapping.test_convert_roundtrips import save_hf


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(path: Path) -> dict:
    """Every file under `path`: content digest and mtime, to prove a source was not touched."""
    return {str(p.relative_to(path)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def pixtral_hf(tmp_path_factory):
    return save_hf("pixtral", tmp_path_factory.mktemp("src") / "pixtral", seed=5)


@pytest.fixture(scope="module")
def pixtral_single(tmp_path_factory, pixtral_hf):
    path = tmp_path_factory.mktemp("src") / "single"
    path.mkdir()
    state = {}
    for shard in sorted(pixtral_hf.glob("*.safetensors")):
        state.update(load_file(shard))
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_bytes((pixtral_hf / "config.json").read_bytes())
    return path


@pytest.fixture(scope="module")
def pixtral_legacy(tmp_path_factory, pixtral_hf):
    path = tmp_path_factory.mktemp("mcore") / "legacy"
    assert main(["convert", "--family", "pixtral", "--src", str(pixtral_hf), "--dst", str(path), "--to", "mcore",
                 "--format", "legacy", "--tp", "2", "--pp", "2", "--quiet"]) == 0
    return path


def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def assert_fails_cleanly(capsys, tmp_path, src: Path, *argv, match: str, dst_name: str = "out"):
    """exit 2, exactly one stderr line containing `match`, no traceback, no output, source intact."""
    before_src, before_parent = snapshot(src), sorted(os.listdir(tmp_path))
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / dst_name, *argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (out, err)
    assert len(lines) == 1 and match in lines[0], err
    assert "Traceback" not in out + err
    assert sorted(os.listdir(tmp_path)) == before_parent  # no destination, no staging, no scratch
    assert snapshot(src) == before_src
    return lines[0]


# --------------------------------------------------------------------------------------------------
# success paths


def test_convert_reports_one_line_and_leaves_the_source_alone(capsys, pixtral_hf, tmp_path):
    before = snapshot(pixtral_hf)
    code, out, err = run_cli(capsys, "convert", "--family", "pixtral", "--src", pixtral_hf, "--dst",
                             tmp_path / "m", "--to", "mcore", "--format", "legacy")
    assert code == 0 and err == ""  # no progress bars when stderr is not a terminal
    assert out.count("\n") == 1 and "mcore_legacy" in out and "14 tensors" in out
    assert snapshot(pixtral_hf) == before
    code, out, err = run_cli(capsys, "convert", "--src", tmp_path / "m", "--dst", tmp_path / "h", "--to", "hf",
                             "--quiet")
    assert code == 0 and out == "" and err == ""


def test_existing_destination_needs_force_and_is_replaced_only_when_complete(capsys, pixtral_hf, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    assert_fails_cleanly(capsys, tmp_path, pixtral_hf, "--family", "pixtral", "--to", "mcore",
                         match="already exists; pass --force")
    assert sorted(os.listdir(dst)) == ["keep.txt"]
    # A failing --force run leaves the old destination as it was.
    assert_fails_cleanly(capsys, tmp_path, pixtral_hf, "--family", "pixtral", "--to", "mcore", "--tp", "3",
                         "--force", match="does not divide")
    assert sorted(os.listdir(dst)) == ["keep.txt"]
    code, _, err = run_cli(capsys, "convert", "--family", "pixtral", "--src", pixtral_hf, "--dst", dst, "--to",
                           "mcore", "--force", "--quiet")
    assert code == 0, err
    assert "keep.txt" not in os.listdir(dst) and "mmparity.json" in os.listdir(dst)


def test_progress_bars_are_drawn_on_a_terminal(pixtral_hf, tmp_path):
    from rich.console import Console

    from mmparity.cli.convert import _RichProgress
    from mmparity.convert import ConvertOptions, convert

    with (tmp_path / "tty.txt").open("w") as terminal:
        progress = _RichProgress(Console(file=terminal, force_terminal=True, width=120))
        with progress:
            convert(ConvertOptions(src=pixtral_hf, dst=tmp_path / "m", to="mcore", family="pixtral",
                                   format="legacy", tp=2), progress)
    drawn = (tmp_path / "tty.txt").read_text()
    # Rank files are filled while tensors are converted: one phase, counted in tensors and bytes.
    assert "14/14 tensors" in drawn and "files" not in drawn


# --------------------------------------------------------------------------------------------------
# bad inputs: exit 2, one line, nothing left behind, source untouched


def test_truncated_safetensors(capsys, pixtral_single, tmp_path):
    src = copy_dir(pixtral_single, tmp_path / "src")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_fails_cleanly(capsys, tmp_path, src, "--family", "pixtral", "--to", "mcore", match="model.safetensors")


def test_corrupt_safetensors_header(capsys, pixtral_single, tmp_path):
    src = copy_dir(pixtral_single, tmp_path / "src")
    data = bytearray((src / "model.safetensors").read_bytes())
    data[10:20] = b"\xff" * 10
    (src / "model.safetensors").write_bytes(bytes(data))
    assert_fails_cleanly(capsys, tmp_path, src, "--family", "pixtral", "--to", "mcore",
                         match="not a readable safetensors file")


def test_index_naming_a_missing_shard(capsys, pixtral_hf, tmp_path):
    src = copy_dir(pixtral_hf, tmp_path / "src")
    victim = sorted(src.glob("model-*.safetensors"))[1]
    victim.unlink()
    assert_fails_cleanly(capsys, tmp_path, src, "--family", "pixtral", "--to", "mcore",
                         match=f"index names missing shard file(s) {victim.name}")


def test_wrong_family(capsys, tmp_path):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    cfg = CLIPVisionConfig(hidden_size=16, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8)
    CLIPVisionModel(cfg).save_pretrained(tmp_path / "clip")
    assert_fails_cleanly(capsys, tmp_path, tmp_path / "clip", "--family", "pixtral", "--to", "mcore",
                         match="is not a Pixtral model")
    assert_fails_cleanly(capsys, tmp_path, tmp_path / "clip", "--family", "nope", "--to", "mcore",
                         match="valid families: ")


def _rewrite(src: Path, edit) -> None:
    state = load_file(src / "model.safetensors")
    edit(state)
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.__setitem__("ln_pre.weight", torch.ones(40)),
     "ln_pre.weight -> ln_pre.weight is [40], the config implies [48]"),
    (lambda s: s.__setitem__("transformer.layers.1.attention.q_proj.weight", torch.ones(40, 48)),
     "transformer.layers.1.attention.q_proj.weight (40, 48)"),
    (lambda s: s.pop("transformer.layers.1.attention.k_proj.weight"),
     "missing source tensor transformer.layers.1.attention.k_proj.weight"),
    (lambda s: s.__setitem__("transformer.layers.0.attention.extra.weight", torch.ones(2)),
     "unconsumed source tensor transformer.layers.0.attention.extra.weight"),
])
def test_shape_mismatch_missing_and_unexpected_tensors(capsys, pixtral_single, tmp_path, edit, match):
    src = copy_dir(pixtral_single, tmp_path / "src")
    _rewrite(src, edit)
    for fmt in ("legacy", "torch_dist"):
        assert_fails_cleanly(capsys, tmp_path, src, "--family", "pixtral", "--to", "mcore", "--format", fmt,
                             match=match)


def test_nan_with_check_finite_fails_midway_and_leaves_nothing(capsys, pixtral_single, tmp_path):
    src = copy_dir(pixtral_single, tmp_path / "src")

    def poison(state):  # the last layer's down projection: found after most tensors were written
        state["transformer.layers.1.feed_forward.down_proj.weight"][3, 4] = float("nan")

    _rewrite(src, poison)
    for argv in (["--to", "mcore", "--format", "legacy"], ["--to", "mcore"], ["--to", "hf"]):
        assert_fails_cleanly(capsys, tmp_path, src, "--family", "pixtral", "--check-finite", *argv,
                             match="transformer.layers.1.feed_forward.down_proj.weight holds 1 NaN/Inf")
    code, _, err = run_cli(capsys, "convert", "--family", "pixtral", "--src", src, "--dst", tmp_path / "ok",
                           "--to", "mcore", "--quiet")
    assert code == 0, err  # without --check-finite a NaN is just a value


def test_tp_that_does_not_divide_the_heads(capsys, pixtral_hf, tmp_path):
    line = assert_fails_cleanly(capsys, tmp_path, pixtral_hf, "--family", "pixtral", "--to", "mcore", "--tp", "3",
                                "--format", "legacy", match="--tp 3 does not fit this model")
    assert "num_attention_heads=4" in line


@pytest.mark.parametrize("argv, match", [
    (["--to", "mcore", "--pp", "3", "--format", "legacy"], "--pp 3 is more pipeline stages than the 2 layers"),
    (["--to", "mcore", "--tp", "0"], "--tp must be a positive integer"),
    (["--to", "hf", "--tp", "2"], "HF output is never sharded"),
    (["--to", "hf", "--format", "legacy"], "does not apply to --to hf"),
    (["--to", "mcore", "--format", "legacy", "--max-shard-size", "1GB"], "a legacy checkpoint has one file per rank"),
    (["--to", "mcore", "--workers", "0"], "--workers must be >= 1"),
    (["--to", "hf", "--max-shard-size", "lots"], "invalid size"),
    (["--to", "hf", "--hf-format", "mistral3"], "not a layout of family 'pixtral'"),
])
def test_bad_options(capsys, pixtral_hf, tmp_path, argv, match):
    assert_fails_cleanly(capsys, tmp_path, pixtral_hf, "--family", "pixtral", *argv, match=match)


def test_destination_inside_the_source_is_refused(capsys, pixtral_hf, tmp_path):
    before = snapshot(pixtral_hf)
    for dst in (pixtral_hf, pixtral_hf / "sub"):
        code, _, err = run_cli(capsys, "convert", "--family", "pixtral", "--src", pixtral_hf, "--dst", dst,
                               "--to", "hf", "--force")
        assert code == 2 and "overlaps the source" in err
    assert snapshot(pixtral_hf) == before


def test_missing_source_and_not_a_checkpoint(capsys, tmp_path):
    assert_fails_cleanly(capsys, tmp_path, tmp_path / "absent", "--family", "pixtral", "--to", "mcore",
                         match="no such file or directory")
    (tmp_path / "empty").mkdir()
    assert_fails_cleanly(capsys, tmp_path, tmp_path / "empty", "--family", "pixtral", "--to", "mcore",
                         match="neither an HF safetensors directory")


def test_mcore_source_problems(capsys, pixtral_legacy, tmp_path):
    assert_fails_cleanly(capsys, tmp_path, pixtral_legacy, "--family", "clip", "--to", "hf",
                         match="holds a 'pixtral' checkpoint, not 'clip'")
    src = tmp_path / "copy"
    import shutil

    shutil.copytree(pixtral_legacy, src)
    (src / "hf_config.json").unlink()
    assert_fails_cleanly(capsys, tmp_path, src, "--to", "hf", match="no hf_config.json")
    shutil.copy(pixtral_legacy / "hf_config.json", src / "hf_config.json")
    rank_file = src / "iter_0000001" / "mp_rank_01_001" / "model_optim_rng.pt"
    rank_file.unlink()
    assert_fails_cleanly(capsys, tmp_path, src, "--to", "hf", match="missing mp_rank_01_001")


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_untrusted_pickles_are_never_unpickled(capsys, pixtral_legacy, tmp_path, monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)
    # legacy: a rank file holding an arbitrary object
    src = tmp_path / "legacy"
    shutil.copytree(pixtral_legacy, src)
    rank_file = src / "iter_0000001" / "mp_rank_00_000" / "model_optim_rng.pt"
    torch.save({"model": {"x": Exploit()}, "checkpoint_version": 3.0}, rank_file)
    assert_fails_cleanly(capsys, tmp_path, src, "--to", "hf", match="refusing to unpickle posix.system")
    # torch_dist: a DCP .metadata pickle naming os.system
    dist = tmp_path / "dist"
    code, _, err = run_cli(capsys, "convert", "--src", pixtral_legacy, "--dst", dist, "--to", "mcore", "--quiet")
    assert code == 0, err
    (dist / "iter_0000001" / ".metadata").write_bytes(pickle.dumps(Exploit()))
    assert_fails_cleanly(capsys, tmp_path, dist, "--to", "hf", match="refusing to unpickle posix.system")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow  # several seconds: the full suite runs it, the quick loops skip it
def test_no_traceback_from_the_module_entry_point(tmp_path, pixtral_hf):
    proc = subprocess.run([sys.executable, "-m", "mmparity", "convert", "--family", "pixtral", "--src",
                           str(pixtral_hf), "--dst", str(tmp_path / "o"), "--to", "mcore", "--tp", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "does not divide" in proc.stderr


# --------------------------------------------------------------------------------------------------
# verify


def test_verify_exit_codes(capsys, pixtral_hf, pixtral_legacy, tmp_path):
    code, out, _ = run_cli(capsys, "verify", pixtral_legacy)
    assert code == 0 and "all match" in out
    hf = tmp_path / "hf"
    assert main(["convert", "--src", str(pixtral_legacy), "--dst", str(hf), "--to", "hf", "--quiet"]) == 0
    code, out, _ = run_cli(capsys, "verify", hf, pixtral_legacy, "--quiet")
    assert code == 0 and out == ""
    blob = bytearray((hf / "model.safetensors").read_bytes())
    blob[-3] ^= 0x01
    (hf / "model.safetensors").write_bytes(bytes(blob))
    code, out, _ = run_cli(capsys, "verify", hf)
    assert code == 1 and "of the bytes differs" in out and "1 problem(s)" in out
    code, _, err = run_cli(capsys, "verify", pixtral_hf)
    assert code == 2 and "not written by mmparity" in err
    code, _, err = run_cli(capsys, "verify", tmp_path / "absent")
    assert code == 2 and "no such directory" in err


# --------------------------------------------------------------------------------------------------
# check --mcore


@pytest.mark.slow
def test_check_mcore_runs_at_the_stored_layout(capsys, pixtral_legacy):
    # TP 2 x PP 2 as stored: four spawned ranks.
    code, out, err = run_cli(capsys, "check", "--mcore", pixtral_legacy, "--no-components")
    assert code == 0, out + err  # --hf defaults to the source recorded in the manifest


@pytest.mark.slow
def test_check_mcore_passes_and_locates_a_perturbed_tensor(capsys, pixtral_hf, pixtral_legacy, tmp_path):
    # The stored pipeline merged to one stage; its two TP shards still run as two spawned ranks.
    code, out, err = run_cli(capsys, "check", "pixtral", "--mcore", pixtral_legacy, "--hf", pixtral_hf, "--tp", "1",
                             "--pp", "1", "--no-components", "--quiet")
    assert code == 0, out + err

    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(pixtral_legacy, bad)
    # PP 2 over 2 layers: global layer 1 is local layer 0 of stage 1; TP rank 1 holds half of it.
    rank_file = bad / "iter_0000001" / "mp_rank_01_001" / "model_optim_rng.pt"
    payload = torch.load(rank_file, weights_only=True)
    payload["model"]["decoder.layers.0.mlp.linear_fc2.weight"][0, 0] += 0.5
    torch.save(payload, rank_file)
    code, out, err = run_cli(capsys, "check", "--mcore", bad, "--hf", pixtral_hf, "--tp", "1", "--pp", "1",
                             "--no-components")
    assert code == 1, out + err
    assert "layer.1" in out and "FAIL" in out
    code, _, err = run_cli(capsys, "check", "--mcore", tmp_path / "absent")
    assert code == 2 and "no such directory" in err
