"""Where megatron-core's ``dist_checkpointing`` puts each tensor of a model, derived from the rule
table's mcore keys alone: no megatron, no model, no torch.distributed.

A torch_dist checkpoint holds *global* tensors under mcore's sharded keys. For the TP = 1 state
dict a converter produces (its keys in TE spelling), Megatron's classes shard it so:

* **layer stacks.** A homogeneous ``TransformerBlock`` keys its layers without their number
  (``decoder.layers.mlp.linear_fc2.weight``) and prepends a layer axis of the block's layer count,
  each layer one chunk at its own offset. A block of dense and MoE layers (DeepSeek-V3-style:
  Megatron-LM's recipes give ``moe_layer_freq`` as a list, which makes mcore key such a block layer
  by layer, and so does the native model) keeps the number and prepends nothing.
* **routed experts.** ``...mlp.experts.local_experts.<e>.<linear>`` (or the grouped spelling
  ``...mlp.experts.<linear>.weight<e>``) is one tensor ``...mlp.experts.experts.<linear>`` with an
  expert axis of the layer's expert count after the layer axis (``SequentialMLP`` and
  ``TEGroupedMLP`` alike), so the same files load at any EP size.
* **gated FC1** (TP kind ``gated``, ``[gate; up]``): mcore's swiglu factory stores the two halves
  as two chunks of one tensor, rows ``[0, F)`` and ``[F, 2F)`` at TP 1.
* **extra states** (``_extra_state``, TE's FP8 slots, written empty): byte objects under
  ``<key>/shard_<offsets>_<shape>``, with the same prepended axes as their module's tensors.

``tests/io/test_torch_dist_layout.py`` pins this against every registered family's Megatron model
(its ``sharded_state_dict()``, factories applied), which is where the rules come from.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from mmparity.io.fsio import shared
from mmparity.io.fsio.errors import CheckpointError
from mmparity.parallel import ep, pp
from mmparity.parallel.tp import split_of

__all__ = ["Chunk", "StoredTensor", "StoredObject", "Layout", "per_layer_stacks", "plan",
           "object_placements", "object_key"]


@dataclass(frozen=True, slots=True)  # one per stored chunk: thousands in a many-expert checkpoint
class Chunk:
    """One saved chunk of a global tensor: where it sits, and which rows of which converter tensor
    it holds (``rows`` None: all of them)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    source: str
    rows: tuple[int, int] | None = None
    prepended: int = 0  # how many leading (size-1) layer / expert axes ``sizes`` has

    @property
    def source_shape(self) -> tuple[int, ...]:
        """The chunk's shape without the prepended axes: the block of the converter tensor it holds."""
        return self.sizes[self.prepended:]


@dataclass(frozen=True, slots=True)
class StoredTensor:
    key: str  # mcore's sharded key, the DCP item name
    shape: tuple[int, ...]  # global, prepended axes included
    dtype: object  # torch.dtype
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True, slots=True)
class StoredObject:
    key: str  # the ShardedObject's key
    shape: tuple[int, ...]
    offset: tuple[int, ...]

    @property
    def unique_key(self) -> str:
        return object_key(self.key, self.offset, self.shape)


@dataclass(frozen=True)
class Layout:
    tensors: tuple[StoredTensor, ...]
    objects: tuple[StoredObject, ...]


def object_key(key: str, offset: Sequence[int], shape: Sequence[int]) -> str:
    """mcore's ``ShardedObject.unique_key``: the DCP item a byte object is stored as."""
    return shared.name(f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}")


def per_layer_stacks(keys: Sequence[str], shapes: Mapping[str, Sequence[int]] | None = None) -> set[str]:
    """The layer stacks mcore keys layer by layer: those holding routed experts (see the module
    note), and any whose layers do not all hold the same tensors, or (``shapes`` given: a model
    whose config sets mcore's ``hetereogenous_dist_checkpoint``, Gemma 4's wider full-attention
    layers) not of the same shapes: no stacked tensor could cover them."""
    contents: dict[str, dict[int, set]] = {}
    for key in keys:
        parts = pp.layer_key_parts(key)
        if parts is not None:
            stack, index, rest = parts
            shape = tuple(shapes[key]) if shapes is not None else None
            contents.setdefault(stack, {}).setdefault(index, set()).add((rest, shape))
    stacks = set()
    for stack, layers in contents.items():
        if len({frozenset(rest) for rest in layers.values()}) > 1 or any(
                ep.is_expert_key(f"{stack}{index}.{rest}") for index, rests in layers.items() for rest, _ in rests):
            stacks.add(stack)
    return stacks


def _placement(key: str, layers: Mapping[str, set[int]], per_layer: Collection[str],
               num_experts: int) -> tuple[str, tuple[tuple[int, int], ...]]:
    """(sharded key, prepended axes as (size, offset)) of one converter key."""
    name, expert_axis = key, ()
    expert = ep.parse_expert_key(key)
    if expert is not None:
        if not 0 <= expert.expert < num_experts:
            raise CheckpointError(f"{key}: no expert {expert.expert} among the {num_experts} of the state dict")
        name, expert_axis = f"{expert.prefix}experts.{expert.rest}", ((num_experts, expert.expert),)
    parts = pp.layer_key_parts(name)
    layer_axis = ()
    if parts is not None:
        stack, index, rest = parts
        if index not in layers.get(stack, ()):
            raise CheckpointError(f"{key}: no tensors of its layer in the state dict")
        if stack not in per_layer:
            layer_axis, name = ((len(layers[stack]), index),), stack + rest
    return name, layer_axis + expert_axis


def object_placements(keys: Sequence[str], tensor_keys: Sequence[str],
                      per_layer: Collection[str] | None = None) -> dict[str, StoredObject]:
    """The ``_extra_state`` byte objects for the global state-dict ``keys`` (as
    ``extra_state.sharded_extra_state_keys`` names them), placed as Megatron's classes place
    them at TP 1 (``make_sharded_object_for_checkpoint``): the axes their module's tensors are
    prepended, or shape ``(1,)`` at offset ``(0,)`` with none. Only TP rank 0's copy is the
    main replica and each expert's object is its own shard, so they are those of any TP or EP."""
    per_layer = per_layer_stacks(tensor_keys) if per_layer is None else per_layer
    layers = pp.layer_stacks(tensor_keys)
    experts = ep.expert_count(tensor_keys) if any(ep.is_expert_key(k) for k in keys) else 0
    objects = {}
    for key in keys:
        name, axes = _placement(key, layers, per_layer, experts)
        axes = axes or ((1, 0),)
        objects[key] = StoredObject(name, tuple(size for size, _ in axes), tuple(offset for _, offset in axes))
    return objects


def plan(order: Sequence[str], kinds: Mapping[str, str], shapes: Mapping[str, Sequence[int]],
         dtypes: Mapping[str, object], extra_state_keys: Sequence[str] = (), heterogeneous: bool = False) -> Layout:
    """The stored tensors (chunks of the converter tensors ``order``, of ``shapes`` and
    ``dtypes``, TP kinds ``kinds``) and byte objects (for ``extra_state_keys``) of a torch_dist
    checkpoint, in ``order``. Raises CheckpointError when tensors that mcore would stack into one
    disagree in shape or dtype, or leave part of it uncovered. ``heterogeneous``: the model's
    ``TransformerConfig`` sets ``hetereogenous_dist_checkpoint`` (its layers differ in shape by
    design), so a stack whose layers differ in shape is keyed layer by layer rather than refused."""
    per_layer = per_layer_stacks(order, shapes if heterogeneous else None)
    layers = pp.layer_stacks(order)
    experts = ep.expert_count(order)
    building: dict[str, dict] = {}
    problems = []
    for key in order:
        shape = shared.shape(shapes[key])
        name, axes = _placement(key, layers, per_layer, experts)
        name = shared.name(name)
        split = split_of(kinds[key])
        if split.section_names and shape:
            # mcore's factory stores each named block of such a tensor as a tensor of its own.
            start, offsets, ones = 0, tuple(o for _, o in axes), (1,) * len(axes)
            for section, size in zip(split.section_names, split.sections):
                block = building.setdefault(shared.name(f"{name}.{section}"), {
                    "shape": shared.shape(tuple(s for s, _ in axes) + (size,) + shape[1:]), "dtype": dtypes[key],
                    "chunks": [], "first": key})
                block["chunks"].append(Chunk(offsets + (0,) * len(shape), shared.shape(ones + (size,) + shape[1:]),
                                             key, (start, start + size), len(axes)))
                start += size
            continue
        entry = building.setdefault(name, {"shape": shared.shape(tuple(s for s, _ in axes) + shape), "dtype": dtypes[key],
                                           "chunks": [], "first": key})
        if entry["shape"] != tuple(s for s, _ in axes) + shape or entry["dtype"] != dtypes[key]:
            problems.append(f"{key} {list(shape)} {dtypes[key]} is stored in {name} with {entry['first']} "
                            f"{list(entry['shape'][len(axes):])} {entry['dtype']}")
            continue
        offsets, ones = tuple(o for _, o in axes), (1,) * len(axes)
        if split.paired and shape:
            if shape[0] % 2:
                problems.append(f"{key} {list(shape)}: a gated tensor of an odd row count")
                continue
            half = shape[0] // 2
            for start in (0, half):
                entry["chunks"].append(Chunk(offsets + (start,) + (0,) * (len(shape) - 1),
                                             shared.shape(ones + (half,) + shape[1:]), key, (start, start + half),
                                             len(axes)))
        else:
            entry["chunks"].append(Chunk(offsets + (0,) * len(shape), shared.shape(ones + shape), key, None,
                                         len(axes)))
    tensors = []
    for name, entry in building.items():
        offsets = [c.offsets for c in entry["chunks"]]
        if len(set(offsets)) != len(offsets):
            problems.append(f"{name}: two converted tensors at the same offset")
        covered = sum(math.prod(c.sizes) for c in entry["chunks"])
        if covered != math.prod(entry["shape"]):
            problems.append(f"{name} {list(entry['shape'])}: the converted tensors cover {covered} of its "
                            f"{math.prod(entry['shape'])} elements")
        tensors.append(StoredTensor(name, entry["shape"], entry["dtype"], tuple(entry["chunks"])))
    if problems:
        raise CheckpointError(f"cannot lay out the torch_dist checkpoint ({len(problems)}): " + "; ".join(problems))
    objects = object_placements(extra_state_keys, order, per_layer)
    return Layout(tuple(tensors), tuple(objects[k] for k in extra_state_keys))
