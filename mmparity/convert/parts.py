"""A whole VLM's parts: an mcore source seen as one of its parts (``--part``), one part made whole
again from its base release (``--to hf --base``), and the Megatron class a part is laid out for.

``LLaVAModel`` holds a whole VLM (``vision_model.`` / ``vision_projection.`` / ``language_model.``);
``GPTModel`` holds its language model trained alone, under its own keys. Both are targets: what one
holds of the source is written, the rest is left out and reported, and a checkpoint of one part is
made whole again only from the release it came from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmparity.errors import ConvertError
from mmparity.io.formats.base import Source, SourceUse, part_root
from mmparity.io.formats.mcore import McoreSource
from mmparity.mapping import rules as R
from mmparity.mapping.tables import mcore_order, tp_kinds

__all__ = ["PartView", "WithBase", "as_target_part", "refuse_part_alone", "part_megatron_class", "megatron_class_of"]


class PartView:
    """A whole VLM's mcore source seen as one of its parts (``root``, e.g. ``language_model.``): its
    keys under the root, without it, and that part's table; everything else is the source's."""

    def __init__(self, inner: Source, root: str):
        self._inner, self.part = inner, root
        self.rules = R.part_rules(inner.rules, root)
        self.metas = {key[len(root):]: meta for key, meta in inner.metas.items() if key.startswith(root)}
        self.kinds = tp_kinds(self.rules)
        self.order = mcore_order(self.rules)
        # What it leaves of the whole, by part, as an HF source's plan says it.
        self.use = SourceUse.split([k for k in inner.metas if k.startswith(root)],
                                   [k for k in inner.metas if not k.startswith(root)],
                                   {key: meta.nbytes for key, meta in inner.metas.items()})

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def mcore_pieces(self, key: str) -> list[torch.Tensor]:
        return self._inner.mcore_pieces(self.part + key)

    def produce(self, key: str) -> tuple[list, list]:
        return self._inner.produce(self.part + key)

    def provenance_extra(self) -> dict:
        return {**self._inner.provenance_extra(), "left_out": self.use.to_json()}


class WithBase:
    """An mcore checkpoint of one part of a whole VLM (a language model Megatron-LM trained as
    ``GPTModel``) made whole again for HF output: its part under its root, every other tensor from
    the base release (``--base``), which the trained model never held; ``from_base`` names those."""

    def __init__(self, inner: Source, base: Source):
        self._inner, self._base, root = inner, base, inner.part
        self.part = ""
        self.rules = self.whole_rules = inner.whole_rules
        self.metas = {**{key: meta for key, meta in base.metas.items() if not key.startswith(root)},
                      **{root + key: meta for key, meta in inner.metas.items()}}
        self.from_base = tuple(key for key in self.metas if not key.startswith(root)) + tuple(
            root + key for key in inner.from_base)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def mcore_pieces(self, key: str) -> list[torch.Tensor]:
        root = self._inner.part
        if key.startswith(root):
            return self._inner.mcore_pieces(key[len(root):])
        return self._base.mcore_pieces(key)

    def produce(self, key: str) -> tuple[list, list]:
        return self.mcore_pieces(key), []

    def locate(self, piece) -> tuple[int, int] | None:
        return self._inner.locate(piece) or self._base.locate(piece)


def _held_alone(source: Source) -> str:
    """How a message names what an mcore checkpoint of one part holds."""
    name = R.part_name(source.part)
    megatron_class = R.PART_CLASSES.get(source.part)
    return f"the {name} alone" + (f" (laid out for Megatron's {megatron_class})" if megatron_class else "")


def refuse_part_alone(source: Source, doing: str) -> None:
    """An mcore checkpoint of one part refused by what needs the whole model (``doing``)."""
    if source.part:
        raise ConvertError(f"{source.root}: holds {_held_alone(source)}; {doing}")


def as_target_part(source: Source, to: str, part: str | None):
    """``source`` as a conversion ``--to to`` writes it: a whole VLM's mcore checkpoint seen as the
    part ``--part`` asks for; one part made whole again from ``--base`` for HF output."""
    if not isinstance(source, McoreSource):
        return source
    if to == "hf" and source.part:
        base = source.model_config.base_source if source.model_config is not None else None
        if base is None:
            refuse_part_alone(source, "an HF release is the whole model: pass --base HF_DIR (the release it was "
                                      "converted from) for the other parts, which it never held")
        return WithBase(source, base)
    if to == "mcore" and part is not None and R.part_name(source.part or "whole.") != part:
        if source.part:
            raise ConvertError(f"{source.root}: holds {_held_alone(source)}, not --part {part}")
        return PartView(source, part_root(source.rules, source.family, part))
    return source


def part_megatron_class(root: str, whole_roots: Sequence[str]) -> str:
    """The Megatron class an mcore checkpoint of a whole VLM's part (``root``; "" the whole) is laid
    out for, where one class is known to hold exactly that ("" otherwise: a tower's class is its
    family's)."""
    if not root:
        return "LLaVAModel" if "language_model." in whole_roots else ""
    return R.PART_CLASSES.get(root, "")


def megatron_class_of(source) -> str:
    """The Megatron class the mcore output of ``source`` is laid out for ("" where no one class is
    known to hold it: a tower's class is its family's). A whole VLM is named in ``LLaVAModel``'s
    module layout whatever its family; the manifest names that class only where the family's
    ``LLaVAModel`` can be built for this model (Qwen-VL, Kimi or Mistral3 wholes load part by part)."""
    whole = source.whole_rules if source.part else source.rules
    name = part_megatron_class(source.part, R.rule_roots(whole))
    if name and not source.part and not _builds(source, name):
        return ""
    return name


def _builds(source, name: str) -> bool:
    """Whether ``source``'s family names ``name`` as the class of the whole for its config (its
    record's ``megatron_whole``, which reads the config alone)."""
    spec = getattr(getattr(source, "model", None), "spec", None)
    whole = getattr(spec, "megatron_whole", None)
    return whole is not None and whole(source.cfg) == name
