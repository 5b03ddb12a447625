"""The DeepSeek-V3 language-model part (Kimi-K2 / K2.5's decoder): HF ``DeepseekV3Model`` <->
Megatron's ``GPTModel`` with multi-latent attention and MoE layers, under ``language_model.``.

mcore names are those Megatron-LM's DeepSeek-V3 recipes produce with Transformer Engine
(``--multi-latent-attention --qk-layernorm --moe-grouped-gemm``):

* attention: ``input_layernorm`` (a separate norm: MLA's first projections are not norm-fused),
  ``linear_q_down_proj`` + ``linear_q_up_proj`` with the q LoRA norm fused in (or
  ``linear_q_proj`` without a q LoRA rank), ``linear_kv_down_proj`` (the KV latent and the shared
  rope key), ``linear_kv_up_proj`` with the KV latent norm fused in, ``linear_proj``. HF's rows
  are in mcore's order already: q is ``[heads × (nope ‖ rope)]``, kv_b ``[heads × (nope ‖ v)]``
  and both sides read the rope dimensions as interleaved pairs (HF's ``rope_interleave``, mcore's
  MLA rotary), so every attention tensor is a rename. The down projections are TE's
  "duplicated" linears: every TP rank holds them whole.
* the leading dense layers (``range(0, first_k_dense_replace)``, variable ``{d}``): the post-
  attention norm fused into ``mlp.linear_fc1``, as for any GPT layer;
* the MoE layers (variable ``{m}``): ``pre_mlp_layernorm``, ``mlp.router.weight`` and
  ``mlp.router.expert_bias`` (HF's ``e_score_correction_bias``), the shared experts as one
  ``mlp.shared_experts`` MLP, and the routed experts in TEGroupedMLP's names,
  ``mlp.experts.linear_fc1.weight{e}`` / ``linear_fc2.weight{e}`` (variable ``{e}``; global
  numbers here, the expert axis renumbers them per EP rank). With expert tensor parallelism equal
  to TP (Megatron's default) an expert's fc1 splits like a dense gated fc1 and its fc2 by rows.

HF-side layouts of the decoder body (``NAMES``): ``hf``, transformers 5's module names, which hold
each layer's experts as two stacked tensors (``mlp.experts.gate_up_proj`` ``[E, 2F, H]``,
``mlp.experts.down_proj`` ``[E, H, F]``); ``hf_checkpoint``, what ``save_pretrained`` writes and
the releases ship, one ``mlp.experts.{e}.{gate,up,down}_proj.weight`` per expert.

Multi-token-prediction layers a release stores after the last decoder layer are dropped by
name (no HF or mcore model here builds them) and show in the report of what was left out.
"""

from __future__ import annotations

import re

from mmparity.mapping.ops import PadRows, Unstack, fuse_gate_up
from mmparity.mapping.rules import VOCAB_MULTIPLE, LanguageKeys, Rule, rename
from mmparity.config import dense_layer_range, moe_layer_range, mtp_layers, padded_vocab_size, routed_experts

MCORE_ROOT = "language_model."
LAYOUTS = ("hf", "hf_checkpoint")

_MC = MCORE_ROOT + "decoder.layers."


def _attention_rules(text, hf: str, mc: str) -> tuple:
    rules = (rename(mc + "input_layernorm.weight", hf + "input_layernorm.weight"),)
    if text.q_lora_rank is None:
        rules += (rename(mc + "self_attention.linear_q_proj.weight", hf + "self_attn.q_proj.weight", "column"),)
    else:
        rules += (rename(mc + "self_attention.linear_q_down_proj.weight", hf + "self_attn.q_a_proj.weight"),
                  rename(mc + "self_attention.linear_q_up_proj.layer_norm_weight",
                         hf + "self_attn.q_a_layernorm.weight"),
                  rename(mc + "self_attention.linear_q_up_proj.weight", hf + "self_attn.q_b_proj.weight",
                         "column"))
    return rules + (
        rename(mc + "self_attention.linear_kv_down_proj.weight", hf + "self_attn.kv_a_proj_with_mqa.weight"),
        rename(mc + "self_attention.linear_kv_up_proj.layer_norm_weight", hf + "self_attn.kv_a_layernorm.weight"),
        rename(mc + "self_attention.linear_kv_up_proj.weight", hf + "self_attn.kv_b_proj.weight", "column"),
        rename(mc + "self_attention.linear_proj.weight", hf + "self_attn.o_proj.weight", "row"),
    )


def gated_mlp_rules(hf: str, mc: str) -> tuple:
    """A gated MLP (``gate_proj``/``up_proj``/``down_proj`` under ``hf``) as mcore's ``linear_fc1``
    / ``linear_fc2`` under ``mc``."""
    return (Rule(mc + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"), fuse_gate_up(),
                 "gated"),
            rename(mc + "linear_fc2.weight", hf + "down_proj.weight", "row"))


def routed_expert_rules(hf: str, mc: str, count: int, *, stacked: bool = True) -> tuple:
    """The ``count`` routed experts of the MoE layer under ``hf`` / ``mc`` in TEGroupedMLP's names,
    from HF's two stacked tensors (``stacked``: transformers 5's modules) or from one set of
    tensors per expert (what ``save_pretrained`` writes and the releases ship)."""
    experts = mc + "mlp.experts."
    if not stacked:
        return (
            Rule(experts + "linear_fc1.weight{e}",
                 (hf + "mlp.experts.{e}.gate_proj.weight", hf + "mlp.experts.{e}.up_proj.weight"),
                 fuse_gate_up(), "gated"),
            rename(experts + "linear_fc2.weight{e}", hf + "mlp.experts.{e}.down_proj.weight", "row"))
    # One stacked HF tensor feeds every expert's mcore tensor: the rule lists them all.
    return (Rule(tuple(experts + f"linear_fc1.weight{e}" for e in range(count)),
                 hf + "mlp.experts.gate_up_proj", Unstack(count), "gated"),
            Rule(tuple(experts + f"linear_fc2.weight{e}" for e in range(count)),
                 hf + "mlp.experts.down_proj", Unstack(count), "row"))


def mlp_rules(text, lm_root: str, *, stacked: bool = True) -> tuple:
    """Each layer's MLP with the norm before it: the leading dense layers' (``{d}``, the post-attention
    norm fused into ``linear_fc1``) and the MoE layers' (``{m}``: ``pre_mlp_layernorm``, the router and
    its score-correction bias, the shared experts, the routed experts stacked or one set per expert)."""
    dense, moe = (lm_root + "layers.{%s}." % v for v in "dm")
    mc_dense, mc_moe = (_MC + "{%s}." % v for v in "dm")
    rules = (rename(mc_dense + "mlp.linear_fc1.layer_norm_weight", dense + "post_attention_layernorm.weight"),
             *gated_mlp_rules(dense + "mlp.", mc_dense + "mlp."))
    rules += (rename(mc_moe + "pre_mlp_layernorm.weight", moe + "post_attention_layernorm.weight"),
              rename(mc_moe + "mlp.router.weight", moe + "mlp.gate.weight"),
              rename(mc_moe + "mlp.router.expert_bias", moe + "mlp.gate.e_score_correction_bias"))
    if text.n_shared_experts:
        rules += gated_mlp_rules(moe + "mlp.shared_experts.", mc_moe + "mlp.shared_experts.")
    return rules + routed_expert_rules(moe, mc_moe, routed_experts(text), stacked=stacked)


def language_rules(text, lm_root: str, head_key: str, *, tied: bool, layout: str = "hf") -> tuple:
    """Rules for the decoder whose body is under ``lm_root`` and whose output head is ``head_key``,
    in ``layout``'s names (:data:`LAYOUTS`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"DeepSeek-V3 decoder layout {layout!r}; known: {', '.join(LAYOUTS)}")
    vocab = PadRows(text.vocab_size, padded_vocab_size(text.vocab_size, VOCAB_MULTIPLE))
    rules = (Rule(MCORE_ROOT + "embedding.word_embeddings.weight", lm_root + "embed_tokens.weight", vocab, "vocab"),)
    rules += _attention_rules(text, lm_root + "layers.{i}.", _MC + "{i}.")
    rules += mlp_rules(text, lm_root, stacked=layout != "hf_checkpoint")
    rules += (rename(MCORE_ROOT + "decoder.final_layernorm.weight", lm_root + "norm.weight"),)
    if not tied:
        rules += (Rule(MCORE_ROOT + "output_layer.weight", head_key, vocab, "vocab"),)
    return rules


def variables(text) -> dict:
    return {"i": text.num_hidden_layers, "d": dense_layer_range(text), "m": moe_layer_range(text),
            "e": routed_experts(text)}


def drops(text, lm_root: str) -> tuple:
    """The release's multi-token-prediction layers, numbered after the decoder's."""
    first = text.num_hidden_layers
    numbers = "|".join(str(first + k) for k in range(mtp_layers(text)))
    return (rf"^{re.escape(lm_root)}layers\.({numbers})\.",) if numbers else ()


def tp_problems(text, tp: int) -> list[str]:
    """Sizes of the decoder that tensor parallelism (and expert tensor parallelism, equal to it)
    must divide."""
    sizes = {"text num_attention_heads": text.num_attention_heads,
             "text intermediate_size": text.intermediate_size,
             "text moe_intermediate_size": text.moe_intermediate_size,
             "text hidden_size (projector width)": text.hidden_size}
    return [f"tp={tp} does not divide {name}={value}" for name, value in sizes.items() if value % tp]


SPEC = LanguageKeys(layouts=LAYOUTS, rules=language_rules, tp_problems=tp_problems, variables=variables,
                    drops=drops, experts=routed_experts)
