"""Pixtral-12B (``LlavaForConditionalGeneration``, Pixtral tower, Mistral decoder): the LLaVA
composition fed the Pixtral processor's row layout of image tokens."""

from __future__ import annotations

from transformers import LlavaConfig, MistralConfig

from mmparity.models.llava import cases as llava
from mmparity.models.llava import megatron as llava_megatron
from mmparity.models.spec import FamilyHooks, TowerLookup
from mmparity.models.pixtral_12b import reference


def random_config(pick) -> LlavaConfig:
    """Pixtral-12B-shaped configs: tower depth, the decoder of :func:`llava.random_text`,
    projector bias."""
    vision = reference.tiny_config().vision_config
    vision.num_hidden_layers = pick(range(1, 4))
    text, vocab, tied = llava.random_text(pick, MistralConfig, [40, 131, 256], sliding_window=None)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=pick(range(vocab - 3)),
                       vision_feature_layer=-1, vision_feature_select_strategy="full",
                       multimodal_projector_bias=pick([False, True]), tie_word_embeddings=tied)


# Pixtral-12B-2409's config as transformers lays it out (recalled from its release; the bench
# cannot reach the hub to read it).
PUBLISHED = llava.published_pixtral_mistral(
    "Pixtral-12B (Pixtral 24 x 1024 tower, patch 16; Mistral-NeMo decoder 40 x 5120, GQA 32/8, "
    "head 128, vocabulary 131072)",
    patch=16, image_size=1024, ffn=14336, positions=1024000, projector_bias=True, batch=(2, (1024, 1024)))


# LLaVAModel cannot hold it (a vit_model tower): the language model, the vision part (Pixtral
# ViTModel) and the projector, each alone.
MEGATRON = llava_megatron.whole_vlm_parts(llava_megatron.pixtral_vision_part())


def hooks(towers: TowerLookup, languages) -> FamilyHooks:
    return llava.hooks(towers, languages, llava.Composition(llava.ROWS, random_config=random_config,
                                                 published=PUBLISHED, megatron=MEGATRON), reference)
