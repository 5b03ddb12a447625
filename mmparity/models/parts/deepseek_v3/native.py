"""The DeepSeek-V3 language-model part on mcore: a ``GPTModel`` built from mcore's own
``MLASelfAttention`` and ``MoELayer`` (routed ``SequentialMLP`` experts plus a ``SharedExpertMLP``),
configured as Megatron-LM's DeepSeek-V3 / Kimi-K2 recipes configure them: ``moe_layer_freq`` with
``first_k_dense_replace`` leading dense layers, sigmoid router scores with the score-correction
bias (``moe_router_enable_expert_bias``), group-limited top-k, ``moe_router_topk_scaling_factor``,
routing in fp32, and YaRN RoPE with its softmax-scale correction.

What HF computes and mcore cannot is refused by name, not approximated (:func:`config_problems`):
mcore ranks expert groups by the sum of their top ``topk / topk_group`` scores where HF always takes
the top 2, and it renormalises the chosen sigmoid scores exactly when top-k > 1, where HF does when
``norm_topk_prob`` is set.

The checkpoint names the experts as TEGroupedMLP does (``mlp.experts.linear_fc1.weight{e}``); the
CPU model runs them as ``SequentialMLP`` (grouped GEMM needs Transformer Engine), whose state-dict
hooks here read and write the grouped names, as the fused-norm linears keep TE's norm names.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from mmparity.config import moe_layer_range
from mmparity.models.spec import Case, Extractor, Pair, first_tensor, routing_tensor
from mmparity.models.core.layers import (
    BiasInGemmRowParallelLinear, NormedColumnParallelLinear, get_bias_dropout_add)
# Imported first: it corrects megatron-core 0.16's Transformer Engine guards the MLA and MoE
# modules below read.
from mmparity.models.core.mla_moe import host_placement
from mmparity.models.core.stages import stage_layers
# The part's native module is where its callers read the recipe and its refusals.
from mmparity.models.parts.deepseek_v3.config import config_problems, transformer_config  # noqa: F401
from mmparity.models.parts.dense_decoder.native import CausalCoreAttention

from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules  # noqa: E402
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP  # noqa: E402
from megatron.core.transformer.multi_latent_attention import (MLASelfAttention,  # noqa: E402
                                                             MLASelfAttentionSubmodules)

# --- the layer specs ---------------------------------------------------------------------------------

_GROUPED = re.compile(r"^(?P<root>.*)linear_fc(?P<fc>[12])\.(?P<kind>weight|bias)(?P<e>\d+)$")
_SEQUENTIAL = re.compile(r"^(?P<root>.*)local_experts\.(?P<e>\d+)\.linear_fc(?P<fc>[12])\.(?P<kind>weight|bias)$")


class GroupedNamesSequentialMLP(SequentialMLP):
    """mcore's ``SequentialMLP`` whose state dict uses TEGroupedMLP's names
    (``linear_fc1.weight{e}``), the names of the checkpoints Megatron-LM's MoE recipes write."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._register_state_dict_hook(_to_grouped_names)
        self._register_load_state_dict_pre_hook(_from_grouped_names)


def _to_grouped_names(module, state_dict, prefix, local_metadata):
    for key in [k for k in state_dict if k.startswith(prefix)]:
        match = _SEQUENTIAL.match(key[len(prefix):])
        if match:
            value = state_dict.pop(key)
            if not key.endswith("_extra_state"):
                state_dict[f"{prefix}{match['root']}linear_fc{match['fc']}.{match['kind']}{match['e']}"] = value
        elif key.endswith("_extra_state"):
            state_dict.pop(key)
    return state_dict


def _from_grouped_names(state_dict, prefix, *unused):
    # TEGroupedMLP's grouped linears each hold one (empty) extra state for all their experts; the
    # sequential experts here have theirs per expert (left to the model's tolerance of missing ones).
    for fc in (1, 2):
        state_dict.pop(f"{prefix}linear_fc{fc}._extra_state", None)
    for key in [k for k in state_dict if k.startswith(prefix)]:
        match = _GROUPED.match(key[len(prefix):])
        if match:
            state_dict[f"{prefix}{match['root']}local_experts.{match['e']}.linear_fc{match['fc']}."
                       f"{match['kind']}"] = state_dict.pop(key)


def accept_te_extra_states(module: torch.nn.Module) -> None:
    """Let ``module`` load a state dict holding an ``_extra_state`` slot for each of its children
    that is a TE module in Megatron-LM's spec but is none here (MLA's ``TELinear`` down projections
    and ``TEDotProductAttention`` core attention): a load pre-hook drops the slots of the children
    that have no extra state of their own."""
    stateless = [name for name, child in module.named_children()
                 if type(child).get_extra_state is torch.nn.Module.get_extra_state]

    def drop(state_dict, prefix, *unused):
        for name in stateless:
            state_dict.pop(f"{prefix}{name}._extra_state", None)

    module._register_load_state_dict_pre_hook(drop)


def add_routed_experts_probe(moe: MoELayer) -> None:
    """Pass an MoE layer's combined routed-expert output through a stateless probe module
    (``routed_experts``) before the shared expert's output is added, so that parity can hook the
    routed part alone, as it hooks HF's ``experts`` module. Set on the built layer rather than
    by subclassing: mcore hands its process groups only to ``MoELayer`` itself."""
    if not hasattr(moe, "postprocess"):
        return  # a release without that step: the routed part is not paired
    moe.routed_experts = torch.nn.Identity()
    postprocess = moe.postprocess
    moe.postprocess = lambda output, shared: postprocess(moe.routed_experts(output), shared)


def _attention_spec() -> ModuleSpec:
    return ModuleSpec(
        module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear,
            # TE's "duplicated" linears in Megatron-LM: every TP rank holds the down projections whole.
            linear_q_down_proj=ReplicatedLinear, linear_kv_down_proj=ReplicatedLinear,
            linear_q_up_proj=NormedColumnParallelLinear, linear_kv_up_proj=NormedColumnParallelLinear,
            core_attention=CausalCoreAttention, linear_proj=BiasInGemmRowParallelLinear,
            q_layernorm=IdentityOp, kv_layernorm=IdentityOp))


def _expert_mlp() -> MLPSubmodules:
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=BiasInGemmRowParallelLinear)


def moe_spec(shared_experts: bool) -> ModuleSpec:
    """mcore's ``MoELayer`` with the routed experts run one by one under TEGroupedMLP's names and,
    with ``shared_experts``, a shared expert MLP beside them."""
    shared = ModuleSpec(module=SharedExpertMLP, submodules=_expert_mlp()) if shared_experts else None
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(
        experts=ModuleSpec(module=GroupedNamesSequentialMLP, submodules=_expert_mlp()), shared_experts=shared))


def layer_spec(moe: bool) -> ModuleSpec:
    if moe:
        mlp = moe_spec(shared_experts=True)
    else:
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=NormedColumnParallelLinear,
                                                              linear_fc2=BiasInGemmRowParallelLinear))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm, self_attention=_attention_spec(), self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=WrappedTorchNorm if moe else IdentityOp, mlp=mlp, mlp_bda=get_bias_dropout_add))


def block_spec(text) -> TransformerBlockSubmodules:
    """One spec per layer of this pipeline stage: dense first, then MoE."""
    moe = moe_layer_range(text)
    specs = stage_layers([layer_spec(i in moe) for i in range(text.num_hidden_layers)])
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=WrappedTorchNorm)


class LanguageModelBuilder:
    """Builds the DeepSeek-V3 decoder as Megatron-LM holds it, a ``GPTModel`` for a padded
    vocabulary and a pipeline stage (what a whole VLM's ``language_model`` is)."""

    def __init__(self, text, params_dtype: torch.dtype = torch.float32, config=None):
        self.text = text
        if config is None:
            # The q and kv latent norms live in the up projections here (NormedColumnParallelLinear,
            # TE's fused names), so MLA itself must add none: with qk_layernorm set, mcore 0.19
            # accepts only its backend's own fused class for those projections.
            config = dataclasses.replace(transformer_config(text, params_dtype), qk_layernorm=False)
        self.config = config
        self.max_sequence_length = text.max_position_embeddings

    def __call__(self, vocab_size: int, *, pre_process: bool, post_process: bool,
                 parallel_output: bool = True, share_embeddings_and_output_weights: bool = False) -> GPTModel:
        model = build_gpt_model(self.config, block_spec(self.text), vocab_size, self.max_sequence_length,
                                pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
                                share_embeddings_and_output_weights=share_embeddings_and_output_weights)
        for layer in model.decoder.layers:
            accept_te_extra_states(layer.self_attention)
        return model


def build_gpt_model(config, block: TransformerBlockSubmodules, vocab_size: int, max_sequence_length: int,
                    **options) -> GPTModel:
    """A :class:`HostPlacedGPTModel` of ``block``'s layers with RoPE, built on the host (mcore's
    MoE router asks for a CUDA device when built), each MoE layer with its routed-experts probe.
    ``options``: GPTModel's stage, output and rotary arguments."""
    with host_placement(torch.get_default_device()):
        model = HostPlacedGPTModel(config=config, transformer_layer_spec=block, vocab_size=vocab_size,
                                   max_sequence_length=max_sequence_length, position_embedding_type="rope",
                                   scatter_embedding_sequence_parallel=False, **options)
    for layer in model.decoder.layers:
        if isinstance(layer.mlp, MoELayer):
            add_routed_experts_probe(layer.mlp)
    return model


class HostPlacedGPTModel(GPTModel):
    """``GPTModel`` whose forward runs under :func:`host_placement`: a whole VLM that runs it
    (LLaVA's composition) places nothing itself, and mcore's rotary tables ask for the current
    CUDA device on the first forward."""

    def forward(self, *args, **kwargs):
        with host_placement(next(self.parameters()).device):
            return super().forward(*args, **kwargs)



# --- parity: the pairs inside an MoE layer's MLP ---------------------------------------------------

def mlp_pairs(name: str, mlp, extract: Extractor) -> list[Pair]:
    """mcore's ``MoELayer``: its router (the dense routing weights), shared experts and the routed
    experts' combined output (the ``routed_experts`` probe), under ``name`` (the layer's ``mlp``);
    none in a dense layer. ``extract``: the layer's own extractor, on ``[s, b, h]``."""
    if not isinstance(mlp, MoELayer):
        return []
    rows = _sequence_rows(extract)
    return [Pair(name + ".router", mlp.router, lambda output, case: routing_tensor(rows(output[0], case))),
            Pair(name + ".shared_experts", mlp.shared_experts, extract),
            Pair(name + ".experts", getattr(mlp, "routed_experts", None), rows)]


def _sequence_rows(extract: Extractor) -> Extractor:
    """The router and the routed experts see the tokens flattened sequence-major (``[s·b, x]``):
    back to ``[s, b, x]`` (the case's ``input_ids`` give the batch), then the layer's extractor."""

    def rows(output, case: Case):
        t = first_tensor(output)
        return extract(t.reshape(-1, case.data["input_ids"].shape[0], t.shape[-1]), case)

    return rows
