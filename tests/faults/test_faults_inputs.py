"""Fault injection, inputs the first fault suite did not reach: links inside checkpoints, a
destination that is a link, a read-only destination parent, a source rewritten while it is read,
a config of another architecture than the family asked for, NaN/Inf weights, and names that must
survive JUnit XML and JSON reports.

The contract is tests/faults/test_faults.py's: the command works correctly, or exits 2 with one stderr
line naming the file and the fix (verify: exit 1 listing the damage), never a traceback, never a
hang, never a half-written or lost destination; the source is never modified.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state
from mmparity.cli.main import main

from tests.faults.test_faults import FAMILY, REPO, copy_tree, one_line_error, run_cli, snapshot, sources  # noqa: F401

pytestmark = pytest.mark.fault


def _convert(*argv) -> None:
    assert main(["convert", *map(str, argv), "--quiet"]) == 0, argv


@pytest.fixture(scope="module")
def more_sources(sources, tmp_path_factory):
    """A sharded HF directory (with an index) and clip mcore checkpoints, which keep a side file."""
    base = tmp_path_factory.mktemp("inputs")
    sharded = base / "sharded"
    _convert("--src", sources["legacy"], "--dst", sharded, "--to", "hf", "--max-shard-size", "30KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    fam = families.get("clip")
    model = fam.build_reference(fam.tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=3))
    clip = base / "clip"
    model.save_pretrained(clip)
    clip_legacy, clip_dist = base / "clip_legacy", base / "clip_dist"
    _convert("--family", "clip", "--src", clip, "--dst", clip_legacy, "--to", "mcore", "--format", "legacy")
    _convert("--family", "clip", "--src", clip, "--dst", clip_dist, "--to", "mcore")
    assert (clip_legacy / "mcore_side.safetensors").is_file() and (clip_dist / "mcore_side.safetensors").is_file()
    return {**sources, "sharded": sharded, "clip": clip, "clip_legacy": clip_legacy, "clip_dist": clip_dist}


def _hf_of(kind: str, srcs) -> tuple[str, Path]:
    return ("clip", srcs["clip"]) if kind.startswith("clip") else (FAMILY, srcs["hf"])


def _commands(kind: str, directory: Path, srcs, out: Path) -> dict[str, list]:
    """The commands that read checkpoint `directory` of `kind`, by name."""
    family, hf = _hf_of(kind, srcs)
    if kind in ("hf", "hf_out", "sharded", "clip"):
        commands = {"convert": ["convert", "--family", family, "--src", directory, "--dst", out, "--to", "mcore",
                                "--format", "legacy"],
                    "check --hf": ["check", family, "--hf", directory, "--no-components", "--quiet"]}
        if (directory / "mmparity.json").exists():
            commands["verify"] = ["verify", directory]
        return commands
    commands = {"convert": ["convert", "--src", directory, "--dst", out, "--to", "hf"],
                "check --mcore": ["check", "--mcore", directory, "--hf", hf, "--no-components", "--quiet"],
                "verify": ["verify", directory]}
    return commands


# --------------------------------------------------------------------------------------------------
# 1. links inside a checkpoint


LINKED_FILES = {
    "hf/config.json": ("hf", "config.json"),
    "hf/model.safetensors": ("hf", "model.safetensors"),
    "sharded/index": ("sharded", "model.safetensors.index.json"),
    "sharded/shard": ("sharded", "model-00001-of-"),  # completed to the shard's name below
    "legacy/rank file": ("legacy", "iter_0000001/mp_rank_00/model_optim_rng.pt"),
    "legacy/rank directory": ("legacy", "iter_0000001/mp_rank_00"),
    "legacy/hf_config.json": ("legacy", "hf_config.json"),
    "legacy/tracker": ("legacy", "latest_checkpointed_iteration.txt"),
    "torch_dist/.metadata": ("torch_dist", "iter_0000001/.metadata"),
    "torch_dist/distcp": ("torch_dist", "iter_0000001/__0_0.distcp"),
    "torch_dist/common.pt": ("torch_dist", "iter_0000001/common.pt"),
    "torch_dist/metadata.json": ("torch_dist", "iter_0000001/metadata.json"),
    "torch_dist/iteration directory": ("torch_dist", "iter_0000001"),
    "torch_dist/hf_config.json": ("torch_dist", "hf_config.json"),
    "clip_legacy/side file": ("clip_legacy", "mcore_side.safetensors"),
    "clip_dist/side file": ("clip_dist", "mcore_side.safetensors"),
}


def _move_out_and_link(directory: Path, relative: str, outside: Path) -> Path:
    path = directory / relative
    outside.mkdir(parents=True, exist_ok=True)
    target = outside / path.name
    shutil.move(path, target)
    os.symlink(target, path)
    return target


@pytest.mark.parametrize("case", sorted(LINKED_FILES))
def test_symlink_pointing_outside_the_checkpoint_is_refused_by_name(capsys, more_sources, tmp_path, case):
    kind, relative = LINKED_FILES[case]
    directory = copy_tree(more_sources[kind], tmp_path / "ckpt")
    if relative.endswith("-of-"):
        relative = next(directory.glob(relative + "*")).name
    target = _move_out_and_link(directory, relative, tmp_path / "elsewhere")
    before, outside_before = snapshot(directory), snapshot(target.parent)
    name = Path(relative).name
    for command, argv in _commands(kind, directory, more_sources, tmp_path / "out").items():
        code, out, err = run_cli(capsys, *argv)
        assert "Traceback" not in out + err, (command, err)
        if command == "verify" and name != "mmparity.json":
            assert code == 1 and name in out and "outside" in out and "all match" not in out, (command, out, err)
        else:
            one_line_error(code, out, err, name, "outside")
        assert not (tmp_path / "out").exists(), command
    assert os.path.islink(directory / relative)
    assert snapshot(directory) == before and snapshot(target.parent) == outside_before


@pytest.mark.parametrize("kind,relative", [("hf", "model.safetensors"),
                                           ("legacy", "iter_0000001/mp_rank_00/model_optim_rng.pt"),
                                           ("torch_dist", "iter_0000001/__0_0.distcp")])
def test_symlink_within_the_checkpoint_is_followed(capsys, more_sources, tmp_path, kind, relative):
    directory = copy_tree(more_sources[kind], tmp_path / "ckpt")
    path = directory / relative
    (directory / "store").mkdir()
    shutil.move(path, directory / "store" / "blob")
    os.symlink(os.path.relpath(directory / "store" / "blob", path.parent), path)
    for command, argv in _commands(kind, directory, more_sources, tmp_path / "out").items():
        code, out, err = run_cli(capsys, *argv)
        assert code == 0, (command, out, err)
        shutil.rmtree(tmp_path / "out", ignore_errors=True)


def test_hugging_face_hub_cache_layout_is_accepted(capsys, more_sources, tmp_path):
    """The hub cache links every snapshot file to ../../blobs/<hash>: outside the snapshot
    directory, but inside the same repository's cache. That is the one outside target accepted."""
    repo = tmp_path / "hub" / "models--mistral--tiny"
    snapshot_dir = repo / "snapshots" / "0123abc"
    snapshot_dir.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for index, path in enumerate(sorted(more_sources["hf"].iterdir())):
        blob = repo / "blobs" / f"{index:040x}"
        shutil.copy(path, blob)
        os.symlink(f"../../blobs/{blob.name}", snapshot_dir / path.name)
    for command, argv in _commands("hf", snapshot_dir, more_sources, tmp_path / "out").items():
        code, out, err = run_cli(capsys, *argv)
        assert code == 0, (command, out, err)


HARD_LINKED = {
    "hf/model.safetensors": ("hf", "model.safetensors"),
    "hf_out/model.safetensors": ("hf_out", "model.safetensors"),
    "legacy/rank file": ("legacy", "iter_0000001/mp_rank_00/model_optim_rng.pt"),
    "torch_dist/distcp": ("torch_dist", "iter_0000001/__0_0.distcp"),
    "clip_legacy/side file": ("clip_legacy", "mcore_side.safetensors"),
    "clip_dist/hf_config.json": ("clip_dist", "hf_config.json"),
}


@pytest.mark.parametrize("case", sorted(HARD_LINKED))
def test_hard_link_to_a_file_outside_is_accepted_and_certified(capsys, more_sources, tmp_path, case):
    """Policy: a hard link is accepted (see `fsio.paths.refuse_links_outside`): its bytes are the
    checkpoint's own, certified by the manifest, and never written through."""
    kind, relative = HARD_LINKED[case]
    directory = copy_tree(more_sources[kind], tmp_path / "ckpt")
    (tmp_path / "elsewhere").mkdir()
    other = tmp_path / "elsewhere" / "other-name"
    os.link(directory / relative, other)
    assert os.stat(directory / relative).st_nlink == 2
    before = other.read_bytes()
    for command, argv in _commands(kind, directory, more_sources, tmp_path / "out").items():
        code, out, err = run_cli(capsys, *argv)
        assert code == 0, (command, out, err)
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
    assert other.read_bytes() == before and os.stat(other).st_nlink == 2
    if relative.endswith(("safetensors", ".pt", ".distcp")) and (directory / "mmparity.json").exists():
        # Bytes changed through the other name are the checkpoint's bytes changed: verify says so.
        # (the middle: the tail of a .distcp written under megatron-core 0.19 is its common_state
        # item, which no manifest record covers)
        with open(other, "r+b") as f:
            f.seek(os.path.getsize(other) // 2)
            f.write(bytes(64))
        code, out, err = run_cli(capsys, "verify", directory)
        assert code == 1 and "problem" in out and "Traceback" not in out + err, (out, err)


# --------------------------------------------------------------------------------------------------
# 2. a destination that is a symlink


def _link_destination(tmp_path: Path, target_kind: str, source: Path) -> tuple[Path, Path | None]:
    dst = tmp_path / "dst"
    if target_kind == "a directory elsewhere":
        target = tmp_path / "elsewhere" / "precious"
        target.mkdir(parents=True)
        (target / "keep.txt").write_text("do not delete")
    elif target_kind == "nothing (dangling)":
        target = tmp_path / "gone"
    else:
        target = source
    os.symlink(target, dst)
    return dst, target


DESTINATIONS = {"legacy": ("hf", ["--family", FAMILY, "--to", "mcore", "--format", "legacy"]),
                "torch_dist": ("hf", ["--family", FAMILY, "--to", "mcore"]),
                "hf": ("legacy", ["--to", "hf"])}


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("target_kind", ["a directory elsewhere", "nothing (dangling)", "the source"])
@pytest.mark.parametrize("output", sorted(DESTINATIONS))
def test_destination_that_is_a_symlink_is_refused(capsys, sources, tmp_path, output, target_kind, force):
    kind, argv = DESTINATIONS[output]
    source = copy_tree(sources[kind], tmp_path / "src")
    dst, target = _link_destination(tmp_path, target_kind, source)
    link_before = os.readlink(dst)
    source_before = snapshot(source)
    target_before = snapshot(target) if target.exists() else None
    code, out, err = run_cli(capsys, "convert", "--src", source, "--dst", dst, *argv,
                             *(["--force"] if force else []), "--quiet")
    one_line_error(code, out, err, dst, "symbolic link")
    assert os.path.islink(dst) and os.readlink(dst) == link_before
    assert snapshot(source) == source_before
    if target_before is not None:
        assert snapshot(target) == target_before
    else:
        assert not os.path.lexists(target)
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith(".dst.")) == []


# --------------------------------------------------------------------------------------------------
# 3. a read-only destination parent


@pytest.fixture
def read_only_dir(tmp_path, monkeypatch):
    """A directory nothing can be created in: chmod 0o555 where that binds (not root), else
    EACCES from os.mkdir / os.open for paths inside it, as a read-only directory answers."""
    directory = tmp_path / "ro"
    directory.mkdir()
    os.chmod(directory, 0o555)
    if os.geteuid() == 0:
        real_mkdir, real_open = os.mkdir, os.open

        def inside(path) -> bool:
            return Path(os.path.abspath(os.fsdecode(path))).parent == directory

        def mkdir(path, *args, **kwargs):
            if inside(path):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
            return real_mkdir(path, *args, **kwargs)

        def open_(path, flags, *args, **kwargs):
            if isinstance(path, (str, bytes, os.PathLike)) and flags & os.O_CREAT and inside(path):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", mkdir)
        monkeypatch.setattr(os, "open", open_)
    yield directory
    os.chmod(directory, 0o755)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("output", sorted(DESTINATIONS))
def test_read_only_destination_parent(capsys, sources, read_only_dir, output, nested):
    kind, argv = DESTINATIONS[output]
    dst = read_only_dir / "missing" / "out" if nested else read_only_dir / "out"
    code, out, err = run_cli(capsys, "convert", "--src", sources[kind], "--dst", dst, *argv, "--quiet")
    one_line_error(code, out, err, read_only_dir, "ermission")
    assert os.listdir(read_only_dir) == []


# --------------------------------------------------------------------------------------------------
# 4. a source rewritten while a conversion reads it


def _mutate(path: Path, how: str) -> None:
    if how == "replaced":  # another file renamed over it: the open one lives on unchanged
        fresh = path.with_name(path.name + ".new")
        fresh.write_bytes(bytes(b ^ 0x5A for b in path.read_bytes()))
        os.replace(fresh, path)
    elif how == "rewritten in place":  # same inode, same size, other bytes past the header
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(size // 2)
            f.write(os.urandom(size - size // 2))
    else:
        raise AssertionError(how)


SOURCE_FILES = {
    "hf->legacy": ("hf", "model.safetensors", ["--family", FAMILY, "--to", "mcore", "--format", "legacy"]),
    "hf->torch_dist": ("hf", "model.safetensors", ["--family", FAMILY, "--to", "mcore"]),
    "legacy->hf": ("legacy", "iter_0000001/mp_rank_00/model_optim_rng.pt", ["--to", "hf"]),
    "torch_dist->hf": ("torch_dist", "iter_0000001/__0_0.distcp", ["--to", "hf"]),
}


def _manifest_tensors(directory: Path) -> list:
    return sorted(json.dumps(r, sort_keys=True) for r in json.loads((directory / "mmparity.json").read_text())["tensors"])


@pytest.mark.parametrize("how", ["replaced", "rewritten in place"])
@pytest.mark.parametrize("case", sorted(SOURCE_FILES))
def test_source_rewritten_while_it_is_read(capsys, sources, tmp_path, monkeypatch, case, how):
    from mmparity.io.fsio import faults

    kind, relative, argv = SOURCE_FILES[case]
    source = copy_tree(sources[kind], tmp_path / "src")
    reference = tmp_path / "reference"
    assert run_cli(capsys, "convert", "--src", source, "--dst", reference, *argv, "--quiet")[0] == 0
    real_fault_point = faults.fault_point
    mutated = []

    def fault_point(name):  # the writer's own fault hook: after the first tensor is handed over
        if name == "tensor" and not mutated:
            _mutate(source / relative, how)
            mutated.append(name)
        real_fault_point(name)

    monkeypatch.setattr(faults, "fault_point", fault_point)
    dst = tmp_path / "dst"
    code, out, err = run_cli(capsys, "convert", "--src", source, "--dst", dst, *argv, "--quiet")
    monkeypatch.setattr(faults, "fault_point", real_fault_point)
    assert mutated, "the conversion never reached its first tensor"
    if code == 0:
        # A consistent snapshot: exactly what the source held when it was opened.
        assert _manifest_tensors(dst) == _manifest_tensors(reference), "published a mix of old and new bytes"
        assert run_cli(capsys, "verify", dst)[0] == 0
    else:
        one_line_error(code, out, err, Path(relative).name, "changed")
        assert not os.path.lexists(dst)
    if how == "rewritten in place":
        assert code == 2  # the bytes read are not one snapshot of the file: refused
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith(".dst.")) == []


_TRUNCATING_RUNNER = """
import os, sys
from mmparity.io.fsio import faults
from mmparity.cli.main import main
victim, argv = sys.argv[1], sys.argv[2:]
real = faults.fault_point
done = []
def fault_point(name):
    if name == "tensor" and not done:
        done.append(1)
        os.truncate(victim, os.path.getsize(victim) // 3)
    real(name)
faults.fault_point = fault_point
sys.exit(main(argv))
"""


@pytest.mark.parametrize("case", ["hf->legacy", "legacy->hf"])
def test_source_truncated_while_it_is_read(sources, tmp_path, case):
    """Truncated in place under a conversion: exit 2 naming the file, or (documented limit) the
    kernel's SIGBUS for a mapping read past its file's new end; never a published destination,
    and the next run removes what the killed one left."""
    kind, relative, argv = SOURCE_FILES[case]
    source = copy_tree(sources[kind], tmp_path / "src")
    dst = tmp_path / "dst"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _TRUNCATING_RUNNER, str(source / relative), "convert", "--src",
                           str(source), "--dst", str(dst), *argv, "--quiet"],
                          capture_output=True, text=True, timeout=180, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr
    if proc.returncode != -signal.SIGBUS:
        one_line_error(proc.returncode, proc.stdout, proc.stderr, Path(relative).name)
    assert not os.path.lexists(dst)
    fresh = copy_tree(sources[kind], tmp_path / "fresh")
    assert main(["convert", "--src", str(fresh), "--dst", str(dst), *argv, "--quiet"]) == 0
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith(".dst.")) == []


# --------------------------------------------------------------------------------------------------
# 5. a config of another architecture than the family asked for


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("architectures")
    out = {}
    for name in ("siglip", "clip", "llava"):
        fam = families.get(name)
        model = fam.build_reference(fam.tiny_config())
        model.load_state_dict(random_like_state(model.state_dict(), seed=5))
        model.save_pretrained(base / name)
        out[name] = base / name
    return out


@pytest.mark.parametrize("saved,asked,needles", [
    ("siglip", "clip", ["siglip_vision_model", "SiglipVisionModel", "'siglip'"]),
    ("clip", "siglip", ["clip_vision_model", "CLIPVisionModel", "'clip'"]),
    ("llava", "clip", ["'llava'", "LlavaForConditionalGeneration", "'llava'"]),
    ("siglip", "llava", ["siglip_vision_model", "'siglip'"]),
    ("siglip", "pixtral", ["siglip_vision_model", "'siglip'"]),
])
def test_check_hf_with_a_config_of_another_architecture(capsys, tiny_dirs, saved, asked, needles):
    code, out, err = run_cli(capsys, "check", asked, "--hf", tiny_dirs[saved], "--no-components", "--quiet")
    line = one_line_error(code, out, err, tiny_dirs[saved], *needles)
    assert f"family {asked!r}" in line or f"'{asked}'" in line
    code, out, err = run_cli(capsys, "convert", "--family", asked, "--src", tiny_dirs[saved], "--dst",
                             tiny_dirs[saved].parent / "out", "--to", "mcore")
    one_line_error(code, out, err, saved if saved != "llava" else "llava")


def test_llava_directory_checked_as_its_tower_family(capsys, tiny_dirs):
    """A LLaVA's tower is a pixtral: checking the directory as `pixtral` checks that tower."""
    code, out, err = run_cli(capsys, "check", "pixtral", "--hf", tiny_dirs["llava"], "--no-components", "--quiet")
    assert code == 0, (out, err)


# --------------------------------------------------------------------------------------------------
# 6. NaN and +/-Inf in bf16 and fp16 weights

SPECIAL_BITS = {
    # NaNs with payloads (quiet and signalling, both signs), +Inf, -Inf, -0.0, the largest finite
    torch.bfloat16: [0x7FC1, 0xFFC3, 0x7F81, 0x7FFF, 0x7F80, 0xFF80, 0x8000, 0x7F7F],
    torch.float16: [0x7E01, 0xFE05, 0x7C01, 0x7FFF, 0x7C00, 0xFC00, 0x8000, 0x7BFF],
}
POISONED = "transformer.layers.0.attention.q_proj.weight"  # permuted on the way to mcore (RoPE)


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def special_hf(request, tmp_path_factory):
    from safetensors.torch import save_file

    dtype = getattr(torch, request.param)
    fam = families.get(FAMILY)
    cfg = fam.tiny_config()
    model = fam.build_reference(cfg)
    state = {k: v.to(dtype) for k, v in random_like_state(model.state_dict(), seed=9).items()}
    bits = torch.tensor(SPECIAL_BITS[dtype], dtype=torch.int32).to(torch.int16)
    for name, stride in ((POISONED, 7), ("transformer.layers.1.feed_forward.down_proj.weight", 5), ("ln_pre.weight", 3)):
        flat = state[name].view(torch.int16).reshape(-1)
        for i, value in enumerate(bits):
            flat[i * stride % flat.numel()] = value
    directory = tmp_path_factory.mktemp(f"special-{request.param}")
    cfg.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory, state


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_nan_and_inf_round_trip_bit_exact(capsys, special_hf, tmp_path, fmt):
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    directory, state = special_hf
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    code, out, err = run_cli(capsys, "convert", "--family", FAMILY, "--src", directory, "--dst", mcore, "--to",
                             "mcore", "--format", fmt, "--quiet")
    assert code == 0, err
    code, out, err = run_cli(capsys, "convert", "--src", mcore, "--dst", back, "--to", "hf", "--quiet")
    assert code == 0, err
    for path in (mcore, back):
        assert run_cli(capsys, "verify", path)[0] == 0
    restored = load_safetensors_state_dict(back)
    assert sorted(restored) == sorted(state)
    for name, tensor in state.items():
        assert restored[name].dtype == tensor.dtype, name
        assert torch.equal(restored[name].view(torch.int16), tensor.view(torch.int16)), name


@pytest.mark.parametrize("direction", ["hf->legacy", "hf->torch_dist", "legacy->hf", "torch_dist->hf"])
def test_nan_and_inf_refused_with_check_finite(capsys, special_hf, tmp_path, direction):
    directory, _ = special_hf
    source = directory
    if not direction.startswith("hf"):
        source = tmp_path / "mcore"
        fmt = direction.split("->")[0]
        assert run_cli(capsys, "convert", "--family", FAMILY, "--src", directory, "--dst", source, "--to", "mcore",
                       "--format", fmt, "--quiet")[0] == 0
        argv = ["--to", "hf"]
    else:
        argv = ["--family", FAMILY, "--to", "mcore", "--format", direction.split("->")[1]]
    dst = tmp_path / "out"
    code, out, err = run_cli(capsys, "convert", "--src", source, "--dst", dst, *argv, "--check-finite", "--quiet")
    line = one_line_error(code, out, err, "NaN/Inf")
    assert any(n in line for n in ("q_proj", "linear_qkv", "down_proj", "linear_fc2", "ln_pre")), line
    assert not os.path.lexists(dst)


def test_check_hf_on_nan_weights_reports_not_crashes(capsys, special_hf, tmp_path):
    directory, _ = special_hf
    report = tmp_path / "report.json"
    code, out, err = run_cli(capsys, "check", FAMILY, "--hf", directory, "--no-components", "--quiet",
                             "--json", report, "--dtype", "bfloat16")
    assert "Traceback" not in out + err
    if code == 2:
        one_line_error(code, out, err, directory)
    else:
        assert code == 1, (code, out, err)
        data = json.loads(report.read_text())
        assert data["passed"] is False


# --------------------------------------------------------------------------------------------------
# 7. names in JUnit XML and JSON reports

HOSTILE = {
    "markup": 'a<b>&c"d\'e',
    "cdata end": "x]]>y",
    "rich markup": "[red]layer[/] [/bold]",
    "newline and tab": "line\nnext\ttab\r",
    "control characters": "nul\x00bell\x07esc\x1bdel\x7f",
    "not encodable": "lone\udcffsurrogate",
    "non-BMP and separators": "emoji\U0001F600 sep\u2028\ufffe",
}


def _xml_expected(text: str) -> str:
    """What a name reads back as from the XML: itself, where XML 1.0 can hold it; a character
    it cannot hold (C0 controls but tab/newline/CR, lone surrogates, U+FFFE/U+FFFF) as its Python
    escape. An attribute value's whitespace round-trips through character references."""
    out = []
    for ch in text:
        code = ord(ch)
        if code in (0x9, 0xA, 0xD) or 0x20 <= code <= 0xD7FF or 0xE000 <= code <= 0xFFFD or code >= 0x10000:
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape", "backslashreplace").decode("ascii") if code < 0xD800 or code > 0xDFFF
                       else f"\\u{code:04x}")
    return "".join(out)


def _hostile_report(name: str):
    from mmparity.parity.report import Divergence, Report, Result

    text = HOSTILE[name]
    metrics = {"max_abs": 1.0, "mean_abs": 0.5, "rel_l2": 0.25, "cosine": 0.9}
    tolerance = {"rel_l2": 1e-5, "note": text}
    failing = Result(family=f"fam{text}", check=f"check{text}", passed=False, metrics=metrics, tolerance=tolerance,
                     first_divergence=Divergence(f"module{text}", {"error": f"err{text}"}, tolerance),
                     description=text, modules=[{"module": f"module{text}", "metrics": metrics, "passed": False}])
    passing = Result(family=f"fam{text}", check=f"ok{text}", passed=True, metrics=metrics, tolerance=tolerance)
    return Report(device="cpu", dtype="float32", seed=0, attention_backend=f"sdpa{text}",
                  results=[failing, passing], versions={"mmparity": text})


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_report_names_survive_junit_and_json(capsys, tmp_path, monkeypatch, name):
    from mmparity.parity import harness

    text = HOSTILE[name]
    monkeypatch.setattr(harness, "check", lambda *args, **kwargs: _hostile_report(name))
    junit, report = tmp_path / "junit.xml", tmp_path / "report.json"
    code, out, err = run_cli(capsys, "check", FAMILY, "--no-components", "--junit", junit, "--json", report)
    assert code == 1 and "Traceback" not in out + err, (code, out, err)
    data = json.loads(report.read_bytes().decode("utf-8"))
    result = data["results"][0]
    assert result["family"] == f"fam{text}" and result["check"] == f"check{text}"
    assert result["first_divergence"]["module"] == f"module{text}"
    assert result["modules"][0]["module"] == f"module{text}"
    assert data["attention_backend"] == f"sdpa{text}"
    suite = ET.fromstring(junit.read_bytes())
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [_xml_expected(f"check{text}"), _xml_expected(f"ok{text}")]
    assert cases[0].get("classname") == _xml_expected(f"mmparity.fam{text}")
    failure = cases[0].find("failure")
    assert failure is not None and cases[1].find("failure") is None
    assert _xml_expected(f"module{text}") in failure.get("message")
    assert failure.text and "rel_l2" in failure.text
    assert suite.get("tests") == "2" and suite.get("failures") == "1"
    # The table people read names the module too (rich markup in a name is text, not markup).
    assert "FAIL" in out
