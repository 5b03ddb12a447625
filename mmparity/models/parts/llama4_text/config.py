"""Llama 4's text config -> Megatron ``TransformerConfig`` recipe, the facts of its layers (which
use RoPE, which are chunked, which are MoE), and transformers' ``Llama4TextConfig`` as config.json
is read without transformers."""

from __future__ import annotations

from mmparity.config import DECODER_FIELDS, ConfigType, head_dim, query_groups


# Unscaled RoPE, and Llama 3's frequency scaling.
ROPE_TYPES = ("default", "llama3")
# The fields of Llama 3's scaling, as mcore's RotaryEmbedding names its arguments.
LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_layers(text) -> list[bool]:
    """Per layer, whether it rotates q/k (transformers' ``no_rope_layers[i]`` is 1 on RoPE layers:
    the list names the layers that are *not* NoPE)."""
    return [bool(flag) for flag in text.no_rope_layers]


def megatron_args(text) -> dict:
    """What of a Llama 4 text config Megatron-LM has flags for beyond the common ones, under its
    argument names: ``no_rope_freq`` (1 on a NoPE layer, HF's ``no_rope_layers`` the other way
    round), ``qk_l2_norm`` (the weightless q/k L2 norms) and the ``spec`` a run must be given,
    the part's layer spec, which keeps those norms off the NoPE layers as Llama 4 does (flags
    alone put them on every layer); ``--use-checkpoint-args`` restores ``spec``."""
    return {"no_rope_freq": [0 if rope else 1 for rope in rope_layers(text)],
            "qk_l2_norm": bool(text.use_qk_norm),
            "spec": [f"{__package__}.megatron", "LAYER"]}


def chunked_layers(text) -> list[bool]:
    """Per layer, whether its causal mask is cut into ``attention_chunk_size`` chunks."""
    return [kind == "chunked_attention" for kind in text.layer_types]


def moe_layers(text) -> list[bool]:
    """Per layer, whether its MLP is the mixture of experts."""
    moe = set(text.moe_layers)
    return [i in moe for i in range(text.num_hidden_layers)]


def config_problems(text) -> list[str]:
    """What of a Llama 4 text config the native decoder cannot reproduce exactly."""
    problems = []
    if text.num_experts_per_tok != 1 and any(moe_layers(text)):
        problems.append(f"num_experts_per_tok={text.num_experts_per_tok} (mcore scales the expert input by "
                        "the router score only at top-1)")
    rope_type = (getattr(text, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        problems.append(f"rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    if text.attention_bias:
        problems.append("attention_bias=True")
    if text.hidden_act not in ("silu", "swish"):
        problems.append(f"hidden_act {text.hidden_act!r} (the MLPs here are SwiGLU)")
    return problems


def transformer_fields(text) -> dict:
    """RMSNorm, SwiGLU, GQA with an explicit head width, no biases, interleaved RoPE (transformers
    rotates adjacent pairs as complex numbers on the weights as stored). ``ffn_hidden_size`` is the
    dense layers' (``intermediate_size_mlp``); the experts' and the shared expert's width is
    ``intermediate_size``."""
    return dict(num_layers=text.num_hidden_layers, hidden_size=text.hidden_size,
                num_attention_heads=text.num_attention_heads, num_query_groups=query_groups(text),
                kv_channels=head_dim(text), ffn_hidden_size=text.intermediate_size_mlp, normalization="RMSNorm",
                norm_eps=text.rms_norm_eps, activation=text.hidden_act, gated=True, bias=False,
                rotary_interleaved=True)


# --- HF config tables ---

def _derived(v: dict, extra: dict) -> None:
    # What Llama4TextConfig computes at init from the fields it was given.
    n = v["num_hidden_layers"]
    if v["num_key_value_heads"] is None:
        v["num_key_value_heads"] = v["num_attention_heads"]
    if not v["no_rope_layers"]:
        v["no_rope_layers"] = [int((i + 1) % v["no_rope_layer_interval"] != 0) for i in range(n)]
    if v["head_dim"] is None:
        v["head_dim"] = v["hidden_size"] // v["num_attention_heads"]
    if v["moe_layers"] is None:
        step = v["interleave_moe_layer_step"]
        v["moe_layers"] = list(range(step - 1, n, step))
    if v["layer_types"] is None:
        v["layer_types"] = ["chunked_attention" if rope and v["attention_chunk_size"] is not None
                            else "full_attention" for rope in v["no_rope_layers"]]


TEXT_FIELDS = {**DECODER_FIELDS, "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
               "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
               "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
               "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "num_experts_per_tok": 1,
               "num_local_experts": 16, "moe_layers": None, "interleave_moe_layer_step": 1, "use_qk_norm": True,
               "output_router_logits": False, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
               "no_rope_layers": None, "no_rope_layer_interval": 4, "attention_chunk_size": 8192,
               "layer_types": None, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
               "attention_bias": False}

HF_CONFIGS = {"llama4_text": ConfigType(TEXT_FIELDS, rope_type="default", before=_derived, rope_theta=500000.0)}
