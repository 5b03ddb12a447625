"""The Gemma 4 language-model part: HF ``Gemma4TextModel`` keys (under a whole model's
``language_model.``, or a ``Gemma4ForCausalLM``'s ``model.``) <-> Megatron's ``GPTModel`` under
``language_model.``, in the names Megatron-Bridge's Gemma 3 gives the same norms:

* the input norm in ``linear_qkv.layer_norm_weight``, q/k/v fused in Megatron's per-group order
  with each layer's own width (full layers are wider: the rule is per layer), q/k norms in
  ``q_layernorm`` / ``k_layernorm`` (HF's ``v_norm`` has no weight), the post-attention norm in
  ``linear_proj.post_layernorm``, the pre-feedforward norm in ``linear_fc1.layer_norm_weight``,
  gate/up fused, the post-feedforward norm in ``linear_fc2.post_layernorm``;
* ``layer_scalar``, which no Megatron class has a place for, as ``decoder.layers.N.layer_scalar``
  (the native layer's buffer of the same name), copied exactly;
* norm weights copied as HF stores them (Gemma 4 scales by ``w``); the embedding padded as
  Megatron-LM pads vocabularies; an untied head as ``output_layer.weight``.
"""

from __future__ import annotations

from mmparity.config import padded_vocab_size
from mmparity.mapping.ops import FuseQKV, PadRows, fuse_gate_up
from mmparity.mapping.rules import VOCAB_MULTIPLE, LanguageKeys, Rule, rename
from mmparity.models.parts.gemma4_text.config import layer_groups, layer_head_dim, tp_problems

MCORE_ROOT = "language_model."
LAYOUTS = ("hf",)
_MC = MCORE_ROOT + "decoder.layers."


def _qkv_rules(text, lm_root: str) -> tuple:
    rules = ()
    for i in range(text.num_hidden_layers):
        attn = f"{lm_root}layers.{i}.self_attn."
        fuse = FuseQKV(text.num_attention_heads, layer_groups(text, i), layer_head_dim(text, i))
        rules += (Rule(f"{_MC}{i}.self_attention.linear_qkv.weight",
                       tuple(attn + p + ".weight" for p in ("q_proj", "k_proj", "v_proj")), fuse, "qkv"),)
    return rules


def language_rules(text, lm_root: str, head_key: str, *, tied: bool, layout: str = "hf") -> tuple:
    """Rules for the decoder whose body is under ``lm_root`` and whose output head is ``head_key``."""
    if layout not in LAYOUTS:
        raise ValueError(f"Gemma 4 decoder layout {layout!r}; known: {', '.join(LAYOUTS)}")
    vocab = PadRows(text.vocab_size, padded_vocab_size(text.vocab_size, VOCAB_MULTIPLE))
    hf, mc = lm_root + "layers.{i}.", _MC + "{i}."
    attn, mlp = hf + "self_attn.", hf + "mlp."
    rules = (
        Rule(MCORE_ROOT + "embedding.word_embeddings.weight", lm_root + "embed_tokens.weight", vocab, "vocab"),
        rename(mc + "self_attention.linear_qkv.layer_norm_weight", hf + "input_layernorm.weight"),
        *_qkv_rules(text, lm_root),
        rename(mc + "self_attention.q_layernorm.weight", attn + "q_norm.weight"),
        rename(mc + "self_attention.k_layernorm.weight", attn + "k_norm.weight"),
        rename(mc + "self_attention.linear_proj.weight", attn + "o_proj.weight", "row"),
        rename(mc + "self_attention.linear_proj.post_layernorm.weight", hf + "post_attention_layernorm.weight"),
        rename(mc + "mlp.linear_fc1.layer_norm_weight", hf + "pre_feedforward_layernorm.weight"),
        Rule(mc + "mlp.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), fuse_gate_up(), "gated"),
        rename(mc + "mlp.linear_fc2.weight", mlp + "down_proj.weight", "row"),
        rename(mc + "mlp.linear_fc2.post_layernorm.weight", hf + "post_feedforward_layernorm.weight"),
        rename(mc + "layer_scalar", hf + "layer_scalar"),
        rename(MCORE_ROOT + "decoder.final_layernorm.weight", lm_root + "norm.weight"),
    )
    if not tied:
        rules += (Rule(MCORE_ROOT + "output_layer.weight", head_key, vocab, "vocab"),)
    return rules


def variables(text) -> dict:
    return {"i": text.num_hidden_layers}


SPEC = LanguageKeys(layouts=LAYOUTS, rules=language_rules, tp_problems=tp_problems, variables=variables)
