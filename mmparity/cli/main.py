"""``mmparity`` command line: one module per subcommand, this file only dispatches."""

from __future__ import annotations

import argparse
import importlib
import sys

from mmparity.cli.common import EXIT_USAGE, UsageError, fail_usage, quiet_third_party_warnings

# subcommand -> module under mmparity.cli exposing add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "list": ("list_cmd", "list families, their components and HF reference classes"),
    "check": ("check", "parity of native mcore encoders against the HF reference"),
    "bench": ("bench", "forward time of native encoders against the HF reference"),
    "convert": ("convert", "convert checkpoints between HF safetensors and mcore (legacy, torch_dist)"),
    "verify": ("verify", "re-check a checkpoint mmparity wrote against its mmparity.json checksums"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: one line, exit 2
        self.exit(EXIT_USAGE, f"mmparity: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mmparity", description=__doc__)
    from mmparity import __version__

    parser.add_argument("--version", action="version", version=f"mmparity {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(f"mmparity.cli.{module}").add_arguments(sub_parser)
    return parser


def main(argv=None) -> int:
    # Before any subcommand module imports megatron or transformers (some do so at parse time).
    quiet_third_party_warnings()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        # A usage error like any other: on stderr, so a script capturing stdout sees nothing.
        parser.print_usage(sys.stderr)
        return fail_usage(f"a subcommand is required ({', '.join(SUBCOMMANDS)}); see mmparity --help")
    module = importlib.import_module(f"mmparity.cli.{SUBCOMMANDS[args.command][0]}")
    try:
        return module.run(args)
    except UsageError as exc:
        return fail_usage(str(exc))
    except KeyboardInterrupt:
        return fail_usage("interrupted")


if __name__ == "__main__":
    sys.exit(main())
