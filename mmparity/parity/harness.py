"""``check``: convert the HF weights with the real converter, run both sides, compare, localise.

Never prints. Every check goes through :func:`mmparity.converters.hf_to_mcore`, so a parity pass
also vouches for the conversion. For low-precision dtypes both models also run in that dtype and
each is measured against the float32 reference (see :mod:`mmparity.parity.metrics`).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Callable, Iterable, Optional

import torch

from mmparity import families
from mmparity.parity import metrics as M
from mmparity.parity.cases import Case
from mmparity.parity.inputs import random_like_state
from mmparity.parity.report import Divergence, Report, Result, versions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextmanager
def capture(pairs) -> Iterable[dict]:
    """Record each paired module's (last) output during the block, keyed by pair name."""
    seen: dict = {}
    handles = []
    for pair in pairs:
        def hook(module, args, output, _name=pair.name):
            seen[_name] = output
        handles.append(pair.module.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _extract(pairs, seen: dict, case: Case) -> dict:
    out = {}
    for pair in pairs:
        if pair.name in seen:
            out[pair.name] = pair.extract(seen[pair.name], case).detach().float().cpu()
    return out


def _canonical(outputs: dict) -> dict:
    return {k: v.detach().float().cpu() for k, v in outputs.items()}


class Side:
    """One model plus how to run it and which of its modules pair up."""

    def __init__(self, model, run: Callable, pairs: list):
        self.model, self.run_fn, self.pairs = model, run, pairs

    @torch.no_grad()
    def run(self, case: Case) -> tuple[dict, dict]:
        with capture(self.pairs) as seen:
            outputs = self.run_fn(self.model, case)
        return _canonical(outputs), _extract(self.pairs, seen, case)


def _move(model, device, dtype):
    return model.to(device=device, dtype=dtype)


def load_reference_weights(ref, hf_state: Optional[dict], seed: int) -> dict:
    """Load ``hf_state`` or seeded random weights into ``ref``; return the state actually used."""
    if hf_state is None:
        # HF's init leaves norms at 1 and biases at 0, which hides swapped or misplaced tensors.
        hf_state = random_like_state(ref.state_dict(), seed)
    ref.load_state_dict(hf_state, strict=True)
    return {k: v for k, v in ref.state_dict().items()}


def check(family: str, cfg=None, hf_state: Optional[dict] = None, *, dtype: str = "float32",
          device: str = "cpu", seed: int = 0, image_sizes=None, components: bool = True,
          mutate_native: Optional[Callable[[dict], None]] = None, hf_format: Optional[str] = None,
          native_shards: Optional[list] = None) -> Report:
    """Parity of one family; returns a :class:`Report` (no printing, no exit codes).

    ``hf_state``: HF-layout weights of the reference model (keys as the reference module expects);
    random seeded weights when None. ``mutate_native`` edits the converted mcore state before it is
    loaded (negative controls). ``native_shards`` bypasses the converter (e.g. shards read from an
    mcore checkpoint on disk).
    """
    from mmparity import converters
    from mmparity.native import attention, runtime

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    fam = families.get(family)
    ref_mod, nat_mod = fam.reference(), fam.native()
    cfg = cfg if cfg is not None else fam.tiny_config()
    torch.manual_seed(seed)

    ref = fam.build_reference(cfg)
    used_state = load_reference_weights(ref, hf_state, seed)
    shards = native_shards if native_shards is not None else converters.hf_to_mcore(
        family, used_state, cfg, tp_size=1, hf_format=hf_format)
    native_state = dict(shards[0])
    if mutate_native is not None:
        mutate_native(native_state)

    runtime.init_parallel(1, 1, device=device, seed=seed)
    native = fam.build_native(cfg, params_dtype=torch_dtype)
    native.load_state_dict({k: v.to(torch_dtype) for k, v in native_state.items()}, strict=True)
    native = _move(native, device, torch_dtype)
    ref32 = _move(ref, device, torch.float32)

    report = Report(device=str(device), dtype=dtype, seed=seed, versions=versions(),
                    attention_backend=attention.describe_backend(device))
    ref32_side = Side(ref32, ref_mod.run, ref_mod.pairs(ref32, cfg))
    native_side = Side(native, nat_mod.run, nat_mod.pairs(native, cfg))
    ref_lp_side = None
    if torch_dtype != torch.float32:
        ref_lp = _move(copy.deepcopy(ref), device, torch_dtype)
        ref_lp_side = Side(ref_lp, ref_mod.run, ref_mod.pairs(ref_lp, cfg))

    prepare = getattr(ref_mod, "prepare_case", lambda case, cfg: case)
    for case in ref_mod.cases(cfg, seed, image_sizes):
        case = prepare(case, cfg)
        report.results.extend(_compare_case(fam.name, case, ref32_side, native_side, ref_lp_side,
                                            torch_dtype))
    if components:
        for name in getattr(ref_mod, "COMPONENTS", ()):
            report.results.append(_compare_component(fam.name, name, ref_mod, nat_mod, ref32, native,
                                                     ref_lp_side, cfg, seed, torch_dtype))
    return report


def _tolerance(dtype, ref_lp_out, ref32_out) -> M.Tolerance:
    if ref_lp_out is None:
        return M.fp32_tolerance()
    return M.tolerance_for(dtype, M.compare(ref_lp_out, ref32_out).rel_l2)


def _compare_case(family, case, ref32_side, native_side, ref_lp_side, dtype) -> list[Result]:
    ref_out, ref_mods = ref32_side.run(case)
    nat_out, nat_mods = native_side.run(case)
    lp_out, lp_mods = ref_lp_side.run(case) if ref_lp_side else ({}, {})

    module_rows, divergence = [], None
    for pair in ref32_side.pairs:
        name = pair.name
        if name not in ref_mods or name not in nat_mods:
            continue
        tol = _tolerance(dtype, lp_mods.get(name), ref_mods[name])
        try:
            m = M.compare(nat_mods[name], ref_mods[name])
        except ValueError as exc:
            module_rows.append({"module": name, "error": str(exc), "passed": False})
            divergence = divergence or Divergence(name, {"error": str(exc)}, tol.as_dict())
            continue
        ok = tol.accepts(m)
        module_rows.append({"module": name, "metrics": m.as_dict(), "tolerance": tol.rel_l2, "passed": ok})
        if not ok and divergence is None:
            divergence = Divergence(name, m.as_dict(), tol.as_dict())

    results = []
    for output in case.outputs:
        tol = _tolerance(dtype, lp_out.get(output), ref_out[output])
        m = M.compare(nat_out[output], ref_out[output])
        passed = tol.accepts(m)
        div = divergence
        if not passed and div is None:
            div = Divergence(output, m.as_dict(), tol.as_dict())
        results.append(Result(family=family, check=f"{case.name}:{output}", passed=passed,
                              metrics=m.as_dict(), tolerance=tol.as_dict(),
                              first_divergence=div if not passed else None,
                              description=case.description, modules=module_rows))
    return results


@torch.no_grad()
def _compare_component(family, name, ref_mod, nat_mod, ref32, native, ref_lp_side, cfg, seed, dtype):
    expected = ref_mod.component(name, ref32, cfg, seed).float().cpu()
    actual = nat_mod.component(name, native, cfg, seed).float().cpu()
    lp = ref_mod.component(name, ref_lp_side.model, cfg, seed).float().cpu() if ref_lp_side else None
    tol = _tolerance(dtype, lp, expected)
    try:
        m = M.compare(actual, expected)
    except ValueError as exc:
        return Result(family, f"component:{name}", False, {}, tol.as_dict(),
                      Divergence(name, {"error": str(exc)}, tol.as_dict()))
    passed = tol.accepts(m)
    return Result(family, f"component:{name}", passed, m.as_dict(), tol.as_dict(),
                  None if passed else Divergence(name, m.as_dict(), tol.as_dict()))


def size_multiple(family: str, cfg) -> int:
    """Image sides must be a multiple of this: the patch size, times the merge size if any."""
    fam = families.get(family)
    ref_mod = fam.reference()
    custom = getattr(ref_mod, "image_size_multiple", None)
    if custom is not None:
        return custom(cfg)
    vision = getattr(cfg, "vision_config", None) or cfg
    patch = getattr(vision, "patch_size", 1)
    patch = patch if isinstance(patch, int) else patch[0]
    merge = getattr(vision, "spatial_merge_size", None) or 1
    return patch * merge


class InputError(ValueError):
    """The caller's input cannot be checked (bad image size …); the CLI maps it to exit code 2."""


def validate_image_sizes(family: str, cfg, sizes) -> None:
    cfg = cfg if cfg is not None else families.get(family).tiny_config()
    multiple = size_multiple(family, cfg)
    bad = [f"{h}x{w}" for h, w in sizes if h <= 0 or w <= 0 or h % multiple or w % multiple]
    if bad:
        raise InputError(f"image size {', '.join(bad)} is not a positive multiple of {multiple} "
                         f"(the patch size{', times the merge size,' if multiple != _patch(cfg) else ''} "
                         f"of family {family!r})")


def _patch(cfg) -> int:
    vision = getattr(cfg, "vision_config", None) or cfg
    patch = getattr(vision, "patch_size", 1)
    return patch if isinstance(patch, int) else patch[0]
