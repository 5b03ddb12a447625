"""A synthetic many-expert checkpoint of a chosen size, for measuring conversion at scale without
downloads (not a test).

What it writes is a Kimi-K2.5 release as transformers saves one (``KimiK25ForConditionalGeneration``:
a DeepSeek-V3 language model with MLA attention, dense leading layers, 1 shared and N routed experts
per MoE layer, one tensor per expert; the MoonViT tower and its projector), every width and the
expert count divided by ``--scale`` (``reference.kimi_k25_vl.published_config``), as many decoder
layers as make ``--size`` bytes: HF sharded safetensors with ``model.safetensors.index.json`` and
``config.json``. Its key set is the real one (the release spelling of ``fam.rule_set(cfg,
"release")``, worked out on meta tensors).

Values are deterministic: one pool of 2^24 ``N(0, 0.02)`` values is drawn from ``--seed``, and each
tensor is the pool read cyclically from an offset its name picks, so the same arguments write the
same bytes, no two tensors start alike, and writing runs at memory speed, not at the random
generator's (a few tens of MB/s). One tensor is in memory at a time (the largest, the embedding, is
``vocab/scale x hidden/scale``), whatever the size.

Usage: python benchmarks/synthetic_moe_checkpoint.py OUT [--size 8GB] [--scale 4] [--seed 0]
       [--max-shard-size 4GB] [--dtype bfloat16] [--layers N] [--experts N]
Prints one JSON line: layers, experts, tensors, bytes, seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def release_shapes(scale: int, layers: int, dtype, experts: int | None = None) -> dict:
    """Release key -> shape of the scaled model with ``layers`` decoder layers (and ``experts``
    routed experts per MoE layer, if given), from meta tensors."""
    import torch

    from mmparity import families
    from mmparity.converters.rules import convert_mcore_to_hf
    from mmparity.reference import kimi_k25_vl as reference

    cfg = reference.published_config(scale=scale, layers=layers, experts=experts)
    fam = families.get("kimi_k25_vl")
    state = {k: torch.empty(s, dtype=dtype, device="meta") for k, s in reference.state_shapes(cfg).items()}
    release = convert_mcore_to_hf(fam.rule_set(cfg, "release"), fam.hf_to_mcore(state, cfg, hf_format="hf"))
    return cfg, {k: tuple(v.shape) for k, v in release.items()}


def layers_for(size: int, scale: int, dtype, experts: int | None = None) -> int:
    """The decoder depth whose checkpoint comes closest to ``size`` bytes (at least 2: one dense
    layer, one MoE layer)."""
    def nbytes(layers: int) -> int:
        return sum(math.prod(s) for s in release_shapes(scale, layers, dtype, experts)[1].values()) * dtype.itemsize

    two, three = nbytes(2), nbytes(3)
    per_layer = three - two
    return max(2, round((size - (two - 2 * per_layer)) / per_layer))


def _cyclic(pool, start: int, count: int):
    """``count`` values of ``pool`` from ``start`` on, wrapping around."""
    import torch

    parts, left = [], count
    while left:
        take = min(left, pool.numel() - start)
        parts.append(pool[start:start + take])
        left, start = left - take, 0
    return parts[0].clone() if len(parts) == 1 else torch.cat(parts)


def write(out: Path, size: int, scale: int, seed: int, max_shard_size: str, dtype, *,
          layers: int | None = None, experts: int | None = None) -> dict:
    import torch

    from mmparity.checkpoint.fsio.publish import atomic_directory
    from mmparity.checkpoint.fsio.safetensors_write import StreamingSafetensorsWriter

    started = time.perf_counter()
    layers = layers or layers_for(size, scale, dtype, experts)
    cfg, shapes = release_shapes(scale, layers, dtype, experts)
    names = sorted(shapes)
    with atomic_directory(out) as staging:
        writer = StreamingSafetensorsWriter(staging, [(k, dtype, shapes[k]) for k in names],
                                            max_shard_size=max_shard_size)
        pool = torch.randn(1 << 24, generator=torch.Generator().manual_seed(seed)).mul_(0.02).to(dtype)
        try:
            for name in names:
                writer.write(name, _cyclic(pool, zlib.crc32(name.encode()) % pool.numel(), math.prod(shapes[name]))
                             .view(shapes[name]))
            writer.close()
        finally:
            writer.abort()
        (staging / "config.json").write_text(cfg.to_json_string())
    text = cfg.text_config
    return {"out": str(out), "layers": layers, "dense_layers": text.first_k_dense_replace,
            "experts": text.n_routed_experts, "hidden": text.hidden_size, "tensors": len(names),
            "bytes": sum(math.prod(s) for s in shapes.values()) * dtype.itemsize,
            "seconds": round(time.perf_counter() - started, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", default="8GB", help="target checkpoint size (e.g. 1GB, 16GB)")
    parser.add_argument("--scale", type=int, default=4, help="divide every width and the expert count by this")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (instead of as many as make --size)")
    parser.add_argument("--experts", type=int, default=None,
                        help="routed experts per MoE layer (instead of the release's 384 / --scale): with "
                             "--layers 61 --experts 384 and a large --scale, the release's tensor count at a "
                             "small size, which is what a conversion's bookkeeping grows with")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default="4GB")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    import torch

    from mmparity.checkpoint.fsio.safetensors_format import parse_size

    print(json.dumps(write(args.out, parse_size(args.size), args.scale, args.seed, args.max_shard_size,
                           getattr(torch, args.dtype), layers=args.layers, experts=args.experts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
