"""Facts read off Hugging Face config objects, shared by every layer.

Attribute access only: nothing here imports transformers or megatron, so the converters, the
native models and the reference models read a config the same way.
"""

from __future__ import annotations


def first_int(value) -> int:
    """A size that HF configs give either as an int or as a (h, w) / (t, h, w) sequence."""
    return value if isinstance(value, int) else int(value[0])


def image_hw(cfg) -> tuple[int, int]:
    size = cfg.image_size
    return (size, size) if isinstance(size, int) else tuple(size)


def num_heads(cfg) -> int:
    """Attention heads (``num_attention_heads``; Qwen's vision configs say ``num_heads``)."""
    heads = getattr(cfg, "num_attention_heads", None)
    return heads if heads is not None else cfg.num_heads


def head_dim(cfg) -> int:
    """The per-head width: an explicit ``head_dim`` when the config sets one, else hidden / heads."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads(cfg)


# Norm epsilons HF hard-codes in its modules instead of reading a config field: every layer that
# builds these towers (native, upstream) reads them here.
PIXTRAL_NORM_EPS = 1e-5  # every PixtralRMSNorm of the tower, ln_pre included
QWEN_VISION_NORM_EPS = 1e-6  # every LayerNorm of the Qwen3.5 vision tower
KIMI_VISION_NORM_EPS = 1e-5  # every vision LayerNorm of Kimi-K2.5, as in the release


def query_groups(cfg) -> int:
    """Key/value heads (GQA groups): ``num_key_value_heads`` when set, else one per head."""
    return getattr(cfg, "num_key_value_heads", None) or num_heads(cfg)


def rope_theta(cfg, default: float = 10000.0) -> float:
    """The RoPE base: transformers v5 keeps it in ``rope_parameters``, older configs as a
    ``rope_theta`` attribute."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", default)))


def vision_sub_config(cfg):
    """A whole-model config's ``vision_config``, or ``cfg`` itself when it has none."""
    return getattr(cfg, "vision_config", None) or cfg


def has_vision_sub_config(cfg) -> bool:
    return getattr(cfg, "vision_config", None) is not None


def vision_of(cfg, model_types: tuple):
    """``cfg`` when its model_type is in ``model_types``, else its ``vision_config`` when that one's
    is (under any parent); ``ValueError`` otherwise."""
    if getattr(cfg, "model_type", None) in model_types:
        return cfg
    sub = getattr(cfg, "vision_config", None)
    if getattr(sub, "model_type", None) in model_types:
        return sub
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} has no "
                     f"{'/'.join(model_types)} vision config")


def tower_config(cfg, model_types: tuple, parent_types: tuple, what: str):
    """The config of model_type in ``model_types``: ``cfg`` itself, or the ``vision_config`` of a
    config whose model_type is in ``parent_types``; ``ValueError`` naming ``what`` otherwise."""
    model_type = getattr(cfg, "model_type", None)
    if model_type in model_types:
        return cfg
    sub = getattr(cfg, "vision_config", None)
    if model_type in parent_types and getattr(sub, "model_type", None) in model_types:
        return sub
    raise ValueError(f"config of model_type {model_type!r} is not a {what} model "
                     f"(expected one of {tuple(model_types) + tuple(parent_types)})")


def tower_config_or_self(cfg, model_type: str):
    """Lenient :func:`tower_config` for key planning: an unrecognised config is taken as the tower's."""
    if getattr(cfg, "model_type", None) == model_type:
        return cfg
    sub = getattr(cfg, "vision_config", None)
    return sub if getattr(sub, "model_type", None) == model_type else cfg


# --- LLaVA ----------------------------------------------------------------------------------------

# Megatron-LM's default ``make_vocab_size_divisible_by``.
VOCAB_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_PAD_MULTIPLE, tp: int = 1) -> int:
    """Megatron-LM's padded vocabulary: a multiple of ``multiple`` (``--make-vocab-size-divisible-by``)
    times the TP size, so the padded size depends on TP as Megatron-LM's does."""
    step = multiple * tp
    return -(-vocab_size // step) * step


# Decoder families whose attention always carries q/k/v biases (and nothing else), whatever flags
# the config has: Qwen2's checkpoints store ``q_proj.bias`` etc. with no config switch.
_QKV_BIAS_MODEL_TYPES = ("qwen2",)


def decoder_biases(text) -> tuple[bool, bool]:
    """``(q/k/v bias, output and MLP biases)`` of a dense decoder's text config, as mcore's
    ``add_qkv_bias`` / ``add_bias_linear`` state them. Llama's ``attention_bias`` puts a bias on
    q/k/v *and* o_proj, ``mlp_bias`` on the MLP; mcore has one switch for o_proj and the MLP
    together, so the two flags must agree (:func:`decoder_bias_problems`)."""
    attention, mlp = bool(getattr(text, "attention_bias", False)), bool(getattr(text, "mlp_bias", False))
    if getattr(text, "model_type", None) in _QKV_BIAS_MODEL_TYPES:
        return True, False
    return attention, attention and mlp


def decoder_bias_problems(text) -> list[str]:
    attention, mlp = bool(getattr(text, "attention_bias", False)), bool(getattr(text, "mlp_bias", False))
    if getattr(text, "model_type", None) not in _QKV_BIAS_MODEL_TYPES and attention != mlp:
        return [f"attention_bias={attention} with mlp_bias={mlp} (mcore biases o_proj and the MLP "
                "together)"]
    return []


def select_strategy(cfg) -> str:
    """LLaVA's ``vision_feature_select_strategy``; configs without one (Mistral3) keep every token."""
    return getattr(cfg, "vision_feature_select_strategy", None) or "full"


def has_patch_merger(cfg) -> bool:
    """Whether a whole-VLM config merges patches before its projector (Mistral3's
    ``spatial_merge_size``; LLaVA has none)."""
    return getattr(cfg, "model_type", None) == "mistral3"


def spatial_merge(cfg) -> int:
    """Patches merged along each side before the projector (1: none)."""
    return int(cfg.spatial_merge_size) if has_patch_merger(cfg) else 1


def tied_embeddings(cfg) -> bool:
    """Whether ``lm_head`` shares the input embedding (HF reads the top-level config flag)."""
    return bool(getattr(cfg, "tie_word_embeddings", False))


def tower_depth(cfg) -> int:
    """How many vision layers a LLaVA tower is built with, as Megatron builds it: up to the deepest
    hidden state ``vision_feature_layer`` reads (at least one layer: a transformer block of none
    cannot be built, and features from the embedding output alone leave that layer unused)."""
    return max(1, *feature_layer_indices(cfg))


def feature_layer_indices(cfg) -> list[int]:
    """``vision_feature_layer`` as indices into HF's ``hidden_states`` (0 = the embedding output,
    k = the output of vision layer k-1), in the order the features are concatenated."""
    layers = cfg.vision_feature_layer
    layers = [layers] if isinstance(layers, int) else list(layers)
    count = cfg.vision_config.num_hidden_layers
    resolved = [layer + count + 1 if layer < 0 else layer for layer in layers]
    bad = [layer for layer, index in zip(layers, resolved) if not 0 <= index <= count]
    if not layers or bad:
        raise ValueError(f"vision_feature_layer {cfg.vision_feature_layer!r} does not select among "
                         f"the {count + 1} hidden states of a {count}-layer vision tower")
    return resolved


def vision_layers_run(cfg) -> int:
    """Vision layers the features depend on; later layers are converted but never run."""
    return max(feature_layer_indices(cfg))


# --- MoE decoders with multi-latent attention (DeepSeek-V3, Kimi-K2) ----------------------------

def routed_experts(text) -> int:
    """How many routed experts each MoE layer has (0: a dense decoder)."""
    return int(getattr(text, "n_routed_experts", None) or getattr(text, "num_local_experts", None) or 0)


def moe_layer_range(text) -> range:
    """The layers whose MLP is a mixture of experts: all after the ``first_k_dense_replace``
    leading dense layers."""
    if not routed_experts(text):
        return range(text.num_hidden_layers, text.num_hidden_layers)
    return range(min(int(text.first_k_dense_replace or 0), text.num_hidden_layers), text.num_hidden_layers)


def dense_layer_range(text) -> range:
    return range(0, moe_layer_range(text).start)


def shared_expert_size(text) -> int:
    """The shared experts' combined intermediate width (HF builds them as one MLP)."""
    return int(text.moe_intermediate_size) * int(getattr(text, "n_shared_experts", 0) or 0)


def rope_parameters(text) -> dict:
    """The RoPE parameters, whichever spelling the config uses (transformers 5's
    ``rope_parameters``, older ``rope_scaling`` + ``rope_theta``), with ``rope_type`` always set."""
    params = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    params.setdefault("rope_theta", rope_theta(text))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def mtp_layers(text) -> int:
    """Multi-token-prediction layers a release stores after the decoder (``layers.N…``), which
    transformers' model does not build."""
    return int(getattr(text, "num_nextn_predict_layers", 0) or 0)
