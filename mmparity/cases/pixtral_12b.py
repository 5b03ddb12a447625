"""Pixtral-12B (``LlavaForConditionalGeneration``, Pixtral tower, Mistral decoder): the LLaVA
composition fed the Pixtral processor's row layout of image tokens."""

from __future__ import annotations

from transformers import LlavaConfig, MistralConfig

from mmparity.cases import llava
from mmparity.cases.core import FamilyHooks, TowerLookup
from mmparity.reference import pixtral_12b as reference


def random_config(pick) -> LlavaConfig:
    """Pixtral-12B-shaped configs: tower depth, GQA, head_dim, vocabulary, projector bias, tied head."""
    base = reference.tiny_config()
    vision = base.vision_config
    vision.num_hidden_layers = pick(range(1, 4))
    groups = pick([1, 2])
    heads = groups * pick([1, 2, 3])
    vocab = pick([40, 131, 256])
    tied = pick([False, True])
    text = MistralConfig(vocab_size=vocab, hidden_size=heads * 4 * pick([1, 2, 3]),
                         intermediate_size=2 * pick(range(1, 13)), num_hidden_layers=pick([1, 2]),
                         num_attention_heads=heads, num_key_value_heads=groups, head_dim=pick([4, 6]),
                         sliding_window=None, tie_word_embeddings=tied)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=pick(range(vocab - 3)),
                       vision_feature_layer=-1, vision_feature_select_strategy="full",
                       multimodal_projector_bias=pick([False, True]), tie_word_embeddings=tied)


def hooks(towers: TowerLookup) -> FamilyHooks:
    return llava.hooks(towers, llava.Composition(llava.ROWS, random_config=random_config), reference)
