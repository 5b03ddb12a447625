"""The Gemma 4 decoder on mcore: a ``GPTModel`` whose layers are Gemma 3's
(:mod:`mmparity.models.parts.gemma_blocks`: sandwich norms on ``linear_proj`` / ``linear_fc2``,
q/k norms, sliding and full layers each rotating with its own RoPE) with what Gemma 4 changes:

* every RMSNorm scales by ``w`` (not Gemma 3's ``1 + w``), computed in fp32 and cast back;
* attention is unscaled (``softmax_scale`` 1) and the values are RMS-normalised per head with no
  weight (HF's ``v_norm``), in the core attention: mcore has no value norm and there is nothing
  to hold;
* full layers are wider (``global_head_dim``): their attention is built from the block's config
  with its own ``kv_channels`` (so ``linear_qkv``, ``linear_proj`` and the q/k norms take that
  width); their RoPE is proportional (only the first ``partial_rotary_factor`` of the frequencies
  turn, pairs ``(k, k + d/2)`` as over the full width);
* each layer's output is multiplied by its ``layer_scalar`` (HF's buffer, kept as a buffer of the
  same name on the layer: Megatron's layer has no place for it, so the checkpoint carries it as
  ``decoder.layers.N.layer_scalar``);
* the embedding is scaled by ``sqrt(hidden)`` rounded to the parameter dtype (the embedding's
  output, so a whole VLM's image features placed after it are not scaled), and the logits are
  soft-capped (``cap · tanh(logits / cap)``) where the config sets ``final_logit_softcapping``.

A full layer whose keys are its values (``attention_k_eq_v``) is a stock layer whose value rows of
``linear_qkv`` equal its key rows (the converter writes them so): its values are the key
projection's output, value-normed, as transformers computes them. The MoE block
(``enable_moe_block``) replaces every layer's MLP by an ``MoELayer`` (:mod:`.moe_native`). E2B /
E4B's per-layer inputs and shared keys / values are built by
:mod:`~mmparity.models.parts.gemma4_text.per_layer_native`'s builder, on this one; this builder
refuses them rather than build a model without them.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from mmparity.models.core.layers import NormedColumnParallelLinear, get_bias_dropout_add
from mmparity.models.core.stages import stage_layers
from mmparity.models.parts.deepseek_v3.native import build_gpt_model
from mmparity.models.parts.gemma4_text.config import (
    SLIDING, config_problems, layer_fields, layer_inv_freq, transformer_config)
from mmparity.models.parts.gemma4_text.moe import is_moe
from mmparity.models.parts.gemma4_text.moe_native import moe_layer_spec
from mmparity.models.parts.gemma_blocks import (
    PerLayerRopeSelfAttention, PostNormedRowParallelLinear, WindowedCoreAttention, rope_table)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """HF's Gemma 4 RMSNorm: in fp32, ``x · (mean(x²) + eps)^-½``, times ``weight`` where it has
    one, cast back to ``x``'s dtype."""
    x32 = x.float()
    normed = x32 * torch.pow(x32.square().mean(-1, keepdim=True) + eps, -0.5)
    return (normed if weight is None else normed * weight.float()).to(x.dtype)


class RMSNorm(torch.nn.Module):
    """A local RMSNorm module (key ``weight``), Gemma 4's: scaled by ``w`` in fp32."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class NormedColumn(NormedColumnParallelLinear):
    """TE's ``LayerNormColumnParallelLinear`` with Gemma 4's fp32 input norm."""

    def norm(self, input_: torch.Tensor) -> torch.Tensor:
        return rms_norm(input_, self.layer_norm_weight, self.norm_eps)


class PostNormedRow(PostNormedRowParallelLinear):
    norm_class = RMSNorm


class Gemma4CoreAttention(WindowedCoreAttention):
    """Gemma's windowed causal attention with HF's ``v_norm``: each value head RMS-normalised, no
    weight. A whole VLM's mask (its images' bidirectional blocks) reaches the sliding layers only:
    Gemma 4's full layers stay causal (unlike Gemma 3's)."""

    def __init__(self, config, layer_number: int, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        self.eps = config.layernorm_epsilon

    def forward(self, query, key, value, attention_mask=None, *args, **kwargs):
        if self.window is None:
            attention_mask = None
        return super().forward(query, key, rms_norm(value, None, self.eps), attention_mask, *args, **kwargs)


class ScaledLayer(TransformerLayer):
    """mcore's ``TransformerLayer`` whose output is multiplied by ``layer_scalar`` (HF's buffer of
    one element, saved with the layer)."""

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.register_buffer("layer_scalar", torch.ones(1, dtype=config.params_dtype))

    def forward(self, *args, **kwargs):
        out, context = super().forward(*args, **kwargs)
        return self.before_scale(out) * self.layer_scalar.to(out.dtype), context

    def before_scale(self, out: torch.Tensor) -> torch.Tensor:
        """What a subclass adds to the layer's output before the scalar (E2B's per-layer input)."""
        return out


def layer_spec(text) -> ModuleSpec:
    windows = tuple(text.sliding_window if t == SLIDING else None for t in text.layer_types)
    ropes = tuple(layer_inv_freq(text, i) for i in range(text.num_hidden_layers))
    attention = ModuleSpec(module=PerLayerRopeSelfAttention,
                           params={"attn_mask_type": AttnMaskType.causal, "ropes": ropes,
                                   "layer_fields": layer_fields(text)},
                           submodules=SelfAttentionSubmodules(
                               linear_qkv=NormedColumn,
                               core_attention=ModuleSpec(module=Gemma4CoreAttention, params={"windows": windows}),
                               linear_proj=PostNormedRow, q_layernorm=RMSNorm, k_layernorm=RMSNorm))
    mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=NormedColumn, linear_fc2=PostNormedRow))
    return ModuleSpec(module=ScaledLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=IdentityOp, self_attention=attention, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=IdentityOp, mlp=mlp, mlp_bda=get_bias_dropout_add))


def with_moe(text, spec: ModuleSpec) -> ModuleSpec:
    """``spec`` (a layer's), its MLP the MoE block where the config has one (every layer then does)."""
    if not is_moe(text):
        return spec
    return moe_layer_spec(spec, RMSNorm, rms_norm)


def block_spec(text) -> TransformerBlockSubmodules:
    return TransformerBlockSubmodules(layer_specs=stage_layers([with_moe(text, layer_spec(text))] * text.num_hidden_layers),
                                      layer_norm=RMSNorm)


def _scale_embedding(hidden_size: int):
    def hook(module, args, out):
        # HF multiplies by sqrt(hidden) held in the weights' dtype (bf16 rounds it).
        return out * torch.tensor(hidden_size ** 0.5, dtype=torch.float32).to(out.dtype).to(out.device)
    return hook


def _cap_logits(cap: float):
    def hook(module, args, out):
        logits, bias = out
        return torch.tanh(logits / cap) * cap, bias
    return hook


class LanguageModelBuilder:
    """The Gemma 4 decoder as a ``GPTModel`` for a padded vocabulary and a pipeline stage."""

    def __init__(self, text, params_dtype: torch.dtype = torch.float32):
        problems = config_problems(text) + self.unbuilt(text)
        if problems:
            raise ValueError("unsupported Gemma 4 language model: " + "; ".join(problems))
        self.text = text
        self.config = transformer_config(text, params_dtype)
        self.max_sequence_length = text.max_position_embeddings

    @staticmethod
    def unbuilt(text) -> list[str]:
        """What this builder leaves to :class:`~mmparity.models.parts.gemma4_text.per_layer_native.LanguageModelBuilder`."""
        return [f"text_config: {name}: built by the per-layer builder (parts.gemma4_text.per_layer_native)"
                for name in ("hidden_size_per_layer_input", "num_kv_shared_layers") if getattr(text, name, None)]

    def block(self) -> TransformerBlockSubmodules:
        return block_spec(self.text)

    def __call__(self, vocab_size: int, *, pre_process: bool, post_process: bool,
                 parallel_output: bool = True, share_embeddings_and_output_weights: bool = False):
        text = self.text
        model = build_gpt_model(self.config, self.block(), vocab_size, self.max_sequence_length,
                                pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
                                share_embeddings_and_output_weights=share_embeddings_and_output_weights)
        # GPTModel's own table is unused (each layer rotates with its own), kept on the host.
        model.rotary_pos_emb = rope_table(layer_inv_freq(text, 0))
        if pre_process:
            model.embedding.register_forward_hook(_scale_embedding(text.hidden_size))
        cap = getattr(text, "final_logit_softcapping", None)
        if post_process and cap:
            model.output_layer.register_forward_hook(_cap_logits(float(cap)))
        return model
