"""Time the packed-attention kernels on one layer's q/k/v, to place the auto policy's switches.

    python benchmarks/attention_kernels.py --device cuda --dtype bfloat16 --json out.json
    python benchmarks/attention_kernels.py            # CPU, small sizes (a smoke run)

Scenarios: equal sizes (dense vs the rest), mixed sizes (per-size SDPA vs varlen vs masked padded
SDPA), and a sweep over the number of distinct sizes in a batch of many small images: where
``grouped`` (one SDPA call per size) stops beating ``varlen`` (one launch) is where
``attention.VARLEN_MIN_LENGTHS`` belongs. Every kernel's output is compared with the per-size SDPA
path in float32 (``rel_l2``); results go to benchmarks/RESULTS.md, never into asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from mmparity.parity.bench import time_call
from mmparity.models.core import attention
from mmparity.models.core import attention_backends as kernels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def scenarios(scale: int) -> list[tuple[str, list[int]]]:
    """(name, token counts); ``scale`` 1 is the H200 measurement's sizes (16 heads x 72)."""
    def s(n):
        return max(1, n // scale)
    mixed = [s(n) for n in (2304, 1600, 3136, 1369, 2916, 1024, 4096, 1444)]  # 8 sizes, ~17.9k
    out = [("equal 8x2304", [s(2304)] * 8), ("mixed 8 sizes", mixed)]
    for distinct in (2, 4, 8, 16, 32, 64):
        # 64 small images (~300-1000 tokens) drawn from `distinct` sizes.
        sizes = [s(256 + 12 * (i % distinct) * (64 // distinct)) for i in range(64)]
        out.append((f"64 images, {distinct} sizes", sizes))
    return out


def masked_padded(q, k, v, seqlens, scale):
    """What HF-style padding costs: pad every image to the longest, mask the padding."""
    heads, dim = q.shape[1], q.shape[2]
    longest, n = max(seqlens), len(seqlens)
    pad = torch.zeros(n, longest, heads, dim, device=q.device, dtype=q.dtype)
    pads = [pad.clone() for _ in range(3)]
    start = 0
    for i, length in enumerate(seqlens):
        for buf, x in zip(pads, (q, kernels.expand_kv(k, heads, 1), kernels.expand_kv(v, heads, 1))):
            buf[i, :length] = x[start:start + length]
        start += length
    keep = torch.arange(longest, device=q.device)[None, :] < torch.tensor(seqlens, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(*(p.transpose(1, 2) for p in pads),
                                         attn_mask=keep[:, None, None, :], scale=scale)
    return torch.cat([out[i, :, :length].transpose(0, 1) for i, length in enumerate(seqlens)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, choices=tuple(DTYPES))
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=None, help="key/value groups (default: heads)")
    parser.add_argument("--head-dim", type=int, default=72)
    parser.add_argument("--scale", type=int, default=None,
                        help="divide every token count by this (default: 1 on CUDA, 16 on CPU)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("attention_kernels: CUDA is not available", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    scale_down = args.scale or (1 if device.type == "cuda" else 16)
    repeats = args.repeats or (20 if device.type == "cuda" else 3)
    groups = args.groups or args.heads
    softmax_scale = 1 / args.head_dim ** 0.5
    candidates = ["dense", "grouped", "varlen", "flash", "te", "masked-padded"]
    rows = []
    for name, seqlens in scenarios(scale_down):
        total = sum(seqlens)
        gen = torch.Generator(device=device).manual_seed(total)
        q = torch.randn(total, args.heads, args.head_dim, device=device, generator=gen).to(dtype)
        k = torch.randn(total, groups, args.head_dim, device=device, generator=gen).to(dtype)
        v = torch.randn(total, groups, args.head_dim, device=device, generator=gen).to(dtype)
        baseline = kernels.grouped(q.float(), k.float(), v.float(), seqlens, softmax_scale)
        row = {"scenario": name, "images": len(seqlens), "tokens": total,
               "distinct_sizes": len(set(seqlens)),
               "auto": attention.plan(seqlens, device, dtype, args.head_dim, "auto").kernel, "ms": {},
               "rel_l2": {}}
        for kernel in candidates:
            if kernel == "dense" and len(set(seqlens)) != 1:
                continue
            if kernel in kernels.OPTIONAL_KERNELS and kernels.unavailable_reason(
                    kernel, device, dtype, args.head_dim):
                continue
            fn = masked_padded if kernel == "masked-padded" else kernels.PACKED_KERNELS[kernel]
            call = lambda: fn(q, k, v, seqlens, softmax_scale)  # noqa: E731
            out = call()
            row["rel_l2"][kernel] = ((out.float() - baseline).norm() / baseline.norm()).item()
            row["ms"][kernel] = statistics.median(time_call(call, device, warmup=3, repeats=repeats))
        row["fastest"] = min(row["ms"], key=row["ms"].get)
        rows.append(row)
        timings = "  ".join(f"{k} {v:.3f}" for k, v in row["ms"].items())
        print(f"{name:24s} tokens {total:6d}  auto={row['auto']:8s} fastest={row['fastest']:14s} ms: {timings}",
              flush=True)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
              "heads": args.heads, "groups": groups, "head_dim": args.head_dim,
              "token_scale": scale_down, "repeats": repeats,
              "varlen_min_lengths": attention.VARLEN_MIN_LENGTHS, "rows": rows}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
