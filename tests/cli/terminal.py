"""The real CLI on a pseudo-terminal, as a user's shell runs it; and a tiny Mistral3 whose HF copy
has one weight perturbed (what the terminal tests check)."""

from __future__ import annotations

import errno
import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def cli_env(columns: int | None) -> dict:
    """This checkout first on PYTHONPATH (ranks inherit it); COLUMNS set to ``columns`` or unset
    (rich then asks the terminal)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    env.pop("COLUMNS", None)
    if columns is not None:
        env.update(COLUMNS=str(columns), LINES="60")
    return env


def run_on_pty(argv, columns: int, stdout_on_pty: bool, timeout: int) -> tuple[int, str, str]:
    """``python -m mmparity ARGV`` with stderr (and stdout, when ``stdout_on_pty``) on a
    pseudo-terminal ``columns`` wide: (exit code, stdout when piped, the terminal's bytes decoded)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "mmparity", *map(str, argv)], cwd=ROOT,
                            env=cli_env(columns if stdout_on_pty else None),
                            stdin=slave if stdout_on_pty else subprocess.DEVNULL,
                            stdout=slave if stdout_on_pty else subprocess.PIPE, stderr=slave, close_fds=True)
    os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError as exc:  # the child closed its end
                if exc.errno != errno.EIO:
                    raise
                break
            if not data:
                break
            chunks.append(data)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, (out or b"").decode(), b"".join(chunks).decode("utf-8", "replace")


def run_in_pty(*argv, columns: int = 80, timeout: int = 600) -> tuple[int, str]:
    """``python -m mmparity ARGV`` on a pseudo-terminal ``columns`` wide: (exit code, what the
    terminal showed, escapes stripped)."""
    code, _out, raw = run_on_pty(argv, columns, True, timeout)
    text = ANSI.sub("", raw).replace("\r\n", "\n")
    # A line redrawn in place (the progress line: carriage return, then erase to its end) shows
    # what was drawn last.
    return code, "\n".join(line.rpartition("\r")[2] for line in text.split("\n"))


def widest(text: str) -> int:
    return max(len(line.rstrip()) for line in text.splitlines())


def perturbed_mistral3(root: Path, key: str, seed: int, noise_seed: int) -> tuple[Path, Path]:
    """(mcore checkpoint converted from a tiny Mistral3, an HF copy with ``key`` perturbed): the
    native model runs the untouched conversion, the reference the perturbed copy."""
    from safetensors.torch import load_file, save_file

    from mmparity.cli.main import main

    hf, mcore, perturbed = root / "hf", root / "mcore", root / "perturbed"
    assert main(["tiny", "mistral3", str(hf), "--seed", str(seed)]) == 0
    assert main(["convert", "--src", str(hf), "--dst", str(mcore), "--to", "mcore", "--format", "legacy",
                 "--quiet"]) == 0
    perturbed.mkdir()
    for name in os.listdir(hf):
        (perturbed / name).write_bytes((hf / name).read_bytes())
    state = load_file(hf / "model.safetensors")
    noise = torch.randn(state[key].shape, generator=torch.Generator().manual_seed(noise_seed), dtype=state[key].dtype)
    state[key] = state[key] + 0.05 * noise
    save_file(state, perturbed / "model.safetensors", metadata={"format": "pt"})
    return mcore, perturbed
