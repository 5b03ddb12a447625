"""The Gemma 4 language-model part: HF ``Gemma4TextModel`` keys (under a whole model's
``language_model.``, or a ``Gemma4ForCausalLM``'s ``model.``) <-> Megatron's ``GPTModel`` under
``language_model.``, in the names Megatron-Bridge's Gemma 3 gives the same norms:

* the input norm in ``linear_qkv.layer_norm_weight``, q/k/v fused in Megatron's per-group order
  with each layer's own width (full layers are wider: the rule is per layer; where keys are the
  values, the value rows repeat the key rows, :class:`FuseKeysAsValues`), q/k norms in
  ``q_layernorm`` / ``k_layernorm`` (HF's ``v_norm`` has no weight), the post-attention norm in
  ``linear_proj.post_layernorm``, the pre-feedforward norm in ``linear_fc1.layer_norm_weight``,
  gate/up fused, the post-feedforward norm in ``linear_fc2.post_layernorm``;
* ``layer_scalar``, which no Megatron class has a place for, as ``decoder.layers.N.layer_scalar``
  (the native layer's buffer of the same name), copied exactly;
* norm weights copied as HF stores them (Gemma 4 scales by ``w``); the embedding padded as
  Megatron-LM pads vocabularies; an untied head as ``output_layer.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmparity.config import padded_vocab_size
from mmparity.mapping.ops import FuseQKV, LayoutError, Op, PadRows, fuse_gate_up
from mmparity.mapping.rules import VOCAB_MULTIPLE, LanguageKeys, Rule, rename
from mmparity.models.parts.gemma4_text import per_layer
from mmparity.models.parts.gemma4_text.config import keys_as_values, layer_groups, layer_head_dim, tp_problems
from mmparity.models.parts.gemma4_text.moe import experts, is_moe, moe_rules


@dataclass(frozen=True, repr=False)
class FuseKeysAsValues(Op):
    """q and k of a layer whose keys are its values (``attention_k_eq_v``) -> mcore ``linear_qkv``
    with each group's value rows a copy of its key rows: Megatron's attention has no layer without
    a value projection, and with equal rows it computes transformers' function (the values are
    the key projection's output, value-normed before any key norm or RoPE). Back, the value rows
    must still equal the key rows, or the checkpoint is refused by name: a model trained with them
    apart is not a keys-as-values model any more."""

    fuse: FuseQKV
    n_hf = 2

    def apply(self, hf):
        q, k = hf
        return self.fuse.apply([q, k, k])

    def apply_pieces(self, hf):
        q, k = hf
        return self.fuse.apply_pieces([q, k, k])

    def invert(self, mcore):
        q, k, v = self.fuse.invert(mcore)
        # The plan runs every op on shapes alone (meta tensors) first: values are checked when real.
        if not k.is_meta and not torch.equal(k, v):
            raise LayoutError(f"{self!r}: the value rows differ from the key rows; this layer's transformers "
                              "class has no value projection to hold them (attention_k_eq_v)")
        return [q, k]

    def __repr__(self):
        return f"FuseKeysAsValues({self.fuse!r})"

MCORE_ROOT = "language_model."
LAYOUTS = ("hf",)
_MC = MCORE_ROOT + "decoder.layers."


def _qkv_rules(text, lm_root: str) -> tuple:
    """Per layer (a shared layer has its query projection only: :mod:`.per_layer`): the fused
    q/k/v with the input norm, and the key norm."""
    rules = ()
    for i in range(text.num_hidden_layers):
        if per_layer.is_shared(text, i):
            rules += per_layer.shared_attention_rules(text, lm_root, i)
            continue
        attn = f"{lm_root}layers.{i}.self_attn."
        rules += (rename(f"{_MC}{i}.self_attention.linear_qkv.layer_norm_weight",
                         f"{lm_root}layers.{i}.input_layernorm.weight"),
                  rename(f"{_MC}{i}.self_attention.k_layernorm.weight", attn + "k_norm.weight"))
        fuse = FuseQKV(text.num_attention_heads, layer_groups(text, i), layer_head_dim(text, i))
        names = ("q_proj", "k_proj") if keys_as_values(text, i) else ("q_proj", "k_proj", "v_proj")
        rules += (Rule(f"{_MC}{i}.self_attention.linear_qkv.weight", tuple(attn + p + ".weight" for p in names),
                       FuseKeysAsValues(fuse) if keys_as_values(text, i) else fuse, "qkv"),)
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
        *per_layer.embedding_rules(text, lm_root),
        *_qkv_rules(text, lm_root),
        rename(mc + "self_attention.q_layernorm.weight", attn + "q_norm.weight"),
        rename(mc + "self_attention.linear_proj.weight", attn + "o_proj.weight", "row"),
        rename(mc + "self_attention.linear_proj.post_layernorm.weight", hf + "post_attention_layernorm.weight"),
        *(moe_rules(text, hf, mc) if is_moe(text) else (
            rename(mc + "mlp.linear_fc1.layer_norm_weight", hf + "pre_feedforward_layernorm.weight"),
            Rule(mc + "mlp.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), fuse_gate_up(),
                 "gated"),
            rename(mc + "mlp.linear_fc2.weight", mlp + "down_proj.weight", "row"),
            rename(mc + "mlp.linear_fc2.post_layernorm.weight", hf + "post_feedforward_layernorm.weight"))),
        rename(mc + "layer_scalar", hf + "layer_scalar"),
        *per_layer.layer_rules(text, lm_root),
        rename(MCORE_ROOT + "decoder.final_layernorm.weight", lm_root + "norm.weight"),
    )
    if not tied:
        rules += (Rule(MCORE_ROOT + "output_layer.weight", head_key, vocab, "vocab"),)
    return rules


def variables(text) -> dict:
    return {"i": text.num_hidden_layers}


SPEC = LanguageKeys(layouts=LAYOUTS, rules=language_rules, tp_problems=tp_problems, variables=variables,
                    experts=experts)
