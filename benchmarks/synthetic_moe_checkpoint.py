"""A synthetic many-expert checkpoint of a chosen size, for measuring conversion at scale without
downloads (not a test).

``--model qwen3_5_moe`` writes a Qwen3.5-397B-A17B release instead
(``Qwen3_5MoeForConditionalGeneration``: 60 hybrid layers, three Gated DeltaNet layers to one
gated-attention layer, 512 routed experts and a shared one in every layer, one tensor per expert as
the release ships them, its multi-token-prediction layer under ``mtp.``; the tower merged into the
text width), scaled the same way (``qwen3_5_whole.reference.published_config``); by default the
rest of this note is the Kimi one's.

What it writes by default is a Kimi-K2.5 release as transformers saves one (``KimiK25ForConditionalGeneration``:
a DeepSeek-V3 language model with MLA attention, dense leading layers, 1 shared and N routed experts
per MoE layer, one tensor per expert; the MoonViT tower and its projector), every width and the
expert count divided by ``--scale`` (``reference.kimi_k25_vl.published_config``), as many decoder
layers as make ``--size`` bytes: HF sharded safetensors with ``model.safetensors.index.json`` and
``config.json``. Its key set is the real one (the release spelling of ``fam.rule_set(cfg,
"release")``, worked out on meta tensors).

``--by-width`` reaches ``--size`` the other way: the depth and expert count stay as given (the
release's, 61 layers and 384 experts for Kimi-K2.5, 60 and 512 for Qwen3.5, unless ``--layers`` /
``--experts`` say otherwise) and the width scale is chosen, so checkpoints of different sizes have the same tensor names and count and
differ only in bytes. ``--heads`` fixes the attention heads (4 by default in that mode, so that
every size splits over TP 2 the same way).

Values are deterministic: one pool of 2^24 ``N(0, 0.02)`` values is drawn from ``--seed``, and each
tensor is the pool read cyclically from an offset its name picks, so the same arguments write the
same bytes, no two tensors start alike, and writing runs at memory speed, not at the random
generator's (a few tens of MB/s). One tensor is in memory at a time (the largest, the embedding, is
``vocab/scale x hidden/scale``), whatever the size.

Usage: python benchmarks/synthetic_moe_checkpoint.py OUT [--model kimi_k25_vl|qwen3_5_moe] [--size 8GB]
       [--scale 4] [--seed 0] [--max-shard-size 4GB] [--dtype bfloat16] [--layers N] [--experts N]
       [--heads N] [--by-width]
Prints one JSON line: model, layers, experts, scale, hidden, tensors, bytes, seconds.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class Release:
    """A published MoE release this script can write: its family, the HF layout the release ships,
    its config module (``published_config``, ``state_shapes``) and its depth and expert count."""

    family: str
    layout: str
    reference: str
    layers: int
    experts: int
    extra: str = ""  # the reference module's function giving tensors the release ships beyond the model's
    # Tensors (by name ending) written around one rather than zero: norms the release stores as
    # their scale where Megatron stores the offset from one (Qwen3.5's gated DeltaNet norm; its
    # other norms are offsets on both sides). A trained model's sit near one; a scale near zero
    # has no exact offset in bf16, and conversion refuses it, as it should.
    scales: tuple = ()


MODELS = {
    "kimi_k25_vl": Release("kimi_k25_vl", "release", "mmparity.models.kimi_k25_vl.reference", 61, 384),
    "qwen3_5_moe": Release("qwen3_5_whole", "hf_checkpoint", "mmparity.models.qwen3_5_whole.reference", 60, 512,
                           extra="mtp_shapes", scales=("linear_attn.norm.weight",)),
}
DEFAULT_MODEL = "kimi_k25_vl"


def release_shapes(scale: int, layers: int, dtype, experts: int | None = None, heads: int | None = None,
                   model: str = DEFAULT_MODEL) -> dict:
    """Release key -> shape of the scaled model with ``layers`` decoder layers (and ``experts``
    routed experts per MoE layer and ``heads`` attention heads, if given), from meta tensors."""
    import torch

    from mmparity.models import registry as families
    from mmparity.mapping.rules import convert_mcore_to_hf

    release = MODELS[model]
    reference = importlib.import_module(release.reference)
    cfg = reference.published_config(scale=scale, layers=layers, experts=experts, heads=heads)
    fam = families.get(release.family)
    state = {k: torch.empty(s, dtype=dtype, device="meta") for k, s in reference.state_shapes(cfg).items()}
    shapes = convert_mcore_to_hf(fam.rule_set(cfg, release.layout), fam.hf_to_mcore(state, cfg, hf_format="hf"))
    shapes = {k: tuple(v.shape) for k, v in shapes.items()}
    if release.extra:
        shapes |= getattr(reference, release.extra)(cfg)
    return cfg, shapes


@functools.lru_cache(maxsize=None)
def checkpoint_bytes(scale: int, layers: int, dtype, experts: int | None = None, heads: int | None = None,
                     model: str = DEFAULT_MODEL) -> int:
    """The size of the checkpoint ``write`` makes, worked out from two and three layers (every layer
    after the first two is alike), so a deep key set is never built just to be measured."""
    def nbytes(depth: int) -> int:
        shapes = release_shapes(scale, depth, dtype, experts, heads, model)[1]
        return sum(math.prod(s) for s in shapes.values()) * dtype.itemsize

    if model != DEFAULT_MODEL:
        # Qwen3.5's layers repeat in groups of four (three DeltaNet, one attention).
        if layers % 4 or layers < 8:
            return nbytes(layers)
        four, eight = nbytes(4), nbytes(8)
        return four + (layers // 4 - 1) * (eight - four)
    two, three = nbytes(2), nbytes(3)
    return two + (layers - 2) * (three - two)


def layers_for(size: int, scale: int, dtype, experts: int | None = None, heads: int | None = None,
               model: str = DEFAULT_MODEL) -> int:
    """The decoder depth whose checkpoint comes closest to ``size`` bytes (at least 2: one dense
    layer, one MoE layer; for Qwen3.5 whole groups of four)."""
    if model != DEFAULT_MODEL:
        group = checkpoint_bytes(scale, 8, dtype, experts, heads, model) - checkpoint_bytes(
            scale, 4, dtype, experts, heads, model)
        base = checkpoint_bytes(scale, 4, dtype, experts, heads, model) - group
        return 4 * max(1, round((size - base) / group))
    two = checkpoint_bytes(scale, 2, dtype, experts, heads)
    per_layer = checkpoint_bytes(scale, 3, dtype, experts, heads) - two
    return max(2, round((size - (two - 2 * per_layer)) / per_layer))


def scale_for(size: int, layers: int, dtype, experts: int | None = None, heads: int | None = None,
              model: str = DEFAULT_MODEL) -> int:
    """The width scale whose checkpoint of ``layers`` layers comes closest to ``size`` bytes. The
    size falls as the scale grows, so a bisection over the scales finds the two either side."""
    low, high = 1, 1024  # bytes(low) >= size > bytes(high) once the loop is done, or an end
    def nbytes(s: int) -> int:
        return checkpoint_bytes(s, layers, dtype, experts, heads, model)

    if nbytes(low) <= size:
        return low
    if nbytes(high) >= size:
        return high
    while high - low > 1:
        mid = (low + high) // 2
        if nbytes(mid) >= size:
            low = mid
        else:
            high = mid
    return min((low, high), key=lambda s: abs(nbytes(s) - size))


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
          by_width: bool = False, model: str = DEFAULT_MODEL) -> dict:
    """Write the checkpoint. ``by_width``: ``size`` picks the scale at the given depth (the
    release's layers and experts when not given), not the depth at the given scale."""
    import torch

    from mmparity.io.fsio.publish import atomic_directory
    from mmparity.io.fsio.safetensors_write import StreamingSafetensorsWriter

    started = time.perf_counter()
    release = MODELS[model]
    if by_width:
        layers, experts, heads = layers or release.layers, experts or release.experts, heads or 4
        scale = scale_for(size, layers, dtype, experts, heads, model)
    layers = layers or layers_for(size, scale, dtype, experts, heads, model)
    cfg, shapes = release_shapes(scale, layers, dtype, experts, heads, model)
    names = sorted(shapes)
    with atomic_directory(out) as staging:
        writer = StreamingSafetensorsWriter(staging, [(k, dtype, shapes[k]) for k in names],
                                            max_shard_size=max_shard_size)
        pool = torch.randn(1 << 24, generator=torch.Generator().manual_seed(seed)).mul_(0.02).to(dtype)
        try:
            for name in names:
                values = _cyclic(pool, zlib.crc32(name.encode()) % pool.numel(), math.prod(shapes[name]))
                if release.scales and name.endswith(release.scales):
                    values += 1
                writer.write(name, values.view(shapes[name]))
            writer.close()
        finally:
            writer.abort()
        (staging / "config.json").write_text(cfg.to_json_string())
    text = cfg.text_config
    return {"out": str(out), "model": model, "layers": layers,
            "dense_layers": getattr(text, "first_k_dense_replace", 0),
            "experts": getattr(text, "n_routed_experts", None) or text.num_experts, "scale": scale,
            "heads": text.num_attention_heads,
            "hidden": text.hidden_size, "tensors": len(names),
            "bytes": sum(math.prod(s) for s in shapes.values()) * dtype.itemsize,
            "seconds": round(time.perf_counter() - started, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS),
                        help="the release to imitate (default Kimi-K2.5; qwen3_5_moe: Qwen3.5-397B-A17B)")
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
                           heads=args.heads, by_width=args.by_width, model=args.model)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
