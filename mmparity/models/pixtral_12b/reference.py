"""Reference side of Pixtral-12B: transformers' ``LlavaForConditionalGeneration`` with a Pixtral
tower and a Mistral decoder, fed the ids HF's Pixtral processor lays out (rows of ``[IMG]``,
``[IMG_BREAK]`` between rows, ``[IMG_END]`` last). Outputs as :mod:`mmparity.models.llava.reference`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.models.llava.reference import build, state_shapes, tiny_pixtral, tiny_text, vision_config  # noqa: F401  (the same HF class)

if TYPE_CHECKING:
    from transformers import LlavaConfig, MistralConfig

MODEL_TYPES = ("llava",)


def tiny_config() -> LlavaConfig:
    """Pixtral tower (2 layers, features from the last, as Pixtral-12B), Mistral decoder with GQA
    (8 heads in 4 groups; TP 4 divides every split size),
    an explicit head_dim, a vocabulary that needs padding (131 -> 256), no projector bias, untied
    embeddings as released."""
    from transformers import LlavaConfig, MistralConfig

    vision = tiny_pixtral(hidden=32, ffn=36, layers=2, image_size=64, head_dim=8)
    text = tiny_text(MistralConfig, vocab=131, hidden=48, ffn=40, heads=8, groups=4, head_dim=8, eps=1e-5,
                     theta=1000000.0, sliding_window=None)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=10,
                       projector_hidden_act="gelu", vision_feature_layer=-1,
                       vision_feature_select_strategy="full", multimodal_projector_bias=False,
                       tie_word_embeddings=False)
