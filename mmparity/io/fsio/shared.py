"""One object per distinct tensor name and per distinct shape, however many records hold it.

A conversion keeps a few records per tensor until its manifest and index are written (the source's
header entry, the plan's step, the writer's slot, the checksum, the manifest record), and each used
to hold its own copy of the tensor's name and shape: thousands of tensors made that most of what
grew with the checkpoint. Names are interned (`sys.intern`: one string per name, process-wide, and
the same object for every module that interns it); shapes are few (every expert of a layer has the
same ones) and go through one table. Offsets are not shared: nearly every tensor's is its own.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

__all__ = ["name", "shape"]

_SHAPES: dict[tuple, tuple] = {}


def name(text: str) -> str:
    return sys.intern(text)


def shape(sizes: Iterable[int]) -> tuple[int, ...]:
    """``sizes`` as a tuple of ints, the same object for equal shapes."""
    sizes = tuple(int(n) for n in sizes)
    return _SHAPES.setdefault(sizes, sizes)
