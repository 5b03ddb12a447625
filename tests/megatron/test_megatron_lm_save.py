"""Local only: Megatron-LM main's own ``save_checkpoint`` (not in CI), exported back to HF with
``--base``, bit-exact (``tests/megatron_lm_save.py`` does the work in a fresh process, with
Megatron-LM first on its path). Set ``MEGATRON_LM`` to a Megatron-LM checkout to run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MEGATRON_LM = os.environ.get("MEGATRON_LM")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_megatron_lm_save_checkpoint_exports_bit_exact(tmp_path, fmt):
    if not MEGATRON_LM or not (Path(MEGATRON_LM) / "megatron" / "training" / "checkpointing.py").is_file():
        pytest.skip("needs a Megatron-LM checkout: set MEGATRON_LM (not in CI)")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), MEGATRON_LM])}
    done = subprocess.run([sys.executable, str(repo / "tests" / "megatron_lm_save.py"), fmt, str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode == 77:
        pytest.skip(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"MEASURED {fmt}" in done.stdout
