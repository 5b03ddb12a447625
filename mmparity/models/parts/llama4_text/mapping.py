"""The Llama 4 language-model part: HF ``Llama4ForCausalLM`` keys (under a whole model's
``language_model.``) <-> Megatron's MoE ``GPTModel`` under ``language_model.``.

Every layer: the input RMSNorm fused into ``linear_qkv`` (TE's names), q/k/v fused in Megatron's
per-group order with no permutation (both sides rotate adjacent pairs), ``linear_proj``. Dense
layers (variable ``{d}``): the post-attention norm fused into ``mlp.linear_fc1`` = [gate; up].
MoE layers (``{m}``): ``pre_mlp_layernorm``, ``mlp.router.weight``, the shared expert as
``mlp.shared_experts``, and the routed experts in TEGroupedMLP's names
``mlp.experts.linear_fc1.weight{e}`` / ``linear_fc2.weight{e}``.

transformers keeps each MoE layer's experts as two stacks, read and written as saved:
``feed_forward.experts.gate_up_proj`` ``[E, H, 2I]`` (each expert's [gate | up] as the input side
of a matmul, the transpose of mcore's ``linear_fc1`` ``[2I, H]``, gate first) and
``feed_forward.experts.down_proj`` ``[E, I, H]`` (the transpose of ``linear_fc2`` ``[H, I]``).
"""

from __future__ import annotations

from mmparity.config import head_dim, padded_vocab_size, query_groups
from mmparity.mapping.ops import FuseQKV, PadRows, UnstackTransposed
from mmparity.mapping.rules import VOCAB_MULTIPLE, LanguageKeys, Rule, rename
from mmparity.models.parts.deepseek_v3.mapping import gated_mlp_rules
from mmparity.models.parts.llama4_text.config import moe_layers

MCORE_ROOT = "language_model."
LAYOUTS = ("hf",)
_MC = MCORE_ROOT + "decoder.layers."


def _mlp_rules(text, lm_root: str) -> tuple:
    """Layer by layer (MoE layers need not be evenly spaced): the dense MLP or the MoE layer."""
    rules, count = (), text.num_local_experts
    for i, sparse in enumerate(moe_layers(text)):
        hf, mc = f"{lm_root}layers.{i}.", f"{_MC}{i}."
        if not sparse:
            rules += (rename(mc + "mlp.linear_fc1.layer_norm_weight", hf + "post_attention_layernorm.weight"),
                      *gated_mlp_rules(hf + "feed_forward.", mc + "mlp."))
            continue
        experts = mc + "mlp.experts."
        rules += (
            rename(mc + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"),
            rename(mc + "mlp.router.weight", hf + "feed_forward.router.weight"),
            *gated_mlp_rules(hf + "feed_forward.shared_expert.", mc + "mlp.shared_experts."),
            # One stacked HF tensor feeds every expert's mcore tensor: the rule lists them all.
            Rule(tuple(experts + f"linear_fc1.weight{e}" for e in range(count)),
                 hf + "feed_forward.experts.gate_up_proj", UnstackTransposed(count), "gated"),
            Rule(tuple(experts + f"linear_fc2.weight{e}" for e in range(count)),
                 hf + "feed_forward.experts.down_proj", UnstackTransposed(count), "row"))
    return rules


def language_rules(text, lm_root: str, head_key: str, *, tied: bool, layout: str = "hf") -> tuple:
    """Rules for the decoder whose body is under ``lm_root`` and whose output head is ``head_key``."""
    if layout not in LAYOUTS:
        raise ValueError(f"Llama 4 decoder layout {layout!r}; known: {', '.join(LAYOUTS)}")
    vocab = PadRows(text.vocab_size, padded_vocab_size(text.vocab_size, VOCAB_MULTIPLE))
    every, mc_every = lm_root + "layers.{i}.", _MC + "{i}."
    attn, sa = every + "self_attn.", mc_every + "self_attention."
    fuse = FuseQKV(text.num_attention_heads, query_groups(text), head_dim(text))
    rules = (
        Rule(MCORE_ROOT + "embedding.word_embeddings.weight", lm_root + "embed_tokens.weight", vocab, "vocab"),
        rename(sa + "linear_qkv.layer_norm_weight", every + "input_layernorm.weight"),
        Rule(sa + "linear_qkv.weight", tuple(attn + p + ".weight" for p in ("q_proj", "k_proj", "v_proj")),
             fuse, "qkv"),
        rename(sa + "linear_proj.weight", attn + "o_proj.weight", "row"),
        *_mlp_rules(text, lm_root),
        rename(MCORE_ROOT + "decoder.final_layernorm.weight", lm_root + "norm.weight"),
    )
    if not tied:
        rules += (Rule(MCORE_ROOT + "output_layer.weight", head_key, vocab, "vocab"),)
    return rules


def variables(text) -> dict:
    return {"i": text.num_hidden_layers}


def tp_problems(text, tp: int) -> list[str]:
    sizes = {"text num_attention_heads": text.num_attention_heads,
             "text num_key_value_heads": query_groups(text),
             "text intermediate_size": text.intermediate_size,
             "text intermediate_size_mlp": text.intermediate_size_mlp}
    return [f"tp={tp} does not divide {name}={value}" for name, value in sizes.items() if value % tp]


def experts(text) -> int:
    return int(text.num_local_experts) if any(moe_layers(text)) else 0


SPEC = LanguageKeys(layouts=LAYOUTS, rules=language_rules, tp_problems=tp_problems, variables=variables,
                    experts=experts)
