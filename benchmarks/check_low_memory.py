"""``check --low-memory`` on a model whose weights are several times the address space the process
may use at all (not a test: nothing is asserted; it prints a markdown table).

1. A tiny ``kimi_k25_vl`` checkpoint is checked ``--low-memory`` in a child with no limit; that
   child's VmPeak (Python, torch, transformers, Megatron-Core imported, one tiny check run) is the
   baseline. The limit is the baseline plus ``--headroom``, and it is the whole address space:
   ``RLIMIT_AS`` is set in the child before ``exec`` (``preexec_fn``), so the interpreter's start
   and every import run under it too.
2. A synthetic whole Kimi-K2.5 (``kimi_k25_vl``: the DeepSeek-V3 decoder with MLA attention, one
   dense layer, then MoE layers with a shared expert and stacked routed experts, and the tiny
   MoonViT tower and projector) is written in the reference's own HF layout (what ``check --hf``
   loads without conversion, stacked ``mlp.experts.gate_up_proj`` / ``down_proj``), tensor by
   tensor through mmparity's ``StreamingSafetensorsWriter``, never the whole model in memory. It
   has as many MoE layers as make ``--size`` bytes (default: ``--ratio`` times the limit).
   Values are a seeded pool of N(0, 1) values read cyclically from an offset each tensor's name
   picks, at trained-network scale (matrices / sqrt(fan-in), each expert's own for stacked
   experts; norm weights 1 + 0.2 x, vectors 0.1 x).
3. ``python -m mmparity check kimi_k25_vl --hf BIG --low-memory --json OUT`` runs in a child under
   the limit; then the in-memory check under the same limit (expected: it fails, exit 2); then,
   with ``--negative-control``, the same CLI check again under the limit with one routed
   expert's converted mcore ``linear_fc2`` weight of one MoE layer scaled by 1.5 on the native
   side only (``low_memory.check(mutate_native=…)``; scaling it in the file would change both
   sides alike): it should fail, with its first divergence in that layer.

VmPeak and peak RSS (VmHWM) are read from ``/proc/<pid>/status`` every 20 ms while the child
runs (the last values read: both only grow, so they miss at most the child's last 20 ms; VmPeak
cannot exceed the limit). The children run with ``OMP_NUM_THREADS=1`` and ``MALLOC_ARENA_MAX=1``
(fewer thread stacks and malloc arenas: a lower baseline), and ``--quiet``. The default headroom,
224 MiB, is what the default model's check was measured to need above the baseline (189 MiB at
``--expert-group 8``) plus a margin; a wider, deeper or bfloat16 model may need more.
``kimi_k25_vl`` has no component checks, so ``--no-components`` changes nothing for it.

Usage: python benchmarks/check_low_memory.py [--dir SCRATCH] [--size 5GB] [--ratio 3]
       [--headroom 224MiB] [--negative-control] [--no-components] [--keep]
(the measured run: ``--negative-control``, about two minutes on 2 cores; benchmarks/RESULTS.md)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB, GiB = 2**20, 2**30
FAMILY = "kimi_k25_vl"
# The widths of the big model's decoder: each MoE layer's routed experts are 16 x 3 x 1024 x 1024
# float32 values (192 MiB), its shared expert 12 MiB, its MLA attention under 1 MiB.
BIG_TEXT = dict(hidden_size=1024, moe_intermediate_size=1024, intermediate_size=1024, n_routed_experts=16,
                n_group=4, topk_group=2, num_experts_per_tok=4)


def big_config(layers: int):
    from mmparity.models.kimi_k25_vl.reference import tiny_config

    return tiny_config(num_hidden_layers=layers, **BIG_TEXT)


def nbytes(cfg, dtype) -> int:
    from mmparity.models.kimi_k25_vl.reference import state_shapes

    return sum(math.prod(s) for s in state_shapes(cfg).values()) * dtype.itemsize


def layers_for(size: int, dtype) -> int:
    """The decoder depth (at least 2) whose checkpoint is the first at least ``size`` bytes."""
    two, three = nbytes(big_config(2), dtype), nbytes(big_config(3), dtype)
    return max(2, 2 + math.ceil((size - two) / (three - two)))


def _values(pool, name: str, shape):
    """Deterministic values for tensor ``name`` at trained-network scale (``random_like_state``'s)."""
    import torch

    count, start = math.prod(shape), zlib.crc32(name.encode()) % pool.numel()
    parts, left = [], count
    while left:
        take = min(left, pool.numel() - start)
        parts.append(pool[start:start + take])
        left, start = left - take, 0
    value = (parts[0].clone() if len(parts) == 1 else torch.cat(parts)).view(shape)
    if len(shape) >= 2:  # a stacked experts tensor [experts, out, in] is one matrix per expert
        fan_in = shape[-1] if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) else math.prod(shape[1:])
        return value.div_(fan_in ** 0.5)
    if "norm" in name and name.endswith("weight"):
        return value.mul_(0.2).add_(1.0)
    return value.mul_(0.1)


def write(out: Path, cfg, dtype, seed: int, max_shard_size: str) -> int:
    import torch

    from mmparity.io.fsio.publish import atomic_directory
    from mmparity.io.fsio.safetensors_write import StreamingSafetensorsWriter
    from mmparity.models.kimi_k25_vl.reference import state_shapes

    shapes = state_shapes(cfg)
    names = list(shapes)
    pool = torch.randn(1 << 22, generator=torch.Generator().manual_seed(seed))
    with atomic_directory(out) as staging:
        writer = StreamingSafetensorsWriter(staging, [(k, dtype, shapes[k]) for k in names],
                                            max_shard_size=max_shard_size)
        try:
            for name in names:  # one tensor in memory at a time
                writer.write(name, _values(pool, name, shapes[name]).to(dtype))
            writer.close()
        finally:
            writer.abort()
        (staging / "config.json").write_text(cfg.to_json_string())
    return sum(math.prod(s) for s in shapes.values()) * dtype.itemsize


def _status(pid: int) -> dict:
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmPeak", "VmHWM", "VmSize"):
                    fields[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return fields


def child(argv: list, limit: int | None, perturb: tuple | None = None) -> dict:
    """Run ``python -m mmparity`` with ``argv`` under ``RLIMIT_AS = limit`` (None: none); with
    ``perturb`` (mcore key, factor), the same CLI with that native tensor scaled."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1"}

    def cap():
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    started = time.perf_counter()
    head = ["-m", "mmparity"] if perturb is None else ["-c", _PERTURBED, perturb[0], str(perturb[1])]
    proc = subprocess.Popen([sys.executable, *head, *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, preexec_fn=cap)
    seen: dict = {}
    done = threading.Event()

    def watch():
        while not done.is_set():
            now = _status(proc.pid)
            for key, value in now.items():
                seen[key] = max(seen.get(key, 0), value)
            done.wait(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, err = proc.communicate()
    done.set()
    watcher.join()
    seconds = time.perf_counter() - started
    return {"code": proc.returncode, "seconds": seconds, "vm_peak": seen.get("VmPeak"),
            "rss_peak": seen.get("VmHWM"), "stdout": out, "stderr": err}


def verdict(json_path: Path) -> tuple[str, list]:
    """(passed/failed summary, sorted first-divergence modules of the failed results)."""
    if not json_path.exists():
        return "no report", []
    report = json.loads(json_path.read_text())
    results = report["results"]
    failed = [r for r in results if not r["passed"]]
    modules = sorted({r["first_divergence"]["module"] for r in failed if r.get("first_divergence")})
    return f"{len(results) - len(failed)}/{len(results)} checks pass", modules


# The negative control's child: the CLI's own ``check --low-memory``, with the converted mcore
# tensor ``key`` scaled by ``factor`` as it is read (``low_memory.check(mutate_native=…)``, which
# sees one module's tensors at a time). Scaling the tensor in the file instead would change both
# sides alike, and the check would rightly pass.
_PERTURBED = r"""
import functools, sys
from mmparity.parity import low_memory
key, factor = sys.argv[1], float(sys.argv[2])

def mutate(state):
    if key in state:
        state[key] = state[key] * factor

low_memory.check = functools.partial(low_memory.check, mutate_native=mutate)
from mmparity.cli.main import main
raise SystemExit(main(sys.argv[3:]))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a new temporary one)")
    parser.add_argument("--size", default=None, help="weights of the big model (default: --ratio x the limit)")
    parser.add_argument("--ratio", type=float, default=3.0, help="weights / limit when --size is not given")
    parser.add_argument("--headroom", default="224MiB", help="address space allowed above the baseline")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-shard-size", default="2GB")
    parser.add_argument("--expert-group", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--negative-control", action="store_true",
                        help="also check with one expert's native linear_fc2 weight of one MoE layer x 1.5")
    parser.add_argument("--perturb-layer", type=int, default=None, help="that layer (default: the middle one)")
    parser.add_argument("--perturb-expert", type=int, default=0, help="that expert (default 0)")
    parser.add_argument("--no-components", action="store_true", help="pass --no-components to the checks")
    parser.add_argument("--skip-in-memory", action="store_true", help="do not run the in-memory check")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args()

    import torch

    from mmparity.io.fsio.safetensors_format import parse_size
    from mmparity.models.kimi_k25_vl.reference import tiny_config

    dtype = getattr(torch, args.dtype)
    scratch = args.dir or Path(tempfile.mkdtemp(prefix="check_low_memory."))
    scratch.mkdir(parents=True, exist_ok=True)
    extra = ["--no-components"] if args.no_components else []
    extra += ["--expert-group", str(args.expert_group)] if args.expert_group else []
    rows = []
    try:
        small = scratch / "small"
        if not small.exists():
            write(small, tiny_config(), dtype, args.seed, "10GB")
        base = child(["check", FAMILY, "--hf", small, "--low-memory", "--quiet", "--json", scratch / "small.json",
                      *extra], None)
        if base["code"] != 0:
            print(base["stderr"][-3000:], file=sys.stderr)
            return 1
        limit = base["vm_peak"] + parse_size(args.headroom)
        size = parse_size(args.size) if args.size else math.ceil(args.ratio * limit)
        layers = layers_for(size, dtype)
        cfg = big_config(layers)
        big = scratch / f"big-{layers}-{args.dtype}"
        started = time.perf_counter()
        weights = nbytes(cfg, dtype) if big.exists() else write(big, cfg, dtype, args.seed, args.max_shard_size)
        wrote = time.perf_counter() - started
        shards = sorted(p.stat().st_size for p in big.glob("*.safetensors"))
        text = cfg.text_config
        print(f"baseline (tiny --low-memory check, no limit): VmPeak {base['vm_peak'] / MiB:.0f} MiB, "
              f"{base['seconds']:.1f} s; limit {limit / MiB:.0f} MiB = baseline + {args.headroom}")
        print(f"model: {layers} decoder layers ({text.first_k_dense_replace} dense), {text.n_routed_experts} "
              f"routed experts of {text.moe_intermediate_size} x hidden {text.hidden_size}, {args.dtype}; "
              f"{weights / GiB:.2f} GiB in {len(shards)} shards (largest {shards[-1] / GiB:.2f} GiB); "
              f"written in {wrote:.1f} s")

        notes = []

        def run(label: str, low: bool, report: str, perturb=None) -> None:
            out = scratch / report
            out.unlink(missing_ok=True)
            argv = ["check", FAMILY, "--hf", big, "--quiet", "--json", out, *extra]
            got = child(argv + (["--low-memory"] if low else []), limit, perturb)
            summary, modules = verdict(out)
            err = [line for line in got["stderr"].strip().splitlines() if line.strip()]
            note = summary + (f"; first divergence: {', '.join(modules)}" if modules else "")
            if got["code"] not in (0, 1) and err:  # 1: a parity failure, in the report
                note += f" (stderr note {len(notes) + 1})"
                notes.append(err[-1].replace(str(scratch), "SCRATCH"))
            rows.append((label, got["code"], note, got["seconds"], got["vm_peak"], got["rss_peak"]))

        run("`--low-memory` under the limit", True, "low.json")
        if not args.skip_in_memory:
            run("in memory under the limit", False, "in_memory.json")
        if args.negative_control:
            moe = list(range(text.first_k_dense_replace, layers))
            layer = args.perturb_layer if args.perturb_layer is not None else moe[len(moe) // 2]
            key = f"language_model.decoder.layers.{layer}.mlp.experts.linear_fc2.weight{args.perturb_expert}"
            run(f"`--low-memory`, native `{key}` x 1.5", True, "negative.json", (key, 1.5))

        print()
        print(f"weights {weights / GiB:.2f} GiB, limit (RLIMIT_AS) {limit / GiB:.2f} GiB, ratio "
              f"{weights / limit:.2f}; baseline VmPeak {base['vm_peak'] / GiB:.2f} GiB")
        print()
        print("| run | exit | verdict | wall s | VmPeak MiB | peak RSS MiB |")
        print("|---|---|---|---|---|---|")
        for label, code, note, seconds, vm, rss in rows:
            mib = lambda n: f"{n / MiB:.0f}" if n else "—"  # noqa: E731
            print(f"| {label} | {code} | {note} | {seconds:.1f} | {mib(vm)} | {mib(rss)} |")
        for i, line in enumerate(notes, 1):
            print(f"\n{i}. `{line}`")
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
