"""Write tests/data/megatron_layout/<family>.json: Megatron's own class's state-dict layout for each
family's tiny config at TP 1 and TP 2 (every key, per-rank shapes, split dim or replicated).

Run with the installed megatron-core for the stock families (clip, siglip, llava) and with
Megatron-LM main first on PYTHONPATH for the vit_model ones (pixtral, pixtral_large, qwen3_5,
kimi_k25); families whose class is not importable are skipped with the reason:

    PYTHONPATH=$PWD:/path/to/Megatron-LM python scripts/megatron_layout.py [FAMILY ...]
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron.core import package_info  # noqa: E402

from mmparity.models import registry as families  # noqa: E402
from mmparity.models.core import megatron_layout as layout, megatron_classes as models  # noqa: E402
from tests.megatron_interop import layout_config, whole_class_families  # noqa: E402

OUT = ROOT / "tests" / "data" / "megatron_layout"
# Every registered family whose default Megatron class holds the whole model.
FAMILIES = tuple(whole_class_families())


def config_for(family: str):
    """The HF config the layout is measured on, and how it is described in the file: the family's
    tiny config, or its Megatron record's default config where the class cannot be built on that
    (stock LLaVAModel builds CLIP-like towers only, see docs/megatron.md)."""
    default = families.megatron_class(family)[1].default_config
    if default is not None:
        return layout_config(family), f"{family} Megatron default config ({default.__name__})"
    return layout_config(family), f"{family} tiny config"


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    wanted = argv or list(FAMILIES)
    unknown = [f for f in wanted if f not in FAMILIES]
    if unknown:
        print(f"unknown families {unknown}; known: {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    for family in wanted:
        build = families.megatron_class(family)[1].build
        if not models.available(build):
            print(f"{family}: skipped ({models.INSTALL_HINT})")
            continue
        cfg, described = config_for(family)
        record = layout.measure(family, build, cfg)
        record["config"] = described
        record["measured_with"] = (f"megatron-core {package_info.__version__}"
                                   + (" (Megatron-LM main vit_model.py)"
                                      if getattr(build, "needs_vit_model", False) else ""))
        path = OUT / f"{family}.json"
        path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        split = sum(1 for e in record["tensors"].values() if e["split_dim"] is not None)
        print(f"{family}: {len(record['tensors'])} tensors ({split} split at TP 2), {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
