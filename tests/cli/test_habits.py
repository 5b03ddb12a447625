"""What a person at a terminal, or a CI job, meets around a command: an interrupt's exit code, the
closest option named for a typo, strict JSON, and reports written even for a refused command."""

from __future__ import annotations

import signal

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
    (["chek"], "argument COMMAND: invalid choice: 'chek' (choose from 'list', 'check', 'convert', "
               "'verify', 'bench', 'tiny'); did you mean check?"),
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
