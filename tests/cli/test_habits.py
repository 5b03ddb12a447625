"""What a person at a terminal, or a CI job, meets around a command: an interrupt's exit code, the
closest option named for a typo, strict JSON, and reports written even for a refused command."""

from __future__ import annotations

import json
import os
import signal
from xml.etree import ElementTree

import pytest

from mmparity.cli import main as cli


def _run(capsys, *argv):
    capsys.readouterr()
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse's own errors exit from inside the parser
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _stopped_by(exc):
    def run(args):
        raise exc

    return run


@pytest.mark.parametrize("exc, code, name", [(KeyboardInterrupt(), 130, "SIGINT"),
                                             (cli.Interrupted(signal.SIGTERM), 143, "SIGTERM"),
                                             (cli.Interrupted(signal.SIGHUP), 129, "SIGHUP")])
def test_an_interrupt_exits_128_plus_the_signal_in_one_line(capsys, monkeypatch, exc, code, name):
    import mmparity.cli.list_cmd

    monkeypatch.setattr(mmparity.cli.list_cmd, "run", _stopped_by(exc))
    got, out, err = _run(capsys, "list")
    assert (got, out, err) == (code, "", f"mmparity: interrupted by {name}\n")


@pytest.mark.parametrize("argv, line", [
    (["check", "--tp2"], "unrecognized argument --tp2; did you mean --tp?"),
    (["check", "pixtral", "--sed=4"], "unrecognized argument --sed=4; did you mean --seed?"),
    (["check", "--tp2", "--jsn"], "unrecognized arguments --tp2 (did you mean --tp?), --jsn (did you mean --json?)"),
    (["list", "extra"], "unrecognized argument extra"),
    (["check", "--zzzz"], "unrecognized argument --zzzz"),
    (["chek"], "argument COMMAND: invalid choice: 'chek' (choose from 'list', 'check', 'report', "
               "'convert', 'verify', 'bench', 'tiny'); did you mean check?"),
    (["convrt", "--src", "a"], "did you mean convert?"),
    (["check", "--dtype", "bfloat61"], "did you mean bfloat16?"),
    # A required option missing because its name was mistyped: the typo is named all the same.
    (["convert", "--srcc", "a", "--dst", "b", "--to", "hf"],
     "the following arguments are required: --src (unrecognized --srcc; did you mean --src?)"),
    (["--tiemout", "3", "list"], "(unrecognized --tiemout; did you mean --timeout?)"),
])
def test_a_mistyped_option_or_command_names_the_closest(capsys, argv, line):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmparity: error: ") and lines[0].endswith(line), err


def test_no_suggestion_for_what_resembles_nothing_nor_for_a_valid_abbreviation(capsys):
    code, _, err = _run(capsys, "check", "--qqqqqqq")
    assert code == 2 and err == "mmparity: error: unrecognized argument --qqqqqqq\n"
    # `--sr` abbreviates --src: not an unknown option, so the missing ones alone are named.
    code, _, err = _run(capsys, "convert", "--sr", "a", "--to", "hf")
    assert code == 2 and err == "mmparity: error: the following arguments are required: --dst\n"


def _strict_loads(text: str):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("argv, line", [
    # Refused by argparse, before any option has a value: the paths are read from the words.
    (["check", "--tp2", "--json", "{json}", "--junit={junit}"], "unrecognized argument --tp2; did you mean --tp?"),
    # Refused by check itself, after parsing.
    (["check", "pixtral", "--pp", "0", "--junit", "{junit}", "--json", "{json}"], "--pp must be >= 1, got 0"),
    (["--timeout", "5", "check", "no<such>&family", "--json={json}", "--junit", "{junit}"],
     "unknown family 'no<such>&family'"),
])
def test_a_refused_check_still_writes_its_json_and_junit_reports(capsys, tmp_path, argv, line):
    paths = {"json": tmp_path / "r.json", "junit": tmp_path / "r.xml"}
    code, out, err = _run(capsys, *[word.format(**paths) for word in argv])
    assert code == 2 and len(err.splitlines()) == 1 and line in err, err
    said = err.splitlines()[0].removeprefix("mmparity: error: ")
    assert _strict_loads(paths["json"].read_text()) == {"passed": False, "error": said, "results": []}
    suite = ElementTree.fromstring(paths["junit"].read_text())
    assert (suite.tag, suite.get("tests"), suite.get("errors"), suite.get("failures")) == ("testsuite", "1", "1", "0")
    (case,) = suite
    (error,) = case
    assert error.tag == "error" and error.get("message") == said and error.text == said


def test_reports_get_the_mode_a_plain_open_gives(capsys, tmp_path):
    """A report is an artifact others read: not the private mode of a temporary file."""
    previous = os.umask(0o022)
    try:
        paths = [tmp_path / "r.json", tmp_path / "r.xml"]
        _run(capsys, "check", "pixtral", "--pp", "0", "--json", str(paths[0]), "--junit", str(paths[1]))
    finally:
        os.umask(previous)
    assert [oct(p.stat().st_mode & 0o777) for p in paths] == [oct(0o644)] * 2


def test_a_refused_report_path_is_passed_over_and_the_other_report_written(capsys, tmp_path):
    junit = tmp_path / "r.xml"
    code, _, err = _run(capsys, "check", "pixtral", "--json", str(tmp_path / "no" / "r.json"), "--junit", str(junit))
    assert code == 2 and len(err.splitlines()) == 1 and "does not exist" in err
    assert sorted(os.listdir(tmp_path)) == ["r.xml"]
    assert "does not exist" in ElementTree.fromstring(junit.read_text())[0][0].get("message")


def test_a_refused_command_without_reports_writes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, _ = _run(capsys, "check", "--tp2")
    assert code == 2 and os.listdir(tmp_path) == []
    # bench's --json is its own report, not a CI one: only check writes reports for a refusal.
    code, _, _ = _run(capsys, "bench", "--repeatz", "2", "--json", "b.json")
    assert code == 2 and os.listdir(tmp_path) == []
