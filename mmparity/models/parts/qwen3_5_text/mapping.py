"""The Qwen3.5 / Qwen3.5-MoE language-model part: HF ``Qwen3_5TextModel`` /
``Qwen3_5MoeTextModel`` <-> Megatron's ``GPTModel`` with its hybrid Gated DeltaNet block, under
``language_model.``. mcore names are those of megatron-core's hybrid spec with Transformer Engine
(input norms fused into the first linear of each sub-layer). The token mixers' rules are written
per layer (``layer_types`` is a list, not a range); ``{i}`` ranges over all layers, ``{e}`` over
the experts.

* Gated DeltaNet: ``in_proj`` is HF's ``in_proj_qkv`` (rows ``[q; k; v]``), ``in_proj_z``,
  ``in_proj_b``, ``in_proj_a`` stacked in that order; ``conv1d`` is a rename (channels ``[q; k; v]``
  on both sides). Megatron cuts both per TP rank block by block (rank r holds the r-th share of
  q, of k, of v, …: TP kind ``sections``), which keeps whole key heads with their value heads.
  HF's output norm scales by ``weight`` where mcore's (a zero-centred TE norm, as every norm of
  the model) scales by ``1 + weight``: ``out_norm.weight = norm.weight - 1``, refused where that
  subtraction would round (an HF weight outside [0.5, 2], which round trips could not keep).
* gated attention: HF's ``q_proj`` rows are ``[query; gate]`` per head; mcore's ``linear_qkv``
  rows are ``[queries of the group; gates of the group; k; v]`` per key/value group.
* MLP: dense ``gate_proj``/``up_proj`` fused into ``linear_fc1``; MoE ``mlp.gate`` is the router,
  experts in TEGroupedMLP's names (``hf``: transformers' stacked ``gate_up_proj`` / ``down_proj``;
  ``hf_checkpoint``: one tensor per expert and projection), the shared expert an MLP and its gate
  ``shared_experts.gate_weight``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmparity.config import padded_vocab_size
from mmparity.mapping.ops import LayoutError, Op, PadRows, _own
from mmparity.mapping.rules import VOCAB_MULTIPLE, LanguageKeys, Rule, rename
from mmparity.models.parts.deepseek_v3.mapping import gated_mlp_rules, routed_expert_rules
from mmparity.models.parts.qwen3_5_text.config import LINEAR, is_moe, tp_problems
from mmparity.parallel.tp import cat, sections_kind

MCORE_ROOT = "language_model."
LAYOUTS = ("hf", "hf_checkpoint")

_MC = MCORE_ROOT + "decoder.layers."


@dataclass(frozen=True, repr=False)
class StackRows(Op):
    """Several HF tensors stacked along dim 0 into one mcore tensor, of these row counts."""

    rows: tuple

    @property
    def n_hf(self) -> int:
        return len(self.rows)

    def apply(self, hf):
        if tuple(t.shape[0] for t in hf) != self.rows:
            raise LayoutError(f"{self!r}: got {[tuple(t.shape) for t in hf]}")
        return [_own(cat(hf, dim=0), hf)]

    def apply_pieces(self, hf):
        self.apply([t[:, :0] if t.dim() > 1 else t for t in hf])  # the shape check alone
        return [list(hf)]

    def invert(self, mcore):
        return [_own(t, mcore) for t in self._split(mcore[0])]

    def invert_pieces(self, mcore):
        return [[t] for t in self._split(mcore[0])]

    def _split(self, t):
        if t.shape[0] != sum(self.rows):
            raise LayoutError(f"{self!r}: got {tuple(t.shape)}")
        return torch.split(t, list(self.rows), dim=0)

    def __repr__(self):
        return f"StackRows({list(self.rows)})"


@dataclass(frozen=True, repr=False)
class GatedQuery(Op):
    """HF ``q_proj`` (per head ``[query; gate]``), ``k_proj``, ``v_proj`` -> mcore ``linear_qkv``
    rows ``[group queries; group gates; k; v]`` per key/value group."""

    heads: int
    groups: int
    head_dim: int
    n_hf = 3

    def _check(self, q, k, v):
        d, g = self.head_dim, self.groups
        if (q.shape[0], k.shape[0], v.shape[0]) != (2 * self.heads * d, g * d, g * d) or self.heads % g:
            raise LayoutError(f"{self!r}: got {[tuple(t.shape) for t in (q, k, v)]}")

    def apply(self, hf):
        q, k, v = hf
        self._check(q, k, v)
        g, per, d, rest = self.groups, self.heads // self.groups, self.head_dim, q.shape[1:]
        qg = q.reshape(g, per, 2, d, *rest)
        fused = cat([qg[:, :, 0].reshape(g, per * d, *rest), qg[:, :, 1].reshape(g, per * d, *rest),
                     k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
        return [_own(fused.reshape(-1, *rest), hf)]

    def invert(self, mcore):
        t = mcore[0]
        g, per, d, rest = self.groups, self.heads // self.groups, self.head_dim, t.shape[1:]
        if t.shape[0] != g * (2 * per + 2) * d:
            raise LayoutError(f"{self!r}: got {tuple(t.shape)}")
        grouped = t.reshape(g, 2 * per + 2, d, *rest)
        query, gate = grouped[:, :per], grouped[:, per:2 * per]
        q = torch.stack([query, gate], dim=2).reshape(-1, *rest)
        return [_own(q, mcore), _own(grouped[:, 2 * per].reshape(-1, *rest), mcore),
                _own(grouped[:, 2 * per + 1].reshape(-1, *rest), mcore)]

    def __repr__(self):
        return f"GatedQuery(heads={self.heads}, groups={self.groups}, head_dim={self.head_dim})"


@dataclass(frozen=True, repr=False)
class ShiftByOne(Op):
    """HF weight ``w`` -> mcore ``w - 1`` (a zero-centred norm's weight), exact or refused: the
    subtraction is exact for ``w`` in [0.5, 2] (Sterbenz), and checked for every element."""

    def apply(self, hf):
        w = hf[0]
        shifted = w - 1
        if w.device.type != "meta" and not torch.equal(shifted + 1, w):  # meta: a plan's shapes
            bad = int((shifted + 1 != w).sum())
            raise LayoutError(f"{self!r}: {bad} of {w.numel()} weights do not survive w - 1 + 1 exactly "
                              "(only weights in [0.5, 2] are sure to); a zero-centred copy of them would not "
                              "convert back")
        return [shifted]

    def invert(self, mcore):
        return [mcore[0] + 1]


def _delta_net_rules(text, hf: str, mc: str) -> tuple:
    qk = text.linear_num_key_heads * text.linear_key_head_dim
    v = text.linear_num_value_heads * text.linear_value_head_dim
    heads = text.linear_num_value_heads
    att, mc_att = hf + "linear_attn.", mc + "self_attention."
    return (
        rename(mc_att + "in_proj.layer_norm_weight", hf + "input_layernorm.weight"),
        Rule(mc_att + "in_proj.weight", tuple(att + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
             StackRows((2 * qk + v, v, heads, heads)),
             sections_kind((qk, qk, v, v, heads, heads), ("query", "key", "value", "z", "beta", "alpha"))),
        Rule(mc_att + "conv1d.weight", att + "conv1d.weight", tp=sections_kind((qk, qk, v), ("query", "key", "value"))),
        rename(mc_att + "dt_bias", att + "dt_bias", "column"),
        rename(mc_att + "A_log", att + "A_log", "column"),
        Rule(mc_att + "out_norm.weight", att + "norm.weight", ShiftByOne()),
        rename(mc_att + "out_proj.weight", att + "out_proj.weight", "row"),
    )


def _attention_rules(text, hf: str, mc: str) -> tuple:
    att, mc_att = hf + "self_attn.", mc + "self_attention."
    return (
        rename(mc_att + "linear_qkv.layer_norm_weight", hf + "input_layernorm.weight"),
        Rule(mc_att + "linear_qkv.weight", tuple(att + f"{p}_proj.weight" for p in "qkv"),
             GatedQuery(text.num_attention_heads, text.num_key_value_heads, text.head_dim), "qkv"),
        rename(mc_att + "q_layernorm.weight", att + "q_norm.weight"),
        rename(mc_att + "k_layernorm.weight", att + "k_norm.weight"),
        rename(mc_att + "linear_proj.weight", att + "o_proj.weight", "row"),
    )


def _moe_rules(text, hf: str, mc: str, layout: str) -> tuple:
    return (rename(mc + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"),
            rename(mc + "mlp.router.weight", hf + "mlp.gate.weight"),
            *gated_mlp_rules(hf + "mlp.shared_expert.", mc + "mlp.shared_experts."),
            rename(mc + "mlp.shared_experts.gate_weight", hf + "mlp.shared_expert_gate.weight"),
            *routed_expert_rules(hf, mc, text.num_experts, stacked=layout != "hf_checkpoint"))


def language_rules(text, lm_root: str, head_key: str, *, tied: bool, layout: str = "hf") -> tuple:
    """Rules for the decoder whose body is under ``lm_root`` and whose output head is ``head_key``,
    in ``layout``'s names (:data:`LAYOUTS`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"Qwen3.5 decoder layout {layout!r}; known: {', '.join(LAYOUTS)}")
    vocab = PadRows(text.vocab_size, padded_vocab_size(text.vocab_size, VOCAB_MULTIPLE))
    every, mc_every = lm_root + "layers.{i}.", _MC + "{i}."
    rules = (Rule(MCORE_ROOT + "embedding.word_embeddings.weight", lm_root + "embed_tokens.weight", vocab, "vocab"),)
    # The token mixer's rules name their layers: which layers are which is a list, not a range.
    for i, kind in enumerate(text.layer_types):
        mixer = _delta_net_rules if kind == LINEAR else _attention_rules
        rules += mixer(text, f"{lm_root}layers.{i}.", f"{_MC}{i}.")
    if is_moe(text):
        rules += _moe_rules(text, every, mc_every, layout)
    else:
        rules += (rename(mc_every + "mlp.linear_fc1.layer_norm_weight", every + "post_attention_layernorm.weight"),
                  *gated_mlp_rules(every + "mlp.", mc_every + "mlp."))
    rules += (rename(MCORE_ROOT + "decoder.final_layernorm.weight", lm_root + "norm.weight"),)
    if not tied:
        rules += (Rule(MCORE_ROOT + "output_layer.weight", head_key, vocab, "vocab"),)
    return rules


def variables(text) -> dict:
    return {"i": text.num_hidden_layers, "e": experts(text)}


def experts(text) -> int:
    return int(getattr(text, "num_experts", 0) or 0)


SPEC = LanguageKeys(layouts=LAYOUTS, rules=language_rules, tp_problems=tp_problems, variables=variables,
                    experts=experts)
