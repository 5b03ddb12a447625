"""Benchmark: peak anonymous memory of a conversion against the checkpoint's size (not a test).

For each ``--sizes`` a synthetic many-expert checkpoint (``synthetic_moe_checkpoint.py``: a scaled
Kimi-K2.5 release, the same widths at every size, only the depth grows) is converted, each job in
a fresh child process whose RssAnon the parent samples every few milliseconds
(``convert_throughput._measure``): anonymous memory only, not the page cache that reading and
writing a checkpoint goes through. Jobs: HF -> torch_dist, HF -> legacy at TP 2 x EP 2 (the
experts split over EP ranks, every matrix over TP ranks), and both back to HF in the release
layout, checked tensor for tensor against the source; ``--jobs`` adds the re-layouts between
Megatron's formats (torch_dist -> legacy at TP 2 x PP 2 x EP 2, legacy -> torch_dist), a legacy
-> legacy re-layout (TP 2 x EP 2 -> PP 2 x EP 4) and HF -> legacy with pipeline stages, each also
taken back to HF and checked.

A conversion's memory is bounded when the peak stays flat as the size grows: what a converter
holds is a few tensors at a time, so the figure to compare it with is the largest tensor
(printed), not the checkpoint.

``--layers N [N ...]`` instead of ``--sizes``: checkpoints of N decoder layers each, at the same
width, so the tensor count is what grows; with ``--experts 384 --scale 32`` and 61 layers it is
the release's (70,310 tensors in 2 GB; at ``--scale 64`` the text model has one attention head,
which TP 2 cannot split). A conversion's bookkeeping grows with the tensor
count, not the bytes, and its setup time is where anything worse than linear would show.

``--model qwen3_5_moe``: a Qwen3.5-397B-A17B release instead (60 hybrid layers, 512 experts, its
multi-token-prediction layer, which conversion leaves out and lists; a round trip is compared
without it).

``--by-width`` with ``--sizes``: the other way round, the release's key set at every size (61
layers and 384 experts unless ``--layers N`` / ``--experts N`` say otherwise, 4 attention heads)
and the width scale chosen to make each size, so only the bytes grow: what a conversion holds
per byte, with its bookkeeping the same at every size.

Usage: python benchmarks/convert_memory.py [--workdir DIR] [--sizes 1GB 4GB 16GB] [--scale 4] [--keep] [--phases]
       [--layers N [N ...]] [--experts N] [--by-width] [--jobs JOB [JOB ...]] [--model kimi_k25_vl|qwen3_5_moe]
Numbers go to benchmarks/RESULTS.md; nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import convert_throughput as bench  # noqa: E402  (its child runner and RssAnon sampler)
import synthetic_moe_checkpoint as synthetic  # noqa: E402

# Run in this order; an mcore checkpoint is removed once no later chosen job reads it, and every
# HF one made ("*back") is compared with the source and removed: three copies of a size on disk
# at most.
# What conversion leaves out of a release (and lists with counts and bytes): no model here builds
# Qwen3.5's multi-token-prediction layer.
LEFT_OUT = {"qwen3_5_moe": ("mtp.",)}
JOBS = {
    "hf -> torch_dist": ("hf", "td", {"to": "mcore", "format": "torch_dist"}),
    # A re-layout between Megatron's two formats, every parallel axis split on the way.
    "torch_dist -> legacy tp2 pp2 ep2": ("td", "legacy_pp", {"to": "mcore", "format": "legacy", "tp": 2, "pp": 2,
                                                             "ep": 2}),
    "legacy tp2 pp2 ep2 -> hf": ("legacy_pp", "legacy_pp_back", {"to": "hf", "hf_format": "release"}),
    "torch_dist -> hf": ("td", "td_back", {"to": "hf", "hf_format": "release"}),
    "hf -> legacy tp2 ep2": ("hf", "legacy", {"to": "mcore", "format": "legacy", "tp": 2, "ep": 2}),
    "legacy tp2 ep2 -> torch_dist": ("legacy", "td_again", {"to": "mcore", "format": "torch_dist"}),
    "torch_dist (from legacy) -> hf": ("td_again", "td_again_back", {"to": "hf", "hf_format": "release"}),
    # Legacy to legacy on another grid: TP parts joined, the stages and expert ranks cut anew.
    "legacy tp2 ep2 -> legacy tp1 pp2 ep4": ("legacy", "legacy_re", {"to": "mcore", "format": "legacy", "tp": 1,
                                                                     "pp": 2, "ep": 4}),
    "legacy tp1 pp2 ep4 -> hf": ("legacy_re", "legacy_re_back", {"to": "hf", "hf_format": "release"}),
    "legacy tp2 ep2 -> hf": ("legacy", "legacy_back", {"to": "hf", "hf_format": "release"}),
    "hf -> legacy tp2 pp2": ("hf", "legacy_hpp", {"to": "mcore", "format": "legacy", "tp": 2, "pp": 2}),
    "legacy tp2 pp2 -> hf": ("legacy_hpp", "legacy_hpp_back", {"to": "hf", "hf_format": "release"}),
}
DEFAULT_JOBS = ("hf -> torch_dist", "torch_dist -> hf", "hf -> legacy tp2 ep2", "legacy tp2 ep2 -> hf")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--sizes", nargs="+", default=["1GB", "4GB", "16GB"])
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--layers", nargs="+", type=int, default=None,
                        help="checkpoints of these decoder depths instead of --sizes (the tensor count grows)")
    parser.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer")
    parser.add_argument("--model", default=synthetic.DEFAULT_MODEL, choices=sorted(synthetic.MODELS),
                        help="the release the synthetic checkpoint imitates (default Kimi-K2.5)")
    parser.add_argument("--by-width", action="store_true",
                        help="make each of --sizes by the width scale, at one depth (--layers N, else the "
                             "release's) and expert count (--experts, else the release's): the same key set "
                             "at every size")
    parser.add_argument("--jobs", nargs="+", default=list(DEFAULT_JOBS), choices=list(JOBS), metavar="JOB",
                        help="which conversions, run in the order of JOBS (a job's mcore source must be made by "
                             f"an earlier chosen one); default: {', '.join(repr(j) for j in DEFAULT_JOBS)}; "
                             f"all: {', '.join(repr(j) for j in JOBS)}")
    parser.add_argument("--phases", action="store_true",
                        help="also the peak above start per phase of each conversion (setup: source, plan "
                             "and layout up to the first tensor; streaming; finish: manifest, .metadata, "
                             "publish), sampled in the child itself")
    args = parser.parse_args()
    import torch

    from mmparity.io.fsio.safetensors_format import parse_size

    if args.by_width and args.layers and len(args.layers) > 1:
        parser.error("--by-width takes one depth: --layers N")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mmparity-memory-"))
    rows = []
    if args.by_width:
        runs = [(size, args.layers[0] if args.layers else None) for size in args.sizes]
    elif args.layers:
        runs = [(f"{n} layers", n) for n in args.layers]
    else:
        runs = [(size, None) for size in args.sizes]
    try:
        for size, layers in runs:
            root = work / size.replace(" ", "_")
            by_size = args.by_width or layers is None
            info = synthetic.write(root / "hf", parse_size(size) if by_size else 0, args.scale, 0, "4GB",
                                   torch.bfloat16, layers=layers, experts=args.experts, by_width=args.by_width,
                                   model=args.model)
            _, shapes = synthetic.release_shapes(info["scale"], info["layers"], torch.bfloat16, info["experts"],
                                                 info["heads"], args.model)
            largest = max(math.prod(s) for s in shapes.values()) * 2
            left_out = LEFT_OUT.get(args.model, ())
            dropped = [math.prod(s) * 2 for k, s in shapes.items() if k.startswith(left_out)] if left_out else []
            chosen = [job for job in JOBS if job in args.jobs]
            for at, job in enumerate(chosen):
                src, dst, options = JOBS[job]
                if options.get("hf_format") == "release":  # the release's own layout, whatever it is called
                    options = {**options, "hf_format": synthetic.MODELS[args.model].layout}
                bench._settle(1)
                bench._warm(root / src)
                result = bench._measure("convert", root / src, root / dst,
                                        json.dumps({**options, "memory_phases": True} if args.phases else options))
                row = {"size": size, "bytes": info["bytes"], "scale": info["scale"], "layers": info["layers"],
                       "tensors": info["tensors"],
                       "job": job,
                       "seconds": round(result["seconds"], 2),
                       "GB/s": round(info["bytes"] / result["seconds"] / 1e9, 3),
                       "peak_anon_MB": round(result["peak_anon_kb"] / 1024, 1),
                       "above_start_MB": round((result["peak_anon_kb"] - (result["ready_anon_kb"] or 0)) / 1024, 1),
                       "largest_tensor_MB": round(largest / 2**20, 1)}
                if dropped and src == "hf":
                    row["left_out"] = {"tensors": len(dropped), "MB": round(sum(dropped) / 2**20, 1)}
                if args.phases:
                    row["phases_MB"] = {name.rsplit("_", 1)[-1]: round(kb / 1024, 1)
                                        for name, kb in result["phases"].items()}
                if dst.endswith("back"):
                    row["same_as_source"] = bench._same_tensors(root / "hf", root / dst, left_out)
                    shutil.rmtree(root / dst)
                if src != "hf" and all(JOBS[later][0] != src for later in chosen[at + 1:]):
                    shutil.rmtree(root / src)
                rows.append(row)
                print(json.dumps(row), flush=True)
            if not args.keep:
                shutil.rmtree(root)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print("| size | scale | layers | tensors | job | s | GB/s | peak RssAnon MB | above start MB | largest tensor MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['scale']} | {r['layers']} | {r['tensors']} | {r['job']} | {r['seconds']} | {r['GB/s']} | "
              f"{r['peak_anon_MB']} | {r['above_start_MB']} | {r['largest_tensor_MB']} |")
    if args.phases:
        print("\nPeak RssAnon above start by phase, MB (setup: up to the first tensor; finish: after the last):\n")
        print("| size | job | setup | streaming | finish |")
        print("|---|---|---|---|---|")
        for r in rows:
            ph = r["phases_MB"]
            print(f"| {r['size']} | {r['job']} | {ph['setup']} | {ph['streaming']} | {ph['finish']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
