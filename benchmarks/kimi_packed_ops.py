"""What the native Kimi-K2.5 tower's packed mixed-size path costs beyond a uniform batch: aten op
counts (inside and outside the transformer block), host scalar reads, and forward times.

    python benchmarks/kimi_packed_ops.py                          # tiny config, CPU
    python benchmarks/kimi_packed_ops.py --size moderate          # published widths, 2 layers, CPU
    python benchmarks/kimi_packed_ops.py --size published --device cuda --dtype bfloat16

On the CPU an op is a few microseconds of host time; on a GPU each is a kernel launch (and an
``item`` of a device tensor, or a copy from pageable host memory, a synchronisation). The op counts
are the portable part of the evidence: a per-image loop shows as counts that grow with the number
of images. ``--sync-debug`` (CUDA) counts the synchronising calls of one warm forward
(``torch.cuda.set_sync_debug_mode("warn")``).

``--position-term`` times only the resampled position term of the published mixed set (64 x 64 x
1152 table, 8 sizes): ``F.interpolate`` once per size, as the tower did, against the tower's one
``embedding_bag``.

Rows: ``uniform`` (the static batch of N images of the set's first size), ``mixed N`` (N images of
distinct sizes, packed), each timed cold (first forward on a layout) and warm (same layout again).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Distinct sides, in units of patch x merge (28 px at published size); the first is the uniform size.
UNITS = ((8, 8), (6, 10), (10, 6), (7, 7), (9, 9), (5, 10), (10, 10), (4, 8),
         (8, 4), (6, 6), (4, 4), (3, 9), (9, 3), (5, 5), (6, 8), (8, 6))


class OpCount(TorchDispatchMode):
    """Counts aten ops, split into those inside ``decoder`` (toggled by hooks) and the rest."""

    def __init__(self):
        super().__init__()
        self.inside = collections.Counter()
        self.outside = collections.Counter()
        self.in_decoder = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).removeprefix("aten.")
        (self.inside if self.in_decoder else self.outside)[name] += 1
        return func(*args, **(kwargs or {}))


def count_ops(model, run) -> OpCount:
    """Aten ops of ``run()``; the tower's ``decoder`` calls are counted apart."""
    from mmparity.models.kimi_k25.native import tower

    counter = OpCount()
    decoder = tower(model).decoder

    def enter(*_):
        counter.in_decoder += 1

    def leave(*_):
        counter.in_decoder -= 1

    handles = [decoder.register_forward_pre_hook(enter), decoder.register_forward_hook(leave)]
    try:
        with torch.no_grad(), counter:
            run()
    finally:
        for h in handles:
            h.remove()
    return counter


def build(size: str, dtype: torch.dtype, device: torch.device):
    from mmparity.models import registry as families
    from mmparity.parallel import runtime
    from mmparity.parity import bench

    warnings.filterwarnings("ignore")
    fam = families.get("kimi_k25")
    if size == "tiny":
        cfg = fam.tiny_config()
    else:
        cfg = bench.published_config(families.get("kimi_k25"))
        if size == "moderate":
            cfg.vision_config.num_hidden_layers = 2
    runtime.init_parallel(1, 1, device=device, seed=0)
    torch.manual_seed(0)
    model = fam.build_native(cfg, params_dtype=dtype).to(device=device, dtype=dtype).eval()
    return cfg, model


def unit(cfg, size: str) -> int:
    """Pixels per side unit: patch x merge (28 px at published widths); x4 at published size, so
    that the uniform image is the published 896 px."""
    from mmparity.models.kimi_k25.cases import image_size_multiple

    return image_size_multiple(cfg) * (4 if size == "published" else 1)


def inputs_for(model, sizes, patch: int, dtype, device, static: bool):
    from mmparity.models.core import inputs

    images = [img.to(device) for img in inputs.images(sizes, 3, 0)]
    if static:
        batch = torch.stack(images).to(dtype)
        return lambda: model(batch)
    rows = inputs.packed_rows(images, patch).to(dtype)
    return lambda: model(rows, imgs_sizes=sizes)


def timed(run, device: torch.device, repeats: int) -> float:
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def position_term(device: torch.device, repeats: int) -> None:
    import torch.nn.functional as F

    from mmparity.models.kimi_k25.cases import PUBLISHED
    from mmparity.models.kimi_k25 import native as nat

    vc = PUBLISHED.vision
    side, patch = vc["pos_emb_height"], vc["patch_size"]
    pos = nat.KimiLearned2DPosEmbed(side, vc["pos_emb_width"], vc["hidden_size"]).to(device)
    grids = [(h // patch, w // patch) for h, w in PUBLISHED.mixed]

    def per_size():
        table = pos.weight.permute(2, 0, 1)[None].float()
        return torch.cat([pos.weight.flatten(0, 1) if g == (side, side) else
                          F.interpolate(table, size=g, mode="bicubic", align_corners=False)[0]
                          .permute(1, 2, 0).flatten(0, 1) for g in grids])

    def packed():
        return pos.packed(grids, [1] * len(grids))

    with torch.no_grad():
        a, b = per_size(), packed()
        print(f"position term, {len(grids)} sizes, {a.shape[0]} tokens: rel_l2 "
              f"{float((a - b).norm() / a.norm()):.2e}")
        for name, fn in (("F.interpolate per size", per_size), ("embedding_bag, all sizes", packed)):
            print(f"  {name:26s} {timed(fn, device, repeats):8.1f} ms")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=("tiny", "moderate", "published"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--images", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--position-term", action="store_true",
                        help="time only the position term of the published mixed set")
    parser.add_argument("--sync-debug", action="store_true",
                        help="CUDA: count the synchronising calls of one warm forward")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.position_term:
        warnings.filterwarnings("ignore")
        position_term(device, args.repeats)
        return 0
    cfg, model = build(args.size, dtype, device)
    from mmparity.models.kimi_k25.native import tower

    patch, u = tower(model).patch_dim, unit(cfg, args.size)
    print(f"kimi_k25 {args.size}: {cfg.vision_config.num_hidden_layers} layers x "
          f"{cfg.vision_config.hidden_size}, patch {patch}, unit {u} px, {device}, {args.dtype}")
    rows = [("uniform", n, [tuple(s * u for s in UNITS[0])] * n, True) for n in args.images]
    rows += [("mixed", n, [tuple(s * u for s in UNITS[i % len(UNITS)]) for i in range(n)], False)
             for n in args.images]
    for label, n, sizes, static in rows:
        run = inputs_for(model, sizes, patch, dtype, device, static)
        tokens = sum((h // patch) * (w // patch) for h, w in sizes)
        began = time.perf_counter()
        cold = count_ops(model, run)
        cold_ms = (time.perf_counter() - began) * 1e3
        warm = count_ops(model, run)
        syncs = "-"
        if args.sync_debug and device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                    warnings.simplefilter("always")
                    run()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            syncs = str(sum("synchroniz" in str(w.message) for w in caught))
        ms = timed(run, device, args.repeats)
        reads = warm.outside["_local_scalar_dense"] + warm.inside["_local_scalar_dense"]
        print(f"{label:7s} n={n:2d} tokens={tokens:6d} | ops outside block: cold {sum(cold.outside.values()):5d} "
              f"warm {sum(warm.outside.values()):5d} | inside block {sum(warm.inside.values()):5d} "
              f"| host scalar reads {reads:3d} | device syncs {syncs} | forward {ms:8.1f} ms "
              f"(first, counted: {cold_ms:.1f})",
              flush=True)
        if label == "mixed" and n == max(args.images):
            top = ", ".join(f"{k}={v}" for k, v in warm.outside.most_common(10))
            print(f"        outside block, warm: {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
