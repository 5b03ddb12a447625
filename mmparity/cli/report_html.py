"""The HTML page of a parity report: where the error grows along the model, as a picture.

One self-contained file (its styles inline, its plots inline SVG drawn by matplotlib, nothing
fetched): the run's facts, then per family and case the relative error of every paired module in
model order on a log scale, the model's parts shaded (tower, merger/projector, decoder), the
tolerance, the first divergence marked and named, router agreement per MoE layer, and the table.

It is drawn from the report's JSON form (what ``check --json`` writes), so that ``check --html``
and ``report SAVED.json --html`` make the same page. matplotlib is imported only here, and only
when a page with plots is drawn: a plain ``check`` never pays for it.
"""

from __future__ import annotations

import html
import io
import math
import os

from mmparity.cli.common import UsageError

INSTALL_HINT = "pip install 'mmparity[report]'"

# The parts a whole VLM is made of, in Megatron's LLaVAModel names, and how each is shaded.
TOWER, PROJECTOR, DECODER = "tower", "merger / projector", "decoder"
PART_COLOURS = {TOWER: "#dbe9f6", PROJECTOR: "#fbe3c8", DECODER: "#dcefd9"}
# Past this many paired modules, the axis names every n-th (and the first divergence) only.
MAX_TICK_LABELS = 60


def require_matplotlib() -> None:
    """A usage error, before any work, when matplotlib is missing (found, not imported)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a stand-in module without a spec: treat as missing
        found = False
    if not found:
        raise UsageError(f"--html needs matplotlib, which is not installed: {INSTALL_HINT}")


def _writable(xdg: str, default: str) -> bool:
    try:
        base = os.environ.get(xdg) or os.path.join(os.path.expanduser("~"), default)
        target = os.path.join(base, "matplotlib")
        os.makedirs(target, exist_ok=True)
        return os.access(target, os.W_OK | os.X_OK)
    except (OSError, RuntimeError):
        return False


def _private_config_dir() -> None:
    """matplotlib writes its font cache under its config and cache directories and warns when it
    cannot (a read-only home, a CI user without one): give it a private temporary one then."""
    if os.environ.get("MPLCONFIGDIR"):
        return
    if _writable("XDG_CONFIG_HOME", ".config") and _writable("XDG_CACHE_HOME", ".cache"):
        return
    import atexit
    import shutil
    import tempfile

    private = tempfile.mkdtemp(prefix="mmparity-matplotlib-")
    os.environ["MPLCONFIGDIR"] = private
    atexit.register(shutil.rmtree, private, True)


def _matplotlib():
    """(matplotlib, its Figure class), imported now; a usage error naming the install if missing."""
    _private_config_dir()
    os.environ.setdefault("MPLBACKEND", "Agg")  # never a GUI backend, whatever the environment says
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(f"--html needs matplotlib, which is not installed: {INSTALL_HINT}") from None
    return matplotlib, Figure


# --------------------------------------------------------------------------------------------------
# text


def _plain(text) -> str:
    """A name from the report as display text: control characters (which no page should carry)
    shown as their escapes, ``\\x07``."""
    text = str(text)
    return "".join(ch if ch in "\t\n" or not (ord(ch) < 0x20 or ord(ch) == 0x7F or 0xD800 <= ord(ch) <= 0xDFFF)
                   else f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}" for ch in text)


def _h(text) -> str:
    """Report text as HTML text (and attribute value): escaped, quotes included."""
    return html.escape(_plain(text), quote=True)


def _number(value) -> str:
    from mmparity.cli.render import number_text

    return number_text(value)


def _cosine(value) -> str:
    from mmparity.cli.render import cosine_text

    return cosine_text(value)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --------------------------------------------------------------------------------------------------
# what the page shows, read off the report's JSON form


def part_of(module: str) -> str:
    """The part of the model a paired module belongs to, from its name: ``language_model.`` is the
    decoder; ``vision_projection`` and any merger or projector the merger / projector; the rest
    (``vision_model.``, a tower family's own modules) the tower."""
    head = str(module).split(".")
    if head[0] == "language_model":
        return DECODER
    if head[0] == "vision_model":
        head = head[1:]
    first = head[0] if head else ""
    if first == "vision_projection" or "merger" in first or "projector" in first:
        return PROJECTOR
    return TOWER


def cases(data: dict) -> list:
    """The report's results grouped by (family, impl, case), in order: a case is what comes before
    the first ``:`` of a check's name (``sample`` of ``sample:logits``); every output of a case
    carries the same paired modules."""
    groups: dict = {}
    for index, result in enumerate(data.get("results") or []):
        key = (result["family"], result.get("impl", "native"), str(result["check"]).split(":", 1)[0])
        groups.setdefault(key, []).append(index)
    return [(key, indices) for key, indices in groups.items()]


def _case_modules(results: list) -> list:
    return next((r["modules"] for r in results if r.get("modules")), [])


def _divergences(results: list) -> list:
    """(module, [checks]) for each distinct first divergence of a case's failing results, in order."""
    found: dict = {}
    for r in results:
        div = r.get("first_divergence")
        if not r.get("passed") and div:
            found.setdefault(div["module"], []).append(r["check"])
    return list(found.items())


def _bound(value):
    """A module row's or a result's bound on rel_l2 (a number, or a ``{"rel_l2": ...}`` map)."""
    if isinstance(value, dict):
        value = value.get("rel_l2")
    return value if _finite(value) else None


def _why(metrics: dict, tolerance) -> str:
    metrics = metrics or {}
    if "error" in metrics:
        return str(metrics["error"])
    verdict = metrics.get("router")
    if isinstance(verdict, dict) and verdict.get("disagreements"):
        return f"{verdict['disagreements']} of {verdict.get('tokens')} tokens routed to other experts"
    rel = metrics.get("rel_l2")
    if rel is None and "rel_l2" in (metrics.get("non_finite") or {}):
        rel_text = metrics["non_finite"]["rel_l2"]
    else:
        rel_text = _number(rel)
    bound = _bound(tolerance)
    return f"rel_l2 {rel_text}" + ("" if bound is None else f" > tolerance {_number(bound)}")


def routers(modules: list) -> list:
    """The paired modules that are MoE routers (their rows carry a ``router`` verdict)."""
    return [m for m in modules if isinstance((m.get("metrics") or {}).get("router"), dict)]


# --------------------------------------------------------------------------------------------------
# the plot


def _points(modules: list) -> tuple:
    """(rel_l2 per module, finite and > 0 or None; which are exact zeros; which are not finite)."""
    values, zeros, broken = [], [], []
    for i, m in enumerate(modules):
        metrics = m.get("metrics") or {}
        rel = metrics.get("rel_l2")
        if _finite(rel) and rel > 0:
            values.append(float(rel))
            continue
        values.append(None)
        if _finite(rel):
            zeros.append(i)
        else:  # null (NaN, infinite, or an error): a divergence all the same
            broken.append(i)
    return values, zeros, broken


def plot_svg(modules: list, marked: str | None) -> str:
    """The case's relative error per paired module as inline SVG (matplotlib)."""
    matplotlib, Figure = _matplotlib()
    names = [_plain(m.get("module", "?")) for m in modules]
    values, zeros, broken = _points(modules)
    bounds = [_bound(m.get("tolerance")) for m in modules]
    known = [v for v in values if v is not None] + [b for b in bounds if b is not None and b > 0]
    low = min(known) / 30 if known else 1e-12
    high = max(known) * 30 if known else 1.0
    x = list(range(len(modules)))
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "mmparity", "font.size": 9,
                                "axes.titlesize": 10}):
        fig = Figure(figsize=(11, 5.2))
        ax = fig.add_subplot()
        ax.set_yscale("log")
        ax.set_ylim(low, high)
        ax.set_xlim(-0.5, len(modules) - 0.5)
        # The parts as shaded spans, each named at the top.
        start = 0
        for i in range(1, len(modules) + 1):
            if i == len(modules) or part_of(names[i]) != part_of(names[start]):
                part = part_of(names[start])
                ax.axvspan(start - 0.5, i - 0.5, color=PART_COLOURS[part], zorder=0, linewidth=0)
                ax.text((start + i - 1) / 2, 1.01, part, transform=ax.get_xaxis_transform(), ha="center",
                        va="bottom", fontsize=8, color="#444444", parse_math=False)
                start = i
        ax.plot([i for i in x if values[i] is not None], [v for v in values if v is not None],
                color="#777777", linewidth=0.8, zorder=2)
        passed = [bool(m.get("passed")) for m in modules]
        router = {id(m) for m in routers(modules)}
        for ok, colour, label in ((True, "#1f5fa8", "within tolerance"), (False, "#c62828", "over tolerance")):
            for is_router, marker, kind in ((False, "o", ""), (True, "D", " (router weights)")):
                xs = [i for i in x if values[i] is not None and passed[i] == ok
                      and (id(modules[i]) in router) == is_router]
                if xs:
                    ax.scatter(xs, [values[i] for i in xs], color=colour, marker=marker, s=22, zorder=3,
                               label=label + kind)
        if zeros:
            ax.scatter(zeros, [low * 1.5] * len(zeros), facecolors="none", edgecolors="#1f5fa8", s=22,
                       zorder=3, label="exactly 0 (drawn at the bottom)")
        if broken:
            ax.scatter(broken, [high / 1.5] * len(broken), marker="x", color="#c62828", s=40, zorder=3,
                       label="not finite or failed to compare (drawn at the top)")
        if any(b is not None for b in bounds):
            edges = [i - 0.5 for i in x] + [len(modules) - 0.5]
            steps = [b if b is not None else math.nan for b in bounds]
            ax.stairs(steps, edges, color="#222222", linestyle="--", linewidth=1.1, zorder=2,
                      label="tolerance (bound on rel_l2)")
        if marked is not None and marked in names:
            at = names.index(marked)
            ax.axvline(at, color="#c62828", linewidth=1.5, zorder=1)
            ax.annotate("first divergence", (at, high / 4), xytext=(6, 0), textcoords="offset points",
                        color="#c62828", fontsize=9, fontweight="bold", va="center", parse_math=False)
        step = max(1, math.ceil(len(modules) / MAX_TICK_LABELS))
        ticks = sorted(set(range(0, len(modules), step)) | ({names.index(marked)} if marked in names else set()))
        ax.set_xticks(ticks, [names[i] for i in ticks], rotation=90, fontsize=7, parse_math=False)
        for tick, i in zip(ax.get_xticklabels(), ticks):
            if names[i] == marked:
                tick.set_color("#c62828")
                tick.set_fontweight("bold")
        ax.set_ylabel("relative error (rel_l2)")
        ax.grid(axis="y", which="major", color="#cccccc", linewidth=0.5)
        ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg", bbox_inches="tight",
                    metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = buffer.getvalue()
    return svg[svg.index("<svg"):].strip()  # inline: no XML prologue, no DOCTYPE


# --------------------------------------------------------------------------------------------------
# the page


STYLE = """
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ccc; }
h3 { font-size: 15px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0 16px; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
td.num { text-align: right; font-family: monospace; }
.pass { color: #1b7d2b; font-weight: bold; } .fail { color: #c62828; font-weight: bold; }
.verdict { font-size: 15px; } code { font-size: 13px; overflow-wrap: anywhere; }
.first-divergence { color: #c62828; font-weight: bold; }
.error { background: #fdecea; border: 1px solid #c62828; padding: 8px; }
.plot svg { max-width: 100%; height: auto; }
"""

HEADER_ORDER = ("versions", "device", "dtype", "tp", "pp", "ep", "attention_backend", "seed", "impl", "megatron")


def _fact(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{_plain(k)} {_fact(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_fact(v) for v in value)
    return "-" if value is None else str(value)


def _facts(data: dict) -> list:
    """The run's facts: every member of the report but its results, the known ones first."""
    keys = [k for k in HEADER_ORDER if k in data]
    keys += [k for k in data if k not in keys and k not in ("results", "result_seconds", "passed", "error")]
    rows = []
    for key in keys:
        if key in ("pp", "ep"):
            continue  # on the row of tp
        if key == "tp":
            rows.append(f"<tr><th>TP / PP / EP</th><td>{_h(_fact(data['tp']))} / {_h(_fact(data.get('pp', 1)))} / "
                        f"{_h(_fact(data.get('ep', 1)))}</td></tr>")
        else:
            rows.append(f"<tr><th>{_h(key)}</th><td>{_h(_fact(data[key]))}</td></tr>")
    return ["<h2>What ran</h2>", '<table class="facts">', *rows, "</table>"] if rows else []


def _router_table(rows: list) -> list:
    out = ["<h4>Router agreement per MoE layer</h4>",
           "<table class=\"routers\"><tr><th>router</th><th>result</th><th>tokens</th><th>same experts as HF</th>"
           "<th>ties</th><th>to other experts</th><th>worst score gap</th><th>weights rel_l2</th></tr>"]
    for m in rows:
        verdict = m["metrics"]["router"]
        ok = bool(m.get("passed"))
        out.append(f"<tr><td><code>{_h(m.get('module'))}</code></td>"
                   f"<td class=\"{'pass' if ok else 'fail'}\">{'pass' if ok else 'FAIL'}</td>"
                   + "".join(f'<td class="num">{_h(_number(verdict.get(k)))}</td>'
                             for k in ("tokens", "same_experts", "ties", "disagreements", "worst_gap"))
                   + f'<td class="num">{_h(_number(m["metrics"].get("rel_l2")))}</td></tr>')
    out.append("</table>")
    return out


def _case_section(case: str, results: list, plots: bool) -> list:
    out = [f"<h3>case <code>{_h(case)}</code></h3>"]
    modules = _case_modules(results)
    divergences = _divergences(results)
    failing = [r for r in results if not r.get("passed")]
    marked = None
    if divergences:
        (module, checks), *others = divergences
        marked = _plain(module)
        row = next((m for m in modules if m.get("module") == module), None)
        first = next(r for r in failing if r.get("first_divergence") and r["first_divergence"]["module"] == module)
        why = _why(row.get("metrics") if row else first["first_divergence"].get("metrics"),
                   row.get("tolerance") if row else first["first_divergence"].get("tolerance"))
        out.append(f'<p class="verdict fail">First divergence: <code class="first-divergence" '
                   f'data-module="{_h(module)}">{_h(module)}</code> ({_h(why)}), in '
                   f"{_h(', '.join(checks))}</p>")
        for other, checks in others:
            out.append(f'<p class="verdict fail">Also first divergence of {_h(", ".join(checks))}: '
                       f'<code class="first-divergence">{_h(other)}</code></p>')
    elif failing:
        out.append(f'<p class="verdict fail">Failed: {_h(", ".join(r["check"] for r in failing))} '
                   f"({_h(_why(failing[0].get('metrics'), failing[0].get('tolerance')))})</p>")
    else:
        out.append(f'<p class="verdict pass">Passed: every output'
                   + (f" and all {len(modules)} paired modules" if modules else "") + " within tolerance.</p>")
    if modules and plots:
        out.append(f'<div class="plot">{plot_svg(modules, marked)}</div>')
    elif not modules:
        out.append("<p>No paired modules in this case (a component or output check): see the table.</p>")
    router_rows = routers(modules)
    if router_rows:
        out += _router_table(router_rows)
    return out


def _table(data: dict) -> list:
    seconds = data.get("result_seconds") or []
    out = ["<h2>All results</h2>",
           "<table class=\"results\"><tr><th>family</th><th>check</th><th>result</th><th>rel_l2</th>"
           "<th>max_abs</th><th>cosine</th><th>tolerance (rel_l2)</th><th>seconds</th>"
           "<th>first divergence</th></tr>"]
    for index, r in enumerate(data.get("results") or []):
        metrics, ok = r.get("metrics") or {}, bool(r.get("passed"))
        div = r.get("first_divergence")
        family = r["family"] if r.get("impl", "native") == "native" else f"{r['family']} · {r['impl']}"
        time = seconds[index] if index < len(seconds) else None
        cells = [_number(metrics.get("rel_l2")), _number(metrics.get("max_abs")), _cosine(metrics.get("cosine")),
                 _number(_bound(r.get("tolerance"))), "-" if not _finite(time) else f"{time:.3f}"]
        out.append(f"<tr><td>{_h(family)}</td><td><code>{_h(r['check'])}</code></td>"
                   f"<td class=\"{'pass' if ok else 'fail'}\">{'pass' if ok else 'FAIL'}</td>"
                   + "".join(f'<td class="num">{_h(c)}</td>' for c in cells)
                   + f"<td>{'' if not div else '<code>' + _h(div['module']) + '</code>'}</td></tr>")
    out.append("</table>")
    return out


def render(data: dict, plots: bool = True) -> str:
    """The page of a report in its JSON form (validated: :func:`mmparity.cli.report.load_report`).
    ``plots=False`` leaves the plots out (no matplotlib needed)."""
    results = data.get("results") or []
    failed = [r for r in results if not r.get("passed")]
    passed = bool(data.get("passed")) and not failed and bool(results)
    summary = f"{len(results) - len(failed)} passed, {len(failed)} failed"
    body = ["<h1>mmparity check</h1>",
            f'<p class="verdict {"pass" if passed else "fail"}">{"PASSED" if passed else "FAILED"}: {_h(summary)}</p>']
    if data.get("error"):
        body.append(f'<p class="error">The check was refused: <code>{_h(data["error"])}</code></p>')
    body += _facts(data)
    current = None
    for (family, impl, case), indices in cases(data):
        if (family, impl) != current:
            current = (family, impl)
            body.append(f"<h2>{_h(family)}{'' if impl == 'native' else ' · ' + _h(impl)}</h2>")
        body += _case_section(case, [results[i] for i in indices], plots)
    if results:
        body += _table(data)
    page = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
            f"<title>mmparity check: {_h(summary)}</title>", f"<style>{STYLE}</style></head><body>",
            *body, "</body></html>", ""]
    # ASCII with character references: the file reads the same whatever the locale's encoding.
    return "\n".join(page).encode("ascii", "xmlcharrefreplace").decode("ascii")


def error_page(message: str) -> str:
    """The page of a refused command: its one-line error (no plots, no matplotlib)."""
    return render({"passed": False, "error": message, "results": []}, plots=False)


def write_html(path: str, data: dict, option: str = "--html") -> None:
    from mmparity.cli.common import write_text_atomic

    write_text_atomic(str(path), render(data), option)
