"""Reference side of Qwen3.5 whole: transformers' ``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration``, and their state-dict shapes read off the config (the
qwen3_5 tower's under ``model.visual.``, the qwen3_5_text part's under ``model.language_model.``)."""

from __future__ import annotations

from mmparity.config import tied_embeddings
from mmparity.models.parts.qwen3_5_text import reference as decoder
from mmparity.models.parts.qwen3_5_text.config import is_moe
from mmparity.models.qwen3_5 import reference as tower
from mmparity.models.qwen3_5_lm import reference as text_model

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
# Token ids at the top of the tiny vocabulary of 101.
IMAGE, VIDEO, START, END = 99, 100, 97, 98


def tiny_text(moe: bool = True, **overrides) -> dict:
    """The qwen3_5_lm family's awkward tiny decoder (2 key heads serving 4 value heads; 6 experts
    choose 2) in three layers, attention, DeltaNet, attention, with heads of 16 whose first half
    rotates: 4 frequencies, dealt t h w t by the interleaved M-RoPE split [2, 1, 1].

    Three layers, not four: under the harness's seeded weights (zero-centred norms at 1 ± 0.2,
    an effective scale of 2) each Gated DeltaNet layer amplifies the fp32 noise the tower's
    features bring in several times over, and a second one takes the logits to the 1e-5 bound
    at some seeds; the parity itself is that of each layer (tests/models/test_qwen3_5_whole.py)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    text = text_model.tiny_config(moe=moe, head_dim=16, rope_parameters=rope, num_hidden_layers=3,
                                  layer_types=["full_attention", "linear_attention", "full_attention"]).to_dict()
    for key in ("architectures", "model_type", "transformers_version", "dtype"):
        text.pop(key, None)
    return text | overrides


def tiny_config(moe: bool = True, **text_overrides):
    import transformers

    vision = tower.tiny_config().to_dict()
    vision.pop("model_type", None)
    vision["out_hidden_size"] = tiny_text(moe)["hidden_size"]
    cls, arch = ((transformers.Qwen3_5MoeConfig, "Qwen3_5MoeForConditionalGeneration") if moe
                 else (transformers.Qwen3_5Config, "Qwen3_5ForConditionalGeneration"))
    return cls(vision_config=vision, text_config=tiny_text(moe, **text_overrides), image_token_id=IMAGE,
               video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
               tie_word_embeddings=False, architectures=[arch])


def vision_config(cfg):
    """The family config: a whole Qwen3.5 / Qwen3.5-MoE config."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES and getattr(cfg, "text_config", None) is not None:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a whole Qwen3.5 model "
                     f"(expected one of {MODEL_TYPES})")


def build(cfg):
    import torch
    import transformers

    cls = (transformers.Qwen3_5MoeForConditionalGeneration if is_moe(cfg.text_config)
           else transformers.Qwen3_5ForConditionalGeneration)
    model = cls(cfg).to(torch.float32).eval()
    if is_moe(cfg.text_config):
        # As qwen3_5_lm's reference: each expert as the modelling code writes it (the grouped-GEMM
        # path needs 16-byte-aligned strides, which bf16 at odd tiny widths lacks).
        model.set_experts_implementation("eager")
    return model


def state_shapes(cfg) -> dict[str, tuple]:
    text = cfg.text_config
    out = {f"model.visual.{k}": s for k, s in tower.state_shapes(cfg.vision_config).items()}
    out.update({f"model.language_model.{k}": s for k, s in decoder.decoder_shapes(text).items()})
    if not tied_embeddings(cfg):
        out["lm_head.weight"] = (text.vocab_size, text.hidden_size)
    return out
