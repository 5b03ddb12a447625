"""``mmparity bench``: forward time of native encoders against their HF references."""

from __future__ import annotations

import os
import sys

from mmparity.cli.common import (
    EXIT_FAIL, EXIT_OK, UsageError, parse_image_size, progress_line, quiet_third_party_warnings,
    select_device_and_backend, write_text_atomic)


def add_arguments(parser) -> None:
    what = parser.add_argument_group("what is timed")
    what.add_argument("families", nargs="*", metavar="FAMILY",
                      help="families to time (default: every registered family with a config at --size)")
    what.add_argument("--size", default="tiny", choices=("tiny", "published"),
                      help="tiny: the built-in test config; published: the released model's config "
                           "(random weights)")
    what.add_argument("--case", default="auto", metavar="NAME",
                      help="the family case to time: auto (static batch when all sizes are equal, "
                           "else packed), static or packed")
    what.add_argument("--images", type=int, metavar="N", default=None,
                      help="images per forward (default: 4 at tiny size, the published batch otherwise)")
    what.add_argument("--image-size", metavar="HxW", action="append", default=None,
                      help="image size in pixels; repeat for a mixed batch (sizes cycle over --images)")
    what.add_argument("--mixed", action="store_true",
                      help="time each family's packed mixed-size batch (the family record's published config, "
                           "mixed sets at published size; 8 sizes of the patch multiple at tiny); "
                           "families without one are skipped")
    numerics = parser.add_argument_group("numerics")
    numerics.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                         help="dtype of both models (default float32)")
    numerics.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both models run (default cpu)")
    numerics.add_argument("--attention-backend", default=None, metavar="NAME",
                          help="native attention backend: auto (default), sdpa, math, varlen, flash, te; "
                               "one that cannot run here is an error")
    numerics.add_argument("--seed", type=int, default=0, metavar="N",
                         help="seed of the random weights and inputs (default 0)")
    numerics.add_argument("--no-parity", dest="parity", action="store_false",
                          help="skip the parity verdict (in bfloat16/float16 it costs one float32 HF "
                               "forward per family)")
    timing = parser.add_argument_group("timing and report")
    timing.add_argument("--repeats", type=int, metavar="N", default=None,
                        help="timed forwards per side (default: 10 on CUDA, 3 on CPU); the median is reported")
    timing.add_argument("--warmup", type=int, metavar="N", default=None,
                        help="untimed forwards first (default: 3 on CUDA, 1 on CPU)")
    timing.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    timing.add_argument("--quiet", action="store_true",
                        help="only the summary line; no progress line (drawn on stderr when it is a terminal)")


# A benchmarked batch: far above any published batch (tens of images), far below what fails to
# allocate on a large host.
MAX_IMAGES = 4096
MAX_BATCH_PIXELS = 2**32


def run(args) -> int:
    quiet_third_party_warnings()
    sizes = [parse_image_size(s) for s in args.image_size] if args.image_size else None
    if args.images is not None and args.images < 1:
        raise UsageError(f"--images must be >= 1, got {args.images}")
    if args.images is not None and args.images > MAX_IMAGES:
        # The batch is made before anything runs: a count like this is an allocation that fails.
        raise UsageError(f"--images {args.images}: at most {MAX_IMAGES} images a forward; pass fewer")
    if args.images is not None and sizes and args.images * max(h * w for h, w in sizes) > MAX_BATCH_PIXELS:
        raise UsageError(f"--images {args.images} of up to {max(h * w for h, w in sizes)} pixels: more than the "
                         f"{MAX_BATCH_PIXELS} pixels a benchmarked batch may hold; pass fewer or smaller images")
    if args.repeats is not None and args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup is not None and args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    json_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else None
    if json_dir is not None and not os.path.isdir(json_dir):
        # Before any timing: the first partial report would otherwise fail after one family.
        raise UsageError(f"cannot write {args.json}: directory {json_dir} does not exist")
    # The flags above are checked before this import (megatron's and transformers': seconds).
    from mmparity.parity import bench

    select_device_and_backend(args.device, args.dtype, args.attention_backend)


    def write_partial(report) -> None:
        # After every family: a run killed by a time limit still leaves what it measured.
        if args.json:
            write_text_atomic(args.json, report.to_json())

    with progress_line(args.quiet) as line:
        def progress(name: str) -> None:
            line.start(f"bench {name} ({args.size}, {args.device}, {args.dtype})")

        try:
            report = bench.bench(args.families, size=args.size, images=args.images, image_sizes=sizes,
                                 dtype=args.dtype, device=args.device, warmup=args.warmup,
                                 repeats=args.repeats, seed=args.seed, case_name=args.case,
                                 mixed=args.mixed, parity=args.parity, progress=progress,
                                 on_result=write_partial)
        except bench.BenchError as exc:
            raise UsageError(str(exc)) from None
    if args.json:
        write_text_atomic(args.json, report.to_json())
    print_bench(report, quiet=args.quiet, stream=sys.stdout)
    return EXIT_OK if report.passed else EXIT_FAIL


def _fmt(value, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def _gflop(result) -> str:
    total = result.flops.get("total")
    return "-" if total is None else _fmt(total / 1e9)


def _parity_cell(result) -> str:
    parity = result.parity
    if parity is None:
        return "-"
    if parity.get("error"):
        return "[red]FAIL (no verdict)[/]"
    return "PASS" if parity["passed"] else "[red]FAIL[/]"


def parity_line(result) -> str:
    """One line: the verdict and the numbers it rests on (for logs read long after the run)."""
    parity = result.parity
    if parity is None:
        return f"parity {result.family}: not checked"
    verdict = "PASS" if parity["passed"] else "FAIL"
    if parity.get("error"):
        return f"parity {result.family}: FAIL, no float32 reference: {parity['error']}"
    hf = "" if parity["hf_rel_l2"] is None else f", HF {parity['hf_rel_l2']:.3g}"
    return (f"parity {result.family}: {verdict} {parity['output']} native rel_l2 "
            f"{parity['native_rel_l2']:.3g} {'<=' if parity['passed'] else '>'} "
            f"{parity['tolerance']['rel_l2']:.3g}{hf} ({parity['tolerance']['basis']})")


def print_bench(report, quiet: bool = False, stream=None) -> None:
    from rich.console import Console
    from rich.table import Table

    is_tty = bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())
    console = Console(file=stream, highlight=False, width=None if is_tty else 230)
    if not quiet:
        table = Table(title=f"mmparity bench · {report.device_name} · {report.dtype} · {report.size}"
                            f"{' mixed' if report.mixed else ''} · "
                            f"median of {report.repeats} ({report.timer}) · attention "
                            f"{report.attention_backend}")
        for column in ("family", "case", "images", "tokens", "GFLOP", "native ms", "HF ms",
                       "speedup", "native TFLOP/s", "HF TFLOP/s", "native img/s", "rel_l2",
                       "parity", "native attention"):
            table.add_column(column)
        for r in report.results:
            if r.error:
                table.add_row(r.family, r.case, str(r.images), _fmt(r.tokens, "d"), _gflop(r),
                              f"[red]{r.error}[/]", "", "", "", "", "", "", "", "")
                continue
            kernels = ", ".join(f"{k}×{v}" for k, v in r.native.detail.get("attention_kernels", {}).items())
            table.add_row(r.family, r.case, str(r.images), _fmt(r.tokens, "d"), _gflop(r),
                          _fmt(r.native.median_ms, ".2f"),
                          _fmt(r.hf.median_ms, ".2f"), _fmt(r.speedup_vs_hf, ".2f") + "x",
                          _fmt(r.native.tflops), _fmt(r.hf.tflops), _fmt(r.native.images_per_s, ".1f"),
                          _fmt(r.rel_l2), _parity_cell(r), kernels or "-")
        console.print(table)
        for r in report.results:
            if not r.error and report.parity_checked:
                console.print(parity_line(r))
        for s in report.skipped:
            console.print(f"skipped {s['family']}: {s['reason']}")
    failed = [r for r in report.results if r.error]
    line = (f"{len(report.results) - len(failed)} timed, {len(failed)} failed, "
            f"{len(report.skipped)} skipped")
    if report.parity_checked:
        judged = [r for r in report.results if r.parity is not None]
        parity_failed = [r.family for r in judged if not r.parity["passed"]]
        line += f", parity {len(judged) - len(parity_failed)}/{len(judged)} passed"
        if parity_failed:
            line += f" (FAILED: {', '.join(parity_failed)})"
    else:
        line += ", parity not checked"
    console.print(line)
