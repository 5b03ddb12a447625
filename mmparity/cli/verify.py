"""``mmparity verify``: re-check checkpoints mmparity wrote against their ``mmparity.json``; with
``--load``, load them strictly into Megatron's own class instead."""

from __future__ import annotations

import os
from pathlib import Path

from mmparity.cli.common import EXIT_FAIL, EXIT_OK, UsageError


def add_arguments(parser) -> None:
    parser.add_argument("dirs", nargs="+", metavar="DIR",
                        help="checkpoint directories written by mmparity (HF, legacy or torch_dist)")
    parser.add_argument("--load", action="store_true",
                        help="build Megatron's own class for each mcore checkpoint's family at its TP "
                             "size (one gloo rank each) and load it strictly: load_state_dict per rank "
                             "(legacy), dist_checkpointing.load's steps with nothing unpickled beyond an allow-list "
                             "(torch_dist)")
    parser.add_argument("--megatron-class", metavar="NAME", default=None,
                        help="with --load, where a family loads into several Megatron classes: which")
    parser.add_argument("--tp", type=int, default=None, metavar="N",
                        help="with --load, a torch_dist checkpoint (global tensors) loads at any TP "
                             "size: load it on N ranks (default: the size recorded)")
    parser.add_argument("--pp", type=int, default=None, metavar="N",
                        help="with --load, a torch_dist checkpoint loads at any PP size too: build "
                             "Megatron's language model in N stages (default: the size recorded)")
    parser.add_argument("--quiet", action="store_true", help="print only problems")


def run(args) -> int:
    from mmparity.checkpoint import CheckpointError, read_manifest, verify
    from mmparity.checkpoint.verify import refuse_manifest_link

    if args.megatron_class is not None and not args.load:
        raise UsageError("--megatron-class needs --load")
    for option, value in (("--tp", args.tp), ("--pp", args.pp)):
        if value is not None and not args.load:
            raise UsageError(f"{option} needs --load")
    for directory in args.dirs:
        if not os.path.isdir(directory):
            raise UsageError(f"{directory}: no such directory")
        try:
            refuse_manifest_link(Path(directory))
            read_manifest(directory)
        except CheckpointError as exc:
            raise UsageError(str(exc)) from None
    if args.load:
        return _run_load(args)
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


def _run_load(args) -> int:
    from mmparity.cases.megatron import NoMegatronClass
    from mmparity.checkpoint import CheckpointError
    from mmparity.checkpoint.megatron_load import load_into_megatron
    from mmparity.upstream.models import UpstreamUnavailable

    ok = True
    for directory in args.dirs:
        try:
            report = load_into_megatron(directory, args.megatron_class, args.tp, args.pp)
        except CheckpointError as exc:  # names the checkpoint (or the option) itself
            raise UsageError(str(exc)) from None
        except (NoMegatronClass, UpstreamUnavailable) as exc:
            raise UsageError(f"{directory}: {exc}") from None
        except NotImplementedError as exc:  # Megatron's class refuses the config (e.g. its tower)
            raise UsageError(f"{directory}: Megatron cannot build this model: {exc}") from None
        ok = ok and report.ok
        if not report.ok or not args.quiet:
            print(report)
    return EXIT_OK if ok else EXIT_FAIL
