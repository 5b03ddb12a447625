"""Reference side of whole Mistral3 (Mistral-Small-3.1 / Pixtral-Large style): transformers'
``Mistral3ForConditionalGeneration``, Pixtral tower + 2x2 merger + projector + Mistral decoder.

Cases are the LLaVA composition's (:mod:`mmparity.models.llava.reference` states the compared outputs);
the ids come from HF's Pixtral processor, so images are laid out as rows of ``[IMG]`` tokens closed
by ``[IMG_BREAK]``, the last by ``[IMG_END]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from mmparity.models.llava.reference import fill_tied_head, tiny_pixtral, tiny_text, whole_model_shapes
from mmparity.models.pixtral_large.reference import projector_shapes

if TYPE_CHECKING:
    from transformers import Mistral3Config, MistralConfig, Mistral3ForConditionalGeneration

MODEL_TYPES = ("mistral3",)


def tiny_config() -> Mistral3Config:
    """Pixtral tower (3 layers), Mistral decoder with GQA (8 heads in 4 groups, so TP 4 divides
    both) and a head_dim that is not hidden/heads,
    a vocabulary that needs padding (97 -> 128), a text epsilon far from the tower's (the merger
    norm must take the text one), projector biases, untied head, a non-default RoPE base."""
    from transformers import Mistral3Config, MistralConfig

    vision = tiny_pixtral(hidden=48, ffn=44, layers=3, image_size=96)
    text = tiny_text(MistralConfig, vocab=97, hidden=40, ffn=52, heads=8, groups=4, head_dim=12, eps=1e-3,
                     theta=7000.0, sliding_window=None)
    return Mistral3Config(vision_config=vision, text_config=text, image_token_index=10,
                          spatial_merge_size=2, projector_hidden_act="gelu",
                          multimodal_projector_bias=True, vision_feature_layer=-1,
                          tie_word_embeddings=False)


def vision_config(cfg):
    """The family config: a whole ``Mistral3Config``."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a Mistral3 model")


def build(cfg) -> Mistral3ForConditionalGeneration:
    from transformers import Mistral3ForConditionalGeneration

    return fill_tied_head(Mistral3ForConditionalGeneration(cfg).eval(), cfg)


def state_shapes(cfg, tower_shapes: Callable, decoder_shapes: Callable) -> dict[str, tuple]:
    """The shapes of :func:`build`'s state dict: LLaVA's, with Mistral3's projector (pre-merge
    norm and patch merger)."""
    cfg = vision_config(cfg)
    return whole_model_shapes(cfg, tower_shapes, projector_shapes(cfg), decoder_shapes)
