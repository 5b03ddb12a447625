"""``mmparity list``: the registered families (no framework import needed).

Two lines a family at any width: its name and HF reference class(es), then its summary, cut at
the terminal's edge with a visible ``…`` (``--long`` and ``--json`` give every summary whole)."""

from __future__ import annotations

import json


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--long", action="store_true",
                        help="a table with each family's compared components and its whole summary")


def run(args) -> int:
    from mmparity.models import registry as families

    rows = families.families()
    if args.json:
        print(json.dumps([{"family": f.name, "summary": f.summary, "components": list(f.compared),
                           "reference_classes": list(f.reference_classes)} for f in rows], indent=2))
        return 0
    from rich import box
    from rich.console import Console, Group
    from rich.table import Table
    from rich.text import Text

    if args.long:
        table = Table(title="mmparity families")
        for column in ("family", "HF reference", "components", "summary"):
            table.add_column(column)
        for fam in rows:
            table.add_row(fam.name, ", ".join(fam.reference_classes), ", ".join(fam.compared), fam.summary)
        Console().print(table)
        return 0
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 2, 0, 0))
    table.add_column("family", no_wrap=True)
    table.add_column("HF reference, summary", overflow="fold")
    for fam in rows:
        # The class names are what a user matches a checkpoint against: never cut, folded at worst.
        summary = Text(fam.summary, style="dim", no_wrap=True, overflow="ellipsis")
        table.add_row(Text(fam.name, style="bold"), Group(Text(", ".join(fam.reference_classes)), summary))
    console = Console()
    console.print(table)
    console.print(Text("A summary ending in … goes on: mmparity list --long prints each whole, with the "
                       "components compared."), overflow="fold")
    return 0
