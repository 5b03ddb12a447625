"""The HTML report (``check --html``, ``mmparity report RESULT.json --html``) and the ``report``
subcommand: a perturbed MLP weight of a whole VLM's decoder is the page's first divergence, marked
and named, and a real browser draws the page; a saved report gives the same page and the same
table; every string from the report is escaped; a file that is no report is one line, exit 2, and
nothing written."""

from __future__ import annotations

import contextlib
import functools
import html
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mmparity.cli import report as report_cli
from mmparity.cli.main import main
from mmparity.cli.report_html import DECODER, PART_COLOURS, PROJECTOR, TOWER, part_of

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
# A whole VLM: tower, merger and projector, decoder.
FAMILY = "mistral3"


def _perturbed_layer(state: dict) -> int:
    """Makes one decoder layer's MLP input projection 1.5x too large (the last layer's in sort
    order, not layer 0); returns that layer's number."""
    key = sorted(k for k in state if k.startswith("language_model.decoder.layers.")
                 and k.endswith(".mlp.linear_fc1.weight"))[-1]
    state[key] = state[key] * 1.5
    return int(key.split(".")[3])


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    """A check of the tiny Mistral3 whose native decoder has one perturbed MLP weight, with its JSON,
    HTML and terminal output, and the number of the perturbed layer."""
    from mmparity.parity import harness

    root = tmp_path_factory.mktemp("report")
    layers = []

    def perturb(state):
        layers.append(_perturbed_layer(state))

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(harness, "check", functools.partial(harness.check, mutate_native=perturb))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["check", FAMILY, "--seed", "3", "--no-components", "--json", str(root / "r.json"),
                         "--html", str(root / "r.html")])
    assert code == 1, err.getvalue()[-2000:]
    assert layers
    return {"root": root, "json": root / "r.json", "html": root / "r.html", "stdout": out.getvalue(),
            "layer": layers[0]}


def _first_divergence(data: dict) -> str:
    return next(r["first_divergence"]["module"] for r in data["results"] if r["first_divergence"])


def test_the_page_names_the_perturbed_module_as_first_divergence(failing):
    data = json.loads(failing["json"].read_text())
    module = _first_divergence(data)
    # The perturbed weight is the MLP's: its layer's MLP departs first, named below the layer.
    prefix = f"language_model.decoder.layers.{failing['layer']}.mlp"
    assert module == prefix or module.startswith(prefix + "."), module
    page = failing["html"].read_text()
    named = re.findall(r'<code class="first-divergence" data-module="([^"]*)">([^<]*)</code>', page)
    assert named and named[0] == (module, module), named
    # One plot per case with paired modules, inline, the divergence marked on it.
    assert page.count("<svg") == 1 and "first divergence" in page.split("<svg", 1)[1]
    # The run's facts and the table.
    for fact in ("TP / PP / EP", "attention_backend", "torch", "float32", "sample:logits"):
        assert fact in page, fact


def test_the_page_fetches_nothing(failing):
    page = failing["html"].read_text()
    lowered = page.lower()
    for needle in ("<script", "<link", "<img", "<iframe", "@import", "src="):
        assert needle not in lowered, needle
    # References inside the page only (the plot's clip paths).
    assert all(ref.startswith("#") for ref in re.findall(r"url\(([^)]*)\)", page))
    assert all(ref.startswith("#") for ref in re.findall(r'href="([^"]*)"', page))
    # The only URLs are the XML namespaces of the inline SVG, which are names, not fetches.
    urls = set(re.findall(r"https?://[^\s\"'<>]+", page))
    assert urls <= {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}, urls
    page.encode("ascii")  # character references only: the same bytes whatever the locale


def test_report_of_the_saved_json_gives_the_same_page_and_table(failing, tmp_path, capsys):
    again = tmp_path / "again.html"
    assert main(["report", str(failing["json"]), "--html", str(again)]) == 0
    assert again.read_bytes() == failing["html"].read_bytes()
    printed = capsys.readouterr().out.splitlines()
    checked = failing["stdout"].splitlines()
    # Everything but the summary line's seconds (the check's wall time, the results' measured ones).
    assert printed[:-1] == checked[:-1]
    assert re.sub(r"[\d.]+s\)$", "", printed[-1]) == re.sub(r"[\d.]+s\)$", "", checked[-1])
    assert "first divergence at" in "\n".join(printed)


def test_report_without_html_prints_the_table_only(failing, tmp_path, capsys):
    assert main(["report", str(failing["json"]), "--quiet"]) == 0
    assert capsys.readouterr().out.strip().startswith("1 passed, 2 failed (FAILED")
    assert not list(tmp_path.iterdir())


def test_parts_come_from_module_names():
    assert part_of("vision_model.layer.0") == TOWER
    assert part_of("layer.3") == TOWER  # a tower family's own modules
    assert part_of("vision_model.merger") == part_of("merger.linear_fc1") == part_of("merger_norm") == PROJECTOR
    assert part_of("vision_projection") == part_of("projector") == PROJECTOR
    assert part_of("language_model.decoder.layers.2.mlp.router") == DECODER


def _escaped_copy(source: Path, target: Path) -> str:
    """The saved report with markup, quotes and a terminal escape in its names; returns the
    hostile module name."""
    data = json.loads(source.read_text())
    hostile = '<script>alert("x")</script>&layer"\x1b[31m'
    for r in data["results"]:
        r["check"] = "<script>alert(1)</script>:" + r["check"].split(":", 1)[1]
        r["family"] = "fam<b>\x07"
        if r["first_divergence"]:
            r["first_divergence"]["module"] = hostile
        r["modules"][-1]["module"] = hostile
    data["device"] = "<img src=x onerror=alert(1)>"
    target.write_text(json.dumps(data))
    return hostile


def test_every_string_from_the_report_is_escaped(failing, tmp_path):
    source = tmp_path / "hostile.json"
    _escaped_copy(failing["json"], source)
    out = tmp_path / "hostile.html"
    assert main(["report", str(source), "--html", str(out), "--quiet"]) == 0
    page = out.read_text()
    lowered = page.lower()
    assert "<script" not in lowered and "<img" not in lowered and "<b>" not in lowered
    assert "&lt;script&gt;alert(1)&lt;/script&gt;:logits" in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "\x1b" not in page and "\x07" not in page and "\\x1b[31m" in page
    # The hostile module is still the one named and marked.
    assert 'data-module="&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;layer&quot;\\x1b[31m"' in page


# --------------------------------------------------------------------------------------------------
# refusals: one line, exit 2, the file named, nothing written


def _refused(capsys, argv, *names) -> str:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors exit from inside the parser
        code = exc.code
    assert code == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and err.startswith("mmparity: error: "), captured.err
    assert "Traceback" not in captured.err
    for name in names:
        assert name in err, (name, err)
    return err


def _shape(tmp_path, data) -> Path:
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(data))
    return path


def _result(**changes) -> dict:
    base = {"family": "f", "check": "c:out", "passed": True, "metrics": {"rel_l2": 0.0}, "tolerance": {},
            "first_divergence": None, "modules": [{"module": "m", "metrics": {"rel_l2": 0.0}, "tolerance": 1e-5}]}
    return {**base, **changes}


@pytest.mark.parametrize("content, words", [
    (b"", "not JSON"),
    (b"{not json", "not JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    (json.dumps([1, 2]).encode(), "top level is not an object"),
    (json.dumps({"passed": True}).encode(), "no list of results"),
    (json.dumps({"results": [{"family": "f"}]}).encode(), "results[0].check is not a string"),
    (json.dumps({"results": [_result(passed="yes")]}).encode(), "results[0].passed"),
    (json.dumps({"results": [_result(metrics={"rel_l2": "big"})]}).encode(), "results[0].metrics.rel_l2"),
    (json.dumps({"results": [_result(modules=[{"metrics": {}}])]}).encode(), "results[0].modules[0]"),
    (json.dumps({"results": [_result(first_divergence={"module": 3})]}).encode(), "first_divergence"),
    (json.dumps({"tp": "2", "results": []}).encode(), "tp is not an integer"),
    (b"[" * 100000 + b"]" * 100000, "not JSON"),
], ids=["empty", "not-json", "not-utf8", "a-list", "no-results", "no-check", "passed-text", "metric-text",
        "module-unnamed", "divergence-unnamed", "tp-text", "deep"])
def test_a_file_that_is_no_report_is_refused_naming_it(tmp_path, capsys, content, words):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    out = tmp_path / "out.html"
    _refused(capsys, ["report", str(path), "--html", str(out)], str(path), words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_a_missing_or_unreadable_path_is_refused(tmp_path, capsys):
    _refused(capsys, ["report", str(tmp_path / "nope.json")], "nope.json", "No such file")
    _refused(capsys, ["report", str(tmp_path)], str(tmp_path), "not a regular file")
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    _refused(capsys, ["report", str(fifo)], "pipe.json", "not a regular file")


def test_a_report_past_the_size_bound_is_refused_with_its_size(failing, tmp_path, capsys, monkeypatch):
    size = failing["json"].stat().st_size
    monkeypatch.setattr(report_cli, "MAX_REPORT_BYTES", size - 1)
    out = tmp_path / "out.html"
    _refused(capsys, ["report", str(failing["json"]), "--html", str(out)], str(size), str(size - 1))
    assert not out.exists()


def test_the_page_may_not_overwrite_its_input(failing, tmp_path, capsys):
    copy = tmp_path / "r.json"
    shutil.copy(failing["json"], copy)
    before = copy.read_bytes()
    _refused(capsys, ["report", str(copy), "--html", str(copy)], "same file")
    os.link(copy, tmp_path / "linked.json")
    _refused(capsys, ["report", str(copy), "--html", str(tmp_path / "linked.json")], "same file")
    assert copy.read_bytes() == before
    _refused(capsys, ["report", str(copy), "--html", str(tmp_path / "no" / "out.html")], "does not exist")
    _refused(capsys, ["report", str(copy), "--html", str(tmp_path)], "is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["linked.json", "r.json"]


def test_without_matplotlib_one_line_names_the_install(failing, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails, as uninstalled
    out = tmp_path / "out.html"
    _refused(capsys, ["report", str(failing["json"]), "--html", str(out)], "pip install 'mmparity[report]'")
    assert not out.exists()
    # check --html is refused before any work; its page says why, as its other reports would.
    _refused(capsys, ["check", FAMILY, "--html", str(out)], "pip install 'mmparity[report]'")
    assert "pip install &#x27;mmparity[report]&#x27;" in out.read_text()


@pytest.mark.parametrize("argv, words", [
    (["check", "--tp", "0"], "--tp must be"),
    (["check", "--tp2"], "did you mean --tp"),
    (["check", "no_such_family"], "unknown family"),
], ids=["bad-value", "mistyped-option", "unknown-family"])
def test_a_refused_check_writes_a_page_that_says_why(tmp_path, capsys, argv, words):
    out = tmp_path / "page.html"
    err = _refused(capsys, [*argv, "--html", str(out), "--json", str(tmp_path / "r.json")], words)
    page = out.read_text()
    assert 'class="error"' in page and "<svg" not in page
    line = err[len("mmparity: error: "):]
    assert html.escape(line) in page
    assert json.loads((tmp_path / "r.json").read_text())["error"] == line


def test_html_may_not_be_another_report_of_the_same_check(tmp_path, capsys):
    same = tmp_path / "r.out"
    _refused(capsys, ["check", FAMILY, "--json", str(same), "--html", str(same)], "same file")


# --------------------------------------------------------------------------------------------------
# matplotlib's config directory


def test_a_home_that_cannot_be_written_neither_fails_nor_warns(failing, tmp_path):
    home = tmp_path / "home"
    home.write_text("a file, not a directory: nothing can be created under it\n")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CONFIG_HOME")}
    env.update(HOME=str(home), TMPDIR=str(scratch),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "page.html"
    proc = subprocess.run([sys.executable, "-m", "mmparity", "report", str(failing["json"]), "--html", str(out),
                           "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == ""
    assert out.read_bytes() == failing["html"].read_bytes()
    assert not list(scratch.iterdir())  # its private config directory is gone with it


# --------------------------------------------------------------------------------------------------
# a real browser


def _chromium(tmp_path: Path, *argv) -> subprocess.CompletedProcess:
    profile = tempfile.mkdtemp(prefix="profile-", dir=tmp_path)
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={profile}", *argv],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


def _near(pixel, colour: str, within: int = 6) -> bool:
    target = tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return all(abs(a - b) <= within for a, b in zip(pixel[:3], target))


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no headless Chromium at {CHROMIUM} "
                    "(Debian's package chromium; .ci/run installs it where it can)")
def test_a_browser_draws_the_page_and_names_the_first_divergence(failing, tmp_path):
    from PIL import Image

    url = failing["html"].resolve().as_uri()
    shot = tmp_path / "page.png"
    proc = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,1600", url)
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    with Image.open(shot) as image:
        raw = image.convert("RGB").tobytes()
        pixels = [tuple(raw[i:i + 3]) for i in range(0, len(raw), 3)]
        width = image.width
    assert len(pixels) == 1200 * 1600
    # Not blank: the plot's part shadings, its red divergence marks, and many colours in all.
    for part, colour in PART_COLOURS.items():
        assert sum(_near(p, colour) for p in pixels) > 2000, part
    assert sum(_near(p, "#c62828", 30) for p in pixels) > 100
    assert len(set(pixels)) > 50
    # The plot area (the rows holding the shadings) is mostly drawn, not white.
    rows = sorted({i // width for i, p in enumerate(pixels) if _near(p, PART_COLOURS[DECODER])})
    band = pixels[rows[0] * width:(rows[-1] + 1) * width]
    assert sum(p != (255, 255, 255) for p in band) > len(band) // 3

    proc = _chromium(tmp_path, "--dump-dom", url)
    assert proc.returncode == 0, proc.stderr[-2000:]
    module = _first_divergence(json.loads(failing["json"].read_text()))
    named = re.findall(r'class="first-divergence"[^>]*>([^<]*)<', proc.stdout)
    assert named and named[0] == module, named
    assert "First divergence:" in proc.stdout


def test_exact_zeros_and_non_finite_errors_are_drawn_and_named(tmp_path):
    """A strict JSON report's NaN (null, named in ``non_finite``) is a divergence the page names
    with what it was; exact zeros, which a log scale cannot place, are drawn at its bottom."""
    rows = [{"module": "vision_model.layer.0", "metrics": {"rel_l2": 0.0}, "tolerance": 1e-5, "passed": True},
            {"module": "vision_projection", "metrics": {"rel_l2": 3e-7}, "tolerance": 1e-5, "passed": True},
            {"module": "language_model.decoder.layers.0", "metrics": {"rel_l2": None, "non_finite": {"rel_l2": "NaN"}},
             "tolerance": 1e-5, "passed": False}]
    data = {"device": "cpu", "dtype": "float32", "seed": 7, "tp": 1, "pp": 1, "ep": 1, "passed": False,
            "attention_backend": "sdpa", "results": [_result(
                passed=False, metrics={"rel_l2": None, "non_finite": {"rel_l2": "NaN"}}, modules=rows,
                first_divergence={"module": rows[2]["module"], "metrics": rows[2]["metrics"], "tolerance": {}})]}
    source, out = tmp_path / "nan.json", tmp_path / "nan.html"
    source.write_text(json.dumps(data))
    assert main(["report", str(source), "--html", str(out), "--quiet"]) == 0
    page = out.read_text()
    assert ('<code class="first-divergence" data-module="language_model.decoder.layers.0">'
            'language_model.decoder.layers.0</code> (rel_l2 NaN &gt; tolerance 1e-05)') in page
    assert "exactly 0 (drawn at the bottom)" in page and "not finite or failed to compare" in page
