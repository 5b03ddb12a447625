"""Reference side of Llama 4 whole: transformers' ``Llama4ForConditionalGeneration``, run by its
parts (its own ``forward`` raises in transformers 5.24, docs/megatron.md), and its state-dict
shapes read off the config from its parts (the ``llama4_vision`` tower, the ``llama4_text``
decoder)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.models.llama4_vision import reference as tower
from mmparity.models.parts.llama4_text import reference as decoder

if TYPE_CHECKING:
    from transformers import Llama4Config

MODEL_TYPES = ("llama4",)


def tiny_text(**overrides) -> dict:
    """4 layers, the last NoPE (with attention temperature: floor_scale 4 changes the scale within
    the sequence), chunks of 8 on the RoPE layers (shorter than the rows), MoE on alternate layers
    with 4 experts top-1 and a shared expert, GQA 4 heads / 2 groups of 16, a vocabulary that
    needs padding."""
    text = {"model_type": "llama4_text", "vocab_size": 250, "hidden_size": 64, "intermediate_size": 48,
            "intermediate_size_mlp": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
            "no_rope_layers": [1, 1, 1, 0], "attention_chunk_size": 8, "floor_scale": 4, "attn_scale": 0.1,
            "max_position_embeddings": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    return text | overrides


def tiny_config(**text_overrides) -> Llama4Config:
    from transformers import Llama4Config

    vision = tower.tiny_config().to_dict()
    return Llama4Config(vision_config=vision, text_config=tiny_text(**text_overrides), image_token_index=247,
                        boi_token_index=248, eoi_token_index=249, tie_word_embeddings=False)


def vision_config(cfg):
    """The family config: a whole Llama 4 config."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES and getattr(cfg, "text_config", None) is not None:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a whole Llama 4 model")


def build(cfg):
    from transformers import Llama4ForConditionalGeneration

    return Llama4ForConditionalGeneration(cfg).float().eval()


def state_shapes(cfg) -> dict[str, tuple]:
    text, vc = cfg.text_config, cfg.vision_config
    shapes = {"vision_model." + k: s for k, s in tower.state_shapes(vc).items()}
    shapes["multi_modal_projector.linear_1.weight"] = (text.hidden_size, vc.vision_output_dim)
    shapes |= {"language_model.model." + k: s for k, s in decoder.decoder_shapes(text).items()}
    shapes["language_model.lm_head.weight"] = (text.vocab_size, text.hidden_size)
    return shapes
