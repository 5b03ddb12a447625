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
        title = (f"mmparity check · {report.device} · {report.dtype} · seed {report.seed} "
                 f"· attention {report.attention_backend}")
        if report.megatron is not None:
            classes = ", ".join(f"{family}: {name}" for family, name in report.megatron["classes"].items())
            title += f" · Megatron {report.megatron['version']} ({report.megatron['te']}) · {classes}"
        table = Table(title=title)
        with_impl = report.impl != "native"
        columns = ("family",) + (("impl",) if with_impl else ()) + (
            "check", "result", "rel_l2", "max_abs", "cosine", "tolerance", "first divergence")
        for column in columns:
            table.add_column(column)
        for r in report.results:
            div = r.first_divergence
            where = "-" if div is None else f"{div.module} ({_divergence_detail(div.metrics)})"
            table.add_row(r.family, *((r.impl,) if with_impl else ()), r.check,
                          "[green]pass[/]" if r.passed else "[red]FAIL[/]",
                          _fmt(r.metrics.get("rel_l2")), _fmt(r.metrics.get("max_abs")),
                          _fmt(r.metrics.get("cosine")), _fmt(r.tolerance.get("rel_l2")), where)
        console.print(table)
    failed = report.failures()
    status = "passed" if report.passed else "FAILED"
    console.print(f"{len(report.results) - len(failed)} passed, {len(failed)} failed "
                  f"({status}, {elapsed:.1f}s)")


def _divergence_detail(metrics: dict) -> str:
    if "error" in metrics:
        return metrics["error"]
    return f"rel_l2 {_fmt(metrics.get('rel_l2'))}"


def junit_xml(report, elapsed: float) -> str:
    failures = report.failures()
    lines = ['<?xml version="1.0" encoding="utf-8"?>',
             f'<testsuite name="mmparity" tests="{len(report.results)}" failures="{len(failures)}" '
             f'time="{elapsed:.3f}">']
    for r in report.results:
        name = quoteattr(r.check)
        classname = "mmparity." + r.family + ("" if r.impl == "native" else "." + r.impl)
        lines.append(f'  <testcase classname={quoteattr(classname)} name={name}>')
        if not r.passed:
            div = r.first_divergence
            where = div.module if div else r.check
            message = f"first divergence at {where}: {div.metrics if div and not r.metrics else r.metrics}"
            lines.append(f"    <failure message={quoteattr(message)}>{escape(str(r.tolerance))}</failure>")
        lines.append("  </testcase>")
    lines.append("</testsuite>")
    return "\n".join(lines) + "\n"
