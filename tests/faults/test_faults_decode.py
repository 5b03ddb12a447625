"""Decodes that must finish: pickles and JSON inside a checkpoint shaped to stall whoever walks them.

A pickle refers to an object it made before in two bytes, so a file of a few hundred bytes can
decode to a list that holds the one below it twice, 60 levels down: 120 objects, 2^60 paths, and
every walk of it (a scan for Megatron's records, a copy, a message's ``repr``) never ends. A list
that holds itself has no end at all, and one nested a hundred thousand deep breaks every recursive
walk. JSON cannot share, but nests: past the decoder's limit it raises ``RecursionError``, and a
value just shallow enough to decode still breaks whatever walks it next.

The contract: each command refuses such a file in one line naming it (verify: exit 1 listing it as
damage), promptly; nothing hangs (every command that would hang runs in a child with a timeout).
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from mmparity.io import torch_dist_files, unpickle
from mmparity.io.fsio.bounded import MAX_DEPTH, check_bounded, json_value
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.legacy import load_rank_payload

from tests.faults.test_faults import copy_tree, one_line_error, run_cli, run_subprocess, sources  # noqa: F401
from tests.faults.test_faults_pickles import _repoint

pytestmark = pytest.mark.fault

STALLS = "stall its readers"


def diamonds(levels: int, make=list):
    """A container holding the one below it twice, ``levels`` deep: 2^levels paths, 2 * levels
    objects. ``make`` builds each level from its two (identical) items."""
    value = make([])
    for _ in range(levels):
        value = make([value, value])
    return value


def _object_array(items) -> np.ndarray:
    array = np.empty(len(items), dtype=object)  # filled item by item: np.array would nest arrays
    for index, item in enumerate(items):
        array[index] = item
    return array


def holds_itself():
    value = [1, "two"]
    value.append(value)
    value.append(value)
    return value


def nested(levels: int) -> bytes:
    """A pickle of a list nested ``levels`` deep, written opcode by opcode (``pickle.dumps``
    itself recurses, and gives up far sooner)."""
    return b"\x80\x02" + b"]" * levels + b"a" * (levels - 1) + b"."


# --------------------------------------------------------------------------------------------------
# the bound itself, on values of every shape a decoder can make


STALLING = {
    "list diamonds 60 deep": lambda: diamonds(60),
    "tuple diamonds 60 deep": lambda: diamonds(60, tuple),
    "dict diamonds 60 deep": lambda: diamonds(60, lambda items: {"a": items[0], "b": items[-1]} if items else {}),
    "numpy object array diamonds": lambda: diamonds(60, _object_array),
    "a list that holds itself": holds_itself,
    "a dict that holds itself": lambda: (lambda d: (d.__setitem__("self", d), d)[1])({}),
    "a flat tuple shared two million times": lambda: [tuple(range(1000))] * 2000,
}


@pytest.mark.parametrize("case", sorted(STALLING))
def test_a_value_no_walk_finishes_is_refused_by_name(case):
    with pytest.raises(CheckpointError, match=STALLS) as refused:
        check_bounded(STALLING[case](), "some/file.pt", nbytes=1000)
    assert str(refused.value).startswith("some/file.pt: ")


def test_depth_is_bounded_whether_or_not_anything_is_shared():
    deep = unpickle.loads(nested(MAX_DEPTH - 2), unpickle.OBJECT_NAMES, "f")
    assert isinstance(deep, list)
    with pytest.raises(CheckpointError, match=f"more than {MAX_DEPTH} deep"):
        unpickle.loads(nested(MAX_DEPTH + 1), unpickle.OBJECT_NAMES, "f")
    with pytest.raises(CheckpointError, match=f"more than {MAX_DEPTH} deep"):
        unpickle.loads(nested(200_000), unpickle.OBJECT_NAMES, "f")


def test_what_writers_make_passes_with_its_sharing():
    """Legitimate sharing (DCP's index keeps one tuple for each distinct shape; an enum member or a
    class is referred to by every record) and a wide tree pass; only what multiplies paths fails."""
    shape = (4096, 1024)
    index = {f"layers.{i}.weight": {"size": shape, "offsets": (i, 0), "dtype": torch.bfloat16}
             for i in range(20_000)}
    check_bounded(index, "index", nbytes=len(pickle.dumps(index)))
    rng = {"random_rng_state": (3, tuple(range(625)), None), "np": np.arange(624, dtype=np.uint32),
           "torch": torch.arange(5)}
    check_bounded([rng] * 64, "rng", nbytes=64 * 3000)
    check_bounded(diamonds(12), "small", nbytes=100)  # 2^13 paths: inside the floor


@pytest.mark.parametrize("levels", [60, 20])
def test_the_unpickler_refuses_before_handing_the_value_on(levels):
    data = pickle.dumps({"weights": diamonds(levels)})
    assert len(data) < 1000  # 20 levels: 2^21 paths, past the floor too
    with pytest.raises(CheckpointError, match=STALLS):
        unpickle.loads(data, unpickle.OBJECT_NAMES, "f")
    buffer = io.BytesIO()
    torch.save({"weights": diamonds(levels)}, buffer)
    with pytest.raises(CheckpointError, match=STALLS):
        unpickle.load_torch_archive(buffer.getvalue(), unpickle.OBJECT_NAMES, "f")


def test_json_nesting_is_bounded():
    assert json_value("[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1), "x.json")
    for levels in (MAX_DEPTH + 1, 900, 100_000):
        with pytest.raises(CheckpointError, match="x.json: .*deep"):
            json_value("[" * levels + "]" * levels, "x.json")


# --------------------------------------------------------------------------------------------------
# planted in checkpoints, run through every command


def _rank_file(root: Path) -> Path:
    return next(root.glob("iter_*/mp_rank_00*/model_optim_rng.pt"))


def _rewrite_rank_file(root: Path, edit) -> Path:
    path = _rank_file(root)
    payload = load_rank_payload(path)
    edit(payload)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    path.write_bytes(buffer.getvalue())
    return path


def _commands(root: Path, out: Path) -> dict[str, list]:
    return {
        "verify": ["verify", root],
        "convert": ["convert", "--src", root, "--dst", out, "--to", "hf", "--quiet"],
        "verify --load": ["verify", "--load", root],
        "check --mcore": ["check", "--mcore", root, "--quiet", "--no-components"],
    }


def _refused(code, out, err, command: str, needle: str) -> None:
    if command == "verify":  # lists the damage
        assert code == 1 and "Traceback" not in out + err and needle in out and STALLS in out, (code, out, err)
    else:
        one_line_error(code, out, err, needle, STALLS)


@pytest.mark.parametrize("command", ["verify", "convert",
                                     pytest.param("verify --load", marks=pytest.mark.slow),
                                     pytest.param("check --mcore", marks=pytest.mark.slow)])
def test_a_kilobyte_pickle_in_a_rank_file_model_entry(sources, tmp_path, command):
    root = copy_tree(sources["legacy"], tmp_path / "ckpt")
    before = _rank_file(root).stat().st_size
    path = _rewrite_rank_file(root, lambda payload: payload["model"].__setitem__("bomb", diamonds(60)))
    assert path.stat().st_size - before < 2000
    code, out, err = run_subprocess(*_commands(root, tmp_path / "out")[command], timeout=120)
    _refused(code, out, err, command, "model_optim_rng.pt")
    assert not (tmp_path / "out").exists()


LEGACY_PLANTS = {
    "args holds diamonds": lambda payload: payload.__setitem__("args", diamonds(60)),
    "optimizer holds a list that holds itself": lambda payload: payload.__setitem__("optimizer", holds_itself()),
    "rng_state nested 100000 deep": None,  # written as raw opcodes below
    "model holds a dict of diamonds": lambda payload: payload["model"].__setitem__(
        "bomb", diamonds(60, lambda items: {"a": items[0], "b": items[-1]} if items else {})),
}


@pytest.mark.parametrize("case", sorted(LEGACY_PLANTS))
def test_legacy_rank_file_entries_that_stall(sources, tmp_path, case):
    root = copy_tree(sources["legacy"], tmp_path / "ckpt")
    if LEGACY_PLANTS[case] is None:
        _rewrite_rank_file(root, lambda payload: payload.__setitem__("rng_state", "PLACEHOLDER"))
        _swap_placeholder_for_nesting(_rank_file(root), 100_000)
    else:
        _rewrite_rank_file(root, LEGACY_PLANTS[case])
    code, out, err = run_subprocess(*_commands(root, tmp_path / "out")["convert"], timeout=120)
    one_line_error(code, out, err, "model_optim_rng.pt", STALLS)


def _swap_placeholder_for_nesting(path: Path, levels: int) -> None:
    """Rewrites the archive's pickle with the string 'PLACEHOLDER' replaced by a list nested
    ``levels`` deep (opcodes no pickler would write for it, since pickling recurses)."""
    from zipfile import ZipFile

    with ZipFile(path) as archive:
        records = {info.filename: archive.read(info) for info in archive.infolist()}
    (name,) = [n for n in records if n.endswith("/data.pkl")]
    marker = b"X" + struct.pack("<I", 11) + b"PLACEHOLDER"  # BINUNICODE: the string's own opcode
    assert records[name].count(marker) == 1
    records[name] = records[name].replace(marker, b"]" * levels + b"a" * (levels - 1))
    with ZipFile(path, "w") as archive:
        for record, data in records.items():
            archive.writestr(record, data)


def _iteration(root: Path) -> Path:
    return next(root.glob("iter_*"))


def _plant_common(root: Path) -> str:
    buffer = io.BytesIO()
    torch.save({"checkpoint_version": 3.0, "iteration": 1, "args": diamonds(60)}, buffer)
    (_iteration(root) / "common.pt").write_bytes(buffer.getvalue())
    return "common.pt"


def _plant_metadata(root: Path) -> str:
    metadata = torch_dist_files.load_metadata(_iteration(root))
    metadata.planner_data = {"bomb": diamonds(60)}
    (_iteration(root) / ".metadata").write_bytes(pickle.dumps(metadata))
    return ".metadata"


def _plant_extra_state(root: Path) -> str:
    key = torch_dist_files.object_keys(_iteration(root))[0]
    buffer = io.BytesIO()
    torch.save([diamonds(60)], buffer)
    _repoint(root, key, buffer.getvalue(), rewrite_checksum=True)
    return key


def test_torch_dist_metadata_that_stalls(sources, tmp_path):
    root = copy_tree(sources["torch_dist"], tmp_path / "ckpt")
    needle = _plant_metadata(root)
    for command in ("verify", "convert"):
        code, out, err = run_subprocess(*_commands(root, tmp_path / "out")[command], timeout=120)
        _refused(code, out, err, command, needle)


def test_common_state_that_stalls_in_what_megatron_wrote(sources, tmp_path):
    """Megatron-LM's own torch_dist output (no mmparity files) is described from its common state."""
    root = copy_tree(sources["torch_dist"], tmp_path / "ckpt")
    for name in ("mmparity.json", "hf_config.json", "mcore_side.safetensors"):
        (root / name).unlink(missing_ok=True)
    needle = _plant_common(root)
    one_line_error(*run_subprocess("verify", root, timeout=120), needle, STALLS)


@pytest.mark.slow  # builds Megatron's class in a child: several seconds
def test_extra_state_that_stalls_under_verify_load(tmp_path):
    """TE's `_extra_state` items are decoded when a checkpoint is loaded into Megatron's class
    (stock CLIPViTModel here)."""
    from mmparity.models import registry as families
    from mmparity.models.core.inputs import random_like_state
    from mmparity.cli.main import main

    fam = families.get("clip")
    model = fam.build_reference(fam.tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=8))
    model.save_pretrained(tmp_path / "hf")
    root = tmp_path / "ckpt"
    assert main(["convert", "--family", "clip", "--src", str(tmp_path / "hf"), "--dst", str(root), "--to", "mcore",
                 "--quiet"]) == 0
    needle = _plant_extra_state(root)
    code, out, err = run_subprocess("verify", "--load", root, timeout=180)
    one_line_error(code, out, err, needle, STALLS)


# --------------------------------------------------------------------------------------------------
# JSON: configs, the manifest, safetensors headers and indexes


def _deep(levels: int) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


def _add_member(path: Path, text: str) -> None:
    """``text`` as the first member of the JSON object in ``path``."""
    body = path.read_text().lstrip()
    path.write_text('{"planted": ' + text + ", " + body[1:])


def _only_an_index(directory: Path, metadata: str) -> None:
    """The single safetensors file renamed to a shard named by an index whose metadata is ``metadata``."""
    single = directory / "model.safetensors"
    raw = single.read_bytes()
    names = [k for k in json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]]) if k != "__metadata__"]
    single.rename(directory / "model-00001-of-00001.safetensors")
    weight_map = json.dumps({name: "model-00001-of-00001.safetensors" for name in names})
    (directory / "model.safetensors.index.json").write_text(f'{{"metadata": {metadata}, "weight_map": {weight_map}}}')


JSON_PLANTS = {
    # (source kind, file edited, edit, command)
    "config.json": ("hf", "config.json", lambda d, t: _add_member(d / "config.json", t), "to mcore"),
    "index": ("hf", "model.safetensors.index.json", _only_an_index, "to mcore"),
    "hf_config.json": ("legacy", "hf_config.json", lambda d, t: _add_member(d / "hf_config.json", t), "to hf"),
    "manifest": ("legacy", "mmparity.json", lambda d, t: _add_member(d / "mmparity.json", t), "to hf"),
}


@pytest.mark.parametrize("levels", [MAX_DEPTH + 5, 900, 100_000])
@pytest.mark.parametrize("plant", sorted(JSON_PLANTS))
def test_json_nested_too_deep(capsys, sources, tmp_path, plant, levels):
    kind, name, edit, direction = JSON_PLANTS[plant]
    root = copy_tree(sources[kind], tmp_path / "ckpt")
    edit(root, _deep(levels))
    argv = ["--family", "pixtral", "--to", "mcore"] if direction == "to mcore" else ["--to", "hf"]
    code, out, err = run_cli(capsys, "convert", "--src", root, "--dst", tmp_path / "out", *argv, "--quiet")
    one_line_error(code, out, err, name, "deep")
    assert not (tmp_path / "out").exists()


def test_json_nested_just_inside_the_bound_converts(capsys, sources, tmp_path):
    root = copy_tree(sources["hf"], tmp_path / "hf")
    _add_member(root / "config.json", _deep(MAX_DEPTH - 5))
    code, out, err = run_cli(capsys, "convert", "--src", root, "--dst", tmp_path / "out", "--family", "pixtral",
                             "--to", "mcore", "--quiet")
    assert code == 0, err


@pytest.mark.parametrize("name", ["mmparity.json", "model.safetensors.index.json"])
def test_a_sparse_json_file_of_gigabytes_is_refused_unread(capsys, sources, tmp_path, name):
    kind = "legacy" if name == "mmparity.json" else "hf"
    root = copy_tree(sources[kind], tmp_path / "ckpt")
    if name != "mmparity.json":
        _only_an_index(root, "{}")
    with open(root / name, "r+b") as f:
        f.truncate(8 * 2**30)  # sparse: no disk, but a whole read would want 8 GiB of memory
    argv = ["--to", "hf"] if kind == "legacy" else ["--family", "pixtral", "--to", "mcore"]
    code, out, err = run_subprocess("convert", "--src", root, "--dst", tmp_path / "out", *argv, "--quiet",
                                    memory_limit=6 * 2**30)
    one_line_error(code, out, err, name, "bytes, more than")
