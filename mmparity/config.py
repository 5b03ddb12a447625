"""Facts read off Hugging Face config objects, shared by every layer, and config.json read as
transformers reads it (:class:`ConfigView`) for commands that need the facts, not the classes.

Attribute access only: nothing here imports transformers or megatron, so the converters, the
native models and the reference models read a config the same way.
"""

from __future__ import annotations

import copy
from typing import Mapping


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

def padded_vocab_size(vocab_size: int, multiple: int, tp: int = 1) -> int:
    """Megatron-LM's padded vocabulary: a multiple of ``multiple`` (``--make-vocab-size-divisible-by``,
    whose default is :data:`mmparity.mapping.rules.VOCAB_MULTIPLE`) times the TP size, so the padded
    size depends on TP as Megatron-LM's does."""
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


def declares(cfg, name: str) -> bool:
    """Whether ``cfg``'s configuration class has the field ``name``, rather than its file merely
    carrying a value of that name (transformers keeps unknown keys as attributes too)."""
    if isinstance(cfg, ConfigView):
        return name in object.__getattribute__(cfg, "_declared")
    return hasattr(type(cfg), name)


def has_patch_merger(cfg) -> bool:
    """Whether a whole-VLM config merges patches before its projector: its class has a
    ``spatial_merge_size`` (Mistral3's does; LLaVA's has none, whatever its file carries)."""
    return declares(cfg, "spatial_merge_size")


def spatial_merge(cfg) -> int:
    """Patches merged along each side before the projector (1: none)."""
    return int(cfg.spatial_merge_size) if has_patch_merger(cfg) else 1


def pixel_shuffle_reduction(cfg) -> int:
    """Patches merged along each side by InternVL's pixel shuffle before its projector (1: none):
    a whole-VLM config whose class has a ``downsample_ratio`` (InternVL's; 0.5 merges 2x2)."""
    if not declares(cfg, "downsample_ratio"):
        return 1
    reduction = round(1 / cfg.downsample_ratio)
    if reduction < 1 or abs(reduction * cfg.downsample_ratio - 1) > 1e-6:
        raise ValueError(f"downsample_ratio {cfg.downsample_ratio} is not 1/n for a whole n")
    return reduction


def image_token_id(cfg) -> int:
    """The id of one image slot in HF's ids (``image_token_index``; InternVL's class names it
    ``image_token_id``)."""
    value = getattr(cfg, "image_token_index", None)
    return cfg.image_token_id if value is None else value


def projector_bias(cfg) -> bool:
    """Whether the projector's linears have biases (InternVL's always do; its config says nothing)."""
    return bool(getattr(cfg, "multimodal_projector_bias", True))


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
    """The shared experts' combined intermediate width (HF builds them as one MLP): stated whole
    (Qwen's ``shared_expert_intermediate_size``) or as a count of routed experts' widths
    (DeepSeek's ``n_shared_experts``)."""
    whole = getattr(text, "shared_expert_intermediate_size", None)
    if whole:
        return int(whole)
    return int(getattr(text, "moe_intermediate_size", 0) or 0) * int(getattr(text, "n_shared_experts", 0) or 0)


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


# --- config.json read without transformers --------------------------------------------------------
#
# Conversion needs a config's facts, not transformers' configuration classes: importing those costs
# more CPU than converting a small checkpoint (transformers' import pulls half of torch's optional
# machinery). :class:`ConfigView` is what ``AutoConfig.from_pretrained`` would hold for the same
# config.json, attribute for attribute: the file's fields over the defaults of its model_type's
# class (a :class:`ConfigType`: transformers 5's dataclass defaults), the derived fields those
# classes compute at init (``head_dim``, key/value heads, ``rope_parameters``), sub-configs built
# the same way, and the classes' attribute aliases. Each table lives in the package of the model
# that reads it (``HF_CONFIGS`` of its ``config`` module) and is handed to :func:`config_view` by
# its caller, which collects them through the registry; this module holds the machinery alone.
# tests/models/test_config_view.py checks every table, field by field, against transformers' own
# classes, so a transformers release that changes a default fails there, not in a conversion.
# Commands that build models (check, bench) keep transformers' classes.


# Fields of every config (transformers' PreTrainedConfig), with their defaults after init.
_BASE_FIELDS = {"architectures": None, "output_hidden_states": False, "return_dict": True, "dtype": None,
                "chunk_size_feed_forward": 0, "is_encoder_decoder": False, "id2label": None,
                "label2id": None, "problem_type": None}
# Keys transformers' init consumes rather than keeps (generation defaults belong to a
# GenerationConfig; the rest are loading options).
_CONSUMED = {"max_length", "min_length", "do_sample", "use_cache", "early_stopping", "num_beams", "temperature",
             "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
             "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
             "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
             "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "epsilon_cutoff",
             "eta_cutoff", "encoder_repetition_penalty", "num_assistant_tokens", "num_assistant_tokens_schedule",
             "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "num_beam_groups",
             "diversity_penalty", "_commit_hash", "attn_implementation", "experts_implementation",
             "_attn_implementation_internal", "_experts_implementation_internal", "transformers_version",
             "model_type", "num_labels"}
_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention",
                       "deepseek_sparse_attention": "indexed_attention",
                       "qwen_sparse_attention": "indexed_attention"}
_SCALED_ROPE_TYPES = ("llama3", "yarn", "longrope")


class ConfigType:
    """One configuration class, as its model's package declares it: its own fields and defaults,
    attribute aliases, sub-configs (``key: (default model_type, resolved by the dict's model_type,
    init values when absent, or None: optional, None when absent)``), whether it standardises
    ``rope_parameters`` and with which default RoPE type, and what the class computes at init: ``before(values, extra)`` before the common
    part (sub-configs, RoPE, labels) runs, ``after(values, extra)`` once it has."""

    def __init__(self, fields: dict, aliases: dict | None = None, subs: dict | None = None,
                 rope_type: str | None = None, before=None, after=None, rope_theta: float = 10000.0):
        self.fields, self.aliases, self.subs, self.rope_type = fields, aliases or {}, subs or {}, rope_type
        # The RoPE base the class takes where the file names none (transformers' ``default_theta``).
        self.rope_theta = rope_theta
        self.before, self.after = before, after


# The fields every decoder class shares, with transformers' defaults; each decoder's table
# starts from these.
DECODER_FIELDS = {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True,
                  "pad_token_id": None, "tie_word_embeddings": False, "rope_parameters": None,
                  "attention_dropout": 0.0}


def renamed_sub(key: str, old: str, new: str):
    """A ``before`` hook for old checkpoints whose sub-config ``key`` names the wrong model type."""
    def fix(v: dict, extra: dict) -> None:
        if isinstance(v[key], dict) and v[key].get("model_type", new if key == "text_config" else None) == old:
            v[key] = {**v[key], "model_type": new}
    return fix


class ConfigView:
    """An HF config built from config.json's mapping as transformers builds its own (see above):
    read-only (a ``copy.copy`` may be edited). Attribute access as on transformers' object; a
    field the file lacks and the class has no default for is an ``AttributeError``, as there.
    ``to_dict()`` is transformers' ``to_dict()`` (without ``transformers_version``)."""

    __slots__ = ("_values", "_aliases", "model_type", "_writable", "_declared")

    def __init__(self, values: dict, model_type: str, aliases: dict, writable: bool = False,
                 declared: frozenset = frozenset()):
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_aliases", aliases)
        object.__setattr__(self, "model_type", model_type)
        object.__setattr__(self, "_writable", writable)
        # The fields its class has (the rest of ``_values`` the file merely carried).
        object.__setattr__(self, "_declared", declared)

    def __getattr__(self, name: str):
        values = object.__getattribute__(self, "_values")
        name = object.__getattribute__(self, "_aliases").get(name, name)
        if name in values:
            return values[name]
        if name == "rope_scaling" and "rope_parameters" in values:
            return values["rope_parameters"]
        if name == "num_labels":
            return len(values["id2label"]) if values.get("id2label") is not None else None
        if name == "name_or_path":
            return values.get("_name_or_path")
        raise AttributeError(f"{self.model_type} config has no field {name!r}")

    def __setattr__(self, name, value):
        # The view read from a file is shared by every reader; a copy is its taker's own (the
        # native models copy a tower config to build fewer layers, as with transformers' objects).
        if not self._writable:
            raise AttributeError(f"a ConfigView is read-only (setting {name!r}); copy.copy() it to edit")
        self._values[self._aliases.get(name, name)] = value

    def __repr__(self) -> str:
        return f"ConfigView({self.model_type!r}, {len(self._values)} fields)"

    def __copy__(self):
        return ConfigView(dict(self._values), self.model_type, self._aliases, writable=True,
                          declared=self._declared)

    def __deepcopy__(self, memo):
        return ConfigView(copy.deepcopy(self._values, memo), self.model_type, self._aliases, writable=True,
                          declared=self._declared)

    def __reduce__(self):
        return ConfigView, (self._values, self.model_type, self._aliases, self._writable, self._declared)

    def to_dict(self) -> dict:
        out = {}
        for key, value in self._values.items():
            out[key] = value.to_dict() if isinstance(value, ConfigView) else copy.deepcopy(value)
        out["model_type"] = self.model_type
        return out


class ConfigViewError(ValueError):
    """config.json names a model type the view has no table for, or a malformed sub-config."""


def config_view(data: dict, tables: Mapping[str, ConfigType], model_type: str | None = None) -> ConfigView:
    """The :class:`ConfigView` of a config.json mapping, read with ``tables`` (model_type -> its
    :class:`ConfigType`, sub-configs' types included; the packages of the models declare them);
    ``model_type``: the class to read it as, default the mapping's own."""
    model_type = model_type or data.get("model_type")
    kind = tables.get(model_type)
    if kind is None:
        raise ConfigViewError(f"model_type {model_type!r} is not one mmparity reads without transformers "
                              f"(known: {', '.join(tables)})")
    data = {kind.aliases.get(k, k): v for k, v in data.items()}
    fields = {**_BASE_FIELDS, **{kind.aliases.get(k, k): v for k, v in kind.fields.items()}}
    values = {name: copy.deepcopy(data[name] if name in data else default) for name, default in fields.items()}
    values.pop("transformers_version", None)
    extra = {k: copy.deepcopy(v) for k, v in data.items() if k not in fields}
    if kind.before is not None:
        kind.before(values, extra)
    for key, (default_type, by_model_type, init) in kind.subs.items():
        sub = values[key]
        if isinstance(sub, ConfigView) or (sub is None and init is None):
            continue  # ``init`` None: an optional sub-config, None where the file has none
        if sub is not None and not isinstance(sub, dict):
            raise ConfigViewError(f"{key} is a {type(sub).__name__}, not an object")
        sub_type = (sub or {}).get("model_type", default_type) if by_model_type else default_type
        values[key] = config_view(init if sub is None else sub, tables, sub_type)
    torch_dtype = extra.pop("torch_dtype", None)
    if values["dtype"] is None and torch_dtype is not None:
        values["dtype"] = torch_dtype
    if values["id2label"] is None:
        labels = extra.get("num_labels", 2)
        values["id2label"] = {i: f"LABEL_{i}" for i in range(labels)}
        values["label2id"] = {f"LABEL_{i}": i for i in range(labels)}
    else:
        values["id2label"] = {int(k): v for k, v in values["id2label"].items()}
    if kind.rope_type is not None:
        _standardize_rope(values, extra, kind.rope_type, kind.rope_theta)
    values["_name_or_path"] = str(extra.pop("name_or_path", ""))
    values["output_attentions"] = extra.pop("output_attentions", False)
    extra.pop("per_layer_config", None)
    for key, value in extra.items():
        if key not in _CONSUMED:
            values[key] = value
    for key in ("layer_types", "mtp_layer_types"):
        if values.get(key) is not None:
            values[key] = [_LEGACY_LAYER_TYPES.get(t, t) for t in values[key]]
    if kind.after is not None:
        kind.after(values, extra)
    return ConfigView(values, model_type, kind.aliases, declared=frozenset(fields))


def _standardize_rope(values: dict, extra: dict, default_rope_type: str, default_theta: float = 10000.0) -> None:
    """``rope_parameters`` as transformers 5 standardises it at init: a legacy ``rope_scaling``
    taken over, ``rope_theta`` and ``partial_rotary_factor`` moved inside, ``rope_type`` set."""
    scaling = extra.pop("rope_scaling", None)
    params = scaling or values["rope_parameters"]
    params = dict(params) if params is not None else {}
    theta = extra.pop("rope_theta", values.get("rope_theta", default_theta))
    partial = extra.pop("partial_rotary_factor", values.get("partial_rotary_factor"))
    labels = values.get("layer_types") or ()
    nested = [key for key in params if key in labels]
    for group in ([params[k] for k in nested] or [params]):
        if group is not None:
            group.setdefault("rope_theta", theta)
            if partial is not None:
                group.setdefault("partial_rotary_factor", partial)
    if not (params or values.get("rope_theta")):
        values["rope_parameters"] = params
        return
    for group in ([params[k] for k in nested] if nested else [params]):
        if group is None:
            continue
        group.setdefault("rope_type", group.get("type", "default"))
        group.setdefault("rope_theta", theta)
        if partial is not None:
            group.setdefault("partial_rotary_factor", partial)
        if group["rope_type"] in _SCALED_ROPE_TYPES:
            if "original_max_position_embeddings" in values:
                group["original_max_position_embeddings"] = values["original_max_position_embeddings"]
            else:
                group.setdefault("original_max_position_embeddings", values["max_position_embeddings"])
        if default_rope_type != "default" and group["rope_type"] == "default":
            group["rope_type"] = default_rope_type
    values["rope_parameters"] = params
