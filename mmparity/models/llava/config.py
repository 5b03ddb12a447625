"""The projector's one HF config -> Megatron ``TransformerConfig`` recipe of the VLMs composed as
LLaVA (LLaVA, Pixtral-12B) and as Mistral3 (Pixtral-Large): the native projectors
(:mod:`mmparity.models.llava.native`, :mod:`mmparity.models.pixtral_large.native`) and Megatron's
``MultimodalProjector`` (:mod:`mmparity.models.llava.megatron`) all build from it. The tower's and
the language model's recipes are their parts' own (``<part>/config.py``). Below it, LLaVA's HF
configuration class as config.json is read without transformers."""

from __future__ import annotations

from mmparity.config import ConfigType, pixel_shuffle_reduction, projector_bias

# transformers' InternVL projector LayerNorm is built without an epsilon: torch's default.
INTERNVL_PROJECTOR_EPS = 1e-5


def projection_fields(cfg) -> dict:
    """The projector MLP's ``TransformerConfig`` fields from the whole VLM's config: two linears to
    the text width, HF's projector activation, biases as ``multimodal_projector_bias`` says, the
    text config's RMSNorm epsilon (InternVL's: a LayerNorm over the pixel-shuffled vector, which its
    projector applies first). ``activation`` is the HF activation's name: each side turns it
    into its function. The attention fields, which an MLP never reads, are each side's."""
    text = cfg.text_config
    if pixel_shuffle_reduction(cfg) > 1:
        # InternVL's projector starts with a LayerNorm over the shuffled vector (torch's default
        # epsilon), held by linear_fc1 as Megatron-LM's normed projector holds it.
        norm = dict(normalization="LayerNorm", norm_eps=INTERNVL_PROJECTOR_EPS)
    else:
        norm = dict(normalization="RMSNorm", norm_eps=text.rms_norm_eps)
    return dict(hidden_size=text.hidden_size, ffn_hidden_size=text.hidden_size, **norm,
                activation=cfg.projector_hidden_act, gated=False, bias=projector_bias(cfg))


# --- HF config tables ---
# The configuration class config.json is read with, without transformers (mmparity.config's
# ConfigView): transformers 5's defaults of LlavaConfig; its sub-configs are read with the tables
# of the tower's and the text model's packages.


def _tied_from_text(v: dict, extra: dict) -> None:
    # transformers forwards the text config's flag when the whole config's own is unset.
    if not v["tie_word_embeddings"] and v["text_config"].tie_word_embeddings:
        v["tie_word_embeddings"] = True


HF_CONFIGS = {
    "llava": ConfigType({"vision_config": None, "text_config": None, "image_token_index": 32000,
                         "image_seq_length": 576, "projector_hidden_act": "gelu",
                         "vision_feature_select_strategy": "default", "vision_feature_layer": -2,
                         "multimodal_projector_bias": True, "tie_word_embeddings": False},
                        aliases={"image_token_id": "image_token_index"},
                        subs={"vision_config": ("clip_vision_model", True, {
                                  "intermediate_size": 4096, "hidden_size": 1024, "patch_size": 14,
                                  "image_size": 336, "num_hidden_layers": 24, "num_attention_heads": 16,
                                  "vocab_size": 32000, "projection_dim": 768}),
                              "text_config": ("llama", True, {})},
                        after=_tied_from_text),
}
