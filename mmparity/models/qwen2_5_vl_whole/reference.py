"""Reference side of Qwen2.5-VL whole: transformers' ``Qwen2_5_VLForConditionalGeneration``, and
its state-dict shapes read off the config (the ``qwen2_5_vl`` tower's, then the Qwen2 decoder's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.config import tied_embeddings
from mmparity.models.parts.dense_decoder.reference import decoder_shapes
from mmparity.models.qwen2_5_vl import reference as tower
from mmparity.models.qwen2_5_vl_whole.config import Qwen2Text

if TYPE_CHECKING:
    from transformers import Qwen2_5_VLConfig

MODEL_TYPES = ("qwen2_5_vl",)
def tiny_text(**overrides) -> dict:
    """Awkward tiny Qwen2 sizes: hidden 40 with 4 heads of 10 (no explicit head_dim in Qwen2), 2
    key/value groups, FFN 36, 3 layers, and an M-RoPE split [1, 2, 2] of the 5 frequencies, t h w
    in contiguous sections (unequal, so a swap of two sections shows)."""
    text = {"hidden_size": 40, "intermediate_size": 36, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 256,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [1, 2, 2]},
            "bos_token_id": None, "eos_token_id": None}
    text |= overrides
    # Qwen2's sliding-window layer bound (unused: no sliding window), kept within the model.
    text.setdefault("max_window_layers", text["num_hidden_layers"])
    return text


def tiny_config(**text_overrides) -> Qwen2_5_VLConfig:
    from transformers import Qwen2_5_VLConfig

    text = tiny_text(**text_overrides)
    vision = tower.tiny_config().to_dict() | {"out_hidden_size": text["hidden_size"]}
    return Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=95, video_token_id=96,
                            vision_start_token_id=93, vision_end_token_id=94, tie_word_embeddings=False)


def vision_config(cfg):
    """The family config: a whole Qwen2.5-VL config."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES and getattr(cfg, "text_config", None) is not None:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a whole Qwen2.5-VL model")


def build(cfg):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration(cfg).float().eval()


def state_shapes(cfg) -> dict[str, tuple]:
    text = cfg.text_config
    out = {f"model.visual.{k}": s for k, s in tower.state_shapes(cfg.vision_config).items()}
    out.update({f"model.language_model.{k}": s for k, s in decoder_shapes(Qwen2Text(text)).items()})
    if not tied_embeddings(cfg):
        out["lm_head.weight"] = (text.vocab_size, text.hidden_size)
    return out
