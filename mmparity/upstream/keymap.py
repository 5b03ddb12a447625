"""From the mcore state dict ``converters.hf_to_mcore`` writes today to Megatron's own class's.

Pure tensors and names (no megatron, no transformers): the differences are data, one rule list
per family, each rule with an exact inverse except where the docs say none exists.

* :class:`Rename` — the same tensor under Megatron's name (``patch_conv.conv.*`` ->
  ``conv1.*``, ``merger.norm`` -> ``merger.pre_norm`` ...).
* :class:`Side` — a tensor Megatron's class has no place for (CLIP ``ln_post``, the SigLIP
  head, layers past LLaVA's ``vision_feature_layer`` ...). It leaves the Megatron state dict and is
  returned beside it, so that nothing is lost.
* :class:`Replicate` — a tensor mmparity splits over TP ranks that Megatron keeps whole on every
  rank (Qwen's merger linears are plain ``nn.Linear``\\ s): the rank pieces are concatenated.
* :class:`RepadVocab` — vocabulary rows padded to Megatron-LM's multiple of
  ``make_vocab_size_divisible_by × TP`` instead of mmparity's multiple of 128, then re-split.
* :class:`Tile` — Kimi's per-sub-token norm placed, approximately, as a norm over the merged
  vector (see ``models.kimi_projection``); the H-sized vector is repeated m² times. The original
  stays a side tensor too, since the Megatron function differs.

:func:`to_megatron` applies a family's rules to the per-rank dicts; :func:`from_megatron` undoes
them bit-exactly given the side tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch


@dataclass(frozen=True)
class Rename:
    pattern: str  # full-match regex on mmparity's key
    replacement: str  # re.sub template for Megatron's key


@dataclass(frozen=True)
class Side:
    pattern: str
    why: str


@dataclass(frozen=True)
class Replicate:
    pattern: str  # Megatron's key (after renames)
    dim: int  # the dim mmparity splits it along


@dataclass(frozen=True)
class RepadVocab:
    pattern: str
    vocab_size: int
    divisible_by: int = 128


@dataclass(frozen=True)
class Tile:
    source: str  # mmparity key (kept as a side tensor as well)
    target: str  # Megatron key
    times: int


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's ``--make-vocab-size-divisible-by`` rule: a multiple of ``divisible_by * tp``."""
    step = divisible_by * tp
    return -(-vocab_size // step) * step


_TOWER_RENAMES = {
    "clip": [Rename(r"(.*)patch_conv\.conv\.(weight|bias)", r"\1conv1.\2")],
    "siglip": [Rename(r"(.*)patch_conv\.conv\.(weight|bias)", r"\1conv1.\2")],
    "pixtral": [Rename(r"(.*)patch_conv\.conv\.(weight|bias)", r"\1patch_embed.proj.\2")],
}


def _feature_layers(cfg) -> int:
    layer = cfg.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer={layer!r}: Megatron's LLaVAModel takes one layer")
    total = cfg.vision_config.num_hidden_layers
    return layer + total + 1 if layer < 0 else layer


def rules(family: str, cfg, *, kimi_projection: Optional[str] = "fused_norm_over_merged") -> list:
    """The rule list for ``family`` and its HF config."""
    if family == "clip":
        return [*_TOWER_RENAMES["clip"],
                Side(r"ln_post\.(weight|bias)", "stock CLIPViTModel has no ln_post in CLIP mode "
                                                "(HF applies it to the pooled class token only)")]
    if family == "clip_vit":
        return [Rename(r"patch_conv\.conv\.weight", r"patch_embed.proj.weight"),
                Side(r"ln_post\.(weight|bias)", "ViTModel has no ln_post")]
    if family == "siglip":
        return [*_TOWER_RENAMES["siglip"],
                Side(r"head\..*", "stock CLIPViTModel has no attention-pooling head")]
    if family == "pixtral":
        return list(_TOWER_RENAMES["pixtral"])
    if family == "pixtral_large":
        return [Rename(r"vision_model\.patch_conv\.conv\.weight", r"vision_model.patch_embed.proj.weight"),
                Rename(r"vision_model\.merger\.norm\.weight", r"vision_model.merger.pre_norm.weight"),
                Rename(r"vision_model\.merger\.merging_layer\.weight",
                       r"vision_model.merger.linear_fc1.weight")]
    if family == "qwen3_5":
        return [Replicate(r"merger\.linear_fc1\.(weight|bias)", 0),
                Replicate(r"merger\.linear_fc2\.weight", 1)]
    if family == "kimi_k25":
        has_projector = getattr(cfg, "model_type", None) == "kimi_k25"
        prefix = "vision_model." if has_projector else ""
        out = [Rename(r"patch_embed\.conv\.(weight|bias)", prefix + r"patch_embed.proj.\1"),
               Rename(r"decoder\.final_layernorm\.(weight|bias)", prefix + r"final_ln.\1"),
               Rename(r"(pos_embed\.weight|decoder\.layers\..*)", prefix + r"\1")]
        if has_projector:
            out.append(Side(r"vision_projection\.pre_norm\.(weight|bias)",
                            "Kimi normalises each merged sub-token over H; Megatron has no "
                            "per-sub-token norm (MultimodalProjector's fused norm spans the "
                            "merged vector)"))
            if kimi_projection == "fused_norm_over_merged":
                times = tuple(cfg.vision_config.merge_kernel_size)
                out += [Tile(f"vision_projection.pre_norm.{p}",
                             f"vision_projection.encoder.linear_fc1.layer_norm_{p}",
                             times[0] * times[1]) for p in ("weight", "bias")]
        return out
    if family == "llava":
        vc = cfg.vision_config
        tower = {"clip_vision_model": "clip", "siglip_vision_model": "siglip",
                 "pixtral": "pixtral"}[vc.model_type]
        keep = _feature_layers(cfg)
        out = [Rename(r.pattern.replace("(.*)", r"(vision_model\.)"), r.replacement)
               for r in _TOWER_RENAMES[tower]]
        if keep < vc.num_hidden_layers:
            dropped = "|".join(str(i) for i in range(keep, vc.num_hidden_layers))
            out.append(Side(rf"vision_model\.decoder\.layers\.({dropped})\..*",
                            f"Megatron builds the tower {keep} layers deep "
                            f"(vision_feature_layer={cfg.vision_feature_layer})"))
        out.append(Side(r"vision_model\.(ln_post|head)\..*",
                        "LLaVA reads the tower's hidden states; Megatron's tower has no place"))
        vocab = cfg.text_config.vocab_size
        out += [RepadVocab(r"language_model\.embedding\.word_embeddings\.weight", vocab),
                RepadVocab(r"language_model\.output_layer\.weight", vocab)]
        return out
    raise KeyError(f"no Megatron key map for family {family!r}")


def _match(pattern: str, key: str) -> bool:
    return re.fullmatch(pattern, key) is not None


def to_megatron(family: str, shards: Sequence[Mapping[str, torch.Tensor]], cfg, **options
                ) -> tuple[list[dict], dict]:
    """mmparity's per-TP-rank state dicts -> (Megatron's per-rank state dicts, side tensors).

    ``side`` maps each mmparity key with no Megatron place to its per-rank pieces, as mmparity
    wrote them (the SigLIP head is TP-split, CLIP's ``ln_post`` replicated)."""
    rule_list = rules(family, cfg, **options)
    tp = len(shards)
    out = [dict() for _ in range(tp)]
    side: dict = {}
    for key in shards[0]:
        if any(isinstance(r, Side) and _match(r.pattern, key) for r in rule_list):
            side[key] = [s[key] for s in shards]
            continue
        new = key
        for r in rule_list:
            if isinstance(r, Rename) and _match(r.pattern, key):
                new = re.sub(r.pattern, r.replacement, key)
                break
        pieces = [s[key] for s in shards]
        for r in rule_list:
            if isinstance(r, Replicate) and _match(r.pattern, new) and tp > 1:
                whole = torch.cat(pieces, dim=r.dim)
                pieces = [whole] * tp
            if isinstance(r, RepadVocab) and _match(r.pattern, new):
                whole = torch.cat(pieces, dim=0)[: r.vocab_size]
                rows = padded_vocab_size(r.vocab_size, tp, r.divisible_by)
                padded = whole.new_zeros(rows, *whole.shape[1:])
                padded[: r.vocab_size] = whole
                pieces = list(padded.chunk(tp, dim=0))
        for rank, piece in enumerate(pieces):
            out[rank][new] = piece
    for r in rule_list:
        if isinstance(r, Tile):
            for rank in range(tp):
                out[rank][r.target] = side[r.source][rank].repeat(r.times)
    return out, side


def from_megatron(family: str, megatron: Sequence[Mapping[str, torch.Tensor]], side: Mapping,
                  cfg, mmparity_vocab_rows: Optional[int] = None, **options) -> list[dict]:
    """The inverse of :func:`to_megatron`: Megatron's per-rank dicts + side tensors -> mmparity's
    per-rank dicts. ``mmparity_vocab_rows`` is mmparity's padded vocabulary (LLaVA only)."""
    rule_list = rules(family, cfg, **options)
    tp = len(megatron)
    tiled = {r.target for r in rule_list if isinstance(r, Tile)}
    out = [dict() for _ in range(tp)]
    for key in megatron[0]:
        if key in tiled:
            continue
        old = key
        for r in rule_list:
            if isinstance(r, Rename):
                inverse = _invert_rename(r, key)
                if inverse is not None:
                    old = inverse
                    break
        pieces = [m[key] for m in megatron]
        for r in rule_list:
            if isinstance(r, Replicate) and _match(r.pattern, key) and tp > 1:
                pieces = list(pieces[0].chunk(tp, dim=r.dim))
            if isinstance(r, RepadVocab) and _match(r.pattern, key):
                if mmparity_vocab_rows is None:
                    raise ValueError("mmparity_vocab_rows is needed to undo the vocabulary padding")
                whole = torch.cat(pieces, dim=0)[: r.vocab_size]
                padded = whole.new_zeros(mmparity_vocab_rows, *whole.shape[1:])
                padded[: r.vocab_size] = whole
                pieces = list(padded.chunk(tp, dim=0))
        for rank, piece in enumerate(pieces):
            out[rank][old] = piece
    for key, pieces in side.items():
        for rank in range(tp):
            out[rank][key] = pieces[rank]
    return out


def _invert_rename(rule: Rename, key: str) -> Optional[str]:
    """Megatron key -> mmparity key for one rename, by turning the template into a pattern."""
    groups = re.findall(r"\((?:[^()\\]|\\.)*\)", rule.pattern)
    pattern = re.escape(rule.replacement)
    for i, group in enumerate(groups, start=1):
        pattern = pattern.replace(re.escape(f"\\{i}"), group)
    m = re.fullmatch(pattern, key)
    if m is None:
        return None
    source = rule.pattern
    for group, value in zip(groups, m.groups()):
        source = source.replace(group, value, 1)
    return source.replace("\\.", ".")
