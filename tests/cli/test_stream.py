"""What a person sees on stderr while a command works: a progress line on a terminal (never in a
pipe, nor with --quiet), and no import chatter repeated by spawned ranks."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from mmparity import progress
from mmparity.cli.common import ProgressLine
from mmparity.cli.main import main
from tests.cli import terminal as pty_cli

ROOT = Path(__file__).resolve().parents[2]
FAMILY = "clip"  # the cheapest family to run


def _env() -> dict:
    return pty_cli.cli_env(None)


def run_stderr_on_a_terminal(*argv, columns: int = 100, timeout: int = 600) -> tuple[int, str, str]:
    """``python -m mmparity ARGV`` with stderr on a pseudo-terminal and stdout a pipe: (exit code,
    stdout, everything written to the terminal, raw)."""
    return pty_cli.run_on_pty(argv, columns, False, timeout)


def run_piped(*argv, timeout: int = 600) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "mmparity", *map(str, argv)], cwd=ROOT, env=_env(),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def drawn_lines(terminal: str) -> list[str]:
    """Each state of the progress line, in order (its redraws are carriage returns)."""
    return [part.replace("\x1b[K", "") for part in terminal.split("\r") if part.replace("\x1b[K", "").strip()]


class _Terminal(io.StringIO):
    def __init__(self, columns: int):
        super().__init__()
        self.columns = columns

    def fileno(self):
        raise io.UnsupportedOperation  # no real terminal: the line falls back to 80 columns


def test_the_line_shows_this_process_and_each_rank_and_leaves_no_trace():
    stream = _Terminal(80)
    line = ProgressLine(stream)
    with progress.listen(line):
        line.start("check llava (2/3)")
        progress.step("native")
        progress.step("1/4", "rank 10")
        progress.step("2/4", "rank 1")
        progress.step("3/4", "rank 0")
        # Ranks in their order (10 after 1), each with its own step.
        assert drawn_lines(stream.getvalue())[-1] == ("check llava (2/3): native [rank 0: 3/4; "
                                                      "rank 1: 2/4; rank 10: 1/4]")
        progress.step("native case 3/4 packed-mixed-sizes-of-a-long-name", "rank 10")
        drawn = drawn_lines(stream.getvalue())[-1]  # cut to the width: a wrapped line is not redrawn in place
        assert len(drawn) == 79 and drawn.endswith("…"), drawn
        progress.step("case 1/4 images-3: reference")  # the ranks are done: their steps go
        assert drawn_lines(stream.getvalue())[-1] == "check llava (2/3): case 1/4 images-3: reference"
        line.clear()
    assert stream.getvalue().endswith("\r\x1b[K") and not progress.listening()
    progress.step("nobody listens")  # a no-op


def test_check_shows_progress_on_a_terminal_only(tmp_path):
    code, out, terminal = run_stderr_on_a_terminal("check", FAMILY, "--no-components")
    assert code == 0, terminal
    drawn = drawn_lines(terminal)
    assert f"check {FAMILY}: native case 1/" in terminal and f"check {FAMILY}: case 1/" in terminal, drawn
    assert all(len(state) < 100 for state in drawn), drawn
    assert terminal.endswith("\r\x1b[K")  # cleared before the report, which is on stdout
    assert "passed" in out and "\r" not in out
    # --quiet: the summary alone, and nothing drawn.
    code, out, terminal = run_stderr_on_a_terminal("check", FAMILY, "--no-components", "--quiet")
    assert code == 0 and terminal == "", terminal
    # Piped (a log, CI): nothing but the report.
    code, out, err = run_piped("check", FAMILY, "--no-components")
    assert code == 0 and err == "", err


def test_bench_shows_progress_on_a_terminal_only():
    argv = ("bench", FAMILY, "--repeats", "1", "--warmup", "0", "--no-parity")
    code, out, terminal = run_stderr_on_a_terminal(*argv)
    assert code == 0, terminal
    assert f"bench {FAMILY} (tiny, cpu, float32): case " in terminal and "timing native" in terminal, terminal
    assert terminal.endswith("\r\x1b[K")
    code, out, terminal = run_stderr_on_a_terminal(*argv, "--quiet")
    assert code == 0 and terminal == "", terminal


@pytest.fixture(scope="module")
def legacy_tp2(tmp_path_factory):
    base = tmp_path_factory.mktemp("stream")
    assert main(["tiny", FAMILY, str(base / "hf")]) == 0
    assert main(["convert", "--quiet", "--src", str(base / "hf"), "--dst", str(base / "legacy"), "--to", "mcore",
                 "--format", "legacy", "--tp", "2"]) == 0
    return base / "legacy"


@pytest.mark.slow  # spawns ranks
def test_verify_load_shows_each_rank_on_a_terminal_and_nothing_piped(legacy_tp2):
    code, out, terminal = run_stderr_on_a_terminal("verify", "--load", legacy_tp2, columns=250)
    assert code == 0, terminal
    drawn = drawn_lines(terminal)
    assert any("[rank 0: " in state and "; rank 1: " in state for state in drawn), drawn
    assert any("loading it strictly" in state for state in drawn), drawn
    assert "all ranks load" in out
    # Piped: the report alone; the ranks' megatron-core import warnings are not repeated.
    code, out, err = run_piped("verify", "--load", legacy_tp2)
    assert code == 0 and err.splitlines() == [], err
    code, out, terminal = run_stderr_on_a_terminal("verify", "--load", legacy_tp2, "--quiet")
    assert code == 0 and terminal == "" and out == "", (out, terminal)


@pytest.mark.slow  # spawns ranks
def test_spawned_ranks_do_not_repeat_import_warnings():
    """megatron-core warns at import that Transformer Engine and Apex are missing (and logs from
    torch's cpp_extension): each spawned rank imports it afresh, and must be as quiet as the parent."""
    code, out, err = run_piped("check", FAMILY, "--tp", "2", "--no-components")
    assert code == 0, err
    assert err.splitlines() == [], err  # not one line: no warning, no progress into a pipe
    assert "passed" in out and "Apex" not in out


def test_torch_dist_says_its_tensors_are_global_where_tp_and_pp_were_asked(tmp_path, capsys):
    """torch_dist holds global tensors: convert --tp/--pp says so in one line, verify says so in
    place of the sizes recorded (which would read as flags lost), and the manifest in a field."""
    import json

    hf = tmp_path / "hf"
    assert main(["tiny", "llava", str(hf)]) == 0
    runs = {"torch_dist": ["--tp", "2", "--pp", "2"], "legacy": ["--tp", "2"]}
    for fmt, sizes in runs.items():
        capsys.readouterr()
        assert main(["convert", "--src", str(hf), "--dst", str(tmp_path / fmt), "--to", "mcore", "--format", fmt,
                     *sizes]) == 0
        said = [line for line in capsys.readouterr().out.splitlines() if "global tensors" in line]
        assert said == (["llava: torch_dist stores global tensors, not --tp 2 --pp 2 slices: Megatron-LM loads it "
                         "at any TP/PP"] if fmt == "torch_dist" else []), said
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "torch_dist"), str(tmp_path / "legacy")]) == 0
    out = capsys.readouterr().out.splitlines()
    # (A LLaVA on the tiny Pixtral tower: no Megatron class holds the whole, and verify names none.)
    assert out[0].startswith(f"{tmp_path / 'torch_dist'} (mcore_torch_dist global (loads at any TP/PP)): "), out
    assert "tp=" not in out[0] and out[1].startswith(f"{tmp_path / 'legacy'} (mcore_legacy tp=2 pp=1 ep=1): "), out
    for fmt, stored in (("torch_dist", "global"), ("legacy", "per_rank")):
        manifest = json.loads((tmp_path / fmt / "mmparity.json").read_text())
        # The sizes' keys stay as they were; the new field says what they bind.
        assert manifest["tensors_stored"] == stored and "tensor_parallel_size" in manifest, manifest
