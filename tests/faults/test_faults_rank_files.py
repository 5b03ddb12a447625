"""Fault injection: a legacy rank file copied over another.

Rank files of one checkpoint hold the same key names (layers and experts numbered locally), so a
file in the wrong place decodes as a valid rank; where the checkpoint's manifest records the
files, convert tells each file by one tensor that differs from every other file's, and refuses a
file holding another file's recorded bytes, naming both, before writing anything. A tensor changed
in place is data, not a misplaced file: tests/cli/test_convert_cli.py has check --mcore locate one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.faults.test_faults import one_line_error, run_cli

pytestmark = pytest.mark.fault


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from mmparity.cli.main import main

    path = tmp_path_factory.mktemp("hf") / "kimi"
    assert main(["tiny", "kimi_k25_vl", str(path), "--seed", "5"]) == 0
    return path


def _convert(hf: Path, dst: Path, *grid: str) -> Path:
    from mmparity.cli.main import main

    assert main(["convert", "--src", str(hf), "--dst", str(dst), "--to", "mcore", "--format", "legacy",
                 "--quiet", *grid]) == 0
    return dst


@pytest.mark.parametrize("grid, moved, onto", [
    (("--ep", "2"), "mp_rank_00_000", "mp_rank_00_001"),  # an EP rank's experts replaced by another's
    (("--tp", "2", "--pp", "2"), "mp_rank_01_001", "mp_rank_00_001"),  # a TP rank of the last stage
    (("--tp", "2", "--pp", "2"), "mp_rank_00_000", "mp_rank_00_001"),  # one stage over another
])
def test_a_rank_file_in_another_ranks_place_is_refused(hf, tmp_path, capsys, grid, moved, onto):
    ckpt = _convert(hf, tmp_path / "mcore", *grid)
    iteration = ckpt / "iter_0000001"
    shutil.copyfile(iteration / moved / "model_optim_rng.pt", iteration / onto / "model_optim_rng.pt")
    out = tmp_path / "back"
    line = one_line_error(*run_cli(capsys, "convert", "--src", ckpt, "--dst", out, "--to", "hf"),
                          f"{onto}/model_optim_rng.pt", "mmparity verify")
    assert "copied over another" in line and f"holds the tensors of iter_0000001/{moved}/" in line
    assert not out.exists()


def test_the_files_where_they_belong_convert(hf, tmp_path, capsys):
    """The control: the same checkpoint untouched converts back (its tensors bit-exact is the round
    trip tests' business), and swapping two files back where they belong is accepted again."""
    ckpt = _convert(hf, tmp_path / "mcore", "--ep", "2")
    iteration = ckpt / "iter_0000001"
    first, second = (iteration / f"mp_rank_00_00{r}" / "model_optim_rng.pt" for r in (0, 1))
    kept = tmp_path / "kept.pt"
    shutil.copyfile(second, kept)
    shutil.copyfile(first, second)
    code, _, _ = run_cli(capsys, "convert", "--src", ckpt, "--dst", tmp_path / "refused", "--to", "hf")
    assert code == 2
    shutil.copyfile(kept, second)
    code, out, err = run_cli(capsys, "convert", "--src", ckpt, "--dst", tmp_path / "back", "--to", "hf")
    assert code == 0, err
