"""The pairs Gemma 4 E2B / E4B add on both sides (:mod:`mmparity.models.parts.gemma4_text.per_layer`):
the per-layer table's scaled lookup and the projection's per-layer norm (before the decoder), each
layer's per-layer input gate (before the layer's own pair), and a shared layer's input norm (its
fused norm sits in ``linear_q``, where the generic pairing looks in ``linear_qkv``)."""

from __future__ import annotations

from mmparity.models.kimi_k25_vl.cases import LANGUAGE_LAYER
from mmparity.models.parts.gemma4_text.per_layer import ROOT, is_shared, ple_dim
from mmparity.models.spec import Pair, sbh_tokens_2d, tokens_2d

TABLE, NORM = ROOT + "embeddings", ROOT + "projection_norm"


def _insert(pairs: list, before: str, pair: Pair) -> list:
    at = next((k for k, p in enumerate(pairs) if p.name == before), len(pairs))
    return pairs[:at] + [pair] + pairs[at:]


def _layer_pairs(pairs: list, text, layers, extract, *, native: bool) -> list:
    for i, layer in layers:
        name = LANGUAGE_LAYER.format(i)
        if layer is None:
            continue
        if native and is_shared(text, i):
            pairs = _insert(pairs, f"{name}.self_attention",
                            Pair(f"{name}.input_layernorm", layer.self_attention.linear_q.normed, extract))
        if ple_dim(text):
            pairs = _insert(pairs, name, Pair(f"{name}.per_layer_input_gate", layer.per_layer_input_gate, extract))
    return pairs


def reference_pairs(pairs: list, text_model, text) -> list:
    """``pairs`` (HF's, the decoder's among them) with what E2B / E4B add."""
    if ple_dim(text):
        first = next(k for k, p in enumerate(pairs) if p.name.startswith("language_model."))
        pairs = pairs[:first] + [Pair(TABLE, text_model.embed_tokens_per_layer, tokens_2d),
                                 Pair(NORM, text_model.per_layer_projection_norm, tokens_2d)] + pairs[first:]
    return _layer_pairs(pairs, text, enumerate(text_model.layers), tokens_2d, native=False)


def native_pairs(pairs: list, language_model, text, layers) -> list:
    """``pairs`` (the native model's) with what E2B / E4B add; ``layers``: this stage's, numbered."""
    per_layer = getattr(getattr(language_model, "embedding", None), "per_layer", None)
    if per_layer is not None:
        first = next(k for k, p in enumerate(pairs) if p.name.startswith("language_model."))
        pairs = pairs[:first] + [Pair(TABLE, per_layer.looked_up, sbh_tokens_2d),
                                 Pair(NORM, per_layer.projection_norm, sbh_tokens_2d)] + pairs[first:]
    return _layer_pairs(pairs, text, layers, sbh_tokens_2d, native=True)
