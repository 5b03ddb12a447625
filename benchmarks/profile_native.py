"""Where does a native tower's forward spend its time? (a benchmark, not a test)

For each family: build the published-size native model (seeded random weights, bf16), profile one
forward with ``torch.profiler``, group the device kernels into GEMM / attention / norm /
elementwise / copy, and print the top kernels with their share. Then time the same forward with
every transformer layer wrapped in ``torch.compile`` to see how much kernel fusion alone buys.

    python benchmarks/profile_native.py qwen3_5 kimi_k25 siglip --device cuda --json out.json

On the CPU (``--size tiny``) it exercises the same code paths with CPU activities only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import warnings
from dataclasses import replace

import torch

CATEGORIES = [
    ("attention", re.compile(r"flash|fmha|attention|sdpa|softmax", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|sm90_xmma|nvjet|matmul|addmm|\bmm\b|linear|cublas", re.I)),
    ("norm", re.compile(r"layer_norm|layernorm|rms_norm|rmsnorm|welford", re.I)),
    ("copy/transpose", re.compile(r"copy|transpose|cat|contiguous|clone|index|gather|scatter", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|gelu|add|mul|tanh|reduce|triton", re.I)),
]


def categorise(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def profile_forward(run, device: torch.device, steps: int = 3) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    device_attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = []
    for evt in prof.key_averages():
        t = getattr(evt, device_attr, 0) or 0
        if device.type == "cuda" and getattr(evt, "device_type", None) is not None and \
                str(evt.device_type).endswith("CPU"):
            continue
        if t > 0:
            rows.append((evt.key, t / steps / 1000.0, evt.count // steps))
    if device.type != "cuda":  # CPU: keep leaf aten ops only, as a rough stand-in for kernels
        rows = [r for r in rows if r[0].startswith("aten::")]
    total = sum(r[1] for r in rows) or 1.0
    by_cat: dict = {}
    for name, ms, _ in rows:
        by_cat[categorise(name)] = by_cat.get(categorise(name), 0.0) + ms
    rows.sort(key=lambda r: -r[1])
    return {"kernel_ms_per_forward": total,
            "by_category": {k: {"ms": round(v, 3), "share": round(v / total, 3)}
                            for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "top": [{"kernel": n[:120], "ms": round(ms, 3), "share": round(ms / total, 3), "calls": c}
                    for n, ms, c in rows[:12]]}


def compiled_layers(native) -> tuple[bool, str]:
    layers = native.pipelined_module().layers  # the tower's block, also inside a tower+projector model
    try:
        for i in range(len(layers)):
            layers[i] = torch.compile(layers[i])
        return True, "every decoder layer wrapped in torch.compile"
    except Exception as exc:  # report, don't die: the eager numbers still stand
        return False, f"torch.compile failed: {type(exc).__name__}: {exc}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=["qwen3_5", "kimi_k25", "siglip"])
    parser.add_argument("--size", default="published", choices=("published", "tiny"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")

    from mmparity.models import registry as families
    from mmparity.parity import bench
    from mmparity.parity.harness import DTYPES

    device = torch.device(args.device)
    out = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "dtype": args.dtype, "families": {}}
    for family in args.families:
        if family not in families.names():
            print(f"skip {family}: not registered")
            continue
        started = time.perf_counter()
        prepared = bench.prepare_family(families.get(family), size=args.size)
        _, native = bench._build_pair(prepared.family, prepared.cfg, DTYPES[args.dtype], device, seed=0)
        case = replace(prepared.case, data=bench._to_device(prepared.case.data, device))
        run_native = families.get(family).hooks.native.run

        def forward():
            with torch.no_grad():
                return run_native(native, case)

        eager_ms = bench.time_call(forward, device, warmup=2, repeats=args.repeats)
        record = {"images": prepared.result.images, "image_size": prepared.result.image_sizes[0],
                  "gflop": (prepared.result.flops["total"] or 0) / 1e9,
                  "eager_median_ms": sorted(eager_ms)[len(eager_ms) // 2],
                  "profile": profile_forward(forward, device)}
        if not args.no_compile:
            ok, note = compiled_layers(native)
            record["compile"] = note
            if ok:
                try:
                    t0 = time.perf_counter()
                    forward()
                    record["compile_first_call_s"] = round(time.perf_counter() - t0, 1)
                    times = bench.time_call(forward, device, warmup=2, repeats=args.repeats)
                    record["compiled_median_ms"] = sorted(times)[len(times) // 2]
                except Exception as exc:
                    record["compile"] = f"compiled forward failed: {type(exc).__name__}: {str(exc)[:300]}"
        record["wall_s"] = round(time.perf_counter() - started, 1)
        out["families"][family] = record
        p = record["profile"]
        print(f"== {family}: {record['images']} x {record['image_size']} eager {record['eager_median_ms']:.2f} ms"
              f" | compiled {record.get('compiled_median_ms', float('nan')):.2f} ms ({record.get('compile')})"
              f" | kernels {p['kernel_ms_per_forward']:.2f} ms/forward")
        print("   by category: " + ", ".join(f"{k} {v['ms']:.2f} ms ({v['share']:.0%})"
                                             for k, v in p["by_category"].items()))
        for row in p["top"][:8]:
            print(f"   {row['share']:6.1%} {row['ms']:8.3f} ms x{row['calls']:<4} {row['kernel']}")
        sys.stdout.flush()
        del native
        bench._release(device)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(out, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
