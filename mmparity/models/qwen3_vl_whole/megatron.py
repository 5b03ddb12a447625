"""Megatron's own class for Qwen3-VL's language model trained alone: stock megatron-core
``GPTModel``, as Megatron-LM's ``pretrain_gpt.py`` builds a Qwen3 decoder (``--qk-layernorm``,
RoPE with the text config's base, TE layer spec).

On text the three M-RoPE position axes are equal, so interleaved M-RoPE is plain rotate-half RoPE
and the stock class computes HF's text model; the DeepStack features only touch image tokens, which
a language model trained alone never sees."""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.gpt import gpt_layer_specs, gpt_model

from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.models.core import te_stand_ins
from mmparity.models.core.te_stand_ins import buildable_without_te
from mmparity.models.llava import megatron as llava
from mmparity.models.parts.dense_decoder.megatron import language_model_args
from mmparity.parallel import runtime


def qk_norm_layer_spec():
    """Megatron-LM's dense GPT layer spec with TE and ``qk_layernorm``: ``TENorm`` on q and k.
    Without TE megatron-core cannot assemble it (its TE-version test for the q/k norm fails), so
    the stand-in dense spec gets the ``TENorm`` stand-in in those two places, as TE >= 1.9 has."""
    if te_stand_ins.HAVE_TE:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    spec = te_stand_ins.gpt_layer_spec()
    attention = spec.submodules.self_attention
    norm = te_stand_ins.te_class("TENorm")
    normed = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, q_layernorm=norm, k_layernorm=norm))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=normed))


def build_language_model(cfg, params_dtype=torch.float32, divisible_by: int = VOCAB_MULTIPLE,
                         parallel_output: bool = True):
    """The Qwen3 decoder of a whole Qwen3-VL alone: the dense decoder's recipe (no biases, GQA,
    explicit head width) with a per-head RMSNorm on q and k (``qk_layernorm``), on Megatron's own
    TE layer spec for it; this pipeline stage of it."""
    language = language_model_args(cfg, params_dtype, divisible_by)
    config = dataclasses.replace(language.config, qk_layernorm=True)
    spec = qk_norm_layer_spec()
    with buildable_without_te(gpt_model):
        model = gpt_model.GPTModel(
            config=config, transformer_layer_spec=spec,
            vocab_size=language.vocab_size, max_sequence_length=language.max_sequence_length,
            pre_process=runtime.is_first_stage(), post_process=runtime.is_last_stage(),
            parallel_output=parallel_output, share_embeddings_and_output_weights=language.tied,
            position_embedding_type="rope", rotary_base=language.rotary_base,
            scatter_embedding_sequence_parallel=False)
    return model.eval()


WHY_NO_WHOLE = ("megatron-core and Megatron-LM main have no Qwen3-VL class (no DeepStack, no interleaved "
                "M-RoPE; Megatron-Bridge has one, outside this project's scope), so only the language model "
                "has one: stock GPTModel, which trains it alone")

LANGUAGE_MODEL = dataclasses.replace(
    llava.LANGUAGE_MODEL, build=build_language_model, why_part=WHY_NO_WHOLE,
    note=f"the Qwen3 language model part (language_model.*) on text-only ids, stock GPTModel with "
         f"qk_layernorm (M-RoPE on text is plain RoPE); {llava.PADDED_LOSS_NOTE}")
MEGATRON = {"GPTModel": LANGUAGE_MODEL}
