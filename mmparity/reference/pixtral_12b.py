"""Reference side of Pixtral-12B: transformers' ``LlavaForConditionalGeneration`` with a Pixtral
tower and a Mistral decoder, fed the ids HF's Pixtral processor lays out (rows of ``[IMG]``,
``[IMG_BREAK]`` between rows, ``[IMG_END]`` last). Outputs as :mod:`mmparity.reference.llava`.
"""

from __future__ import annotations

from transformers import LlavaConfig, MistralConfig, PixtralVisionConfig

from mmparity.reference.llava import build, state_shapes, vision_config  # noqa: F401  (the same HF class)

MODEL_TYPES = ("llava",)


def tiny_config() -> LlavaConfig:
    """Pixtral tower (2 layers, features from the last, as Pixtral-12B), Mistral decoder with GQA
    (8 heads in 4 groups; TP 4 divides every split size),
    an explicit head_dim, a vocabulary that needs padding (131 -> 256), no projector bias, untied
    embeddings as released."""
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=36, num_hidden_layers=2,
                                 num_attention_heads=4, image_size=64, patch_size=8,
                                 hidden_act="silu", num_channels=3, head_dim=8)
    text = MistralConfig(vocab_size=131, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                         rms_norm_eps=1e-5, max_position_embeddings=512, sliding_window=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         tie_word_embeddings=False)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=10,
                       projector_hidden_act="gelu", vision_feature_layer=-1,
                       vision_feature_select_strategy="full", multimodal_projector_bias=False,
                       tie_word_embeddings=False)
