"""Fault injection: numbers that make no sense, blame put on the wrong file, and what is written
against what is checked.

Each class: a number a checkpoint or a config states (a NaN ``checkpoint_version``, a NaN or absurd
``params.json`` field, a ``config.json`` beside ``params.json`` that says otherwise, a vocabulary
divisor that pads a table to hundreds of GB, a side file that declares a 12 GiB tensor), a
non-floating target dtype of the live export, a ``--base`` tensor of the wrong shape, expert
problems, ±Inf weights through ``--requantize``, a ``--dtype`` cast that overflows under
``--check-finite``, a divisor a checkpoint records for ``--impl megatron``, NaN metrics in a
``--json`` report. The contract is tests/test_faults.py's: the command gives a correct result, or
exits 2 with one stderr line naming the file (or flag, or argument) and the fix, never a
traceback, never numeric nonsense published.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch

from mmparity.cli.main import main

try:  # the first fault suite's helpers and its `sources` fixture (pixtral in every format)
    from tests.test_faults import copy_tree, one_line_error, run_cli, run_subprocess, sources  # noqa: F401
except ImportError:  # pragma: no cover - rootdir-less import mode
    from test_faults import copy_tree, one_line_error, run_cli, run_subprocess, sources  # noqa: F401

pytestmark = pytest.mark.fault

RANK_FILE = "iter_0000001/mp_rank_00/model_optim_rng.pt"


def _resave_rank_file(path: Path, edit) -> None:
    """A rank file of mmparity's own (plain tensors), loaded, edited and saved again."""
    payload = torch.load(path, weights_only=True)
    edit(payload)
    torch.save(payload, path)


# --------------------------------------------------------------------------------------------------
# 1. a legacy rank file's checkpoint_version that is no version


@pytest.mark.parametrize("version", [math.nan, math.inf, -math.inf, -3.0, 0.5, 1e300, 4.0, True, "3.0", None])
def test_checkpoint_version_that_is_no_version_is_refused(capsys, sources, tmp_path, version):
    src = copy_tree(sources["legacy"], tmp_path / "src")
    _resave_rank_file(src / RANK_FILE, lambda p: p.__setitem__("checkpoint_version", version))
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / "hf", "--to", "hf", "--quiet")
    one_line_error(code, out, err, RANK_FILE.split("/")[-1], "checkpoint_version")
    assert not (tmp_path / "hf").exists()
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / "tp", "--to", "mcore", "--quiet")
    one_line_error(code, out, err, "checkpoint_version")
    # verify lists the damage (exit 1), no traceback.
    code, out, err = run_cli(capsys, "verify", src)
    assert code == 1 and "checkpoint_version" in out and "Traceback" not in out + err, (code, out, err)


@pytest.mark.parametrize("version", [3, 3.0, 3.5])
def test_checkpoint_version_of_the_current_layout_converts(capsys, sources, tmp_path, version):
    src = copy_tree(sources["legacy"], tmp_path / "src")
    _resave_rank_file(src / RANK_FILE, lambda p: p.__setitem__("checkpoint_version", version))
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / "hf", "--to", "hf", "--quiet")
    assert code == 0, err
