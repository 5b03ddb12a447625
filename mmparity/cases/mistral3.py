"""Whole Mistral3 (``Mistral3ForConditionalGeneration``): the LLaVA composition with the Pixtral
tower carrying Mistral3's 2x2 merger, the projector, a Mistral decoder, and the Pixtral
processor's row layout of image tokens."""

from __future__ import annotations

from transformers import Mistral3Config, MistralConfig

from mmparity.cases import llava
from mmparity.cases.core import FamilyHooks, Published, TowerLookup
from mmparity.hfconfig import tower_depth
from mmparity.native import pixtral_large
from mmparity.reference import mistral3 as reference


def build_tower(cfg, vision_config, params_dtype):
    return pixtral_large.merged_tower(cfg, params_dtype, num_layers=tower_depth(cfg))


def random_config(pick) -> Mistral3Config:
    """Mistral3 configs on the tiny Pixtral tower: tower depth, GQA, head_dim, a vocabulary that
    needs padding or not, projector bias, tied or untied head."""
    base = reference.tiny_config()
    vision = base.vision_config
    vision.num_hidden_layers = pick(range(1, 4))
    groups = pick([1, 2])
    heads = groups * pick([1, 2, 3])
    vocab = pick([40, 97, 128, 200])
    tied = pick([False, True])
    text = MistralConfig(vocab_size=vocab, hidden_size=heads * 4 * pick([1, 2, 3]),
                         intermediate_size=2 * pick(range(1, 13)), num_hidden_layers=pick([1, 2]),
                         num_attention_heads=heads, num_key_value_heads=groups, head_dim=pick([4, 6]),
                         rms_norm_eps=pick([1e-5, 1e-3]), sliding_window=None, tie_word_embeddings=tied)
    return Mistral3Config(vision_config=vision, text_config=text, image_token_index=pick(range(vocab - 3)),
                          spatial_merge_size=2, projector_hidden_act="gelu", vision_feature_layer=-1,
                          multimodal_projector_bias=pick([False, True]), tie_word_embeddings=tied)


# Mistral-Small-3.1-24B-Instruct-2503's config (recalled from its release; the bench cannot reach
# the hub to read it).
PUBLISHED = Published(
    source="Mistral-Small-3.1-24B (Pixtral 24 x 1024 tower, patch 14, 2x2 merger; Mistral decoder "
           "40 x 5120, GQA 32/8, head 128, vocabulary 131072)",
    vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14,
                num_channels=3, hidden_act="silu"),
    parent={"text_config.hidden_size": 5120, "text_config.intermediate_size": 32768,
            "text_config.num_hidden_layers": 40, "text_config.num_attention_heads": 32,
            "text_config.num_key_value_heads": 8, "text_config.head_dim": 128,
            "text_config.vocab_size": 131072, "text_config.rms_norm_eps": 1e-5,
            "text_config.rope_parameters": {"rope_type": "default", "rope_theta": 1e9},
            "text_config.max_position_embeddings": 131072, "multimodal_projector_bias": False},
    images=2, image_size=(896, 896),
    note="whole forward, language model included")


def hooks(towers: TowerLookup, languages) -> FamilyHooks:
    return llava.hooks(towers, languages, llava.Composition(llava.ROWS, build_tower=build_tower,
                                                 random_config=random_config, published=PUBLISHED),
                       reference)
