"""Gemma 4's MoE block on mcore (:mod:`.moe` says what transformers computes and where each tensor
goes): megatron-core's ``MoELayer`` with its softmax top-k router, its all-gather dispatcher and
EP, and a shared expert, with what Gemma adds, each the smallest change to the stock module:

* the router's input is RMS-normalised without a weight, times a learned per-channel ``scale``
  and ``hidden ** -0.5``; its chosen weights are then multiplied by the chosen experts'
  ``per_expert_scale`` (:class:`Gemma4Router`);
* the routed experts read their own normed input (``pre_experts_layernorm``; the router and the
  dense MLP read the layer's residual), their combined output is normed (``post_experts_layernorm``)
  before the dense MLP's normed output is added, and the sum is normed (``post_layernorm``)
  (:class:`Gemma4MoE`);
* the dense MLP is the shared expert, ungated, its norms fused into its linears as in a dense
  Gemma 4 layer.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

# Imported first: it corrects megatron-core 0.16's Transformer Engine guards the MoE modules read.
from mmparity.models.core.mla_moe import host_placement  # noqa: F401
from mmparity.models.parts.deepseek_v3.native import mlp_pairs, moe_spec
from mmparity.models.spec import sbh_tokens_2d

from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP  # noqa: E402


class Gemma4Router(TopKRouter):
    """megatron-core's top-k router (``weight``: HF's ``router.proj``) on Gemma's scaled input, its
    routing weights times ``per_expert_scale``: both scales are the router's own parameters.
    ``norm(x, weight, eps)``: the decoder's RMSNorm function (called with no weight)."""

    def __init__(self, config, *args, norm, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.norm = norm
        self.scale = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype))
        self.per_expert_scale = torch.nn.Parameter(torch.ones(config.num_moe_experts, dtype=config.params_dtype))

    def forward(self, input, padding_mask=None):
        scaled = self.norm(input, None, self.config.layernorm_epsilon) * self.scale * self.config.hidden_size ** -0.5
        probs, routing_map = super().forward(scaled, padding_mask)
        # Zero where an expert was not chosen, so the scale reaches the chosen weights only.
        return probs * self.per_expert_scale, routing_map


class Gemma4MoE(MoELayer):
    """``MoELayer`` whose routed experts have their own pre and post norms and whose output (routed
    plus shared) is normed. ``routed_experts``: a stateless probe on the routed part alone, after
    the combine and before its norm (what parity pairs with HF's ``experts``). ``norm_class``: the
    decoder's RMSNorm module."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *, norm_class):
        super().__init__(config, submodules, layer_number, pg_collection)
        size, eps = config.hidden_size, config.layernorm_epsilon
        self.pre_experts_layernorm = norm_class(config, size, eps)
        self.post_experts_layernorm = norm_class(config, size, eps)
        self.post_layernorm = norm_class(config, size, eps)
        self.routed_experts = torch.nn.Identity()

    @property
    def linear_fc1(self):
        """The dense MLP's first linear, whose fused norm is the layer's pre-feedforward norm
        (where parity finds a fused ``pre_mlp_layernorm``, as in a dense layer)."""
        return self.shared_experts.linear_fc1

    def preprocess(self, hidden_states, probs, routing_map):
        return super().preprocess(self.pre_experts_layernorm(hidden_states), probs, routing_map)

    def postprocess(self, output, shared_expert_output):
        routed = self.post_experts_layernorm(self.routed_experts(super().postprocess(output, None)))
        return self.post_layernorm(routed + shared_expert_output)


def spec_submodules(spec):
    """A ``ModuleSpec``'s submodules, or those of the ``functools.partial`` newer megatron-core
    spells an MLP's spec with."""
    return spec.keywords["submodules"] if isinstance(spec, partial) else spec.submodules


def moe_layer_spec(layer: ModuleSpec, norm_class, norm, experts=None) -> ModuleSpec:
    """A dense Gemma 4 layer's spec with its MLP replaced by the block: the stock MoE spec's
    routed experts (TEGroupedMLP's names), Gemma's router, the dense MLP (its fused norms and
    all) as the shared expert. ``norm_class`` / ``norm``: the decoder's RMSNorm module and
    function (the decoder's native module builds this spec, and this module does not import it);
    ``experts``: the routed experts' spec in place of the stock MoE spec's (Megatron's class: TEGroupedMLP)."""
    base = moe_spec(shared_experts=False)
    if experts is not None:
        base = dataclasses.replace(base, submodules=dataclasses.replace(base.submodules, experts=experts))
    dense = spec_submodules(layer.submodules.mlp)
    shared = ModuleSpec(module=SharedExpertMLP, submodules=MLPSubmodules(linear_fc1=dense.linear_fc1,
                                                                         linear_fc2=dense.linear_fc2))
    submodules = dataclasses.replace(base.submodules, shared_experts=shared, router=partial(Gemma4Router, norm=norm))
    # A class, not a ModuleSpec: mcore's layer logs every MLP spec of a class it does not know as
    # unknown; megatron-core's build_module reads a class's own ``submodules`` and ``params`` as a spec's.
    mlp = type("Gemma4MoE", (Gemma4MoE,), {"submodules": submodules, "params": {**base.params, "norm_class": norm_class},
                                           "__module__": __name__})
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))


def native_moe_pairs(name: str, layer) -> list:
    """The native layer's block pairs under ``name`` (its ``mlp``): the router, the shared expert
    (the dense MLP's normed output), the routed experts' combined output; none in a dense layer."""
    return mlp_pairs(name, getattr(layer, "mlp", None), sbh_tokens_2d)

