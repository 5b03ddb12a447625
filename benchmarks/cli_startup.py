"""CPU time of the small commands, start-up included, as ratios against what they cannot avoid
(not a test: nothing is asserted; it prints a markdown table).

    python benchmarks/cli_startup.py [--repeat 5]

Every figure is the user + system CPU seconds of one fresh interpreter, read with ``getrusage``
in that interpreter after the command returned, so interpreter start-up and every import count.
Each job runs ``--repeat`` times and the least is kept: a shared machine's noise only ever adds
CPU time. ``--help`` and ``list`` are divided by a bare interpreter (``python -c pass``); a
convert of a tiny checkpoint (``mmparity tiny``'s, or the mcore checkpoint converted from it) is
divided by an interpreter that only imports torch, which is most of what a convert costs.
What each command may import is asserted by tests/cli/test_imports.py; this measures what it costs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# One interpreter: run the statement (or mmparity with the arguments), print its own CPU seconds.
DRIVER = """
import resource, sys
if sys.argv[1] == "--cli":
    from mmparity.cli.main import main
    try:
        main(sys.argv[2:])
    except SystemExit:  # --help leaves through argparse
        pass
else:
    exec(sys.argv[1])
usage = resource.getrusage(resource.RUSAGE_SELF)
print("CPU", usage.ru_utime + usage.ru_stime)
"""

FAMILIES = ("clip", "llava", "mistral3")


def cpu_seconds(*argv, cwd: Path) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", DRIVER, *map(str, argv)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{argv}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("CPU ")][-1]
    return float(line.split()[1])


def least(repeat: int, *argv, cwd: Path, before=None) -> float:
    runs = []
    for _ in range(repeat):
        if before is not None:
            before()
        runs.append(cpu_seconds(*argv, cwd=cwd))
    return min(runs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per job; the least is kept (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        bare = least(args.repeat, "pass", cwd=work)
        torch_only = least(args.repeat, "import torch", cwd=work)
        for argv in (["--help"], ["list"], ["list", "--json"], ["convert", "--help"]):
            rows.append(("mmparity " + " ".join(argv), least(args.repeat, "--cli", *argv, cwd=work),
                         "bare interpreter", bare))
        for family in FAMILIES:
            hf = work / f"{family}_hf"
            cpu_seconds("--cli", "tiny", family, hf, cwd=work)
            for fmt in ("legacy", "torch_dist"):
                mcore = work / f"{family}_{fmt}"
                out = work / "out"

                def clear(out=out):
                    shutil.rmtree(out, ignore_errors=True)

                rows.append((f"convert {family} hf -> {fmt}",
                             least(args.repeat, "--cli", "convert", "--src", hf, "--dst", out, "--to", "mcore",
                                   "--format", fmt, "--quiet", cwd=work, before=clear),
                             "import torch", torch_only))
                cpu_seconds("--cli", "convert", "--src", hf, "--dst", mcore, "--to", "mcore", "--format", fmt,
                            "--quiet", cwd=work)
                rows.append((f"convert {family} {fmt} -> hf",
                             least(args.repeat, "--cli", "convert", "--src", mcore, "--dst", out, "--to", "hf",
                                   "--quiet", cwd=work, before=clear),
                             "import torch", torch_only))

    print(f"bare interpreter: {bare:.3f} CPU-s; import torch: {torch_only:.3f} CPU-s (least of {args.repeat})")
    print()
    print("| command | CPU-s | against | x |")
    print("| --- | ---: | --- | ---: |")
    for name, cpu, against, base in rows:
        print(f"| {name} | {cpu:.3f} | {against} | {cpu / base:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"bare": bare, "import_torch": torch_only,
             "rows": [{"command": n, "cpu": c, "against": a, "ratio": c / b} for n, c, a, b in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
