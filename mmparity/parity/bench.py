"""Forward-time benchmark of each family's native mcore encoder against its HF reference.

Both sides get the same seeded random weights (converted with the real converter) and the same inputs,
and are driven through the family's own ``cases(...)`` and ``run(model, case)``, so any registered
family can be measured. Inputs are moved to the device before timing; what ``run`` itself does
(dtype casts, re-layout, padding) is part of each side's measured forward. Warm-up first, then
the median of the repeats: CUDA events on a GPU, ``perf_counter`` on the CPU.

Every timed configuration also gets a parity verdict under the project's tolerance policy
(:func:`parity_verdict`): in float32 native against HF; in bfloat16 / float16 both sides against
one more, untimed, forward of HF in float32 on the same weights and inputs. ``--mixed`` times the
family's packed mixed-size batch (``Published.mixed``; at tiny size :data:`TINY_MIXED_UNITS`).

FLOPs are counted from the config (:func:`count_flops`), the same number for both sides, so that
achieved TFLOP/s compares like with like: patch embedding, QKV, attention scores and values per
image (never across images), output projection, MLP (gated or not) and mergers / projectors /
pooling heads, two FLOPs per multiply-add, biases, norms and activations not counted.

Never prints; :mod:`mmparity.cli.bench` renders the report.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from mmparity import progress
from mmparity.models import registry as families
from mmparity.parallel import runtime
from mmparity.models.core import inputs
from mmparity.models.spec import TowerShape
from mmparity.mapping.rules import with_side
from mmparity.config import first_int, head_dim, query_groups, vision_sub_config
from mmparity.models.core import attention
from mmparity.parity import metrics
from mmparity.parity.harness import (
    InputError, exact_float32, load_reference_weights, move_model, refuse_long_sequences, size_multiple,
    validate_image_sizes)
from mmparity.parity.report import strict_json, versions

SIZES = ("tiny", "published")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TINY_IMAGES = 4


class BenchError(ValueError):
    """A request the bench cannot honour (size, family, image size); the CLI exits 2."""


# --- configs ----------------------------------------------------------------------------------------

def published_families() -> list[str]:
    """The registered families whose record names a released size."""
    return [fam.name for fam in families.families() if fam.hooks.bench.published is not None]


def published_config(fam: families.Family):
    """The family's config at its released size, of the same classes as its tiny config."""
    family, spec = fam.name, fam.hooks.bench.published
    if spec is None:
        raise BenchError(f"family {family!r} has no published config in the bench; "
                         f"published: {', '.join(published_families())}")
    tiny = fam.tiny_config()
    vision = type(vision_sub_config(tiny))(**spec.vision)
    if getattr(tiny, "vision_config", None) is None:
        return vision
    cfg = copy.deepcopy(tiny)
    cfg.vision_config = vision
    for dotted, value in spec.parent.items():
        *path, name = dotted.split(".")
        target = cfg
        for part in path:
            target = getattr(target, part)
        if not hasattr(target, name):
            raise BenchError(f"published config of {family!r}: {type(target).__name__} has no "
                             f"attribute {name!r} (did the family's tiny config change?)")
        setattr(target, name, value)
    return cfg


def bench_config(fam: families.Family, size: str):
    if size not in SIZES:
        raise BenchError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if size == "published":
        cfg = published_config(fam)
        spec = fam.hooks.bench.published
        return cfg, spec.source + (f"; {spec.note}" if spec.note else "")
    return fam.tiny_config(), "tiny config (mmparity.reference)"


def default_batch(fam: families.Family, size: str, cfg) -> tuple[int, tuple[int, int]]:
    """(images, (H, W)) when the caller gives none: the published batch, or a small tiny one."""
    if size == "published":
        spec = fam.hooks.bench.published
        return spec.images, tuple(spec.image_size)
    multiple = size_multiple(fam, cfg)
    side = getattr(vision_sub_config(cfg), "image_size", None)
    if isinstance(side, (list, tuple)) and len(set(side)) == 1:  # InternViT's (h, w) of a square
        side = side[0]
    side = side if isinstance(side, int) else 8 * multiple
    side = max(multiple, -(-side // multiple) * multiple)
    return TINY_IMAGES, (side, side)


# Tiny ``--mixed`` set, in units of the family's size multiple: 8 images, 6 distinct token counts
# (2x6 and 6x2 share one), at least 2 units a side so that 2x2 mergers always have a whole block.
TINY_MIXED_UNITS = ((4, 4), (2, 6), (6, 2), (3, 3), (4, 2), (2, 4), (5, 5), (2, 2))


def mixed_batch(fam: families.Family, size: str, cfg) -> tuple[int, list]:
    """(images, sizes) of the family's packed mixed-size batch at ``size`` (``--mixed``);
    ``BenchError`` when the family has none or refuses it (e.g. LLaVA's fixed-size towers)."""
    if size == "published":
        spec = fam.hooks.bench.published
        if not spec.mixed:
            raise BenchError(f"family {fam.name!r} has no mixed-size set in its published config")
        sizes, images = [tuple(s) for s in spec.mixed], spec.mixed_images or len(spec.mixed)
    else:
        multiple = size_multiple(fam, cfg)
        sizes = [(h * multiple, w * multiple) for h, w in TINY_MIXED_UNITS]
        images = len(sizes)
    try:
        validate_image_sizes(fam, cfg, sizes)
    except InputError as exc:
        raise BenchError(f"mixed sizes: {exc}") from None
    return images, sizes


def with_mixed_sets(records: Sequence[families.Family], size: str) -> tuple[list, list]:
    """(families that have a mixed set at ``size`` they accept, [{family, reason}] for the rest)."""
    accepted, refused = [], []
    for fam in records:
        try:
            mixed_batch(fam, size, bench_config(fam, size)[0])
            accepted.append(fam)
        except BenchError as exc:
            refused.append({"family": fam.name, "reason": str(exc)})
    return accepted, refused


# --- FLOPs ---------------------------------------------------------------------------------------------

def _base_shape(cfg) -> TowerShape:
    vc = vision_sub_config(cfg)
    heads = vc.num_attention_heads
    return TowerShape(
        hidden=vc.hidden_size, layers=vc.num_hidden_layers, heads=heads,
        groups=query_groups(vc),
        head_dim=head_dim(vc),
        ffn=vc.intermediate_size, gated=False, patch=first_int(vc.patch_size),
        channels=getattr(vc, "num_channels", None) or getattr(vc, "in_channels", None) or 3,
        temporal=first_int(getattr(vc, "temporal_patch_size", None) or 1))


def tower_shape(fam: families.Family, cfg) -> Optional[TowerShape]:
    """The family's shape for :func:`count_flops`; ``None`` for a family whose record has no FLOP
    formula (e.g. a whole VLM): its FLOPs and TFLOP/s are then reported as not counted, never
    guessed."""
    shape_fn = fam.hooks.bench.flop_shape
    return None if shape_fn is None else shape_fn(cfg, _base_shape(cfg))


def count_flops(shape: TowerShape, image_sizes: Sequence[tuple[int, int]]) -> dict:
    """FLOPs of one forward over ``image_sizes`` (pixels), by part, and ``total``."""
    s = shape
    parts = dict.fromkeys(("patch_embed", "qkv", "attention", "proj", "mlp", "merger", "head"), 0)
    qkv_out = (s.heads + 2 * s.groups) * s.head_dim
    attn_width = s.heads * s.head_dim
    for height, width in image_sizes:
        h_p, w_p = height // s.patch, width // s.patch
        patches = h_p * w_p
        tokens = patches + s.class_tokens
        parts["patch_embed"] += 2 * patches * s.channels * s.temporal * s.patch ** 2 * s.hidden
        parts["qkv"] += s.layers * 2 * tokens * s.hidden * qkv_out
        parts["attention"] += s.layers * 4 * tokens * tokens * attn_width  # QK^T and PV
        parts["proj"] += s.layers * 2 * tokens * attn_width * s.hidden
        parts["mlp"] += s.layers * (3 if s.gated else 2) * 2 * tokens * s.hidden * s.ffn
        merged = (h_p // s.merge) * (w_p // s.merge)
        parts["merger"] += sum(2 * merged * fan_in * fan_out for fan_in, fan_out in s.merger)
        if s.head == "attention_pool":  # one probe: q, k/v of every token, attention, out, MLP
            parts["head"] += (2 * s.hidden * s.hidden + 2 * tokens * s.hidden * 2 * s.hidden
                              + 4 * tokens * attn_width + 2 * attn_width * s.hidden
                              + 2 * 2 * s.hidden * s.ffn)
    return {"total": sum(parts.values()), "parts": parts}


# --- timing ---------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device | str, warmup: int, repeats: int
              ) -> list[float]:
    """Milliseconds of each of ``repeats`` calls after ``warmup`` untimed ones."""
    device = torch.device(device)
    if repeats < 1 or warmup < 0:
        raise BenchError("repeats must be >= 1 and warm-up >= 0")
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return times


# --- the benchmark ------------------------------------------------------------------------------------

@dataclass
class SideTiming:
    median_ms: float
    times_ms: list
    images_per_s: float
    tflops: Optional[float]
    detail: dict = field(default_factory=dict)


@dataclass
class BenchResult:
    family: str
    size: str
    config: str
    case: str
    images: int
    image_sizes: list
    tokens: Optional[int]
    flops: dict
    native: Optional[SideTiming] = None
    hf: Optional[SideTiming] = None
    rel_l2: Optional[float] = None
    error: Optional[str] = None
    # {passed, native_rel_l2, hf_rel_l2, tolerance, output, outputs, reference, error?}; None
    # when not checked (--no-parity) or when the family failed before its first forward.
    parity: Optional[dict] = None

    @property
    def parity_failed(self) -> bool:
        return self.parity is not None and not self.parity["passed"]

    @property
    def speedup_vs_hf(self) -> Optional[float]:
        if self.native is None or self.hf is None or self.native.median_ms <= 0:
            return None
        return self.hf.median_ms / self.native.median_ms

    def as_dict(self) -> dict:
        out = asdict(self)
        out["speedup_vs_hf"] = self.speedup_vs_hf
        return out


@dataclass
class BenchReport:
    device: str
    device_name: str
    dtype: str
    size: str
    attention_backend: str
    timer: str
    warmup: int
    repeats: int
    versions: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    results: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    mixed: bool = False
    parity_checked: bool = True
    # False while families are still being timed (the CLI writes the JSON after each one, so a
    # run killed by a time limit still leaves what it measured).
    complete: bool = False

    @property
    def ok(self) -> bool:
        """Every family was timed (parity aside)."""
        return all(r.error is None for r in self.results)

    @property
    def passed(self) -> bool:
        """Every family timed and no parity verdict failed: the exit status of ``mmparity bench``."""
        return self.ok and not any(r.parity_failed for r in self.results)

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("results",)}
        out["results"] = [r.as_dict() for r in self.results]
        out["ok"] = self.ok
        out["passed"] = self.passed
        return out

    def to_json(self, indent: int = 2) -> str:
        return strict_json(self.as_dict(), indent)


def _to_device(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _resize_static(case, sizes: list, seed: int):
    """A family's static case holds a fixed few images; give it ``len(sizes)`` (all one size).

    Every per-image list in the case data (same length as ``images``) is cycled to the new count;
    the images themselves are fresh seeded pixels of the case's own shape.
    """
    data = dict(case.data)
    have = len(data["images"])
    want = len(sizes)
    if have == want:
        return case
    first = data["images"][0]
    if first.dim() != 3 or tuple(first.shape[-2:]) != tuple(sizes[0]):
        raise BenchError(f"static case of this family does not hold plain {sizes[0]} images")
    for key, value in case.data.items():
        if isinstance(value, list) and len(value) == have:
            data[key] = [value[i % have] for i in range(want)]
    data["images"] = inputs.images(sizes, first.shape[0], seed + 1)
    return replace(case, data=data, description=f"static batch of {want} images {sizes[0][0]}x{sizes[0][1]}")


def bench_case(fam: families.Family, cfg, sizes: list, seed: int, case_name: str = "auto"):
    """The family's case for ``sizes``: ``static`` (one batch tensor) when every image has one
    size and the family has a static case, else ``packed``; ``case_name`` forces one."""
    family, hooks = fam.name, fam.hooks
    try:
        by_name = {case.name: case for case in hooks.parity.cases(cfg, seed, sizes)}
    except ValueError as exc:  # the family refuses these sizes
        raise BenchError(f"{family}: {exc}") from None
    if case_name == "auto":
        uniform = len(set(map(tuple, sizes))) == 1
        case_name = "static" if uniform and "static" in by_name else (
            "packed" if "packed" in by_name else next(iter(by_name)))
    if case_name not in by_name:
        raise BenchError(f"family {family!r} has no case {case_name!r}; it has {', '.join(by_name)}")
    case = by_name[case_name]
    if case_name == "static":
        if len(set(map(tuple, sizes))) != 1:
            raise BenchError("the static case needs every image of one size")
        case = _resize_static(case, sizes, seed)
    return hooks.parity.prepare_case(case, cfg)


def _case_sizes(case) -> list:
    """The image sizes of ``case``; none for a language model alone (text cases)."""
    return [tuple(int(v) for v in s) for s in case.data.get("sizes", ())]


def _tflops(flops: Optional[int], ms: float) -> Optional[float]:
    if flops is None:
        return None
    return flops / (ms * 1e-3) / 1e12 if ms > 0 else float("nan")


def _side(times: list, images: int, flops: int, detail: dict) -> SideTiming:
    median = statistics.median(times)
    return SideTiming(median_ms=median, times_ms=[round(t, 4) for t in times],
                      images_per_s=images / (median * 1e-3) if median > 0 else float("nan"),
                      tflops=_tflops(flops, median), detail=detail)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _build_models(fam: families.Family, cfg, dtype: torch.dtype, device: torch.device, seed: int,
                  mutate_native: Optional[Callable[[dict], None]] = None):
    """(HF model in float32 on the host, native model on ``device`` in ``dtype``), sharing seeded
    random weights. The HF model stays float32 so that the caller can keep an exact copy as the
    parity reference before casting it. ``mutate_native`` edits the converted state before it is
    loaded (negative controls), as in :func:`mmparity.parity.harness.check`."""
    torch.manual_seed(seed)
    ref = fam.build_reference(cfg)
    # The harness's seeded weights: never zeros (METHOD: zeros can time faster than real data).
    shards = fam.hf_to_mcore(load_reference_weights(ref, None, seed), cfg, tp_size=1)
    state = with_side(shards)[0]
    del shards
    if mutate_native is not None:
        mutate_native(state)
    runtime.init_parallel(1, 1, device=device, seed=seed)
    native = fam.build_native(cfg, params_dtype=dtype)
    native.load_state_dict({k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                            for k, v in state.items()}, strict=True)
    del state
    return ref.eval(), move_model(native, device, dtype).eval()


def _build_pair(fam: families.Family, cfg, dtype: torch.dtype, device: torch.device, seed: int):
    """(HF model, native model) on ``device`` in ``dtype``, sharing seeded random weights."""
    ref, native = _build_models(fam, cfg, dtype, device, seed)
    return move_model(ref, device, dtype).eval(), native


# --- parity --------------------------------------------------------------------------------------------

PARITY_REFERENCE = "HF in float32 (TF32 off), same weights, inputs and device"


def _outputs(out: dict, case) -> dict:
    """The case's outputs, on the host in float32: kept across the timed runs for the verdict."""
    return {k: out[k].detach().float().cpu() for k in case.outputs if k in out}


def parity_verdict(dtype: torch.dtype, native_out: dict, hf_out: dict,
                   reference_out: Optional[dict] = None) -> dict:
    """The project's tolerance policy (:mod:`mmparity.parity.metrics`) on every output both sides
    produced. float32: native against HF directly. bfloat16 / float16: native and HF, both in that
    dtype, each against ``reference_out`` (HF in float32); the native error may be at most
    ``LOW_PRECISION_FACTOR`` x HF's. The top-level numbers are those of the output closest to (or
    furthest past) its bound; ``outputs`` has them all."""
    low_precision = dtype != torch.float32
    if low_precision and reference_out is None:
        raise ValueError("a low-precision parity verdict needs the float32 reference outputs")
    expected = reference_out if low_precision else hf_out
    names = [n for n in native_out if n in hf_out and n in expected]
    if not names:
        raise ValueError("native and HF share no output to compare")
    rows = {}
    for name in names:
        native_err = metrics.compare(native_out[name], expected[name]).rel_l2
        hf_err = metrics.compare(hf_out[name], expected[name]).rel_l2 if low_precision else None
        tol = metrics.tolerance_for(dtype, hf_err)
        rows[name] = {"passed": native_err <= tol.rel_l2, "native_rel_l2": native_err,
                      "hf_rel_l2": hf_err, "tolerance": tol.as_dict()}

    def margin(name):
        bound = rows[name]["tolerance"]["rel_l2"]
        return rows[name]["native_rel_l2"] / bound if bound > 0 else float("inf")

    decisive = max(names, key=margin)
    top = {k: v for k, v in rows[decisive].items() if k != "passed"}
    return {"passed": all(r["passed"] for r in rows.values()), **top, "output": decisive,
            "outputs": rows, "reference": PARITY_REFERENCE}


def _reference_outputs(ref32, run: Callable, case, device: torch.device) -> dict:
    ref32 = move_model(ref32, device, torch.float32)
    with torch.no_grad(), exact_float32(device, torch.float32):
        return _outputs(run(ref32, case), case)


@dataclass
class Prepared:
    """Everything about one family's measurement that can be decided (and refused) before timing."""

    family: families.Family
    cfg: object
    case: object
    result: BenchResult


def prepare_family(fam: families.Family, *, size: str = "tiny", images: Optional[int] = None,
                   image_sizes: Optional[Sequence[tuple[int, int]]] = None, seed: int = 0,
                   case_name: str = "auto", mixed: bool = False) -> Prepared:
    """Config, inputs and FLOP count of one family; ``BenchError`` for a request it cannot take.
    ``mixed``: the family's packed mixed-size batch (:func:`mixed_batch`), sizes cycled over
    ``images`` when given."""
    family = fam.name
    cfg, source = bench_config(fam, size)
    if mixed:
        if image_sizes:
            raise BenchError("--mixed takes its sizes from the family's mixed set; drop --image-size")
        default_n, pattern = mixed_batch(fam, size, cfg)
    else:
        default_n, default_size = default_batch(fam, size, cfg)
        pattern = [tuple(s) for s in (image_sizes or [default_size])]
    n = images or default_n
    sizes = [pattern[i % len(pattern)] for i in range(n)]
    try:
        validate_image_sizes(fam, cfg, list(dict.fromkeys(sizes)))
    except InputError as exc:
        raise BenchError(str(exc)) from None
    case = bench_case(fam, cfg, sizes, seed, case_name)
    try:
        refuse_long_sequences(fam, cfg, [case])
    except InputError as exc:
        raise BenchError(str(exc)) from None
    used = _case_sizes(case)
    shape = tower_shape(fam, cfg)
    if shape is None:
        flops = {"total": None, "parts": {},
                 "note": f"not counted: the record of family {family!r} has no FLOP formula"}
        try:
            patch, extra = _base_shape(cfg).patch, 0
        except AttributeError:
            patch = extra = None
    else:
        flops = count_flops(shape, used)
        patch, extra = shape.patch, shape.class_tokens
    tokens = None if patch is None else sum((h // patch) * (w // patch) + extra for h, w in used)
    result = BenchResult(family=family, size=size, config=source, case=case.name, images=len(used),
                         image_sizes=[list(s) for s in used], tokens=tokens, flops=flops)
    return Prepared(fam, cfg, case, result)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def time_family(prepared: Prepared, *, dtype: str = "float32", device: str = "cpu", warmup: int = 1,
                repeats: int = 3, seed: int = 0, parity: bool = True,
                mutate_native: Optional[Callable[[dict], None]] = None) -> BenchResult:
    """Build both sides, time them and judge their parity (:func:`parity_verdict`; for bfloat16 /
    float16 one more, untimed, forward of HF in float32 after the timings). Errors while building
    or running are recorded in the result, not raised: one family's failure must not hide the
    others' numbers; a failed float32 reference forward is recorded in ``parity`` only, so that
    the timings survive it."""
    result, case, fam = prepared.result, prepared.case, prepared.family
    dev = torch.device(device)
    torch_dtype = DTYPES[dtype]
    needs_reference = parity and torch_dtype != torch.float32
    ref = native = ref32 = None
    try:
        progress.step(f"case {case.name}: building both models")
        ref32, native = _build_models(fam, prepared.cfg, torch_dtype, dev, seed, mutate_native)
        # A separate copy: HF modules may cache tensors (RoPE tables) in the dtype of their first call.
        ref = move_model(copy.deepcopy(ref32) if needs_reference else ref32, dev, torch_dtype)
        if not needs_reference:
            ref32 = None
        case = replace(case, data=_to_device(case.data, dev))
        ref_run, nat_run = fam.hooks.reference.run, fam.hooks.native.run
        # TF32 off for these untimed float32 forwards (a no-op otherwise): on CUDA it alone
        # exceeds the float32 bound. The timed forwards keep the settings the report shows.
        with torch.no_grad(), exact_float32(dev, torch_dtype):
            with attention.record_kernels() as kernels_used:
                nat_out = _outputs(nat_run(native, case), case)
            ref_out = _outputs(ref_run(ref, case), case)
        name = next((o for o in case.outputs if o in nat_out and o in ref_out), None)
        if name is not None:
            result.rel_l2 = metrics.compare(nat_out[name], ref_out[name]).rel_l2
        if parity and not needs_reference:
            result.parity = parity_verdict(torch_dtype, nat_out, ref_out)
        with torch.no_grad():
            progress.step(f"case {case.name}: timing native, {warmup} + {repeats} forwards")
            nat_times = time_call(lambda: nat_run(native, case), dev, warmup, repeats)
            progress.step(f"case {case.name}: timing HF, {warmup} + {repeats} forwards")
            ref_times = time_call(lambda: ref_run(ref, case), dev, warmup, repeats)
        total = result.flops["total"]
        result.native = _side(nat_times, result.images, total, {"attention_kernels": dict(kernels_used)})
        hf_attn = getattr(getattr(ref, "config", None), "_attn_implementation", None)
        result.hf = _side(ref_times, result.images, total, {"attn_implementation": hf_attn})
    except Exception as exc:
        result.error = _error_text(exc)
        ref32 = None
    finally:
        ref = native = None  # freed before the float32 reference takes the device
        _release(dev)
    if ref32 is not None:
        progress.step(f"case {case.name}: float32 reference")
        try:
            result.parity = parity_verdict(torch_dtype, nat_out, ref_out,
                                           _reference_outputs(ref32, fam.hooks.reference.run, case, dev))
        except Exception as exc:  # e.g. out of memory: no verdict is a failed verdict
            result.parity = {"passed": False, "native_rel_l2": None, "hf_rel_l2": None,
                             "tolerance": None, "output": None, "outputs": {},
                             "reference": PARITY_REFERENCE, "error": _error_text(exc)}
        finally:
            ref32 = None
            _release(dev)
    return result


def bench_family(fam: families.Family, *, size: str = "tiny", images: Optional[int] = None,
                 image_sizes: Optional[Sequence[tuple[int, int]]] = None, dtype: str = "float32",
                 device: str = "cpu", warmup: int = 1, repeats: int = 3, seed: int = 0,
                 case_name: str = "auto", mixed: bool = False, parity: bool = True,
                 mutate_native: Optional[Callable[[dict], None]] = None) -> BenchResult:
    """:func:`prepare_family` then :func:`time_family`."""
    prepared = prepare_family(fam, size=size, images=images, image_sizes=image_sizes, seed=seed,
                              case_name=case_name, mixed=mixed)
    return time_family(prepared, dtype=dtype, device=device, warmup=warmup, repeats=repeats, seed=seed,
                       parity=parity, mutate_native=mutate_native)


def bench(family_names: Optional[Sequence[str]] = None, *, size: str = "tiny",
          images: Optional[int] = None, image_sizes=None, dtype: str = "float32",
          device: str = "cpu", warmup: Optional[int] = None, repeats: Optional[int] = None,
          seed: int = 0, case_name: str = "auto", mixed: bool = False, parity: bool = True,
          mutate_native: Optional[Callable[[dict], None]] = None,
          progress: Optional[Callable[[str], None]] = None,
          on_result: Optional[Callable[["BenchReport"], None]] = None) -> BenchReport:
    """Benchmark ``family_names`` (default: every registered family that has a config at ``size``,
    and with ``mixed`` a mixed-size set it accepts). ``on_result`` sees the report after each
    family (``complete`` still False)."""
    if dtype not in DTYPES:
        raise BenchError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if size not in SIZES:
        raise BenchError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if mixed and image_sizes:
        raise BenchError("--mixed takes its sizes from the family's mixed set; drop --image-size")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: CUDA is not available on this machine")
    warmup = warmup if warmup is not None else (3 if dev.type == "cuda" else 1)
    repeats = repeats if repeats is not None else (10 if dev.type == "cuda" else 3)
    registered = {fam.name: fam for fam in families.families()}
    requested = list(family_names or [])
    unknown = [n for n in requested if n not in registered]
    if unknown:
        raise BenchError(f"unknown family {', '.join(map(repr, unknown))}; valid families: "
                         f"{', '.join(registered)}")
    skipped = []
    if size == "published":
        published = published_families()
        missing = [n for n in requested if n not in published]
        if missing:
            raise BenchError(f"no published config for {', '.join(map(repr, missing))}; "
                             f"published: {', '.join(published)}")
        names = requested or published
        skipped = [{"family": n, "reason": "no published config in its family record"}
                   for n in registered if n not in published and not requested]
    else:
        names = requested or list(registered)
    chosen = [registered[n] for n in names]
    if mixed and not requested:
        # A family without a mixed set it accepts is skipped, as one without a published config;
        # asked for by name it is a usage error (raised by prepare_family below).
        chosen, refused = with_mixed_sets(chosen, size)
        skipped += refused
    report = BenchReport(
        device=str(dev), device_name=(torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"),
        dtype=dtype, size=size, attention_backend=attention.describe_backend(dev, DTYPES[dtype]),
        timer="cuda-events" if dev.type == "cuda" else "perf_counter", warmup=warmup, repeats=repeats,
        versions=versions(), settings=_settings(dev), skipped=skipped, mixed=mixed,
        parity_checked=parity)
    # Every request is checked before anything is built or timed: a usage error costs nothing.
    prepared = [prepare_family(fam, size=size, images=images, image_sizes=image_sizes, seed=seed,
                               case_name=case_name, mixed=mixed) for fam in chosen]
    for item in prepared:
        if progress:
            progress(item.family.name)
        report.results.append(time_family(item, dtype=dtype, device=device, warmup=warmup,
                                          repeats=repeats, seed=seed, parity=parity,
                                          mutate_native=mutate_native))
        if on_result:
            on_result(report)
    report.complete = True
    return report


def _settings(device: torch.device) -> dict:
    out = {"torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        out["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
        out["tf32_cudnn"] = torch.backends.cudnn.allow_tf32
    return out
