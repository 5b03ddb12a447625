"""``mmparity check``: parity of each family's native encoder against its HF reference."""

from __future__ import annotations

import math
import os
import sys
import time

from mmparity.cli.common import (
    EXIT_FAIL, EXIT_OK, UsageError, check_output_path, check_seed, config_facts, left_out_line, parse_image_size,
    progress_line, quiet_third_party_warnings, select_device_and_backend, write_text_atomic)


def add_arguments(parser) -> None:
    what = parser.add_argument_group("what is compared")
    what.add_argument("families", nargs="*", metavar="FAMILY",
                      help="families to check (default: every registered family)")
    what.add_argument("--hf", metavar="DIR",
                      help="an HF save_pretrained directory (config + safetensors, single or sharded); "
                           "without FAMILY, its family is told from its config")
    what.add_argument("--hf-format", metavar="F", default=None,
                      help="HF-side layout of --hf (default: detected from the keys)")
    what.add_argument("--mcore", metavar="DIR",
                      help="check a converted mcore checkpoint (legacy or torch_dist, e.g. from "
                           "mmparity convert) against the HF reference loaded from --hf (default: the "
                           "source recorded in its mmparity.json); a legacy checkpoint runs at its own "
                           "TP and PP, --tp / --pp reshard it")
    what.add_argument("--impl", default="native", choices=("native", "megatron", "both"),
                      help="whose model to test against HF: mmparity's native mcore model (default), "
                           "Megatron's own class (stock megatron-core, or Megatron-LM main's "
                           "vit_model on PYTHONPATH), or both side by side")
    what.add_argument("--megatron-class", metavar="NAME", default=None,
                      help="with --impl megatron/both, where a family loads into several Megatron "
                           "classes: which (clip: CLIPViTModel (default) or ViTModel)")
    what.add_argument("--no-components", action="store_true", help="skip component checks")
    inputs = parser.add_argument_group("inputs and numerics")
    inputs.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                       help="dtype of both models (default float32)")
    inputs.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both models run (default cpu)")
    inputs.add_argument("--seed", type=int, default=0, metavar="N",
                       help="seed of the inputs, and of the weights when no --hf gives them (default 0)")
    inputs.add_argument("--attention-backend", default=None, metavar="NAME",
                        help="native attention backend: auto (default), sdpa, math, varlen, flash, te; "
                             "one that cannot run here is an error")
    inputs.add_argument("--image-size", metavar="HxW", action="append", default=None,
                        help="image size in pixels; repeat for several images per batch")
    ranks = parser.add_argument_group("parallelism")
    ranks.add_argument("--tp", type=int, default=1, metavar="N",
                       help="run the native model across N tensor-parallel ranks (spawned, or torchrun's)")
    ranks.add_argument("--pp", type=int, default=None, metavar="N",
                       help="run the native model as N pipeline stages, each loading what "
                            "'mmparity convert --pp N' writes for it; tp*pp ranks in all (default 1)")
    ranks.add_argument("--ep", type=int, default=1, metavar="N",
                       help="expert-parallel size of the native model (MoE families): each MoE layer's "
                            "experts spread over N ranks, as convert --ep lays them out")
    memory = parser.add_argument_group("memory")
    memory.add_argument("--low-memory", action="store_true",
                        help="with --hf: build both models without weights and read each module's weights "
                             "from the files just before it runs, dropping them after; resident at once: "
                             "about one layer's weights on one side (an MoE layer's routed experts one "
                             "--expert-group at a time on HF's side, one expert at a time on mcore's) plus "
                             "the weights outside the layer stacks while component checks run, plus "
                             "activations; same report as without it (native model, one process, no "
                             "--tp/--pp/--ep/--mcore)")
    memory.add_argument("--expert-group", type=int, default=None, metavar="N",
                        help="with --low-memory: experts of a stacked HF experts tensor resident at once "
                             "(default 8)")
    report = parser.add_argument_group("report")
    report.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    report.add_argument("--junit", metavar="PATH", help="also write JUnit XML for CI runners")
    report.add_argument("--html", metavar="PATH",
                        help="also write one self-contained HTML page: the relative error of each paired "
                             "module along the model, plotted (needs pip install 'mmparity[report]')")
    report.add_argument("--quiet", action="store_true",
                        help="only the summary line; no progress line (drawn on stderr when it is a terminal)")


# The reports a CI job reads: written even when the command is refused (exit 2), saying why.
REPORT_OPTIONS = ("--json", "--junit", "--html")


def write_usage_error_reports(paths: dict, message: str) -> None:
    """For a refused ``check`` (``paths``: each of :data:`REPORT_OPTIONS` given, to its path): the
    JSON report with the error and no results, JUnit XML with one errored testcase, so that CI
    shows a failed test rather than no report. A path that cannot be written is passed over: the
    one stderr line already says what went wrong."""
    if int(os.environ.get("RANK", "0") or 0) != 0 or not any(paths.values()):
        return  # under torchrun, rank 0 reports; and none asked for, nothing to import
    from mmparity.cli.common import one_line
    from mmparity.cli.render import usage_error_junit
    from mmparity.cli.report_html import error_page
    from mmparity.parity.report import strict_json

    line = one_line(message)
    texts = {"--json": lambda: strict_json({"passed": False, "error": line, "results": []}) + "\n",
             "--junit": lambda: usage_error_junit(line), "--html": lambda: error_page(line)}
    written = set()
    for option, path in paths.items():
        if path and option in texts and os.path.realpath(str(path)) not in written:  # one file named twice
            written.add(os.path.realpath(str(path)))
            try:
                write_text_atomic(str(path), texts[option](), option)
            except UsageError:
                pass


def _resolve_families(requested: list[str]) -> list:
    """The registry records of the families named (default: every registered family)."""
    from mmparity.models import registry as families

    known = {fam.name: fam for fam in families.families()}
    unknown = [n for n in requested if n not in known]
    if unknown:
        raise UsageError(f"unknown family {', '.join(map(repr, unknown))}; valid families: {', '.join(known)}")
    return [known[n] for n in requested] if requested else list(known.values())


def _detect(directory: str):
    """The family of ``--hf DIR`` from its config (:func:`mmparity.models.registry.detect`)."""
    from mmparity.models import registry as families
    from mmparity.io.fsio.errors import CheckpointError
    from mmparity.convert.configs import detect_family

    if not os.path.isdir(directory):
        raise UsageError(f"--hf {directory}: no such directory")
    try:
        return detect_family(directory)
    except CheckpointError as exc:
        raise UsageError(f"--hf {exc}") from None
    except families.DetectError as exc:
        raise UsageError(f"--hf {directory}: {exc}") from None


def _note_left_out(fam, use, detection, directory: str, notes: list) -> None:
    if use.left_out:
        facts = detection.facts if detection is not None else config_facts(directory)
        notes.append(left_out_line(fam, use, facts, "checks part of the checkpoint: "))


def _check_image_sizes(fam, cfg, sizes) -> None:
    from mmparity.parity import harness

    if sizes is not None:
        try:
            harness.validate_image_sizes(fam, cfg, sizes)
        except harness.InputError as exc:
            raise UsageError(f"--image-size: {exc}") from None


def _refuse_poisoned(directory: str, poisoned: dict) -> None:
    """``poisoned``: {tensor: count of NaN/Inf values}; any makes the check meaningless."""
    if poisoned:
        name = sorted(poisoned)[0]
        raise UsageError(f"--hf {directory}: tensor {name} holds {poisoned[name]} NaN/Inf value(s)"
                         + (f" ({len(poisoned) - 1} more tensor(s) too)" if len(poisoned) > 1 else "")
                         + "; parity is undefined for non-finite weights (mmparity convert --check-finite "
                           "finds them all)")


def _family_config(directory: str, fam):
    """The config of the family (its record) from ``--hf DIR``'s config file; one line if it has
    none or the family does not take it."""
    from mmparity.io.fsio.errors import CheckpointError
    from mmparity.convert.configs import read_hf_config

    if not os.path.isdir(directory):
        raise UsageError(f"--hf {directory}: no such directory")
    try:
        full_cfg, _ = read_hf_config(directory, for_models=True)
    except CheckpointError as exc:
        raise UsageError(f"--hf {exc}") from None
    try:
        cfg = fam.family_config(full_cfg)
    except ValueError as exc:
        raise UsageError(f"--hf {directory}: {exc} (family {fam.name!r}); {_family_taking(full_cfg)}") from None
    from mmparity.parity import harness

    try:
        harness.refuse_config(fam, cfg)
    except harness.InputError as exc:
        raise UsageError(f"--hf {directory}: {exc}") from None
    return cfg


def _load_hf(directory: str, fam, hf_format):
    """(family config, family tensors in the reference's own layout, what of the checkpoint they
    are: a ``SourceUse``) from an HF directory."""
    from mmparity.io.fsio.dtypes import check_source_dtypes
    from mmparity.io.fsio.errors import CheckpointError
    from mmparity.io.fsio.safetensors_read import open_safetensors_checkpoint
    from mmparity.io.hf import bound_config
    from mmparity.mapping.rules import ConversionError

    cfg = _family_config(directory, fam)
    try:
        config_name = "config.json" if os.path.exists(os.path.join(directory, "config.json")) else "params.json"
        bound_config(cfg, os.path.join(directory, config_name), directory)
        with open_safetensors_checkpoint(directory) as ckpt:
            state = ckpt.state_dict()
    except CheckpointError as exc:
        raise UsageError(f"--hf {directory}: {exc}") from None
    from mmparity.io.formats.base import SourceUse

    try:
        tensors, prefix, fmt = fam.select_tensors(cfg, state, hf_format)
        selected = {prefix + k for k in tensors}
        use = SourceUse.split(selected, [k for k in state if k not in selected],
                              {k: v.numel() * v.element_size() for k, v in state.items()})
        default_format = fam.hooks.converter.formats[0]
        if fmt != default_format:
            # The reference only loads its own layout: go through mcore, exactly as a user would.
            shards = fam.hf_to_mcore(tensors, cfg, hf_format=fmt)
            tensors = fam.mcore_to_hf(shards, cfg, hf_format=default_format)
        else:
            fam.hf_to_mcore(tensors, cfg, hf_format=fmt)  # totality, before any model
    except ConversionError as exc:
        raise UsageError(f"--hf {directory}: {exc.title}: "
                         f"{'; '.join(exc.problems[:5])}") from None
    try:
        check_source_dtypes(directory, {k: v.dtype for k, v in tensors.items()})
    except CheckpointError as exc:
        raise UsageError(f"--hf {directory}: {exc}") from None
    import torch

    # NaN/Inf weights make every metric NaN (or every output equal): no parity verdict means anything.
    poisoned = {k: int(v.numel() - torch.isfinite(v).sum()) for k, v in tensors.items()
                if v.is_floating_point() and not bool(torch.isfinite(v).all())}
    _refuse_poisoned(directory, poisoned)
    _refuse_unbacked_parameters(fam, cfg, tensors, directory)
    return cfg, tensors, use


def _open_low_memory(directory: str, fam, hf_format):
    """(family config, the checkpoint as a ``RangeReader``, its ``SourceUse``, the layout) for
    ``--low-memory``: the in-memory load's checks, each on one tensor at a time or on the headers."""
    import torch

    from mmparity.io.fsio.dtypes import check_source_dtypes
    from mmparity.io.fsio.errors import CheckpointError
    from mmparity.io.fsio.heap import map_large_blocks
    from mmparity.io.fsio.safetensors_pread import RangeReader
    from mmparity.io.hf import bound_config
    from mmparity.io.formats.base import SourceUse
    from mmparity.mapping.rules import ConversionError

    if not os.path.isdir(directory):
        raise UsageError(f"--hf {directory}: no such directory")
    # Freed weights give their address space back at once (what an RLIMIT_AS run counts).
    map_large_blocks()
    cfg = _family_config(directory, fam)
    try:
        config_name = "config.json" if os.path.exists(os.path.join(directory, "config.json")) else "params.json"
        reader = RangeReader(directory)
        capacity = (len(reader.infos()), sum(math.prod(i.shape) for i in reader.infos().values()))
        bound_config(cfg, os.path.join(directory, config_name), directory, capacity)
    except CheckpointError as exc:
        raise UsageError(f"--hf {directory}: {exc}") from None
    # Shapes and dtypes without the bytes: enough for selection, totality and the size checks.
    metas = {k: torch.empty(i.shape, dtype=i.dtype, device="meta") for k, i in reader.infos().items()}
    try:
        tensors, prefix, fmt = fam.select_tensors(cfg, metas, hf_format)
        selected = {prefix + k for k in tensors}
        use = SourceUse.split(selected, [k for k in metas if k not in selected],
                              {k: i.nbytes for k, i in reader.infos().items()})
        check_source_dtypes(directory, {k: v.dtype for k, v in tensors.items()})
        poisoned = {}
        for key in sorted(tensors):  # a range of rows of one tensor resident at a time
            count = reader.nonfinite(prefix + key)
            if count:
                poisoned[key] = count
    except ConversionError as exc:
        raise UsageError(f"--hf {directory}: {exc.title}: {'; '.join(exc.problems[:5])}") from None
    except CheckpointError as exc:
        raise UsageError(f"--hf {directory}: {exc}") from None
    _refuse_poisoned(directory, poisoned)
    _refuse_unbacked_parameters(fam, cfg, tensors, directory)
    return cfg, reader, use, fmt


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _usage_line(usage) -> str:
    sides = ", ".join(f"{side} {_mib(usage.peak[side])} of {_mib(usage.total[side])}" for side in usage.peak)
    return f"low memory: parameters resident at most at once: {sides}; {usage.reads} tensor reads"


def _check_low_memory(args, fam, sizes, notes: list, detection):
    """``check --hf DIR --low-memory`` of one family (its record): its report (see
    ``parity.low_memory``)."""
    from mmparity.mapping.rules import ConversionError
    from mmparity.parity import harness, low_memory

    name = fam.name
    if name not in low_memory.supported():
        raise UsageError(f"--low-memory does not support family {name!r} yet; it supports "
                         f"{', '.join(low_memory.supported())}")
    cfg, reader, use, fmt = _open_low_memory(args.hf, fam, args.hf_format)
    with reader:
        _note_left_out(fam, use, detection, args.hf, notes)
        _check_image_sizes(fam, cfg, sizes)
        usage = low_memory.Usage()
        try:
            report = low_memory.check(fam, cfg, reader, dtype=args.dtype, device=args.device, seed=args.seed,
                                      image_sizes=sizes, components=not args.no_components, hf_format=fmt,
                                      usage=usage,
                                      expert_group=args.expert_group or low_memory.DEFAULT_EXPERT_GROUP)
        except low_memory.LowMemoryError as exc:
            raise UsageError(f"{name}: {exc}") from None
        except ConversionError as exc:
            raise UsageError(f"{name}: {exc.title}: {'; '.join(exc.problems[:5])}") from None
        except harness.InputError as exc:
            raise UsageError(str(exc)) from None
    notes.append(_usage_line(usage))
    return report


def _family_taking(full_cfg) -> str:
    """Which registered families take this config, for a message about one that does not."""
    from mmparity.models import registry as families

    takers = []
    for fam in families.families():
        try:
            fam.family_config(full_cfg)
        except Exception:  # any refusal: not this family's
            continue
        takers.append(fam.name)
    architectures = ", ".join(getattr(full_cfg, "architectures", None) or []) or "no architectures"
    what = f"the config is {architectures} (model_type {getattr(full_cfg, 'model_type', None)!r})"
    if not takers:
        return f"{what}, which no registered family takes"
    return f"{what}: check it as family {' or '.join(map(repr, takers))}"


def _refuse_unbacked_parameters(fam, cfg, tensors, directory: str) -> None:
    """The check builds real models from `cfg`: refuse, before allocating them, a config that implies
    more parameters than the checkpoint holds, or other shapes than it holds (the reference built on
    the meta device, where building is free), rather than meet them in ``load_state_dict``."""
    import torch

    family = fam.name
    present = sum(t.numel() for t in tensors.values())
    try:
        with torch.device("meta"):
            reference = fam.build_reference(cfg)
            implied = sum(p.numel() for p in reference.parameters())
            expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"--hf {directory}: config.json describes no buildable {family!r} model "
                         f"({' '.join(str(exc).split())[:200]})") from None
    if implied > present:
        raise UsageError(f"--hf {directory}: config.json implies {implied} parameters, the checkpoint holds "
                         f"{present}; config and weights do not belong together")
    wrong = [f"{k} is {list(t.shape)}, the config implies {list(expected[k])}" for k, t in sorted(tensors.items())
             if k in expected and tuple(t.shape) != expected[k]]
    if wrong:
        raise UsageError(f"--hf {directory}: shape mismatch with its config.json: {'; '.join(wrong[:4])}"
                         + (f" (+{len(wrong) - 4} more)" if len(wrong) > 4 else "")
                         + "; config and weights do not belong together")


def _load_mcore(args) -> tuple[str, str, list, int, list | None, int | None]:
    """(family, HF reference directory, native rank shards, pipeline size, its per-stage layer
    counts or None, the vocabulary divisor its manifest records or None) for ``--mcore DIR``.

    A legacy checkpoint holds one file per (TP rank, stage): it runs at its own pipeline size
    (and layer split) unless ``--pp`` says otherwise. torch_dist holds global tensors; like its
    TP size, its pipeline size is only how it was saved, so it runs at ``--pp`` (default 1).
    """
    from mmparity.io.manifest import MANIFEST_FILE, read_manifest
    from mmparity.io.fsio.errors import CheckpointError
    from mmparity.io import formats
    from mmparity.io.legacy import open_legacy
    from mmparity.io.layout import resolve_iteration_dir
    from mmparity.convert import read_mcore_shards
    from mmparity.errors import ConvertError

    if len(args.families) > 1:
        raise UsageError("--mcore checks one checkpoint: give at most one FAMILY")
    if args.tp < 1:
        raise UsageError(f"--tp must be >= 1, got {args.tp}")
    if not os.path.isdir(args.mcore):
        raise UsageError(f"--mcore {args.mcore}: no such directory")
    family = args.families[0] if args.families else None
    try:
        family, _config, shards = read_mcore_shards(args.mcore, family, tp=args.tp if args.tp != 1 else None)
        root = resolve_iteration_dir(args.mcore)[0]
        manifest = read_manifest(root) if os.path.isfile(os.path.join(root, MANIFEST_FILE)) else None
        stored_pp, stored_counts = 1, None
        # Rank files (legacy) fix the pipeline they were written for; global tensors do not.
        if manifest is not None:
            if formats.by_layout(manifest.layout).stores_grid:
                stored_pp, stored_counts = manifest.pipeline_parallel_size, manifest.pipeline_layer_counts
        elif formats.detect_iteration(resolve_iteration_dir(args.mcore)[1]).stores_grid:
            stored_pp = open_legacy(args.mcore).pp_size
    except (ConvertError, CheckpointError) as exc:
        raise UsageError(f"--mcore {args.mcore}: {exc}") from None
    pp = args.pp if args.pp is not None else stored_pp
    counts = list(stored_counts) if stored_counts and pp == stored_pp else None
    hf_dir = args.hf or (manifest.provenance.source_path if manifest is not None else None)
    if not hf_dir or not os.path.isdir(hf_dir):
        raise UsageError(f"--mcore {args.mcore}: needs --hf DIR, the HF checkpoint to compare against"
                         + (f" (its recorded source {hf_dir} is gone)" if hf_dir else ""))
    # Owned copies: rank shards may be memory-mapped files, and spawned ranks receive them pickled.
    # The side tensors the native model has modules for (CLIP's ln_post) come with them.
    from mmparity.mapping.rules import McoreShards

    def owned(state: dict) -> dict:
        return {k: v.clone() for k, v in state.items()}

    copies = McoreShards([owned(s) for s in shards], [owned(s) for s in shards.side], shards.unused)
    # The divisor the tables were padded with, as read_mcore_shards held it to them: Megatron's
    # class is built with it (the native model takes the tables' size as they load).
    divisor = (manifest.provenance.extra or {}).get("make_vocab_size_divisible_by") if manifest is not None else None
    divisor = divisor if isinstance(divisor, int) and not isinstance(divisor, bool) and divisor > 0 else None
    return family, hf_dir, copies, pp, counts, divisor


def _refuse_early(args) -> None:
    """What the command line and config.json alone show to be wrong, said before torch,
    transformers or megatron is imported (those cost seconds; a typo in a path should not)."""
    for option, path in (("--hf", args.hf), ("--mcore", args.mcore)):
        if path and not os.path.isdir(path):
            raise UsageError(f"{option} {path}: no such directory")
    if args.hf and not args.mcore and not args.low_memory and args.tp > 1 and len(args.families) <= 1:
        _refuse_tp_from_config(args.hf, args.families[0] if args.families else None, args.tp)


def _refuse_tp_from_config(directory: str, family, tp: int) -> None:
    """A TP size that does not divide the model's heads (or other split sizes), read off config.json
    as convert reads it: the rule tables and torch, no model code. Anything this cannot tell is left
    to the check itself, which refuses it all the same, later."""
    try:
        from mmparity.convert.configs import read_hf_config
        from mmparity.convert.sources import family_for

        fam = family_for(directory, family)
        rules = fam.rule_set(fam.family_config(read_hf_config(directory)[0]))
        problems = list(rules.validate_tp(tp)) if rules.validate_tp else []
    except Exception:  # noqa: BLE001 — not this check's to report
        return
    if problems:
        raise UsageError(f"{fam.name}: tensor-parallel size does not fit this model: {'; '.join(problems[:5])}")


def run(args) -> int:
    quiet_third_party_warnings()
    _refuse_early(args)
    if args.pp is not None and args.pp < 1:
        raise UsageError(f"--pp must be >= 1, got {args.pp}")
    check_seed(args.seed)
    for option, path in (("--json", args.json), ("--junit", args.junit), ("--html", args.html)):
        if path:
            check_output_path(option, path)
    if args.html:
        from mmparity.cli.report import refuse_same_paths
        from mmparity.cli.report_html import require_matplotlib

        refuse_same_paths({"--json": args.json, "--junit": args.junit, "--html": args.html})
        require_matplotlib()
    sizes = [parse_image_size(s) for s in args.image_size] if args.image_size else None
    native_shards, layer_counts, divisor = None, None, None
    if args.mcore:
        family, args.hf, native_shards, args.pp, layer_counts, divisor = _load_mcore(args)
        args.families = [family]
    pp = args.pp or 1
    notes, detection = [], None
    if args.hf and not args.families:
        detection = _detect(args.hf)
        args.families = [detection.family]
        notes.append(detection.line())
    records = _resolve_families(args.families)
    if args.hf and len(records) != 1:
        raise UsageError("--hf checks one checkpoint: give at most one FAMILY (default: told from its config)")
    select_device_and_backend(args.device, args.dtype, args.attention_backend)

    if args.tp < 1:
        raise UsageError(f"--tp must be >= 1, got {args.tp}")
    if args.megatron_class is not None and args.impl == "native":
        raise UsageError("--megatron-class needs --impl megatron or --impl both")
    if args.expert_group is not None and not args.low_memory:
        raise UsageError("--expert-group needs --low-memory")
    if args.low_memory:
        given = [flag for flag, on in (("--mcore", args.mcore), ("--tp", args.tp != 1), ("--pp", pp != 1),
                                       ("--ep", args.ep != 1), ("--impl", args.impl != "native")) if on]
        if args.expert_group is not None and args.expert_group < 1:
            raise UsageError(f"--expert-group must be >= 1, got {args.expert_group}")
        if not args.hf or given:
            raise UsageError("--low-memory checks an HF directory (--hf DIR) against the native model in "
                             "one process" + (f"; drop {', '.join(given)}" if given else ""))
    from mmparity.mapping.rules import ConversionError
    from mmparity.parallel import runtime
    from mmparity.models.core.megatron_classes import StrictLoadError, UpstreamUnavailable

    if args.device == "cuda" and runtime.launched_world_size() == 1:
        import torch

        # nccl needs one GPU per rank; a rank without one would fail deep inside its set-up.
        tp = len(native_shards) if native_shards is not None else args.tp
        if tp * pp > torch.cuda.device_count():
            raise UsageError(f"TP {tp} x PP {pp} needs {tp * pp} GPUs, this machine has "
                             f"{torch.cuda.device_count()}")
    from mmparity.parity import harness
    from mmparity.parity.report import Report

    with progress_line(args.quiet) as line:
        started = time.perf_counter()
        combined = None
        for number, fam in enumerate(records, 1):
            name, cfg, hf_state = fam.name, None, None
            line.start(f"check {name}" + (f" ({number}/{len(records)})" if len(records) > 1 else ""),
                       "loading the weights" if args.hf else "")
            if args.low_memory:
                report = _check_low_memory(args, fam, sizes, notes, detection)
                combined = Report(device=report.device, dtype=report.dtype, seed=report.seed,
                                  attention_backend=report.attention_backend, versions=report.versions,
                                  tp=report.tp, pp=report.pp, ep=report.ep, impl=report.impl, megatron=report.megatron)
                combined.results.extend(report.results)
                continue
            if args.hf:
                cfg, hf_state, use = _load_hf(args.hf, fam, args.hf_format)
                _note_left_out(fam, use, detection, args.hf, notes)
            _check_image_sizes(fam, cfg, sizes)
            try:
                report = harness.check(fam, cfg, hf_state, dtype=args.dtype, device=args.device,
                                       seed=args.seed, image_sizes=sizes, tp=args.tp, pp=pp, ep=args.ep,
                                       layer_counts=layer_counts, components=not args.no_components,
                                       native_shards=native_shards, impl=args.impl, vocab_divisor=divisor,
                                       megatron_class=args.megatron_class)
            except ConversionError as exc:  # e.g. a TP size that does not divide the heads
                raise UsageError(f"{name}: {exc.title}: {'; '.join(exc.problems[:5])}") from None
            except harness.InputError as exc:  # e.g. more pipeline stages than layers
                raise UsageError(str(exc)) from None
            except UpstreamUnavailable as exc:
                raise UsageError(f"{name} --impl {args.impl}: {exc}") from None
            except StrictLoadError as exc:  # weights that are not the layout of Megatron's class
                raise UsageError(f"{name}: the weights do not load strictly into Megatron's class: "
                                 f"{exc}") from None
            except NotImplementedError as exc:  # Megatron's class refuses the config (e.g. its tower)
                raise UsageError(f"{name} --impl {args.impl}: Megatron cannot build this model: "
                                 f"{exc}") from None
            if combined is None:
                combined = Report(device=report.device, dtype=report.dtype, seed=report.seed,
                                  attention_backend=report.attention_backend, versions=report.versions,
                                  tp=report.tp, pp=report.pp, ep=report.ep, impl=report.impl,
                                  megatron=report.megatron)
            elif report.megatron is not None:
                combined.megatron["classes"].update(report.megatron["classes"])
                if "notes" in report.megatron:
                    combined.megatron.setdefault("notes", {}).update(report.megatron["notes"])
            combined.results.extend(report.results)
    elapsed = time.perf_counter() - started
    if runtime.launched_world_size() > 1 and int(os.environ.get("RANK", "0")) != 0:
        return EXIT_OK if combined.passed else EXIT_FAIL  # under torchrun only rank 0 reports

    page = None
    # The page is drawn from the JSON form, as `mmparity report` draws a saved one, and before any
    # report is written: one that cannot be drawn refuses the command, and every report says why.
    if args.html:
        import json

        from mmparity.cli.report_html import render

        page = render(json.loads(combined.to_json()))
    if args.json:
        write_text_atomic(args.json, combined.to_json(), "--json")
    if args.junit:
        from mmparity.cli.render import junit_xml

        write_text_atomic(args.junit, junit_xml(combined, elapsed), "--junit")
    if page is not None:
        write_text_atomic(args.html, page, "--html")
    from mmparity.cli.render import print_report

    if not args.quiet:
        for note in notes:
            print(note)
    print_report(combined, elapsed, quiet=args.quiet, stream=sys.stdout)
    return EXIT_OK if combined.passed else EXIT_FAIL
