"""Kimi-K2.5 MoonViT (+ projector): HF and release checkpoint keys <-> native ``KimiViTModel`` keys.

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

mcore side: the tower at the root (``patch_embed.conv.*``, ``pos_embed.weight``, ``decoder.…``,
``decoder.final_layernorm.*``), the projector under ``vision_projection.{pre_norm, encoder.linear_fc1,
encoder.linear_fc2}``.

Also here: :class:`KimiVLStateDictAdapter`, pure key re-prefixing between release names and the
``model.``-prefixed names of a native (Automodel-style) Kimi-VL module.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

from mmparity.converters.ops import FuseQKV, RegroupQKV, RopeInterleave
from mmparity.hfconfig import has_vision_sub_config as has_projector
from mmparity.hfconfig import vision_sub_config as vision_cfg
from mmparity.converters.rules import ConversionError, ConverterSpec, Rule, RuleSet, rename

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


def _tower_rules(cfg, hf_format: str, hf_root: str) -> list[Rule]:
    vc = vision_cfg(cfg)
    heads = vc.num_attention_heads
    d = vc.hidden_size // heads
    n = _TOWER[hf_format]
    layer = hf_root + n["layer"]
    native = "decoder.layers.{i}."
    attn, mlp = native + "self_attention.", native + "mlp."
    rules = [
        rename("patch_embed.conv.weight", hf_root + n["patch"] + ".weight"),
        rename("patch_embed.conv.bias", hf_root + n["patch"] + ".bias"),
        rename("pos_embed.weight", hf_root + n["pos"]),
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
            rename(f"decoder.final_layernorm.{p}", hf_root + f"{n['final']}.{p}"),
        ]
    return rules


def _projector_rules(hf_format: str) -> list[Rule]:
    norm, fc1, fc2 = _PROJECTOR[hf_format]
    native = "vision_projection."
    rules = []
    for p in ("weight", "bias"):
        rules += [
            rename(native + f"pre_norm.{p}", f"{norm}.{p}"),
            rename(native + f"encoder.linear_fc1.{p}", f"{fc1}.{p}", "column"),
            rename(native + f"encoder.linear_fc2.{p}", f"{fc2}.{p}",
                   "row" if p == "weight" else "replicated"),
        ]
    return rules


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    if hf_format not in FORMATS:
        raise ConversionError("unknown HF layout for family 'kimi_k25'",
                              [f"got {hf_format!r}; this family knows {', '.join(FORMATS)}"])
    if has_projector(cfg):
        rules = _tower_rules(cfg, hf_format, "vision_tower.") + _projector_rules(hf_format)
        # HF's Kimi_K25ForConditionalGeneration nests both under ``model.``; the release does not.
        prefixes = ("model.", "") if hf_format == "hf" else ("",)
        drop = _LANGUAGE
    else:
        rules = _tower_rules(cfg, hf_format, "")
        prefixes = (("", "vision_tower.", "model.vision_tower.") if hf_format == "hf"
                    else ("vision_tower.", ""))
        drop = _LANGUAGE + (_ANY_PROJECTOR,)
    return RuleSet(rules=tuple(rules), variables={"i": vision_cfg(cfg).num_hidden_layers},
                   hf_prefixes=prefixes, drop_hf=drop, hf_format=hf_format,
                   validate_tp=lambda tp: tp_problems(cfg, tp))


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
