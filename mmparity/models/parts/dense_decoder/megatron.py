"""Megatron's own class the dense decoder's converted weights load into: stock ``GPTModel``, as
Megatron-LM builds a whole VLM's language model (``LLaVAModel``'s ``language_model``, or the
language model trained alone), configured by the part's one recipe
(:func:`mmparity.models.parts.dense_decoder.config.transformer_fields`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.models.gpt import gpt_model
from megatron.core.transformer.transformer_config import TransformerConfig

from mmparity.config import padded_vocab_size, rope_theta, tied_embeddings
from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.models.core import megatron_classes as upstream
from mmparity.models.core import te_stand_ins
from mmparity.models.core.te_stand_ins import buildable_without_te
from mmparity.models.parts.dense_decoder.config import transformer_fields
from mmparity.parallel import runtime


@dataclass(frozen=True)
class LanguageModelArgs:
    """What Megatron-LM builds a dense decoder's ``GPTModel`` with, read off the HF config once:
    ``LLaVAModel`` takes them as its ``language_*`` arguments, :func:`build_language_model` hands
    them to ``GPTModel`` itself."""

    config: TransformerConfig
    vocab_size: int  # padded as Megatron-LM pads it at the current TP size
    max_sequence_length: int
    rotary_base: float
    tied: bool  # share_embeddings_and_output_weights


def language_model_args(cfg, params_dtype=torch.float32, divisible_by: int = VOCAB_MULTIPLE) -> LanguageModelArgs:
    """A whole VLM's dense decoder (its ``text_config``), the layer stack split over the pipeline
    stages; RoPE with the config's base."""
    text = cfg.text_config
    layout = runtime.current_layout()
    tp = layout.tp if layout is not None else 1
    fields = transformer_fields(text)
    fields["activation"] = upstream.activation(fields["activation"])
    config = upstream.transformer_config(pipelined=True, params_dtype=params_dtype, **fields)
    return LanguageModelArgs(config, padded_vocab_size(text.vocab_size, divisible_by, tp),
                             text.max_position_embeddings, rope_theta(text), tied_embeddings(cfg))


def build_language_model(cfg, params_dtype=torch.float32, divisible_by: int = VOCAB_MULTIPLE,
                         parallel_output: bool = True):
    """A whole VLM's language model alone: stock ``GPTModel`` exactly as ``LLaVAModel`` builds its
    ``language_model`` (the same arguments, :func:`language_model_args`), this pipeline stage of it
    (embedding on the first stage, final norm and output layer on the last)."""
    language = language_model_args(cfg, params_dtype, divisible_by)
    with buildable_without_te(gpt_model):
        model = gpt_model.GPTModel(
            config=language.config, transformer_layer_spec=te_stand_ins.gpt_layer_spec(),
            vocab_size=language.vocab_size, max_sequence_length=language.max_sequence_length,
            pre_process=runtime.is_first_stage(), post_process=runtime.is_last_stage(),
            parallel_output=parallel_output, share_embeddings_and_output_weights=language.tied,
            position_embedding_type="rope", rotary_base=language.rotary_base,
            scatter_embedding_sequence_parallel=False)
    return model.eval()
