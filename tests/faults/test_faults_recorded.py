"""Fault injection: what an mcore checkpoint records (its vocabulary divisor, TP, PP, layer split,
side tensors) against ``check --mcore`` and ``verify --load``.

Both build their models from what the checkpoint records, and check the stored shapes against its
HF config first, exactly as ``convert`` does: a record the tensors present cannot back is exit 2
with one line naming the manifest, before anything is allocated from it; a valid checkpoint of
convert's own (LLaVA on a CLIP tower, whose ``ln_post`` is kept in the side file; a vocabulary
padded with another divisor) passes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mmparity.io.fsio.checksums import tensor_checksum
from tests.mapping.test_convert_roundtrips import save_hf
from tests.faults.test_faults import one_line_error, run_cli, run_subprocess
from tests.megatron.test_megatron_load import llava_clip_config

pytestmark = pytest.mark.fault

EMBEDDING = "language_model.embedding.word_embeddings.weight"
# The tiny LLaVA's text vocabulary: 101 rows, padded to 128 by Megatron-LM's default divisor.
VOCAB = 101
# A subprocess under this address-space limit fails an allocation of the sizes a bad record asks
# for (hundreds of GB) at once, instead of taking the shared machine's memory.
MEMORY_LIMIT = 8 * 2**30


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """LLaVA on the CLIP tiny tower (Megatron's LLaVAModel builds CLIP-like towers only)."""
    return save_hf("llava", tmp_path_factory.mktemp("hf") / "llava_clip", seed=3, cfg=llava_clip_config())


@pytest.fixture(scope="module")
def converted(hf, tmp_path_factory):
    """convert's own output, made once per (format, TP, divisor) and copied by each test."""
    root, made = tmp_path_factory.mktemp("mcore"), {}

    def _converted(fmt: str, tp: int = 1, divisor: int | None = None, pp: int = 1) -> Path:
        key = (fmt, tp, divisor, pp)
        if key not in made:
            from mmparity.cli.main import main

            dst = root / f"{fmt}_tp{tp}_pp{pp}_{divisor}"
            argv = ["convert", "--family", "llava", "--src", str(hf), "--dst", str(dst), "--to", "mcore",
                    "--format", fmt, "--tp", str(tp), "--pp", str(pp), "--quiet"]
            if divisor is not None:
                argv += ["--make-vocab-size-divisible-by", str(divisor)]
            assert main(argv) == 0
            made[key] = dst
        return made[key]

    return _converted


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_manifest(directory: Path, edit) -> Path:
    path = directory / "mmparity.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1))
    return path


def rewrite_legacy_tensor(directory: Path, rank_dir: str, key: str, change) -> None:
    """Replace ``key`` in one legacy rank file by ``change(tensor)`` and re-record its checksum in
    the manifest, so that ``verify`` passes and only the shape is wrong."""
    relative = f"iter_0000001/{rank_dir}/model_optim_rng.pt"
    rank_file = directory / relative
    saved = torch.load(rank_file, weights_only=True)
    saved["model"][key] = new = change(saved["model"][key]).clone()
    torch.save(saved, rank_file)

    def rerecord(data):
        records = [r for r in data["tensors"] if r["key"] == key and r["file"] == relative]
        assert len(records) == 1, records
        records[0].update(tensor_checksum(new).to_json())

    edit_manifest(directory, rerecord)


# --------------------------------------------------------------------------------------------------
# 3. convert's own LLaVA-on-CLIP output: ln_post is in the side file, and the native model gets it


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_check_mcore_passes_on_converts_own_llava_with_a_clip_tower(capsys, converted, fmt):
    code, out, err = run_cli(capsys, "check", "--mcore", converted(fmt), "--no-components", "--quiet")
    assert code == 0, out + err
    assert "Traceback" not in out + err


@pytest.mark.slow
def test_check_mcore_passes_on_converts_own_llava_with_a_clip_tower_at_tp2(capsys, converted):
    code, out, err = run_cli(capsys, "check", "--mcore", converted("legacy", tp=2), "--no-components", "--quiet")
    assert code == 0, out + err


# --------------------------------------------------------------------------------------------------
# 4. the recorded vocabulary divisor is what Megatron's class is built with


def test_load_job_builds_with_the_recorded_divisor(converted):
    from mmparity.megatron.load import load_job

    job = load_job(converted("legacy", tp=2, divisor=7))[0]
    assert (job.grid.tp.size, job.grid.pp.size) == (2, 1)
    assert job.build_options == {"divisible_by": 7}


@pytest.mark.slow
def test_verify_load_passes_with_another_vocabulary_divisor(capsys, converted):
    directory = converted("legacy", tp=2, divisor=7)
    code, out, err = run_cli(capsys, "verify", "--load", directory)
    assert code == 0, out + err
    assert "rank 0: ok" in out and "rank 1: ok" in out


# --------------------------------------------------------------------------------------------------
# 5. what a manifest records is bounded by the tensors present


def _divisor(value):
    return lambda data: data["extra"].__setitem__("make_vocab_size_divisible_by", value)


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
@pytest.mark.slow  # several seconds: the full suite runs it, the quick loops skip it
def test_an_implausible_recorded_divisor_is_refused_before_allocating(converted, tmp_path, fmt):
    directory = copy_of(converted(fmt), tmp_path / "ckpt")
    manifest = edit_manifest(directory, _divisor(1_000_000_000))
    needles = (manifest, "vocabulary divisor 1000000000 is not plausible", f"pads {VOCAB} rows", "(stored: 128)")
    for argv in (["check", "--mcore", directory, "--tp", 2, "--no-components"],
                 ["convert", "--src", directory, "--dst", tmp_path / "out", "--to", "mcore",
                  "--format", "legacy", "--tp", 2],
                 ["verify", "--load", directory]):
        code, out, err = run_subprocess(*argv, memory_limit=MEMORY_LIMIT)
        one_line_error(code, out, err, *needles)
    assert not (tmp_path / "out").exists()


def test_a_divisor_that_does_not_give_the_stored_rows_is_refused(capsys, converted, tmp_path):
    """A divisor that stays small but is not the one the table was padded with (128 rows stored, 7
    gives 105) is as wrong as a huge one."""
    directory = copy_of(converted("legacy"), tmp_path / "ckpt")
    manifest = edit_manifest(directory, _divisor(7))
    code, out, err = run_cli(capsys, "check", "--mcore", directory, "--no-components")
    one_line_error(code, out, err, manifest, "divisor 7 is not plausible", f"pads {VOCAB} rows to 105",
                   "(stored: 128)")


def test_a_recorded_tp_that_is_not_the_rank_directories_is_refused(capsys, converted, tmp_path):
    directory = copy_of(converted("legacy", tp=2), tmp_path / "ckpt")
    manifest = edit_manifest(directory, lambda data: data.__setitem__("tensor_parallel_size", 64))
    for argv in (["check", "--mcore", directory, "--no-components"], ["verify", "--load", directory]):
        code, out, err = run_cli(capsys, *argv)
        one_line_error(code, out, err, manifest, "TP 64", "2 TP rank")


def test_a_recorded_torch_dist_tp_the_model_cannot_take_is_refused(capsys, converted, tmp_path):
    """torch_dist holds global tensors; the TP it records is what verify --load spawns by default,
    so it must fit the model (the heads divide) like any --tp."""
    directory = copy_of(converted("torch_dist"), tmp_path / "ckpt")
    manifest = edit_manifest(directory, lambda data: data.__setitem__("tensor_parallel_size", 1000))
    code, out, err = run_cli(capsys, "verify", "--load", directory)
    one_line_error(code, out, err, manifest, "TP 1000")


@pytest.mark.parametrize("counts, pp", [([1000, 1], 2), ([1], 2), ([1, 1], 3)])
def test_recorded_pipeline_layer_counts_are_bounded_by_the_config(capsys, converted, tmp_path, counts, pp):
    directory = copy_of(converted("legacy", pp=2), tmp_path / "ckpt")

    def edit(data):
        data["pipeline_layer_counts"] = counts
        data["pipeline_parallel_size"] = pp

    manifest = edit_manifest(directory, edit)
    for argv in (["check", "--mcore", directory, "--no-components"], ["verify", "--load", directory]):
        code, out, err = run_cli(capsys, *argv)
        one_line_error(code, out, err, manifest)


# --------------------------------------------------------------------------------------------------
# 7. shapes are checked against the HF config first, as convert checks them


def test_a_cut_vocabulary_is_a_shape_mismatch_everywhere(capsys, converted, tmp_path):
    directory = copy_of(converted("legacy"), tmp_path / "ckpt")
    rewrite_legacy_tensor(directory, "mp_rank_00", EMBEDDING, lambda t: t[:100])
    code, out, err = run_cli(capsys, "verify", directory)
    assert code == 0, out + err  # the checksums agree: only the shape is wrong
    for argv in (["convert", "--src", directory, "--dst", tmp_path / "out", "--to", "hf"],
                 ["check", "--mcore", directory, "--no-components"],
                 ["verify", "--load", directory]):
        code, out, err = run_cli(capsys, *argv)
        one_line_error(code, out, err, "shape mismatch with its HF config", EMBEDDING, "[100, 40]")


def test_a_mis_shaped_tower_tensor_is_a_shape_mismatch_before_any_load(capsys, converted, tmp_path):
    directory = copy_of(converted("legacy"), tmp_path / "ckpt")
    key = "vision_model.decoder.layers.0.self_attention.linear_proj.weight"
    rewrite_legacy_tensor(directory, "mp_rank_00", key, lambda t: t[:, :-1])
    for argv in (["check", "--mcore", directory, "--no-components"], ["verify", "--load", directory]):
        code, out, err = run_cli(capsys, *argv)
        one_line_error(code, out, err, "shape mismatch with its HF config", key)
