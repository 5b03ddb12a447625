"""Rich tables and JUnit XML for parity reports (the harness itself never prints)."""

from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr


def _xml_safe(text) -> str:
    """`text` with every character XML 1.0 cannot hold at all (C0 controls but tab, newline and
    carriage return; lone surrogates, which no encoding writes; U+FFFE, U+FFFF) as its Python
    escape, `\\x07`, `\\udcff`: a name stays readable and the report parses. `<`, `&`, quotes and
    `]]>` are left to quoteattr / escape."""
    text = str(text)
    out = []
    for ch in text:
        code = ord(ch)
        if code in (0x9, 0xA, 0xD) or 0x20 <= code <= 0xD7FF or 0xE000 <= code <= 0xFFFD or code >= 0x10000:
            out.append(ch)
        elif code < 0x100:
            out.append(f"\\x{code:02x}")
        else:
            out.append(f"\\u{code:04x}")
    return "".join(out)


def _attr(text) -> str:
    return quoteattr(_xml_safe(text))


def _console_text(text):
    """A name as table text: rich markup in it is literal, terminal control characters and text no
    encoding writes are shown escaped (a module name must not drive the terminal)."""
    from rich.text import Text

    text = str(text)
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F or 0xD800 <= ord(ch) <= 0xDFFF for ch in text):
        text = "".join(ch if not (ord(ch) < 0x20 or ord(ch) == 0x7F or 0xD800 <= ord(ch) <= 0xDFFF)
                       else ch.encode("unicode_escape", "backslashreplace").decode("ascii")
                       if ord(ch) < 0xD800 else f"\\u{ord(ch):04x}" for ch in text)
    return Text(text)


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
            table.add_row(_console_text(r.family), *((_console_text(r.impl),) if with_impl else ()),
                          _console_text(r.check),
                          "[green]pass[/]" if r.passed else "[red]FAIL[/]",
                          _fmt(r.metrics.get("rel_l2")), _fmt(r.metrics.get("max_abs")),
                          _fmt(r.metrics.get("cosine")), _fmt(r.tolerance.get("rel_l2")), _console_text(where))
        table.title = _console_text(title)
        console.print(table)
        if report.megatron is not None:
            for family, note in report.megatron.get("notes", {}).items():
                console.print(_console_text(f"note: {family}: {report.megatron['classes'][family]}: {note}"),
                              soft_wrap=True)
    failed = report.failures()
    status = "passed" if report.passed else "FAILED"
    console.print(f"{len(report.results) - len(failed)} passed, {len(failed)} failed "
                  f"({status}, {elapsed:.1f}s)")


def _divergence_detail(metrics: dict) -> str:
    if "error" in metrics:
        return metrics["error"]
    verdict = metrics.get("router")
    if verdict is not None and verdict["disagreements"]:
        return (f"{verdict['disagreements']} of {verdict['tokens']} tokens routed to other experts, "
                f"score gap up to {_fmt(verdict['worst_gap'])} (a tie is <= {_fmt(verdict['tie_tolerance'])})")
    return f"rel_l2 {_fmt(metrics.get('rel_l2'))}"


def junit_xml(report, elapsed: float) -> str:
    failures = report.failures()
    lines = ['<?xml version="1.0" encoding="utf-8"?>',
             f'<testsuite name="mmparity" tests="{len(report.results)}" failures="{len(failures)}" '
             f'time="{elapsed:.3f}">']
    for r in report.results:
        # Every name is the report's own text (a family, a check, a module, an error message):
        # escaped for XML, with what XML cannot hold written as its escape (_xml_safe).
        name = _attr(r.check)
        classname = "mmparity." + str(r.family) + ("" if r.impl == "native" else "." + str(r.impl))
        lines.append(f'  <testcase classname={_attr(classname)} name={name}>')
        if not r.passed:
            div = r.first_divergence
            where = div.module if div else r.check
            message = f"first divergence at {where}: {div.metrics if div and not r.metrics else r.metrics}"
            lines.append(f"    <failure message={_attr(message)}>{escape(_xml_safe(r.tolerance))}</failure>")
        lines.append("  </testcase>")
    lines.append("</testsuite>")
    # ASCII with character references: the file reads back the same whatever the locale's encoding.
    return ("\n".join(lines) + "\n").encode("ascii", "xmlcharrefreplace").decode("ascii")
