"""Benchmark: what converting a whole Kimi-K2.5 needs, measured on proportionally scaled synthetic
models and extrapolated to the released size (not a test).

1. The released size, from the config alone (``reference.kimi_k25_vl.published_config``, recalled,
   not read from the hub): tensors, parameters, bytes at bf16, and the largest single tensor in
   each HF layout, which bounds what a streaming conversion must hold at once.
2. For each ``--scale`` (every width and the expert count divided by it, ``--layers`` decoder
   layers), a synthetic bf16 checkpoint in the release layout (one tensor per expert) is written,
   then converted HF -> mcore legacy (``--tp``, ``--ep``) and back to HF, each in a fresh child
   process: wall time, peak RSS of the child (``ru_maxrss``), bytes read and written.

Usage: python benchmarks/kimi_k25_conversion.py [--workdir DIR] [--scale 32 16] [--layers 6] [--tp 1] [--ep 2] [--keep]
Numbers go to benchmarks/RESULTS.md; nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import resource, sys, time
from mmparity.cli.main import main
started = time.perf_counter()
code = main(sys.argv[1:] + ["--quiet"])
print("RESULT", code, time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def released() -> dict:
    from mmparity.models.kimi_k25_vl import reference

    cfg = reference.published_config()
    module_names = reference.state_shapes(cfg)
    params = sum(math.prod(s) for s in module_names.values())
    largest = max(module_names.items(), key=lambda kv: math.prod(kv[1]))
    text = cfg.text_config
    per_expert = (text.moe_intermediate_size, text.hidden_size)
    return {"tensors (module names)": len(module_names), "parameters": params, "bf16 bytes": 2 * params,
            "largest tensor, module names": [largest[0], list(largest[1]), 2 * math.prod(largest[1])],
            "largest expert tensor, release layout": [list(per_expert), 2 * math.prod(per_expert)],
            "embedding": [[text.vocab_size, text.hidden_size], 2 * text.vocab_size * text.hidden_size]}


def write_synthetic(directory: Path, scale: int, layers: int) -> dict:
    import torch

    from mmparity.models import registry as families
    from mmparity.io.fsio.safetensors_write import save_safetensors_checkpoint
    from mmparity.mapping.rules import convert_mcore_to_hf
    from mmparity.models.kimi_k25_vl import reference

    cfg = reference.published_config(scale=scale, layers=layers)
    fam = families.get("kimi_k25_vl")
    gen = torch.Generator().manual_seed(scale)
    state = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in reference.state_shapes(cfg).items()}
    release = convert_mcore_to_hf(fam.rule_set(cfg, "release"), fam.hf_to_mcore(state, cfg, hf_format="hf"))
    save_safetensors_checkpoint(directory, release, max_shard_size="500MB",
                                extra_files={"config.json": cfg.to_json_string()})
    return {"tensors": len(release), "parameters": sum(t.numel() for t in release.values()),
            "experts": cfg.text_config.n_routed_experts, "hidden": cfg.text_config.hidden_size}


def run_child(*argv) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, *map(str, argv)], capture_output=True, text=True)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(out.stderr[-2000:])
    _, code, seconds, maxrss_kb = line.split()
    return {"exit": int(code), "seconds": round(float(seconds), 2), "peak_rss_mb": round(int(maxrss_kb) / 1024, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--scale", type=int, nargs="+", default=[32, 16])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mmparity-kimi-"))
    print(json.dumps({"released": released()}, indent=1))
    try:
        for scale in args.scale:
            root = work / f"scale{scale}"
            src, mcore, back = root / "hf", root / "mcore", root / "back"
            started = time.perf_counter()
            synthetic = write_synthetic(src, scale, args.layers)
            synthetic["write_seconds"] = round(time.perf_counter() - started, 2)
            to_mcore = run_child("convert", "--src", src, "--dst", mcore, "--to", "mcore", "--format", "legacy",
                                 "--tp", args.tp, "--ep", args.ep)
            to_mcore |= {"read_bytes": _size(src), "written_bytes": _size(mcore)}
            to_hf = run_child("convert", "--src", mcore, "--dst", back, "--to", "hf", "--hf-format", "release")
            to_hf |= {"read_bytes": _size(mcore), "written_bytes": _size(back)}
            print(json.dumps({"scale": scale, "layers": args.layers, "synthetic": synthetic,
                              f"hf -> legacy tp{args.tp} ep{args.ep}": to_mcore, "legacy -> hf": to_hf}, indent=1))
            if not args.keep:
                shutil.rmtree(root)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
