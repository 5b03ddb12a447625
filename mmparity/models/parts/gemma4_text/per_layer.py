"""Gemma 4 E2B / E4B's two additions to the decoder, as config facts and converter rules (the mcore
modules are :mod:`mmparity.models.parts.gemma4_text.per_layer_native`):

* per-layer inputs (PLE, ``hidden_size_per_layer_input``): a second token table of ``layers · P``
  columns (``embed_tokens_per_layer``) and a projection of the input embeddings to the same width
  (``per_layer_model_projection``, RMS-normed per layer by ``per_layer_projection_norm``) give each
  layer a ``P``-wide input; after its MLP the layer adds
  ``norm(projection(act(gate(h)) · input))`` to its residual;
* shared keys and values (``num_kv_shared_layers``): the last layers compute queries only and
  attend over the keys and values of the last earlier layer of their own type (sliding or full).
  transformers builds no key / value projection or key norm for them, so ``save_pretrained``
  writes none; a checkpoint that has them anyway (transformers ignores them on load) has them
  left out by name and counted (:func:`unused_hf`). Where ``use_double_wide_mlp`` is set, those
  layers' MLPs are twice as wide.

Megatron has no place for either. The layout mmparity writes (its native model's):

* under ``language_model.embedding.per_layer.``, on the first pipeline stage with the word
  embedding (the per-layer inputs are computed from the ids and the input embeddings, which only
  that stage has): ``embeddings.weight`` (the table, padded and split over TP by vocabulary rows
  as the word embedding is: it is ``vocab × layers · P``, the largest tensor of E2B),
  ``projection.weight`` and ``projection_norm.weight``, whole on every TP rank;
* in each layer: ``per_layer_input_gate.weight``, ``per_layer_projection.weight``,
  ``post_per_layer_input_norm.weight``, whole on every TP rank (``P`` is small);
* a shared layer's attention: ``linear_q.weight`` (split over TP by heads, as ``linear_qkv``'s
  query rows are) with the input norm fused in as ``linear_q.layer_norm_weight`` (mcore's
  cross-attention name for a query-only projection), ``q_layernorm``, ``linear_proj``; no
  ``linear_qkv`` and no ``k_layernorm``.
"""

from __future__ import annotations

import re

from mmparity.config import padded_vocab_size
from mmparity.mapping.ops import PadRows
from mmparity.mapping.rules import VOCAB_MULTIPLE, Rule, rename

ROOT = "language_model.embedding.per_layer."
_MC = "language_model.decoder.layers."


def ple_dim(text) -> int:
    """Each layer's per-layer input width ``P`` (0: the model has no per-layer inputs)."""
    return int(getattr(text, "hidden_size_per_layer_input", 0) or 0)


def shared_from(text) -> tuple:
    """Per layer, the earlier layer whose keys and values it attends over (None: its own), as
    transformers assigns them: the last ``num_kv_shared_layers`` layers each take the last
    layer of their type before them."""
    n, shared = text.num_hidden_layers, int(getattr(text, "num_kv_shared_layers", 0) or 0)
    first = n - shared
    out = []
    for i in range(n):
        if i < first or shared == 0:
            out.append(None)
            continue
        kind = text.layer_types[i]
        out.append(next((j for j in range(first - 1, -1, -1) if text.layer_types[j] == kind), None))
    return tuple(out)


def is_shared(text, i: int) -> bool:
    return int(getattr(text, "num_kv_shared_layers", 0) or 0) > 0 and i >= text.num_hidden_layers - int(
        text.num_kv_shared_layers)


def mlp_width(text, i: int) -> int:
    """Layer ``i``'s MLP width: doubled on shared layers where ``use_double_wide_mlp`` says so."""
    double = bool(getattr(text, "use_double_wide_mlp", False)) and is_shared(text, i)
    return text.intermediate_size * (2 if double else 1)


def problems(text) -> list[str]:
    """What of PLE and shared keys / values the native model cannot reproduce."""
    out = []
    shared = int(getattr(text, "num_kv_shared_layers", 0) or 0)
    if shared >= text.num_hidden_layers > 0:
        out.append(f"text_config: num_kv_shared_layers={shared} of {text.num_hidden_layers} layers: no layer "
                   "computes the keys and values they would share")
    elif shared and None in [s for i, s in enumerate(shared_from(text)) if is_shared(text, i)]:
        out.append(f"text_config: num_kv_shared_layers={shared}: a shared layer's type (sliding or full) has no "
                   "earlier layer of that type to take keys and values from")
    if ple_dim(text) and not getattr(text, "vocab_size_per_layer_input", None):
        out.append("text_config: hidden_size_per_layer_input without vocab_size_per_layer_input")
    return out


def pipeline_problems(text, pp: int) -> list[str]:
    """The per-layer inputs are computed on the first stage and a shared layer reads another layer's
    keys: mmparity's pipeline hands a stage only the hidden state."""
    if pp <= 1:
        return []
    named = [n for n, on in (("hidden_size_per_layer_input", ple_dim(text)),
                             ("num_kv_shared_layers", getattr(text, "num_kv_shared_layers", 0))) if on]
    return [f"text_config: {n}: not run under pipeline parallelism (a stage receives only the hidden state); "
            "check it with --pp 1 (convert takes any --pp)" for n in named]


def megatron_refusal(text) -> str | None:
    """Why megatron-core's ``GPTModel`` cannot hold this language model (None: it can)."""
    missing = []
    if ple_dim(text):
        missing.append("per-layer input embeddings (hidden_size_per_layer_input)")
    if getattr(text, "num_kv_shared_layers", 0):
        missing.append("layers sharing earlier layers' keys and values (num_kv_shared_layers)")
    if not missing:
        return None
    return ("megatron-core's GPTModel has no " + " nor ".join(missing)
            + "; the native model runs it (check --impl native)")


# --- converter rules ---------------------------------------------------------------------------------


def embedding_rules(text, lm_root: str) -> tuple:
    """The per-layer input tables (before the layers in the plan: they live on the first stage)."""
    if not ple_dim(text):
        return ()
    vocab = int(text.vocab_size_per_layer_input)
    return (Rule(ROOT + "embeddings.weight", lm_root + "embed_tokens_per_layer.weight",
                 PadRows(vocab, padded_vocab_size(vocab, VOCAB_MULTIPLE)), "vocab"),
            rename(ROOT + "projection.weight", lm_root + "per_layer_model_projection.weight"),
            rename(ROOT + "projection_norm.weight", lm_root + "per_layer_projection_norm.weight"))


def layer_rules(text, lm_root: str) -> tuple:
    """Each layer's gate, projection and norm of its per-layer input, whole on every TP rank."""
    if not ple_dim(text):
        return ()
    hf, mc = lm_root + "layers.{i}.", _MC + "{i}."
    return tuple(rename(mc + name + ".weight", hf + name + ".weight")
                 for name in ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm"))


def shared_attention_rules(text, lm_root: str, i: int) -> tuple:
    """A shared layer's query projection and its fused input norm (it has no keys or values)."""
    hf, mc = f"{lm_root}layers.{i}.", f"{_MC}{i}.self_attention."
    return (rename(mc + "linear_q.layer_norm_weight", hf + "input_layernorm.weight"),
            rename(mc + "linear_q.weight", hf + "self_attn.q_proj.weight", "column"))


def unused_hf(text, lm_root: str) -> tuple:
    """Patterns of what a shared layer's checkpoint may carry that no model reads (its key / value
    projections and norms): left out by name and counted, as transformers ignores them on load."""
    shared = [i for i in range(text.num_hidden_layers) if is_shared(text, i)]
    if not shared:
        return ()
    layers = "|".join(str(i) for i in shared)
    return (rf"^{re.escape(lm_root)}layers\.({layers})\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.",)


def layer_shapes(text) -> dict:
    """The decoder's state-dict shapes PLE adds, and those a shared layer lacks (as None)."""
    p, h = ple_dim(text), text.hidden_size
    out: dict = {}
    if p:
        out |= {"embed_tokens_per_layer.weight": (text.vocab_size_per_layer_input, text.num_hidden_layers * p),
                "per_layer_model_projection.weight": (text.num_hidden_layers * p, h),
                "per_layer_projection_norm.weight": (p,)}
    for i in range(text.num_hidden_layers):
        if p:
            out |= {f"layers.{i}.per_layer_input_gate.weight": (p, h),
                    f"layers.{i}.per_layer_projection.weight": (h, p),
                    f"layers.{i}.post_per_layer_input_norm.weight": (h,)}
        if is_shared(text, i):
            out |= {f"layers.{i}.self_attn.{n}.weight": None for n in ("k_proj", "v_proj", "k_norm")}
        f = mlp_width(text, i)
        if f != text.intermediate_size:
            out |= {f"layers.{i}.mlp.gate_proj.weight": (f, h), f"layers.{i}.mlp.up_proj.weight": (f, h),
                    f"layers.{i}.mlp.down_proj.weight": (h, f)}
    return out
