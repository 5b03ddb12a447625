"""Reference side of Qwen3-VL whole: transformers' ``Qwen3VLForConditionalGeneration``, and its
state-dict shapes read off the config (the ``qwen3_vl`` tower's, then the decoder's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.config import head_dim, tied_embeddings
from mmparity.models.qwen3_vl import reference as tower

if TYPE_CHECKING:
    from transformers import Qwen3VLConfig

MODEL_TYPES = ("qwen3_vl",)


def tiny_text(**overrides) -> dict:
    """Awkward tiny Qwen3 sizes: hidden 40 with 4 heads of 12 (so heads·head_dim is not the
    width), 2 key/value groups, FFN 36, 3 layers of which the first two take DeepStack features,
    and an M-RoPE split [2, 2, 2] of the 6 frequencies, interleaved t h w t h w."""
    text = {"hidden_size": 40, "intermediate_size": 36, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 12, "vocab_size": 97, "max_position_embeddings": 256,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 2, 2],
                                "mrope_interleaved": True}}
    return text | overrides


def tiny_config(**text_overrides) -> Qwen3VLConfig:
    from transformers import Qwen3VLConfig

    text = tiny_text(**text_overrides)
    vision = tower.tiny_config().to_dict() | {"out_hidden_size": text["hidden_size"]}
    return Qwen3VLConfig(vision_config=vision, text_config=text, image_token_id=95, video_token_id=96,
                         vision_start_token_id=93, vision_end_token_id=94, tie_word_embeddings=False)


def vision_config(cfg):
    """The family config: a whole Qwen3-VL config."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES and getattr(cfg, "text_config", None) is not None:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a whole Qwen3-VL model")


def build(cfg):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration(cfg).float().eval()


def state_shapes(cfg) -> dict[str, tuple]:
    text = cfg.text_config
    h, f, d = text.hidden_size, text.intermediate_size, head_dim(text)
    q, kv = text.num_attention_heads * d, text.num_key_value_heads * d
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
             "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    out = {f"model.visual.{k}": s for k, s in tower.state_shapes(cfg.vision_config).items()}
    out["model.language_model.embed_tokens.weight"] = (text.vocab_size, h)
    out.update({f"model.language_model.layers.{i}.{k}": s
                for i in range(text.num_hidden_layers) for k, s in layer.items()})
    out["model.language_model.norm.weight"] = (h,)
    if not tied_embeddings(cfg):
        out["lm_head.weight"] = (text.vocab_size, h)
    return out
