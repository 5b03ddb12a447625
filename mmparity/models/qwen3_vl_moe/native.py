"""Qwen3-VL-MoE whole on mcore, ``LLaVAModel``'s tree: Qwen3-VL whole's model (``qwen3_vl_whole``:
the ``qwen3_vl`` tower with its DeepStack mergers as ``vision_model``, DeepStack injection after
the first decoder layers, interleaved M-RoPE, q/k norms) whose ``language_model`` is a
``GPTModel`` with a layer spec per layer: Qwen3-VL's dense layer, or the same attention with
megatron-core's ``MoELayer`` (a separate ``pre_mlp_layernorm``, the softmax top-k router, routed
experts, no shared expert) where transformers builds the sparse block
(:func:`~mmparity.models.qwen3_vl_moe.config.moe_layers`).

Routing: HF takes the softmax over all experts, its top k, and renormalises them to sum to one;
mcore's softmax router (``moe_router_pre_softmax`` off) takes the top k logits and a softmax over
those, the same weights. Routing runs in fp32 on both sides.

Deliberate deviations from Megatron-LM's classes, each computing the same: the experts run as
``SequentialMLP`` under TEGroupedMLP's state-dict names (grouped GEMM needs Transformer Engine),
as the DeepSeek-V3 part runs them; the fused-norm linears are the local stand-ins with TE's names.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from mmparity.config import rope_theta
from mmparity.models.core.layers import activation_from_hf, moe_fields, vision_transformer_config
from mmparity.models.core.stages import build_stage, stage_layers
from mmparity.models.parts.deepseek_v3.native import build_gpt_model, moe_spec
from mmparity.models.parts.dense_decoder.config import transformer_fields
from mmparity.models.qwen3_vl import native as tower
from mmparity.models.qwen3_vl_moe.config import experts, moe_layers
from mmparity.models.qwen3_vl_whole import native as whole

def text_config_problems(text) -> list[str]:
    problems = whole.text_config_problems(text)
    if text.hidden_act not in ("silu", "swish"):
        problems.append(f"hidden_act {text.hidden_act!r} (the experts here are SwiGLU)")
    return problems


def transformer_config(text, params_dtype: torch.dtype = torch.float32):
    problems = text_config_problems(text)
    if problems:
        raise ValueError("unsupported language model: " + "; ".join(problems))
    fields = transformer_fields(text)
    fields["activation"] = activation_from_hf(fields["activation"])
    moe = set(moe_layers(text))
    if moe:
        fields.update(moe_fields(
            num_moe_experts=experts(text), moe_layer_freq=[int(i in moe) for i in range(text.num_hidden_layers)],
            moe_ffn_hidden_size=text.moe_intermediate_size, moe_router_topk=text.num_experts_per_tok,
            moe_router_score_function="softmax", moe_router_pre_softmax=False))
    return vision_transformer_config(params_dtype=params_dtype, qk_layernorm=True,
                                     mrope_section=whole.mrope_section(text), **fields)


def layer_spec(sparse: bool, base=whole.language_spec, shared_experts: bool = False) -> ModuleSpec:
    """``base()``'s layer (Qwen3-VL's dense one); with ``sparse``, its MLP is the MoE layer (with a
    shared expert where ``shared_experts``), whose norm is its own."""
    spec = base()
    if sparse:
        spec.submodules.pre_mlp_layernorm = WrappedTorchNorm
        spec.submodules.mlp = moe_spec(shared_experts=shared_experts)
    return spec


def block_spec(text, sparse_layers=None, layer=layer_spec) -> TransformerBlockSubmodules:
    """One spec per layer of this pipeline stage, by its kind: ``layer(sparse)`` for each, sparse in
    ``sparse_layers`` (default: where transformers builds Qwen3-VL-MoE's sparse block)."""
    moe = set(moe_layers(text) if sparse_layers is None else sparse_layers)
    specs = stage_layers([layer(i in moe) for i in range(text.num_hidden_layers)])
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=WrappedTorchNorm)


def build_language_model(text, params_dtype, vocab_size: int, *, pre_process: bool, post_process: bool,
                         share_embeddings_and_output_weights: bool):
    config = transformer_config(text, params_dtype)
    model = build_gpt_model(config, block_spec(text), vocab_size, text.max_position_embeddings,
                            pre_process=pre_process, post_process=post_process, parallel_output=True,
                            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                            rotary_base=rope_theta(text))
    # Qwen3-VL's interleaved M-RoPE, switched in as Qwen3-VL whole's decoder does.
    model.position_embedding_type = "mrope"
    model.mrope_section = whole.mrope_section(text)
    model.rotary_pos_emb = whole.InterleavedMRoPE(config.kv_channels, rope_theta(text))
    return model


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> whole.Qwen3VLModel:
    text, vc = cfg.text_config, cfg.vision_config
    vision, language_model = build_stage(cfg, text, functools.partial(build_language_model, text, params_dtype),
                                         tower=lambda: tower.build_native(vc, params_dtype))
    model = whole.Qwen3VLModel(vision, language_model, image_token_id=cfg.image_token_id,
                               vocab_size=text.vocab_size, merge=vc.spatial_merge_size,
                               patch_dim=int(vc.patch_size), video_token_id=cfg.video_token_id)
    return model.to(params_dtype)
