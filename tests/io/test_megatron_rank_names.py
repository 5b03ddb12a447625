"""Legacy rank directories named as Megatron-LM names them, read as it means them.

Megatron-LM's ``get_checkpoint_name`` names a rank's directory ``mp_rank_TT``, then ``_PPP`` only
when the pipeline has more than one stage, then ``_EEE`` only when there is more than one expert
rank. ``mp_rank_00_001`` is therefore stage 1 at PP 2 or expert rank 1 at PP 1 x EP 2; the
``args`` in the rank files say which. Each case below writes a directory as Megatron-LM's own saver
lays one out (its ``args`` Namespace with enums inside, its iteration, RNG and scheduler entries,
virtual-pipeline chunks ``model0``/``model1`` where it has them; no mmparity files), exports it
with ``convert --to hf --base`` and asserts the release comes back bit for bit.

The weights are a seeded whole Kimi-K2.5 (MoE, so every axis has something to split), built
four decoder layers deep so that PP 2 x VPP 2 has a layer per chunk.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from mmparity.models import registry as families
from mmparity.io.legacy import open_legacy
from mmparity.io.megatron_args import read_legacy_args
from mmparity.io.megatron_written import describe
from tests.cli.test_convert_cli import run_cli
from tests.mapping.test_convert_roundtrips import assert_same_checkpoint, save_hf
from tests.io.test_megatron_written import megatron_args, rng_state

FAMILY = "kimi_k25_vl"
ITERATION = 7
GRIDS = [(tp, pp, ep) for tp in (1, 2) for pp in (1, 2) for ep in (1, 2)]


def megatron_rank_name(tp_rank: int, pp_rank: int, ep_rank: int, pp: int, ep: int) -> str:
    """Megatron-LM's rank directory name, restated: TP rank always, PP rank at PP > 1, EP rank at
    EP > 1 (checked against ``get_checkpoint_name`` itself where Megatron-LM is importable)."""
    return (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
            + (f"_{ep_rank:03d}" if ep > 1 else ""))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    cfg = families.get(FAMILY).tiny_config()
    cfg.text_config.num_hidden_layers = 4  # 1 dense + 3 MoE layers: one per chunk at PP 2 x VPP 2
    return save_hf(FAMILY, tmp_path_factory.mktemp("rank_names") / "hf", seed=21, cfg=cfg)


@pytest.fixture(scope="module")
def converted(hf_dir):
    """mmparity's legacy conversion at (TP, stages, EP), made once per grid."""
    made = {}

    def _converted(tp: int, stages: int, ep: int) -> Path:
        if (tp, stages, ep) not in made:
            dst = hf_dir.parent / f"mmparity_tp{tp}_pp{stages}_ep{ep}"
            argv = ["convert", "--family", FAMILY, "--src", str(hf_dir), "--dst", str(dst), "--to", "mcore",
                    "--format", "legacy", "--tp", str(tp), "--pp", str(stages), "--ep", str(ep), "--quiet"]
            from mmparity.cli.main import main

            assert main(argv) == 0, argv
            made[tp, stages, ep] = dst
        return made[tp, stages, ep]

    return _converted


def write_as_megatron(src: Path, out: Path, tp: int, pp: int, ep: int, vpp: int = 1,
                      iteration: int = ITERATION) -> list[str]:
    """The rank files of ``src`` (converted at PP ``pp * vpp``) laid out as Megatron-LM saves a
    TP x PP x EP run with ``vpp`` virtual stages: chunk c of stage p is the (c * PP + p)-th slice
    of the layer stack. Returns the directory names written."""
    ckpt = open_legacy(src)
    assert (ckpt.tp_size, ckpt.pp_size, ckpt.ep_size) == (tp, pp * vpp, ep)
    iteration_dir = out / f"iter_{iteration:07d}"
    names = []
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                args = megatron_args(tp, pp, ep)
                args.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
                args.iteration = iteration
                # Megatron-LM's entry order: the model (chunks) first, the RNG state's tensors after.
                payload = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
                chunks = [ckpt.load_rank(t, c * pp + p, e) for c in range(vpp)]
                if vpp == 1:
                    payload["model"] = chunks[0]
                else:
                    payload.update({f"model{c}": chunk for c, chunk in enumerate(chunks)})
                payload.update({"opt_param_scheduler": {"max_lr": 1e-4, "num_steps": iteration},
                                "rng_state": rng_state(), "num_floating_point_operations_so_far": 0})
                name = megatron_rank_name(t, p, e, pp, ep)
                (iteration_dir / name).mkdir(parents=True)
                torch.save(payload, iteration_dir / name / "model_optim_rng.pt")
                names.append(name)
    (out / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return names


def export_and_compare(capsys, ckpt: Path, hf_dir: Path, dst: Path) -> None:
    code, out, err = run_cli(capsys, "convert", "--src", ckpt, "--dst", dst, "--to", "hf", "--base", hf_dir,
                             "--quiet")
    assert code == 0, out + err
    assert_same_checkpoint(dst, hf_dir)


@pytest.mark.parametrize("tp, pp, ep", [pytest.param(*g, id=f"tp{g[0]}-pp{g[1]}-ep{g[2]}") for g in GRIDS])
def test_megatron_named_rank_directories_export_bit_exact(capsys, tmp_path, hf_dir, converted, tp, pp, ep):
    out = tmp_path / "megatron"
    names = write_as_megatron(converted(tp, pp, ep), out, tp, pp, ep)
    assert len(set(names)) == tp * pp * ep
    assert not (out / "mmparity.json").exists()
    found = describe(out)
    assert (found.tp, found.pp, found.ep) == (tp, pp, ep), found
    assert found.written_by == "Megatron-written" and found.parallelism_from == "args and rank directories"
    export_and_compare(capsys, out, hf_dir, tmp_path / "hf")


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 2)])
def test_virtual_pipeline_chunks_export_bit_exact(capsys, tmp_path, hf_dir, converted, tp, ep):
    out = tmp_path / "megatron"
    write_as_megatron(converted(tp, 4, ep), out, tp, 2, ep, vpp=2)
    found = describe(out)
    assert (found.tp, found.pp, found.ep, found.vpp) == (tp, 2, ep, 2), found
    export_and_compare(capsys, out, hf_dir, tmp_path / "hf")


def test_args_win_over_a_manifest_of_another_iteration(capsys, tmp_path, hf_dir, converted):
    """mmparity wrote iteration 1 at PP 2 (its manifest says so); Megatron-LM then trained at
    PP 1 x EP 2 and saved iteration 7 into the same root: its ``mp_rank_00_001`` is expert rank 1."""
    root = tmp_path / "root"
    shutil.copytree(converted(1, 2, 1), root)
    assert json.loads((root / "mmparity.json").read_text())["pipeline_parallel_size"] == 2
    write_as_megatron(converted(1, 1, 2), root, 1, 1, 2)
    assert sorted(p.name for p in (root / "iter_0000007").iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    ckpt = open_legacy(root)
    assert (ckpt.iteration, ckpt.tp_size, ckpt.pp_size, ckpt.ep_size) == (ITERATION, 1, 1, 2)
    # The iteration mmparity wrote is still read with its own sizes.
    first = open_legacy(root, iteration=1)
    assert (first.pp_size, first.ep_size) == (2, 1)
    export_and_compare(capsys, root, hf_dir, tmp_path / "hf")


def test_without_args_a_lone_suffix_is_a_stage(tmp_path, hf_dir, converted):
    """Rank files without ``args`` (and no manifest describing them): Megatron's own reader could
    not tell either; the name is read as a stage, as every Megatron-LM run without experts means."""
    out = tmp_path / "megatron"
    write_as_megatron(converted(1, 2, 1), out, 1, 2, 1)
    for path in out.rglob("model_optim_rng.pt"):
        payload = torch.load(path, weights_only=False)
        del payload["args"]
        torch.save(payload, path)
        assert read_legacy_args(path) is None
    ckpt = open_legacy(out)
    assert (ckpt.pp_size, ckpt.ep_size) == (2, 1)


def test_args_that_contradict_the_names_are_refused_by_name(capsys, tmp_path, hf_dir, converted):
    """Args recording PP 2 x EP 2 over directories with one suffix: neither reading fits, and the
    export says which file records what (exit 2, one line)."""
    out = tmp_path / "megatron"
    write_as_megatron(converted(1, 1, 2), out, 1, 1, 2)
    for path in out.rglob("model_optim_rng.pt"):
        payload = torch.load(path, weights_only=False)
        payload["args"] = argparse.Namespace(**{**vars(payload["args"]), "pipeline_model_parallel_size": 2})
        torch.save(payload, path)
    code, out_text, err = run_cli(capsys, "convert", "--src", out, "--dst", tmp_path / "hf", "--to", "hf",
                                  "--base", hf_dir)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "mp_rank_00_000" in err and "its args record EP 2" in err and "PP 2 x EP 1" in err, err
    assert not (tmp_path / "hf").exists()


def _megatron_lm_checkpointing():
    if sys.version_info < (3, 12):
        return None
    try:
        if importlib.util.find_spec("megatron.training.checkpointing") is None:
            return None
        from megatron.training import checkpointing
    except Exception:  # noqa: BLE001 - not importable here: the restated rule stands alone
        return None
    return checkpointing


@pytest.mark.skipif(_megatron_lm_checkpointing() is None,
                    reason="needs Megatron-LM main's megatron.training on PYTHONPATH (Python >= 3.12)")
@pytest.mark.parametrize("tp, pp, ep", GRIDS)
def test_the_names_are_megatron_lms_own(tp, pp, ep):
    checkpointing = _megatron_lm_checkpointing()
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                path = checkpointing.get_checkpoint_name("root", ITERATION, pipeline_parallel=pp > 1, tensor_rank=t,
                                                         pipeline_rank=p, expert_parallel=ep > 1, expert_rank=e)
                assert Path(path).parent.name == megatron_rank_name(t, p, e, pp, ep)

