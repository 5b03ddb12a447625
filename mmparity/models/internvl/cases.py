"""Whole InternVL (``InternVLForConditionalGeneration``): the LLaVA composition with the InternViT
tower, pixel shuffle and InternVL's normed projector (both read off the config's
``downsample_ratio`` by the shared LLaVA machinery), a dense decoder, and each image's run of
image tokens between ``<img>`` and ``</img>``."""

from __future__ import annotations

from transformers import InternVLConfig, Qwen2Config

from mmparity.config import image_token_id
from mmparity.models.internvit import cases as internvit
from mmparity.models.internvl import megatron as internvl_megatron
from mmparity.models.internvl import reference
from mmparity.models.llava import cases as llava
from mmparity.models.spec import FamilyHooks, Published, TowerLookup


def image_wrap(cfg) -> tuple[int, int]:
    """The ids of ``<img>`` and ``</img>``: InternVL's tokenizers put them just below the image
    token (InternVL3: 151665, 151666, then ``<IMG_CONTEXT>`` 151667); the config does not name
    them."""
    image = image_token_id(cfg)
    if image < 2:
        raise ValueError(f"image_token_id {image}: <img> and </img> are taken to be the two ids below it")
    return image - 2, image - 1


def random_config(pick) -> InternVLConfig:
    """InternVL configs on a random InternViT tower whose tiles shuffle (an even patch grid), the
    decoder of :func:`llava.random_text` (Qwen2), feature layer last or not."""
    vision = internvit.random_config(pick)
    patch = vision.patch_size[0]
    vision.image_size = (2 * patch * pick([1, 2]),) * 2
    text, vocab, tied = llava.random_text(pick, Qwen2Config, [40, 97, 128, 200])
    layer = pick([-1, -vision.num_hidden_layers]) if vision.num_hidden_layers > 1 else -1
    grid = vision.image_size[0] // patch
    return InternVLConfig(vision_config=vision, text_config=text, image_token_id=pick(range(2, vocab)),
                          image_seq_length=(grid // 2) ** 2, downsample_ratio=0.5,
                          projector_hidden_act="gelu", vision_feature_layer=layer,
                          vision_feature_select_strategy="default", tie_word_embeddings=tied)


# InternVL3-1B-hf's config (recalled from its release; the bench cannot reach the hub to read it).
PUBLISHED = Published(
    source="InternVL3-1B (InternViT-300M 24 x 1024 tower, 448 tiles, pixel shuffle; Qwen2.5 decoder "
           "24 x 896, GQA 14/2, vocabulary 151674)",
    vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                image_size=448, patch_size=14, num_channels=3, hidden_act="gelu", norm_type="layer_norm",
                attention_bias=True, use_qk_norm=False, layer_norm_eps=1e-6, use_mean_pooling=True),
    parent={"text_config.hidden_size": 896, "text_config.intermediate_size": 4864,
            "text_config.num_hidden_layers": 24, "text_config.layer_types": ["full_attention"] * 24,
            "text_config.num_attention_heads": 14, "text_config.num_key_value_heads": 2,
            "text_config.head_dim": 64, "text_config.vocab_size": 151674, "text_config.rms_norm_eps": 1e-6,
            "text_config.rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "text_config.max_position_embeddings": 32768, "image_token_id": 151667, "image_seq_length": 256},
    images=2, image_size=(448, 448), note="whole forward, language model included")


# What Megatron's default class has no place for: nothing on the tiny config (its tower has no
# final norm, use_mean_pooling); tests/models/test_upstream.py holds the converter to it.
SIDE_TENSORS = frozenset()


def hooks(towers: TowerLookup, languages) -> FamilyHooks:
    return llava.hooks(towers, languages, llava.Composition(random_config=random_config, published=PUBLISHED,
                                                            megatron=internvl_megatron.MEGATRON, image_wrap=image_wrap),
                       reference)
