"""Megatron's own class for GLM-4.5V's language model trained alone: stock megatron-core
``GPTModel`` as Megatron-LM's ``pretrain_gpt.py`` builds a GLM-4.5 MoE decoder (``--group-query-attention
--num-query-groups --kv-channels --add-qkv-bias --disable-bias-linear --rotary-percent
--num-experts --moe-layer-freq --moe-ffn-hidden-size --moe-shared-expert-intermediate-size
--moe-router-topk --moe-router-score-function sigmoid --moe-router-enable-expert-bias
--moe-router-num-groups --moe-router-group-topk --moe-router-topk-scaling-factor --moe-grouped-gemm``,
TE block spec), from this family's one text config -> ``TransformerConfig`` recipe.

On text the three M-RoPE position axes are equal, so sectioned M-RoPE over the rotated part of each
head is plain rotate-half RoPE with ``rotary_percent`` and the stock class computes HF's text model."""

from __future__ import annotations

import dataclasses

import torch

from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.models.glm4v_moe.config import rotary_fraction
from mmparity.models.glm4v_moe.native import transformer_config
from mmparity.models.llava import megatron as llava
from mmparity.models.qwen3_vl_moe.megatron import build_te_moe_gpt_model


def build_language_model(cfg, params_dtype=torch.float32, divisible_by: int = VOCAB_MULTIPLE,
                         parallel_output: bool = True):
    """The GLM-4.5 MoE decoder of a whole GLM-4.5V alone: mcore's own TE block spec (dense layers
    first, then ``MoELayer`` with ``TEGroupedMLP`` experts and a shared expert), as Qwen3-VL-MoE's
    is built, with half (``partial_rotary_factor``) of each head rotated; this pipeline stage of it."""
    return build_te_moe_gpt_model(cfg, transformer_config(cfg.text_config, params_dtype), divisible_by=divisible_by,
                                  parallel_output=parallel_output, rotary_percent=rotary_fraction(cfg.text_config))


WHY_NO_WHOLE = ("megatron-core and Megatron-LM main have no GLM-4.5V class (no GLM vision tower, no "
                "M-RoPE model), so only the language model has one: stock GPTModel, which trains it alone")

LANGUAGE_MODEL = dataclasses.replace(
    llava.LANGUAGE_MODEL, build=build_language_model, why_part=WHY_NO_WHOLE, unwritten_extra_state=(),
    note=f"the GLM-4.5 MoE language model part (language_model.*) on text-only ids, stock GPTModel on mcore's "
         f"TE block spec (q/k/v biases, partial RoPE, sigmoid group-limited router with expert bias, shared "
         f"and grouped-GEMM experts; M-RoPE on text is plain RoPE); {llava.PADDED_LOSS_NOTE}")
MEGATRON = {"GPTModel": LANGUAGE_MODEL}
