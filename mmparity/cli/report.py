"""``mmparity report``: a saved ``check --json`` report (a CI artifact) as the terminal table, and
with ``--html`` as the page with the error plotted along the model (cli/report_html.py).

It reads data only: no torch, no model code, and matplotlib only for ``--html``.
"""

from __future__ import annotations

import json
import os
import stat
import sys

from mmparity.cli.common import EXIT_OK, UsageError, check_output_path

# A check's report is a few kB per result even for the largest models (a row per paired module):
# anything far past this is no such report, and is refused before it is read.
MAX_REPORT_BYTES = 64 * 2**20


def add_arguments(parser) -> None:
    parser.add_argument("result", metavar="RESULT.json",
                        help="a report that `mmparity check --json` wrote")
    parser.add_argument("--html", metavar="PATH",
                        help="also write the report as one self-contained HTML page: the relative error "
                             "of each paired module along the model, plotted (needs matplotlib: "
                             "pip install 'mmparity[report]')")
    parser.add_argument("--quiet", action="store_true", help="only the summary line")


def read_report(path: str, option: str = "") -> dict:
    """The JSON object of a ``check --json`` report at ``path``, checked for the members the
    renderings read; a usage error naming the file otherwise (missing, not a file, too large, not
    UTF-8 JSON, another shape)."""
    where = f"{option} {path}" if option else str(path)
    try:
        info = os.stat(path)
    except OSError as exc:
        raise UsageError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if not stat.S_ISREG(info.st_mode):  # a directory, or a FIFO that would block the read
        raise UsageError(f"{where}: not a regular file; give the JSON file `mmparity check --json` wrote")
    if info.st_size > MAX_REPORT_BYTES:
        raise UsageError(f"{where}: {info.st_size} bytes, more than a check report's bound of "
                         f"{MAX_REPORT_BYTES}; is it the file `mmparity check --json` wrote?")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_REPORT_BYTES + 1)  # a file that grew since stat is bounded all the same
    except OSError as exc:
        raise UsageError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if len(raw) > MAX_REPORT_BYTES:
        raise UsageError(f"{where}: more than a check report's bound of {MAX_REPORT_BYTES} bytes")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"{where}: not JSON (not UTF-8 text); give the file `mmparity check --json` wrote") from None
    except (ValueError, RecursionError) as exc:
        detail = f" ({exc.msg} at line {exc.lineno} column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise UsageError(f"{where}: not JSON{detail}; give the file `mmparity check --json` wrote") from None
    problem = shape_problem(data)
    if problem:
        raise UsageError(f"{where}: not a `mmparity check --json` report: {problem}")
    return data


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _metrics_problem(metrics, where: str) -> str | None:
    if not isinstance(metrics, dict):
        return f"{where} is not an object"
    for key in ("rel_l2", "max_abs", "mean_abs", "cosine"):
        if key in metrics and not _is_number(metrics[key]):
            return f"{where}.{key} is not a number"
    return None


def shape_problem(data) -> str | None:
    """What of a report's shape the renderings cannot read (None when nothing): the header's
    scalars, and each result's names, verdict, metrics, first divergence and paired modules."""
    if not isinstance(data, dict):
        return "the top level is not an object"
    if not isinstance(data.get("results"), list):
        return "it has no list of results"
    for key in ("device", "dtype", "attention_backend", "impl", "error"):
        if key in data and not isinstance(data[key], str):
            return f"{key} is not a string"
    for key in ("seed", "tp", "pp", "ep"):
        if key in data and data[key] is not None and not _is_int(data[key]):
            return f"{key} is not an integer"
    for key in ("versions", "megatron"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            return f"{key} is not an object"
    megatron = data.get("megatron")
    if megatron is not None and not isinstance(megatron.get("classes"), dict):
        return "megatron.classes is not an object"
    seconds = data.get("result_seconds")
    if seconds is not None and (not isinstance(seconds, list) or not all(map(_is_number, seconds))):
        return "result_seconds is not a list of numbers"
    for i, r in enumerate(data["results"]):
        at = f"results[{i}]"
        if not isinstance(r, dict):
            return f"{at} is not an object"
        for key in ("family", "check"):
            if not isinstance(r.get(key), str):
                return f"{at}.{key} is not a string"
        if "impl" in r and not isinstance(r["impl"], str):
            return f"{at}.impl is not a string"
        if not isinstance(r.get("passed"), bool):
            return f"{at}.passed is not true or false"
        problem = _metrics_problem(r.get("metrics"), f"{at}.metrics")
        if problem:
            return problem
        if not isinstance(r.get("tolerance"), dict):
            return f"{at}.tolerance is not an object"
        div = r.get("first_divergence")
        if div is not None:
            if not isinstance(div, dict) or not isinstance(div.get("module"), str):
                return f"{at}.first_divergence has no module name"
            problem = _metrics_problem(div.get("metrics", {}), f"{at}.first_divergence.metrics")
            if problem:
                return problem
        modules = r.get("modules", [])
        if not isinstance(modules, list):
            return f"{at}.modules is not a list"
        for j, m in enumerate(modules):
            if not isinstance(m, dict) or not isinstance(m.get("module"), str):
                return f"{at}.modules[{j}] has no module name"
            problem = _metrics_problem(m.get("metrics", {}), f"{at}.modules[{j}].metrics")
            if problem:
                return problem
            if not _is_number(m.get("tolerance")) and not isinstance(m.get("tolerance"), dict):
                return f"{at}.modules[{j}].tolerance is not a number"
    return None


def as_report(data: dict):
    """The :class:`~mmparity.parity.report.Report` a (shape-checked) JSON report was written from,
    for the terminal table."""
    from mmparity.parity.report import Divergence, Report, Result

    report = Report(device=data.get("device", "?"), dtype=data.get("dtype", "?"), seed=data.get("seed", "?"),
                    attention_backend=data.get("attention_backend", "?"), versions=data.get("versions") or {},
                    tp=data.get("tp", 1), pp=data.get("pp", 1), ep=data.get("ep", 1),
                    impl=data.get("impl", "native"), megatron=data.get("megatron"))
    seconds = data.get("result_seconds") or []
    for i, r in enumerate(data["results"]):
        div = r.get("first_divergence")
        report.results.append(Result(
            family=r["family"], check=r["check"], passed=r["passed"], metrics=r["metrics"],
            tolerance=r["tolerance"], description=r.get("description", ""), modules=r.get("modules", []),
            impl=r.get("impl", "native"), seconds=seconds[i] if i < len(seconds) else None,
            first_divergence=None if div is None else Divergence(div["module"], div.get("metrics") or {},
                                                                 div.get("tolerance") or {})))
    return report


def refuse_same_paths(paths: dict) -> None:
    """Two of a command's files (``{option: path}``; None where not given) that are one file: a
    report would overwrite its input, or another report."""
    seen: dict = {}
    for option, path in paths.items():
        if not path:
            continue
        key = os.path.realpath(path)
        for other, other_key in seen.items():
            same = key == other_key
            if not same and os.path.exists(path) and os.path.exists(paths[other]):
                same = os.path.samefile(path, paths[other])
            if same:
                raise UsageError(f"{option} {path}: is the same file as {other} {paths[other]}; name another file")
        seen[option] = key


def run(args) -> int:
    if args.html:
        check_output_path("--html", args.html)
        refuse_same_paths({"RESULT.json": args.result, "--html": args.html})
    data = read_report(args.result)
    if args.html:
        from mmparity.cli.report_html import require_matplotlib, write_html

        require_matplotlib()
        write_html(args.html, data)
    from mmparity.cli.render import print_report

    report = as_report(data)
    if data.get("error") and not args.quiet:
        print(f"the check was refused: {data['error']}")
    elapsed = sum(s for s in (data.get("result_seconds") or []) if isinstance(s, (int, float)))
    print_report(report, elapsed, quiet=args.quiet, stream=sys.stdout)
    return EXIT_OK
