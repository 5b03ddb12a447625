"""Mistral's own release config (``params.json`` beside ``consolidated.safetensors``) as the HF
config transformers would hold for the same model.

Pixtral-12B and Mistral-Small-3.1 ship their weights in Mistral's layout with a ``params.json``
instead of a ``config.json``. The field names are those of transformers' conversion scripts
(``convert_pixtral_weights_to_hf.py``, ``convert_mistral3_weights_to_hf.py``): a ``vision_encoder``
with ``spatial_merge_size`` (Mistral3's patch merger) becomes a ``Mistral3Config``, one without a
``LlavaConfig`` with a Pixtral tower; both with a Mistral text model. A field this translation does
not know is refused by name rather than dropped: it may change the function the weights compute.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from mmparity.config import has_patch_merger

# Top-level fields: params.json name -> MistralConfig name.
TEXT_FIELDS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "head_dim": "head_dim",
               "hidden_dim": "intermediate_size", "n_heads": "num_attention_heads",
               "n_kv_heads": "num_key_value_heads", "norm_eps": "rms_norm_eps",
               "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings",
               "max_seq_len": "max_position_embeddings"}
# Fields read for something other than a text config attribute, or known to change nothing here.
TEXT_OTHER = {"rope_theta", "tied_embeddings", "vision_encoder", "model_type", "multimodal",
              "sliding_window"}
VISION_FIELDS = {"hidden_size": "hidden_size", "num_channels": "num_channels",
                 "image_size": "image_size", "patch_size": "patch_size",
                 "intermediate_size": "intermediate_size", "num_hidden_layers": "num_hidden_layers",
                 "num_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads",
                 "head_dim": "head_dim"}
VISION_OTHER = {"rope_theta", "image_token_id", "image_break_token_id", "image_end_token_id",
                "adapter_bias", "spatial_merge_size", "mm_projector_id",
                "add_pre_mm_projector_layer_norm", "max_image_size", "image_token_index"}
# Mistral3's adapter: the merger and its norm are what these two flags switch on.
MERGER_IDS = (None, "patch_merge")


class ParamsError(ValueError):
    """params.json states something this translation cannot express."""


@dataclass(frozen=True)
class NativeRelease:
    """What a release in Mistral's layout is in HF terms, as the package of a model that takes
    such releases declares it (its ``config.MISTRAL_NATIVE``): the model types of the HF config
    (whole, ``vision_config``, ``text_config``) a params.json whose ``vision_encoder`` merges
    patches or not (:func:`merges_patches`) translates to. Family detection reads it without
    translating (and so without transformers)."""

    merges_patches: bool
    model_type: str
    vision_model_type: str
    text_model_type: str


def merges_patches(encoder: dict) -> bool:
    """Whether a params.json ``vision_encoder`` merges patches before its projector (Mistral3's
    patch merger): it states a ``spatial_merge_size``."""
    return encoder.get("spatial_merge_size") is not None


def release_of(encoder: dict, releases) -> NativeRelease | None:
    """The one of ``releases`` a params.json with this ``vision_encoder`` is, or None."""
    return next((r for r in releases if r.merges_patches == merges_patches(encoder)), None)


# What each number of params.json may be, by field: (kind, lowest, highest). Far beyond any
# released model, yet bounded: a size is a count of rows, layers or heads that a model (and every
# converter rule) is built from before a weight is read, and an epsilon or a RoPE base that is
# NaN, zero or negative is no function at all. Token ids are checked against the vocabulary.
_MAX_LAYERS = 10_000
_MAX_WIDTH = 2**20
_MAX_VOCAB = 2**24  # sixty times the largest vocabulary released (262k)
_MAX_POSITIONS = 2**27  # a context length; thirteen times the longest released (10M)
_MAX_IMAGE_SIDE = 2**15
_SIZE, _ID, _FLOAT, _FLAG = "size", "token id", "number", "flag"
TEXT_NUMBERS = {"dim": (_SIZE, 1, _MAX_WIDTH), "n_layers": (_SIZE, 1, _MAX_LAYERS),
                "head_dim": (_SIZE, 1, _MAX_WIDTH), "hidden_dim": (_SIZE, 1, _MAX_WIDTH),
                "n_heads": (_SIZE, 1, _MAX_WIDTH), "n_kv_heads": (_SIZE, 1, _MAX_WIDTH),
                "vocab_size": (_SIZE, 1, _MAX_VOCAB), "max_position_embeddings": (_SIZE, 1, _MAX_POSITIONS),
                "max_seq_len": (_SIZE, 1, _MAX_POSITIONS),
                # An RMSNorm epsilon is a small positive number; a RoPE base below 2 has no rotation
                # that slows down with the dimension.
                "norm_eps": (_FLOAT, 0.0, 1.0), "rope_theta": (_FLOAT, 2.0, 1e15),
                "tied_embeddings": (_FLAG, None, None)}
VISION_NUMBERS = {"hidden_size": (_SIZE, 1, _MAX_WIDTH), "num_channels": (_SIZE, 1, 64),
                  "image_size": (_SIZE, 1, _MAX_IMAGE_SIDE), "max_image_size": (_SIZE, 1, _MAX_IMAGE_SIDE),
                  "patch_size": (_SIZE, 1, _MAX_IMAGE_SIDE), "intermediate_size": (_SIZE, 1, _MAX_WIDTH),
                  "num_hidden_layers": (_SIZE, 1, _MAX_LAYERS), "num_layers": (_SIZE, 1, _MAX_LAYERS),
                  "num_attention_heads": (_SIZE, 1, _MAX_WIDTH), "head_dim": (_SIZE, 1, _MAX_WIDTH),
                  "spatial_merge_size": (_SIZE, 1, 64), "rope_theta": (_FLOAT, 2.0, 1e15),
                  "image_token_id": (_ID, 0, _MAX_VOCAB), "image_token_index": (_ID, 0, _MAX_VOCAB),
                  "image_break_token_id": (_ID, 0, _MAX_VOCAB), "image_end_token_id": (_ID, 0, _MAX_VOCAB),
                  "adapter_bias": (_FLAG, None, None), "add_pre_mm_projector_layer_norm": (_FLAG, None, None)}


def _shown(value) -> str:
    try:
        return json.dumps(value, allow_nan=True)[:60]
    except (TypeError, ValueError):
        return repr(value)[:60]


def _check_numbers(section: dict, table: dict, where: str) -> None:
    """Every number of ``section`` a translation reads, of its kind and within its bounds (a JSON
    ``true`` is no size, ``4096.0`` is no layer count, NaN is no epsilon); None stands for absent."""
    for key, (kind, low, high) in table.items():
        value = section.get(key)
        if value is None:
            continue
        name = f"{where}{key}"
        if kind == _FLAG:
            if not isinstance(value, bool):
                raise ParamsError(f"{name} is {_shown(value)}, expected true or false")
            continue
        if kind == _FLOAT:
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                  and low < value <= high)
            if not ok:
                raise ParamsError(f"{name} is {_shown(value)}, expected a finite number above {low:g} and at most "
                                  f"{high:g}")
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ParamsError(f"{name} is {_shown(value)}, expected an integer {kind} from {low} to {high}")


def _check_consistency(params: dict, vision: dict | None) -> None:
    """Sizes that only make a model together: grouped heads that divide the heads, token ids
    inside the vocabulary, patches no larger than the image."""
    heads, groups = params["n_heads"], params.get("n_kv_heads")
    groups = heads if groups is None else groups
    if groups > heads or heads % groups:
        raise ParamsError(f"n_kv_heads is {groups}, which does not divide n_heads {heads}")
    if "head_dim" not in params and params["dim"] % heads:
        raise ParamsError(f"dim {params['dim']} is not a multiple of n_heads {heads} (and no head_dim is given)")
    if vision is None:
        return
    for key in ("image_token_id", "image_token_index", "image_break_token_id", "image_end_token_id"):
        if vision.get(key) is not None and vision[key] >= params["vocab_size"]:
            raise ParamsError(f"vision_encoder.{key} is {vision[key]}, outside the vocabulary of "
                              f"vocab_size {params['vocab_size']}")
    patch, image = vision.get("patch_size"), vision.get("image_size")
    if patch is not None and image is not None and patch > image:
        raise ParamsError(f"vision_encoder.patch_size {patch} is larger than image_size {image}")
    width, heads = vision.get("hidden_size"), vision.get("num_attention_heads")
    if width is not None and heads is not None and "head_dim" not in vision and width % heads:
        raise ParamsError(f"vision_encoder.hidden_size {width} is not a multiple of num_attention_heads {heads} "
                          "(and no head_dim is given)")


def _unknown(section: dict, known: set, where: str) -> None:
    extra = sorted(set(section) - known)
    if extra:
        raise ParamsError(f"{where}: fields not translated: {', '.join(extra)} (they may change the "
                          "model's function; give a config.json instead)")


def config_from_params(params: dict):
    """The HF config of a Mistral-native release from its ``params.json`` mapping."""
    # Imported here: only a translation builds transformers' configuration classes; detection
    # reads this module's records without them.
    from transformers import LlavaConfig, Mistral3Config, MistralConfig, PixtralVisionConfig

    if not isinstance(params, dict):
        raise ParamsError("not a JSON object")
    _unknown(params, set(TEXT_FIELDS) | TEXT_OTHER, "top level")
    if params.get("sliding_window") is not None:
        raise ParamsError(f"sliding_window={params['sliding_window']} is not supported "
                          "(the decoder is fully causal)")
    missing = [name for name in ("dim", "n_layers", "hidden_dim", "n_heads", "vocab_size", "norm_eps")
               if params.get(name) is None]
    if missing:
        raise ParamsError(f"missing {', '.join(missing)}")
    _check_numbers(params, TEXT_NUMBERS, "")
    vision = params.get("vision_encoder")
    if isinstance(vision, dict):
        _check_numbers(vision, VISION_NUMBERS, "vision_encoder.")
    _check_consistency(params, vision if isinstance(vision, dict) else None)
    text = {TEXT_FIELDS[k]: v for k, v in params.items() if k in TEXT_FIELDS and v is not None}
    text.setdefault("num_key_value_heads", params["n_heads"])
    text.setdefault("head_dim", params["dim"] // params["n_heads"])
    tied = params.get("tied_embeddings") is True
    text_config = MistralConfig(**text, sliding_window=None, hidden_act="silu",
                                rope_parameters={"rope_type": "default",
                                                 "rope_theta": float(params.get("rope_theta", 10000.0))},
                                tie_word_embeddings=tied)
    if not isinstance(vision, dict):
        raise ParamsError("no vision_encoder section (a text-only Mistral release has no "
                          "registered family here)")
    _unknown(vision, set(VISION_FIELDS) | VISION_OTHER, "vision_encoder")
    fields = {VISION_FIELDS[k]: v for k, v in vision.items() if k in VISION_FIELDS and v is not None}
    vision_config = PixtralVisionConfig(**fields, hidden_act="silu",
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": float(vision.get("rope_theta", 10000.0))})
    image_token = next((vision[k] for k in ("image_token_id", "image_token_index") if vision.get(k) is not None), 10)
    bias = vision.get("adapter_bias") is not False
    merge = vision.get("spatial_merge_size")
    if merge is None and vision.get("mm_projector_id") not in MERGER_IDS[:1]:
        raise ParamsError(f"vision_encoder: mm_projector_id {vision.get('mm_projector_id')!r} "
                          "without spatial_merge_size")
    if merge is not None:
        if vision.get("mm_projector_id") not in MERGER_IDS or not vision.get("add_pre_mm_projector_layer_norm", True):
            raise ParamsError("vision_encoder: only the patch merger with its pre-norm "
                              f"(mm_projector_id 'patch_merge') is supported, got {vision.get('mm_projector_id')!r}")
        return Mistral3Config(vision_config=vision_config, text_config=text_config,
                              image_token_index=image_token, spatial_merge_size=int(merge),
                              projector_hidden_act="gelu", multimodal_projector_bias=bias,
                              vision_feature_layer=-1, tie_word_embeddings=tied)
    return LlavaConfig(vision_config=vision_config, text_config=text_config, image_token_index=image_token,
                       projector_hidden_act="gelu", vision_feature_layer=-1,
                       vision_feature_select_strategy="full", multimodal_projector_bias=bias,
                       tie_word_embeddings=tied)


# What params.json states that a config.json beside it states too: params.json name -> (the
# sub-config, the attribute) in the HF config. A context length (max_seq_len,
# max_position_embeddings) is left out: it sizes no weight and changes nothing a check runs.
_COMPARED_TEXT = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "head_dim": "head_dim",
                  "hidden_dim": "intermediate_size", "n_heads": "num_attention_heads",
                  "n_kv_heads": "num_key_value_heads", "norm_eps": "rms_norm_eps", "vocab_size": "vocab_size"}
_MISSING = object()


def _differs(stated, held) -> bool:
    if isinstance(stated, bool) or isinstance(held, bool):
        return stated is not held
    if isinstance(stated, (int, float)) and isinstance(held, (int, float)):
        if isinstance(stated, int) and isinstance(held, int):
            return stated != held
        return not math.isclose(stated, held, rel_tol=1e-9)  # NaN is close to nothing
    return stated != held


def params_disagreements(params: dict, cfg) -> list[str]:
    """Where ``params.json`` (``params``) and the HF config ``cfg`` read beside it (a whole
    Mistral3 / LLaVA config) state the same field differently: ``"name: params.json X,
    config.json Y"`` for each, by params.json's names. Fields only one of them states are not
    compared."""
    from mmparity.config import rope_theta, tied_embeddings

    text, vision = getattr(cfg, "text_config", None), getattr(cfg, "vision_config", None)
    pairs = [(k, params.get(k), getattr(text, attr, _MISSING)) for k, attr in _COMPARED_TEXT.items()]
    pairs.append(("rope_theta", params.get("rope_theta"), rope_theta(text) if text is not None else _MISSING))
    pairs.append(("tied_embeddings", params.get("tied_embeddings"), tied_embeddings(cfg)))
    encoder = params.get("vision_encoder")
    if isinstance(encoder, dict) and vision is not None:
        pairs += [(f"vision_encoder.{k}", encoder.get(k), getattr(vision, attr, _MISSING))
                  for k, attr in VISION_FIELDS.items()]
        pairs.append(("vision_encoder.rope_theta", encoder.get("rope_theta"), rope_theta(vision)))
        pairs.append(("vision_encoder.spatial_merge_size", encoder.get("spatial_merge_size"),
                      getattr(cfg, "spatial_merge_size", _MISSING)))
        image_token = next((encoder[k] for k in ("image_token_id", "image_token_index")
                            if encoder.get(k) is not None), None)
        pairs.append(("vision_encoder.image_token_id", image_token, getattr(cfg, "image_token_index", _MISSING)))
        pairs.append(("vision_encoder.adapter_bias", encoder.get("adapter_bias"),
                      getattr(cfg, "multimodal_projector_bias", _MISSING)))
    return [f"{name}: params.json {_shown(stated)}, config.json {_shown(held)}" for name, stated, held in pairs
            if stated is not None and held is not _MISSING and held is not None and _differs(stated, held)]


def params_from_config(cfg) -> dict:
    """The ``params.json`` a Mistral-native release of ``cfg`` carries (tests write tiny ones)."""
    text, vision = cfg.text_config, cfg.vision_config
    params = {"dim": text.hidden_size, "n_layers": text.num_hidden_layers, "head_dim": text.head_dim,
              "hidden_dim": text.intermediate_size, "n_heads": text.num_attention_heads,
              "n_kv_heads": text.num_key_value_heads, "norm_eps": text.rms_norm_eps,
              "vocab_size": text.vocab_size, "max_position_embeddings": text.max_position_embeddings,
              "rope_theta": text.rope_parameters["rope_theta"],
              "tied_embeddings": bool(getattr(cfg, "tie_word_embeddings", False))}
    encoder = {"hidden_size": vision.hidden_size, "num_channels": vision.num_channels,
               "image_size": vision.image_size, "patch_size": vision.patch_size,
               "intermediate_size": vision.intermediate_size,
               "num_hidden_layers": vision.num_hidden_layers,
               "num_attention_heads": vision.num_attention_heads, "head_dim": vision.head_dim,
               "rope_theta": vision.rope_parameters["rope_theta"],
               "image_token_id": cfg.image_token_index, "adapter_bias": bool(cfg.multimodal_projector_bias)}
    if has_patch_merger(cfg):
        encoder.update(spatial_merge_size=cfg.spatial_merge_size, mm_projector_id="patch_merge")
    params["vision_encoder"] = encoder
    return params
