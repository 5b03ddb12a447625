"""The Qwen3.5 part's one HF text config -> Megatron ``TransformerConfig`` recipe, for the dense
(``qwen3_5_text``) and the MoE (``qwen3_5_moe_text``) language models alike: what of the config
megatron-core's hybrid Gated DeltaNet block reproduces (:func:`config_problems`) and the config that
says it (:func:`transformer_config`), read by the native model
(:mod:`mmparity.models.parts.qwen3_5_text.native`). Below it, the dense text model's HF
configuration class as config.json is read without transformers (the MoE one's table sits with the
Qwen3.5-MoE tower, which reads whole checkpoints)."""

from __future__ import annotations

from mmparity.config import DECODER_FIELDS, ConfigType, rope_parameters

LINEAR, FULL = "linear_attention", "full_attention"


def is_moe(text) -> bool:
    return bool(getattr(text, "num_experts", 0) or 0)


def linear_pattern(text) -> list[int]:
    """Megatron's ``linear_attention_freq`` as a list: 1 where the layer is Gated DeltaNet."""
    return [int(kind == LINEAR) for kind in text.layer_types]


def layers_of(text, kind: str) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(text.layer_types) if t == kind)


def rotary_fraction(text) -> float:
    return float(rope_parameters(text).get("partial_rotary_factor", 1.0))


def config_problems(text) -> list[str]:
    """What of a Qwen3.5 text config mcore cannot reproduce."""
    problems = []
    unknown = sorted(set(text.layer_types) - {LINEAR, FULL})
    if unknown:
        problems.append(f"layer_types {unknown} (linear_attention and full_attention only)")
    if len(text.layer_types) != text.num_hidden_layers:
        problems.append(f"{len(text.layer_types)} layer_types for {text.num_hidden_layers} layers")
    if getattr(text, "attention_bias", False):
        problems.append("attention_bias=True (the gated attention here has no biases)")
    rope = rope_parameters(text)
    if rope["rope_type"] != "default":
        problems.append(f"rope_type {rope['rope_type']!r} (only unscaled RoPE)")
    if text.linear_num_value_heads % text.linear_num_key_heads:
        problems.append(f"linear_num_value_heads={text.linear_num_value_heads} is not a multiple of "
                        f"linear_num_key_heads={text.linear_num_key_heads}")
    if text.hidden_act not in ("silu", "swish"):
        problems.append(f"hidden_act {text.hidden_act!r} (Gated DeltaNet's conv and gate use silu)")
    return problems


def tp_problems(text, tp: int) -> list[str]:
    """The sizes tensor parallelism must divide: whole attention heads and key/value groups, whole
    Gated DeltaNet key heads (each with its value heads)."""
    problems = []
    for name in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads"):
        value = getattr(text, name)
        if value % tp:
            problems.append(f"{name}={value} is not divisible by tp={tp}")
    return problems


def transformer_config(text, params_dtype=None):
    """The ``TransformerConfig`` of the text model (``params_dtype`` None: fp32) at the current
    TP / PP / EP, or ValueError naming what :func:`config_problems` finds."""
    # Imported here: the config table below is read by commands that load no framework.
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mmparity.models.core.layers import activation_from_hf, add_stage_fields, moe_fields, run_fields

    params_dtype = torch.float32 if params_dtype is None else params_dtype
    problems = config_problems(text)
    if problems:
        raise ValueError("unsupported Qwen3.5 language model: " + "; ".join(problems))
    moe = is_moe(text)
    fields = dict(
        num_layers=text.num_hidden_layers, hidden_size=text.hidden_size,
        num_attention_heads=text.num_attention_heads, num_query_groups=text.num_key_value_heads,
        kv_channels=text.head_dim,
        ffn_hidden_size=text.moe_intermediate_size if moe else text.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=text.rms_norm_eps,
        # Every norm of the model but the DeltaNet output norm scales by (1 + weight) in HF; with
        # the flag, mcore's do so too (the output norm's weight is shifted by one in the mapping).
        layernorm_zero_centered_gamma=True,
        activation_func=activation_from_hf(text.hidden_act), gated_linear_unit=True, add_bias_linear=False,
        qk_layernorm=True, attention_output_gate=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=linear_pattern(text),
        linear_conv_kernel_dim=text.linear_conv_kernel_dim, linear_key_head_dim=text.linear_key_head_dim,
        linear_value_head_dim=text.linear_value_head_dim, linear_num_key_heads=text.linear_num_key_heads,
        linear_num_value_heads=text.linear_num_value_heads, **run_fields(params_dtype))
    if moe:
        fields.update(moe_fields(
            num_moe_experts=text.num_experts, moe_layer_freq=[1] * text.num_hidden_layers,
            moe_ffn_hidden_size=text.moe_intermediate_size,
            moe_shared_expert_intermediate_size=text.shared_expert_intermediate_size,
            moe_shared_expert_gate=True, moe_router_topk=text.num_experts_per_tok,
            moe_router_score_function="softmax"))
    return TransformerConfig(**add_stage_fields(fields))


# --- HF config tables ---
# The configuration class a text_config is read with, without transformers (mmparity.config's
# ConfigView): transformers 5's defaults of Qwen3_5TextConfig.


def _text(v: dict, extra: dict) -> None:
    extra.setdefault("partial_rotary_factor", 0.25)
    if v["layer_types"] is None:
        interval = extra.pop("full_attention_interval", 4)
        v["layer_types"] = [LINEAR if (i + 1) % interval else FULL for i in range(v["num_hidden_layers"])]


HF_CONFIGS = {
    "qwen3_5_text": ConfigType({**DECODER_FIELDS, "vocab_size": 248320, "hidden_size": 4096,
                                "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
                                "num_key_value_heads": 4, "max_position_embeddings": 32768,
                                "attention_bias": False, "head_dim": 256, "linear_conv_kernel_dim": 4,
                                "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                                "linear_num_key_heads": 16, "linear_num_value_heads": 32, "layer_types": None,
                                "bos_token_id": None, "eos_token_id": None},
                               rope_type="default", before=_text),
}
