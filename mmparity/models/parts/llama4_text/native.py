"""The Llama 4 language-model part on mcore: a ``GPTModel`` with one layer spec per layer.

Every layer is GQA attention with its input RMSNorm fused into ``linear_qkv`` (TE's names) and a
SwiGLU MLP; what differs per layer, as transformers' ``Llama4TextConfig`` says:

* RoPE layers (``no_rope_layers[i]`` = 1): interleaved RoPE (transformers multiplies adjacent pairs
  as complex numbers, on the weights as stored, so no q/k permutation), then a weightless L2 norm
  of each head of q and k where ``use_qk_norm`` (``q_layernorm`` / ``k_layernorm``: mcore applies
  them before the rotation, transformers after; a rotation keeps each head's mean square, so the
  two orders are the same function), and a causal mask cut into ``attention_chunk_size`` chunks
  where transformers' ``layer_types`` says ``chunked_attention``;
* NoPE layers: no rotation, no q/k norm, a full causal mask, and with ``attn_temperature_tuning``
  each query scaled by ``1 + attn_scale · log(1 + floor((position + 1) / floor_scale))``;
* MLP: the dense layers' (``intermediate_size_mlp``, its norm fused into ``linear_fc1``), or on
  the layers of ``moe_layers`` mcore's ``MoELayer`` (a separate ``pre_mlp_layernorm``): a sigmoid
  top-1 router whose score scales the chosen expert's *input* (``moe_apply_probs_on_input``, as
  transformers multiplies the hidden state before its experts), routed experts run one by one
  under TEGroupedMLP's names, and the shared expert on the unscaled input.

Megatron's stock GPT spec has no chunked attention and no temperature tuning, and its NoPE layers
(``no_rope_freq``) take its L2 q/k norms (``qk_l2_norm``) where Llama 4's skip them: the mask, the
skipped rotation and norms and the query scale live in the core attention and the attention
class of this spec, which hold no tensors, so the state dict is the stock MoE ``GPTModel``'s.
"""

from __future__ import annotations


import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from mmparity.config import rope_theta
from mmparity.models.core.layers import (
    BiasInGemmRowParallelLinear, NormedColumnParallelLinear, activation_from_hf, get_bias_dropout_add, moe_fields,
    vision_transformer_config)
from mmparity.models.core.stages import stage_layers
# mlp_pairs: the pairs inside an MoE layer, as every MoELayer here pairs them.
from mmparity.models.parts.deepseek_v3.native import build_gpt_model, mlp_pairs, moe_spec  # noqa: F401
from mmparity.models.parts.dense_decoder.native import CausalCoreAttention, LanguageRotaryEmbedding
from mmparity.models.parts.llama4_text.config import (
    LLAMA3_FIELDS, chunked_layers, config_problems, moe_layers, rope_layers, transformer_fields)


def transformer_config(text, params_dtype: torch.dtype = torch.float32):
    problems = config_problems(text)
    if problems:
        raise ValueError("unsupported Llama 4 language model: " + "; ".join(problems))
    fields = transformer_fields(text)
    fields["activation"] = activation_from_hf(fields["activation"])
    moe = moe_layers(text)
    if any(moe):
        fields.update(moe_fields(
            num_moe_experts=text.num_local_experts, moe_layer_freq=[int(m) for m in moe],
            moe_ffn_hidden_size=text.intermediate_size, moe_router_topk=text.num_experts_per_tok,
            moe_router_score_function="sigmoid", moe_apply_probs_on_input=True,
            moe_shared_expert_intermediate_size=text.intermediate_size))
    return vision_transformer_config(params_dtype=params_dtype, qk_layernorm=bool(text.use_qk_norm), **fields)


class L2HeadNorm(MegatronModule):
    """transformers' ``Llama4TextL2Norm``: each head scaled to unit mean square (in fp32, cast
    back), no weight; built where mcore builds ``q_layernorm`` / ``k_layernorm``."""

    def __init__(self, config, hidden_size: int = 0, eps: float = 1e-6):
        super().__init__(config=config)
        self.eps = config.layernorm_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class Llama4CoreAttention(CausalCoreAttention):
    """Causal SDPA, cut into ``chunk``-long blocks (a query attends to the keys of its own chunk
    only) where ``chunk`` is set; with ``floor_scale`` the queries are first scaled by transformers'
    attention temperature at their positions (NoPE layers)."""

    def __init__(self, config, layer_number: int, *args, chunk: int | None = None,
                 floor_scale: float | None = None, attn_scale: float = 0.0, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        self.chunk, self.floor_scale, self.attn_scale = chunk, floor_scale, attn_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        seq = query.shape[0]
        positions = torch.arange(seq, device=query.device)
        if self.floor_scale is not None:
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            query = (query * scale.view(seq, 1, 1, 1)).to(query.dtype)
        if self.chunk is not None and seq > self.chunk:
            block = positions // self.chunk
            outside = block[:, None] != block[None, :]  # mcore's boolean: True = masked out
            attention_mask = outside if attention_mask is None else (attention_mask.bool() | outside)
        return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                               packed_seq_params)


class NoPESelfAttention(SelfAttention):
    """mcore's ``SelfAttention`` that never rotates q/k: GPTModel hands every layer the same RoPE
    table, and a NoPE layer ignores it."""

    def forward(self, *args, **kwargs):
        kwargs["rotary_pos_emb"] = None
        return super().forward(*args, **kwargs)


def layer_spec(text, i: int) -> ModuleSpec:
    rope, chunked, moe = rope_layers(text)[i], chunked_layers(text)[i], moe_layers(text)[i]
    core_params = {}
    if chunked:
        core_params["chunk"] = text.attention_chunk_size
    if not rope and text.attn_temperature_tuning:
        core_params.update(floor_scale=text.floor_scale, attn_scale=text.attn_scale)
    qk_norm = L2HeadNorm if rope and text.use_qk_norm else IdentityOp
    attention = ModuleSpec(
        module=SelfAttention if rope else NoPESelfAttention, params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=NormedColumnParallelLinear,
            core_attention=ModuleSpec(module=Llama4CoreAttention, params=core_params),
            linear_proj=BiasInGemmRowParallelLinear, q_layernorm=qk_norm, k_layernorm=qk_norm))
    if moe:
        mlp, norm = moe_spec(shared_experts=True), WrappedTorchNorm
    else:
        mlp = ModuleSpec(module=MLP, params={"ffn_hidden_size": text.intermediate_size_mlp},
                         submodules=MLPSubmodules(linear_fc1=NormedColumnParallelLinear,
                                                  linear_fc2=BiasInGemmRowParallelLinear))
        norm = IdentityOp
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=IdentityOp, self_attention=attention, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=norm, mlp=mlp, mlp_bda=get_bias_dropout_add))


def block_spec(text) -> TransformerBlockSubmodules:
    """One spec per layer of this pipeline stage, by its kind."""
    specs = stage_layers([layer_spec(text, i) for i in range(text.num_hidden_layers)])
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=WrappedTorchNorm)


class LanguageModelBuilder:
    """Builds the Llama 4 decoder as a ``GPTModel`` for a padded vocabulary and a pipeline stage."""

    def __init__(self, text, params_dtype: torch.dtype = torch.float32, config=None):
        self.text = text
        self.config = transformer_config(text, params_dtype) if config is None else config
        self.max_sequence_length = text.max_position_embeddings
        self.rotary_base = rope_theta(text, 500000.0)

    def __call__(self, vocab_size: int, *, pre_process: bool, post_process: bool,
                 parallel_output: bool = True, share_embeddings_and_output_weights: bool = False) -> GPTModel:
        model = build_gpt_model(self.config, block_spec(self.text), vocab_size, self.max_sequence_length,
                                pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
                                share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                                rotary_base=self.rotary_base)
        rotary = model.rotary_pos_emb = LanguageRotaryEmbedding(
            kv_channels=self.config.kv_channels, rotary_percent=1.0, rotary_interleaved=True,
            rotary_base=self.rotary_base, use_cpu_initialization=True)
        params = getattr(self.text, "rope_parameters", None) or {}
        if params.get("rope_type") == "llama3":
            # mcore's own Llama 3 scaling, with the config's factors (its constructor passes fixed
            # ones: a high-frequency factor of 4, whatever the config says).
            rotary.inv_freq = rotary._apply_scaling(rotary.inv_freq, **{k: params[k] for k in LLAMA3_FIELDS})
        return model
