"""Rich tables and JUnit XML for parity reports (the harness itself never prints)."""

from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def print_report(report, elapsed: float, quiet: bool = False, stream=None) -> None:
    from rich.console import Console
    from rich.table import Table

    # Off a terminal rich would wrap at 80 columns and truncate the numbers people came for.
    is_tty = bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())
    console = Console(file=stream, highlight=False, width=None if is_tty else 200)
    if not quiet:
        table = Table(title=f"mmparity check · {report.device} · {report.dtype} · seed {report.seed} "
                            f"· attention {report.attention_backend}")
        for column in ("family", "check", "result", "rel_l2", "max_abs", "cosine", "tolerance",
                       "first divergence"):
            table.add_column(column)
        for r in report.results:
            div = r.first_divergence
            where = "-" if div is None else f"{div.module} (rel_l2 {_fmt(div.metrics.get('rel_l2'))})"
            table.add_row(r.family, r.check, "[green]pass[/]" if r.passed else "[red]FAIL[/]",
                          _fmt(r.metrics.get("rel_l2")), _fmt(r.metrics.get("max_abs")),
                          _fmt(r.metrics.get("cosine")), _fmt(r.tolerance.get("rel_l2")), where)
        console.print(table)
    failed = report.failures()
    status = "passed" if report.passed else "FAILED"
    console.print(f"{len(report.results) - len(failed)} passed, {len(failed)} failed "
                  f"({status}, {elapsed:.1f}s)")


def junit_xml(report, elapsed: float) -> str:
    failures = report.failures()
    lines = ['<?xml version="1.0" encoding="utf-8"?>',
             f'<testsuite name="mmparity" tests="{len(report.results)}" failures="{len(failures)}" '
             f'time="{elapsed:.3f}">']
    for r in report.results:
        name = quoteattr(r.check)
        lines.append(f'  <testcase classname={quoteattr("mmparity." + r.family)} name={name}>')
        if not r.passed:
            where = r.first_divergence.module if r.first_divergence else r.check
            message = f"first divergence at {where}: {r.metrics}"
            lines.append(f"    <failure message={quoteattr(message)}>{escape(str(r.tolerance))}</failure>")
        lines.append("  </testcase>")
    lines.append("</testsuite>")
    return "\n".join(lines) + "\n"
