"""Fault injection: bad inputs and faults against `convert` / `verify` / `check`, one class per block.

Every case is a way a hostile or unlucky user meets the tool: a checkpoint whose container lies
(dtypes, byte spans, paths), a manifest that certifies something else, a destination inside the
source, a second filesystem, a kill or a signal at any point of a conversion, a resource bomb, a
FIFO where a file should be. The contract for each: the conversion works, or exit 2 with one line
naming the file (verify: exit 1 listing the damage), never a traceback, never a hang, never a
half-written or lost destination. `pytest -m fault` runs just these; the terminal summary counts
the faults tried and handled.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from mmparity.models import registry as families
from mmparity.cli.main import main
from mmparity.models.core.inputs import random_like_state

pytestmark = pytest.mark.fault

REPO = Path(__file__).resolve().parents[2]
FAMILY = "pixtral"


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_subprocess(*argv, env=None, timeout=120, memory_limit=None):
    """`python -m mmparity ARGV` in a child; a hang becomes a test failure, not a stuck suite."""
    def limit():
        if memory_limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))

    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    try:
        proc = subprocess.run([sys.executable, "-m", "mmparity", *map(str, argv)], capture_output=True, text=True,
                              timeout=timeout, env=full_env, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"mmparity {' '.join(map(str, argv))} hung for {timeout}s")
    return proc.returncode, proc.stdout, proc.stderr


def one_line_error(code, out, err, *needles):
    """exit 2, exactly one non-empty stderr line holding every needle, no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out, err)
    assert "Traceback" not in out + err, err
    assert len(lines) == 1, err
    for needle in needles:
        assert str(needle) in lines[0], (needle, lines[0])
    return lines[0]


def snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


# --------------------------------------------------------------------------------------------------
# sources: one tiny seeded model in each format


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    fam = families.get(FAMILY)
    model = fam.build_reference(fam.tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=14))
    base = tmp_path_factory.mktemp("faults")
    hf = base / "hf"
    model.save_pretrained(hf)
    legacy, dist, hf_out = base / "legacy", base / "dist", base / "hf_out"
    for argv in (["--family", FAMILY, "--src", hf, "--dst", legacy, "--to", "mcore", "--format", "legacy"],
                 ["--family", FAMILY, "--src", hf, "--dst", dist, "--to", "mcore"],
                 ["--src", legacy, "--dst", hf_out, "--to", "hf"]):
        assert main(["convert", *map(str, argv), "--quiet"]) == 0
    return {"hf": hf, "legacy": legacy, "torch_dist": dist, "hf_out": hf_out}


# --------------------------------------------------------------------------------------------------
# 1. a second filesystem: copy_file_range answers EXDEV


def _other_filesystem(path: Path) -> Path | None:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and os.stat(shm).st_dev != os.stat(path).st_dev:
        return shm
    return None


CROSS_FS = {
    "hf->legacy": ("hf", ["--family", FAMILY, "--to", "mcore", "--format", "legacy", "--tp", "2"]),
    "hf->torch_dist": ("hf", ["--family", FAMILY, "--to", "mcore"]),
    "legacy->hf": ("legacy", ["--to", "hf"]),
    "torch_dist->hf": ("torch_dist", ["--to", "hf"]),
}


@pytest.mark.parametrize("direction", ["src on tmpfs", "dst on tmpfs"])
@pytest.mark.parametrize("case", sorted(CROSS_FS))
def test_conversion_across_filesystems(capsys, sources, tmp_path, case, direction):
    other = _other_filesystem(tmp_path)
    if other is None:
        pytest.skip("no second filesystem here (/dev/shm missing or on the same device as the temp dir)")
    kind, argv = CROSS_FS[case]
    scratch = Path(tempfile.mkdtemp(prefix="mmparity-faults-", dir=other))
    try:
        if direction == "src on tmpfs":
            src, dst = copy_tree(sources[kind], scratch / "src"), tmp_path / "out"
        else:
            src, dst = sources[kind], scratch / "out"
        assert os.stat(src).st_dev != os.stat(dst.parent).st_dev
        code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", dst, *argv, "--quiet")
        assert code == 0, err
        # The same bytes as a conversion on one filesystem: every checksum matches.
        same_fs = tmp_path / "same"
        assert run_cli(capsys, "convert", "--src", sources[kind], "--dst", same_fs, *argv, "--quiet")[0] == 0
        tensors = lambda d: sorted(json.dumps(r, sort_keys=True) for r in json.loads((d / "mmparity.json").read_text())["tensors"])
        assert tensors(dst) == tensors(same_fs)
        assert run_cli(capsys, "verify", dst)[0] == 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_copy_falls_back_only_on_the_errors_that_mean_unsupported(tmp_path, monkeypatch):
    import errno

    from mmparity.io.fsio import syscalls

    src, dst = tmp_path / "a", tmp_path / "b"
    src.write_bytes(bytes(range(256)) * 64)
    dst.write_bytes(b"")
    for code in (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        def refuse(*args, code=code):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(syscalls.os, "copy_file_range", refuse)
        with open(src, "rb") as s, open(dst, "r+b") as d:
            syscalls.copy_file_range_all(s.fileno(), 100, d.fileno(), 0, 5000)
        assert dst.read_bytes()[:5000] == src.read_bytes()[100:5100]
    def broken(*args):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(syscalls.os, "copy_file_range", broken)
    with open(src, "rb") as s, open(dst, "r+b") as d, pytest.raises(OSError):
        syscalls.copy_file_range_all(s.fileno(), 0, d.fileno(), 0, 10)


# --------------------------------------------------------------------------------------------------
# 2. a legacy storage record shorter than its tensor


def _rewrite_torch_file(path: Path, edit) -> None:
    """Rewrites a torch.save zip record by record through torch's own writer, `edit(name, bytes)`
    deciding each record's new bytes (so the archive stays aligned as torch writes it)."""
    reader = torch._C.PyTorchFileReader(str(path))
    records = {name: reader.get_record(name) for name in reader.get_all_records()}
    del reader
    scratch = path.parent / "rewrite"
    scratch.mkdir()
    out = scratch / path.name
    writer = torch._C.PyTorchFileWriter(str(out))
    for name, data in records.items():
        if name.startswith(".data/"):
            continue  # the writer adds its own version records
        data = edit(name, bytes(data))
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    del writer
    os.replace(out, path)
    scratch.rmdir()


def _record_keys(path: Path) -> dict[str, str]:
    """storage record name -> the key of the tensor stored in it."""
    reader = torch._C.PyTorchFileReader(str(path))
    offsets = {reader.get_record_offset(r): r for r in reader.get_all_records() if r.startswith("data/")}
    model = torch.load(path, mmap=True, weights_only=True)["model"]
    pointers = {k: v.untyped_storage().data_ptr() for k, v in model.items() if isinstance(v, torch.Tensor)}
    base = min(pointers.values()) - min(offsets)
    return {offsets[p - base]: k for k, p in pointers.items()}


@pytest.mark.parametrize("record", ["data/0", "data/3"])
def test_legacy_storage_record_shorter_than_its_tensor(capsys, sources, tmp_path, record):
    legacy = copy_tree(sources["legacy"], tmp_path / "legacy")
    rank_file = legacy / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    key = _record_keys(rank_file)[record]
    _rewrite_torch_file(rank_file, lambda name, data: data[: len(data) // 2] if name == record else data)
    code, out, err = run_cli(capsys, "convert", "--src", legacy, "--dst", tmp_path / "out", "--to", "hf")
    one_line_error(code, out, err, rank_file, key)
    assert not (tmp_path / "out").exists()
    code, out, err = run_cli(capsys, "check", "--mcore", legacy, "--hf", sources["hf"], "--no-components")
    one_line_error(code, out, err, rank_file, key)


# --------------------------------------------------------------------------------------------------
# 3. dtype lies


def _relabel_safetensors_dtype(path: Path, name: str, old: str, new: str) -> None:
    blob = bytearray(path.read_bytes())
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + size])
    assert header[name]["dtype"] == old and len(old) == len(new)
    header[name]["dtype"] = new
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= size
    blob[8:8 + size] = text + b" " * (size - len(text))
    path.write_bytes(bytes(blob))


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_float_weight_relabelled_int32_in_safetensors(capsys, sources, tmp_path, dtype):
    hf = copy_tree(sources["hf"], tmp_path / "hf")
    name = "transformer.layers.1.attention.k_proj.weight"
    _relabel_safetensors_dtype(hf / "model.safetensors", name, "F32", "I32")
    extra = ["--dtype", dtype] if dtype else []
    code, out, err = run_cli(capsys, "convert", "--family", FAMILY, "--src", hf, "--dst", tmp_path / "out",
                             "--to", "mcore", "--format", "legacy", *extra)
    one_line_error(code, out, err, name, "int32")
    assert not (tmp_path / "out").exists()


def _edit_dcp_metadata(iteration_dir: Path, edit) -> None:
    from mmparity.io.torch_dist_files import load_metadata

    metadata = load_metadata(iteration_dir)
    edit(metadata)
    (iteration_dir / ".metadata").write_bytes(pickle.dumps(metadata))


def test_torch_dist_metadata_claims_int32_for_a_float_tensor(capsys, sources, tmp_path):
    dist = copy_tree(sources["torch_dist"], tmp_path / "dist")
    key = "ln_pre.weight"

    def to_int(metadata):
        metadata.state_dict_metadata[key].properties.dtype = torch.int32

    _edit_dcp_metadata(dist / "iter_0000001", to_int)
    code, out, err = run_cli(capsys, "convert", "--src", dist, "--dst", tmp_path / "out", "--to", "hf")
    one_line_error(code, out, err, key, "int32")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------
# 4. torch_dist paths outside the checkpoint


@pytest.fixture
def dist_escaping(sources, tmp_path):
    """A torch_dist checkpoint whose .metadata reads its data file from outside the checkpoint."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    dist = copy_tree(sources["torch_dist"], tmp_path / "deep" / "dist")
    iteration = dist / "iter_0000001"
    (data,) = iteration.glob("*.distcp")

    def escape(metadata):
        for index, info in list(metadata.storage_data.items()):
            metadata.storage_data[index] = _StorageInfo("../../../outside.distcp", info.offset, info.length,
                                                        getattr(info, "transform_descriptors", None))

    _edit_dcp_metadata(iteration, escape)
    shutil.move(data, tmp_path / "outside.distcp")
    return dist


def test_torch_dist_relative_path_outside_the_checkpoint(capsys, sources, tmp_path, dist_escaping):
    code, out, err = run_cli(capsys, "convert", "--src", dist_escaping, "--dst", tmp_path / "out", "--to", "hf")
    one_line_error(code, out, err, "outside.distcp", "outside")
    code, out, err = run_cli(capsys, "check", "--mcore", dist_escaping, "--hf", sources["hf"], "--no-components")
    one_line_error(code, out, err, "outside.distcp", "outside")
    code, out, err = run_cli(capsys, "verify", dist_escaping)
    assert code != 0 and "all match" not in out and "Traceback" not in err
    assert "outside" in out + err


# --------------------------------------------------------------------------------------------------
# 5. verify / check: one line, never a traceback


def test_truncated_distcp(capsys, sources, tmp_path):
    dist = copy_tree(sources["torch_dist"], tmp_path / "dist")
    (data,) = (dist / "iter_0000001").glob("*.distcp")
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    code, out, err = run_cli(capsys, "verify", dist)
    assert code == 1 and "Traceback" not in out + err and "problem" in out, (out, err)
    assert data.name in out
    code, out, err = run_cli(capsys, "check", "--mcore", dist, "--hf", sources["hf"], "--no-components")
    one_line_error(code, out, err, data.name)
    code, out, err = run_cli(capsys, "convert", "--src", dist, "--dst", tmp_path / "out", "--to", "hf")
    one_line_error(code, out, err, data.name)


MALFORMED_MANIFESTS = {
    "a list": lambda m: [1, 2],
    "a string": lambda m: "mmparity",
    "tensors: [1]": lambda m: {**m, "tensors": [1]},
    "tensors: a dict": lambda m: {**m, "tensors": {"a": 1}},
    "source: [1]": lambda m: {**m, "source": [1]},
    "extra: [1]": lambda m: {**m, "extra": [1]},
    "shape: 'x'": lambda m: {**m, "tensors": [{**m["tensors"][0], "shape": "x"}] + m["tensors"][1:]},
    "tensor_parallel_size: 'two'": lambda m: {**m, "tensor_parallel_size": "two"},
    "pipeline_layer_counts: 3": lambda m: {**m, "pipeline_layer_counts": 3},
}


@pytest.mark.parametrize("case", sorted(MALFORMED_MANIFESTS))
def test_malformed_manifest(capsys, sources, tmp_path, case):
    legacy = copy_tree(sources["legacy"], tmp_path / "legacy")
    manifest = legacy / "mmparity.json"
    manifest.write_text(json.dumps(MALFORMED_MANIFESTS[case](json.loads(manifest.read_text()))))
    one_line_error(*run_cli(capsys, "verify", legacy), "mmparity.json")
    one_line_error(*run_cli(capsys, "convert", "--src", legacy, "--dst", tmp_path / "out", "--to", "hf"),
                   "mmparity.json")
    one_line_error(*run_cli(capsys, "check", "--mcore", legacy, "--hf", sources["hf"], "--no-components"),
                   "mmparity.json")


CHECK_ARGUMENTS = {
    "--image-size 100000x100000": (["--image-size", "100000x100000"], "100000x100000"),
    "--image-size 8x1000000000": (["--image-size", "8x1000000000"], "8x1000000000"),
    "--seed 2**70": (["--seed", str(2**70)], "--seed"),
    "--seed 2**64": (["--seed", str(2**64)], "--seed"),
}


@pytest.mark.parametrize("case", sorted(CHECK_ARGUMENTS))
def test_check_arguments_out_of_range(case):
    argv, needle = CHECK_ARGUMENTS[case]
    # In a child with bounded memory: the unfixed command tries to allocate the image.
    code, out, err = run_subprocess("check", FAMILY, "--no-components", *argv, memory_limit=8 * 2**30)
    one_line_error(code, out, err, needle)


@pytest.mark.parametrize("option", ["--json", "--junit"])
def test_check_report_path_is_a_directory(capsys, tmp_path, option):
    code, out, err = run_cli(capsys, "check", FAMILY, "--no-components", option, tmp_path)
    one_line_error(code, out, err, option, tmp_path)
    assert out == ""  # refused before any check ran


@pytest.mark.parametrize("option", ["--json", "--junit"])
def test_check_report_on_a_full_disk(capsys, tmp_path, option):
    # RLIMIT_FSIZE makes every write past 64 bytes fail with EFBIG, as a full disk fails with
    # ENOSPC (Python ignores SIGXFSZ, so the write returns the error).
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    report = tmp_path / "report"
    capsys.readouterr()
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
    try:
        code = main(["check", FAMILY, "--no-components", "--quiet", option, str(report)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out, err = capsys.readouterr()
    one_line_error(code, out, err, report)
    assert sorted(os.listdir(tmp_path)) == []  # no partial report, no scratch file


# --------------------------------------------------------------------------------------------------
# 6. a manifest certifies the directory it sits in


def _edit_manifest(directory: Path, edit) -> None:
    path = directory / "mmparity.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def test_manifest_records_pointing_outside(capsys, sources, tmp_path):
    hf = copy_tree(sources["hf_out"], tmp_path / "hf")
    shutil.copy(hf / "model.safetensors", tmp_path / "outside.safetensors")
    _edit_manifest(hf, lambda m: {**m, "tensors": [{**r, "file": "../outside.safetensors"} for r in m["tensors"]]})
    code, out, err = run_cli(capsys, "verify", hf)
    assert code != 0 and "all match" not in out and "Traceback" not in out + err
    assert "outside.safetensors" in out + err


def test_manifest_with_no_tensors(capsys, sources, tmp_path):
    hf = copy_tree(sources["hf_out"], tmp_path / "hf")
    _edit_manifest(hf, lambda m: {**m, "tensors": []})
    code, out, err = run_cli(capsys, "verify", hf)
    assert code != 0 and "all match" not in out and "Traceback" not in out + err


@pytest.mark.parametrize("kind", ["hf_out", "legacy", "torch_dist"])
def test_data_file_not_covered_by_the_manifest(capsys, sources, tmp_path, kind):
    directory = copy_tree(sources[kind], tmp_path / "ckpt")
    if kind == "hf_out":
        shutil.copy(directory / "model.safetensors", directory / "model-extra.safetensors")
        extra = "model-extra.safetensors"
    elif kind == "legacy":
        copy_tree(directory / "iter_0000001" / "mp_rank_00", directory / "iter_0000001" / "mp_rank_01")
        extra = "mp_rank_01"
    else:
        copy_tree(directory / "iter_0000001", directory / "iter_0000002")
        extra = "iter_0000002"
    code, out, err = run_cli(capsys, "verify", directory)
    assert code == 1 and extra in out and "not covered" in out, (out, err)


def test_foreign_manifest(capsys, sources, tmp_path):
    hf = copy_tree(sources["hf_out"], tmp_path / "hf")
    shutil.copy(sources["legacy"] / "mmparity.json", hf / "mmparity.json")
    code, out, err = run_cli(capsys, "verify", hf)
    assert code != 0 and "all match" not in out and "Traceback" not in out + err


# --------------------------------------------------------------------------------------------------
# 7. a destination inside the source checkpoint


@pytest.mark.parametrize("target", ["hf_config.json", "mmparity.json", "latest_checkpointed_iteration.txt",
                                    "newdir", "iter_0000001/x"])
@pytest.mark.parametrize("kind", ["legacy", "torch_dist"])
def test_destination_inside_the_source_root(capsys, sources, tmp_path, kind, target):
    root = copy_tree(sources[kind], tmp_path / "root")
    before = snapshot(root)
    code, out, err = run_cli(capsys, "convert", "--src", root / "iter_0000001", "--dst", root / target,
                             "--to", "hf", "--force")
    one_line_error(code, out, err, "source")
    assert snapshot(root) == before


# --------------------------------------------------------------------------------------------------
# 8. kills and signals


def _litter(parent: Path, name: str) -> list[str]:
    return sorted(p for p in os.listdir(parent) if p.startswith(f".{name}."))


@pytest.mark.slow  # several seconds: the full suite runs it, the quick loops skip it
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_kill_at_every_point_of_a_forced_conversion(sources, tmp_path, fmt):
    """SIGKILL at step N (the writer's own fault hook) for N = 1, 2, ... until a run completes:
    after every kill the destination is the old complete checkpoint or the new complete one."""
    dst = tmp_path / "dst"
    argv = ["convert", "--family", FAMILY, "--src", sources["hf"], "--dst", dst, "--to", "mcore", "--format",
            fmt, "--force", "--quiet"]
    code, _, err = run_subprocess(*argv[:-2], "--dtype", "bfloat16", "--quiet")  # the old checkpoint
    assert code == 0, err
    old = snapshot(dst)
    outcomes = []
    for step in range(1, 200):
        code, out, err = run_subprocess(*argv, env={"MMPARITY_FAULT": f"kill@{step}"})
        assert "Traceback" not in err, err
        assert dst.is_dir()
        state = snapshot(dst)
        if code == 0:
            break
        assert code == -signal.SIGKILL, (step, code, err)
        manifest = json.loads(state["mmparity.json"])
        assert state == old or manifest["extra"]["dtype"] is None, step
        assert main(["verify", str(dst), "--quiet"]) == 0, step
        outcomes.append("old" if state == old else "new")
    else:
        pytest.fail("the conversion never completed")
    assert outcomes and outcomes[0] == "old" and "new" in outcomes, outcomes  # both sides of the publish were hit
    assert main(["verify", str(dst), "--quiet"]) == 0
    assert _litter(tmp_path, "dst") == [], "the completed run left (or did not remove) temporary directories"


def _as_megatron_wrote_it(legacy: Path, dst: Path) -> Path:
    """mmparity's legacy output without mmparity's own files: what Megatron-LM's saver leaves (a
    tracker, an iteration directory, rank files), read back with ``--base``."""
    shutil.copytree(legacy, dst)
    for name in ("mmparity.json", "hf_config.json", "mcore_side.safetensors"):
        (dst / name).unlink(missing_ok=True)
    return dst


def _release_or_base_export(sources, tmp_path, case: str, dst: Path) -> list:
    if case == "release":
        return ["convert", "--family", FAMILY, "--src", sources["hf"], "--dst", dst, "--to", "mcore",
                "--format", "legacy", "--release", "--quiet"]
    src = tmp_path / "megatron_written"
    if not src.exists():
        _as_megatron_wrote_it(sources["legacy"], src)
    return ["convert", "--src", src, "--dst", dst, "--to", "hf", "--base", sources["hf"], "--quiet"]


@pytest.mark.parametrize("case", ["release", "base"])
@pytest.mark.slow  # several seconds: the full suite runs it, the quick loops skip it
def test_kill_while_writing_a_release_or_a_base_export_leaves_no_destination(sources, tmp_path, case):
    """A kill at any of the first writer steps of ``--release`` (mcore) or ``--base`` (HF export of
    what Megatron wrote, base files copied in) leaves no destination; the next run completes."""
    dst = tmp_path / "dst"
    argv = _release_or_base_export(sources, tmp_path, case, dst)
    killed = 0
    for step in (1, 2, 3, 5, 8):
        code, _, err = run_subprocess(*argv, env={"MMPARITY_FAULT": f"kill@{step}"})
        assert "Traceback" not in err, err
        if code == 0:
            break
        assert code == -signal.SIGKILL, (step, code, err)
        assert not dst.exists(), step
        killed += 1
    assert killed, "no kill landed before the conversion completed"
    code, _, err = run_subprocess(*argv)
    assert code == 0, err
    assert main(["verify", str(dst), "--quiet"]) == 0
    assert _litter(tmp_path, "dst") == []


@pytest.mark.parametrize("case", ["release", "base"])
@pytest.mark.slow  # several seconds: the full suite runs it, the quick loops skip it
def test_release_and_base_export_across_filesystems(sources, tmp_path, case):
    """Written onto a second filesystem, the same files as on the first, byte for byte (the
    manifest's recorded source path aside)."""
    other = _other_filesystem(tmp_path)
    if other is None:
        pytest.skip("no second filesystem here (/dev/shm missing or on the same device as the temp dir)")
    here = tmp_path / "here"
    there = Path(tempfile.mkdtemp(dir=other)) / "there"
    try:
        for dst in (here, there):
            code, _, err = run_subprocess(*_release_or_base_export(sources, tmp_path, case, dst))
            assert code == 0, err
        a, b = snapshot(here), snapshot(there)
        assert sorted(a) == sorted(b)
        assert all(a[k] == b[k] for k in a if k != "mmparity.json"), [k for k in a if a[k] != b[k]]
    finally:
        shutil.rmtree(there.parent, ignore_errors=True)


def test_stale_staging_of_a_dead_writer_is_removed_and_reported(sources, tmp_path):
    dst = tmp_path / "dst"
    stale = tmp_path / ".dst.tmp-dead1234"  # as a writer killed before its publish leaves it
    (stale / "iter_0000001").mkdir(parents=True)
    (stale / "iter_0000001" / "junk").write_bytes(b"x" * 1000)
    code, out, err = run_subprocess("convert", "--family", FAMILY, "--src", sources["hf"], "--dst", dst, "--to",
                                    "mcore", "--format", "legacy", "--quiet")
    assert code == 0, err
    assert not stale.exists() and _litter(tmp_path, "dst") == []
    assert ".dst.tmp-dead1234" in err and "removed" in err


def as_from_a_terminal() -> None:
    """A child's signals as a terminal's shell starts it. A suite run as a shell's background job
    (`.ci/run &`) passes SIGINT on ignored, and one run under ``nohup`` SIGHUP; an interpreter keeps
    what it was started ignoring (as mmparity does on purpose), so the child would never see the
    signal a test sends."""
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signals_clean_up_like_sigint(sources, tmp_path, signum):
    dst = tmp_path / "dst"
    env = {**os.environ, "PYTHONPATH": str(REPO), "MMPARITY_FAULT": "pause@3"}
    proc = subprocess.Popen([sys.executable, "-m", "mmparity", "convert", "--family", FAMILY, "--src",
                             str(sources["hf"]), "--dst", str(dst), "--to", "mcore", "--format", "legacy"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_from_a_terminal)
    try:
        deadline = time.monotonic() + 60
        while not _litter(tmp_path, "dst") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _litter(tmp_path, "dst"), "the conversion never paused inside its staging directory"
        time.sleep(0.2)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    # Ctrl-C exits 130; SIGTERM and SIGHUP, once cleaned up, are handed on to the default action,
    # so the process dies of them (a shell reports 128 + the number, 143 for SIGTERM).
    assert proc.returncode == (128 + signum if signum == signal.SIGINT else -signum), (proc.returncode, err)
    assert err.splitlines() == [f"mmparity: interrupted by {signal.Signals(signum).name}"], err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("point", ["aside", "published", "removed"])
@pytest.mark.slow  # several seconds: the full suite runs it, the quick loops skip it
def test_publish_without_rename_exchange_recovers_on_the_next_run(sources, tmp_path, point):
    """Where the filesystem has no RENAME_EXCHANGE, the old copy is moved aside first; a kill in
    that window leaves no destination, and the next run to the same destination puts it back."""
    dst = tmp_path / "dst"
    base = ["convert", "--family", FAMILY, "--src", sources["hf"], "--dst", dst, "--to", "mcore", "--format",
            "legacy", "--quiet"]
    assert run_subprocess(*base)[0] == 0
    old = snapshot(dst)
    code, _, err = run_subprocess(*base, "--force", "--dtype", "bfloat16", env={"MMPARITY_FAULT": f"noexchange,kill@{point}"})
    assert code == -signal.SIGKILL, err
    assert dst.exists() == (point != "aside")
    # The next run (here one that then fails its TP check) restores the old checkpoint and removes
    # what the killed one left.
    code, _, err = run_subprocess(*base, "--force", "--tp", "3")
    assert code == 2 and "Traceback" not in err, err
    assert ("restored" in err) == (point == "aside"), err
    assert ("removed" in err) == (point != "removed"), err
    state = snapshot(dst)
    assert state == old if point == "aside" else json.loads(state["mmparity.json"])["extra"]["dtype"] == "bfloat16"
    assert _litter(tmp_path, "dst") == []


# --------------------------------------------------------------------------------------------------
# 9. resource bombs


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 10**9), ("num_hidden_layers", 10**5),
                                         ("hidden_size", 2**40), ("intermediate_size", 2**40)])
@pytest.mark.slow  # several seconds: the full suite runs it, the quick loops skip it
def test_config_bomb(sources, tmp_path, field, value):
    hf = copy_tree(sources["hf"], tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    config[field] = value
    (hf / "config.json").write_text(json.dumps(config))
    code, out, err = run_subprocess("convert", "--family", FAMILY, "--src", hf, "--dst", tmp_path / "out",
                                    "--to", "mcore", memory_limit=6 * 2**30)
    one_line_error(code, out, err, field)
    code, out, err = run_subprocess("check", FAMILY, "--hf", hf, "--no-components", memory_limit=6 * 2**30)
    one_line_error(code, out, err, field)


@pytest.mark.slow
def test_config_bomb_in_an_mcore_source(sources, tmp_path):
    """An mcore source bounds its config by the `.metadata` it already decoded for the conversion:
    a layer count under mmparity's ceiling, but above the tensors present."""
    mcore = copy_tree(sources["torch_dist"], tmp_path / "mcore")
    config = json.loads((mcore / "hf_config.json").read_text())
    config["num_hidden_layers"] = 5000
    (mcore / "hf_config.json").write_text(json.dumps(config))
    code, out, err = run_subprocess("convert", "--src", mcore, "--dst", tmp_path / "out", "--to", "hf",
                                    memory_limit=6 * 2**30)
    one_line_error(code, out, err, "num_hidden_layers = 5000, but the checkpoint holds", "hf_config.json")
    assert not (tmp_path / "out").exists()


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


NOT_REGULAR = "not a regular file"
FIFO_CASES = {
    # (source kind, file replaced by a FIFO, command, what the one error line says)
    "distcp / convert": ("torch_dist", "iter_0000001/__0_0.distcp", ["convert", "--to", "hf"], NOT_REGULAR),
    "distcp / verify": ("torch_dist", "iter_0000001/__0_0.distcp", ["verify"], NOT_REGULAR),
    "metadata / convert": ("torch_dist", "iter_0000001/.metadata", ["convert", "--to", "hf"], ".metadata"),
    "tracker / convert": ("legacy", "latest_checkpointed_iteration.txt", ["convert", "--to", "hf"], NOT_REGULAR),
    "rank file / convert": ("legacy", "iter_0000001/mp_rank_00/model_optim_rng.pt", ["convert", "--to", "hf"],
                            "model_optim_rng.pt"),
    "rank file / verify": ("legacy", "iter_0000001/mp_rank_00/model_optim_rng.pt", ["verify"], NOT_REGULAR),
    "shard / convert": ("hf", "model.safetensors", ["convert", "--family", FAMILY, "--to", "mcore"],
                        "model.safetensors"),
    "shard / verify": ("hf_out", "model.safetensors", ["verify"], NOT_REGULAR),
    "manifest / verify": ("hf_out", "mmparity.json", ["verify"], NOT_REGULAR),
    "hf_config / convert": ("legacy", "hf_config.json", ["convert", "--to", "hf"], "hf_config.json"),
    "config.json / convert": ("hf", "config.json", ["convert", "--family", FAMILY, "--to", "mcore"], "config.json"),
}


@pytest.mark.parametrize("case", sorted(FIFO_CASES))
def test_fifo_in_place_of_a_file(sources, tmp_path, case):
    kind, relative, command, needle = FIFO_CASES[case]
    directory = copy_tree(sources[kind], tmp_path / "ckpt")
    _fifo(directory / relative)
    argv = [command[0], "--src", directory, "--dst", tmp_path / "out", *command[1:]] if command[0] == "convert" \
        else [*command, directory]
    code, out, err = run_subprocess(*argv, timeout=60)
    assert "Traceback" not in err
    assert stat.S_ISFIFO(os.lstat(directory / relative).st_mode)
    if command[0] == "verify" and relative != "mmparity.json":
        assert code == 1 and needle in out and Path(relative).name in out, (out, err)
    else:
        one_line_error(code, out, err, Path(relative).name, needle)


# --------------------------------------------------------------------------------------------------
# 10. no subcommand


def test_no_subcommand_prints_usage_on_stderr(capsys):
    code, out, err = run_cli(capsys)
    assert code == 2 and out == "" and "usage: mmparity" in err
