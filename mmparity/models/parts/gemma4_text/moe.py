"""Gemma 4's MoE block (``enable_moe_block``, the 26B-A4B release), the framework-free half: what
of the config it reads and refuses, its ``TransformerConfig`` fields, its rules, its HF shapes and
the HF side's paired modules. The mcore modules are :mod:`.moe_native`.

In transformers' layer the block sits beside the dense MLP, both fed by the same residual: the
MLP runs as in a dense layer (``pre_feedforward_layernorm`` -> MLP) and its output is normed by
``post_feedforward_layernorm_1``; a router (weightless RMSNorm, times a learned per-channel
``scale`` and ``hidden ** -0.5``, a linear to the experts, softmax in fp32, top-k, renormalised,
times ``per_expert_scale`` of each chosen expert) picks experts that run on
``pre_feedforward_layernorm_2``'s output, normed after by ``post_feedforward_layernorm_2``; the two
are summed and ``post_feedforward_layernorm`` norms the sum. Every layer has the block.

In Megatron's layout the layer's ``mlp`` is an ``MoELayer`` whose shared expert is the dense MLP
(its norms fused as in a dense layer: ``shared_experts.linear_fc1.layer_norm_weight`` and
``shared_experts.linear_fc2.post_layernorm``, no gate), whose router is megatron-core's softmax
top-k router with Gemma's input scaling and per-expert scale, and whose experts are TEGroupedMLP's
names. What Megatron's ``MoELayer`` has no place for is named beside its own tensors:

* ``mlp.router.scale`` and ``mlp.router.per_expert_scale`` (HF's router ``scale`` and
  ``per_expert_scale``, copied exactly);
* ``mlp.pre_experts_layernorm.weight`` / ``mlp.post_experts_layernorm.weight`` (the experts'
  own norms, ``pre_feedforward_layernorm_2`` / ``post_feedforward_layernorm_2``) and
  ``mlp.post_layernorm.weight`` (``post_feedforward_layernorm``, on the sum).
"""

from __future__ import annotations

from mmparity.mapping.ops import Unstack
from mmparity.mapping.rules import Rule, rename
from mmparity.models.parts.deepseek_v3.mapping import gated_mlp_rules
from mmparity.models.spec import Pair, routing_tensor, tokens_2d


def is_moe(text) -> bool:
    return bool(getattr(text, "enable_moe_block", False))


def experts(text) -> int:
    """How many routed experts each layer has (0: a dense Gemma 4)."""
    return int(getattr(text, "num_experts", None) or 0) if is_moe(text) else 0


def moe_problems(text) -> list[str]:
    """What of an MoE Gemma 4 config the block cannot be built from, by name."""
    if not is_moe(text):
        return []
    problems = [f"text_config: enable_moe_block needs {name} (got {getattr(text, name, None)!r})"
                for name in ("num_experts", "top_k_experts", "moe_intermediate_size")
                if not getattr(text, name, None)]
    if not problems and text.top_k_experts > text.num_experts:
        problems.append(f"text_config: enable_moe_block with top_k_experts={text.top_k_experts} above "
                        f"num_experts={text.num_experts}")
    return problems


def moe_tp_sizes(text) -> dict:
    """The sizes tensor parallelism splits in the block (the experts' width)."""
    return {"text moe_intermediate_size": text.moe_intermediate_size} if is_moe(text) else {}


def moe_config_fields(text) -> dict:
    """The ``TransformerConfig`` fields of the block: every layer MoE, the dense MLP as the shared
    expert of ``intermediate_size`` (ungated), the routed experts of ``moe_intermediate_size``,
    megatron-core's softmax top-k (the softmax of the chosen logits: HF's softmax renormalised over
    the chosen, the same function)."""
    if not is_moe(text):
        return {}
    from mmparity.models.core.layers import moe_fields

    return moe_fields(num_moe_experts=text.num_experts, moe_layer_freq=[1] * text.num_hidden_layers,
                      moe_ffn_hidden_size=text.moe_intermediate_size,
                      moe_shared_expert_intermediate_size=text.intermediate_size, moe_shared_expert_gate=False,
                      moe_router_topk=text.top_k_experts, moe_router_score_function="softmax",
                      moe_router_pre_softmax=False)


def moe_rules(text, hf: str, mc: str) -> tuple:
    """The rules of one layer's block (``hf`` / ``mc``: the layer's roots with ``{i}``): the dense
    MLP as the shared expert, the router and its two scales, the experts read as transformers
    saves them (stacked ``gate_up_proj (E, 2I, H)`` / ``down_proj (E, H, I)``), the three norms."""
    shared, routed, count = mc + "mlp.shared_experts.", mc + "mlp.experts.", text.num_experts
    return (rename(shared + "linear_fc1.layer_norm_weight", hf + "pre_feedforward_layernorm.weight"),
            *gated_mlp_rules(hf + "mlp.", shared),
            rename(shared + "linear_fc2.post_layernorm.weight", hf + "post_feedforward_layernorm_1.weight"),
            rename(mc + "mlp.router.weight", hf + "router.proj.weight"),
            rename(mc + "mlp.router.scale", hf + "router.scale"),
            rename(mc + "mlp.router.per_expert_scale", hf + "router.per_expert_scale"),
            # One stacked HF tensor feeds every expert's mcore tensor (gate rows then up rows per
            # expert, as mcore's gated linear_fc1): each rule lists them all.
            Rule(tuple(routed + f"linear_fc1.weight{e}" for e in range(count)), hf + "experts.gate_up_proj",
                 Unstack(count), "gated"),
            Rule(tuple(routed + f"linear_fc2.weight{e}" for e in range(count)), hf + "experts.down_proj",
                 Unstack(count), "row"),
            rename(mc + "mlp.pre_experts_layernorm.weight", hf + "pre_feedforward_layernorm_2.weight"),
            rename(mc + "mlp.post_experts_layernorm.weight", hf + "post_feedforward_layernorm_2.weight"),
            rename(mc + "mlp.post_layernorm.weight", hf + "post_feedforward_layernorm.weight"))


def moe_shapes(text) -> dict:
    """One layer's block tensors as transformers holds them (beside the dense MLP and its norms)."""
    h, e, f = text.hidden_size, text.num_experts, text.moe_intermediate_size
    return {"router.proj.weight": (e, h), "router.scale": (h,), "router.per_expert_scale": (e,),
            "experts.gate_up_proj": (e, 2 * f, h), "experts.down_proj": (e, h, f),
            "pre_feedforward_layernorm_2.weight": (h,), "post_feedforward_layernorm_1.weight": (h,),
            "post_feedforward_layernorm_2.weight": (h,)}


# --- parity: the pairs inside a layer's block, HF's side ------------------------------------------

def _hf_routing(output, case):
    import torch

    probs, weights, index = output
    dense = torch.zeros_like(probs, dtype=weights.dtype).scatter(1, index, weights)
    return routing_tensor(dense, probs)


def reference_moe_pairs(name: str, layer) -> list[Pair]:
    """HF's layer ``layer``: its router (the dense routing weights, chosen on its softmax scores),
    the dense MLP's output normed (Megatron's shared expert) and the experts' output, under
    ``name`` (the layer's ``mlp``). None in a dense layer."""
    if not getattr(layer, "enable_moe_block", False):
        return []
    return [Pair(name + ".router", layer.router, _hf_routing),
            Pair(name + ".shared_experts", layer.post_feedforward_layernorm_1, tokens_2d),
            Pair(name + ".experts", layer.experts, tokens_2d)]


def with_moe_pairs(pairs: list, moe_pairs) -> list:
    """``pairs`` with each layer's block pairs (``moe_pairs(mlp_name, layer)``: the layer is the
    module of the pair named as the ``mlp`` pair's parent) placed just before the layer's ``mlp``
    pair, the order a forward runs them (so a divergence names the router or the experts before
    the block's sum)."""
    modules = {pair.name: pair.module for pair in pairs}
    out = []
    for pair in pairs:
        if pair.name.endswith(".mlp"):
            layer = modules.get(pair.name.removesuffix(".mlp"))
            out += moe_pairs(pair.name, layer) if layer is not None else []
        out.append(pair)
    return out
