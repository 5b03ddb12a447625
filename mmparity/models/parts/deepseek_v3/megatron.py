"""Megatron's own class the DeepSeek-V3 part's converted weights load into: stock ``GPTModel`` as
Megatron-LM's DeepSeek-V3 / Kimi-K2 recipes build it, configured by the part's one recipe
(:func:`mmparity.models.parts.deepseek_v3.config.transformer_config`)."""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.gpt import gpt_model

from mmparity.config import padded_vocab_size, tied_embeddings
from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.models.core import te_stand_ins
from mmparity.models.core.te_stand_ins import buildable_without_te
from mmparity.models.parts.deepseek_v3.config import transformer_config
from mmparity.parallel import runtime


def build_moe_language_model(cfg, params_dtype=torch.float32, divisible_by: int = VOCAB_MULTIPLE,
                             parallel_output: bool = True):
    """A whole VLM's DeepSeek-V3 language model (Kimi-K2.5's) alone: stock ``GPTModel`` as
    Megatron-LM's DeepSeek-V3 / Kimi-K2 recipes build it (``--multi-latent-attention
    --qk-layernorm --num-experts --moe-layer-freq --moe-grouped-gemm``, TE): the block spec from
    mcore's own ``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``
    (:func:`te_stand_ins.gpt_decoder_block_spec`), the config mmparity's native DeepSeek-V3 build
    reads off the HF text config (:func:`~mmparity.models.parts.deepseek_v3.config.transformer_config`:
    MLA, YaRN, the sigmoid router with expert bias and group-limited top-k, ``moe_layer_freq``, at
    the current TP / PP / EP) with the experts as grouped GEMMs; this pipeline stage of it."""
    from megatron.core.transformer import multi_latent_attention

    from mmparity.models.core import mla_moe  # its import also corrects mcore 0.16's TE guards

    text = cfg.text_config
    layout = runtime.current_layout()
    tp = layout.tp if layout is not None else 1
    config = dataclasses.replace(transformer_config(text, params_dtype), moe_grouped_gemm=True)
    from megatron.core.extensions import transformer_engine_spec_provider

    with buildable_without_te(gpt_model, multi_latent_attention, transformer_engine_spec_provider), \
            mla_moe.host_placement(torch.get_default_device()):
        model = gpt_model.GPTModel(
            config=config, transformer_layer_spec=te_stand_ins.gpt_decoder_block_spec(config),
            vocab_size=padded_vocab_size(text.vocab_size, divisible_by, tp),
            max_sequence_length=text.max_position_embeddings,
            pre_process=runtime.is_first_stage(), post_process=runtime.is_last_stage(),
            parallel_output=parallel_output, share_embeddings_and_output_weights=tied_embeddings(cfg),
            position_embedding_type="rope", scatter_embedding_sequence_parallel=False)
    return model.eval()
