"""Whole Mistral3 (``Mistral3ForConditionalGeneration``): the LLaVA composition with the Pixtral
tower carrying Mistral3's 2x2 merger, the projector, a Mistral decoder, and the Pixtral
processor's row layout of image tokens."""

from __future__ import annotations

from transformers import Mistral3Config, MistralConfig

from mmparity.cases import llava
from mmparity.cases.core import FamilyHooks, TowerLookup
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


def hooks(towers: TowerLookup) -> FamilyHooks:
    return llava.hooks(towers, llava.Composition(llava.ROWS, build_tower=build_tower,
                                                 random_config=random_config), reference)
