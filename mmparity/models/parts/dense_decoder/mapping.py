"""The dense decoder part: HF Llama / Mistral / Qwen2 ``model.*`` <-> mcore ``GPTModel`` under
``language_model.``.

HF stores q/k in rotate-half order, which mcore's non-interleaved RoPE uses too, so attention only
fuses q/k/v into whole query groups (no per-head permutation, unlike the Pixtral tower). The
embedding and the output layer are padded as Megatron-LM pads them, to a multiple of
``make_vocab_size_divisible_by × TP`` (:func:`~mmparity.config.padded_vocab_size`; the table
states TP 1's and the engine re-pads for the TP size it converts to); export trims the padding.
Tied embeddings have no ``output_layer`` on the mcore side.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmparity.mapping.ops import FuseQKV, PadRows, RopeHalve, fuse_gate_up
from mmparity.mapping.rules import VOCAB_MULTIPLE, LanguageKeys, Rule, rename
from mmparity.config import decoder_biases, head_dim, padded_vocab_size

MCORE_ROOT = "language_model."


@dataclass(frozen=True)
class DecoderNames:
    """A layout's names for one decoder: the embedding and final norm under the body's root, the
    per-layer tensors under ``layers.{i}.``, and whether q/k rows are in the original interleaved
    order (Mistral's own files) rather than HF's rotate-half."""

    embedding: str
    final_norm: str
    input_norm: str
    q: str
    k: str
    v: str
    o: str
    post_norm: str
    gate: str
    up: str
    down: str
    interleaved_qk: bool = False


NAMES = {
    "hf": DecoderNames("embed_tokens", "norm", "input_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                       "self_attn.v_proj", "self_attn.o_proj", "post_attention_layernorm",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    # consolidated.safetensors, as Mistral releases it (transformers' conversion scripts' table).
    "mistral": DecoderNames("tok_embeddings", "norm", "attention_norm", "attention.wq", "attention.wk",
                            "attention.wv", "attention.wo", "ffn_norm", "feed_forward.w1",
                            "feed_forward.w3", "feed_forward.w2", interleaved_qk=True),
}


def language_rules(text, lm_root: str, head_key: str, *, tied: bool, layout: str = "hf") -> tuple:
    """Rules for the decoder whose body is under ``lm_root`` and whose output head is
    ``head_key``, in ``layout``'s names (:data:`NAMES`); layers range over ``{i}``."""
    names = NAMES[layout]
    heads, groups, d = text.num_attention_heads, text.num_key_value_heads, head_dim(text)
    qkv_bias, linear_bias = decoder_biases(text)
    vocab = PadRows(text.vocab_size, padded_vocab_size(text.vocab_size, VOCAB_MULTIPLE))
    hf = lm_root + "layers.{i}."
    mc = MCORE_ROOT + "decoder.layers.{i}."
    q, k, v, o = (hf + name for name in (names.q, names.k, names.v, names.o))
    gate, up, down = (hf + name for name in (names.gate, names.up, names.down))
    if names.interleaved_qk:
        halve_q, halve_k = RopeHalve(heads, d), RopeHalve(groups, d)
        qkv = FuseQKV(heads, groups, d, pre=(halve_q, halve_k, None))
    else:
        qkv = FuseQKV(heads, groups, d)
    rules = (
        Rule(MCORE_ROOT + "embedding.word_embeddings.weight", lm_root + names.embedding + ".weight",
             vocab, "vocab"),
        rename(mc + "self_attention.linear_qkv.layer_norm_weight", hf + names.input_norm + ".weight"),
        Rule(mc + "self_attention.linear_qkv.weight", (q + ".weight", k + ".weight", v + ".weight"),
             qkv, "qkv"),
        rename(mc + "self_attention.linear_proj.weight", o + ".weight", "row"),
        rename(mc + "mlp.linear_fc1.layer_norm_weight", hf + names.post_norm + ".weight"),
        Rule(mc + "mlp.linear_fc1.weight", (gate + ".weight", up + ".weight"), fuse_gate_up(), "gated"),
        rename(mc + "mlp.linear_fc2.weight", down + ".weight", "row"),
        rename(MCORE_ROOT + "decoder.final_layernorm.weight", lm_root + names.final_norm + ".weight"),
    )
    if qkv_bias:
        rules += (Rule(mc + "self_attention.linear_qkv.bias", (q + ".bias", k + ".bias", v + ".bias"),
                       qkv, "qkv"),)
    if linear_bias:
        # Row-parallel biases are added once after the reduction: every rank holds all of it.
        rules += (rename(mc + "self_attention.linear_proj.bias", o + ".bias"),
                  Rule(mc + "mlp.linear_fc1.bias", (gate + ".bias", up + ".bias"), fuse_gate_up(), "gated"),
                  rename(mc + "mlp.linear_fc2.bias", down + ".bias"))
    if not tied:
        rules += (Rule(MCORE_ROOT + "output_layer.weight", head_key, vocab, "vocab"),)
    return rules


def tp_problems(text, tp: int) -> list[str]:
    """Sizes of the decoder that tensor parallelism must divide."""
    sizes = {"text num_attention_heads": text.num_attention_heads,
             "text num_key_value_heads": text.num_key_value_heads,
             "text intermediate_size": text.intermediate_size,
             "text hidden_size (projector width)": text.hidden_size}
    return [f"tp={tp} does not divide {name}={value}" for name, value in sizes.items() if value % tp]


SPEC = LanguageKeys(layouts=tuple(NAMES), rules=language_rules, tp_problems=tp_problems)
