"""``mmparity verify``: re-check checkpoints mmparity wrote against their ``mmparity.json``; with
``--load``, load them strictly into Megatron's own class instead."""

from __future__ import annotations

import os
from pathlib import Path

from mmparity.cli.common import EXIT_FAIL, EXIT_OK, UsageError, parse_iteration, progress_line


def add_arguments(parser) -> None:
    checksums = parser.add_argument_group("checksums")
    checksums.add_argument("dirs", nargs="+", metavar="DIR",
                           help="checkpoint directories written by mmparity (HF, legacy or torch_dist)")
    checksums.add_argument("--base", metavar="HF_DIR", default=None,
                           help="also compare the tensors that were never trained (an HF export's 'from the base', "
                                "an mcore checkpoint's side file) with the HF release they came from; with --load "
                                "of a checkpoint Megatron-LM wrote (no mmparity.json): the model it holds")
    checksums.add_argument("--quiet", action="store_true",
                           help="print only problems; no progress line (drawn on stderr, with --load, when it is a "
                                "terminal)")
    load = parser.add_argument_group("loading into Megatron's class (--load)")
    load.add_argument("--load", action="store_true",
                      help="build Megatron's own class for each mcore checkpoint's family at its TP "
                           "size (one gloo rank each) and load it strictly: load_state_dict per rank "
                           "(legacy), dist_checkpointing.load's steps with nothing unpickled beyond an allow-list "
                           "(torch_dist)")
    load.add_argument("--megatron-class", metavar="NAME", default=None,
                      help="with --load, where a family loads into several Megatron classes: which")
    load.add_argument("--tp", type=int, default=None, metavar="N",
                      help="with --load, a torch_dist checkpoint (global tensors) loads at any TP "
                           "size: load it on N ranks (default: the size recorded)")
    load.add_argument("--pp", type=int, default=None, metavar="N",
                      help="with --load, a torch_dist checkpoint loads at any PP size too: build "
                           "Megatron's language model in N stages (default: the size recorded)")
    load.add_argument("--hf-config", metavar="FILE", default=None,
                      help="with --load of a checkpoint Megatron-LM wrote: the HF config.json of the model it "
                           "holds, instead of --base (with --family unless the file is named config.json)")
    load.add_argument("--family", metavar="NAME", default=None,
                      help="with --hf-config: the model family")
    load.add_argument("--iteration", metavar="N", default=None,
                      help="with a checkpoint Megatron-LM wrote: which iteration to describe or load (default: "
                           "the tracker's)")


def run(args) -> int:
    for directory in args.dirs:  # before torch is imported: a mistyped path costs no seconds
        if not os.path.isdir(directory):
            raise UsageError(f"{directory}: no such directory")
    from mmparity.io.fsio.errors import CheckpointError
    from mmparity.io.manifest import read_manifest
    from mmparity.io.verify import verify
    from mmparity.io.verify import refuse_manifest_link

    if args.megatron_class is not None and not args.load:
        raise UsageError("--megatron-class needs --load")
    for option, value in (("--tp", args.tp), ("--pp", args.pp)):
        if value is not None and not args.load:
            raise UsageError(f"{option} needs --load")
    for option, value in (("--hf-config", args.hf_config), ("--family", args.family)):
        if value is not None and not args.load:
            raise UsageError(f"{option} needs --load (of a checkpoint Megatron-LM wrote)")
    megatron_written = [d for d in args.dirs if os.path.isdir(d) and not os.path.lexists(Path(d) / "mmparity.json")
                        and _is_mcore_dir(Path(d))]
    if megatron_written:
        return _run_megatron_written(args, megatron_written)
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
        ok = _compare_base(args, directory) and ok
    return EXIT_OK if ok else EXIT_FAIL


def _is_mcore_dir(path: Path) -> bool:
    from mmparity.io.layout import TRACKER_FILE

    return (path / TRACKER_FILE).is_file() or path.name.startswith("iter_") or any(
        p.name.startswith("iter_") for p in path.iterdir() if p.is_dir())


def _compare_base(args, directory) -> bool:
    if args.base is None:
        return True
    from mmparity.io.fsio.errors import CheckpointError
    from mmparity.convert.base_compare import compare_with_base
    from mmparity.io.megatron_written import FROM_BASE

    try:
        count, problems = compare_with_base(directory, args.base)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    if problems:
        print(f"{directory}: FAIL: {len(problems)} of {count} tensors {FROM_BASE} differ from {args.base}: "
              + "; ".join(problems[:6]))
        return False
    if not args.quiet:
        print(f"{directory}: {count} tensors {FROM_BASE}, equal to {args.base}'s" if count else
              f"{directory}: no tensors {FROM_BASE} to compare")
    return True


def _run_megatron_written(args, directories) -> int:
    """Directories Megatron-LM wrote (no mmparity.json): what each is (with ``--load``: whether its
    model loads strictly, as ``--base`` / ``--hf-config`` describe it). Their weights carry no
    checksums to re-check; ``convert --to hf --base`` checks every shape against the config."""
    from mmparity.io.fsio.errors import CheckpointError
    from mmparity.io.megatron_written import describe

    iteration = parse_iteration(args.iteration)
    for directory in args.dirs:
        if os.path.lexists(Path(directory) / "mmparity.json"):
            raise UsageError(f"{directory}: verify checkpoints Megatron-LM wrote separately from mmparity's")
    if args.load:
        if args.base is None and args.hf_config is None:
            raise UsageError(f"{directories[0]}: no mmparity.json: --load of a checkpoint Megatron-LM wrote needs "
                             "the model it holds: --base HF_DIR (the HF release) or --hf-config FILE")
        return _run_load(args, iteration=iteration, megatron_written=True)
    for directory in args.dirs:
        try:
            print(describe(directory, iteration))
        except CheckpointError as exc:
            raise UsageError(str(exc)) from None
    return EXIT_OK


def _run_load(args, iteration=None, megatron_written: bool = False) -> int:
    ok = True
    with progress_line(args.quiet) as line:
        for directory in args.dirs:
            line.start(f"verify --load {directory}")
            ok = _load_one(args, directory, iteration, megatron_written, line) and ok
    return EXIT_OK if ok else EXIT_FAIL


def _load_one(args, directory, iteration, megatron_written: bool, line) -> bool:
    from mmparity.models.core.megatron_side import NoMegatronClass
    from mmparity.io.fsio.errors import CheckpointError
    from mmparity.megatron.load import load_into_megatron
    from mmparity.models.core.megatron_classes import UpstreamUnavailable

    try:
        if megatron_written:
            report = load_into_megatron(directory, args.megatron_class, args.tp, args.pp, base=args.base,
                                        hf_config=args.hf_config, family=args.family, iteration=iteration)
        else:
            report = load_into_megatron(directory, args.megatron_class, args.tp, args.pp)
    except CheckpointError as exc:  # names the checkpoint (or the option) itself
        raise UsageError(str(exc)) from None
    except (NoMegatronClass, UpstreamUnavailable) as exc:
        raise UsageError(f"{directory}: {exc}") from None
    except NotImplementedError as exc:  # Megatron's class refuses the config (e.g. its tower)
        raise UsageError(f"{directory}: Megatron cannot build this model: {exc}") from None
    if not report.ok or not args.quiet:
        line.clear()
        print(report)
    return report.ok
