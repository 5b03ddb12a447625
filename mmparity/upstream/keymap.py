"""From the mcore state dict ``converters.hf_to_mcore`` writes today to Megatron's own class's.

Pure tensors and names (no megatron, no transformers): the differences are data, one rule list
per family, each rule with an exact inverse except where the docs say none exists. The converters
of clip, siglip and llava (CLIP / SigLIP towers) write Megatron's layout themselves, with what has
no place kept aside (``McoreShards.side``): for them the map is a pass-through that hands those
side tensors on.

* :class:`Rename` — the same tensor under Megatron's name (``patch_conv.conv.*`` ->
  ``patch_embed.proj.*``, ``merger.norm`` -> ``merger.pre_norm`` ...).
* :class:`Side` — a tensor Megatron's class has no place for (Kimi's projector ``pre_norm``). It
  leaves the Megatron state dict and is returned beside it, so that nothing is lost.
* :class:`Replicate` — a tensor mmparity splits over TP ranks that Megatron keeps whole on every
  rank (Qwen's merger linears are plain ``nn.Linear``\\ s): the rank pieces are concatenated.
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

from mmparity.converters.rules import McoreShards


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
class Tile:
    source: str  # mmparity key (kept as a side tensor as well)
    target: str  # Megatron key
    times: int


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's ``--make-vocab-size-divisible-by`` rule: a multiple of ``divisible_by * tp``."""
    step = divisible_by * tp
    return -(-vocab_size // step) * step




def rules(family: str, cfg, *, kimi_projection: Optional[str] = "fused_norm_over_merged") -> list:
    """The rule list for ``family`` and its HF config."""
    # These converters write Megatron's layout themselves (what has no place kept aside).
    if family in ("clip", "siglip", "pixtral", "pixtral_large", "qwen3_5", "llava"):
        return []
    if family == "clip_vit":
        return [Rename(r"conv1\.weight", r"patch_embed.proj.weight")]
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
    raise KeyError(f"no Megatron key map for family {family!r}")


def _match(pattern: str, key: str) -> bool:
    return re.fullmatch(pattern, key) is not None


def to_megatron(family: str, shards: Sequence[Mapping[str, torch.Tensor]], cfg, **options
                ) -> tuple[list[dict], dict]:
    """mmparity's per-TP-rank state dicts -> (Megatron's per-rank state dicts, side tensors).

    ``side`` maps each mmparity key with no Megatron place to its per-rank pieces, as mmparity
    wrote them (the SigLIP head is TP-split, CLIP's ``ln_post`` replicated): the converter's own
    side tensors (``shards.side``) and those this map sets aside."""
    rule_list = rules(family, cfg, **options)
    tp = len(shards)
    out = [dict() for _ in range(tp)]
    side: dict = {}
    for rank, extra in enumerate(getattr(shards, "side", None) or []):
        for key, value in extra.items():
            side.setdefault(key, [None] * tp)[rank] = value
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
    per-rank dicts, as :class:`McoreShards` whose ``side`` holds what the converter keeps aside.
    ``mmparity_vocab_rows`` is accepted for callers of the phase-1 map and changes nothing: the
    converter pads vocabularies as Megatron-LM does."""
    rule_list = rules(family, cfg, **options)
    tp = len(megatron)
    tiled = {r.target for r in rule_list if isinstance(r, Tile)}
    out = McoreShards([dict() for _ in range(tp)], unused=getattr(megatron, "unused", ()))
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
        for rank, piece in enumerate(pieces):
            out[rank][old] = piece
    for key, pieces in side.items():
        # What this map set aside was in mmparity's state dict; the rest the converter kept aside.
        mapped = any(isinstance(r, Side) and _match(r.pattern, key) for r in rule_list)
        for rank in range(tp):
            (out if mapped else out.side)[rank][key] = pieces[rank]
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
