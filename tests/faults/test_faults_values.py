"""Values that argparse-level checks let through, and internal exceptions passed off as refusals.

- Iteration numbers: ``str.isdigit`` takes '²' and '①', which ``int`` refuses, and any script's
  digits ('٣'), which name some other directory than the one the number is written as; a number
  of thousands of digits is past ``int``'s own limit. On ``--iteration``, in the tracker file, in
  iteration directory names.
- The tracker file read whole: a sparse file of gigabytes is a ``MemoryError``.
- ``--workers`` unbounded (each worker is a process importing torch), and a worker killed by a
  real-time signal, which ``signal.Signals`` has no member for.
- Config sizes of zero or less (``patch_size: 0``, zero heads, zero experts): divisions deep in a
  reader (``conversion failed: ZeroDivisionError``) or a checkpoint published with a config that
  says the model is empty.

Each: exit 0 with a correct result, or exit 2 with one line naming the file or the flag and the fix.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmparity.cli import workers

from tests.mapping.test_convert_roundtrips import save_hf
from tests.faults.test_faults import (REPO, _as_megatron_wrote_it, copy_tree, one_line_error, run_cli,  # noqa: F401
                               run_subprocess, snapshot, sources)

pytestmark = pytest.mark.fault

# Digits str.isdigit accepts: superscript, circled, Arabic-Indic, fullwidth; and too many of them.
NOT_ASCII_NUMBERS = ["²", "①", "٣", "１２", "1²"]
TOO_LONG = "9" * 5000


# --------------------------------------------------------------------------------------------------
# iteration numbers


@pytest.mark.parametrize("value", NOT_ASCII_NUMBERS + [TOO_LONG, "-1", "1e3"])
def test_iteration_flag_takes_ascii_numbers_only(capsys, sources, tmp_path, value):
    code, out, err = run_cli(capsys, "convert", "--src", sources["legacy"], "--dst", tmp_path / "out", "--to", "hf",
                             "--iteration", value)
    one_line_error(code, out, err, "--iteration")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", NOT_ASCII_NUMBERS + [TOO_LONG, "1\x00", "1 2"])
@pytest.mark.parametrize("command", ["verify what Megatron wrote", "convert"])
def test_tracker_holding_no_ascii_number(capsys, sources, tmp_path, text, command):
    if command == "convert":
        root = copy_tree(sources["legacy"], tmp_path / "ckpt")
        argv = ["convert", "--src", root, "--dst", tmp_path / "out", "--to", "hf"]
    else:  # read through its tracker (mmparity's own output is read through its manifest)
        root = _as_megatron_wrote_it(sources["legacy"], tmp_path / "ckpt")
        argv = ["verify", root]
    (root / "latest_checkpointed_iteration.txt").write_text(text)
    one_line_error(*run_cli(capsys, *argv), "latest_checkpointed_iteration.txt", "--iteration")


def test_a_sparse_tracker_of_gigabytes_is_read_as_a_prefix(sources, tmp_path):
    root = copy_tree(sources["legacy"], tmp_path / "ckpt")
    tracker = root / "latest_checkpointed_iteration.txt"
    tracker.write_text("1")
    with open(tracker, "r+b") as f:
        f.truncate(16 * 2**30)  # "1" and 16 GiB of zeros, no disk
    code, out, err = run_subprocess("convert", "--src", root, "--dst", tmp_path / "out", "--to", "hf",
                                    memory_limit=6 * 2**30)
    one_line_error(code, out, err, "latest_checkpointed_iteration.txt")


@pytest.mark.parametrize("name", ["iter_²", "iter_٠٠٠٠٠٠٢", "iter_" + "1" * 30])
def test_iteration_directories_of_other_digits_are_not_iterations(capsys, sources, tmp_path, name):
    """Beside a real iteration, in what Megatron-LM wrote (whose iterations are listed): ignored."""
    root = _as_megatron_wrote_it(sources["legacy"], tmp_path / "ckpt")
    (root / name).mkdir()
    code, out, err = run_cli(capsys, "verify", root)
    assert code == 0 and "Traceback" not in err, (out, err)
    code, out, err = run_cli(capsys, "convert", "--src", root, "--dst", tmp_path / "out", "--to", "hf",
                             "--base", sources["hf"], "--quiet")
    assert code == 0, err


# --------------------------------------------------------------------------------------------------
# --workers


@pytest.mark.parametrize("count", [100_000, workers.max_workers() + 1, 10**30])
def test_workers_beyond_the_machine_are_refused_before_any_starts(capsys, sources, tmp_path, monkeypatch, count):
    def no_worker_may_start(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(subprocess, "Popen", no_worker_may_start)
    code, out, err = run_cli(capsys, "convert", "--family", "pixtral", "--src", sources["hf"], "--dst",
                             tmp_path / "out", "--to", "mcore", "--workers", count)
    one_line_error(code, out, err, "--workers", str(workers.max_workers()))


def _child_with_rank(parent: int, rank: int, deadline: float) -> int:
    """The pid of ``parent``'s child whose environment says RANK=``rank``."""
    while time.monotonic() < deadline:
        for task in Path(f"/proc/{parent}/task").iterdir():
            for pid in (task / "children").read_text().split():
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if f"RANK={rank}".encode() in environ:
                    return int(pid)
        time.sleep(0.05)
    pytest.fail(f"no rank {rank} under {parent}")


@pytest.mark.skipif(not hasattr(signal, "SIGRTMIN") or not Path("/proc/self/task").is_dir(),
                    reason="needs real-time signals and /proc")
@pytest.mark.parametrize("offset", [1, 3])  # SIGRTMIN itself has a name; SIGRTMIN+n has none
def test_a_worker_killed_by_a_real_time_signal_is_named_in_one_line(sources, tmp_path, offset):
    dst = tmp_path / "out"
    before = sorted(os.listdir(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO), "MMPARITY_FAULT": "pause@tensor", "MMPARITY_FAULT_RANK": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mmparity", "convert", "--family", "pixtral", "--src",
                             str(sources["hf"]), "--dst", str(dst), "--to", "mcore", "--workers", "2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        os.kill(_child_with_rank(proc.pid, 1, time.monotonic() + 120), signal.SIGRTMIN + offset)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    line = one_line_error(proc.returncode, out, err, "rank 1", f"SIGRTMIN+{offset}")
    assert "killed" in line
    assert sorted(os.listdir(tmp_path)) == before  # no staging directory, no destination


def test_signal_names_cover_every_number():
    assert workers.signal_name(int(signal.SIGKILL)) == "SIGKILL"
    if hasattr(signal, "SIGRTMAX"):
        assert workers.signal_name(signal.SIGRTMIN + 2) == "SIGRTMIN+2"
        assert workers.signal_name(signal.SIGRTMAX - 1) == f"SIGRTMIN+{signal.SIGRTMAX - 1 - signal.SIGRTMIN}"
    assert workers.signal_name(250) == "signal 250"


# --------------------------------------------------------------------------------------------------
# config sizes of zero or less


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, sources):
    root = tmp_path_factory.mktemp("sizes")
    made = {"pixtral": sources["hf"]}
    for family in ("clip", "qwen3_5", "kimi_k25", "llava", "kimi_k25_vl"):
        made[family] = save_hf(family, root / family, seed=2, max_shard_size="10MB")
    return made


def _set(config: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        config = config[key]
    config[last] = value


# family, field, value: sizes that divide (heads, patches, merges, experts) or size a table
SIZES = [
    ("pixtral", "patch_size", 0), ("pixtral", "hidden_size", 0), ("pixtral", "num_attention_heads", 0),
    ("pixtral", "image_size", -1), ("pixtral", "head_dim", 0), ("clip", "patch_size", 0),
    ("clip", "num_attention_heads", 0), ("qwen3_5", "spatial_merge_size", 0),
    ("qwen3_5", "num_heads", 0), ("qwen3_5", "patch_size", -2), ("kimi_k25", "vision_config.merge_kernel_size", [0, 0]),
    ("kimi_k25", "vision_config.num_attention_heads", 0), ("llava", "text_config.num_key_value_heads", 0),
    ("llava", "vision_config.num_attention_heads", 0), ("llava", "text_config.vocab_size", 0),
    ("kimi_k25_vl", "text_config.n_routed_experts", 0), ("kimi_k25_vl", "text_config.num_experts_per_tok", 0),
    ("kimi_k25_vl", "text_config.kv_lora_rank", 0), ("kimi_k25_vl", "text_config.first_k_dense_replace", -1),
    ("kimi_k25_vl", "vision_config.patch_size", 0),
]


@pytest.mark.parametrize("family,field,value", SIZES, ids=[f"{f}-{k}={v}" for f, k, v in SIZES])
def test_config_sizes_of_zero_or_less_are_refused_by_name(capsys, tiny, tmp_path, family, field, value):
    src = copy_tree(tiny[family], tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    _set(config, field, value)
    (src / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli(capsys, "convert", "--family", family, "--src", src, "--dst", tmp_path / "out",
                             "--to", "mcore", "--quiet")
    line = one_line_error(code, out, err, "config.json", field.rsplit(".", 1)[-1])
    assert "conversion failed" not in line and "Error:" not in line, line
    assert not (tmp_path / "out").exists()


def test_a_feature_layer_past_the_tower_is_refused_by_name(capsys, tiny, tmp_path):
    src = copy_tree(tiny["llava"], tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    config["vision_config"]["num_hidden_layers"] = 0  # vision_feature_layer -2 selects nothing
    (src / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli(capsys, "convert", "--family", "llava", "--src", src, "--dst", tmp_path / "out",
                             "--to", "mcore", "--quiet")
    line = one_line_error(code, out, err, "config.json", "vision_feature_layer")
    assert "conversion failed" not in line, line


@pytest.mark.parametrize("where", ["hf_config.json of an mcore source", "--hf-config", "check --hf"])
def test_zero_patch_size_is_refused_wherever_a_config_is_read(capsys, sources, tmp_path, where):
    if where == "check --hf":
        src = copy_tree(sources["hf"], tmp_path / "hf")
        config = src / "config.json"
        argv = ["check", "pixtral", "--hf", src, "--no-components", "--quiet"]
    elif where == "--hf-config":
        src = _as_megatron_wrote_it(sources["legacy"], tmp_path / "trained")
        config = tmp_path / "configs" / "config.json"
        config.parent.mkdir()
        config.write_bytes((sources["hf"] / "config.json").read_bytes())
        argv = ["convert", "--src", src, "--dst", tmp_path / "out", "--to", "hf", "--hf-config", config]
    else:
        src = copy_tree(sources["legacy"], tmp_path / "legacy")
        config = src / "hf_config.json"
        argv = ["convert", "--src", src, "--dst", tmp_path / "out", "--to", "hf"]
    data = json.loads(config.read_text())
    data["patch_size"] = 0
    config.write_text(json.dumps(data))
    one_line_error(*run_cli(capsys, *argv), config.name, "patch_size")


# --------------------------------------------------------------------------------------------------
# what reached a generic catch-all ("conversion failed: TypeError ...") or escaped as a traceback


def _rewrite_rank_file(root: Path, edit) -> None:
    import io

    import torch

    from mmparity.io.legacy import load_rank_payload

    path = next(root.glob("iter_*/mp_rank_00*/model_optim_rng.pt"))
    payload = load_rank_payload(path)
    edit(payload)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    path.write_bytes(buffer.getvalue())


RANK_FILE_EDITS = {
    "a model key that is no name": lambda p: p["model"].__setitem__(5, p["model"][sorted(p["model"])[1]]),
    "checkpoint_version NaN": lambda p: p.__setitem__("checkpoint_version", float("nan")),
    "checkpoint_version as text": lambda p: p.__setitem__("checkpoint_version", "3.0"),
    "checkpoint_version True": lambda p: p.__setitem__("checkpoint_version", True),
}


@pytest.mark.parametrize("case", sorted(RANK_FILE_EDITS))
def test_rank_file_entries_of_the_wrong_kind(capsys, sources, tmp_path, case):
    root = copy_tree(sources["legacy"], tmp_path / "ckpt")
    _rewrite_rank_file(root, RANK_FILE_EDITS[case])
    code, out, err = run_cli(capsys, "convert", "--src", root, "--dst", tmp_path / "out", "--to", "hf")
    line = one_line_error(code, out, err, "model_optim_rng.pt")
    assert "conversion failed" not in line, line


def test_a_manifest_naming_an_unknown_family(capsys, sources, tmp_path):
    root = copy_tree(sources["legacy"], tmp_path / "ckpt")
    manifest = json.loads((root / "mmparity.json").read_text())
    manifest["family"] = "no_such_family"
    (root / "mmparity.json").write_text(json.dumps(manifest))
    code, out, err = run_cli(capsys, "convert", "--src", root, "--dst", tmp_path / "out", "--to", "hf")
    one_line_error(code, out, err, "mmparity.json", "no_such_family", "--family")


def test_check_hf_with_a_weight_of_another_shape(capsys, sources, tmp_path):
    """Same element count, another shape: was a traceback from load_state_dict."""
    from safetensors.torch import load_file, save_file

    src = copy_tree(sources["hf"], tmp_path / "hf")
    state = load_file(src / "model.safetensors")
    key = next(k for k, v in sorted(state.items()) if v.dim() == 1)
    state[key] = state[key].unsqueeze(0)
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    code, out, err = run_cli(capsys, "check", "pixtral", "--hf", src, "--no-components", "--quiet")
    one_line_error(code, out, err, str(src), key, "shape")


@pytest.mark.parametrize("argv", [["--images", "100000000"], ["--images", "4096", "--image-size", "16384x4096"]])
def test_bench_images_beyond_any_batch_are_refused_before_allocating(argv):
    # In a child with bounded memory: without the bound the batch is allocated, and fails to be.
    code, out, err = run_subprocess("bench", "pixtral", *argv, "--no-parity", memory_limit=8 * 2**30)
    one_line_error(code, out, err, "--images")
