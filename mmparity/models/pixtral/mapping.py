"""Pixtral vision encoder: HF ``PixtralVisionModel`` or Mistral-native keys <-> native ``ViTModel`` keys.

Two HF-side layouts:

* ``hf``: transformers' names (``q_proj`` …, ``feed_forward.gate_proj`` …), q/k rows permuted per
  head for rotate-half RoPE by HF's conversion script;
* ``mistral``: Mistral's own ``consolidated.safetensors`` names (``vision_encoder.`` with ``wq``/
  ``wk``/``wv``/``wo``, ``w1``/``w2``/``w3``, ``attention_norm``, ``ffn_norm``), q/k in the original
  interleaved (complex-pair) order, which is what mcore's ``rotary_interleaved=True`` wants: no
  permutation at all.

:func:`tower_rules` is shared with Pixtral-Large, whose towers sit under other roots.
"""

from __future__ import annotations

import re

from mmparity.mapping.ops import FuseQKV, RopeInterleave, fuse_gate_up
from mmparity.mapping.rules import ConversionError, ConverterSpec, Rule, RuleSet, TowerKeys, rename
from mmparity.config import head_dim, tower_config_or_self

FORMATS = ("hf", "mistral")

# A Pixtral tower also sits inside LLaVA / Mistral3 checkpoints; their other parts are not ours.
HF_PREFIXES = ("", "vision_tower.", "model.vision_tower.")
DROP_HF = (r"^(model\.)?language_model\.", r"^lm_head\.", r"^(model\.)?multi_modal_projector\.")

MISTRAL_PREFIXES = ("",)
# The language model of a Mistral-native VLM checkpoint (text layers, embeddings, final norm, head).
MISTRAL_DROP_LM = (r"^layers\.", r"^tok_embeddings\.", r"^norm\.", r"^output\.")
# The multimodal adapter of a Mistral-native checkpoint (Pixtral-12B: w_in/w_out only;
# Pixtral-Large adds the pre-merge norm and the patch merger).
MISTRAL_DROP_ADAPTER = (r"^vision_language_adapter\.", r"^pre_mm_projector_norm\.",
                        r"^patch_merger\.")

_MISTRAL_KEY = re.compile(r"^vision_encoder\.")
_HF_KEY = re.compile(r"^(model\.)?(vision_tower\.)?(patch_conv|ln_pre|transformer\.layers\.\d+)\.")


def detect_format(keys) -> str:
    """``mistral`` when the keys are Mistral-native (``vision_encoder.*``), else ``hf``."""
    keys = list(keys)
    mistral = any(_MISTRAL_KEY.match(k) for k in keys)
    hf = any(_HF_KEY.match(k) for k in keys)
    if mistral and hf:
        raise ConversionError("ambiguous checkpoint: both Mistral-native and HF Pixtral tensors", [
            "Mistral-native: " + ", ".join(sorted(k for k in keys if _MISTRAL_KEY.match(k))[:3]),
            "HF: " + ", ".join(sorted(k for k in keys if _HF_KEY.match(k))[:3]),
            "pass hf_format='hf' or 'mistral' explicitly"])
    return "mistral" if mistral else "hf"


def tp_problems(cfg, tp: int) -> list[str]:
    problems = []
    for name in ("num_attention_heads", "intermediate_size"):
        value = getattr(cfg, name)
        if value % tp:
            problems.append(f"tp={tp} does not divide {name}={value}")
    return problems


# Per-layer tensor names of the two layouts: (attention norm, q, k, v, o, ffn norm, gate, up, down).
_LAYER_NAMES = {
    "hf": ("attention_norm.weight", "attention.q_proj.weight", "attention.k_proj.weight",
           "attention.v_proj.weight", "attention.o_proj.weight", "ffn_norm.weight",
           "feed_forward.gate_proj.weight", "feed_forward.up_proj.weight",
           "feed_forward.down_proj.weight"),
    "mistral": ("attention_norm.weight", "attention.wq.weight", "attention.wk.weight",
                "attention.wv.weight", "attention.wo.weight", "ffn_norm.weight",
                "feed_forward.w1.weight", "feed_forward.w3.weight", "feed_forward.w2.weight"),
}


def tower_rules(cfg, hf_format: str, hf_root: str = "", mcore_root: str = "") -> tuple:
    """Rules of one Pixtral tower; HF keys under ``hf_root``, mcore keys under ``mcore_root``."""
    if hf_format not in FORMATS:
        raise ConversionError("unknown Pixtral layout", [f"got {hf_format!r}; known: {FORMATS}"])
    heads, d = cfg.num_attention_heads, head_dim(cfg)
    if hf_format == "hf":
        root = hf_root
        # HF checkpoints carry q/k permuted for rotate-half RoPE; mcore runs interleaved RoPE.
        unpermute = RopeInterleave(heads, d)
        pre = (unpermute, unpermute, None)
    else:
        root = hf_root + "vision_encoder."
        pre = (None, None, None)
    attn_norm, q, k, v, o, ffn_norm, gate, up, down = _LAYER_NAMES[hf_format]
    layer = root + "transformer.layers.{i}."
    native = mcore_root + "decoder.layers.{i}."
    return (
        rename(mcore_root + "patch_embed.proj.weight", root + "patch_conv.weight"),
        rename(mcore_root + "ln_pre.weight", root + "ln_pre.weight"),
        rename(native + "self_attention.linear_qkv.layer_norm_weight", layer + attn_norm),
        Rule(native + "self_attention.linear_qkv.weight", (layer + q, layer + k, layer + v),
             FuseQKV(heads, heads, d, pre=pre), "qkv"),
        rename(native + "self_attention.linear_proj.weight", layer + o, "row"),
        rename(native + "mlp.linear_fc1.layer_norm_weight", layer + ffn_norm),
        Rule(native + "mlp.linear_fc1.weight", (layer + gate, layer + up), fuse_gate_up(), "gated"),
        rename(native + "mlp.linear_fc2.weight", layer + down, "row"),
    )


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    cfg = tower_config_or_self(cfg, "pixtral")
    if hf_format == "mistral":
        prefixes, drops = MISTRAL_PREFIXES, MISTRAL_DROP_LM + MISTRAL_DROP_ADAPTER
    else:
        prefixes, drops = HF_PREFIXES, DROP_HF
    return RuleSet(rules=tower_rules(cfg, hf_format), variables={"i": cfg.num_hidden_layers},
                   hf_prefixes=prefixes, drop_hf=drops, hf_format=hf_format,
                   validate_tp=lambda tp: tp_problems(cfg, tp))


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set, detect_format=detect_format,
                    tower=TowerKeys("pixtral"))
