"""``mmparity convert``: HF <-> mcore checkpoints on disk (see :mod:`mmparity.convert` for how)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import dataclasses

from mmparity import errors
from mmparity.cli.common import (
    EXIT_OK, UsageError, config_facts, human_bytes, left_out_line, parse_iteration, quiet_third_party_warnings,
    shows_progress)


def add_arguments(parser) -> None:
    paths = parser.add_argument_group("source and destination")
    paths.add_argument("--src", required=True, metavar="PATH",
                       help="HF save_pretrained directory, or an mcore checkpoint root / iteration directory")
    paths.add_argument("--dst", required=True, metavar="PATH", help="output directory (must not exist, see --force)")
    paths.add_argument("--to", required=True, choices=("mcore", "hf"), help="output kind")
    paths.add_argument("--family", metavar="F",
                       help="model family (default: an HF source's is told from its config, an mcore "
                            "source names its own)")
    paths.add_argument("--force", action="store_true", help="replace an existing --dst (only once complete)")
    paths.add_argument("--iteration", metavar="N", default=None,
                       help="which iteration of an mcore checkpoint root to read (a number or 'release'; "
                            "default: the tracker file's)")
    paths.add_argument("--hf-format", metavar="F", default=None,
                       help="HF-side layout: of the source when converting to mcore (default: detected), "
                            "of the output with --to hf (default: the source's)")
    paths.add_argument("--base", metavar="HF_DIR", default=None,
                       help="with --to hf from an mcore checkpoint Megatron-LM wrote: the HF release it was "
                            "converted from; its config, tokenizer and processor files are copied to the output "
                            "and the tensors Megatron has no place for are taken from it (listed as not trained)")
    paths.add_argument("--hf-config", metavar="FILE", default=None,
                       help="with --to hf from an mcore checkpoint without mmparity's files: the HF config.json "
                            "of the model (no tensors aside: use --base for families that keep some)")
    mcore = parser.add_argument_group("Megatron-LM layout (--to mcore)")
    mcore.add_argument("--format", choices=("torch_dist", "legacy"), default=None,
                       help="mcore output format (default torch_dist)")
    mcore.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size of mcore output")
    mcore.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline-parallel size of mcore output")
    mcore.add_argument("--ep", type=int, default=1, metavar="N",
                       help="expert-parallel size of mcore output (Megatron's --expert-model-parallel-size; "
                            "a model with experts only, dividing their count)")
    mcore.add_argument("--part", metavar="PART", default=None,
                       help="with --to mcore from a whole VLM: write only this part, laid out for the Megatron "
                            "class that trains it alone (language_model: GPTModel, as pretrain_gpt.py builds it); "
                            "the other parts are left out and listed. Export such a checkpoint with --to hf "
                            "--base HF_DIR")
    mcore.add_argument("--expert-layout", choices=("grouped", "sequential"), default="grouped",
                       help="legacy output of an MoE model: routed experts named as TEGroupedMLP does "
                            "(grouped, linear_fc1.weight<e>: Megatron-LM's --moe-grouped-gemm) or as "
                            "SequentialMLP does (sequential, local_experts.<e>.linear_fc1.weight)")
    mcore.add_argument("--make-vocab-size-divisible-by", type=int, default=None, metavar="N",
                       help="pad vocabularies (LLaVA's) as Megatron-LM does: to a multiple of N x --tp "
                            "(default 128, Megatron-LM's default; for an mcore source, the N it records)")
    mcore.add_argument("--release", action="store_true",
                       help="with --to mcore: write Megatron-LM's release checkpoint (tracker 'release', "
                            "directory release/), which its loader takes with a plain --load: iteration 0, "
                            "no RNG or optimizer state looked for (default: iteration 1, see docs/megatron.md)")
    tensors = parser.add_argument_group("tensors and files")
    tensors.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                         help="cast floating tensors (default: keep each tensor's dtype, bit-exact; a quantized "
                              "(FP8 or INT4) source's quantized weights are dequantized to bfloat16)")
    tensors.add_argument("--requantize", action="store_true",
                         help="with --to hf from an mcore checkpoint of a quantized source: write its weights "
                              "in its scheme again (block-scaled FP8, or pack-quantized INT4), with the "
                              "source's quantization_config")
    tensors.add_argument("--check-finite", action="store_true", help="refuse source tensors holding NaN/Inf")
    tensors.add_argument("--max-shard-size", metavar="S", default=None,
                         help="largest output file, e.g. 500MB: an HF shard (default 5GB) or a torch_dist data "
                              "file (default 2GB); with several processes, each writes whole files")
    procs = parser.add_argument_group("processes")
    procs.add_argument("--workers", type=int, default=1, metavar="P",
                       help="convert with P processes on this machine, each writing its share of the output "
                            "files (the same bytes as one process); across machines, start the ranks with "
                            "torchrun instead (docs/convert.md)")
    procs.add_argument("--node-local", action="store_true",
                       help="with torchrun across machines and --format torch_dist: --dst is on each node's own "
                            "disk; each node writes its ranks' data files there, rank 0's node also the metadata "
                            "(gather the directories into one to load it; docs/convert.md)")
    procs.add_argument("--quiet", action="store_true", help="no progress bars, no summary")


class _RichProgress:
    """Two numbers per phase: tensors done / total and bytes done / total, drawn on stderr."""

    def __init__(self, console=None):
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn,
                                   TimeElapsedColumn, TransferSpeedColumn)

        self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                             TextColumn("{task.fields[count]}"), DownloadColumn(), TransferSpeedColumn(),
                             TimeElapsedColumn(), console=console or Console(stderr=True))
        self._task = None
        self._done, self._total, self._unit = 0, None, "tensors"

    def __enter__(self):
        self._bar.start()
        return self

    def __exit__(self, *exc_info):
        self._bar.stop()

    def _count(self) -> str:
        return f"{self._done}/{self._total} {self._unit}" if self._total is not None else ""

    def phase(self, description, tensors=None, nbytes=None, unit="tensors"):
        if self._task is not None:
            task = self._bar.tasks[-1]
            self._bar.update(self._task, completed=task.total if task.total is not None else task.completed)
        self._done, self._total = 0, tensors
        self._unit = unit
        self._task = self._bar.add_task(description, total=nbytes, count=self._count())

    def advance(self, tensors=0, nbytes=0):
        self._done += tensors
        self._bar.update(self._task, advance=nbytes, count=self._count())


class _NoProgress:
    def __enter__(self):
        return None

    def __exit__(self, *exc_info):
        return None

    def phase(self, *args, **kwargs):
        pass

    def advance(self, *args, **kwargs):
        pass


def _join_team(workers: int):
    """This process's share of the conversion: the solo team, or its rank among the ranks a
    launcher started (torchrun's variables, or those ``--workers`` sets for its ranks)."""
    import torch.distributed as dist

    from mmparity.parallel import runtime
    from mmparity.io import team

    if dist.is_available() and dist.is_initialized():
        # Code already in a process group (a rank of ``runtime.spawn``) calls convert on the rank
        # it chose, as one process: its launcher variables are that group's, not a conversion's.
        return team.solo()
    try:
        launched = runtime.launch_env()
    except runtime.LaunchError as exc:
        raise UsageError(str(exc)) from None
    if launched is not None and launched.world_size > 1 and workers > 1:
        raise UsageError(f"--workers {workers} starts its own ranks, but this is already rank {launched.rank} of "
                         f"WORLD_SIZE={launched.world_size} (a launcher's RANK/WORLD_SIZE are set): pass one or "
                         "the other")
    try:
        return team.join()
    except runtime.LaunchError as exc:
        raise UsageError(str(exc)) from None


def _refuse_paths_early(args) -> None:
    """A source that is not there, said before torch is imported (seconds a typo should not cost).
    --dst's checks (an existing one, one overlapping the source) come with the conversion: they
    first recover what a killed run to it left."""
    if not os.path.exists(args.src):
        raise UsageError(f"{args.src}: no such file or directory")


def run(args) -> int:
    quiet_third_party_warnings()
    _refuse_paths_early(args)
    from mmparity.convert import ConvertOptions
    from mmparity.io import formats

    if args.to == "hf" and args.format is not None:
        raise UsageError("--format chooses the mcore output format; it does not apply to --to hf")
    if args.to == "mcore" and args.max_shard_size is not None and args.format == "legacy":
        raise UsageError("--max-shard-size sizes HF shards and torch_dist data files; a legacy checkpoint has "
                         "one file per rank")
    if args.to == "hf" and args.part is not None:
        raise UsageError("--part chooses what --to mcore writes; an HF release is the whole model (an mcore checkpoint "
                         "of one part exports with --base HF_DIR)")
    if args.to == "hf" and args.make_vocab_size_divisible_by is not None:
        # Silently ignoring it would let a user believe the export used it.
        raise UsageError("--make-vocab-size-divisible-by pads what --to mcore writes; --to hf cuts every vocabulary "
                         "table to the HF config's size whatever its padding: drop the flag")
    if args.to == "hf" and args.release:
        raise UsageError("--release names the mcore output's iteration; it does not apply to --to hf")
    if args.ep < 1:
        raise UsageError(f"--ep must be >= 1, got {args.ep}")
    if args.node_local and (args.to != "mcore" or (args.format or formats.writable()[0]) != "torch_dist"):
        raise UsageError("--node-local applies to --to mcore --format torch_dist, whose data files are independent "
                         "of each other; HF shards and legacy rank files go to one shared --dst")
    iteration = parse_iteration(args.iteration)
    base, hf_config = getattr(args, "base", None), getattr(args, "hf_config", None)
    if args.to != "hf" and (base is not None or hf_config is not None):
        raise UsageError("--base / --hf-config describe an mcore source converted --to hf")
    options = ConvertOptions(
        src=Path(args.src), dst=Path(args.dst), to=args.to, family=args.family, tp=args.tp, pp=args.pp, ep=args.ep,
        format=args.format or formats.writable()[0], dtype=args.dtype, hf_format=args.hf_format,
        max_shard_size=args.max_shard_size, check_finite=args.check_finite,
        force=args.force, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        requantize=args.requantize, expert_layout=args.expert_layout,
        base=Path(base) if base is not None else None, hf_config=Path(hf_config) if hf_config is not None else None,
        iteration=iteration, release=args.release, node_local=args.node_local, part=args.part)
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    if args.workers > 1 and "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        from mmparity.cli import workers

        if args.workers > workers.max_workers():
            raise UsageError(f"--workers {args.workers}: at most {workers.max_workers()} here (2 per CPU this "
                             "process may use, at least 8: each worker is a process of its own, and more only "
                             "queue); pass a smaller --workers")
        return workers.run(workers.without_workers(args.argv), args.workers, options.dst)
    team = _join_team(args.workers)
    try:
        return _run(args, dataclasses.replace(options, team=team if not team.solo else None), team)
    except UsageError as exc:
        team.fail(str(exc))
        raise
    except BaseException as exc:
        team.fail(errors.one_line(exc, 400))
        raise
    finally:
        team.close()


def _run(args, options, team) -> int:
    from mmparity.convert import convert
    from mmparity.errors import ConvertError
    from mmparity.io import formats
    from mmparity.io.fsio.errors import CheckpointError
    from mmparity.io.fsio.paths import refuse_link_destination
    from mmparity.io.fsio.sources import check_sources_unchanged, sources_unchanged
    from mmparity.io.layout import checkpoint_extent

    if not team.leader:
        args.quiet = True  # rank 0 speaks for the conversion
    if os.path.islink(options.dst):  # refused before anything is read (see fsio.refuse_link_destination)
        try:
            refuse_link_destination(options.dst)
        except CheckpointError as exc:
            raise UsageError(f"--dst {exc}") from None
    interactive = shows_progress(args.quiet)
    progress = _RichProgress() if interactive else _NoProgress()
    # Every file of the source is watched (stat only) while it is read: a publish checks none changed.
    watched = checkpoint_extent(options.src) if options.src.is_dir() else options.src
    try:
        with sources_unchanged([watched]), progress:
            try:
                result = convert(options, progress if interactive else None)
            except Exception:
                # A source rewritten under the reader fails in many ways (bad header, short read,
                # wrong bytes); the cause, if it is that, is what the user needs to hear.
                check_sources_unchanged()
                raise
    except ConvertError as exc:
        raise UsageError(str(exc)) from None
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:  # disk full, permissions: the staging directory is already gone
        where = f"{exc.filename}: " if exc.filename else ""
        raise UsageError(f"{where}{exc.strerror or exc}") from None
    except Exception as exc:  # anything else is still one line, and nothing was left behind
        runtime = sys.modules.get("mmparity.parallel.runtime")  # ranks that did not meet say so themselves
        launch = runtime.launch_failure(exc) if runtime is not None else None
        raise UsageError(launch or f"conversion failed: {errors.one_line(exc, 400)}") from None
    if not args.quiet:
        if result.detection is not None:
            print(result.detection.line())
        tp, pp, ep = result.grid.sizes
        parallel = (f" tp={tp} pp={pp}" + (f" ep={ep}" if ep > 1 else "")
                    if formats.by_layout(result.layout).stores_grid else f" ep={ep}" if ep > 1 else "")
        rate = result.nbytes / result.seconds if result.seconds > 0 else 0.0
        print(f"{result.family}: {options.src} -> {result.dst} ({result.layout}{parallel}), "
              f"{result.tensors} tensors, {human_bytes(result.nbytes)} in {result.seconds:.1f}s ({human_bytes(rate)}/s)"
              + (f" by {team.size} processes" if team.size > 1 else ""))
        if not formats.by_layout(result.layout).stores_grid and (options.tp, options.pp) != (1, 1):
            print(f"{result.family}: torch_dist stores global tensors, not --tp {options.tp} --pp {options.pp} "
                  "slices: Megatron-LM loads it at any TP/PP")
        if result.megatron_class:
            what = f"the {result.part} alone" if result.part else "the whole model"
            print(f"{result.family}: laid out for Megatron's {result.megatron_class} ({what})")
        if result.requant is not None:
            r = result.requant
            print(f"{result.family}: re-quantized {r.tensors} tensors: max abs error {r.max_abs_error:g}, "
                  f"{r.inexact} not exact, {r.bytes_changed} with bytes other than the source's")
        if result.note:
            print(f"{result.family}: note: {result.note}")
        if result.iteration is not None and result.layout == "hf_safetensors":
            print(f"{result.family}: read iteration {result.iteration} of {options.src}")
        if result.from_base:
            from mmparity.io.megatron_written import FROM_BASE
            shown = ", ".join(result.from_base[:6]) + (" ..." if len(result.from_base) > 6 else "")
            print(f"{result.family}: {len(result.from_base)} tensors ({human_bytes(result.from_base_bytes)}) {FROM_BASE} "
                  f"({options.base}): {shown}")
        if result.copied:
            print(f"{result.family}: copied from the base: {', '.join(result.copied)}")
        if result.source_use is not None and result.source_use.left_out:
            facts = result.detection.facts if result.detection is not None else config_facts(options.src)
            print(left_out_line(result.family, result.source_use, facts,
                                lead=f"--part {result.part}: " if result.part else ""))
    return EXIT_OK

