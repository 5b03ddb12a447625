"""Reference side: transformers' ``LlavaForConditionalGeneration`` (LLaVA's reference module) on
a tiny CLIP tower and the ``toy_moe`` decoder."""

from __future__ import annotations

from mmparity.models.clip import reference as clip
from mmparity.models.llava.reference import build, state_shapes, vision_config  # noqa: F401  (the same HF class)
from tests.models.throwaway.toy_moe.reference import tiny_text


def tiny_config():
    from transformers import LlavaConfig

    return LlavaConfig(vision_config=clip.tiny_config(), text_config=tiny_text(), image_token_index=9,
                       projector_hidden_act="gelu", vision_feature_layer=-1,
                       vision_feature_select_strategy="default", multimodal_projector_bias=True,
                       tie_word_embeddings=False)
