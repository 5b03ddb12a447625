"""The ``_extra_state`` slots of Megatron's classes, which mmparity writes empty.

Transformer Engine's linears and its attention (and the CPU stand-ins of
``mmparity.models.core.te_stand_ins``, like mcore's own parallel linears) override
``get_extra_state``, so ``state_dict()`` holds a ``<module>._extra_state`` entry for each of them
(FP8 metadata; nothing without FP8) and ``load_state_dict(strict=True)`` demands one back. In a
``sharded_state_dict()`` each is a ``ShardedObject``, replicated over TP. A converted checkpoint has
no FP8 state, so every such slot is written empty (``None``, which TE's ``set_extra_state`` and
mcore's both take as "nothing"), and Megatron's class then loads strictly with no tolerance hook.

Which modules have one is a property of Megatron's TE spec, read here from the mcore key names and
their TP kinds (the checkpoint holds nothing else to read it from): the TP-split
``linear_qkv`` / ``linear_proj`` / ``linear_fc1`` / ``linear_fc2`` (decoder layers, the
``MultimodalProjector``) and ``output_layer``, a Gated DeltaNet's ``in_proj`` / ``out_proj``,
and the ``core_attention`` beside each
``linear_qkv``; multi-latent attention's projections and core attention; ``TEGroupedMLP``'s two
grouped linears (one slot each in a plain state dict, one per expert in a sharded one). Plain ``nn.Linear``s that Megatron keeps whole (Qwen's merger, Pixtral-Large's
merging layer) have none. ``tests/io/test_extra_state.py`` checks the rule against every family's
recorded layout (``tests/data/megatron_layout``).
"""

from __future__ import annotations

import io
from collections.abc import Mapping

import torch

from mmparity.parallel import ep
from mmparity.parallel.tp import split_of

SUFFIX = "._extra_state"
_TE_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")
# Megatron's multi-latent attention's TE linears (see extra_state_keys).
_MLA_LINEARS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                "linear_kv_up_proj")
# megatron-core's GatedDeltaNet (the hybrid spec's linear-attention layer, at
# ``<layer>.self_attention``): its input projection is TE's LayerNormColumnParallelLinear, its
# output projection TE's RowParallelLinear.
_DELTA_NET_LINEARS = ("in_proj", "out_proj")
# GPTModel leaves its output layer's slot out of its sharded state dict (old checkpoints lacked it).
_NOT_SHARDED = ("output_layer",)


def _module_name(module: str) -> str:
    return module.rpartition(".")[2]


def _is_mla_linear(module: str) -> bool:
    return _module_name(module) in _MLA_LINEARS and module.rpartition(".")[0].endswith("self_attention")


def _grouped_linear(key: str) -> str | None:
    """``<layer>.mlp.experts.linear_fc{1,2}`` for a grouped-layout expert weight's key
    (``...linear_fc1.weight<e>``), else None."""
    expert = ep.parse_expert_key(key)
    if expert is None or expert.layout != ep.GROUPED:
        return None
    linear, _, param = expert.rest.rpartition(".")
    return f"{expert.prefix}{linear}" if param == "weight" and linear in ("linear_fc1", "linear_fc2") else None


def extra_state_keys(kinds: Mapping[str, str]) -> list[str]:
    """Every ``_extra_state`` key of Megatron's state dict, given its tensors' mcore keys and TP kinds.

    Besides the TP-split TE linears and the ``core_attention`` beside each ``linear_qkv``:

    * Megatron's multi-latent attention (``get_gpt_layer_with_transformer_engine_spec(
      multi_latent_attention=True)``): each of its projections (``linear_q_proj`` or
      ``linear_q_down_proj`` / ``linear_q_up_proj``, ``linear_kv_down_proj`` /
      ``linear_kv_up_proj``), the down projections included although they are whole on every TP
      rank (TE's ``TELinear`` in duplicated mode), and its ``core_attention``
      (``TEDotProductAttention``) beside ``linear_kv_down_proj``;
    * ``TEGroupedMLP``'s two grouped linears, one slot each (``<layer>.mlp.experts.linear_fc1``
      and ``linear_fc2``, TE's ``GroupedLinear`` keeps one extra state for all its experts) where
      the experts are in the grouped layout (``linear_fc1.weight<e>``); in the sequential layout
      each expert's linear is a TE linear of its own, as above.
    """
    modules = set()
    for key, kind in kinds.items():
        module, _, param = key.rpartition(".")
        grouped = _grouped_linear(key)
        if grouped is not None:
            modules.add(grouped)
            continue
        if param != "weight":
            continue
        if _is_mla_linear(module):
            modules.add(module)
            if _module_name(module) == "linear_kv_down_proj":  # every MLA has one
                modules.add(module.rpartition(".")[0] + ".core_attention")
            continue
        delta_net = (_module_name(module) in _DELTA_NET_LINEARS
                     and module.rpartition(".")[0].endswith("self_attention"))
        if split_of(kind).dim is None or not (_module_name(module) in _TE_LINEARS or delta_net):
            continue
        modules.add(module)
        if _module_name(module) == "linear_qkv":
            modules.add(module.rpartition(".")[0] + ".core_attention")
    return sorted(f"{module}{SUFFIX}" for module in modules)


def sharded_extra_state_keys(kinds: Mapping[str, str]) -> list[str]:
    """The ``_extra_state`` slots Megatron's TE-built ``sharded_state_dict()`` holds as
    ``ShardedObject``s: those of :func:`extra_state_keys` (multi-latent attention's included) less
    ``output_layer``'s, and with one slot per routed expert in place of each grouped linear's one
    (a torch_dist load asks for each of them).

    ``TEGroupedMLP``'s grouped linears give every expert a slot of its own
    (``TEGroupedLinear._sharded_state_dict_grouped``), named here in the sequential spelling
    ``<layer>.mlp.experts.local_experts.<e>.linear_fc1._extra_state`` with the global expert number
    (``converters.ep``); ``checkpoint.torch_dist.extra_state_objects`` keys them as mcore does.
    The router (``TopKRouter``) has no slot.
    """
    grouped = {module for key in kinds if (module := _grouped_linear(key)) is not None}
    keys = {k for k in extra_state_keys(kinds)
            if _module_name(k[: -len(SUFFIX)]) not in _NOT_SHARDED and k[: -len(SUFFIX)] not in grouped}
    for key in kinds:
        expert = ep.parse_expert_key(key)
        if expert is not None:
            linear, _, param = expert.rest.rpartition(".")
            if param == "weight" and linear in ("linear_fc1", "linear_fc2"):
                keys.add(expert.spell(ep.SEQUENTIAL).rpartition(".")[0] + SUFFIX)
    return sorted(keys)


def is_extra_state(key: str) -> bool:
    return key.endswith(SUFFIX) or f"{SUFFIX}/" in key


def bytes_tensor(data) -> torch.Tensor:
    """Bytes as a uint8 tensor (what the manifest's checksums take)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


def as_bytes(value) -> torch.Tensor:
    """What an ``_extra_state`` value holds, as a uint8 tensor for the manifest's checksum:
    empty for ``None`` (what mmparity writes), the bytes of TE's serialised state otherwise.
    Raises ``TypeError`` for anything that is not an extra state."""
    if value is None:
        return torch.empty(0, dtype=torch.uint8)
    if isinstance(value, io.BytesIO):
        return bytes_tensor(value.getvalue())
    if isinstance(value, torch.Tensor):
        return value.detach().contiguous().view(-1).view(torch.uint8)
    raise TypeError(f"a {type(value).__name__} is not an _extra_state value")
