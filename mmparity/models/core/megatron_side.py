"""The Megatron side of ``check --impl megatron`` and ``verify --load``: what every family's
Megatron-class record is made of.

A family lists its own Megatron classes in its hooks (``megatron``, in ``mmparity.cases.<name>``;
the first is the default), each a :class:`~mmparity.models.spec.MegatronClass` naming its builder
in :mod:`mmparity.models.core.megatron_classes` (the converter's mcore state dict loads into the class as is),
which of the family's cases it accepts (stock CLIP/SigLIP and ``ViTModel``'s learned positions take
only their configured size, ``KimiViTModel`` has no temporal axis), how to run a case, and which of
its submodules pair with the HF reference's paired modules of the same name, so that a divergence
is located exactly as in the native check. A family with none says why
(:class:`~mmparity.models.spec.NoMegatron`). There is no list of families here: this module holds
the pieces the records share.

A record may hold a part of the family's mcore state dict only (``holds``, under ``root``): whole
VLMs whose ``vit_model`` tower Megatron-LM's ``LLaVAModel`` cannot be built with are checked and
loaded part by part (their records are the LLaVA composition's, :mod:`mmparity.models.llava.megatron`).
"""

from __future__ import annotations

from typing import Callable, Mapping

from mmparity.config import image_hw
from mmparity.models.core import sublayers
from mmparity.models.spec import (
    Case, FamilyHooks, MegatronClass, NoMegatron, NoMegatronClass, Pair, default_refusal, keep_reference_outputs,
    keep_reference_pairs, sbh_tokens_2d, tokens_2d)
from mmparity.models.core import megatron_classes as models

__all__ = ["MegatronClass", "NoMegatron", "NoMegatronClass", "UnsupportedInput", "class_notes", "configured_size",
           "default_refusal",
           "keep_reference_outputs", "keep_reference_pairs", "layer_pairs", "no_pairs",
           "same_cases", "tower_and_projection", "vit_pairs", "whole_model"]


class UnsupportedInput(ValueError):
    """Megatron's class cannot take the inputs asked for (not a parity finding: a usage error)."""


def same_cases(hooks: FamilyHooks, cfg, seed: int, image_sizes) -> list[Case]:
    return hooks.parity.cases(cfg, seed, image_sizes)


def configured_size(vision_cfg: Callable):
    """Cases at the tower's configured size only (its position table is fixed and not resampled)."""
    def cases(hooks: FamilyHooks, cfg, seed: int, image_sizes) -> list[Case]:
        side = image_hw(vision_cfg(cfg))
        other = sorted({f"{h}x{w}" for h, w in image_sizes or () if (h, w) != side})
        if other:
            raise UnsupportedInput(f"Megatron's class takes only the configured image size "
                                   f"{side[0]}x{side[1]} (fixed position table), not {', '.join(other)}")
        return hooks.parity.cases(cfg, seed, image_sizes or [side] * 2)
    return cases


def tower_and_projection(model, case: Case) -> tuple:
    """A :class:`~mmparity.models.core.megatron_classes.VisionWithProjection` on the case's images: the tower's
    (and merger's) tokens and the projector's output."""
    tokens = models.run_vit(model.vision_model, case.data["images"]).tokens
    return tokens, model.vision_projection(tokens)


def layer_pairs(tower) -> list[Pair]:
    return [pair for i, layer in enumerate(tower.decoder.layers)
            for pair in sublayers.layer_pairs(f"layer.{i}", layer, sbh_tokens_2d)]


def vit_pairs(tower) -> list[Pair]:
    """A ``vit_model.ViTModel``'s patch embedding, ``ln_pre`` (where it has one) and layers."""
    out = [Pair("patch_embed", tower.patch_embed, tokens_2d)]
    if tower.ln_pre is not None:
        out.append(Pair("ln_pre", tower.ln_pre, tokens_2d))
    return out + layer_pairs(tower)


def no_pairs(model, cfg) -> list[Pair]:
    return []


def whole_model(model):
    return model


def class_notes(classes: Mapping[str, MegatronClass], name: str, cfg=None) -> str:
    """What a check with Megatron's ``name`` (one of a family's ``classes``) says beside its numbers:
    the record's notes and, for a class holding a part, the family's other classes: whether they
    can be imported here, and which refuse a model of ``cfg`` (offered as a choice, they would be
    the one-line error of :func:`~mmparity.models.spec.megatron_class`)."""
    record = classes[name]
    notes = [record.notes] if record.notes else []
    if record.holds:
        others = []
        for other, rec in classes.items():
            if other == name:
                continue
            refusal = rec.refusal(cfg)
            if refusal is not None:
                others.append(f"{other} (cannot be built for this model)")
            elif not models.available(rec.build):
                others.append(f"--megatron-class {other} (needs Megatron-LM main's vit_model, not importable here)")
            else:
                others.append(f"--megatron-class {other}")
        held = f"{name} holds {', '.join(p + '*' for p in record.holds)}"
        notes.append(f"{held}; the family's other Megatron classes: {', '.join(others)}" if others else held)
    return "; ".join(notes)
