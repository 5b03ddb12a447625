"""``mmparity bench``: forward time of native encoders against their HF references."""

from __future__ import annotations

import sys

from mmparity.cli.common import (EXIT_FAIL, EXIT_OK, UsageError, parse_image_size,
                                 quiet_third_party_warnings, select_device_and_backend,
                                 write_text_atomic)


def add_arguments(parser) -> None:
    from mmparity.native.attention import BACKENDS

    parser.add_argument("families", nargs="*", metavar="FAMILY",
                        help="families to time (default: every registered family with a config at --size)")
    parser.add_argument("--size", default="tiny", choices=("tiny", "published"),
                        help="tiny: the built-in test config; published: the released model's config "
                             "(random weights)")
    parser.add_argument("--images", type=int, metavar="N", default=None,
                        help="images per forward (default: 4 at tiny size, the published batch otherwise)")
    parser.add_argument("--image-size", metavar="HxW", action="append", default=None,
                        help="image size in pixels; repeat for a mixed batch (sizes cycle over --images)")
    parser.add_argument("--case", default="auto", metavar="NAME",
                        help="the family case to time: auto (static batch when all sizes are equal, "
                             "else packed), static or packed")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--attention-backend", default=None, choices=BACKENDS,
                        help="native attention backend (default: auto)")
    parser.add_argument("--repeats", type=int, metavar="N", default=None,
                        help="timed forwards per side (default: 10 on CUDA, 3 on CPU); the median is reported")
    parser.add_argument("--warmup", type=int, metavar="N", default=None,
                        help="untimed forwards first (default: 3 on CUDA, 1 on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="only the summary line")


def run(args) -> int:
    quiet_third_party_warnings()
    from mmparity import bench

    sizes = [parse_image_size(s) for s in args.image_size] if args.image_size else None
    if args.images is not None and args.images < 1:
        raise UsageError(f"--images must be >= 1, got {args.images}")
    if args.repeats is not None and args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup is not None and args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    select_device_and_backend(args.device, args.dtype, args.attention_backend)

    def progress(name: str) -> None:
        if not args.quiet:
            print(f"mmparity bench: {name} ({args.size}, {args.device}, {args.dtype}) ...",
                  file=sys.stderr, flush=True)

    try:
        report = bench.bench(args.families, size=args.size, images=args.images, image_sizes=sizes,
                             dtype=args.dtype, device=args.device, warmup=args.warmup,
                             repeats=args.repeats, seed=args.seed, case_name=args.case,
                             progress=progress)
    except bench.BenchError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        write_text_atomic(args.json, report.to_json())
    print_bench(report, quiet=args.quiet, stream=sys.stdout)
    return EXIT_OK if report.ok else EXIT_FAIL


def _fmt(value, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def _gflop(result) -> str:
    total = result.flops.get("total")
    return "-" if total is None else _fmt(total / 1e9)


def print_bench(report, quiet: bool = False, stream=None) -> None:
    from rich.console import Console
    from rich.table import Table

    is_tty = bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())
    console = Console(file=stream, highlight=False, width=None if is_tty else 220)
    if not quiet:
        table = Table(title=f"mmparity bench · {report.device_name} · {report.dtype} · {report.size} · "
                            f"median of {report.repeats} ({report.timer}) · attention "
                            f"{report.attention_backend}")
        for column in ("family", "case", "images", "tokens", "GFLOP", "native ms", "HF ms",
                       "speedup", "native TFLOP/s", "HF TFLOP/s", "native img/s", "rel_l2",
                       "native attention"):
            table.add_column(column)
        for r in report.results:
            if r.error:
                table.add_row(r.family, r.case, str(r.images), _fmt(r.tokens, "d"), _gflop(r),
                              f"[red]{r.error}[/]", "", "", "", "", "", "", "")
                continue
            kernels = ", ".join(f"{k}×{v}" for k, v in r.native.detail.get("attention_kernels", {}).items())
            table.add_row(r.family, r.case, str(r.images), _fmt(r.tokens, "d"), _gflop(r),
                          _fmt(r.native.median_ms, ".2f"),
                          _fmt(r.hf.median_ms, ".2f"), _fmt(r.speedup_vs_hf, ".2f") + "x",
                          _fmt(r.native.tflops), _fmt(r.hf.tflops), _fmt(r.native.images_per_s, ".1f"),
                          _fmt(r.rel_l2), kernels or "-")
        console.print(table)
        for s in report.skipped:
            console.print(f"skipped {s['family']}: {s['reason']}")
    failed = [r for r in report.results if r.error]
    console.print(f"{len(report.results) - len(failed)} timed, {len(failed)} failed, "
                  f"{len(report.skipped)} skipped")
