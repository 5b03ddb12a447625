"""Print the interop study's numbers: for each family (and TP size), HF weights converted by the real
converter (Megatron's layout), loaded strictly into Megatron's own class, run on
the native check's cases, compared with HF (rel_l2, max_abs per output; first diverging module).

    PYTHONPATH=$PWD[:/path/to/Megatron-LM] python scripts/megatron_parity.py \
        [--tp 1 2] [--json F] [FAMILY ...]

Families whose class is not importable are reported as skipped. ``clip_vit`` is Megatron-LM
main's ViTModel in CLIP mode; ``llava`` is the stock LLaVAModel with the CLIP tiny tower;
``kimi_k25`` runs both proposed projector constructions.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mmparity.models.core import megatron_classes as models  # noqa: E402
from tests import megatron_interop as mi  # noqa: E402

RUNS = {
    "clip": {}, "siglip": {}, "llava": {}, "pixtral": {}, "clip_vit": {}, "pixtral_large": {},
    "qwen3_5": {}, "kimi_k25": {"kimi_projection": "fused_norm_over_merged"},
    "kimi_k25/drop_pre_norm": {"kimi_projection": "drop_pre_norm"},
}


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("families", nargs="*", default=list(RUNS))
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    report = []
    for run in args.families:
        family = run.split("/")[0]
        if not models.available(mi.megatron_class(family).build):
            print(f"{run}: skipped ({models.INSTALL_HINT})")
            continue
        cfg = mi.llava_clip_config() if family == "llava" else None
        for tp in args.tp:
            s = mi.study(family, cfg, tp=tp, **RUNS[run])
            first = mi.first_divergence(s.modules) if s.modules else None
            row = {"run": run, "tp": tp, "outputs": s.outputs, "errors": s.errors,
                   "side_keys": s.side_keys, "first_divergence": first, "modules": s.modules}
            report.append(row)
            print(f"{run} TP {tp}: strict load ok ({len(s.tolerated_missing)} _extra_state "
                  f"tolerated), {len(s.side_keys)} side tensors")
            for name, m in s.outputs.items():
                print(f"    {name:32s} rel_l2 {m['rel_l2']:.3g}  max_abs {m['max_abs']:.3g}")
            for name, err in s.errors.items():
                print(f"    {name:32s} raised {err}")
            if first:
                print(f"    first divergence: {first}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
