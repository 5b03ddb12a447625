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


def _fmt_cosine(value) -> str:
    """A cosine that differs from 1 never reads as ``1``: up to six digits (0.99996), and beyond
    them its distance from 1 with its exponent (``1-4.2e-09``), as narrow as the other numbers."""
    if not isinstance(value, float) or value != value or value in (float("inf"), float("-inf")):
        return _fmt(value)
    if value >= 1.0:  # above 1 only by rounding: nothing to tell
        return "1"
    for digits in range(3, 7):
        text = f"{value:.{digits}g}"
        if float(text) != 1.0:
            return text
    return f"1-{1.0 - value:.2g}"


# The table's spelling of numbers, for the other renderings of a report (the HTML page).
number_text, cosine_text = _fmt, _fmt_cosine


def _where_and_why(result) -> tuple[str, str]:
    """(where a failing result first departs, why: the metric against its bound, or the error)."""
    div = result.first_divergence
    if div is None:  # failed with no module or output named: its own numbers
        return result.check, _over_bound(result.metrics, result.tolerance)
    return div.module, _divergence_detail(div.metrics, div.tolerance)


def _over_bound(metrics: dict, tolerance: dict) -> str:
    bound = (tolerance or {}).get("rel_l2")
    return f"rel_l2 {_fmt(metrics.get('rel_l2'))}" + ("" if bound is None else f" > tolerance {_fmt(bound)}")


def _divergence_detail(metrics: dict, tolerance: dict | None = None) -> str:
    if "error" in metrics:
        return str(metrics["error"])
    verdict = metrics.get("router")
    if verdict is not None and verdict["disagreements"]:
        return (f"{verdict['disagreements']} of {verdict['tokens']} tokens routed to other experts, "
                f"score gap up to {_fmt(verdict['worst_gap'])} (a tie is <= {_fmt(verdict['tie_tolerance'])})")
    return _over_bound(metrics, tolerance)


def router_summaries(report) -> list:
    """One summary per router check (``CASE:router``, a result of its own): the MoE layers'
    verdicts added up, which layers fail, and the index of its result."""
    from mmparity.parity.report import is_router, routes_alike

    summaries = []
    for index, r in enumerate(report.results):
        totals = r.metrics.get("router") if isinstance(r.metrics, dict) else None
        if not isinstance(totals, dict):
            continue
        rows = [row for row in r.modules if is_router(str(row.get("module", "")))]
        summaries.append({"family": r.family, "impl": r.impl, "check": r.check, "index": index,
                          "layers": totals.get("layers", len(rows)), "tokens": totals.get("tokens", 0),
                          "same_experts": totals.get("same_experts", 0), "ties": totals.get("ties", 0),
                          "allowed": totals.get("allowed", 0), "passed": r.passed,
                          "failing": [row["module"] for row in rows if not routes_alike(row)],
                          "errors": [f"{row['module']}: {row['error']}" for row in rows if "error" in row]})
    return summaries


def _router_line(summary: dict) -> str:
    moved = summary["tokens"] - summary["same_experts"] - summary["ties"]
    line = (f"{summary['layers']} MoE layer(s): {summary['same_experts']} of {summary['tokens']} token routings "
            f"to HF's experts, {summary['ties']} tie(s), {moved} to other experts")
    if summary.get("allowed"):
        line += f" (up to {summary['allowed']} allowed: twice HF's own at this dtype)"
    if summary["failing"]:
        line += f"; first failing {summary['failing'][0]}"
    if summary["errors"]:
        line += f"; {summary['errors'][0]}"
    return line


def _fact_lines(facts: list, width) -> list:
    """Facts joined by `` · `` into lines no wider than a terminal's ``width``, broken between
    facts rather than inside one (a fact wider than the terminal still folds on its own line);
    off a terminal (``width`` None), one line for grep."""
    if width is None:
        return [" · ".join(facts)]
    lines: list = []
    for fact in facts:
        if lines and len(lines[-1]) + 3 + len(fact) <= width:
            lines[-1] += " · " + fact
        else:
            lines.append(fact if not lines else "  " + fact)
    return lines


def print_report(report, elapsed: float, quiet: bool = False, stream=None) -> None:
    """The table people read. Nothing in it is cut at any width: names and numbers fold rather
    than end in an ellipsis, and where a check fails, the module where it first departs and by
    how much are on a line of their own under the table, as wide as the terminal."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    # Off a terminal rich would wrap at 80 columns: a file or pipe gets long lines instead.
    is_tty = bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())
    console = Console(file=stream, highlight=False, width=None if is_tty else 200)
    # A line under the table wraps at a terminal's edge (a long name folds, never cut); in a file
    # or pipe it stays one line, whole, for grep.
    whole = {"overflow": "fold"} if is_tty else {"soft_wrap": True}
    if not quiet:
        facts = ["mmparity check", str(report.device), str(report.dtype), f"TP {report.tp}", f"PP {report.pp}",
                 f"EP {getattr(report, 'ep', 1)}", f"attention {report.attention_backend}", f"seed {report.seed}"]
        for line in _fact_lines(facts, console.width if is_tty else None):
            console.print(_console_text(line), **whole)
        if report.megatron is not None:
            classes = [f"{family}: {name}" for family, name in report.megatron["classes"].items()]
            for line in _fact_lines([f"Megatron {report.megatron['version']} ({report.megatron['te']})", *classes],
                                    console.width if is_tty else None):
                console.print(_console_text(line), **whole)
        # Each family (and, beside Megatron's class, whose model) heads its own rows rather than
        # filling a column: the check names get the width.
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
        with_impl = report.impl != "native"
        table.add_column("check", overflow="fold")
        table.add_column("result", no_wrap=True)
        # Numbers are never wrapped, folded or cut: a column is as wide as its widest number.
        numbers = ("rel_l2", "max_abs", "cosine", "tolerance\n(rel_l2)")
        groups: dict = {}
        routers = {s["index"]: s for s in router_summaries(report)}
        for r in report.results:
            rows = groups.setdefault((r.family, r.impl if with_impl else None), [])
            rows.append((r.check, r.passed, (_fmt(r.metrics.get("rel_l2")), _fmt(r.metrics.get("max_abs")),
                                             _fmt_cosine(r.metrics.get("cosine")), _fmt(r.tolerance.get("rel_l2")))))
        every = [row for rows in groups.values() for row in rows]
        for i, name in enumerate(numbers):
            widest = max([len(row[2][i]) for row in every] + [max(map(len, name.split("\n")))])
            table.add_column(name, justify="right", no_wrap=True, width=widest)
        for (family, impl), rows in groups.items():
            head = str(family) if impl is None else f"{family} · {impl}"
            table.add_row(Text(_console_text(head).plain, style="bold"))
            for check, passed, cells in rows:
                table.add_row(Text("  ") + _console_text(check), "[green]pass[/]" if passed else "[red]FAIL[/]",
                              *cells)
        console.print(table)
        # Under the table, per failing check (those failing at the same place together): where it
        # first departs, on a line of its own, then by how much, beside it where the width allows.
        entries = []
        for index, r in enumerate(report.results):
            if r.passed or index in routers:  # a router check's line below says where and how
                continue
            where, why = _where_and_why(r)
            key = (r.family, r.impl, where, why)
            if entries and entries[-1][0] == key:
                entries[-1][1].append(r.check)
            else:
                entries.append((key, [r.check]))
        lines = []
        for (family, impl, where, why), checks in entries:
            lines.append(f"FAIL {family}{' · ' + impl if with_impl else ''} {', '.join(checks)}: first divergence at")
            both = f"  {where}  {why}"
            lines += [both] if len(both) <= console.width else [f"  {where}", f"  {why}"]
        for summary in routers.values():
            lines.append(f"{'pass' if summary['passed'] else 'FAIL'} {summary['family']}"
                         f"{' · ' + summary['impl'] if with_impl else ''} {summary['check']}: {_router_line(summary)}")
        for line in lines:
            console.print(_console_text(line), **whole)
        if report.megatron is not None:
            for family, note in report.megatron.get("notes", {}).items():
                console.print(_console_text(f"note: {family}: {report.megatron['classes'][family]}: {note}"),
                              **whole)
    failed = report.failures()
    status = "passed" if report.passed else "FAILED"
    console.print(Text(f"{len(report.results) - len(failed)} passed, {len(failed)} failed "
                       f"({status}, {elapsed:.1f}s)"))


def _pairs(values: dict) -> str:
    return ", ".join(f"{key} ({_pairs(value)})" if isinstance(value, dict)
                     else f"{key} {_fmt_cosine(value) if key == 'cosine' else _fmt(value)}"
                     for key, value in (values or {}).items())


def _failure_body(result) -> str:
    """The failure's numbers, a line each: the check's own, its bound, and those of the module
    where it first departs."""
    lines = [f"{result.family} {result.check}: {_pairs(result.metrics) or 'no metrics'}",
             f"tolerance: {_pairs(result.tolerance)}"]
    div = result.first_divergence
    if div is not None:
        lines.append(f"first divergence at {div.module}: {_pairs(div.metrics)}")
    return "\n".join(lines)


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
        time = "" if r.seconds is None else f' time="{r.seconds:.3f}"'
        lines.append(f'  <testcase classname={_attr(classname)} name={name}{time}>')
        if not r.passed:
            where, why = _where_and_why(r)
            message = f"first divergence at {where}: {why}"
            lines.append(f"    <failure message={_attr(message)}>{escape(_xml_safe(_failure_body(r)))}</failure>")
        lines.append("  </testcase>")
    lines.append("</testsuite>")
    # ASCII with character references: the file reads back the same whatever the locale's encoding.
    return ("\n".join(lines) + "\n").encode("ascii", "xmlcharrefreplace").decode("ascii")


def usage_error_junit(line: str) -> str:
    """JUnit XML of a refused command: one errored testcase carrying its one-line error, so CI shows
    a failed test rather than no report."""
    return ('<?xml version="1.0" encoding="utf-8"?>\n'
            '<testsuite name="mmparity" tests="1" failures="0" errors="1" time="0.000">\n'
            '  <testcase classname="mmparity.check" name="usage">\n'
            f'    <error type="usage" message={_attr(line)}>{escape(_xml_safe(line))}</error>\n'
            '  </testcase>\n'
            '</testsuite>\n').encode("ascii", "xmlcharrefreplace").decode("ascii")
