"""``check --low-memory``: the in-memory check with only the weights of the module running resident.

Both models are built without weights (parameters are placeholders of one element, NaN, expanded
to their shape; buffers are real: they are small, and non-persistent ones such as RoPE's inverse
frequencies are computed at build time and nowhere else). Each unit (a module holding no layer
stack under one that does: a transformer layer, the patch embedding, the merger, the head; see
:func:`_units`) gets a forward pre-hook that reads its parameters just before it runs (the
reference's from the HF files by key, the native's through the same conversion plan ``check``
uses) and a forward hook that drops them after; the public methods of mmparity's own module
classes (``lookup``, ``merge_packed``) are wrapped the same way. So while a layer runs only that
layer is in memory, on one side at a time. Activations flow through each model's own forward
unchanged, which is why the verdicts and the first divergence are the in-memory check's: the
same code computes the same tensors from the same weights; only where the weights live differs.

Deliberate differences from :func:`mmparity.parity.harness.check`:

- Each side runs its own whole forward per case (reference, then native), each feeding its next
  layer its own previous output, as the in-memory check does; a weight is read again for every
  call of its module (time, not memory).
- A module's parameters are resident for the whole of its call, so a module whose forward runs
  its children (a container with a class token) keeps its own parameters while they run; a
  parameter handed to a module as an argument (mcore's tied output layer takes the embedding's
  weight) is made resident for that call. One that some code reads without calling its module
  reads NaN, so the check fails loudly, never passes silently.
- Component checks call submodules' methods rather than their forwards, so while they run every
  parameter outside the models' layer stacks (module lists) is resident.
- HF stores a layer's routed experts stacked in one parameter (``[experts, …]``); its own
  forward indexes it one expert at a time, so such a parameter is read by rows, ``expert_group``
  experts at a time, as that loop reaches them (and dropped when the experts module returns).
  mcore's sequential experts are one module per expert, each converted from that expert's rows
  alone. The experts run in the same order, so the sums are the in-memory check's bit for bit.
- Stacked experts are read by rows only from files in the reference's own layout; from another
  layout (one tensor per expert) the reference's stacked tensor is made whole, through mcore.
- Native model only, TP = PP = EP = 1, one process.

Never prints.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from mmparity.models import registry as families
from mmparity.parallel import runtime
from mmparity.mapping.ops import Unstack
from mmparity.mapping.rules import (
    VOCAB_MULTIPLE, StepRunner, detect_prefix, expected_keys, join, plan_hf_to_mcore, plan_mcore_to_hf)
from mmparity.models.core import attention
from mmparity.models.core.layers import without_initialization
from mmparity.parity import harness
from mmparity.parity.report import Report, versions


def supported() -> list[str]:
    """The families whose report this path reproduces, as their registry entries say
    (tests/cli/test_check_low_memory.py checks each on its tiny checkpoint)."""
    return [fam.name for fam in families.families() if fam.low_memory]


# Experts of a stacked HF experts tensor resident at once: a DeepSeek-V3 expert (three 7168 x 2048
# matrices) is 0.18 GB in float32, so a group weighs about what a layer's attention and shared
# expert do together.
DEFAULT_EXPERT_GROUP = 8


class LowMemoryError(ValueError):
    """A check ``--low-memory`` cannot run (family, layout, options); the CLI exits 2 on it."""


@dataclass
class Usage:
    """What was resident: the most parameter bytes at once on each side, and all of them."""

    peak: dict = field(default_factory=dict)  # side -> bytes
    total: dict = field(default_factory=dict)  # side -> bytes
    reads: int = 0  # tensors read from the HF files


@dataclass
class _Units:
    """How a model's parameters are made resident (:func:`_units`)."""

    on_call: dict  # module -> the parameters its forward makes resident
    whole: dict  # module -> the parameters of the unit it belongs to (its methods load these)
    pinned: list  # resident throughout


def _units(model: nn.Module) -> _Units:
    """A module holding no layer stack (no ``nn.ModuleList`` below it) under one that does is a
    unit: a transformer layer, the patch embedding, the head. Its call loads everything below
    it, because forwards read their children's weights directly (HF CLIP resamples
    ``position_embedding.weight`` without calling the embedding). A module inside a unit loads
    its own, for the component checks that call it alone. The parameters a module holding a
    stack owns itself (a class token) stay resident: the runs enter such models through methods
    (``encode``, ``embed``) that no hook sees."""
    stacks: dict[int, bool] = {}

    def holds_stack(module: nn.Module) -> bool:
        if id(module) not in stacks:
            stacks[id(module)] = isinstance(module, nn.ModuleList) or any(
                holds_stack(child) for child in module.children())
        return stacks[id(module)]

    units = _Units({}, {}, [])

    def visit(module: nn.Module, parent_holds: bool, unit: Optional[list]) -> None:
        own = [p for p in module._parameters.values() if p is not None]
        if holds_stack(module):
            units.pinned.extend(own)
            units.on_call[module] = []
        elif parent_holds:
            unit = list(module.parameters())
            units.on_call[module] = unit
        else:
            units.on_call[module] = own
        if unit is not None:
            units.whole[module] = unit
        for child in module.children():
            visit(child, holds_stack(module), unit)

    visit(model, True, None)
    return units


def _own_methods(module: nn.Module) -> list[str]:
    """The public methods mmparity's own module classes add (``lookup``, ``merge_packed``): the
    runs and components call them instead of ``forward``, so no forward hook would see them."""
    names = []
    for klass in type(module).__mro__:
        if klass.__module__.startswith("mmparity."):
            names += [name for name, value in vars(klass).items()
                      if inspect.isfunction(value) and not name.startswith("_") and name != "forward"]
    return sorted(set(names))


@contextlib.contextmanager
def _parameters_on_meta():
    """Build a model whose parameters land on the meta device as they are registered, while its
    buffers and plain tensors are made for real (a model built under ``torch.device("meta")``
    would lose RoPE tables that are computed once, at build time). Each parameter's own memory is
    allocated only until it is registered; init kernels then run on meta, for free."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and not param.is_meta:
            meta = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)  # mcore's TP attributes ride on the parameter
            param = meta
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        with without_initialization():
            yield
    finally:
        nn.Module.register_parameter = original


def _placeholder(shape, dtype, device) -> torch.Tensor:
    # NaN, so that a weight read while not loaded poisons every metric instead of passing.
    return torch.full((), float("nan"), dtype=dtype, device=device).expand(tuple(shape))


class _ExpertRows(nn.Parameter):
    """A stacked experts parameter (``[experts, …]``) whose rows are read a group at a time as
    the module's own forward indexes it by one expert (HF's per-expert loop); anything else done
    with it sees the NaN placeholder."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and isinstance(args[0], _ExpertRows):
            return args[0]._owner.row(args[0], args[1])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _expert_stacks(model: nn.Module) -> dict:
    """id of every parameter stacking one slice per expert along dim 0 -> the module holding it:
    three or more dims, under a module whose ``num_experts`` is that length (transformers'
    expert collections)."""
    out = {}
    for module in model.modules():
        experts = getattr(module, "num_experts", None)
        if isinstance(experts, int) and not isinstance(experts, bool):
            for param in module._parameters.values():
                if param is not None and param.dim() >= 3 and param.shape[0] == experts:
                    out[id(param)] = module
    return out


class Streamed:
    """A model whose parameters are read when their module runs and dropped when it returns.

    ``source(names) -> {name: tensor}`` reads parameters by their state-dict names (float32
    values, cast here to ``dtype``). With ``rows(name, start, stop)`` (rows of one, read alone),
    stacked experts parameters are read ``expert_group`` experts at a time instead, as their
    module's forward asks for each expert."""

    def __init__(self, model: nn.Module, source: Callable[[list], dict], dtype: torch.dtype, device,
                 usage: Usage, side: str, rows: Optional[Callable] = None,
                 expert_group: int = DEFAULT_EXPERT_GROUP):
        self.model, self.source, self.dtype, self.device = model, source, dtype, torch.device(device)
        self.usage, self.side = usage, side
        self.rows, self.expert_group = rows, expert_group
        stacks = _expert_stacks(model) if rows is not None else {}
        self._groups: dict[int, tuple] = {}  # id -> (first expert, end, rows) of the group resident
        swapped: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in swapped:
                    # As built: mcore runs a frozen weight through another matmul path.
                    kind = _ExpertRows if id(param) in stacks else nn.Parameter
                    new = kind(_placeholder(param.shape, dtype, device), requires_grad=param.requires_grad)
                    new.__dict__.update(param.__dict__)
                    new._owner = self
                    swapped[id(param)] = new
                module._parameters[name] = swapped[id(param)]
        stacked_modules = {id(m): m for m in stacks.values()}
        # By their state-dict names, which the converter writes (mcore's sequential experts are
        # saved under TEGroupedMLP's names by a state-dict hook).
        self.names = {id(v): k for k, v in model.state_dict(keep_vars=True).items()
                      if isinstance(v, nn.Parameter)}
        self.params = {id(p): p for _, p in model.named_parameters()}
        self.count: dict[int, int] = {}
        self.resident = 0
        usage.total[side] = sum(p.numel() * p.element_size() for p in self.params.values())
        usage.peak.setdefault(side, 0)
        self._calls: dict[int, list] = {}
        self._handles = []
        units = _units(model)
        whole = lambda params: [p for p in params if not isinstance(p, _ExpertRows)]  # noqa: E731
        self._wrapped: list[tuple[nn.Module, str]] = []
        for module, held in units.on_call.items():
            self._handles.append(module.register_forward_pre_hook(self._make_pre(whole(held)), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post, always_call=True))
        for module in stacked_modules.values():
            self._handles.append(module.register_forward_hook(self._drop_groups, always_call=True))
        for module, unit in units.whole.items():
            for name in _own_methods(module):
                setattr(module, name, self._holding(whole(unit), getattr(module, name)))
                self._wrapped.append((module, name))
        self.acquire(whole(units.pinned))

    def row(self, param: nn.Parameter, index) -> torch.Tensor:
        """Expert ``index``'s slice of ``param``, from the group of experts holding it."""
        if isinstance(index, torch.Tensor) and index.dim() == 0 and not index.is_floating_point():
            index = int(index)
        if not isinstance(index, int) or not 0 <= index < param.shape[0]:
            raise LowMemoryError(f"{self.side}: {self.names[id(param)]} is read by expert groups; its module "
                                 f"indexed it by {index!r}, not by one expert")
        group = self._groups.get(id(param))
        if group is None or not group[0] <= index < group[1]:
            # The group resident goes before the next is read (its rows were handed out as
            # copies, so nothing else holds it): one group at a time, not two at each switch.
            group = None
            self._drop(param)
            start = index // self.expert_group * self.expert_group
            stop = min(start + self.expert_group, param.shape[0])
            rows = self.rows(self.names[id(param)], start, stop).to(device=self.device, dtype=self.dtype)
            group = self._groups[id(param)] = (start, stop, rows.contiguous())
            self.resident += group[2].numel() * group[2].element_size()
            self.usage.peak[self.side] = max(self.usage.peak[self.side], self.resident)
        # A copy of the one row: a view would keep the whole group alive in the caller's loop
        # variable while the next group is read.
        return group[2][index - group[0]].clone()

    def _drop(self, param) -> None:
        group = self._groups.pop(id(param), None)
        if group is not None:
            self.resident -= group[2].numel() * group[2].element_size()

    def _drop_groups(self, module, args, output):
        for param in module._parameters.values():
            if isinstance(param, _ExpertRows):
                self._drop(param)

    def _holding(self, params: list, method: Callable) -> Callable:
        @functools.wraps(method)
        def call(*args, **kwargs):
            self.acquire(params)
            try:
                return method(*args, **kwargs)
            finally:
                self.release(params)
        return call

    def _make_pre(self, own: list):
        def pre(module, args, kwargs):
            passed = [a for a in (*args, *kwargs.values()) if isinstance(a, nn.Parameter) and id(a) in self.params]
            mine = {id(p) for p in own}
            held = own + [p for p in passed if id(p) not in mine]
            self.acquire(held)
            self._calls.setdefault(id(module), []).append(held)
        return pre

    def _post(self, module, args, output):
        # A forward may return its weight itself (a position table at its own size): the caller
        # gets the loaded values, not the placeholder the parameter is about to hold.
        returned = output.detach() if isinstance(output, nn.Parameter) and id(output) in self.params else None
        stack = self._calls.get(id(module))
        if stack:
            self.release(stack.pop())
        return returned

    def acquire(self, params: list) -> None:
        missing = [p for p in params if not self.count.get(id(p))]
        if missing:
            loaded = self.source([self.names[id(p)] for p in missing])
            for p in missing:
                value = loaded[self.names[id(p)]]
                if tuple(value.shape) != tuple(p.shape):
                    raise LowMemoryError(f"{self.side}: {self.names[id(p)]} reads as {tuple(value.shape)}, "
                                         f"the model holds {tuple(p.shape)}")
                value = value.to(device=self.device, dtype=self.dtype)
                whole = value.numel() * value.element_size()
                if not value.is_contiguous() or value.untyped_storage().nbytes() != whole:
                    # A view (one expert of a stacked tensor) would keep all of what it was cut from.
                    value = value.clone(memory_format=torch.contiguous_format)
                p.data = value
                self.resident += p.numel() * p.element_size()
            self.usage.peak[self.side] = max(self.usage.peak[self.side], self.resident)
        for p in params:
            self.count[id(p)] = self.count.get(id(p), 0) + 1

    def release(self, params: list) -> None:
        for p in params:
            self.count[id(p)] -= 1
            if not self.count[id(p)]:
                p.data = _placeholder(p.shape, self.dtype, self.device)
                self.resident -= p.numel() * p.element_size()

    @contextlib.contextmanager
    def outside_layer_stacks(self):
        """Every parameter not inside a module list resident for the block (component checks)."""
        inside = {id(p) for m in self.model.modules() if isinstance(m, nn.ModuleList) for p in m.parameters()}
        params = [p for p in self.params.values() if id(p) not in inside]
        self.acquire(params)
        try:
            yield
        finally:
            self.release(params)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        for module, name in self._wrapped:
            delattr(module, name)  # the class's method shows through again


def _load_buffers(model: nn.Module, source: Callable[[list], dict]) -> None:
    """The model's persistent buffers (the router's score-correction bias …) from the checkpoint:
    small, and resident for the whole check."""
    buffers = {id(b) for b in model.buffers()}
    found = {k: v for k, v in model.state_dict(keep_vars=True).items()
             if torch.is_tensor(v) and not isinstance(v, nn.Parameter) and id(v) in buffers}
    if found:
        values = source(list(found))
        for name, target in found.items():
            target.copy_(values[name].to(target.dtype))


def _streamed(model: nn.Module, source, dtype, device, usage: Usage, side: str, rows=None,
              expert_group: int = DEFAULT_EXPERT_GROUP) -> Streamed:
    """``model`` (built by :func:`_parameters_on_meta`) with its buffers loaded and, like the
    in-memory check's ``model.to(device, dtype)``, cast and moved, streaming its parameters."""
    _load_buffers(model, source)
    complex_buffers = harness.take_complex_buffers(model)
    model.to(dtype=dtype)  # the parameters are still meta here: only the buffers are cast
    harness.restore_complex_buffers(model, complex_buffers, "cpu")
    streamed = Streamed(model, source, dtype, device, usage, side, rows, expert_group)
    model.to(device=device)  # the placeholders are there already
    return streamed


def check(family: "str | families.Family", cfg, reader, *, dtype: str = "float32", device: str = "cpu",
          seed: int = 0, image_sizes=None, components: bool = True, hf_format: Optional[str] = None,
          usage: Optional[Usage] = None, mutate_native: Optional[Callable[[dict], None]] = None,
          expert_group: int = DEFAULT_EXPERT_GROUP) -> Report:
    """:func:`mmparity.parity.harness.check` of the HF weights ``reader`` holds (``infos()`` and
    ``read(name)``, full checkpoint keys), with one module's weights resident at a time (see the
    module docstring). ``usage``, when given, receives what was resident. ``mutate_native`` edits
    the converted mcore tensors in place as they are read, one module's at a time (a negative
    control: unlike the harness's, it sees only the keys of the module about to run).
    ``expert_group``: how many experts of a stacked experts tensor are resident at once. Raises
    :class:`LowMemoryError` for what this path cannot check, and the converter's
    ``ConversionError`` for weights that do not convert."""
    name = family if isinstance(family, str) else family.name
    if name not in supported():
        raise LowMemoryError(f"--low-memory does not support family {name!r} yet; it supports "
                             f"{', '.join(supported())}")
    fam = families.resolve(family)
    family = fam.name
    if isinstance(expert_group, bool) or not isinstance(expert_group, int) or expert_group < 1:
        raise LowMemoryError(f"--expert-group must be a positive integer, got {expert_group!r}")
    if dtype not in harness.DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(harness.DTYPES)}")
    torch_dtype = harness.DTYPES[dtype]
    usage = usage if usage is not None else Usage()
    hooks = fam.hooks
    harness.refuse_config(fam, cfg)
    infos = reader.infos()
    rules = fam.rule_set(cfg, hf_format, keys=infos.keys())
    prefix = detect_prefix(rules, infos.keys())
    hf_keys, _ = expected_keys(rules)
    source = {k: infos[prefix + k] for k in hf_keys if prefix + k in infos}
    # Totality on the headers alone, before any weight is read: the in-memory check's refusal.
    plan = plan_hf_to_mcore(rules, source, 1, prefix="", vocab_multiple=VOCAB_MULTIPLE)

    def read(key: str, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        usage.reads += 1
        # float32 first, as the in-memory check loads the reference (fp32) and converts its state.
        return reader.read(prefix + key, start, stop).to(torch.float32)

    def converted(names: list) -> dict:
        unknown = [n for n in names if n not in plan.outputs]
        if unknown:
            raise LowMemoryError(f"the conversion produces no tensor for native parameter(s) {', '.join(unknown[:5])}")
        # Each source once per module (a layer's experts all come from one stacked tensor).
        cache: dict = {}
        runner = StepRunner(plan, lambda key: cache[key] if key in cache else cache.setdefault(key, read(key)))
        out = {}
        for name in names:
            index = plan.producer[name]
            sources = plan.sources[index]
            if isinstance(plan.op(index), Unstack) and len(sources) == 1:
                # One expert of a stacked tensor: its rows alone, not every expert's.
                j = plan.steps[index].mcore_keys.index(name)
                out[name] = read(sources[0], j, j + 1)[0]
            else:
                out[name] = join(runner.pieces(name))
        return out

    def mcore_tensors(names: list) -> dict:
        out = converted(names)
        if mutate_native is not None:
            mutate_native(out)
        return out

    default_format = hooks.converter.formats[0]
    rows = None
    if rules.hf_format == default_format:
        rows = read  # the reference's tensors are the files': stacked experts read by rows
        def hf_tensors(names: list) -> dict:
            unknown = [n for n in names if n not in source]
            if unknown:
                raise LowMemoryError(f"the checkpoint has no tensor for reference parameter(s) "
                                     f"{', '.join(unknown[:5])}")
            return {n: read(n) for n in names}
    else:
        # The reference loads only its own layout: through mcore and back, as the in-memory check
        # does (a transformers-saved LLaVA's keys are not its module names), one step at a time.
        back = plan_mcore_to_hf(fam.rule_set(cfg, default_format), plan.outputs)

        def hf_tensors(names: list) -> dict:
            unknown = [n for n in names if n not in back.producer]
            if unknown:
                raise LowMemoryError(f"the conversion produces no tensor for reference parameter(s) "
                                     f"{', '.join(unknown[:5])}")
            out = {}
            for name in names:
                index = back.producer[name]
                step = back.steps[index]
                mcore = converted(back.sources[index])
                values = step.rule.op.invert_pieces([mcore[k] for k in back.sources[index]])
                out[name] = join(dict(zip(step.hf_keys, values))[name])
            return out

    with harness.exact_float32(device, torch_dtype):
        torch.manual_seed(seed)
        with _parameters_on_meta():
            ref = fam.build_reference(cfg)
        ref32 = _streamed(ref, hf_tensors, torch.float32, device, usage, "reference", rows, expert_group)
        ref_lp = None
        if torch_dtype != torch.float32:
            with _parameters_on_meta():
                lp_model = fam.build_reference(cfg)
            ref_lp = _streamed(lp_model, hf_tensors, torch_dtype, device, usage, "reference_lp", rows,
                               expert_group)

        raw_cases = hooks.parity.cases(cfg, seed, image_sizes)
        harness.refuse_case_sizes(fam, cfg, raw_cases)
        cases = [hooks.parity.prepare_case(case, cfg) for case in raw_cases]
        component_names = hooks.parity.components if components else ()

        runtime.init_parallel(1, 1, device=device, seed=seed)
        with _parameters_on_meta():
            native_model = fam.build_native(cfg, params_dtype=torch_dtype)
        native = _streamed(native_model, mcore_tensors, torch_dtype, device, usage, "native")
        try:
            report = _run(fam.name, cfg, seed, cases, component_names, hooks, ref32, ref_lp, native,
                          device, dtype, torch_dtype)
        finally:
            for side in (ref32, ref_lp, native):
                if side is not None:
                    side.close()
    return report


@torch.no_grad()
def _run(family, cfg, seed, cases, component_names, hooks, ref32, ref_lp, native, device, dtype, torch_dtype):
    report = Report(device=str(device), dtype=dtype, seed=seed, versions=versions(), tp=1, pp=1,
                    attention_backend=attention.describe_backend(device, torch_dtype), impl="native")
    ref_side = harness.Side(ref32.model, hooks.reference.run, hooks.reference.pairs(ref32.model, cfg))
    lp_side = (harness.Side(ref_lp.model, hooks.reference.run, hooks.reference.pairs(ref_lp.model, cfg))
               if ref_lp is not None else None)
    nat_side = harness.Side(native.model, hooks.native.run, hooks.native.pairs(native.model, cfg))
    for case in cases:
        native_run = nat_side.run(case)
        reference = ref_side.run(case)
        low_precision = lp_side.run(case) if lp_side else ({}, {})
        report.results.extend(harness._compare_case(family, case, [p.name for p in ref_side.pairs],
                                                    reference, native_run, low_precision, torch_dtype))
    for name in component_names:
        with native.outside_layer_stacks():
            actual = hooks.native.component(name, native.model, cfg, seed).float().cpu()
        with ref32.outside_layer_stacks():
            expected = hooks.reference.component(name, ref32.model, cfg, seed).float().cpu()
        lp = None
        if ref_lp is not None:
            with ref_lp.outside_layer_stacks():
                lp = hooks.reference.component(name, ref_lp.model, cfg, seed).float().cpu()
        report.results.append(harness._compare_component(family, name, actual, expected, lp, torch_dtype))
    return report
