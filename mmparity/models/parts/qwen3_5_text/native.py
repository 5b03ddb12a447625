"""The Qwen3.5 / Qwen3.5-MoE language-model part on mcore: a ``GPTModel`` whose layers follow the
text config's ``layer_types``, as megatron-core's hybrid block spec
(``models/gpt/experimental_attention_variant_module_specs.py``) lays them out:

* a ``linear_attention`` layer is mcore's ``GatedDeltaNet`` (``in_proj`` with the input norm fused
  in, rows ``[q, k, v, z, beta, alpha]`` per TP rank; the depthwise ``conv1d`` over ``[q, k, v]``;
  ``dt_bias``; ``A_log``; ``out_norm``; ``out_proj``);
* a ``full_attention`` layer is mcore's ``SelfAttention`` with ``attention_output_gate`` (each
  query group's rows ``[q heads, gate heads, k, v]``), q/k norms and partial rotate-half RoPE;
* the MLP is a gated MLP with the post-attention norm fused into ``linear_fc1``, or an ``MoELayer``
  (softmax top-k router, routed experts, a shared expert with its sigmoid gate ``gate_weight``).

Every RMSNorm scales by ``1 + weight`` (``layernorm_zero_centered_gamma``), as HF's do, the
DeltaNet output norm included (HF's scales by ``weight``: the mapping shifts it by one).

Deliberate deviations from megatron-core's classes, each computing the same: the Transformer Engine
modules of its spec are the local stand-ins of :mod:`mmparity.models.core.layers` with TE's names;
``GatedDeltaNet.forward`` is restated here so that it runs without fla (the gated delta rule of
:mod:`mmparity.models.parts.qwen3_5_text.delta_rule`, fla's kernel where it is installed on a GPU;
each layer's ``delta_rule_kernel`` says which).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.ssm import gated_delta_net
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from mmparity.models.core.layers import BiasInGemmRowParallelLinear, NormedColumnParallelLinear, get_bias_dropout_add
# Imported first: it corrects megatron-core 0.16's Transformer Engine guards the MoE modules read.
from mmparity.models.core.mla_moe import host_placement
# The zero-centred norm is TE's (its stand-in's); the part's modules and its callers read it here.
from mmparity.models.core.te_stand_ins import ZeroCentredRMSNorm, zero_centred_rms_norm  # noqa: F401
from mmparity.models.core.stages import stage_layers
from mmparity.models.parts.deepseek_v3.native import build_gpt_model, moe_spec
from mmparity.models.parts.dense_decoder.native import CausalCoreAttention, LanguageRotaryEmbedding
from mmparity.models.parts.qwen3_5_text import delta_rule
# The part's native module is where its callers read the recipe and its refusals.
from mmparity.models.parts.qwen3_5_text.config import (  # noqa: F401
    config_problems, is_moe, linear_pattern, rotary_fraction, transformer_config)


class ZeroCentredNormedColumnParallelLinear(NormedColumnParallelLinear):
    """TE's ``LayerNormColumnParallelLinear`` with ``zero_centered_gamma``: the fused input norm
    scales by ``1 + layer_norm_weight``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        with torch.no_grad():
            self.layer_norm_weight.zero_()

    def norm(self, input_: torch.Tensor) -> torch.Tensor:
        return zero_centred_rms_norm(input_, self.layer_norm_weight, self.norm_eps)


_BUILDING = threading.Lock()


@contextlib.contextmanager
def _buildable_without_fla():
    """megatron-core's ``GatedDeltaNet`` refuses to build without fla, though only its forward
    needs it (and the forward here does not)."""
    with _BUILDING:
        saved = gated_delta_net.HAVE_FLA
        gated_delta_net.HAVE_FLA = True
        try:
            yield
        finally:
            gated_delta_net.HAVE_FLA = saved


class HostGatedDeltaNet(GatedDeltaNet):
    """megatron-core's ``GatedDeltaNet`` (its parameters, names and shapes, its TP layout), whose
    forward runs the gated delta rule of :mod:`~mmparity.models.parts.qwen3_5_text.delta_rule`."""

    def __init__(self, config, submodules, *args, **kwargs):
        with _buildable_without_fla(), host_placement(torch.get_default_device()):
            super().__init__(config, submodules, *args, **kwargs)

    def reset_parameters(self):
        """mcore's initial values, drawn from torch's generator: its CUDA RNG tracker has no state
        on a host without a GPU."""
        if not self.config.perform_initialization:
            return
        with torch.no_grad():
            if self.conv_init is not None:
                torch.nn.init.uniform_(self.conv1d.weight, -self.conv_init, self.conv_init)
            self.dt_bias.fill_(1.0)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*self.A_init_range).log())

    @property
    def delta_rule_kernel(self) -> str:
        """Which gated delta rule this layer runs, on the device its weights are on."""
        return delta_rule.kernel_for(self.A_log.device)

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                inference_params=None, **unused):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("Gated DeltaNet here runs no inference cache")
        if packed_seq_params is not None:
            raise NotImplementedError("Gated DeltaNet here runs no packed sequences")
        seq, batch, _ = hidden_states.shape
        tp = self.tp_size
        mixed, _ = self.in_proj(hidden_states)
        mixed = mixed.transpose(0, 1)  # [b, s, in_proj rows of this rank]
        qkv, gate, beta, alpha = torch.split(
            mixed, [self.conv_dim // tp, self.v_dim // tp, self.num_value_heads // tp,
                    self.num_value_heads // tp], dim=-1)
        qkv = self.act_fn(self.conv1d(qkv.transpose(1, 2))[..., :seq]).transpose(1, 2)
        query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
        query = delta_rule.l2norm(query.reshape(batch, seq, -1, self.key_head_dim))
        key = delta_rule.l2norm(key.reshape(batch, seq, -1, self.key_head_dim))
        value = value.reshape(batch, seq, -1, self.value_head_dim)
        per_key = self.num_value_heads // self.num_key_heads
        if per_key > 1:  # each key head serves that many consecutive value heads
            query, key = (t.repeat_interleave(per_key, dim=2) for t in (query, key))
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias.float())
        out = delta_rule.gated_delta_rule(self.delta_rule_kernel, query, key, value, g, beta.sigmoid())
        flat = out.reshape(-1, self.value_head_dim)
        normed = (self.out_norm(flat) * self.act_fn(gate.reshape(-1, self.value_head_dim).float())).to(flat.dtype)
        normed = normed.reshape(batch, seq, -1).transpose(0, 1).contiguous()
        return self.out_proj(normed)


# --- the layer specs ---------------------------------------------------------------------------------

def _delta_net_spec() -> ModuleSpec:
    return ModuleSpec(module=HostGatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ZeroCentredNormedColumnParallelLinear, out_norm=ZeroCentredRMSNorm,
        out_proj=BiasInGemmRowParallelLinear))


def _attention_spec() -> ModuleSpec:
    return ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=SelfAttentionSubmodules(
                          linear_qkv=ZeroCentredNormedColumnParallelLinear, core_attention=CausalCoreAttention,
                          linear_proj=BiasInGemmRowParallelLinear, q_layernorm=ZeroCentredRMSNorm,
                          k_layernorm=ZeroCentredRMSNorm))


def _mlp_spec(moe: bool) -> ModuleSpec:
    if not moe:
        return ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=ZeroCentredNormedColumnParallelLinear, linear_fc2=BiasInGemmRowParallelLinear))
    return moe_spec(shared_experts=True)


def layer_spec(linear: bool, moe: bool) -> ModuleSpec:
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=IdentityOp, self_attention=_delta_net_spec() if linear else _attention_spec(),
        self_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=ZeroCentredRMSNorm if moe else IdentityOp,
        mlp=_mlp_spec(moe), mlp_bda=get_bias_dropout_add))


def block_spec(text) -> TransformerBlockSubmodules:
    """One spec per layer of this pipeline stage, in ``layer_types`` order."""
    moe = is_moe(text)
    specs = stage_layers([layer_spec(bool(linear), moe) for linear in linear_pattern(text)])
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=ZeroCentredRMSNorm)


def delta_rule_kernels(model: torch.nn.Module) -> dict[str, str]:
    """Which gated delta rule each Gated DeltaNet layer of ``model`` runs, by module name: what a
    report shows beside its numbers."""
    return {name: module.delta_rule_kernel for name, module in model.named_modules()
            if isinstance(module, HostGatedDeltaNet)}


class LanguageModelBuilder:
    """Builds the Qwen3.5 decoder as Megatron-LM holds it, a ``GPTModel`` for a padded vocabulary
    and a pipeline stage (what a whole VLM's ``language_model`` is)."""

    def __init__(self, text, params_dtype: torch.dtype = torch.float32, config=None):
        self.text = text
        self.config = transformer_config(text, params_dtype) if config is None else config
        self.max_sequence_length = text.max_position_embeddings
        self.rotary_percent = rotary_fraction(text)
        from mmparity.config import rope_parameters

        self.rotary_base = float(rope_parameters(text)["rope_theta"])

    def __call__(self, vocab_size: int, *, pre_process: bool, post_process: bool,
                 parallel_output: bool = True, share_embeddings_and_output_weights: bool = False) -> GPTModel:
        model = build_gpt_model(self.config, block_spec(self.text), vocab_size, self.max_sequence_length,
                                pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
                                share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                                rotary_percent=self.rotary_percent, rotary_base=self.rotary_base)
        model.rotary_pos_emb = LanguageRotaryEmbedding(
            kv_channels=self.config.kv_channels, rotary_percent=self.rotary_percent,
            rotary_interleaved=False, rotary_base=self.rotary_base, use_cpu_initialization=True)
        return model
