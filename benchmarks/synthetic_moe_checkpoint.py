"""A synthetic many-expert checkpoint of a chosen size, for measuring conversion at scale without
downloads (not a test).

What it writes is a Kimi-K2.5 release as transformers saves one (``KimiK25ForConditionalGeneration``:
a DeepSeek-V3 language model with MLA attention, dense leading layers, 1 shared and N routed experts
per MoE layer, one tensor per expert; the MoonViT tower and its projector), every width and the
expert count divided by ``--scale`` (``reference.kimi_k25_vl.published_config``), as many decoder
layers as make ``--size`` bytes: HF sharded safetensors with ``model.safetensors.index.json`` and
``config.json``. Its key set is the real one (the release spelling of ``fam.rule_set(cfg,
"release")``, worked out on meta tensors).

``--by-width`` reaches ``--size`` the other way: the depth and expert count stay as given (the
release's, 61 layers and 384 experts, unless ``--layers`` / ``--experts`` say otherwise) and the
width scale is chosen, so checkpoints of different sizes have the same tensor names and count and
differ only in bytes. ``--heads`` fixes the attention heads (4 by default in that mode, so that
every size splits over TP 2 the same way).

Values are deterministic: one pool of 2^24 ``N(0, 0.02)`` values is drawn from ``--seed``, and each
tensor is the pool read cyclically from an offset its name picks, so the same arguments write the
same bytes, no two tensors start alike, and writing runs at memory speed, not at the random
generator's (a few tens of MB/s). One tensor is in memory at a time (the largest, the embedding, is
``vocab/scale x hidden/scale``), whatever the size.

Usage: python benchmarks/synthetic_moe_checkpoint.py OUT [--size 8GB] [--scale 4] [--seed 0]
       [--max-shard-size 4GB] [--dtype bfloat16] [--layers N] [--experts N] [--heads N] [--by-width]
Prints one JSON line: layers, experts, scale, hidden, tensors, bytes, seconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def release_shapes(scale: int, layers: int, dtype, experts: int | None = None, heads: int | None = None) -> dict:
    """Release key -> shape of the scaled model with ``layers`` decoder layers (and ``experts``
    routed experts per MoE layer and ``heads`` attention heads, if given), from meta tensors."""
    import torch

    from mmparity.models import registry as families
    from mmparity.mapping.rules import convert_mcore_to_hf
    from mmparity.models.kimi_k25_vl import reference

    cfg = reference.published_config(scale=scale, layers=layers, experts=experts, heads=heads)
    fam = families.get("kimi_k25_vl")
    state = {k: torch.empty(s, dtype=dtype, device="meta") for k, s in reference.state_shapes(cfg).items()}
    release = convert_mcore_to_hf(fam.rule_set(cfg, "release"), fam.hf_to_mcore(state, cfg, hf_format="hf"))
    return cfg, {k: tuple(v.shape) for k, v in release.items()}


@functools.lru_cache(maxsize=None)
def checkpoint_bytes(scale: int, layers: int, dtype, experts: int | None = None, heads: int | None = None) -> int:
    """The size of the checkpoint ``write`` makes, worked out from two and three layers (every layer
    after the first two is alike), so a deep key set is never built just to be measured."""
    def nbytes(depth: int) -> int:
        shapes = release_shapes(scale, depth, dtype, experts, heads)[1]
        return sum(math.prod(s) for s in shapes.values()) * dtype.itemsize

    two, three = nbytes(2), nbytes(3)
    return two + (layers - 2) * (three - two)


def layers_for(size: int, scale: int, dtype, experts: int | None = None, heads: int | None = None) -> int:
    """The decoder depth whose checkpoint comes closest to ``size`` bytes (at least 2: one dense
    layer, one MoE layer)."""
    two = checkpoint_bytes(scale, 2, dtype, experts, heads)
    per_layer = checkpoint_bytes(scale, 3, dtype, experts, heads) - two
    return max(2, round((size - (two - 2 * per_layer)) / per_layer))


def scale_for(size: int, layers: int, dtype, experts: int | None = None, heads: int | None = None) -> int:
    """The width scale whose checkpoint of ``layers`` layers comes closest to ``size`` bytes. The
    size falls as the scale grows, so a bisection over the scales finds the two either side."""
    low, high = 1, 1024  # bytes(low) >= size > bytes(high) once the loop is done, or an end
    if checkpoint_bytes(low, layers, dtype, experts, heads) <= size:
        return low
    if checkpoint_bytes(high, layers, dtype, experts, heads) >= size:
        return high
    while high - low > 1:
        mid = (low + high) // 2
        if checkpoint_bytes(mid, layers, dtype, experts, heads) >= size:
            low = mid
        else:
            high = mid
    return min((low, high), key=lambda s: abs(checkpoint_bytes(s, layers, dtype, experts, heads) - size))


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
          layers: int | None = None, experts: int | None = None, heads: int | None = None,
          by_width: bool = False) -> dict:
    """Write the checkpoint. ``by_width``: ``size`` picks the scale at the given depth (61 layers
    and 384 experts when not given), not the depth at the given scale."""
    import torch

    from mmparity.io.fsio.publish import atomic_directory
    from mmparity.io.fsio.safetensors_write import StreamingSafetensorsWriter

    started = time.perf_counter()
    if by_width:
        layers, experts, heads = layers or 61, experts or 384, heads or 4
        scale = scale_for(size, layers, dtype, experts, heads)
    layers = layers or layers_for(size, scale, dtype, experts, heads)
    cfg, shapes = release_shapes(scale, layers, dtype, experts, heads)
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
            "experts": text.n_routed_experts, "scale": scale, "heads": text.num_attention_heads,
            "hidden": text.hidden_size, "tensors": len(names),
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
    parser.add_argument("--heads", type=int, default=None,
                        help="attention heads (instead of 64 / --scale; 4 with --by-width)")
    parser.add_argument("--by-width", action="store_true",
                        help="reach --size by the width scale at a fixed depth and expert count (61 and 384 "
                             "unless --layers / --experts say otherwise): every size has the same key set")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default="4GB")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    import torch

    from mmparity.io.fsio.safetensors_format import parse_size

    print(json.dumps(write(args.out, parse_size(args.size), args.scale, args.seed, args.max_shard_size,
                           getattr(torch, args.dtype), layers=args.layers, experts=args.experts,
                           heads=args.heads, by_width=args.by_width)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
