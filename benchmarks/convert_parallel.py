"""Benchmark: `mmparity convert` on 1 and 2 processes, and as two torchrun "nodes" on localhost,
against a plain copy of the same bytes (not a test).

The source is a synthetic many-expert checkpoint (`synthetic_moe_checkpoint.py`: a scaled
Kimi-K2.5 release, HF shards with an index, default 8 GB). Every job runs as a user runs it, the
command line in a fresh child (`python -m mmparity convert ...`, with `--workers 2`, or two
`torchrun --nnodes 2 --nproc-per-node 1` agents meeting on 127.0.0.1), from warm source bytes,
and with `--paired` right after a plain copy (`convert_throughput`'s fsynced copy job) made in
the same state of the disk. Two times per run:

* `command s`: the whole command, interpreter start-up, imports and rendezvous included (what a
  user waits for);
* `convert s`: what rank 0 reports (its `convert()`, from opening the source to publishing, which
  includes waiting for the other ranks).

Ratios are to the copy run just before (best of `--repeat`). Nothing here asserts; numbers go to
benchmarks/RESULTS.md.

Usage: python benchmarks/convert_parallel.py [--workdir DIR] [--size 8GB] [--scale 4] [--repeat 2]
       [--settle 3] [--paired] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import convert_throughput as bench  # noqa: E402  (copy job, warm-up, settle, RssAnon sampler)

REPO = Path(__file__).resolve().parents[1]
_REPORTED = re.compile(r" in ([0-9.]+)s \(")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _convert(argv: list[str], nodes: int = 0) -> dict:
    """One run of the command: `nodes` > 0 starts that many torchrun agents of one rank each."""
    if nodes:
        from mmparity.parallel.runtime import free_port

        port = free_port()
        commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", "1",
                     "--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port", str(port),
                     "-m", "mmparity", *argv] for n in range(nodes)]
    else:
        commands = [[sys.executable, "-m", "mmparity", *argv]]
    started = time.perf_counter()
    procs = [subprocess.Popen(c, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    outputs = [p.communicate() for p in procs]
    seconds = time.perf_counter() - started
    for proc, (out, err) in zip(procs, outputs):
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{err[-3000:]}")
    reported = [float(m.group(1)) for out, _ in outputs for m in [_REPORTED.search(out)] if m]
    return {"seconds": seconds, "reported": reported[0] if reported else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--size", default="8GB")
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--settle", type=float, default=3.0)
    parser.add_argument("--paired", action="store_true")
    parser.add_argument("--keep", action="store_true",
                        help="keep what the jobs wrote (the source in a --workdir is kept either way)")
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="mmparity-parallel-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"hf-{args.size}"
    outputs: list[Path] = []  # what the jobs write, removed at the end unless --keep
    try:
        if not src.exists():
            print(f"writing the synthetic {args.size} source ...", file=sys.stderr)
            subprocess.run([sys.executable, str(Path(__file__).with_name("synthetic_moe_checkpoint.py")), str(src),
                            "--size", args.size, "--scale", str(args.scale)], check=True, env=_env(),
                           stdout=subprocess.DEVNULL)
        source_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        dist = work / "dist"
        jobs = [
            ("hf -> torch_dist, 1 process", src, dist, ["--to", "mcore"], 0),
            ("hf -> torch_dist, --workers 2", src, work / "dist_w2", ["--to", "mcore", "--workers", "2"], 0),
            ("hf -> torch_dist, 2 torchrun nodes x 1", src, work / "dist_n2", ["--to", "mcore"], 2),
            # 2GB shards (the HF default is 5GB) so that 8 GB has units to share.
            ("torch_dist -> hf, 1 process", dist, work / "back", ["--to", "hf", "--hf-format", "release",
                                                                  "--max-shard-size", "2GB"], 0),
            ("torch_dist -> hf, --workers 2", dist, work / "back_w2",
             ["--to", "hf", "--hf-format", "release", "--max-shard-size", "2GB", "--workers", "2"], 0),
        ]
        outputs = [job_dst for _, _, job_dst, _, _ in jobs] + [work / "copy_pair"]
        runs: dict[str, list[dict]] = {label: [] for label, *_ in jobs}
        for attempt in range(max(1, args.repeat)):
            print(f"round {attempt + 1} of {max(1, args.repeat)} ...", file=sys.stderr)
            for label, job_src, job_dst, argv, nodes in jobs:
                if job_dst.exists():
                    shutil.rmtree(job_dst)
                copy = None
                if args.paired:
                    bench._warm(src)
                    bench._settle(args.settle)
                    copy = bench._measure("copy", src, work / "copy_pair")["seconds"]
                    shutil.rmtree(work / "copy_pair")
                bench._warm(job_src)
                bench._settle(args.settle)
                result = _convert(["convert", "--src", str(job_src), "--dst", str(job_dst), *argv], nodes)
                result["copy"] = copy
                runs[label].append(result)
                print(f"  {label}: {json.dumps(result)}", file=sys.stderr)
                if job_dst != dist:
                    same = None
                    if job_dst.name.startswith("dist_"):
                        same = bench_same_tree(dist, job_dst)
                    elif job_dst.name == "back_w2":
                        same = bench_same_tree(work / "back", job_dst)
                    if same is False:
                        raise SystemExit(f"{label}: output differs from the one-process output")
                    if job_dst.name != "back":
                        shutil.rmtree(job_dst)
        print(f"\nSynthetic Kimi-K2.5-style checkpoint, {source_bytes / 1e9:.2f} GB (bf16, scale 1/{args.scale}), "
              f"{os.cpu_count()} CPUs; multi-process outputs byte-identical to the one-process output\n")
        print("| job | command s (runs) | convert s | GB/s (command) | command x the copy just before (runs) "
              "| convert x the copy just before |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for label, *_ in jobs:
            rs = runs[label]
            best = min(rs, key=lambda r: r["seconds"])
            ratios = [r["seconds"] / r["copy"] for r in rs if r["copy"]]
            reported = [r["reported"] / r["copy"] for r in rs if r["copy"] and r["reported"]]
            listed = ", ".join(f"{r['seconds']:.2f}" for r in rs)
            print(f"| {label} | {best['seconds']:.2f} ({listed}) | "
                  f"{min(r['reported'] or float('nan') for r in rs):.1f} | {source_bytes / best['seconds'] / 1e9:.2f} | "
                  + (f"{min(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)}) | {min(reported):.2f} |"
                     if ratios else "- | - |"))
        copies = [r["copy"] for rs in runs.values() for r in rs if r["copy"]]
        if copies:
            print(f"\nplain copy (fsynced): {min(copies):.2f} s best, {max(copies):.2f} s worst "
                  f"({source_bytes / min(copies) / 1e9:.2f} GB/s best)")
    finally:
        if not args.keep:
            _clean(work, args.workdir is None, outputs)


def _clean(work: Path, temporary: bool, outputs: list[Path]) -> None:
    """A temporary work directory goes whole; in a ``--workdir`` the source stays for the next run
    (it is made only when missing) and what the jobs wrote goes: three 8 GB trees per run of the benchmark
    otherwise pile up there."""
    if temporary:
        shutil.rmtree(work, ignore_errors=True)
        return
    for path in outputs:
        shutil.rmtree(path, ignore_errors=True)


def bench_same_tree(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    if files != sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()):
        return False
    for rel in files:
        with open(a / rel, "rb") as x, open(b / rel, "rb") as y:
            while True:
                chunk = x.read(64 << 20)
                if chunk != y.read(64 << 20):
                    return False
                if not chunk:
                    break
    return True


if __name__ == "__main__":
    main()
