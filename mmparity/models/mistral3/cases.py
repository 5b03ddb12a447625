"""Whole Mistral3 (``Mistral3ForConditionalGeneration``): the LLaVA composition with the Pixtral
tower carrying Mistral3's 2x2 merger, the projector, a Mistral decoder, and the Pixtral
processor's row layout of image tokens."""

from __future__ import annotations

from transformers import Mistral3Config, MistralConfig

from mmparity.models.llava import cases as llava
from mmparity.models.llava import megatron as llava_megatron
from mmparity.models.spec import FamilyHooks, TowerLookup
from mmparity.config import tower_depth
from mmparity.models.pixtral_large import native as pixtral_large
from mmparity.models.mistral3 import reference


def build_tower(cfg, vision_config, params_dtype):
    return pixtral_large.merged_tower(cfg, params_dtype, num_layers=tower_depth(cfg))


def random_config(pick) -> Mistral3Config:
    """Mistral3 configs on the tiny Pixtral tower: tower depth, the decoder of
    :func:`llava.random_text` with either epsilon, projector bias."""
    vision = reference.tiny_config().vision_config
    vision.num_hidden_layers = pick(range(1, 4))
    text, vocab, tied = llava.random_text(pick, MistralConfig, [40, 97, 128, 200],
                                          rms_norm_eps=pick([1e-5, 1e-3]), sliding_window=None)
    return Mistral3Config(vision_config=vision, text_config=text, image_token_index=pick(range(vocab - 3)),
                          spatial_merge_size=2, projector_hidden_act="gelu", vision_feature_layer=-1,
                          multimodal_projector_bias=pick([False, True]), tie_word_embeddings=tied)


# Mistral-Small-3.1-24B-Instruct-2503's config (recalled from its release; the bench cannot reach
# the hub to read it).
PUBLISHED = llava.published_pixtral_mistral(
    "Mistral-Small-3.1-24B (Pixtral 24 x 1024 tower, patch 14, 2x2 merger; Mistral decoder "
    "40 x 5120, GQA 32/8, head 128, vocabulary 131072)",
    patch=14, image_size=1540, ffn=32768, positions=131072, projector_bias=False, batch=(2, (896, 896)))


# LLaVAModel cannot hold it (a vit_model tower): the language model, the vision part (Pixtral
# ViTModel with the merger) and the projector, each alone.
MEGATRON = llava_megatron.whole_vlm_parts(llava_megatron.pixtral_vision_part(
    "Megatron's merger norm takes the vision epsilon, HF the text rms_norm_eps (discrepancy 2)"))


def hooks(towers: TowerLookup, languages) -> FamilyHooks:
    return llava.hooks(towers, languages, llava.Composition(llava.ROWS, build_tower=build_tower,
                                                 random_config=random_config, published=PUBLISHED,
                                                 megatron=MEGATRON),
                       reference)
