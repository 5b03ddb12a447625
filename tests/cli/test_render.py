"""What a person reads: the check table at 80 and 120 columns never cuts a module name or a number,
says what ran (device, dtype, TP/PP/EP, attention backend) and sums up router agreement; `list`
fits 80 columns at two lines a family; JUnit failures are one readable line with a time per case.

The terminal tests run the real CLI in a pseudo-terminal of 80 columns, as a user's shell does."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest

from mmparity.cli import render
from mmparity.cli.main import main
from mmparity.models import registry as families
from mmparity.parity.report import Divergence, Report, Result
from tests.cli import terminal
from tests.cli.terminal import ANSI, run_in_pty, widest

DEEP = "language_model.decoder.layers.1.mlp.linear_fc1"


# --------------------------------------------------------------------------------------------------
# the real CLI, a perturbed MLP weight in a Mistral3 decoder layer, an 80-column terminal

@pytest.fixture(scope="module")
def perturbed_mistral3(tmp_path_factory):
    """A tiny Mistral3's conversion and an HF copy whose layer-1 MLP weight is perturbed."""
    return terminal.perturbed_mistral3(tmp_path_factory.mktemp("mistral3"),
                                       "language_model.model.layers.1.mlp.down_proj.weight", seed=3, noise_seed=7)


def test_a_failing_check_at_80_columns_shows_the_first_divergence_and_numbers_whole(perturbed_mistral3, tmp_path):
    mcore, perturbed = perturbed_mistral3
    report_path = tmp_path / "report.json"
    code, shown = run_in_pty("check", "mistral3", "--mcore", mcore, "--hf", perturbed, "--no-components",
                             "--json", report_path)
    assert code == 1, shown
    report = json.loads(report_path.read_text())
    failing = [r for r in report["results"] if not r["passed"]]
    assert failing, report
    module = failing[0]["first_divergence"]["module"]
    assert module.startswith("language_model.decoder.layers.1"), module
    assert "…" not in shown and widest(shown) <= 80, shown
    lines = shown.splitlines()
    # The whole name on one line, with the metric and its bound.
    rel_l2 = failing[0]["first_divergence"]["metrics"]["rel_l2"]
    assert any(module in line for line in lines), shown
    assert f"rel_l2 {rel_l2:.3g} > tolerance 1e-05" in shown, shown
    for result in report["results"]:
        row = next(line for line in lines if line.strip().startswith(result["check"] + " "))
        cells = row.split()
        assert cells[1] == ("pass" if result["passed"] else "FAIL"), row
        assert cells[2] == f"{result['metrics']['rel_l2']:.3g}" and cells[3] == f"{result['metrics']['max_abs']:.3g}"
        if result["metrics"]["cosine"] != 1.0:
            assert cells[4] != "1", row
    header = " ".join(lines[:3])
    for fact in ("cpu", "float32", "TP 1", "PP 1", "EP 1", "attention "):
        assert fact in header, header
    assert "(rel_l2)" in shown and "tolerance" in shown


# --------------------------------------------------------------------------------------------------
# the table itself, at 80 and 120 columns, from a report

class Terminal:
    """A stream that says it is a terminal (rich takes its width from COLUMNS)."""

    def __init__(self):
        self.parts = []

    def write(self, text):
        self.parts.append(text)
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return True

    def text(self) -> str:
        return ANSI.sub("", "".join(self.parts))


def _router_row(layer: int, tokens: int, same: int, ties: int, passed: bool) -> dict:
    return {"module": f"language_model.decoder.layers.{layer}.mlp.router",
            "metrics": {"rel_l2": 3.5e-7 * (layer + 1), "max_abs": 2.25e-7, "cosine": 1.0 - 4.2e-13,
                        "mean_abs": 1e-8,
                        "router": {"tokens": tokens, "same_experts": same, "fraction": same / tokens, "ties": ties,
                                   "disagreements": tokens - same - ties, "worst_gap": 0.0125 if not passed else 0.0,
                                   "tie_tolerance": 9.5e-7}},
            "tolerance": 1e-05, "passed": passed}


def _report(router_rows=()) -> Report:
    tol = {"rel_l2": 1e-05, "basis": "float32"}
    div = Divergence(DEEP, {"rel_l2": 0.008754, "max_abs": 0.03125, "cosine": 0.99996, "mean_abs": 0.002}, tol)
    logits = Result("mistral3", "image_text:logits", False,
                    {"rel_l2": 0.009721, "max_abs": 9.72e-06, "cosine": 0.999961, "mean_abs": 1.25e-06}, tol, div,
                    modules=list(router_rows))
    loss = Result("mistral3", "image_text:token_loss", False,
                  {"rel_l2": 0.00031, "max_abs": 1.5e-04, "cosine": 0.9999996, "mean_abs": 2e-05}, tol, div,
                  modules=list(router_rows))
    tower = Result("mistral3", "component:vision_projection", True,
                   {"rel_l2": 2.13e-07, "max_abs": 3.05e-09, "cosine": 1.0000000000000007, "mean_abs": 1e-9}, tol)
    routers = []
    if router_rows:  # the case's router check, as the harness adds it up from its layers' rows
        from types import SimpleNamespace

        from mmparity.parity.harness import router_result
        routers = [router_result("mistral3", SimpleNamespace(name="image_text", description=""), list(router_rows),
                                 list(router_rows), "native")]
    return Report(device="cpu", dtype="float32", seed=5, attention_backend="sdpa",
                  results=[logits, loss, *routers, tower], tp=2, pp=3, ep=4)


@pytest.mark.parametrize("columns", [80, 120])
def test_the_table_cuts_nothing_at_a_terminals_width(monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    stream = Terminal()
    render.print_report(_report(), 12.5, stream=stream)
    shown = stream.text()
    assert "…" not in shown and widest(shown) <= columns, shown
    assert any(DEEP in line for line in shown.splitlines()), shown
    for number in ("0.00972", "9.72e-06", "0.00031", "0.00015", "2.13e-07", "3.05e-09", "1e-05",
                   "  rel_l2 0.00875 > tolerance 1e-05"):
        assert number in shown, (number, shown)
    # Cosine: never a bare 1 where it is not exactly 1.
    assert "0.99996" in shown and "1-4e-07" in shown, shown
    tower_row = next(line for line in shown.splitlines() if "component:vision_projection" in line)
    assert tower_row.split()[4] == "1"  # a cosine above 1 is rounding: shown as 1
    for fact in ("cpu", "float32", "TP 2", "PP 3", "EP 4", "attention sdpa", "seed 5"):
        assert fact in shown.split("result")[0], (fact, shown)
    assert "(rel_l2)" in shown and "tolerance" in shown


def test_the_header_breaks_between_facts_at_80_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    report = _report()
    report.attention_backend = "sdpa (torch.nn.functional.scaled_dot_product_attention, math kernel)"
    stream = Terminal()
    render.print_report(report, 1.0, stream=stream)
    head = stream.text().split("result")[0].splitlines()
    assert len([line for line in head if line.strip()]) >= 2 and max(map(len, head)) <= 80, head
    facts = ("mmparity check", "cpu", "float32", "TP 2", "PP 3", "EP 4", f"attention {report.attention_backend}",
             "seed 5")
    for fact in facts:  # each fact whole on one line: the header is broken only between them
        assert any(fact in line for line in head), (fact, head)


def test_a_router_summary_row_passes_and_fails():
    stream = Terminal()
    passing = [_router_row(1, 24, 23, 1, True), _router_row(3, 24, 24, 0, True)]
    render.print_report(_report(passing), 1.0, stream=stream)
    shown = stream.text()
    row = next(line for line in shown.splitlines() if line.strip().startswith("image_text:router"))
    assert row.split()[1] == "pass" and row.split()[2] == "1.4e-06", row  # the worst layer's numbers
    flat = " ".join(shown.split())  # the line wraps at the terminal's width
    assert "2 MoE layer(s): 47 of 48 token routings to HF's experts, 1 tie(s), 0 to other experts" in flat

    stream = Terminal()
    failing = [_router_row(1, 24, 23, 1, True), _router_row(3, 24, 21, 1, False)]
    render.print_report(_report(failing), 1.0, stream=stream)
    shown = stream.text()
    row = next(line for line in shown.splitlines() if line.strip().startswith("image_text:router"))
    assert row.split()[1] == "FAIL", row
    assert ("44 of 48 token routings to HF's experts, 2 tie(s), 2 to other experts; first failing "
            "language_model.decoder.layers.3.mlp.router") in " ".join(shown.split()), shown


def test_a_moe_check_carries_its_router_summary(capsys):
    capsys.readouterr()
    code = main(["check", "kimi_k25_vl", "--no-components", "--seed", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    row = next(line for line in out.splitlines() if line.strip().startswith("sample:router"))
    assert row.split()[1] == "pass", out
    assert re.search(r"pass kimi_k25_vl sample:router: \d+ MoE layer\(s\): (\d+) of \1 token routings", out), out


# --------------------------------------------------------------------------------------------------
# JUnit and JSON

def test_junit_failure_is_one_readable_line():
    xml = render.junit_xml(_report([_router_row(1, 24, 24, 0, True)]), 2.0)
    cases = ET.fromstring(xml).findall("testcase")
    failure = cases[0].find("failure")
    assert failure.get("message") == f"first divergence at {DEEP}: rel_l2 0.00875 > tolerance 1e-05"
    assert "{" not in failure.text and "rel_l2 0.00972" in failure.text and DEEP in failure.text, failure.text
    assert cases[2].find("failure") is None


def test_junit_and_json_time_each_case_and_json_names_ep(capsys, tmp_path):
    junit, report = tmp_path / "junit.xml", tmp_path / "report.json"
    capsys.readouterr()
    assert main(["check", "clip", "--junit", str(junit), "--json", str(report)]) == 0
    cases = ET.fromstring(junit.read_text()).findall("testcase")
    assert cases and all(float(case.get("time")) >= 0 for case in cases)
    data = json.loads(report.read_text())
    assert data["ep"] == 1 and data["tp"] == 1 and data["pp"] == 1
    seconds = data["result_seconds"]
    assert len(seconds) == len(data["results"]) and all(isinstance(t, float) and t >= 0 for t in seconds)
    assert [float(case.get("time")) for case in cases] == [round(t, 3) for t in seconds]
    # A case's outputs share its time: its results read the same seconds.
    by_case = {}
    for r, t in zip(data["results"], seconds):
        by_case.setdefault(r["check"].split(":")[0], set()).add(t)
    assert all(len(times) == 1 for case, times in by_case.items() if case != "component"), by_case


# --------------------------------------------------------------------------------------------------
# list

def test_list_fits_80_columns_at_two_lines_a_family():
    code, shown = run_in_pty("list", columns=80)
    assert code == 0, shown
    assert widest(shown) <= 80, shown
    names = families.names()
    lines = shown.splitlines()
    starts = [i for i, line in enumerate(lines) if line.split() and line.split()[0] in names]
    assert sorted(lines[i].split()[0] for i in starts) == sorted(names), shown
    for i in starts:
        fam = lines[i].split()[0]
        classes = ", ".join(families.get(fam).reference_classes)
        assert classes in lines[i], (classes, lines[i])  # the class names whole
        more = 0
        while i + more + 1 < len(lines) and lines[i + more + 1].startswith(" ") and lines[i + more + 1].strip():
            more += 1
        assert more <= 1, lines[i:i + more + 1]
    assert "list --long" in shown


def test_list_long_gives_every_summary_whole(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    capsys.readouterr()
    assert main(["list", "--long"]) == 0
    out = capsys.readouterr().out
    for fam in families.families():
        assert fam.summary in out, fam.summary
