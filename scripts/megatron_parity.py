"""Print the interop study's numbers: for each family (and TP size), HF weights converted by the real
converter (Megatron's layout), loaded strictly into Megatron's own class, run on
the native check's cases, compared with HF (rel_l2, max_abs per output; first diverging module).

    PYTHONPATH=$PWD[:/path/to/Megatron-LM] python scripts/megatron_parity.py \
        [--tp 1 2] [--json F] [FAMILY ...]

The runs are read off the registry: every family whose default Megatron class holds its whole
state dict (on the config that class is measured on: ``llava``'s is the stock LLaVAModel with the
CLIP tiny tower), every other class the interop helpers study under a name of its own
(``clip_vit``: Megatron-LM main's ViTModel in CLIP mode), and every projector construction proposed
beside a family's default (``FAMILY/construction``). Families whose class is not importable are
reported as skipped.
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


def runs() -> dict[str, dict]:
    """Each run's name and the options :func:`tests.megatron_interop.study` takes for it."""
    out = {family: {} for family in mi.whole_class_families()}
    out.update({name: {} for name in mi.CLASS_OF})
    out.update(mi.PROJECTION_STUDIES)
    return out


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    studies = runs()
    parser.add_argument("families", nargs="*", default=list(studies))
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    report = []
    for run in args.families:
        family = run.split("/")[0]
        if not models.available(mi.megatron_class(family).build):
            print(f"{run}: skipped ({models.INSTALL_HINT})")
            continue
        cfg = mi.layout_config(family) if family in mi.whole_class_families() else None
        for tp in args.tp:
            s = mi.study(family, cfg, tp=tp, **studies[run])
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
