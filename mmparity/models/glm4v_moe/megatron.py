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
from megatron.core.models.gpt import gpt_model

from mmparity.config import padded_vocab_size, rope_theta, tied_embeddings
from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.models.core import mla_moe, te_stand_ins
from mmparity.models.core.te_stand_ins import buildable_without_te
from mmparity.models.glm4v_moe.config import rotary_fraction
from mmparity.models.glm4v_moe.native import transformer_config
from mmparity.models.llava import megatron as llava
from mmparity.parallel import runtime


def build_language_model(cfg, params_dtype=torch.float32, divisible_by: int = VOCAB_MULTIPLE,
                         parallel_output: bool = True):
    """The GLM-4.5 MoE decoder of a whole GLM-4.5V alone: mcore's own
    ``get_gpt_decoder_block_spec(config, use_transformer_engine=True)`` (dense layers first, then
    ``MoELayer`` with ``TEGroupedMLP`` experts and a shared expert), the experts as grouped GEMMs;
    this pipeline stage of it."""
    from megatron.core.extensions import transformer_engine_spec_provider

    text = cfg.text_config
    layout = runtime.current_layout()
    tp = layout.tp if layout is not None else 1
    config = transformer_config(text, params_dtype)
    if config.num_moe_experts:
        config = dataclasses.replace(config, moe_grouped_gemm=True)
    with te_stand_ins.qk_norm_without_te():
        spec = te_stand_ins.gpt_decoder_block_spec(config)
    with buildable_without_te(gpt_model, transformer_engine_spec_provider), \
            mla_moe.host_placement(torch.get_default_device()):
        model = gpt_model.GPTModel(
            config=config, transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(text.vocab_size, divisible_by, tp),
            max_sequence_length=text.max_position_embeddings,
            pre_process=runtime.is_first_stage(), post_process=runtime.is_last_stage(),
            parallel_output=parallel_output, share_embeddings_and_output_weights=tied_embeddings(cfg),
            position_embedding_type="rope", rotary_base=rope_theta(text), rotary_percent=rotary_fraction(text),
            scatter_embedding_sequence_parallel=False)
    return model.eval()


WHY_NO_WHOLE = ("megatron-core and Megatron-LM main have no GLM-4.5V class (no GLM vision tower, no "
                "M-RoPE model), so only the language model has one: stock GPTModel, which trains it alone")

LANGUAGE_MODEL = dataclasses.replace(
    llava.LANGUAGE_MODEL, build=build_language_model, why_part=WHY_NO_WHOLE, unwritten_extra_state=(),
    note=f"the GLM-4.5 MoE language model part (language_model.*) on text-only ids, stock GPTModel on mcore's "
         f"TE block spec (q/k/v biases, partial RoPE, sigmoid group-limited router with expert bias, shared "
         f"and grouped-GEMM experts; M-RoPE on text is plain RoPE); {llava.PADDED_LOSS_NOTE}")
MEGATRON = {"GPTModel": LANGUAGE_MODEL}
