"""The layout transformers' ``save_pretrained`` writes and its ``from_pretrained`` reads, as a rule
table: a family's module-name table (``hf``) seen through transformers' own checkpoint conversion
mapping (``transformers.conversion_mapping``), taken from the installed transformers at run time,
so that a release that changes how a model is saved is followed, not refused.

Reading (:func:`rule_set` with the stored keys): every stored key is renamed as ``from_pretrained``
renames it (the model's ``WeightRenaming``\\ s in turn, then at most one ``WeightConverter``, the
base-model prefix added or stripped against the model's own state-dict names, keys visited in
transformers' natural order), the tensors a converter collects become module tensors through that
converter's own ops, and the module-name table takes them to mcore. Writing (the table's inverse,
and the whole table when no stored keys are given): the module tensors go back as
``save_pretrained`` sends them (the transforms reversed and in reverse order, each converter's
``reverse_op``\\ s), to the names it writes.

Nothing here is a copy of a mapping: which transforms apply to which part of a model comes from
``get_model_conversion_mapping`` on the model class built on the meta device, and every name and
shape is what transformers' own renaming and ops give on meta tensors. What transformers cannot
read back is found by running its mapping, not assumed: a table whose stored names
``from_pretrained`` would not read back into the same module tensors is refused with what the
mapping did.

A converter that stacks per-expert tensors (``MergeModulelist``, then possibly ``Concatenate``
along a later dim) feeding a module-table rule that unstacks them again (``Unstack``, one mcore
tensor per expert) becomes one rule per expert (:class:`~mmparity.mapping.ops.Concat` or a
rename of that expert's stored tensors, which is what stacking then unstacking amounts to), so a
conversion holds one expert at a time, as with the release tables, instead of a layer's stack.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch

from mmparity.mapping import rules as R
from mmparity.mapping.ops import Concat, Identity, LayoutError, Op, Unstack

FORMAT = "transformers"

# One line each: the first problems of a refusal are what a user reads.
_SHOWN = 5


class Unreadable(R.ConversionError):
    """transformers' own reading of stored tensors fails (its ``from_pretrained`` would): ``taken``
    is how many of them its renaming placed in the model, which says whether these are its files."""

    def __init__(self, title: str, problems, taken: int):
        super().__init__(title, problems)
        self.taken = taken


class MappingFailed(R.ConversionError):
    """Running transformers' conversion machinery itself failed (an API this reads changed, say):
    not a statement about the files."""


class NoMapping(Exception):
    """transformers has nothing to say about how this model is saved: no model class for the
    config, or no conversion mapping that renames anything (the stored names are the module names)."""


# --------------------------------------------------------------------------------------------------
# the model and its mapping


def _transformers_config(cfg):
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(cfg, PretrainedConfig):
        return cfg
    values = cfg.to_dict()
    model_type = values.pop("model_type", None) or getattr(cfg, "model_type", None)
    try:
        return AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError, TypeError) as exc:
        raise NoMapping(f"transformers cannot build a {model_type!r} config: {exc}") from None


def _model_class(config):
    import transformers
    from transformers.models.auto import modeling_auto

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    for names in (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, modeling_auto.MODEL_MAPPING_NAMES):
        name = names.get(config.model_type)
        cls = getattr(transformers, name, None) if name else None
        if cls is not None:
            return cls
    raise NoMapping(f"transformers has no model class for model_type {config.model_type!r}")


@dataclass
class _Model:
    """The model class of a config built on the meta device: its state-dict names and shapes
    (what ``from_pretrained`` checks renamed keys against) and what its transforms need."""

    model: object
    state: dict  # module key -> meta tensor

    @property
    def config(self):
        return self.model.config

    def forward_transforms(self) -> list:
        """What ``from_pretrained`` applies, fresh (renamings keep state while they run)."""
        from transformers.conversion_mapping import get_model_conversion_mapping

        return get_model_conversion_mapping(self.model)

    def reverse_transforms(self) -> list:
        """What ``save_pretrained`` applies to a model that was not loaded from files: the
        transforms without the legacy ones and without prefix changes, reversed, in reverse order."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange

        forward = [t for t in get_model_conversion_mapping(self.model, add_legacy=False)
                   if not isinstance(t, PrefixChange)]
        return [t.reverse_transform() for t in forward[::-1]]


@functools.lru_cache(maxsize=4)
def _model_of(config_json: str) -> _Model:
    from transformers import AutoConfig

    values = json.loads(config_json)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    cls = _model_class(config)
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as exc:  # transformers raises many kinds for a config its class refuses
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise NoMapping(f"transformers cannot build {cls.__name__} for this config: {first}") from None
    return _Model(model, dict(model.state_dict()))


def _model(cfg) -> _Model:
    config = _transformers_config(cfg)
    return _model_of(json.dumps(config.to_dict(), sort_keys=True, default=str))


# --------------------------------------------------------------------------------------------------
# groups: what one transform gives, names decided once (on meta tensors), tensors converted at run time


def _plain(value):
    return value[0] if isinstance(value, list) else value


@dataclass(eq=False)
class _Group:
    """Stored tensors ``saved`` <-> module tensors ``module``: a rename (one each) or one
    transformers converter (``forward``, run as ``from_pretrained`` runs it) with its reverse
    (``reverse``, run as ``save_pretrained`` runs it)."""

    saved: tuple
    module: tuple
    forward: "_Run | None" = None
    reverse: "_Run | None" = None

    @property
    def renames(self) -> bool:
        return self.forward is None and self.reverse is None


@dataclass(eq=False)
class _Run:
    """One converter run: ``template`` (deep-copied per run, as transformers copies it per target)
    fed ``inputs`` (key, pattern) under ``first``; ``outputs`` maps each name the converter
    gives to the key it stands for."""

    template: object
    first: str
    inputs: tuple  # ((key, source pattern), ...) in collection order
    outputs: dict  # converter output name -> key
    holder: _Model

    def __call__(self, tensors: Sequence[torch.Tensor]) -> dict:
        converter = copy.deepcopy(self.template)
        for (key, pattern), tensor in zip(self.inputs, tensors):
            converter.add_tensor(self.first, key, pattern, tensor)
        try:
            out = converter.convert(self.first, model=self.holder.model, config=self.holder.config)
        except Exception as exc:  # whatever the op raises: a tensor it cannot take
            raise ConverterFailed(self, _first_line(exc)) from None
        return {self.outputs.get(name, name): _plain(value) for name, value in out.items()}


class ConverterFailed(LayoutError):
    """A transformers converter's op raised on the tensors it was given."""

    def __init__(self, run: "_Run", reason: str):
        self.ops, self.reason, self.keys = _ops(run.template), reason, [k for k, _ in run.inputs]
        super().__init__(f"transformers' {self.ops} on {_few(self.keys)}: {reason}")


def _ops(converter) -> str:
    return " + ".join(type(op).__name__ for op in getattr(converter, "operations", ())) or type(converter).__name__


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _natural(keys: Iterable[str]) -> list[str]:
    from transformers.core_model_loading import dot_natural_key

    return sorted(keys, key=dot_natural_key)


def _unshared(t: torch.Tensor, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``t`` owning exactly its bytes and none of ``inputs``': a converter may hand a tensor
    through, or views of one tensor as several outputs, and checkpoint writers refuse tensors that
    share memory (what every layout op promises, ``converters.ops``)."""
    if not t.numel():
        return t.clone()
    storage = t.untyped_storage()
    if (storage.nbytes() != t.numel() * t.element_size() or not t.is_contiguous()
            or any(x.numel() and x.untyped_storage().data_ptr() == storage.data_ptr() for x in inputs)):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _meta(t) -> torch.Tensor:
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


@dataclass
class _Decoded:
    groups: list  # [_Group]
    unmatched: dict  # stored key -> the name transformers gives it, which the model does not have
    problems: list
    # Converter runs that failed: (the name transformers files them under, their stored keys,
    # ops, reason); a problem unless the table leaves that tensor out anyway.
    failed: list = ()

    def failure_problems(self, failures=None) -> list[str]:
        alike: dict[tuple, list] = {}
        for _, keys, ops, reason in (self.failed if failures is None else failures):
            alike.setdefault((ops, reason), []).append(keys[0])
        return [f"transformers' {ops} on {_few(keys)}: {reason}" for (ops, reason), keys in alike.items()]


def decode(holder: _Model, stored: Mapping[str, object], left_out=lambda name: False) -> _Decoded:
    """``from_pretrained``'s reading of stored keys (key -> anything with ``shape`` and ``dtype``):
    which module tensors each gives, through which converter, checked on meta tensors. A
    converter whose first target is ``left_out`` (a part the table does not convert) is not run:
    its keys come back in ``unmatched`` under that name."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = holder.forward_transforms()
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = holder.model.base_model_prefix
    state = holder.state
    model = type(holder.model).__name__
    renamed: dict[str, str] = {}
    collected: dict[str, list] = {}  # first target -> [(stored key, pattern)]
    unmatched: dict[str, str] = {}
    problems: list[str] = []
    # As from_pretrained visits them: natural order (renamings that keep state depend on it).
    for key in _natural(stored):
        name, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if name not in state and key in state:
            name, pattern = rename_source_key(key, [], [], prefix, state)
        if name not in state:
            unmatched[key] = name
        elif pattern is not None:
            collected.setdefault(name, []).append((key, pattern))
        elif name in renamed:
            problems.append(f"{renamed[name]} and {key} are both read as {name}")
        else:
            renamed[name] = key
    groups, failed = [], []
    for name, key in renamed.items():
        if tuple(stored[key].shape) != tuple(state[name].shape):
            problems.append(f"{key} {tuple(stored[key].shape)} is read as {name}, which is "
                            f"{tuple(state[name].shape)} in {model}")
        groups.append(_Group((key,), (name,)))
    for first, inputs in collected.items():
        if left_out(first):
            unmatched.update((key, first) for key, _ in inputs)
            continue
        template = copy.deepcopy(by_pattern[inputs[0][1]])
        run = _Run(template, first, tuple(inputs), {}, holder)
        keys = [k for k, _ in inputs]
        try:
            out = run([_meta(stored[k]) for k in keys])
        except ConverterFailed as exc:
            failed.append((first, keys, exc.ops, exc.reason))
            continue
        bad = [f"{name} {tuple(t.shape)}" for name, t in out.items()
               if name not in state or tuple(t.shape) != tuple(state[name].shape)]
        if bad:
            failed.append((first, keys, _ops(template), f"gives {', '.join(bad)}, which {model} does not have"))
            continue
        run.outputs = {name: name for name in out}
        groups.append(_Group(tuple(keys), tuple(out), forward=run))
    taken: dict[str, str] = {}
    for group in groups:
        for name in group.module:
            if name in taken:
                problems.append(f"{name} is read from both {taken[name]} and {group.saved[0]}")
            taken[name] = group.saved[0]
    return _Decoded(groups, unmatched, problems, failed)


def _few(keys: Sequence[str]) -> str:
    return ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")


def encode(holder: _Model, module_keys: Iterable[str]) -> tuple[list, list]:
    """``save_pretrained``'s writing of module tensors ``module_keys`` of the model: (groups, with
    the stored names and each converter's reverse, problems). Names and shapes come from running
    the reversed transforms on meta tensors of the model's own shapes."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_converters, apply_renamings

    transforms = holder.reverse_transforms()
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    state = holder.state
    module_keys = list(module_keys)
    problems = [f"{k} is not a tensor of {type(holder.model).__name__}" for k in module_keys if k not in state]
    plain: list[tuple[str, str]] = []
    collected: dict[str, list] = {}
    # As save_pretrained visits them: natural order, a converter's keys collected under the name
    # it files them by, every other key renamed at once (renamings that keep state depend on it);
    # converter outputs are renamed after all keys were visited.
    for key in _natural(k for k in module_keys if k in state):
        name, pattern = apply_converters(key, converters)
        if pattern is not None:
            collected.setdefault(name, []).append((key, pattern))
        else:
            plain.append((key, apply_renamings(key, renamings)))
    groups = []
    for first, inputs in collected.items():
        run = _Run(copy.deepcopy(by_pattern[inputs[0][1]]), first, tuple(inputs), {}, holder)
        try:
            out = run([state[k] for k, _ in inputs])
        except ConverterFailed as exc:
            problems.append(str(exc))
            continue
        run.outputs = {name: apply_renamings(name, renamings) for name in out}
        groups.append(_Group(tuple(run.outputs[name] for name in out), tuple(k for k, _ in inputs), reverse=run))
    groups += [_Group((name,), (key,)) for key, name in plain]
    return groups, problems


def _written_shapes(holder: _Model, groups: list) -> dict:
    """Stored key -> meta tensor, from running each group's reverse on the model's shapes."""
    shapes = {}
    for group in groups:
        if group.reverse is None:
            shapes[group.saved[0]] = holder.state[group.module[0]]
        else:
            shapes.update(group.reverse([holder.state[k] for k, _ in group.reverse.inputs]))
    return shapes


# --------------------------------------------------------------------------------------------------
# the op of a rule that reads through converters


@dataclass(frozen=True, eq=False, repr=False)
class _Step:
    op: Op
    module: tuple  # module keys the module-table op reads
    n_mcore: int


@dataclass(frozen=True, eq=False, repr=False)
class Through(Op):
    """Stored tensors -> module tensors by transformers' converters (each group's own ops, as
    ``from_pretrained`` runs them), then the module-name table's ops -> mcore tensors; and back
    through the module table's inverses and each converter's reverse, as ``save_pretrained`` runs
    it. Groups that are renames pass their tensor through."""

    groups: tuple  # _Group, in the order of the rule's stored keys
    steps: tuple  # _Step, in the order of the rule's mcore keys

    @property
    def n_hf(self) -> int:
        return sum(len(g.saved) for g in self.groups)

    @property
    def n_mcore(self) -> int:
        return sum(s.n_mcore for s in self.steps)

    def apply(self, hf):
        module: dict = {}
        at = 0
        for group in self.groups:
            part = hf[at:at + len(group.saved)]
            at += len(group.saved)
            if group.renames:
                module[group.module[0]] = part[0]
            elif group.forward is None:
                raise LayoutError(f"{_few(group.saved)}: no reading of these names by transformers' mapping")
            else:
                module.update(group.forward(part))
        out = []
        for step in self.steps:
            out += step.op.apply([module[k] for k in step.module])
        return [_unshared(t, hf) for t in out]

    def invert(self, mcore):
        module: dict = {}
        at = 0
        for step in self.steps:
            module.update(zip(step.module, step.op.invert(mcore[at:at + step.n_mcore])))
            at += step.n_mcore
        out = []
        for group in self.groups:
            if group.renames:
                out.append(module[group.module[0]])
                continue
            run = group.reverse
            back = run([module[k] for k, _ in run.inputs])
            try:
                out += [back[k] for k in group.saved]
            except KeyError as exc:
                raise LayoutError(f"transformers' {_ops(run.template)} writes {', '.join(sorted(back)[:3])}, "
                                  f"not {exc.args[0]}") from None
        return [_unshared(t, mcore) for t in out]

    def at_tp(self, tp: int, vocab_multiple: int) -> Op:
        steps = tuple(_Step(s.op.at_tp(tp, vocab_multiple), s.module, s.n_mcore) for s in self.steps)
        if all(a.op is b.op for a, b in zip(steps, self.steps)):
            return self
        return Through(self.groups, steps)

    def __repr__(self):
        ops = sorted({_ops(g.forward.template if g.forward else g.reverse.template)
                      for g in self.groups if not g.renames})
        return f"Through({', '.join(ops)}; {', '.join(repr(s.op) for s in self.steps)})"


# --------------------------------------------------------------------------------------------------
# the table


def _per_pattern(group: _Group) -> list[list[str]] | None:
    """The group's stored keys per source pattern of its converter, each list in transformers'
    collection order (natural order), or None when a key matched no pattern of it."""
    per = {p: [] for p in group.forward.template.source_patterns}
    for key, pattern in group.forward.inputs:
        if pattern not in per:
            return None
        per[pattern].append(key)
    return list(per.values())  # collected in natural order already


def _stacked_experts(group: _Group):
    """(the dim an expert's tensors are concatenated along, or None for plain stacking; the
    stored keys per source pattern, expert by expert) when ``group`` only stacks per-expert tensors
    (``MergeModulelist(dim=0)``) and joins the stacks along a later dim (``Concatenate``), so that
    expert j is made of the j-th tensor of each pattern; else None."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    if len(group.module) != 1 or group.forward is None:
        return None
    template = group.forward.template
    ops = list(getattr(template, "operations", ()))
    if not ops or type(ops[0]) is not MergeModulelist or ops[0].dim != 0:
        return None
    rest = ops[1:]
    if len(rest) > 1 or (rest and not (type(rest[0]) is Concatenate and rest[0].dim >= 1)):
        return None
    per_pattern = _per_pattern(group)
    if per_pattern is None or len({len(keys) for keys in per_pattern}) != 1 or (len(per_pattern) > 1 and not rest):
        return None
    return (rest[0].dim - 1 if rest else None), per_pattern


def _split_experts(step: R.Step, group: _Group) -> list[R.Rule] | None:
    """One rule per expert for an ``Unstack`` step fed by a group that only stacks (see the
    module docstring), or None when the step or the group is not of that kind."""
    if not isinstance(step.rule.op, Unstack) or len(step.hf_keys) != 1:
        return None
    found = _stacked_experts(group)
    if found is None:
        return None
    dim, per_pattern = found
    if len(per_pattern[0]) != step.rule.op.count:
        return None
    op = Identity() if dim is None else Concat(n_hf=len(per_pattern), dim=dim)
    return [R.Rule(mcore, tuple(keys[j] for keys in per_pattern), op, kind, side=step.rule.side)
            for j, (mcore, kind) in enumerate(zip(step.mcore_keys, step.rule.tp))]


def _class_name(holder: _Model) -> str:
    return type(holder.model).__name__


def rule_set(table: R.RuleSet, cfg, stored: Mapping | Iterable[str] | None = None) -> R.RuleSet:
    """``table`` (a family's module-name table for ``cfg``) in the layout transformers' mapping
    gives: with ``stored`` (the checkpoint's keys, best with their shapes: key -> anything with
    ``shape`` and ``dtype``), the stored names as ``from_pretrained`` reads them; without, the names
    ``save_pretrained`` writes.

    Raises :class:`NoMapping` when transformers has nothing that renames this model's tensors, and
    a ``ConversionError`` naming what transformers' own mapping did when it cannot read the
    stored tensors (or, without ``stored``, read back what it would write)."""
    try:
        return _rule_set(table, cfg, stored)
    except (NoMapping, R.ConversionError):
        raise
    except Exception as exc:  # transformers' machinery, not the files: say so in one line
        raise MappingFailed("transformers' conversion mapping could not be run here",
                            [f"{type(exc).__name__}: {_first_line(exc)}"]) from None


def _rule_set(table: R.RuleSet, cfg, stored) -> R.RuleSet:
    holder = _model(cfg)
    if not holder.reverse_transforms():
        raise NoMapping(f"transformers saves {_class_name(holder)} under its module names")
    prefix = R.detect_prefix(table, holder.state)
    hf_keys, _ = R.expected_keys(table)
    written, problems = encode(holder, [prefix + k for k in hf_keys])
    if problems:
        raise R.ConversionError(f"transformers' save_pretrained of {_class_name(holder)} cannot write this "
                                "model's tensors", problems)
    written_shapes = _written_shapes(holder, written)
    # Without files, the table is what save_pretrained writes as from_pretrained reads it back:
    # run the reading on those names and shapes, which must give every tensor back as written.
    groups, drops, note = _reading(holder, table, written, written_shapes,
                                   written_shapes if stored is None else stored, read_back=stored is None)
    if all(g.renames and g.saved == g.module for g in groups) and not drops:
        raise NoMapping(f"transformers saves {_class_name(holder)} under its module names")
    return _table(table, prefix, groups, drops, note)


def _reading(holder: _Model, table: R.RuleSet, written: list, written_shapes: dict, stored,
             read_back: bool = False) -> tuple:
    """(groups, stored keys to drop, note) for a checkpoint's own keys: the stored names
    ``from_pretrained`` reads, each converter group given the reverse ``save_pretrained`` runs on
    the same module tensors. ``read_back``: the keys are what save_pretrained writes (``written``),
    which must read back exactly into what was written."""
    shapes = stored if isinstance(stored, Mapping) else None
    if shapes is None or not all(hasattr(v, "shape") and hasattr(v, "dtype") for v in shapes.values()):
        # Names alone: the shapes save_pretrained writes, where the names are its own.
        names = list(stored)
        shapes = {k: written_shapes[k] for k in names if k in written_shapes}
        unknown = [k for k in names if k not in shapes]
        if unknown:
            raise R.ConversionError("reading stored names through transformers' mapping needs their shapes",
                                    [f"no shape for {k}" for k in unknown[:_SHOWN]])
    dropped = [re.compile(p) for p in table.drop_hf]
    read = decode(holder, shapes, left_out=lambda name: any(d.match(name) for d in dropped))
    # What to do instead: the module names are a layout every family's own table reads.
    if read_back:
        title = (f"transformers' from_pretrained would not read back what its save_pretrained writes for "
                 f"this {_class_name(holder)} (export its module names instead: --hf-format hf)")
    else:
        differs = _differences(shapes, written_shapes)
        title = (f"transformers' own from_pretrained of {_class_name(holder)} fails on these tensors, which "
                 f"are not what its save_pretrained writes for this config ({'; '.join(differs[:2])})"
                 if differs else
                 f"transformers' own from_pretrained of {_class_name(holder)} fails on what its save_pretrained "
                 "writes for this config (save the model with save_pretrained(save_original_format=False), "
                 "its module names, to convert it)")
    # A converter that fails on a tensor the table leaves out anyway (the rest of a whole model)
    # costs nothing: those stored keys are dropped with the rest.
    failed_out = [f for f in read.failed if any(d.match(f[0]) for d in dropped)]
    failed_in = [f for f in read.failed if f not in failed_out]
    problems = list(read.problems) + read.failure_problems(failed_in)
    if read_back and not problems:
        problems += [f"{k} is read as {name}, which {_class_name(holder)} does not have"
                     for k, name in read.unmatched.items()]
        source = {name: set(g.saved) for g in read.groups for name in g.module}
        problems += [f"{name} is written as {_few(g.saved)} but read back from {_few(sorted(source.get(name, ()))) or 'nothing'}"
                     for g in written for name in g.module if source.get(name) != set(g.saved)][:_SHOWN]
    if problems:
        taken = sum(len(g.saved) for g in read.groups) + sum(len(f[1]) for f in read.failed)
        raise Unreadable(title, problems, taken)
    drops = [key for key, name in read.unmatched.items() if any(d.match(name) for d in dropped)]
    drops += [key for f in failed_out for key in f[1]]
    # Tensors of the model the table leaves out on purpose (the rest of a whole model, say): the
    # table's own drop patterns, on the names transformers reads them as.
    wanted = {name for g in written for name in g.module}
    kept = []
    for group in read.groups:
        if wanted.intersection(group.module) or not all(any(d.match(n) for d in dropped) for n in group.module):
            kept.append(group)
        else:
            drops += group.saved
    read.groups = kept
    by_module = {name: g for g in written for name in g.module}
    differs = []
    for group in read.groups:
        counterpart = by_module.get(group.module[0])
        if group.renames:
            if counterpart is not None and counterpart.saved != group.saved:
                differs.append((group.saved[0], counterpart.saved[0]))
            continue
        if counterpart is None or counterpart.reverse is None or set(counterpart.module) != set(group.module):
            raise R.ConversionError(f"transformers' save_pretrained of {_class_name(holder)} does not write back "
                                    "what its from_pretrained reads", [
                                        f"{_few(group.saved)} are read as {_few(group.module)}, which it writes "
                                        f"{'otherwise' if counterpart is not None else 'nowhere'}"])
        reverse = counterpart.reverse
        if set(counterpart.saved) != set(group.saved):
            if len(counterpart.saved) != len(group.saved):
                raise R.ConversionError(f"transformers' save_pretrained of {_class_name(holder)} does not write "
                                        "back what its from_pretrained reads", [
                                            f"{_few(group.saved)} are written back as {_few(counterpart.saved)}"])
            differs.append((group.saved[0], counterpart.saved[0]))
            # Its reverse names save_pretrained's keys; the files' own stand in for them, in order.
            instead = dict(zip(_natural(counterpart.saved), _natural(group.saved)))
            reverse = copy.copy(reverse)
            reverse.outputs = {k: instead[v] for k, v in reverse.outputs.items()}
        group.reverse = reverse
    groups = list(read.groups)
    covered = {n for g in groups for n in g.module}
    # What the files lack keeps save_pretrained's name: a missing tensor is reported by that name.
    groups += [g for g in written if not covered.intersection(g.module)]
    note = ""
    if differs:
        src, dst = differs[0]
        note = (f"read through transformers' conversion mapping; {len(differs)} stored name(s) differ from what "
                f"its save_pretrained writes (e.g. {src} -> {dst}), which an export to HF writes")
    return groups, tuple(drops), note


def _differences(stored: Mapping, written: Mapping) -> list[str]:
    """How stored tensors differ from what save_pretrained writes: the tensors it writes that are
    missing, and those of another shape (tensors it does not write are the table's business)."""
    out = [f"no {k}" for k in written if k not in stored]
    out += [f"{k} is {tuple(stored[k].shape)}, save_pretrained writes {tuple(written[k].shape)}"
            for k in written if k in stored and tuple(stored[k].shape) != tuple(written[k].shape)]
    return out


def _components(steps: list, of_step) -> list[list[int]]:
    """Steps that read outputs of one converter, joined (the converter runs once for all of them);
    each component in table order, components ordered by their first step."""
    parent = list(range(len(steps)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_reader: dict[int, int] = {}
    for index, step in enumerate(steps):
        for group in of_step(step):
            if group.renames:
                continue
            other = first_reader.setdefault(id(group), index)
            a, b = find(index), find(other)
            if a != b:
                parent[max(a, b)] = min(a, b)
    members: dict[int, list] = {}
    for index in range(len(steps)):
        members.setdefault(find(index), []).append(index)
    return [members[root] for root in sorted(members)]


def _table(table: R.RuleSet, prefix: str, groups: list, drops: Sequence[str], note: str) -> R.RuleSet:
    by_module = {name: g for g in groups for name in g.module}
    steps = list(R.iter_steps(table))

    def group_of(key: str) -> _Group:
        name = prefix + key
        if name not in by_module:
            by_module[name] = _Group((name,), (name,))  # no stored name known: the plan says it is missing
        return by_module[name]

    def of_step(step) -> list:
        return [group_of(k) for k in step.hf_keys]

    rules: list = []
    for component in _components(steps, of_step):
        member_steps = [steps[i] for i in component]
        used: list = []
        for step in member_steps:
            for group in of_step(step):
                if all(group is not u for u in used):
                    used.append(group)
        if all(g.renames for g in used):
            (step,) = member_steps
            rules.append(R.Rule(step.mcore_keys, tuple(group_of(k).saved[0] for k in step.hf_keys),
                                step.rule.op, step.rule.tp, side=step.rule.side))
            continue
        if len(member_steps) == 1 and len(used) == 1:
            split = _split_experts(member_steps[0], used[0])
            if split is not None:
                rules += split
                continue
        sides = {step.rule.side for step in member_steps}
        if len(sides) != 1:
            raise R.ConversionError("transformers' mapping joins tensors the module table keeps apart", [
                f"{_few([s.mcore_keys[0] for s in member_steps])} are made from one converter's outputs"])
        op = Through(tuple(used), tuple(_Step(s.rule.op, tuple(prefix + k for k in s.hf_keys), len(s.mcore_keys))
                                        for s in member_steps))
        rules.append(R.Rule(tuple(k for s in member_steps for k in s.mcore_keys),
                            tuple(k for g in used for k in g.saved), op,
                            tuple(kind for s in member_steps for kind in s.rule.tp), side=sides.pop()))
    drop = (f"^(?:{'|'.join(re.escape(k) for k in drops)})$",) if drops else ()
    return R.RuleSet(rules=tuple(rules), variables={}, hf_prefixes=("",), drop_hf=drop, hf_format=FORMAT,
                     validate_tp=table.validate_tp, mcore_note="; ".join(n for n in (table.mcore_note, note) if n))
