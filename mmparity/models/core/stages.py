"""What a pipeline stage of a model with a language model holds, decided in one place.

Megatron's placement, which every whole VLM here and a language model alone follow: the first
stage holds the vision tower (never split: it is built whole, :func:`runtime.single_stage`), its
projector and the token embedding; each stage holds its slice of the decoder layers (the split
``runtime.stage_layer_counts`` names, or mcore's even one); the last stage holds the final norm
and the output layer. A tied head is Megatron's too: the last stage's ``GPTModel`` holds its own
copy of the embedding table as ``output_layer.weight`` (set from the first stage's when built; a
checkpoint's last stage, or check's split, hands it the same copy to load).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, TypeVar

import torch

from mmparity.config import padded_vocab_size, tied_embeddings
from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.models.core.te_stand_ins import cuda_calls_on_host
from mmparity.parallel import runtime

T = TypeVar("T")


def build_stage(cfg, text, language: Callable[..., torch.nn.Module],
                tower: Optional[Callable[[], torch.nn.Module]] = None):
    """``(tower or None, language model)`` for this pipeline stage.

    ``cfg``: the config tied embeddings are read from; ``text``: the language model's (its
    vocabulary); ``language(vocab_size, *, pre_process, post_process,
    share_embeddings_and_output_weights)`` builds the language model for the vocabulary padded to
    this TP size; ``tower()`` (with its projector) is called on the first stage only.
    """
    first, last = runtime.is_first_stage(), runtime.is_last_stage()
    tied = tied_embeddings(cfg)
    vision = None
    if first and tower is not None:
        with runtime.single_stage():
            vision = tower()
    vocab = padded_vocab_size(text.vocab_size, VOCAB_MULTIPLE, tp=runtime.current_layout().tp)
    language_model = language_stage(language, vocab, pre_process=first, post_process=last,
                                    share_embeddings_and_output_weights=tied)
    return vision, language_model


def language_stage(language: Callable[..., torch.nn.Module], vocab_size: int, **stage) -> torch.nn.Module:
    """``language(vocab_size, **stage)``, the language model of one stage. With a tied head over
    pipeline stages mcore's ``GPTModel`` sets the last stage's copy of the table from the first
    stage's as it is built: an all-reduce over the embedding group (every first and last stage
    builds at once, so the collective meets) of a tensor it first moves with ``.cuda()``. On a
    machine without CUDA that move stays on the host, where gloo reduces."""
    with cuda_calls_on_host():
        return language(vocab_size, **stage)


def stage_layers(layers: Sequence[T]) -> list[T]:
    """This stage's slice of the whole stack's per-layer ``layers`` (specs, kinds), by the split
    ``runtime.stage_layer_counts`` names; all of them where it names none."""
    layers = list(layers)
    counts = runtime.stage_layer_counts()
    if counts is None or runtime.pipeline_size() <= 1:
        return layers
    stage = runtime.pipeline_rank()
    start = sum(counts[:stage])
    return layers[start:start + counts[stage]]
