"""``mmparity list``: the registered families (no framework import needed)."""

from __future__ import annotations

import json


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    from mmparity.models import registry as families

    rows = families.families()
    if args.json:
        print(json.dumps([{"family": f.name, "summary": f.summary, "components": list(f.compared),
                           "reference_classes": list(f.reference_classes)} for f in rows], indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="mmparity families")
    for column in ("family", "HF reference", "components", "summary"):
        table.add_column(column)
    for fam in rows:
        table.add_row(fam.name, ", ".join(fam.reference_classes), ", ".join(fam.compared), fam.summary)
    Console().print(table)
    return 0
