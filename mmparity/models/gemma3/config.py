"""Gemma 3's one HF config -> Megatron ``TransformerConfig`` recipe of its decoder (read by the native
model, :mod:`mmparity.models.gemma3.native`), what of a config the native model reproduces
(:func:`config_problems`), each layer type's RoPE, and below them Gemma 3's HF configuration
classes (``gemma3``, ``gemma3_text``) as config.json is read without transformers."""

from __future__ import annotations

from mmparity.config import DECODER_FIELDS, ConfigType
from mmparity.models.parts.gemma_config import FULL, SLIDING, layer_type_problems

# transformers' Gemma3TextConfig defaults when a file names no base: global and local.
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


def layer_rope(text, layer_type: str) -> tuple[float, float]:
    """(base, linear scaling factor) of the RoPE of ``layer_type``'s layers."""
    params = (text.rope_parameters or {}).get(layer_type) or {}
    factor = float(params.get("factor", 1.0)) if params.get("rope_type", "default") == "linear" else 1.0
    return float(params.get("rope_theta", DEFAULT_THETA[layer_type])), factor


def text_problems(text) -> list[str]:
    """What of a Gemma 3 text config the native model cannot reproduce as transformers computes it
    (Megatron-LM's ``--spec`` layer reads the text config alone)."""
    problems = layer_type_problems(text, ("default", "linear"))
    # transformers 5.24's whole Gemma 3 applies neither soft-cap: Gemma3Attention never hands its cap
    # to the attention function, and only the text-only Gemma3ForCausalLM caps its logits. A model
    # computed either way would be checked against nothing (released Gemma 3 configs set neither).
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(text, name, None) is not None:
            problems.append(f"text_config: {name} is set, which transformers' Gemma3ForConditionalGeneration "
                            "does not apply")
    if getattr(text, "use_bidirectional_attention", False):
        problems.append("text_config: use_bidirectional_attention (an encoder's mask, not Gemma 3's)")
    if getattr(text, "attention_bias", False):
        problems.append("text_config: attention_bias=True (Gemma 3 has no attention biases)")
    return problems


def config_problems(cfg) -> list[str]:
    """What of a whole Gemma 3 config the native model cannot reproduce as transformers computes it."""
    vc = cfg.vision_config
    problems = text_problems(cfg.text_config)
    if getattr(vc, "vision_use_head", False):
        problems.append("vision_config: vision_use_head (Gemma 3 reads the tower's tokens, not a pooled head)")
    patches = vc.image_size // vc.patch_size
    side = round(cfg.mm_tokens_per_image ** 0.5)
    if side * side != cfg.mm_tokens_per_image or side == 0 or patches % side:
        problems.append(f"mm_tokens_per_image={cfg.mm_tokens_per_image} is not a square whose side divides "
                        f"the {patches}x{patches} patch grid")
    return problems


def transformer_config(text, params_dtype=None):
    """The decoder's ``TransformerConfig`` at the current TP / PP: Gemma's (1 + w) RMSNorms, q/k
    norms, GeGLU (tanh), GQA with an explicit head width, no biases, attention scaled by
    ``query_pre_attn_scalar ** -0.5``. Windows and per-type RoPE are the layers' own."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mmparity.models.core.layers import activation_from_hf, add_stage_fields, run_fields

    params_dtype = torch.float32 if params_dtype is None else params_dtype
    fields = dict(
        num_layers=text.num_hidden_layers, hidden_size=text.hidden_size,
        num_attention_heads=text.num_attention_heads, num_query_groups=text.num_key_value_heads,
        kv_channels=text.head_dim, ffn_hidden_size=text.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=text.rms_norm_eps, layernorm_zero_centered_gamma=True,
        activation_func=activation_from_hf(text.hidden_activation), gated_linear_unit=True,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True, rotary_interleaved=False,
        softmax_scale=float(text.query_pre_attn_scalar) ** -0.5, **run_fields(params_dtype))
    return TransformerConfig(**add_stage_fields(fields))


# --- HF config tables ---
# transformers 5's defaults of Gemma3TextConfig and Gemma3Config, and what their inits compute.


def _text(v: dict, extra: dict) -> None:
    pattern = extra.pop("sliding_window_pattern", 6)
    v["_sliding_window_pattern"] = pattern
    if v["use_bidirectional_attention"]:
        v["sliding_window"] = v["sliding_window"] // 2 + 1
    if v["layer_types"] is None:
        v["layer_types"] = [SLIDING if (i + 1) % pattern else FULL for i in range(v["num_hidden_layers"])]
    # Per-layer-type RoPE, older files' rope_scaling / rope_theta / rope_local_base_freq taken in.
    params = {k: dict(g) for k, g in (v["rope_parameters"] or {}).items() if g is not None}
    params.setdefault(SLIDING, {"rope_type": "default"})
    params.setdefault(FULL, {"rope_type": "default"})
    scaling = extra.pop("rope_scaling", None)
    if scaling is not None:
        params[FULL].update(scaling)
    params[FULL].setdefault("rope_theta", extra.pop("rope_theta", DEFAULT_THETA[FULL]))
    params[SLIDING].setdefault("rope_theta", extra.pop("rope_local_base_freq", DEFAULT_THETA[SLIDING]))
    for group in params.values():
        group.setdefault("rope_type", group.pop("type", "default"))
    v["rope_parameters"] = params


HF_CONFIGS = {
    "gemma3_text": ConfigType({**{k: d for k, d in DECODER_FIELDS.items() if k != "hidden_act"}, "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                               "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                               "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                               "max_position_embeddings": 131072, "pad_token_id": 0, "eos_token_id": 1,
                               "bos_token_id": 2, "tie_word_embeddings": True, "attention_bias": False,
                               "query_pre_attn_scalar": 256, "sliding_window": 4096, "layer_types": None,
                               "final_logit_softcapping": None, "attn_logit_softcapping": None,
                               "use_bidirectional_attention": False}, before=_text),
    "gemma3": ConfigType({"text_config": None, "vision_config": None, "mm_tokens_per_image": 256,
                          "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
                          "initializer_range": 0.02, "tie_word_embeddings": True},
                         aliases={"image_token_id": "image_token_index", "boi_token_id": "boi_token_index",
                                  "eoi_token_id": "eoi_token_index"},
                         subs={"vision_config": ("siglip_vision_model", False, {}),
                               "text_config": ("gemma3_text", False, {})}),
}


def window_args(text) -> dict:
    """The sliding layers as megatron-core and Megatron-LM say them: a window of
    ``sliding_window - 1`` keys back (HF's key is within the window while ``query - key <
    sliding_window``) on the layers listed 1 in ``window_attn_skip_freq``; none without them."""
    sliding = [int(kind == SLIDING) for kind in text.layer_types]
    return dict(window_size=(text.sliding_window - 1, 0), window_attn_skip_freq=sliding) if any(sliding) else {}


def megatron_args(cfg) -> dict:
    """What of a whole Gemma 3 config Megatron-LM has flags for beyond the common ones, under its
    argument names: the text model's windows and the ``spec`` a run must be given (the family's
    layer, which puts the sandwich norms where Gemma has them); ``--use-checkpoint-args``
    restores ``spec``."""
    return {**window_args(cfg.text_config), "spec": [f"{__package__}.megatron", "LAYER"]}
