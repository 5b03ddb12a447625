"""Every subcommand's ``--help`` is written for a reader at a terminal: it exits 0, shows exactly
one worked example (a command line of that subcommand), and it fits an 80-column terminal and is
never wider than 100 columns, however wide the terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmparity.cli.main import SUBCOMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]
WIDEST = 100


def help_text(*argv, columns: int) -> str:
    env = {**os.environ, "COLUMNS": str(columns),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "mmparity", *argv, "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not proc.stderr, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.parametrize("columns", [80, 300])
@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_help_has_one_example_and_short_lines(command, columns):
    text = help_text(command, columns=columns)
    examples = [line for line in text.splitlines() if line.strip().startswith(f"mmparity {command} ")]
    assert len(examples) == 1, examples
    assert text.count("example") == 1, text
    wide = [line for line in text.splitlines() if len(line) > min(columns, WIDEST)]
    assert not wide, wide


@pytest.mark.parametrize("columns", [80, 300])
def test_top_level_help_lines_are_short(columns):
    text = help_text(columns=columns)
    assert all(f"mmparity {command}" in text for command in ("tiny", "check", "convert", "verify"))
    wide = [line for line in text.splitlines() if len(line) > min(columns, WIDEST)]
    assert not wide, wide


def test_every_option_is_explained():
    """Each subcommand's options carry a help line (argparse's own -h aside)."""
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    bare = [f"{name} {'/'.join(action.option_strings) or action.dest}"
            for name, sub in commands.items() for action in sub._actions if not action.help]
    assert not bare, bare
