"""``mmparity`` command line: one module per subcommand, this file only dispatches."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import logging
import shutil
import signal
import sys
import threading
from dataclasses import dataclass

from mmparity.cli.common import EXIT_USAGE, UsageError, fail_usage, quiet_third_party_warnings
from mmparity.models.registry import RegistryError


@dataclass(frozen=True)
class Command:
    """A subcommand as its ``--help`` presents it."""

    module: str  # under mmparity.cli, exposing add_arguments(parser) and run(args) -> int
    summary: str  # the one line `mmparity --help` lists it with
    description: str  # what it does, atop its own --help
    example: str  # the one worked example: a command line that works on what `before` wrote
    before: str = ""  # the commands that write its input, from `mmparity tiny` on

    def epilog(self) -> str:
        after = f" (after {self.before})" if self.before else ""
        return f"example{after}:\n  {self.example}"


SUBCOMMANDS = {
    "list": Command(
        "list_cmd", "the registered families: towers, language models, whole VLMs",
        "List the model families mmparity knows: the HF classes each is tested against\n"
        "and the components compared. A family name is what check, convert, bench and\n"
        "tiny take.",
        "mmparity list --json"),
    "check": Command(
        "check", "does the mcore model (or Megatron's own class) compute what transformers does? "
                 "names the first module where it departs",
        "Run the Megatron-Core model and the transformers reference on the same inputs\n"
        "and compare them, module by module: exit 0 when they agree, 1 naming the first\n"
        "module where they depart. Weights are seeded random ones, an HF directory's\n"
        "(--hf), or a converted checkpoint's (--mcore).",
        "mmparity check --hf hf/", "`mmparity tiny llava hf/`"),
    "report": Command(
        "report", "a saved check report (check --json) as the table, or as an HTML page with the "
                  "error plotted along the model (--html)",
        "Print a report that `mmparity check --json` wrote (a CI artifact) as the table\n"
        "check prints; with --html, also write it as one self-contained HTML page: the\n"
        "relative error of each paired module along the model, the tolerance, the first\n"
        "divergence marked, router agreement, what ran.",
        "mmparity report r.json --html r.html", "`mmparity check --json r.json`"),
    "convert": Command(
        "convert", "HF safetensors <-> Megatron-LM checkpoints (torch_dist, legacy), TP/PP/EP, bit-exact",
        "Convert an HF save_pretrained directory to a Megatron-LM checkpoint\n"
        "(torch_dist or legacy rank files, at any TP/PP/EP), or such a checkpoint back\n"
        "to HF. Tensors are copied bit for bit unless --dtype casts them, and the\n"
        "output is written to a staging directory that only takes --dst's name once\n"
        "complete.",
        "mmparity convert --src hf/ --dst mcore/ --to mcore --tp 2 --format legacy",
        "`mmparity tiny llava hf/`"),
    "verify": Command(
        "verify", "re-check a checkpoint against its checksums, or load it strictly into Megatron's "
                  "class (--load)",
        "Re-read checkpoints mmparity wrote and compare every tensor with the checksums\n"
        "recorded in their mmparity.json (exit 1 naming what differs). With --load,\n"
        "build Megatron's own class instead and load each mcore checkpoint into it\n"
        "strictly.",
        "mmparity verify --load dist/",
        "`mmparity tiny llava hf/`\n  and `mmparity convert --src hf/ --dst dist/ --to mcore`"),
    "bench": Command(
        "bench", "time the mcore and transformers forwards on the same inputs, with a parity verdict",
        "Time the Megatron-Core model's and the transformers reference's forwards on\n"
        "the same inputs, at a family's tiny or published config with random weights,\n"
        "and report the median of each with a parity verdict.",
        "mmparity bench llava --repeats 2"),
    "tiny": Command(
        "tiny", "write a family's tiny HF model with seeded random weights (a first try, a bug report)",
        "Write a family's built-in tiny HF model with seeded random weights, as\n"
        "save_pretrained writes it: a small real input for check --hf, convert and\n"
        "verify. The same FAMILY and --seed give the same bytes.",
        "mmparity tiny kimi_k25_vl hf/"),
}

DESCRIPTION = """\
Move vision-language models between Hugging Face transformers and Megatron-LM,
both ways, and check that the Megatron-Core model computes the same function
as the transformers one: convert a release for Megatron-LM (the whole VLM, or
its language model alone), check it, and export what Megatron-LM trained back
to the whole release."""

EPILOG = """\
example: a tiny LLaVA to Megatron-LM's rank files at TP 2 and back
  mmparity tiny llava hf/
  mmparity check --hf hf/
  mmparity convert --src hf/ --dst mcore/ --to mcore --tp 2 --format legacy
  mmparity verify --load mcore/
  mmparity convert --src mcore/ --dst hf2/ --to hf

Each command's options: mmparity COMMAND --help. Exit codes: 0 success,
1 a parity failure or problems found, 2 a usage or input error, 128 + the
signal's number when stopped by one (130 for Ctrl-C), after cleaning up.
Guides: README.md and docs/ in the mmparity repository (convert.md, check.md,
megatron.md for Megatron-LM users, live.md, gpu.md)."""


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return seconds


TIMEOUT_HELP = ("seconds a rendezvous of ranks (torchrun's, or the --tp/--pp ranks spawned) and each "
                "collective waits for the other ranks before exit 2 names the missing ones "
                "(default: $MMPARITY_TIMEOUT, else 60)")


# Wider terminals still get at most this many columns: help reads best in short lines.
HELP_WIDTH = 100


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples as written (their lines are already short), options wrapped."""

    def __init__(self, prog, **kwargs):
        kwargs.setdefault("width", min(HELP_WIDTH, shutil.get_terminal_size().columns - 2))
        kwargs.setdefault("max_help_position", 32)
        super().__init__(prog, **kwargs)


class _ParseError(SystemExit):
    """argparse refused the command line (its line already on stderr): exit 2, as ``parser.exit``
    would, with the message kept for the reports a refused command still writes."""

    def __init__(self, message: str):
        super().__init__(EXIT_USAGE)
        self.message = message


def _closest(word: str, candidates) -> str | None:
    found = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return found[0] if found else None


class _Parser(argparse.ArgumentParser):
    commands: dict = {}  # on the top-level parser: each subcommand's parser, by name
    _given: list = []  # the arguments this parser was last given, for the hints of its errors

    def error(self, message):  # argparse's own usage errors: one line, exit 2
        # An error met before argparse reports unknown options (a required option missing because
        # its name was mistyped: `convert --srcc`) still names them, with the closest known option.
        if "did you mean" not in message and not message.startswith("unrecognized"):
            parsers = [self, *self.commands.values()]
            hints = [(word, guess) for word, guess in self._unknown(self._given, parsers) if guess]
            if hints:
                message += " (" + ", ".join(f"unrecognized {word}; did you mean {guess}?"
                                            for word, guess in hints) + ")"
        self._print_message(f"mmparity: error: {message}\n", sys.stderr)
        raise _ParseError(message)

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _check_value(self, action, value):
        # A mistyped subcommand or choice (`mmparity chek`, `--dtype bfloat61`) names the closest.
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            guess = _closest(str(value), map(str, action.choices))
            if guess is None:
                raise
            raise argparse.ArgumentError(action, f"{exc.message}; did you mean {guess}?") from None

    def parse_args(self, args=None, namespace=None):
        # argparse's own check, but naming for each unknown option the closest of the subcommand's.
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(parsed, "command", None)
            parsers = [self] + ([self.commands[command]] if command in self.commands else [])
            guesses = dict(self._unknown(extras, parsers))
            if len(extras) == 1:
                guess = guesses.get(extras[0])
                self.error(f"unrecognized argument {extras[0]}" + (f"; did you mean {guess}?" if guess else ""))
            self.error("unrecognized arguments " + ", ".join(
                word + (f" (did you mean {guesses[word]}?)" if guesses.get(word) else "") for word in extras))
        return parsed

    def _unknown(self, words, parsers) -> list:
        """(word, the closest option or None) for each of ``words`` spelt as an option that is no
        option of ``parsers``, nor an abbreviation of one."""
        options = {option for parser in parsers for action in parser._actions for option in action.option_strings}
        found = []
        for word in words:
            head = word.split("=", 1)[0]
            if (head.startswith("-") and head not in ("-", "--") and not self._negative_number_matcher.match(head)
                    and not any(option.startswith(head) for option in options)):
                found.append((word, _closest(head, options)))
        return found


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mmparity", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=_Formatter)
    from mmparity import __version__

    parser.add_argument("--version", action="version", version=f"mmparity {__version__}")
    parser.add_argument("--timeout", type=_seconds, metavar="S", help=TIMEOUT_HELP)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, title="commands", metavar="COMMAND")
    parser.commands = {}
    for name, command in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=command.summary, description=command.description,
                                    epilog=command.epilog(), formatter_class=_Formatter)
        parser.commands[name] = sub_parser
        importlib.import_module(f"mmparity.cli.{command.module}").add_arguments(sub_parser)
        # A global option, also taken after the subcommand; SUPPRESS keeps one given before it.
        sub_parser.add_argument("--timeout", type=_seconds, metavar="S", default=argparse.SUPPRESS,
                                help=TIMEOUT_HELP)
    return parser


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP (and, embedded, SIGINT), raised where the program is so that every cleanup
    runs, as for SIGINT. ``delivered``: a signal arrived (not an exception raised by hand)."""

    def __init__(self, signum: int, delivered: bool = False):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.delivered = delivered


def _interrupt(signum, frame):
    raise Interrupted(signum, delivered=True)


def _interrupted(exc: KeyboardInterrupt) -> int:
    """One line, and the exit code a shell gives a command its signal ended, 128 + the signal's
    number (130 for Ctrl-C): a script or scheduler tells a stopped run from a refused one (2)."""
    signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
    print(f"mmparity: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
    return 128 + signum


class _StderrNotes(logging.Handler):
    """What the library reports along the way (e.g. litter of killed runs it removed), one line
    each on whatever `sys.stderr` is at the time."""

    def emit(self, record):
        print(f"mmparity: {record.getMessage()}", file=sys.stderr)


@contextlib.contextmanager
def _terminating_signals_interrupt(embedded: bool):
    """A kill from a scheduler (SIGTERM) or a closed terminal (SIGHUP) must clean up like Ctrl-C:
    staging directories removed, nothing half-written left. A signal the process was started
    ignoring (``nohup``) stays ignored. Embedded, Ctrl-C is caught the same way, so that it too can
    be handed on (see main). Restored on exit, so that an embedding program (or a test runner)
    keeps its own handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, _interrupt)
    if embedded and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if signal.getsignal(signum) is not signal.SIG_IGN:  # the program, interrupted: see main
                signal.signal(signum, handler)


def main(argv=None) -> int:
    """The CLI. Called without ``argv`` it is the program itself (``python -m mmparity``, the
    ``mmparity`` script): once an interrupt has been handled (everything cleaned up on its way
    here), the process only exits, and further interrupts are ignored rather than cut that short
    with a traceback. Called with ``argv`` (embedded, tests) the handlers stay as they were.

    A SIGTERM or SIGHUP that arrived is, after the cleanup, handed on as Unix programs do: the
    handler that was in place before gets the same signal, so that the program dies of it (a shell
    sees 128 + its number) and an embedding program (a test runner) stops as it would have without
    mmparity in between, instead of reading an exit code. Ctrl-C does the same embedded; the
    program itself exits 130."""
    handed_on = None
    with _terminating_signals_interrupt(embedded=argv is not None):
        try:
            try:
                return _main(argv)
            except RegistryError as exc:  # MMPARITY_FAMILIES names no family's package
                return _refused(str(exc), argv=sys.argv[1:] if argv is None else argv)
            except KeyboardInterrupt as exc:  # also while parsing and importing
                if argv is None:
                    # Ctrl-C pressed again and again: one landing before the ignore takes hold
                    # (raised on entering the call) is the same request, not a traceback.
                    for _ in range(100):
                        try:
                            _only_exit()
                            break
                        except KeyboardInterrupt:
                            pass
                code = _interrupted(exc)
                if not getattr(exc, "delivered", False) or (argv is None and exc.signum == signal.SIGINT):
                    return code
                handed_on = exc.signum
        finally:
            if argv is None:
                # The command is done (or was stopped): what is left is the interpreter's shutdown
                # (library finalizers), which an interrupt would cut short with a traceback.
                _only_exit()
    _hand_on(handed_on, program=argv is None)
    return code  # the handler in place ignores the signal


def _hand_on(signum: int, program: bool) -> None:
    """Delivers ``signum`` again, now to the handler that was in place before ``main`` (the
    program's: the default action, death by that signal)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if program:
        signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


def _only_exit() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


def _main(argv) -> int:
    # Before any subcommand module imports megatron or transformers (some do so at parse time).
    quiet_third_party_warnings()
    notes = logging.getLogger("mmparity")
    if not any(isinstance(h, _StderrNotes) for h in notes.handlers):
        notes.addHandler(_StderrNotes())
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _ParseError as exc:
        _usage_error_reports(exc.message, argv=sys.argv[1:] if argv is None else argv)
        raise
    args.argv = list(sys.argv[1:] if argv is None else argv)  # convert --workers runs it again per rank
    if not args.command:
        # A usage error like any other: on stderr, so a script capturing stdout sees nothing.
        parser.print_usage(sys.stderr)
        return fail_usage(f"a subcommand is required ({', '.join(SUBCOMMANDS)}); see mmparity --help")
    module = importlib.import_module(f"mmparity.cli.{SUBCOMMANDS[args.command].module}")
    runtime = None
    if args.timeout is not None:
        from mmparity.parallel import runtime

        runtime.set_timeout(args.timeout)
    try:
        return module.run(args)
    except UsageError as exc:
        return _refused(str(exc), args=args)
    except Exception as exc:
        message = _launch_failure(exc)
        if message is None:
            raise
        return _refused(message, args=args)
    finally:
        if runtime is not None:
            runtime.set_timeout(None)  # an embedding program's next call starts from the default


def _refused(message: str, args=None, argv=()) -> int:
    """A usage error: its one line, exit 2, and the reports the command was asked for."""
    _usage_error_reports(message, args, argv)
    return fail_usage(message)


def _usage_error_reports(message: str, args=None, argv=()) -> None:
    """A subcommand that writes reports for CI (``REPORT_OPTIONS``, ``write_usage_error_reports``:
    ``check``) writes them for a refused command line too, with the error. The paths are the
    parsed ones, or read from the words of a command line argparse refused."""
    if args is not None:
        command, words = getattr(args, "command", None), ()
    else:
        command, words = _command_words([str(word) for word in argv])
    module = sys.modules.get(f"mmparity.cli.{SUBCOMMANDS[command].module}") if command in SUBCOMMANDS else None
    write = getattr(module, "write_usage_error_reports", None)
    if write is None:
        return
    if args is not None:
        paths = {option: getattr(args, option[2:].replace("-", "_"), None) for option in module.REPORT_OPTIONS}
    else:
        paths = {}
        for at, word in enumerate(words):
            for option in module.REPORT_OPTIONS:
                if word == option and at + 1 < len(words) and not words[at + 1].startswith("-"):
                    paths[option] = words[at + 1]
                elif word.startswith(option + "="):
                    paths[option] = word[len(option) + 1:]
    write(paths, message)


def _command_words(words: list) -> tuple:
    """(the subcommand, the words after it) of a command line: the first word that is no option
    (nor --timeout's value)."""
    at = 0
    while at < len(words):
        if words[at] == "--timeout":
            at += 2
        elif words[at].startswith("-"):
            at += 1
        else:
            return words[at], words[at + 1:]
    return None, []


def _launch_failure(exc: Exception) -> str | None:
    """The one line for ranks that did not meet or fell apart (:func:`mmparity.parallel.runtime.launch_failure`),
    None for anything else. Only a command that imported the runtime can meet such a failure, so it
    is not imported (nor torch with it) just to ask."""
    runtime = sys.modules.get("mmparity.parallel.runtime")
    return runtime.launch_failure(exc) if runtime is not None else None


if __name__ == "__main__":
    sys.exit(main())
