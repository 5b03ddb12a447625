"""Reference side of whole InternVL: transformers' ``InternVLForConditionalGeneration``, the
InternViT tower, pixel shuffle, the projector (LayerNorm over the shuffled vector, two linears)
and a Qwen2 (or Llama) decoder.

Cases are the LLaVA composition's (:mod:`mmparity.models.llava.reference` states the compared
outputs): every image is a few tiles of the configured size, and its run of image tokens
(``image_seq_length`` per tile) sits between the ``<img>`` and ``</img>`` text tokens, as
InternVL's processor writes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from mmparity.models.llava.reference import fill_tied_head, tiny_text, whole_model_shapes

if TYPE_CHECKING:
    from transformers import InternVLConfig, InternVLForConditionalGeneration

MODEL_TYPES = ("internvl",)
# Of LLaVA's HF layouts, those InternVL has: module names and what transformers 5 saves (its
# tower was never nested deeper, and Mistral never released it in its own layout).
HF_LAYOUTS = ("hf", "hf_checkpoint")


def tiny_config() -> InternVLConfig:
    """InternVL3's tower kind (LayerNorm, q/k/v biases, no final norm) on 4x4-patch tiles (four
    image tokens each after the shuffle); a Qwen2 decoder with GQA (4 heads in 2 groups, so TP 2
    divides both), a head width that is not hidden/heads, a vocabulary that needs padding (97 ->
    128), an untied head (check --pp runs a tied one too), a non-default RoPE base; layer scales
    away from 1."""
    from transformers import InternVLConfig, InternVLVisionConfig, Qwen2Config

    vision = InternVLVisionConfig(hidden_size=48, intermediate_size=52, num_hidden_layers=2,
                                  num_attention_heads=4, image_size=32, patch_size=8, num_channels=3,
                                  hidden_act="gelu", norm_type="layer_norm", attention_bias=True,
                                  use_qk_norm=False, layer_norm_eps=1e-6, layer_scale_init_value=0.5,
                                  use_mean_pooling=True)
    text = tiny_text(Qwen2Config, vocab=97, hidden=40, ffn=52, heads=4, groups=2, head_dim=12, eps=1e-6,
                     theta=3000.0, positions=256)
    return InternVLConfig(vision_config=vision, text_config=text, image_token_id=9, image_seq_length=4,
                          downsample_ratio=0.5, projector_hidden_act="gelu", vision_feature_layer=-1,
                          vision_feature_select_strategy="default", tie_word_embeddings=False)


def vision_config(cfg):
    """The family config: a whole ``InternVLConfig``."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not an InternVL model")


def build(cfg) -> InternVLForConditionalGeneration:
    from transformers import InternVLForConditionalGeneration

    return fill_tied_head(InternVLForConditionalGeneration(cfg).eval(), cfg)


def projector_shapes(cfg) -> dict[str, tuple]:
    """``InternVLMultiModalProjector``: a LayerNorm over the shuffled vector, two biased linears."""
    shuffled = cfg.vision_config.hidden_size * round(1 / cfg.downsample_ratio) ** 2
    text = cfg.text_config.hidden_size
    return {"layer_norm.weight": (shuffled,), "layer_norm.bias": (shuffled,),
            "linear_1.weight": (text, shuffled), "linear_1.bias": (text,),
            "linear_2.weight": (text, text), "linear_2.bias": (text,)}


def state_shapes(cfg, tower_shapes: Callable, decoder_shapes: Callable) -> dict[str, tuple]:
    cfg = vision_config(cfg)
    return whole_model_shapes(cfg, tower_shapes, projector_shapes(cfg), decoder_shapes)
