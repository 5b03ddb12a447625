"""``mmparity verify``: re-check checkpoints mmparity wrote against their ``mmparity.json``."""

from __future__ import annotations

import os

from mmparity.cli.common import EXIT_FAIL, EXIT_OK, UsageError


def add_arguments(parser) -> None:
    parser.add_argument("dirs", nargs="+", metavar="DIR",
                        help="checkpoint directories written by mmparity (HF, legacy or torch_dist)")
    parser.add_argument("--quiet", action="store_true", help="print only problems")


def run(args) -> int:
    from mmparity.checkpoint import CheckpointError, read_manifest, verify

    for directory in args.dirs:
        if not os.path.isdir(directory):
            raise UsageError(f"{directory}: no such directory")
        try:
            read_manifest(directory)
        except CheckpointError as exc:
            raise UsageError(str(exc)) from None
    ok = True
    for directory in args.dirs:
        try:
            report = verify(directory)
        except CheckpointError as exc:
            raise UsageError(str(exc)) from None
        ok = ok and report.ok
        if not report.ok or not args.quiet:
            print(report)
    return EXIT_OK if ok else EXIT_FAIL
