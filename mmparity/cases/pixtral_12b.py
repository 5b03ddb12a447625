"""Pixtral-12B (``LlavaForConditionalGeneration``, Pixtral tower, Mistral decoder): the LLaVA
composition fed the Pixtral processor's row layout of image tokens."""

from __future__ import annotations

from transformers import LlavaConfig, MistralConfig

from mmparity.cases import llava
from mmparity.cases.core import FamilyHooks, Published, TowerLookup
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


# Pixtral-12B-2409's config as transformers lays it out (recalled from its release; the bench
# cannot reach the hub to read it).
PUBLISHED = Published(
    source="Pixtral-12B (Pixtral 24 x 1024 tower, patch 16; Mistral-NeMo decoder 40 x 5120, GQA "
           "32/8, head 128, vocabulary 131072)",
    vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                num_attention_heads=16, head_dim=64, image_size=1024, patch_size=16,
                num_channels=3, hidden_act="silu"),
    parent={"text_config.hidden_size": 5120, "text_config.intermediate_size": 14336,
            "text_config.num_hidden_layers": 40, "text_config.num_attention_heads": 32,
            "text_config.num_key_value_heads": 8, "text_config.head_dim": 128,
            "text_config.vocab_size": 131072, "text_config.rms_norm_eps": 1e-5,
            "text_config.rope_parameters": {"rope_type": "default", "rope_theta": 1e9},
            "text_config.max_position_embeddings": 1024000, "multimodal_projector_bias": True},
    images=2, image_size=(1024, 1024),
    note="whole forward, language model included")


def hooks(towers: TowerLookup, languages) -> FamilyHooks:
    return llava.hooks(towers, languages, llava.Composition(llava.ROWS, random_config=random_config,
                                                 published=PUBLISHED), reference)
