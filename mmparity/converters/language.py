"""The dense decoder part: HF Llama / Mistral / Qwen2 ``model.*`` <-> mcore ``GPTModel`` under
``language_model.``.

HF stores q/k in rotate-half order, which mcore's non-interleaved RoPE uses too, so attention only
fuses q/k/v into whole query groups (no per-head permutation, unlike the Pixtral tower). The
embedding and the output layer are padded as Megatron-LM pads them, to a multiple of
``make_vocab_size_divisible_by × TP`` (:func:`~mmparity.hfconfig.padded_vocab_size`; the table
states TP 1's and the engine re-pads for the TP size it converts to); export trims the padding.
Tied embeddings have no ``output_layer`` on the mcore side.
"""

from __future__ import annotations

from mmparity.converters.ops import FuseQKV, PadRows, fuse_gate_up
from mmparity.converters.rules import Rule, rename
from mmparity.hfconfig import decoder_biases, head_dim, padded_vocab_size

MCORE_ROOT = "language_model."


def language_rules(text, lm_root: str, head_key: str, *, tied: bool) -> tuple:
    """Rules for the decoder whose HF body is under ``lm_root`` (``embed_tokens``, ``layers.{i}``,
    ``norm``) and whose output head is ``head_key``; layers range over ``{i}``."""
    heads, groups, d = text.num_attention_heads, text.num_key_value_heads, head_dim(text)
    qkv_bias, linear_bias = decoder_biases(text)
    vocab = PadRows(text.vocab_size, padded_vocab_size(text.vocab_size))
    hf = lm_root + "layers.{i}."
    mc = MCORE_ROOT + "decoder.layers.{i}."
    attn, mlp = hf + "self_attn.", hf + "mlp."
    qkv = FuseQKV(heads, groups, d)
    rules = (
        Rule(MCORE_ROOT + "embedding.word_embeddings.weight", lm_root + "embed_tokens.weight", vocab, "vocab"),
        rename(mc + "self_attention.linear_qkv.layer_norm_weight", hf + "input_layernorm.weight"),
        Rule(mc + "self_attention.linear_qkv.weight",
             (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"), qkv, "qkv"),
        rename(mc + "self_attention.linear_proj.weight", attn + "o_proj.weight", "row"),
        rename(mc + "mlp.linear_fc1.layer_norm_weight", hf + "post_attention_layernorm.weight"),
        Rule(mc + "mlp.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"),
             fuse_gate_up(), "gated"),
        rename(mc + "mlp.linear_fc2.weight", mlp + "down_proj.weight", "row"),
        rename(MCORE_ROOT + "decoder.final_layernorm.weight", lm_root + "norm.weight"),
    )
    if qkv_bias:
        rules += (Rule(mc + "self_attention.linear_qkv.bias",
                       (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"), qkv, "qkv"),)
    if linear_bias:
        # Row-parallel biases are added once after the reduction: every rank holds all of it.
        rules += (rename(mc + "self_attention.linear_proj.bias", attn + "o_proj.bias"),
                  Rule(mc + "mlp.linear_fc1.bias", (mlp + "gate_proj.bias", mlp + "up_proj.bias"),
                       fuse_gate_up(), "gated"),
                  rename(mc + "mlp.linear_fc2.bias", mlp + "down_proj.bias"))
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
