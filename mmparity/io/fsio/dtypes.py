"""Dtype names as manifests spell them, and which dtypes a conversion accepts for what it reads."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import torch

from mmparity.io.fsio.errors import CheckpointError


_DTYPE_NAMES: dict = {}  # one string per dtype, however many tensors name it


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`: the spelling used in manifests and error messages."""
    return _DTYPE_NAMES.get(dtype) or _DTYPE_NAMES.setdefault(dtype, str(dtype).removeprefix("torch."))


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype name {name!r}")
    return dtype


# Which dtypes a conversion accepts for a tensor it reads, as data: (key pattern, accepted dtypes in
# words, test), the first matching pattern decides. A model weight is floating: a container that
# labels one as an integer tensor (a header relabelled I32, DCP metadata claiming int32) lies, and
# converting it would truncate the values or write an integer tensor into a float checkpoint. Only
# tensors that are integer state by nature (Transformer Engine's serialized `_extra_state`, position
# ids, counters) may be anything else. This is the default for every family; entries of one family
# would sit beside its rule table once the architecture of #13 gives them a place.
SOURCE_DTYPE_POLICY: tuple[tuple[re.Pattern, str, object], ...] = (
    (re.compile(r"(^|\.)(_extra_state|position_ids|num_batches_tracked)$"), "any dtype", lambda dtype: True),
    (re.compile(r""), "a floating-point dtype", lambda dtype: dtype.is_floating_point),
)


def check_source_dtypes(where: str | os.PathLike, dtypes: Mapping[str, torch.dtype]) -> None:
    """Refuses source tensors whose declared dtype `SOURCE_DTYPE_POLICY` does not accept (reads no
    data: `dtypes` come from headers); one line naming every offender."""
    bad = []
    for name, dtype in dtypes.items():
        for pattern, accepted, accepts in SOURCE_DTYPE_POLICY:
            if pattern.search(name):
                if not accepts(dtype):
                    bad.append(f"{name} is {dtype_name(dtype)}, expected {accepted}")
                break
    if bad:
        bad.sort()
        more = f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""
        raise CheckpointError(f"{where}: the checkpoint declares a dtype a model weight cannot have: "
                              f"{'; '.join(bad[:4])}{more} (a relabelled header or metadata?)")
