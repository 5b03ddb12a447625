"""Kimi-K2.5 MoonViT (+ projector): HF and release checkpoint keys <-> Megatron's ``KimiViTModel`` keys.

Three HF-side layouts of the same weights (``FORMATS``):

- ``hf``: transformers 5.24 ``Kimi_K25VisionModel`` / ``Kimi_K25Model`` — q/k/v separate, q and k
  rows permuted per head for rotate-half RoPE (what HF's loader does to the release ``wqkv``).
- ``release``: the original remote-code MoonViT — ``encoder.blocks.N.{norm0, norm1, wqkv, wo,
  mlp.fc0, mlp.fc1}``, fused ``[q; k; v]`` in interleaved (complex-pair) RoPE order,
  ``patch_embed.pos_emb.weight``, ``encoder.final_layernorm``; projector ``mm_projector.{pre_norm,
  proj.0, proj.2}``.
- ``kimi_vl``: the release layout with Kimi-VL's projector names ``multi_modal_projector.{pre_norm,
  linear_1, linear_2}``.
- ``hf_saved``: what transformers 5.24 ``Kimi_K25ForConditionalGeneration.save_pretrained`` writes
  by default (``save_original_format=True``): the release layout except
  ``vision_tower.encoder.patch_embed.proj.*`` and ``model.mm_projector.pre_norm.*``, which its
  reverse renaming gets wrong (it reloads them correctly).

A whole-model config (``Kimi_K25Config``, with ``vision_config``) converts tower and projector, keys
relative to the model (``vision_tower.…``, ``mm_projector.…``; HF's own checkpoints add ``model.``);
the language model is dropped explicitly. A ``Kimi_K25VisionConfig`` converts the tower alone.

mcore side: Megatron-LM's ``vit_model.KimiViTModel`` names (``patch_embed.proj.*``,
``pos_embed.weight``, ``decoder.layers.…``, ``final_ln.*``), at the root for a tower alone and
under ``vision_model.`` beside the projector ``vision_projection.`` (``LLaVAModel``'s tree) for a
whole model. The projector is ``MultimodalProjector('mlp')`` with a fused norm in ``linear_fc1``
(``encoder.linear_fc1.{layer_norm_weight, layer_norm_bias, weight, bias}``, ``encoder.linear_fc2``),
the closest Megatron construction: Kimi's pre-norm normalises each of the m² sub-tokens of a merged
vector over H with one H-sized weight and bias, Megatron's fused norm spans the m²H vector. Those
H-sized vectors are written tiled m² times (:class:`TileBlocks`), which holds them exactly, so
nothing goes to a side file; the function Megatron computes with them differs (``RuleSet.mcore_note``,
docs/megatron.md), while mmparity's native projector normalises per sub-token and computes Kimi's.

Also here: :class:`KimiVLStateDictAdapter`, pure key re-prefixing between release names and the
``model.``-prefixed names of a native (Automodel-style) Kimi-VL module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from mmparity.mapping.ops import FuseQKV, LayoutError, Op, RegroupQKV, RopeInterleave
from mmparity.config import has_vision_sub_config as has_projector
from mmparity.config import head_dim
from mmparity.config import vision_sub_config as vision_cfg
from mmparity.mapping.rules import ConversionError, ConverterSpec, Rule, RuleSet, rename

FORMATS = ("hf", "release", "kimi_vl", "hf_saved")


# Per layout: names relative to the vision tower, and the projector's pre_norm / fc1 / fc2.
_TOWER = {
    "hf": dict(patch="patch_embed.proj", pos="patch_embed.pos_emb.position_embeddings",
               layer="layers.{i}.", norm_attn="norm1", norm_mlp="norm2", out="attn.proj",
               fc1="mlp.fc1", fc2="mlp.fc2", final="final_layernorm"),
    "release": dict(patch="patch_embed.proj", pos="patch_embed.pos_emb.weight",
                    layer="encoder.blocks.{i}.", norm_attn="norm0", norm_mlp="norm1", out="wo",
                    fc1="mlp.fc0", fc2="mlp.fc1", final="encoder.final_layernorm"),
}
_TOWER["kimi_vl"] = _TOWER["release"]
# transformers 5.24 reverts its load-time renames on save, but its ``vision_tower.encoder`` ->
# ``model.vision_tower`` rename also catches the patch embedding on the way back, and nothing
# reverts the projector norm's ``model.`` prefix.
_TOWER["hf_saved"] = dict(_TOWER["release"], patch="encoder.patch_embed.proj")
_PROJECTOR = {
    "hf": ("mm_projector.pre_norm", "mm_projector.in_proj", "mm_projector.out_proj"),
    "release": ("mm_projector.pre_norm", "mm_projector.proj.0", "mm_projector.proj.2"),
    "kimi_vl": ("multi_modal_projector.pre_norm", "multi_modal_projector.linear_1",
                "multi_modal_projector.linear_2"),
    "hf_saved": ("model.mm_projector.pre_norm", "mm_projector.proj.0", "mm_projector.proj.2"),
}

# What a whole checkpoint holds besides this family's tensors, dropped on purpose.
_LANGUAGE = (r"^(model\.)?language_model\.", r"^lm_head\.")
_ANY_PROJECTOR = r"^(model\.)?(mm_projector|multi_modal_projector)\."


def tp_problems(cfg, tp: int) -> list[str]:
    vc = vision_cfg(cfg)
    sizes = {"num_attention_heads": vc.num_attention_heads, "intermediate_size": vc.intermediate_size}
    if has_projector(cfg):
        kh, kw = tuple(vc.merge_kernel_size)
        sizes["projector width (hidden_size x merge kernel)"] = vc.hidden_size * kh * kw
    return [f"tp={tp} does not divide {name}={value}" for name, value in sizes.items() if value % tp]


# What ``convert`` says when it writes the projector in Megatron's layout (measured on the tiny
# config, CPU fp32, Megatron-LM main; docs/megatron.md, kimi_k25).
PROJECTOR_NOTE = (
    "Kimi's projector has no exact Megatron equivalent: its per-sub-token pre_norm is written as "
    "the fused LayerNorm of MultimodalProjector's linear_fc1 over the merged {m2}H vector (weight "
    "and bias tiled {m2}x), a different function (measured image_embeds rel_l2 2.8e-2, projector "
    "alone 1.3e-1 against HF; without the norm 2.4e-1); mmparity's native model and mcore -> HF "
    "keep Kimi's function exactly (docs/megatron.md)")


@dataclass(frozen=True, repr=False)
class TileBlocks(Op):
    """An H-sized vector written ``times`` times end to end: Kimi's per-sub-token norm parameters
    in the place of Megatron's fused norm over the merged m²H vector.

    The inverse gives back one block and refuses blocks that differ in any bit: such a vector was
    trained as a norm over the merged vector, which no Kimi pre-norm reproduces."""

    times: int

    def apply(self, hf):
        t = hf[0]
        if t.dim() != 1:
            raise LayoutError(f"{self!r}: expected a vector, got {tuple(t.shape)}")
        # Not t.repeat: on the meta device (every conversion's dry run) its shape check imports
        # sympy, 1.6-2.5 s of a Kimi conversion's start; expand + reshape makes the same copy.
        return [t.expand(self.times, -1).reshape(-1)]

    def invert(self, mcore):
        t = mcore[0]
        if t.dim() != 1 or t.shape[0] % self.times:
            raise LayoutError(f"{self!r}: expected a vector of {self.times} equal blocks, got {tuple(t.shape)}")
        blocks = t.reshape(self.times, -1)
        if not t.is_meta:
            bits = blocks.contiguous().view(torch.uint8)
            if not bool((bits == bits[:1]).all()):
                raise LayoutError(f"{self!r}: the {self.times} blocks differ, so this is not a Kimi "
                                  "per-sub-token norm (trained as a norm over the merged vector?)")
        # A copy, not a view of the first block: a writer must not take those rows past the check.
        return [blocks[0].clone()]

    def __repr__(self):
        return f"TileBlocks(times={self.times})"


def _tower_rules(cfg, hf_format: str, hf_root: str, mcore_root: str) -> list[Rule]:
    vc = vision_cfg(cfg)
    heads = vc.num_attention_heads
    d = head_dim(vc)
    n = _TOWER[hf_format]
    layer = hf_root + n["layer"]
    block = mcore_root + "decoder.layers.{i}."
    attn, mlp = block + "self_attention.", block + "mlp."
    rules = [
        rename(mcore_root + "patch_embed.proj.weight", hf_root + n["patch"] + ".weight"),
        rename(mcore_root + "patch_embed.proj.bias", hf_root + n["patch"] + ".bias"),
        rename(mcore_root + "pos_embed.weight", hf_root + n["pos"]),
    ]
    for p in ("weight", "bias"):
        if hf_format == "hf":
            # HF permuted q/k rows for rotate-half RoPE; mcore runs the release's interleaved RoPE.
            unpermute = RopeInterleave(heads, d)
            qkv = Rule(attn + f"linear_qkv.{p}",
                       tuple(layer + f"attn.{x}_proj.{p}" for x in "qkv"),
                       FuseQKV(heads, heads, d, pre=(unpermute, unpermute, None)), "qkv")
        else:
            qkv = Rule(attn + f"linear_qkv.{p}", layer + f"wqkv.{p}", RegroupQKV(heads, heads, d), "qkv")
        rules += [
            rename(attn + f"linear_qkv.layer_norm_{p}", layer + f"{n['norm_attn']}.{p}"),
            qkv,
            rename(attn + f"linear_proj.{p}", layer + f"{n['out']}.{p}",
                   "row" if p == "weight" else "replicated"),
            rename(mlp + f"linear_fc1.layer_norm_{p}", layer + f"{n['norm_mlp']}.{p}"),
            rename(mlp + f"linear_fc1.{p}", layer + f"{n['fc1']}.{p}", "column"),
            rename(mlp + f"linear_fc2.{p}", layer + f"{n['fc2']}.{p}",
                   "row" if p == "weight" else "replicated"),
            rename(mcore_root + f"final_ln.{p}", hf_root + f"{n['final']}.{p}"),
        ]
    return rules


def _merge_tokens(cfg) -> int:
    kh, kw = tuple(vision_cfg(cfg).merge_kernel_size)
    return kh * kw


def _projector_rules(cfg, hf_format: str) -> list[Rule]:
    norm, fc1, fc2 = _PROJECTOR[hf_format]
    mcore = "vision_projection.encoder."
    rules = []
    for p in ("weight", "bias"):
        rules += [
            Rule(mcore + f"linear_fc1.layer_norm_{p}", f"{norm}.{p}", TileBlocks(_merge_tokens(cfg))),
            rename(mcore + f"linear_fc1.{p}", f"{fc1}.{p}", "column"),
            rename(mcore + f"linear_fc2.{p}", f"{fc2}.{p}",
                   "row" if p == "weight" else "replicated"),
        ]
    return rules


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    if hf_format not in FORMATS:
        raise ConversionError("unknown HF layout for family 'kimi_k25'",
                              [f"got {hf_format!r}; this family knows {', '.join(FORMATS)}"])
    if has_projector(cfg):
        rules = (_tower_rules(cfg, hf_format, "vision_tower.", "vision_model.")
                 + _projector_rules(cfg, hf_format))
        # HF's Kimi_K25ForConditionalGeneration nests both under ``model.``; the release does not.
        prefixes = ("model.", "") if hf_format == "hf" else ("",)
        drop = _LANGUAGE
        note = PROJECTOR_NOTE.format(m2=_merge_tokens(cfg))
    else:
        rules = _tower_rules(cfg, hf_format, "", "")
        prefixes = (("", "vision_tower.", "model.vision_tower.") if hf_format == "hf"
                    else ("vision_tower.", ""))
        drop = _LANGUAGE + (_ANY_PROJECTOR,)
        note = ""
    return RuleSet(rules=tuple(rules), variables={"i": vision_cfg(cfg).num_hidden_layers},
                   hf_prefixes=prefixes, drop_hf=drop, hf_format=hf_format,
                   validate_tp=lambda tp: tp_problems(cfg, tp), mcore_note=note)


def detect_format(keys: Iterable[str]) -> str:
    """``hf`` unless the keys carry the remote-code block names; then the variant those keys show."""
    keys = list(keys)
    release = any(re.search(r"(^|\.)(wqkv|norm0)\.|(^|\.)encoder\.blocks\.|pos_emb\.weight$", k)
                  for k in keys)
    if not release:
        return "hf"
    if any(re.match(r"^(model\.)?multi_modal_projector\.", k) for k in keys):
        return "kimi_vl"
    if any(k.startswith(("vision_tower.encoder.patch_embed.", "model.mm_projector.")) for k in keys):
        return "hf_saved"
    return "release"


class KimiVLStateDictAdapter:
    """Key re-prefixing between a release-layout checkpoint and a native Kimi-VL module.

    The semantics of NeMo Automodel's ``KimiVLStateDictAdapter`` (``nemo_automodel/components/models/kimivl/model.py``) for names:
    ``from_hf`` puts ``vision_tower.*``, ``multi_modal_projector.*`` (and Kimi-K2.5's
    ``mm_projector.*``) and ``language_model.*`` under ``model.``; ``to_hf`` strips it. Tensors are
    passed through untouched; the language model's inner names are kept as they are.

    Deliberate deviation: upstream ``from_hf`` moves ``language_model.lm_head.*`` to a top-level
    ``lm_head.*`` while ``to_hf`` expects ``model.language_model.lm_head.*``, so its round trip
    renames the head. Here the head stays at ``model.language_model.lm_head.*`` both ways and
    ``from_hf(to_hf(sd))`` is key-identical. Keys under no known prefix are refused (all listed),
    since passing them through could not be undone; ``exclude_key_regex`` skips keys on purpose.
    """

    HF_PREFIXES = ("vision_tower.", "multi_modal_projector.", "mm_projector.", "language_model.")
    NATIVE_PREFIX = "model."

    def __init__(self, config=None):
        self.config = config

    def _convert(self, state_dict: Mapping, to_native: bool, exclude_key_regex: str | None) -> dict:
        out, problems = {}, []
        for key, value in state_dict.items():
            if exclude_key_regex and re.match(exclude_key_regex, key):
                continue
            source = key if to_native else key[len(self.NATIVE_PREFIX):] if key.startswith(
                self.NATIVE_PREFIX) else None
            if source is None or not source.startswith(self.HF_PREFIXES):
                problems.append(f"{key}: not under {' / '.join(self._expected(to_native))}")
                continue
            out[self.NATIVE_PREFIX + key if to_native else source] = value
        if problems:
            direction = "from_hf" if to_native else "to_hf"
            raise ConversionError(f"KimiVLStateDictAdapter.{direction} cannot place these keys", problems)
        return out

    def _expected(self, to_native: bool) -> tuple:
        return self.HF_PREFIXES if to_native else tuple(self.NATIVE_PREFIX + p for p in self.HF_PREFIXES)

    def from_hf(self, state_dict: Mapping, **kwargs) -> dict:
        """Release names -> native names (``model.`` + key)."""
        return self._convert(state_dict, True, kwargs.get("exclude_key_regex"))

    def to_hf(self, state_dict: Mapping, **kwargs) -> dict:
        """Native names -> release names."""
        return self._convert(state_dict, False, kwargs.get("exclude_key_regex"))


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set, detect_format=detect_format)
