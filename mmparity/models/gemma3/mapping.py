"""Gemma 3 whole: ``Gemma3ForConditionalGeneration`` <-> Megatron's ``LLaVAModel`` tree, three parts:

* the tower: the ``siglip`` family's table (Megatron's ``CLIPViTModel`` as SigLIP), its mcore side
  under ``vision_model.``, its HF side under the layout's tower root;
* the projector, in ``MultimodalProjector``'s affine place: ``vision_projection.encoder.weight`` is
  HF's ``mm_input_projection_weight`` transposed (HF stores it (vision, text) and multiplies from
  the right; a Linear holds (text, vision)), split by rows under TP like any column-parallel
  linear; ``vision_projection.encoder.layer_norm_weight`` is ``mm_soft_emb_norm`` (a ``1 + w``
  RMSNorm) fused in as Transformer Engine fuses a linear's input norm;
* the decoder, a ``GPTModel`` under ``language_model.`` in the names Megatron-Bridge's Gemma 3
  uses: the input norm in ``linear_qkv.layer_norm_weight``, q/k norms in ``q_layernorm`` /
  ``k_layernorm``, the post-attention norm in ``linear_proj.post_layernorm``, the pre-feedforward
  norm in ``linear_fc1.layer_norm_weight``, the post-feedforward norm in
  ``linear_fc2.post_layernorm``. Norm weights are copied as HF stores them (Megatron's
  ``layernorm_zero_centered_gamma`` reads them as HF does). The embedding is padded as Megatron-LM
  pads vocabularies; the head is tied (HF's ``lm_head.weight`` is dropped).

HF layouts: ``hf`` (module names, ``model.vision_tower.`` …), ``hf_checkpoint`` (what transformers
5 saves: ``vision_tower.``, ``multi_modal_projector.``, ``language_model.model.``) and
``hf_v4_checkpoint`` (the released files: the tower one level deeper, ``vision_tower.vision_model.``),
and ``hf_state_dict``: the module names as ``state_dict()`` returns them, the tied head listed a
second time as ``lm_head.weight`` (one mcore table; export writes it under both names).
"""

from __future__ import annotations

import re

from mmparity.config import padded_vocab_size, tied_embeddings
from mmparity.mapping.ops import FuseQKV, PadRows, TiedPadRows, Transpose, fuse_gate_up
from mmparity.mapping.rules import (
    VOCAB_MULTIPLE, ConversionError, ConverterSpec, Rule, RuleSet, nested_rules, rename)
from mmparity.models.llava.mapping import detect_format
from mmparity.models.siglip import mapping as tower

FORMATS = ("hf", "hf_checkpoint", "hf_v4_checkpoint", "hf_state_dict")
# (tower root, projector root, decoder body root, head key)
ROOTS = {
    "hf": ("model.vision_tower.", "model.multi_modal_projector.", "model.language_model.", "lm_head.weight"),
    "hf_state_dict": ("model.vision_tower.", "model.multi_modal_projector.", "model.language_model.", "lm_head.weight"),
    "hf_checkpoint": ("vision_tower.", "multi_modal_projector.", "language_model.model.",
                      "language_model.lm_head.weight"),
    "hf_v4_checkpoint": ("vision_tower.vision_model.", "multi_modal_projector.", "language_model.model.",
                         "language_model.lm_head.weight"),
}
# Buffers older files saved (SigLIP's position ids); recomputed from the config.
DROP_BUFFERS = (r"^(.*\.)?embeddings\.position_ids$",)
MC = "language_model."


def language_rules(text, lm_root: str) -> tuple:
    heads, groups, d = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    vocab = PadRows(text.vocab_size, padded_vocab_size(text.vocab_size, VOCAB_MULTIPLE))
    hf, mc = lm_root + "layers.{i}.", MC + "decoder.layers.{i}."
    attn, mlp = hf + "self_attn.", hf + "mlp."
    return (
        Rule(MC + "embedding.word_embeddings.weight", lm_root + "embed_tokens.weight", vocab, "vocab"),
        rename(mc + "self_attention.linear_qkv.layer_norm_weight", hf + "input_layernorm.weight"),
        Rule(mc + "self_attention.linear_qkv.weight",
             (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"), FuseQKV(heads, groups, d), "qkv"),
        rename(mc + "self_attention.q_layernorm.weight", attn + "q_norm.weight"),
        rename(mc + "self_attention.k_layernorm.weight", attn + "k_norm.weight"),
        rename(mc + "self_attention.linear_proj.weight", attn + "o_proj.weight", "row"),
        rename(mc + "self_attention.linear_proj.post_layernorm.weight", hf + "post_attention_layernorm.weight"),
        rename(mc + "mlp.linear_fc1.layer_norm_weight", hf + "pre_feedforward_layernorm.weight"),
        Rule(mc + "mlp.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), fuse_gate_up(), "gated"),
        rename(mc + "mlp.linear_fc2.weight", mlp + "down_proj.weight", "row"),
        rename(mc + "mlp.linear_fc2.post_layernorm.weight", hf + "post_feedforward_layernorm.weight"),
        rename(MC + "decoder.final_layernorm.weight", lm_root + "norm.weight"),
    )


def projector_rules(root: str) -> tuple:
    return (rename("vision_projection.encoder.layer_norm_weight", root + "mm_soft_emb_norm.weight"),
            Rule("vision_projection.encoder.weight", root + "mm_input_projection_weight", Transpose(), "column"))


def language_tp_problems(text, tp: int) -> list[str]:
    if tp < 1:
        return []
    sizes = {"text num_attention_heads": text.num_attention_heads,
             "text num_key_value_heads": text.num_key_value_heads,
             "text intermediate_size": text.intermediate_size,
             "text hidden_size (projector width)": text.hidden_size}
    return [f"tp={tp} does not divide {name}={value}" for name, value in sizes.items() if value % tp]


def tower_tp_problems(cfg, tp: int) -> list[str]:
    check = tower.rule_set(cfg.vision_config).validate_tp
    return list(check(tp)) if tp >= 1 and check else []


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    if hf_format not in FORMATS:
        raise ConversionError("unknown HF layout for Gemma 3 whole",
                              [f"got {hf_format!r}; this family knows {', '.join(FORMATS)}"])
    tower_root, projector_root, lm_root, head = ROOTS[hf_format]
    vision, vision_vars = nested_rules(tower.rule_set(cfg.vision_config), "vision_model.", tower_root, "vision_")
    text = cfg.text_config
    rules = language_rules(text, lm_root) + vision + projector_rules(projector_root)
    if tied_embeddings(cfg) and hf_format == "hf_state_dict":
        # A module-names state dict names the tied table twice: one mcore table, both names back.
        table = TiedPadRows(text.vocab_size, padded_vocab_size(text.vocab_size, VOCAB_MULTIPLE))
        rules = (Rule(MC + "embedding.word_embeddings.weight", (lm_root + "embed_tokens.weight", head), table,
                      "vocab"),) + rules[1:]
    if tied_embeddings(cfg):
        # Gemma 3 ties its head to the embedding: save_pretrained writes the table once, and
        # where a state dict names it twice the head's own values are not read (the table's are).
        drops = DROP_BUFFERS + (f"^{re.escape(head)}$",)
    else:
        vocab = PadRows(text.vocab_size, padded_vocab_size(text.vocab_size, VOCAB_MULTIPLE))
        rules += (Rule(MC + "output_layer.weight", head, vocab, "vocab"),)
        drops = DROP_BUFFERS
    return RuleSet(rules=rules, variables={"i": text.num_hidden_layers, **vision_vars}, hf_prefixes=("",),
                   drop_hf=drops, hf_format=hf_format,
                   validate_tp=lambda tp: tower_tp_problems(cfg, tp) + language_tp_problems(text, tp),
                   part_tp={"language_model.": lambda tp: language_tp_problems(text, tp),
                            "vision_model.": lambda tp: tower_tp_problems(cfg, tp)})


def detect_layout(keys) -> str:
    """LLaVA's layouts, told apart by the roots; module names that list the head are a state dict."""
    keys = list(keys)
    found = detect_format(keys)
    return "hf_state_dict" if found == "hf" and "lm_head.weight" in keys else found


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set, detect_format=detect_layout)
