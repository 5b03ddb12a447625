"""Hostile pickles: a code-running payload planted in every pickled object of a checkpoint.

A legacy and a torch_dist checkpoint (loaded at TP 1 and 2) get a payload that, if ever
unpickled, creates a marker directory: in DCP's `.metadata` (inside an otherwise valid
`Metadata`), in an `_extra_state` byte item and in a tensor item of a `.distcp` file (with the
manifest's checksum left stale and rewritten: anyone who can write the payload can rewrite a
checksum), in `common.pt`, and in a legacy rank file. Every subcommand that reads a checkpoint runs
on it; nothing may run, nothing may print a traceback, and `verify --load` refuses the object by
file and key (exit 2).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state
from mmparity.io import extra_state, torch_dist_files
from mmparity.io.fsio.checksums import tensor_checksum
from mmparity.cli.main import main
from tests.faults.test_faults import run_cli

pytestmark = pytest.mark.fault

# Stock megatron-core classes hold both, so verify --load always runs: clip's tower whole, and
# mistral3 part by part (GPTModel + MultimodalProjector), the whole-VLM load path.
FAMILIES = ("clip", "mistral3")


class Payload:
    """Unpickling this makes ``marker``: proof that code from the checkpoint ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture(scope="module", params=FAMILIES)
def clean(request, tmp_path_factory):
    family = request.param
    fam = families.get(family)
    model = fam.build_reference(fam.tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=21))
    base = tmp_path_factory.mktemp("pickles")
    model.save_pretrained(base / "hf")
    made = {"hf": base / "hf"}
    for name, argv in (("legacy1", ["--format", "legacy"]), ("legacy2", ["--format", "legacy", "--tp", "2"]),
                       ("torch_dist", [])):
        assert main(["convert", "--family", family, "--src", str(base / "hf"), "--dst", str(base / name),
                     "--to", "mcore", *argv, "--quiet"]) == 0
        made[name] = base / name
    return made


def _iteration_dir(root: Path) -> Path:
    return next(root.glob("iter_*"))


def _torch_save(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _repoint(root: Path, key: str, data: bytes, rewrite_checksum: bool) -> None:
    """Append ``data`` to the item's `.distcp` file and point `.metadata` at it (a standard pickle
    of a clean Metadata: only the item is hostile)."""
    iteration = _iteration_dir(root)
    metadata = torch_dist_files.load_metadata(iteration)
    (index, info), = [(i, v) for i, v in metadata.storage_data.items() if i.fqn == key]
    path = iteration / info.relative_path
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(data)
    metadata.storage_data[index] = type(info)(info.relative_path, offset, len(data))
    (iteration / ".metadata").write_bytes(pickle.dumps(metadata))
    if rewrite_checksum and extra_state.is_extra_state(key):
        manifest = json.loads((root / "mmparity.json").read_text())
        checksum = tensor_checksum(extra_state.bytes_tensor(data)).to_json()
        for record in manifest["tensors"]:
            if record["key"] == key:
                record.update(checksum)
        (root / "mmparity.json").write_text(json.dumps(manifest))


def _plant_metadata(root: Path, marker: Path, rewrite: bool) -> str:
    iteration = _iteration_dir(root)
    metadata = torch_dist_files.load_metadata(iteration)
    metadata.planner_data = {"hostile": Payload(marker)}
    (iteration / ".metadata").write_bytes(pickle.dumps(metadata))
    return ".metadata"


def _plant_extra_state(root: Path, marker: Path, rewrite: bool) -> str:
    iteration = _iteration_dir(root)
    key = torch_dist_files.object_keys(iteration)[0]
    _repoint(root, key, _torch_save([Payload(marker)]), rewrite)
    return key


def _plant_tensor_item(root: Path, marker: Path, rewrite: bool) -> str:
    iteration = _iteration_dir(root)
    key = next(iter(torch_dist_files.tensor_metadata(iteration)))
    _repoint(root, key, _torch_save(Payload(marker)), rewrite)
    return key


def _plant_common(root: Path, marker: Path, rewrite: bool) -> str:
    path = _iteration_dir(root) / "common.pt"
    path.write_bytes(_torch_save({"checkpoint_version": 3.0, "iteration": 1, "args": Payload(marker)}))
    return "common.pt"


def _plant_legacy(root: Path, marker: Path, rewrite: bool) -> str:
    path = next(root.glob("iter_*/mp_rank_00*/model_optim_rng.pt"))
    payload = torch.load(path, weights_only=True)
    payload["args"] = Payload(marker)
    path.write_bytes(_torch_save(payload))
    return "model_optim_rng.pt"


TORCH_DIST_PLANTS = {
    "metadata": _plant_metadata,
    "extra_state-stale-checksum": _plant_extra_state,
    "extra_state-rewritten-checksum": _plant_extra_state,
    "tensor_item": _plant_tensor_item,
    "common.pt": _plant_common,
}


def _commands(root: Path, out: Path, tp: int) -> dict[str, list]:
    at_tp = ["--tp", str(tp)] if tp != 1 else []
    return {
        "verify": ["verify", root],
        "verify --load": ["verify", "--load", root, *at_tp],
        "convert to hf": ["convert", "--src", root, "--dst", out / "hf", "--to", "hf", "--quiet"],
        "convert reshard": ["convert", "--src", root, "--dst", out / "reshard", "--to", "mcore", "--format",
                            "legacy", "--tp", str(3 - tp), "--quiet"],
        "check --mcore": ["check", "--mcore", root, *at_tp, "--quiet", "--no-components"],
    }


def _run_everything(capsys, root: Path, marker: Path, tp: int, planted: str, out: Path) -> dict:
    codes = {}
    for name, argv in _commands(root, out, tp).items():
        code, stdout, stderr = run_cli(capsys, *argv)
        assert not marker.exists(), f"`mmparity {name}` ran code planted in {planted}"
        assert "Traceback" not in stdout + stderr, (name, stdout + stderr)
        assert code in (0, 1, 2), (name, code, stderr)
        codes[name] = (code, stdout, stderr)
    return codes


def _loads_refused(codes: dict, planted: str) -> None:
    code, out, err = codes["verify --load"]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, (code, out, err)
    assert "refusing" in lines[0] and planted in lines[0], lines[0]


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("plant", sorted(TORCH_DIST_PLANTS))
def test_torch_dist_payload_never_runs(capsys, tmp_path, clean, plant, tp):
    root = shutil.copytree(clean["torch_dist"], tmp_path / "ckpt")
    marker = tmp_path / "PAYLOAD-RAN"
    planted = TORCH_DIST_PLANTS[plant](root, marker, plant.endswith("rewritten-checksum"))
    codes = _run_everything(capsys, root, marker, tp, planted, tmp_path / "out")
    if plant in ("metadata", "extra_state-stale-checksum", "extra_state-rewritten-checksum"):
        _loads_refused(codes, planted)
    if plant == "tensor_item":  # not a plain tensor blob: decoded under our allow-list, refused by name
        code, out, err = codes["convert to hf"]
        assert code == 2 and "refusing to unpickle posix.mkdir" in err and planted in err, (code, out, err)
    if plant == "metadata":  # nothing reads a torch_dist checkpoint without its metadata
        for name, (code, out, err) in codes.items():
            # verify lists the damage (exit 1); every other command refuses the file (exit 2)
            assert code == (1 if name == "verify" else 2), (name, out, err)
            assert "refusing to unpickle posix.mkdir" in out + err, (name, out, err)


@pytest.mark.parametrize("stored", [[1, 2, 3], {"weight": 1.0}, 7, torch.zeros(2, dtype=torch.int8)])
def test_a_tensor_item_that_is_no_such_tensor_is_named_by_every_command(capsys, tmp_path, clean, stored):
    """Inert but wrong: a torch_dist tensor item holding a list, a dict, a number or another tensor.
    Every command names the item and what it holds (verify --load too, whose load DCP decodes)."""
    root = shutil.copytree(clean["torch_dist"], tmp_path / "ckpt")
    key = next(iter(torch_dist_files.tensor_metadata(_iteration_dir(root))))
    _repoint(root, key, _torch_save(stored), False)
    found = type(stored).__name__ if not isinstance(stored, torch.Tensor) else "torch.int8 [2]"
    for name, argv in _commands(root, tmp_path / "out", 1).items():
        code, out, err = run_cli(capsys, *argv)
        assert code == (1 if name.startswith("verify") else 2), (name, out, err)
        assert f"{key!r} chunk" in out + err and f"holds {found}" in out + err, (name, out, err)
        assert "Traceback" not in out + err and "AttributeError" not in out + err, (name, out, err)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_legacy_payload_never_runs(capsys, tmp_path, clean, tp):
    root = shutil.copytree(clean[f"legacy{tp}"], tmp_path / "ckpt")
    marker = tmp_path / "PAYLOAD-RAN"
    planted = _plant_legacy(root, marker, False)
    codes = _run_everything(capsys, root, marker, tp, planted, tmp_path / "out")
    for name, (code, out, err) in codes.items():
        # verify lists the damage (exit 1); every other command refuses the file (exit 2)
        assert code == (1 if name == "verify" else 2), (name, out, err)
        assert "model_optim_rng.pt" in out + err and "posix.mkdir" in out + err, (name, out, err)


def test_megatrons_saved_plans_are_read(capsys, tmp_path, clean):
    """megatron-core's saver keeps every rank's SavePlan in `.metadata` (`all_local_plans`): plain
    dataclasses, accepted; the checkpoint still converts bit-exact."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    root = shutil.copytree(clean["torch_dist"], tmp_path / "ckpt")
    iteration = _iteration_dir(root)
    metadata = torch_dist_files.load_metadata(iteration)
    planner = DefaultSavePlanner()
    planner.set_up_planner({"w": torch.zeros(2, 3), "obj": io.BytesIO(b"x")}, is_coordinator=True)
    plan = planner.create_local_plan()
    plan = type(plan)(plan.items, storage_data=_StoragePrefix("__0_"), planner_data=plan.planner_data)
    metadata.all_local_plans = [plan, plan]
    (iteration / ".metadata").write_bytes(pickle.dumps(metadata))
    assert torch_dist_files.load_metadata(iteration).all_local_plans[0].items == plan.items
    code, out, err = run_cli(capsys, "convert", "--src", root, "--dst", tmp_path / "hf", "--to", "hf", "--quiet")
    assert code == 0, err
    from safetensors.torch import load_file

    back, original = load_file(next((tmp_path / "hf").glob("*.safetensors"))), load_file(
        next(clean["hf"].glob("*.safetensors")))
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in back)


# --------------------------------------------------------------------------------------------------
# checkpoints Megatron's own savers wrote (args, RNG, optimizer; megatron-core's .metadata)


@pytest.fixture(scope="module")
def megatron_written(tmp_path_factory):
    """A clip checkpoint saved by Megatron's savers, legacy (Megatron-LM's rank-file layout) and
    torch_dist (``dist_checkpointing.save`` with an optimizer's sharded state), and its base."""
    from tests.io.test_megatron_written import make_pair, megatron_written as written

    class _Quiet:  # run_cli's capsys, outside a test
        def readouterr(self):
            return "", ""

    tmp = tmp_path_factory.mktemp("megatron_written")
    base, trained = make_pair("clip", tmp)
    return {"base": base, **{fmt: written(_Quiet(), tmp, "clip", 1, fmt, base, trained)
                             for fmt in ("legacy", "torch_dist")}}


def _megatron_commands(root: Path, base: Path, out: Path) -> dict[str, list]:
    return {"verify": ["verify", root],
            "verify --load --base": ["verify", root, "--load", "--base", base],
            "convert --base": ["convert", "--src", root, "--dst", out / "hf", "--to", "hf", "--base", base]}


def test_megatron_written_rank_file_naming_os_system_is_refused(capsys, tmp_path, megatron_written):
    root = shutil.copytree(megatron_written["legacy"], tmp_path / "ckpt")
    marker = tmp_path / "PAYLOAD-RAN"
    path = next(root.glob("iter_*/mp_rank_00*/model_optim_rng.pt"))

    class System:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    # The file as Megatron-LM wrote it (its args, optimizer, RNG), with one hostile entry added.
    from mmparity.io.legacy import load_rank_payload

    assert {"args", "optimizer", "rng_state", "opt_param_scheduler", "iteration"} <= set(load_rank_payload(path))
    payload = torch.load(path, weights_only=False)  # the harness's own file, to re-save with a payload
    for entry in ("opt_param_scheduler", "args"):
        hostile = dict(payload)
        hostile[entry] = System()
        path.write_bytes(_torch_save(hostile))
        for name, argv in _megatron_commands(root, megatron_written["base"], tmp_path / "out").items():
            code, out, err = run_cli(capsys, *argv)
            assert not marker.exists(), f"`mmparity {name}` ran code planted in {entry}"
            assert code == 2 and "refusing to unpickle posix.system" in err and "model_optim_rng.pt" in err, (
                name, out, err)
            assert not (tmp_path / "out" / "hf").exists()


def test_megatron_written_metadata_naming_os_system_is_refused(capsys, tmp_path, megatron_written):
    """megatron-core's own `.metadata` (its SavePlans included), with a hostile planner entry."""
    root = shutil.copytree(megatron_written["torch_dist"], tmp_path / "ckpt")
    marker = tmp_path / "PAYLOAD-RAN"
    iteration = _iteration_dir(root)
    metadata = torch_dist_files.load_metadata(iteration)
    assert metadata.all_local_plans, "megatron-core's saver keeps every rank's SavePlan"

    class System:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    metadata.planner_data = {"hostile": System()}
    (iteration / ".metadata").write_bytes(pickle.dumps(metadata))
    for name, argv in _megatron_commands(root, megatron_written["base"], tmp_path / "out").items():
        code, out, err = run_cli(capsys, *argv)
        assert not marker.exists(), f"`mmparity {name}` ran code planted in .metadata"
        assert code == 2 and "refusing to unpickle posix.system" in err and ".metadata" in err, (name, out, err)


def test_megatron_written_common_state_naming_os_system_is_refused(capsys, tmp_path, megatron_written):
    """The common state beside megatron-core's DCP files (``common.pt``: its args, iteration), with
    a hostile entry: everything that reads it (verify's description, the load, the export, which
    checks its checkpoint_version) refuses it before anything runs."""
    root = shutil.copytree(megatron_written["torch_dist"], tmp_path / "ckpt")
    marker = tmp_path / "PAYLOAD-RAN"

    class System:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (_iteration_dir(root) / "common.pt").write_bytes(_torch_save({"iteration": 7, "args": System()}))
    for name, argv in _megatron_commands(root, megatron_written["base"], tmp_path / "out").items():
        code, out, err = run_cli(capsys, *argv)
        assert not marker.exists(), f"`mmparity {name}` ran code planted in common.pt"
        assert "Traceback" not in out + err, (name, out + err)
        assert code == 2 and "refusing to unpickle posix.system" in err and "common.pt" in err, (name, out, err)


def test_megatron_core_plan_classes_are_allowed(megatron_written):
    """What megatron-core's saver put in `.metadata` names only allow-listed classes: every global
    of the pickle, read without decoding it, is on DCP_METADATA_NAMES."""
    from mmparity.io import unpickle

    data = (_iteration_dir(megatron_written["torch_dist"]) / ".metadata").read_bytes()
    named = set()

    class Recording(unpickle.RestrictedUnpickler):
        def find_class(self, module, name):
            named.add((module, name))
            return super().find_class(module, name)

    metadata = Recording(io.BytesIO(data), unpickle.DCP_METADATA_NAMES, "test").load()
    assert ("torch.distributed.checkpoint.planner", "SavePlan") in named
    assert ("torch.distributed.checkpoint.planner", "WriteItem") in named
    assert metadata.all_local_plans and all(type(p).__name__ == "SavePlan" for p in metadata.all_local_plans)
    # The optimizer's sharded state is there too (and ignored by the export).
    assert any(k.startswith("optimizer.state.exp_avg.") for k in metadata.state_dict_metadata)


def test_megatron_classes_become_inert_records_never_imports():
    """Megatron's enums in `args` are kept as inert records: nothing under `megatron.` is
    imported; anything else (builtins.eval) is still refused; an inert record where weights
    belong is refused by the rank-file reader."""
    import sys

    from mmparity.io import unpickle

    data = (b"\x80\x02cmegatron.core.not_a_module\nAttnBackend\nK\x05\x85R."
            b"")
    before = set(sys.modules)
    value = unpickle.loads(data, unpickle.LEGACY_NAMES, "test", unpickle.MEGATRON_INERT_MODULES)
    assert isinstance(value, unpickle.Inert) and value.args == (5,) and value.name == "AttnBackend"
    assert "megatron.core.not_a_module" not in sys.modules and not {m for m in set(sys.modules) - before
                                                                   if m.startswith("megatron")}
    with pytest.raises(unpickle.RefusedPickle, match="builtins.eval"):
        unpickle.loads(b"\x80\x02cbuiltins\neval\nX\x01\x00\x00\x001\x85R.", unpickle.LEGACY_NAMES, "test",
                       unpickle.MEGATRON_INERT_MODULES)
    # Megatron-LM's args.exit_signal: the Signals enum is inert, the signal module's functions are not.
    assert unpickle.loads(b"\x80\x02csignal\nSignals\nK\x0f\x85R.", unpickle.LEGACY_NAMES, "test",
                          unpickle.MEGATRON_INERT_MODULES).name == "Signals"
    with pytest.raises(unpickle.RefusedPickle, match="signal.alarm"):
        unpickle.loads(b"\x80\x02csignal\nalarm\nK\x0f\x85R.", unpickle.LEGACY_NAMES, "test",
                       unpickle.MEGATRON_INERT_MODULES)
    with pytest.raises(unpickle.RefusedPickle, match="megatron.core.enums.ModelType"):
        unpickle.loads(b"\x80\x02cmegatron.core.enums\nModelType\nK\x01\x85R.", unpickle.LEGACY_NAMES, "test")


def test_inert_record_in_model_entry_is_refused(tmp_path):
    from mmparity.io.fsio.errors import CheckpointError
    from mmparity.io.legacy import load_rank_file
    from megatron.core.transformer.enums import AttnBackend

    path = tmp_path / "model_optim_rng.pt"
    torch.save({"model": {"w": torch.zeros(2), "x": AttnBackend.auto}, "checkpoint_version": 3.0}, path)
    with pytest.raises(CheckpointError, match="Megatron's classes where weights belong"):
        load_rank_file(path)
