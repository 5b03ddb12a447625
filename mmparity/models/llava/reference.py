"""Reference side of LLaVA: transformers' ``LlavaForConditionalGeneration`` on expanded ids.

A case holds one batch in both conventions. The native side reads mcore's: compact ids with one
placeholder per image (``-200``), pre-shifted labels, a loss mask. HF reads what its processor
emits: every placeholder expanded into one image token per embedding slot, labels unshifted with
-100 on image tokens. Compared outputs:

* ``logits`` at every position, over the real vocabulary;
* ``loss_mask``: mcore's expanded mask, here derived from the HF convention (a position trains
  iff it is text and the next token is text; mcore also masks the last image slot, which HF
  trains, and the final token, which has no next token inside the row);
* ``token_loss``: HF's shifted per-token cross entropy at the positions the mask keeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from mmparity.config import tied_embeddings

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlavaConfig, PixtralVisionConfig, LlavaForConditionalGeneration

MODEL_TYPES = ("llava",)
OUTPUTS = ("logits", "loss_mask", "token_loss")
IGNORE_INDEX = -100
PLACEHOLDER = -200  # mcore's DEFAULT_IMAGE_TOKEN_INDEX in compact ids


def tiny_pixtral(*, hidden: int, ffn: int, layers: int, image_size: int, **extra) -> PixtralVisionConfig:
    """A tiny Pixtral tower of 4 heads, patch 8, SwiGLU: the whole VLMs' tiny towers."""
    from transformers import PixtralVisionConfig

    return PixtralVisionConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                               num_attention_heads=4, image_size=image_size, patch_size=8,
                               hidden_act="silu", num_channels=3, **extra)


def tiny_text(config_class, *, vocab: int, hidden: int, ffn: int, heads: int, groups: int, head_dim: int,
              eps: float, theta: float, positions: int = 512, **extra):
    """A tiny two-layer dense decoder config, untied, with an explicit head width and RoPE base."""
    return config_class(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
                        num_attention_heads=heads, num_key_value_heads=groups, head_dim=head_dim,
                        rms_norm_eps=eps, max_position_embeddings=positions, hidden_act="silu",
                        rope_parameters={"rope_type": "default", "rope_theta": theta},
                        tie_word_embeddings=False, **extra)


def tiny_config() -> LlavaConfig:
    """Pixtral tower (3 layers, features from the penultimate one), Llama decoder with GQA and a
    head_dim that is not hidden/heads, a vocabulary that needs padding (101 -> 128), projector
    biases, untied embeddings, a non-default RoPE base."""
    from transformers import LlamaConfig, LlavaConfig

    vision = tiny_pixtral(hidden=48, ffn=44, layers=3, image_size=64)
    text = tiny_text(LlamaConfig, vocab=101, hidden=40, ffn=52, heads=4, groups=2, head_dim=12, eps=1e-6,
                     theta=5000.0, positions=256)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=71,
                       projector_hidden_act="gelu", vision_feature_layer=-2,
                       vision_feature_select_strategy="full", multimodal_projector_bias=True,
                       tie_word_embeddings=False)


def vision_config(cfg):
    """The family config: a ``LlavaConfig`` itself (the whole model is this family's subject)."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a LLaVA model")


def build(cfg) -> LlavaForConditionalGeneration:
    from transformers import LlavaForConditionalGeneration

    return fill_tied_head(LlavaForConditionalGeneration(cfg).eval(), cfg)


def projector_shapes(cfg) -> dict[str, tuple]:
    """``LlavaMultiModalProjector``: two linears, the first over every selected feature layer."""
    vision, text = cfg.vision_config.hidden_size, cfg.text_config.hidden_size
    layers = 1 if isinstance(cfg.vision_feature_layer, int) else len(cfg.vision_feature_layer)
    shapes = {"linear_1.weight": (text, vision * layers), "linear_2.weight": (text, text)}
    if cfg.multimodal_projector_bias:
        shapes |= {"linear_1.bias": (text,), "linear_2.bias": (text,)}
    return shapes


def whole_model_shapes(cfg, tower_shapes: Callable, projector: dict, decoder_shapes: Callable) -> dict[str, tuple]:
    """A whole VLM's state-dict shapes under ``*ForConditionalGeneration``'s module names: the
    tower (``tower_shapes(vision_config)``, its family's), the projector's, the decoder
    (``decoder_shapes(text_config)``, its part's) and the head (listed even when tied: the state
    dict names the shared table twice)."""
    text = cfg.text_config
    return {**{"model.vision_tower." + k: s for k, s in tower_shapes(cfg.vision_config).items()},
            **{"model.multi_modal_projector." + k: s for k, s in projector.items()},
            **{"model.language_model." + k: s for k, s in decoder_shapes(text).items()},
            "lm_head.weight": (text.vocab_size, text.hidden_size)}


def state_shapes(cfg, tower_shapes: Callable, decoder_shapes: Callable) -> dict[str, tuple]:
    """The shapes of :func:`build`'s state dict, read off the config; the tower's come from
    ``tower_shapes``, the shapes function of the tower's own family, the decoder's from its
    language-model part's ``decoder_shapes``."""
    cfg = vision_config(cfg)
    return whole_model_shapes(cfg, tower_shapes, projector_shapes(cfg), decoder_shapes)


def fill_tied_head(model, cfg):
    """A tied checkpoint stores the table once (save_pretrained omits ``lm_head.weight``): accept
    that in strict loads of ``model`` by reading the head from the embedding."""
    if tied_embeddings(cfg):
        def fill(state_dict, prefix, *unused):
            head, embed = prefix + "lm_head.weight", prefix + "model.language_model.embed_tokens.weight"
            if head not in state_dict and embed in state_dict:
                state_dict[head] = state_dict[embed]

        model._register_load_state_dict_pre_hook(fill)
    return model
