"""Megatron's own class for Qwen3-VL-MoE's language model trained alone: stock megatron-core
``GPTModel`` as Megatron-LM's ``pretrain_gpt.py`` builds a Qwen3-MoE decoder (``--qk-layernorm
--num-experts --moe-router-topk --moe-grouped-gemm``, softmax router, no shared expert, TE block
spec), from this family's one text config -> ``TransformerConfig`` recipe.

On text the three M-RoPE position axes are equal, so interleaved M-RoPE is plain rotate-half RoPE
and the stock class computes HF's text model."""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.gpt import gpt_model

from mmparity.config import padded_vocab_size, rope_theta, tied_embeddings
from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.models.core import mla_moe, te_stand_ins
from mmparity.models.core.te_stand_ins import buildable_without_te
from mmparity.models.llava import megatron as llava
from mmparity.models.qwen3_vl_moe.native import transformer_config
from mmparity.parallel import runtime


def build_language_model(cfg, params_dtype=torch.float32, divisible_by: int = VOCAB_MULTIPLE,
                         parallel_output: bool = True):
    """The Qwen3-MoE decoder of a whole Qwen3-VL-MoE alone (:func:`build_te_moe_gpt_model`); this
    pipeline stage of it."""
    return build_te_moe_gpt_model(cfg, transformer_config(cfg.text_config, params_dtype), divisible_by=divisible_by,
                                  parallel_output=parallel_output)


def build_te_moe_gpt_model(cfg, config, *, divisible_by: int = VOCAB_MULTIPLE, parallel_output: bool = True,
                           **options):
    """Stock ``GPTModel`` for ``config`` (a whole VLM's text model's) on mcore's own
    ``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``: dense layers where the
    config has no MoE, ``MoELayer`` with ``TEGroupedMLP`` experts elsewhere, the experts as grouped
    GEMMs; this pipeline stage of it. ``options``: GPTModel's rotary arguments beyond the base."""
    from megatron.core.extensions import transformer_engine_spec_provider

    text = cfg.text_config
    layout = runtime.current_layout()
    tp = layout.tp if layout is not None else 1
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
            position_embedding_type="rope", rotary_base=rope_theta(text),
            scatter_embedding_sequence_parallel=False, **options)
    return model.eval()


WHY_NO_WHOLE = ("megatron-core and Megatron-LM main have no Qwen3-VL class (no DeepStack, no interleaved "
                "M-RoPE; Megatron-Bridge has one, outside this project's scope), so only the language model "
                "has one: stock GPTModel, which trains it alone")

LANGUAGE_MODEL = dataclasses.replace(
    llava.LANGUAGE_MODEL, build=build_language_model, why_part=WHY_NO_WHOLE, unwritten_extra_state=(),
    note=f"the Qwen3-MoE language model part (language_model.*) on text-only ids, stock GPTModel on mcore's "
         f"TE block spec (qk_layernorm, softmax top-k router, grouped-GEMM experts; M-RoPE on text is plain "
         f"RoPE); {llava.PADDED_LOSS_NOTE}")
MEGATRON = {"GPTModel": LANGUAGE_MODEL}
