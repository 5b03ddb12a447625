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

from transformers import LlavaConfig, Mistral3Config, MistralConfig, PixtralVisionConfig

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


def _unknown(section: dict, known: set, where: str) -> None:
    extra = sorted(set(section) - known)
    if extra:
        raise ParamsError(f"{where}: fields not translated: {', '.join(extra)} (they may change the "
                          "model's function; give a config.json instead)")


def config_from_params(params: dict):
    """The HF config of a Mistral-native release from its ``params.json`` mapping."""
    if not isinstance(params, dict):
        raise ParamsError("not a JSON object")
    _unknown(params, set(TEXT_FIELDS) | TEXT_OTHER, "top level")
    if params.get("sliding_window") is not None:
        raise ParamsError(f"sliding_window={params['sliding_window']} is not supported "
                          "(the decoder is fully causal)")
    missing = [name for name in ("dim", "n_layers", "hidden_dim", "n_heads", "vocab_size", "norm_eps")
               if name not in params]
    if missing:
        raise ParamsError(f"missing {', '.join(missing)}")
    text = {TEXT_FIELDS[k]: v for k, v in params.items() if k in TEXT_FIELDS}
    text.setdefault("num_key_value_heads", params["n_heads"])
    text.setdefault("head_dim", params["dim"] // params["n_heads"])
    tied = bool(params.get("tied_embeddings", False))
    text_config = MistralConfig(**text, sliding_window=None, hidden_act="silu",
                                rope_parameters={"rope_type": "default",
                                                 "rope_theta": float(params.get("rope_theta", 10000.0))},
                                tie_word_embeddings=tied)
    vision = params.get("vision_encoder")
    if not isinstance(vision, dict):
        raise ParamsError("no vision_encoder section (a text-only Mistral release has no "
                          "registered family here)")
    _unknown(vision, set(VISION_FIELDS) | VISION_OTHER, "vision_encoder")
    fields = {VISION_FIELDS[k]: v for k, v in vision.items() if k in VISION_FIELDS}
    vision_config = PixtralVisionConfig(**fields, hidden_act="silu",
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": float(vision.get("rope_theta", 10000.0))})
    image_token = int(vision.get("image_token_id", vision.get("image_token_index", 10)))
    bias = bool(vision.get("adapter_bias", True))
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
    if cfg.model_type == "mistral3":
        encoder.update(spatial_merge_size=cfg.spatial_merge_size, mm_projector_id="patch_merge")
    params["vision_encoder"] = encoder
    return params
