"""What a pipeline stage of a model with a language model holds, decided in one place.

Megatron's placement, which every whole VLM here and a language model alone follow: the first
stage holds the vision tower (never split: it is built whole, :func:`runtime.single_stage`), its
projector and the token embedding; each stage holds its slice of the decoder layers (the split
``runtime.stage_layer_counts`` names, or mcore's even one); the last stage holds the final norm
and the output layer. Tied embeddings would need the embedding on the last stage too, which
Megatron keeps in step with a gradient all-reduce a forward-only tool has no use for: refused.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, TypeVar

import torch

from mmparity.config import padded_vocab_size, tied_embeddings
from mmparity.mapping.rules import VOCAB_MULTIPLE
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
    if tied and not (first and last):
        raise ValueError("tied embeddings under pipeline parallelism are not supported")
    vision = None
    if first and tower is not None:
        with runtime.single_stage():
            vision = tower()
    vocab = padded_vocab_size(text.vocab_size, VOCAB_MULTIPLE, tp=runtime.current_layout().tp)
    language_model = language(vocab, pre_process=first, post_process=last,
                              share_embeddings_and_output_weights=tied)
    return vision, language_model


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
