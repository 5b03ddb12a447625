"""``check``: convert the HF weights with the real converter, run both sides, compare, localise.

Never prints. Every check goes through the family's converter (:meth:`Family.hf_to_mcore`), so a parity pass
also vouches for the conversion. For low-precision dtypes both models also run in that dtype and
each is measured against the float32 reference (see :mod:`mmparity.parity.metrics`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Optional

import torch

from mmparity import progress
from mmparity.models import registry as families
from mmparity.parallel import runtime
from mmparity.parallel import pp as pp_mod
from mmparity.mapping.rules import VOCAB_MULTIPLE, with_side
from mmparity.config import first_int, vision_sub_config
from mmparity.models.core import attention, pipeline
from mmparity.parity import metrics as M
from mmparity.parity import router
from mmparity.models.core import megatron_side as megatron_cases
from mmparity.models.spec import Case
from mmparity.models.core.inputs import random_like_state
from mmparity.parity.report import Divergence, Report, Result, versions
from mmparity.models.core import megatron_classes as models

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
IMPLS = ("native", "megatron", "both")


@contextmanager
def exact_float32(device, dtype: torch.dtype):
    """Disable TF32 for float32 checks on CUDA: cuDNN convolutions and matmuls otherwise round to
    10-bit mantissas (~1e-3), which would fail the 1e-5 policy for reasons unrelated to parity."""
    if dtype != torch.float32 or torch.device(device).type != "cuda":
        yield
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@contextmanager
def capture(pairs) -> Iterable[dict]:
    """Record each paired module's (last) output during the block, keyed by pair name."""
    seen: dict = {}
    handles = []
    for pair in pairs:
        def hook(module, args, output, _name=pair.name, _copy=pair.snapshot):
            seen[_name] = _snapshot(output) if _copy else output
        handles.append(pair.module.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _snapshot(output):
    if isinstance(output, torch.Tensor):
        return output.detach().clone()
    if isinstance(output, (tuple, list)):
        return type(output)(_snapshot(o) for o in output)
    return output


def _extract(pairs, seen: dict, case: Case) -> dict:
    out = {}
    for pair in pairs:
        if pair.name in seen:
            out[pair.name] = pair.extract(seen[pair.name], case).detach().float().cpu()
    return out


def _canonical(outputs: dict) -> dict:
    return {k: v.detach().float().cpu() for k, v in outputs.items()}


class Side:
    """One model plus how to run it and which of its modules pair up.

    Pairs whose module is None (built on another pipeline stage) are left out.
    """

    def __init__(self, model, run: Callable, pairs: list):
        self.model, self.run_fn = model, run
        self.pairs = [pair for pair in pairs if pair.module is not None]

    @torch.no_grad()
    def run(self, case: Case) -> tuple[dict, dict]:
        with capture(self.pairs) as seen:
            outputs = self.run_fn(self.model, case)
        return _canonical(outputs), _extract(self.pairs, seen, case)


def move_model(model, device, dtype):
    """``model`` on ``device`` in ``dtype``, its complex buffers kept complex: ``Module.to(dtype)``
    casts a complex tensor to a real dtype, dropping the imaginary part with only a warning
    (transformers' Llama 4 vision tower keeps its RoPE table as a complex buffer)."""
    complex_buffers = take_complex_buffers(model)
    model = model.to(device=device, dtype=dtype)
    restore_complex_buffers(model, complex_buffers, device)
    return model


def take_complex_buffers(model) -> dict:
    """``model``'s complex buffers (name -> tensor), their slots emptied so that a cast skips them."""
    taken = {name: buffer for name, buffer in model.named_buffers() if buffer.is_complex()}
    for name in taken:
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = None
    return taken


def restore_complex_buffers(model, buffers: dict, device) -> None:
    """Put ``buffers`` (from :func:`take_complex_buffers`) back into ``model`` on ``device``."""
    for name, buffer in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = buffer.to(device)


def load_reference_weights(ref, hf_state: Optional[dict], seed: int) -> dict:
    """Load ``hf_state`` or seeded random weights into ``ref``; return the state actually used."""
    if hf_state is None:
        # HF's init leaves norms at 1 and biases at 0, which hides swapped or misplaced tensors.
        hf_state = random_like_state(ref.state_dict(), seed)
    ref.load_state_dict(hf_state, strict=True)
    return {k: v for k, v in ref.state_dict().items()}


def check(family: "str | families.Family", cfg=None, hf_state: Optional[dict] = None, *,
          dtype: str = "float32", device: str = "cpu", **kwargs) -> Report:
    """Parity of one family (its name or its registry record); see :func:`_check` for the
    arguments. Never prints."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    fam = families.resolve(family)
    with exact_float32(device, DTYPES[dtype]):
        return _check(fam, cfg, hf_state, dtype=dtype, device=device, **kwargs)


def _check(fam: families.Family, cfg=None, hf_state: Optional[dict] = None, *, dtype: str = "float32",
          device: str = "cpu", seed: int = 0, image_sizes=None, components: bool = True,
          mutate_native: Optional[Callable[[dict], None]] = None, hf_format: Optional[str] = None,
          native_shards: Optional[list] = None, tp: int = 1, pp: int = 1,
          layer_counts: Optional[list] = None, impl: str = "native",
          megatron_class: Optional[str] = None, ep: int = 1,
          vocab_divisor: Optional[int] = None) -> Report:
    """Parity of one family; returns a :class:`Report` (no printing, no exit codes).

    ``hf_state``: HF-layout weights of the reference model (keys as the reference module expects);
    random seeded weights when None. ``mutate_native`` edits each converted mcore rank state before
    it is loaded (negative controls; keys are globally numbered, before any pipeline split).
    ``native_shards`` bypasses the converter (e.g. shards read from an mcore checkpoint on disk;
    their count sets the TP size). ``tp * pp > 1`` runs the native model across that many ranks
    (spawned, gloo on CPU, nccl on CUDA; or the ranks of a ``torchrun`` of exactly that size).
    Under ``pp > 1`` each rank loads the state of its (TP rank, pipeline stage) exactly as
    ``mmparity convert --pp`` splits it (``layer_counts`` overrides the split, e.g. with the
    counts a checkpoint recorded) and the stages run one after another.
    ``impl``: ``native`` (mmparity's mcore model), ``megatron`` (Megatron's own class,
    :mod:`mmparity.models.core.megatron_side`; ``megatron_class`` picks one where a family has several) or
    ``both`` side by side; every result names its ``impl``.
    ``ep > 1`` spreads each MoE layer's experts over that many ranks as ``mmparity convert --ep``
    does (every rank runs the same batch: mcore's all-gather dispatcher sends each token to the
    rank holding its experts and back), so the outputs must be the EP 1 ones.
    ``vocab_divisor``: the ``make_vocab_size_divisible_by`` the ``native_shards`` were padded with
    (a checkpoint's record; None: Megatron-LM's default): Megatron's class is built with it, as
    Megatron-LM builds it for that checkpoint, and the reference's loss is padded alike.
    Raises :class:`InputError` for a pipeline the model cannot take, and
    :class:`~mmparity.models.core.megatron_classes.UpstreamUnavailable` when Megatron's class cannot be imported.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    if impl not in IMPLS:
        raise InputError(f"unknown impl {impl!r}; choose one of {', '.join(IMPLS)}")
    family, hooks = fam.name, fam.hooks
    runs_native, runs_megatron = impl in ("native", "both"), impl in ("megatron", "both")
    mclass_name, mclass = None, None
    if runs_megatron:
        try:
            mclass_name, mclass = fam.megatron_class(megatron_class, cfg)
        except megatron_cases.NoMegatronClass as exc:
            raise InputError(str(exc)) from None
        if pp != 1 and mclass.stage_module is None:
            raise InputError(f"{family}: --impl {impl} runs Megatron's {mclass_name} without pipeline "
                             f"stages; drop --pp {pp}")
        if runs_native and mclass.holds:
            raise InputError(f"{family}: --impl both sets the whole model beside the native one; "
                             f"Megatron's {mclass_name} holds only {', '.join(p + '*' for p in mclass.holds)}"
                             f"{f' ({mclass.why_part})' if mclass.why_part else ''}: use --impl megatron")
        models.require(mclass.build)
        if cfg is None and mclass.default_config is not None:
            cfg = mclass.default_config()
    cfg = cfg if cfg is not None else fam.tiny_config()
    refuse_config(fam, cfg)  # before any model is built or rank started
    torch.manual_seed(seed)

    ref = fam.build_reference(cfg)
    used_state = load_reference_weights(ref, hf_state, seed)
    if native_shards is None:
        progress.step("converting the weights")
        native_shards = fam.hf_to_mcore(used_state, cfg, tp_size=tp, hf_format=hf_format)
    tp = len(native_shards)
    side = getattr(native_shards, "side", None) or [{} for _ in native_shards]
    native_shards = with_side(native_shards)
    tied = pp_mod.tied_head(list(native_shards[0]), pp)  # the converter's: a mutation cannot untie it
    if mutate_native is not None:
        for shard in native_shards:
            mutate_native(shard)
    stage_shards, counts = split_stages(fam, cfg, native_shards, pp, layer_counts, tied=tied)

    # Megatron's class takes fewer inputs than the native model (fixed sizes, no video ...): under
    # --impl megatron / both every side runs the cases Megatron's class accepts.
    try:
        raw_cases = (mclass.cases(hooks, cfg, seed, image_sizes) if runs_megatron
                     else hooks.parity.cases(cfg, seed, image_sizes))
    except megatron_cases.UnsupportedInput as exc:
        raise InputError(f"{family}: {exc}") from None
    refuse_case_sizes(fam, cfg, raw_cases)
    cases = [hooks.parity.prepare_case(case, cfg) for case in raw_cases]
    refuse_long_sequences(fam, cfg, cases)
    component_names = hooks.parity.components if components and runs_native else ()
    if ep != 1:
        stage_shards = _split_experts(family, stage_shards, ep, runs_megatron)
    world = tp * pp * ep
    native_cases, native_components = [], {}
    if runs_native:
        job = NativeJob(fam, cfg, cases, component_names, dtype, str(device), seed, counts, ep)
        if world == 1 or runtime.launched_world_size() == world:
            # In-process: one rank, or every rank of a ``torchrun --nproc-per-node tp*pp`` launch.
            native_cases, native_components = job.run(stage_shards, layout=(tp, pp))
        else:
            progress.step(f"native model on {world} ranks")
            native_cases, native_components = runtime.spawn(_native_rank, world, job, stage_shards)[0]
    megatron_cases_run = []
    if runs_megatron:
        # Megatron's class loads the converter's mcore state alone (as perturbed above): the side
        # tensors are what it has no place for.
        megatron_shards = [{k: v for k, v in shard.items() if k not in extra}
                           for shard, extra in zip(native_shards, side)]
        megatron_stages, _ = split_stages(fam, cfg, megatron_shards, pp, layer_counts, tied=tied)
        mjob = MegatronJob(fam, mclass_name, cfg, cases, dtype, str(device), counts, vocab_divisor)
        if world == 1 or runtime.launched_world_size() == world:
            megatron_cases_run = mjob.run(megatron_stages, layout=(tp, pp))
        else:
            progress.step(f"Megatron's {mclass_name} on {world} ranks")
            megatron_cases_run = runtime.spawn(_megatron_rank, world, mjob, megatron_stages)[0]

    ref32 = move_model(ref, device, torch.float32)
    report = Report(device=str(device), dtype=dtype, seed=seed, versions=versions(), tp=tp, pp=pp, ep=ep,
                    attention_backend=attention.describe_backend(device, torch_dtype), impl=impl)
    if runs_megatron:
        report.megatron = {"version": models.megatron_version(), "te": models.describe_te(),
                           "classes": {fam.name: mclass_name}}
        notes = megatron_cases.class_notes(hooks.megatron, mclass_name, cfg)
        fallback = megatron_cases.default_refusal(hooks, cfg) if megatron_class is None else None
        if fallback and fallback not in notes:  # why the family's default class is not the one run
            notes = f"{fallback}; {notes}" if notes else fallback
        if notes:
            report.megatron["notes"] = {fam.name: notes}
    ref32_side = Side(ref32, hooks.reference.run, hooks.reference.pairs(ref32, cfg))
    ref_lp_side = None
    if torch_dtype != torch.float32:
        ref_lp = move_model(copy.deepcopy(ref), device, torch_dtype)
        ref_lp_side = Side(ref_lp, hooks.reference.run, hooks.reference.pairs(ref_lp, cfg))
    if runs_megatron:
        # The reference's pairs as set against Megatron's modules (e.g. cut to the same rows); a
        # class holding a part runs the reference's part alone.
        reference_run = (hooks.reference.run if mclass.reference_run is None
                         else lambda model, case: mclass.reference_run(model, case, cfg))
        ref32_for_megatron = Side(ref32, reference_run,
                                  mclass.reference_pairs(hooks.reference.pairs(ref32, cfg), cfg))
        ref_lp_for_megatron = (Side(ref_lp_side.model, reference_run,
                                    mclass.reference_pairs(ref_lp_side.pairs, cfg))
                               if ref_lp_side else None)

    divisor = vocab_divisor if vocab_divisor is not None else VOCAB_MULTIPLE
    for index, case in enumerate(cases):
        progress.step(f"case {index + 1}/{len(cases)} {case.name}: reference")
        if runs_native:
            started = time.perf_counter()
            reference = ref32_side.run(case)
            low_precision = ref_lp_side.run(case) if ref_lp_side else ({}, {})
            report.results.extend(_timed(_compare_case(fam.name, case, [p.name for p in ref32_side.pairs],
                                                       reference, native_cases[index], low_precision,
                                                       torch_dtype), started))
        if runs_megatron:
            started = time.perf_counter()
            mreference, mlow = ref32_for_megatron.run(case), ({}, {})
            if ref_lp_for_megatron:
                mlow = ref_lp_for_megatron.run(case)
                mlow = (mclass.reference_outputs(mlow[0], case, cfg, tp, divisible_by=divisor), mlow[1])
            mreference = (mclass.reference_outputs(mreference[0], case, cfg, tp, divisible_by=divisor),
                          mreference[1])
            if mclass.notes:
                case = dataclasses.replace(case, description="; ".join(
                    d for d in (case.description, mclass.notes) if d))
            report.results.extend(_timed(_compare_megatron_case(
                fam.name, case, megatron_cases_run[index], mreference, mlow, torch_dtype), started))
    with torch.no_grad():
        for name in component_names:
            progress.step(f"component {name}")
            started = time.perf_counter()
            expected = hooks.reference.component(name, ref32, cfg, seed).float().cpu()
            lp = (hooks.reference.component(name, ref_lp_side.model, cfg, seed).float().cpu()
                  if ref_lp_side else None)
            report.results.extend(_timed([_compare_component(fam.name, name, native_components[name],
                                                             expected, lp, torch_dtype)], started))
    return report


def _stepped(cases: list, side: str):
    """``cases``, each said as a progress step as it starts."""
    for index, case in enumerate(cases):
        progress.step(f"{side} case {index + 1}/{len(cases)} {case.name}")
        yield case


def _timed(results: list, started: float) -> list:
    """``results`` of one case (or component), each given an equal share of the seconds since
    ``started``: the case's outputs are judged together, and their shares add up to its time."""
    seconds = (time.perf_counter() - started) / max(len(results), 1)
    for result in results:
        result.seconds = seconds
    return results


class MegatronJob:
    """Megatron's own class on the cases, picklable so that spawned ranks can run it too."""

    def __init__(self, family, class_name, cfg, cases, dtype, device, layer_counts=None, divisible_by=None):
        self.family, self.class_name, self.cfg, self.cases = family, class_name, cfg, cases
        self.dtype, self.device, self.layer_counts = dtype, device, layer_counts
        self.divisible_by = divisible_by  # the checkpoint's vocabulary divisor (None: Megatron-LM's default)

    @torch.no_grad()
    def run(self, stage_shards: list, layout=None) -> list:
        """Per case: ``MegatronRun`` (merged over the pipeline stages). ``stage_shards[stage][tp_rank]``:
        the family's mcore state each rank's Megatron class takes its part of."""
        with exact_float32(self.device, DTYPES[self.dtype]):
            if layout is not None:
                runtime.init_parallel(*layout, device=self.device, layer_counts=self.layer_counts)
            _name, mclass = self.family.megatron_class(self.class_name)
            torch_dtype = DTYPES[self.dtype]
            model = models.build(mclass.build, self.cfg, torch_dtype, divisible_by=self.divisible_by)
            shards = stage_shards[runtime.pipeline_rank()]
            state = shards[runtime.tp_rank()] if len(shards) > 1 else shards[0]
            models.load_strict(model, {k: v.to(torch_dtype) if torch.is_tensor(v) else v
                                       for k, v in mclass.state(state).items()})
            model = move_model(model, self.device, torch_dtype)
            pairs = [pair for pair in mclass.pairs(model, self.cfg) if pair.module is not None]
            pp = len(stage_shards)
            with pipeline.StageLink(model, mclass.stage_module(model)) if pp > 1 else contextlib.nullcontext():
                results = [_run_megatron_case(mclass, model, pairs, case, self.cfg,
                                              compare_modules=case.name in mclass.module_cases)
                           for case in _stepped(self.cases, "Megatron's class")]
            if pp == 1:
                return results
            return _merge_stages(pipeline.gather_stage_results((results, {})), pp)[0]


def _megatron_rank(rank: int, world_size: int, job: MegatronJob, stage_shards: list):
    tp = len(stage_shards[0])
    result = job.run(stage_shards, layout=(tp, world_size // tp))
    return result if rank == 0 else None


def _run_megatron_case(mclass, model, pairs, case: Case, cfg, compare_modules: bool):
    """``(outputs, module captures, error)``. A Megatron failure on an input is a finding: it is
    returned with the innermost paired module that was running when it raised."""
    seen: dict = {}
    running: list = []
    handles = []
    for pair in pairs:
        def before(module, args, _name=pair.name):
            running.append(_name)

        def after(module, args, output, _name=pair.name, _copy=pair.snapshot):
            # Megatron's packed paths call some modules more than once: keep the first call
            # (copied when the pair asks, as ``capture`` copies it).
            if _name not in seen:
                seen[_name] = _snapshot(output) if _copy else output
            running.remove(_name)
        handles += [pair.module.register_forward_pre_hook(before),
                    pair.module.register_forward_hook(after)]
    try:
        outputs = mclass.run(model, case, cfg)
    except Exception as exc:  # noqa: BLE001 — reported as this case's located failure
        where = running[-1] if running else "forward"
        return {}, {}, MegatronError(where, f"{type(exc).__name__}: {' '.join(str(exc).split())}")
    finally:
        for h in handles:
            h.remove()
    modules = _extract(pairs, seen, case) if compare_modules else {}
    return _canonical(outputs), modules, None


class MegatronError:
    """Megatron's class raised on a case: ``module`` is where, ``message`` what."""

    def __init__(self, module: str, message: str):
        self.module, self.message = module, message


def _compare_megatron_case(family, case, megatron_run, reference, low_precision, dtype) -> list[Result]:
    outputs, modules, error = megatron_run
    if error is not None:
        tol = M.fp32_tolerance() if dtype == torch.float32 else M.Tolerance(float("nan"), "not measured")
        # Which outputs the class would have produced is unknown: one result for the case.
        div = Divergence(error.module, {"error": error.message}, tol.as_dict())
        return [Result(family=family, check=f"{case.name}:run", passed=False, metrics={},
                       tolerance=tol.as_dict(), first_divergence=div, description=case.description,
                       impl="megatron")]
    # An HF output Megatron's class has no counterpart for (CLIP's pooled ln_post ...) is not compared.
    compared = dataclasses.replace(case, outputs=tuple(o for o in case.outputs if o in outputs))
    pair_names = [name for name in reference[1] if name in modules]
    return _compare_case(family, compared, pair_names, reference, (outputs, modules), low_precision,
                         dtype, impl="megatron")


def _split_experts(family: str, stage_shards: list, ep: int, runs_megatron: bool) -> list:
    """``states[stage][tp_rank]`` -> ``states[stage][tp_rank][ep_rank]``, each rank's experts
    under local numbers (:func:`mmparity.parallel.ep.split_expert_ranks`)."""
    from mmparity.parallel import ep as ep_mod
    from mmparity.parallel.axes import AxisError, expert_axis

    if runs_megatron:
        raise InputError(f"{family}: --ep runs the native model only; drop --impl megatron")
    experts = ep_mod.expert_count(list(stage_shards[0][0]))
    try:
        axis = expert_axis(ep)
        if not experts:
            raise AxisError(f"--ep {ep}: no experts in family {family}")
        axis.counts(experts)
        return [[ep_mod.split_expert_ranks(state, axis, experts) for state in stage] for stage in stage_shards]
    except AxisError as exc:
        raise InputError(f"{family}: {exc}") from None


def split_stages(fam: families.Family, cfg, shards: list, pp: int,
                 layer_counts: Optional[list] = None, *, tied=None) -> tuple[list, Optional[list]]:
    """Per-TP-rank, globally numbered mcore states -> ``(states[stage][tp_rank], layer counts)``.

    The split is the converter's (``mmparity convert --pp``: the same pipelined stack, the same
    keys on the last stage, the same per-stage counts), so each rank loads exactly what its file in
    a legacy checkpoint holds. Counts are None at ``pp == 1``. Raises :class:`InputError` when the
    model cannot be pipelined that way.
    A tied head (``tied``: ``pp.tied_head`` of the converter's keys, else of ``shards``') gives the
    last stage its own copy of the table, as convert writes it (``pp.split_ranks``).
    """
    family = fam.name
    if pp < 1:
        raise InputError(f"--pp must be >= 1, got {pp}")
    if pp == 1:
        return [shards], None
    # Converter shards list their keys in plan order, which is what pipeline_layout reads.
    layout = pp_mod.pipeline_layout(list(shards[0]))
    try:
        counts = list(layer_counts) if layer_counts is not None else layout.layer_counts(pp)
    except pp_mod.PipelineError as exc:
        raise InputError(f"{family}: {exc}") from None
    if len(counts) != pp or sum(counts) != layout.num_layers or min(counts) < 1:
        raise InputError(f"{family}: per-stage layer counts {counts} do not split the "
                         f"{layout.num_layers} layers of {layout.layer_prefix} over {pp} stages")
    problems = []
    try:
        runtime.uneven_stage_fields(counts)
    except ValueError as exc:
        problems.append(f"--pp {pp} on {layout.num_layers} layers: {exc}")
    problems += fam.hooks.config.pipeline_problems(cfg, pp)
    if problems:
        raise InputError(f"{family}: {'; '.join(problems)}")
    tied = tied if tied is not None else pp_mod.tied_head(list(shards[0]), pp)
    try:
        return pp_mod.split_ranks(shards, counts, layout, tied), counts
    except pp_mod.PipelineError as exc:
        raise InputError(f"{family}: {exc}") from None


class NativeJob:
    """Everything the native side needs, picklable so that spawned ranks can run it too."""

    def __init__(self, family, cfg, cases, components, dtype, device, seed, layer_counts=None, ep=1):
        self.family, self.cfg, self.cases, self.components = family, cfg, cases, components
        self.dtype, self.device, self.seed = dtype, device, seed
        self.layer_counts = layer_counts
        self.ep = ep

    @torch.no_grad()
    def run(self, stage_shards: list, layout=None):
        with exact_float32(self.device, DTYPES[self.dtype]):
            return self._run(stage_shards, layout)

    def _run(self, stage_shards: list, layout=None):
        """``stage_shards[stage][tp_rank]``: the state each rank loads. Returns the outputs and
        the paired-module captures per case, and the components, merged over the stages."""
        if layout is not None:
            runtime.init_parallel(*layout, ep=self.ep, device=self.device, seed=self.seed,
                                  layer_counts=self.layer_counts)
        pp = len(stage_shards)
        stage = runtime.pipeline_rank()
        shards = stage_shards[stage]
        state = shards[runtime.tp_rank()] if len(shards) > 1 else shards[0]
        if self.ep > 1:
            from megatron.core import parallel_state

            state = state[parallel_state.get_expert_model_parallel_rank()]
        torch_dtype = DTYPES[self.dtype]
        fam = self.family
        hooks = fam.hooks
        native = fam.build_native(self.cfg, params_dtype=torch_dtype)
        native.load_state_dict({k: v.to(torch_dtype) if torch.is_tensor(v) else v
                                for k, v in state.items()}, strict=True)
        native = move_model(native, self.device, torch_dtype)
        side = Side(native, hooks.native.run, hooks.native.pairs(native, self.cfg))
        with pipeline.StageLink(native) if pp > 1 else contextlib.nullcontext():
            case_results = [side.run(case) for case in _stepped(self.cases, "native")]
        last_stage_components = set(hooks.parity.last_stage_components)
        mine = [name for name in self.components
                if (name in last_stage_components and stage == pp - 1)
                or (name not in last_stage_components and stage == 0)]
        component_results = {name: hooks.native.component(name, native, self.cfg, self.seed).float().cpu()
                             for name in mine}
        if pp == 1:
            return case_results, component_results
        return _merge_stages(pipeline.gather_stage_results((case_results, component_results)), pp)


def _merge_stages(gathered: list, pp: int):
    """Outputs (and what else a case's result holds after its captures: Megatron's error) from
    the last stage, paired-module captures and components from every stage (TP rank 0 of each:
    TP ranks hold the same replicated activations)."""
    by_stage = {stage: result for stage, tp_rank, result in gathered if tp_rank == 0}
    last_cases, _ = by_stage[pp - 1]
    merged_cases, merged_components = [], {}
    for index, (outputs, _, *rest) in enumerate(last_cases):
        modules = {}
        for stage in range(pp):
            modules.update(by_stage[stage][0][index][1])
        merged_cases.append((outputs, modules, *rest))
    for stage in range(pp):
        merged_components.update(by_stage[stage][1])
    return merged_cases, merged_components


def _native_rank(rank: int, world_size: int, job: NativeJob, stage_shards: list):
    """Entry point of one spawned rank; only rank 0's (merged) results are sent back."""
    tp = len(stage_shards[0])
    result = job.run(stage_shards, layout=(tp, world_size // (tp * job.ep)))
    return result if rank == 0 else None


def _tolerance(dtype, ref_lp_out, ref32_out) -> M.Tolerance:
    if ref_lp_out is None:
        return M.fp32_tolerance()
    return M.tolerance_for(dtype, M.compare(ref_lp_out, ref32_out).rel_l2)


# How much a module's error must exceed every error before it to be where the model departs
# rather than noise handed down (see _Locator).
JUMP = 10.0


class _Locator:
    """The first divergence of a case: the first failing module (in forward order) whose error
    jumps, at least :data:`JUMP` times every error before it; where none jumps, the first failing
    module. A fixed float32 bound sits close to what rounding alone reaches deep in a model (a
    Gated DeltaNet layer multiplies its input's error several times over): a module at the edge
    of its bound, with errors of its size all before it, is noise passed down, while a changed
    weight makes its module's error leap. An error raised comparing a module, or a router sending
    tokens to other experts than rounding can, is decisive where nothing before it was."""

    def __init__(self):
        self.first_failing = self.jumped = None
        self.worst_before = 0.0

    def decisive(self, divergence) -> None:
        if divergence is not None and self.jumped is None:
            self.jumped = divergence
            self.first_failing = self.first_failing or divergence

    def add(self, name: str, m, tol, ok: bool) -> None:
        rel = m.rel_l2 if math.isfinite(m.rel_l2) else math.inf
        if not ok:
            divergence = Divergence(name, m.as_dict(), tol.as_dict())
            self.first_failing = self.first_failing or divergence
            if self.jumped is None and rel >= JUMP * self.worst_before:
                self.jumped = divergence
        self.worst_before = max(self.worst_before, rel)

    @property
    def divergence(self):
        return self.jumped or self.first_failing


def _compare_case(family, case, pair_names, reference, native, low_precision, dtype,
                  impl: str = "native") -> list[Result]:
    ref_out, ref_mods = reference
    nat_out, nat_mods = native
    lp_out, lp_mods = low_precision

    module_rows, located = [], _Locator()
    for name in pair_names:
        if name not in ref_mods or name not in nat_mods:
            continue
        if router.is_router(name):
            row, div = _compare_router(name, nat_mods[name], ref_mods[name], lp_mods.get(name), dtype)
            module_rows.append(row)
            located.decisive(div)  # tokens sent elsewhere than rounding can: no noise at the edge
            continue
        tol = _tolerance(dtype, lp_mods.get(name), ref_mods[name])
        try:
            m = M.compare(nat_mods[name], ref_mods[name])
        except ValueError as exc:
            module_rows.append({"module": name, "error": str(exc), "passed": False})
            located.decisive(Divergence(name, {"error": str(exc)}, tol.as_dict()))
            continue
        ok = tol.accepts(m)
        module_rows.append({"module": name, "metrics": m.as_dict(), "tolerance": tol.rel_l2, "passed": ok})
        located.add(name, m, tol, ok)
    divergence = located.divergence

    results = []
    for output in case.outputs:
        tol = _tolerance(dtype, lp_out.get(output), ref_out[output])
        try:
            m = M.compare(nat_out[output], ref_out[output])
        except ValueError as exc:
            div = divergence or Divergence(output, {"error": str(exc)}, tol.as_dict())
            results.append(Result(family=family, check=f"{case.name}:{output}", passed=False,
                                  metrics={}, tolerance=tol.as_dict(), first_divergence=div,
                                  description=case.description, modules=module_rows, impl=impl))
            continue
        passed = tol.accepts(m)
        div = divergence
        if not passed and div is None:
            div = Divergence(output, m.as_dict(), tol.as_dict())
        results.append(Result(family=family, check=f"{case.name}:{output}", passed=passed,
                              metrics=m.as_dict(), tolerance=tol.as_dict(),
                              first_divergence=div if not passed else None,
                              description=case.description, modules=module_rows, impl=impl))
    routers = [row for row in module_rows if router.is_router(row["module"])]
    if routers:
        results.append(router_result(family, case, routers, module_rows, impl, divergence))
    return results


def router_result(family, case, routers: list, module_rows: list, impl: str,
                  first: Optional[Divergence] = None) -> Result:
    """A case's router agreement as a check of its own, ``CASE:router``: it passes when every MoE
    layer sends its tokens to HF's experts (ties and the dtype's noise floor aside). Its numbers are
    the worst layer's routing weights, which locate like any module's rows (a deep layer's weights
    may carry more error than the logits, as any deep module may); its totals are under
    ``metrics.router``. A failing layer fails the check (and the command) like a failing output;
    its first divergence is the case's (``first``: a router downstream of a changed expert routes
    differently because its input changed, so the cause is where the model first departs)."""
    totals = {"layers": len(routers), "tokens": 0, "same_experts": 0, "ties": 0, "disagreements": 0, "allowed": 0}
    worst, worst_ratio, divergence = routers[0], -1.0, None
    for row in routers:
        verdict = (row.get("metrics") or {}).get("router") or {}
        for key in ("tokens", "same_experts", "ties", "disagreements", "allowed"):
            totals[key] += verdict.get(key, 0)
        rel, bound = (row.get("metrics") or {}).get("rel_l2"), row.get("tolerance")
        ratio = rel / bound if isinstance(rel, float) and isinstance(bound, float) and bound > 0 else -1.0
        if ratio > worst_ratio:
            worst_ratio, worst = ratio, row
        if not router.routes_alike(row) and divergence is None:
            metrics = row.get("metrics") or {"error": row.get("error", "")}
            divergence = Divergence(row["module"], metrics,
                                    {"rel_l2": bound} if isinstance(bound, float) else {})
    numbers = {k: v for k, v in (worst.get("metrics") or {}).items() if k != "router"}
    bound = worst.get("tolerance")
    return Result(family=family, check=f"{case.name}:router", passed=divergence is None,
                  metrics={**numbers, "router": totals},
                  tolerance={"rel_l2": bound} if isinstance(bound, float) else {},
                  first_divergence=None if divergence is None else (first or divergence),
                  description=case.description, modules=module_rows, impl=impl)


def _compare_router(name, actual, expected, low_precision, dtype):
    """A router pair's row and divergence: every token routed to HF's experts (or a tie), and
    the routing weights of the tokens that agree within the usual tolerance."""
    try:
        verdict, same = router.agreement(actual, expected, dtype, low_precision)
        if low_precision is not None:
            floor, _ = router.agreement(low_precision, expected, dtype, low_precision)
            verdict.allowed = 2 * floor.disagreements
    except ValueError as exc:
        return {"module": name, "error": str(exc), "passed": False}, Divergence(name, {"error": str(exc)}, {})
    weights = lambda t: t[same][..., 0]  # noqa: E731
    tol = _tolerance(dtype, None if low_precision is None else weights(low_precision), weights(expected))
    m = M.compare(weights(actual), weights(expected)) if bool(same.any()) else None
    passed = verdict.passed and (m is None or tol.accepts(m))
    metrics = {**(m.as_dict() if m is not None else {}), "router": verdict.as_dict()}
    row = {"module": name, "metrics": metrics, "tolerance": tol.rel_l2, "passed": passed}
    return row, (None if passed else Divergence(name, metrics, tol.as_dict()))


def _compare_component(family, name, actual, expected, low_precision, dtype) -> Result:
    tol = _tolerance(dtype, low_precision, expected)
    try:
        m = M.compare(actual, expected)
    except ValueError as exc:
        return Result(family, f"component:{name}", False, {}, tol.as_dict(),
                      Divergence(name, {"error": str(exc)}, tol.as_dict()))
    passed = tol.accepts(m)
    return Result(family, f"component:{name}", passed, m.as_dict(), tol.as_dict(),
                  None if passed else Divergence(name, m.as_dict(), tol.as_dict()))


def size_multiple(fam: families.Family, cfg) -> int:
    """Image sides must be a multiple of this: the patch size, times the merge size if any."""
    custom = fam.hooks.config.image_size_multiple
    if custom is not None:
        return custom(cfg)
    merge = getattr(vision_sub_config(cfg), "spatial_merge_size", None) or 1
    return _patch(cfg) * merge


class InputError(ValueError):
    """The caller's input cannot be checked (bad image size …); the CLI maps it to exit code 2."""


def validate_image_sizes(fam: families.Family, cfg, sizes) -> None:
    family = fam.name
    cfg = cfg if cfg is not None else fam.tiny_config()
    multiple = size_multiple(fam, cfg)
    bad = [f"{h}x{w}" for h, w in sizes if h <= 0 or w <= 0 or h % multiple or w % multiple]
    if bad:
        raise InputError(f"image size {', '.join(bad)} is not a positive multiple of {multiple} "
                         f"(the patch size{', times the merge size,' if multiple != _patch(cfg) else ''} "
                         f"of family {family!r})")
    # Family-specific limits beyond divisibility (e.g. a 2x2 merger needs at least a 2x2 grid).
    problems = fam.hooks.config.image_size_problems(cfg, sizes)
    if problems:
        raise InputError(f"family {family!r}: {'; '.join(problems)}")


def refuse_config(fam: families.Family, cfg) -> None:
    """:class:`InputError` for what of ``cfg`` the native model cannot reproduce (the family's
    ``config_problems``): said before anything is built, not by a rank that fails building it."""
    problems = fam.hooks.config.problems(cfg)
    if problems:
        raise InputError(f"{fam.name}: the native model cannot reproduce this config: {'; '.join(problems)}")


def refuse_case_sizes(fam: families.Family, cfg, cases) -> None:
    """:class:`InputError` when a case's images are beyond what ``cfg`` allows (the family's
    ``image_size_problems``): the family's own inputs, where a config takes none of them."""
    problems = fam.hooks.config.image_size_problems
    outside = [p for case in cases if "sizes" in case.data for p in problems(cfg, case.data["sizes"])]
    if outside:
        raise InputError(f"{fam.name}: the config takes none of the images this check runs: {outside[0]}"
                         + (f" (+{len(outside) - 1} more)" if len(outside) > 1 else ""))


def longest_sequence(case: Case) -> int:
    """The most tokens a sequence of ``case`` has (0 for a tower's case: no token ids)."""
    lengths = [int(v.shape[-1]) for k, v in case.data.items()
               if k.endswith("input_ids") and isinstance(v, torch.Tensor) and v.dim() >= 1]
    return max(lengths, default=0)


def refuse_long_sequences(fam: families.Family, cfg, cases) -> None:
    """:class:`InputError` when a case's token sequence (text and image tokens together) is longer
    than the language model's ``max_position_embeddings``, for a VLM composed as Megatron's
    ``LLaVAModel``: it cuts the combined sequence there while transformers runs on, so the two
    would compare different lengths. (A language model alone, or Kimi-K2.5's whole model, runs
    its rotary positions past that number as transformers does.)"""
    if not fam.composed:
        return
    text = getattr(cfg, "text_config", None) or cfg
    most = getattr(text, "max_position_embeddings", None)
    if not isinstance(most, int):
        return
    for case in cases:
        tokens = longest_sequence(case)
        if tokens > most:
            images = len(case.data.get("sizes", ()))
            made = f"{images} image(s) and their text make" if images else "the text makes"
            raise InputError(f"{fam.name}: case {case.name!r}: {made} a sequence of {tokens} tokens, beyond the "
                             f"language model's max_position_embeddings {most}: take fewer or smaller images")


def _patch(cfg) -> int:
    return first_int(getattr(vision_sub_config(cfg), "patch_size", 1))
