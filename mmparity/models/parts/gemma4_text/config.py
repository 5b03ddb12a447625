"""Gemma 4's decoder: what of a ``Gemma4TextConfig`` the native model reproduces
(:func:`config_problems`), each layer's head width, key/value heads and RoPE, the one HF config ->
Megatron ``TransformerConfig`` recipe, and the ``gemma4_text`` configuration class as config.json
is read without transformers."""

from __future__ import annotations

from mmparity.config import DECODER_FIELDS, ConfigType
from mmparity.models.parts.gemma4_text.per_layer import problems as per_layer_problems
from mmparity.models.parts.gemma4_text.moe import is_moe, moe_config_fields, moe_problems, moe_tp_sizes
from mmparity.models.parts.gemma_config import FULL, SLIDING, layer_type_problems

# transformers' Gemma4TextConfig defaults: the RoPE of each layer type, the full layers' width.
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
DEFAULT_GLOBAL_HEAD_DIM = 512
ROPE_TYPES = ("default", "proportional")


def _override(text, i: int, name: str):
    """Layer ``i``'s ``name`` (``head_dim``, ``num_key_value_heads``): the config's
    ``per_layer_config`` override where it has one (transformers' view, or the file's mapping with
    string keys), the config's own value otherwise. transformers refuses to read a per-layer
    field off the whole config, so nothing here does."""
    per = getattr(text, "per_layer_config", None)
    if not per:
        return getattr(text, name)
    if isinstance(per, dict):
        by_layer = {int(k): v for k, v in per.items()}  # keys zero-padded as transformers writes them
        return (by_layer.get(i) or {}).get(name, getattr(text, name))
    return getattr(per[i], name)


def layer_head_dim(text, i: int) -> int:
    return int(_override(text, i, "head_dim"))


def layer_groups(text, i: int) -> int:
    return int(_override(text, i, "num_key_value_heads"))


def keys_as_values(text, i: int) -> bool:
    """Whether layer ``i`` has no value projection, its key projection's output serving as the
    values too (``attention_k_eq_v``: full-attention layers only, as transformers builds them)."""
    return bool(getattr(text, "attention_k_eq_v", False)) and text.layer_types[i] == FULL


def layer_inv_freq(text, i: int):
    """Layer ``i``'s RoPE frequencies over its head width, as transformers computes them: default
    (``θ^(-2k/d)``, ``k < d/2``) or proportional (the first ``partial_rotary_factor · d/2``
    frequencies of the full width, zero after them: those channels are not rotated; pairs stay
    ``(k, k + d/2)``, so this is not mcore's ``rotary_percent``), divided by ``factor``."""
    import torch

    params = text.rope_parameters[text.layer_types[i]]
    d, base = layer_head_dim(text, i), float(params["rope_theta"])
    if params.get("rope_type", "default") == "default":
        return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    angles = int(params.get("partial_rotary_factor", 1.0) * d // 2)
    rotated = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / d))
    inv_freq = torch.cat((rotated, torch.zeros(d // 2 - angles, dtype=torch.float32)))
    return inv_freq / float(params.get("factor", 1.0))


def config_problems(text) -> list[str]:
    """What of a Gemma 4 text config the native model cannot reproduce as transformers computes it:
    each refused by name with the reason."""
    problems = layer_type_problems(text, ROPE_TYPES)
    not_built = {
        "attention_bias": "Gemma 4 has no attention biases; a model with them is not built",
    }
    for name, why in not_built.items():
        if getattr(text, name, None):
            problems.append(f"text_config: {name}={getattr(text, name)!r}: {why}")
    problems += per_layer_problems(text)
    problems += moe_problems(text)
    if is_moe(text) and getattr(text, "use_double_wide_mlp", False) and getattr(text, "num_kv_shared_layers", 0):
        problems.append("text_config: enable_moe_block with use_double_wide_mlp: the shared layers' doubled MLP as "
                        "the MoE block's shared expert is not built (no Gemma 4 release has both)")
    if getattr(text, "use_bidirectional_attention", None) == "all":
        problems.append("text_config: use_bidirectional_attention='all' (an encoder's mask, not a decoder's)")
    return problems


def tp_problems(text, tp: int) -> list[str]:
    if tp < 1:
        return []
    sizes = {"text num_attention_heads": text.num_attention_heads,
             "text intermediate_size": text.intermediate_size, **moe_tp_sizes(text)}
    for groups in sorted({layer_groups(text, i) for i in range(text.num_hidden_layers)}):
        sizes["text key/value heads"] = groups
        if groups % tp:
            break
    return [f"tp={tp} does not divide {name}={value}" for name, value in sizes.items() if value % tp]


def layer_fields(text) -> tuple:
    """Per layer, the ``TransformerConfig`` fields that differ from the block's (a full layer's
    head width and key/value heads), empty where none do."""
    base = (layer_head_dim(text, 0), layer_groups(text, 0))
    out = []
    for i in range(text.num_hidden_layers):
        d, g = layer_head_dim(text, i), layer_groups(text, i)
        out.append({} if (d, g) == base else {"kv_channels": d, "num_query_groups": g})
    return tuple(out)


def transformer_config(text, params_dtype=None):
    """The decoder's ``TransformerConfig`` at the current TP / PP, the first layer's: plain RMSNorms
    (``w``, not ``1 + w``) computed in fp32, q/k norms, GeGLU (tanh), GQA with an explicit head
    width, no biases, attention unscaled (``softmax_scale`` 1: the q/k norms set the scale). Full
    layers replace the width and groups (:func:`layer_fields`); windows and RoPE are the layers'."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mmparity.models.core.layers import activation_from_hf, add_stage_fields, run_fields

    params_dtype = torch.float32 if params_dtype is None else params_dtype
    fields = dict(
        num_layers=text.num_hidden_layers, hidden_size=text.hidden_size,
        num_attention_heads=text.num_attention_heads, num_query_groups=layer_groups(text, 0),
        kv_channels=layer_head_dim(text, 0), ffn_hidden_size=text.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=text.rms_norm_eps,
        activation_func=activation_from_hf(text.hidden_activation), gated_linear_unit=True,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True, rotary_interleaved=False,
        softmax_scale=1.0, **run_fields(params_dtype))
    # Layers of two widths cannot share one stacked tensor in a torch_dist checkpoint: mcore keys
    # such a block layer by layer (the part's record says so in the checkpoint's args too).
    fields["hetereogenous_dist_checkpoint"] = True
    fields.update(moe_config_fields(text))
    return TransformerConfig(**add_stage_fields(fields))


# --- HF config table ---
# transformers 5's defaults of Gemma4TextConfig, and what its init computes.


def _text(v: dict, extra: dict) -> None:
    if v["use_bidirectional_attention"] == "all":
        v["sliding_window"] = v["sliding_window"] // 2 + 1
    if v["layer_types"] is None:
        v["layer_types"] = [SLIDING if (i + 1) % 6 else FULL for i in range(v["num_hidden_layers"])]
    if v["layer_types"] and v["layer_types"][-1] != FULL:  # transformers forces it, with a warning
        v["layer_types"] = [*v["layer_types"][:-1], FULL]
    if v["rope_parameters"] is None:
        v["rope_parameters"] = {k: dict(g) for k, g in DEFAULT_ROPE.items()}
    # The full layers' own width (and key/value heads where keys are values), as transformers
    # builds its per-layer overrides from a file that names them.
    glob = extra.pop("global_head_dim", DEFAULT_GLOBAL_HEAD_DIM)
    groups = extra.pop("num_global_key_value_heads", None)
    per = v["per_layer_config"]
    if per is None:
        over = {"head_dim": glob}
        if groups is not None and v["attention_k_eq_v"]:
            over["num_key_value_heads"] = groups
        per = {i: dict(over) for i, t in enumerate(v["layer_types"]) if t == FULL}
    per = {int(k): o for k, o in per.items()}
    # transformers writes the layer numbers zero-padded to the largest one's width.
    width = len(str(max(per))) if per else 1
    v["per_layer_config"] = {str(i).zfill(width): o for i, o in sorted(per.items())}


HF_CONFIGS = {
    "gemma4_text": ConfigType({**{k: d for k, d in DECODER_FIELDS.items() if k != "hidden_act"}, "vocab_size": 262_144,
                               "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
                               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                               "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
                               "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
                               "attention_bias": False, "sliding_window": 512, "layer_types": None,
                               "final_logit_softcapping": None, "use_bidirectional_attention": None,
                               "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256,
                               "attention_k_eq_v": False, "num_kv_shared_layers": 0, "enable_moe_block": False,
                               "use_double_wide_mlp": False, "num_experts": None, "top_k_experts": None,
                               "moe_intermediate_size": None, "per_layer_config": None}, before=_text),
}
