"""What an HF safetensors directory is: its file names, its dtype codes, its header metadata, and
HF's spelling of sizes."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mmparity.io.fsio.errors import CheckpointError


SAFETENSORS_SINGLE_FILE = "model.safetensors"
MISTRAL_CONSOLIDATED_FILE = "consolidated.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
# Far above any index (about 80 bytes a tensor: 6 MB for a release of 70k tensors); past it the
# file is no index, and is not read into memory.
MAX_INDEX_BYTES = 2**28

# HF's own default for save_pretrained.
DEFAULT_MAX_SHARD_SIZE = "5GB"


# transformers refuses safetensors files whose header metadata lacks a known "format".
HF_FORMAT_METADATA = {"format": "pt"}


# An mcore checkpoint's side file: the tensors Megatron's class has no place for (see
# `checkpoint.streaming`). Safetensors, but no HF weights: it never makes a directory an HF one.
MCORE_SIDE_FILE = "mcore_side.safetensors"
# The scales of a quantized HF source, beside the mcore checkpoint made from it (--requantize).
MCORE_QUANT_SCALES_FILE = "quant_scales.safetensors"


def has_hf_weights(path: Path) -> bool:
    """Whether directory `path` holds HF safetensors weights (a single file, an index, or shards)."""
    return ((path / SAFETENSORS_SINGLE_FILE).is_file() or (path / SAFETENSORS_INDEX_FILE).is_file()
            or any(p.name not in (MCORE_SIDE_FILE, MCORE_QUANT_SCALES_FILE) for p in path.glob("*.safetensors")))


SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}


# The inverse of SAFETENSORS_DTYPES: what a writer puts in a header.
SAFETENSORS_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


def entry_data_offsets(entry) -> tuple[int, int] | None:
    """A header entry's ``data_offsets`` as (begin, end), or None where the entry has no pair of
    integers there (the readers each say so in their own words)."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets):
        return offsets[0], offsets[1]
    return None


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """`"5GB"` -> 5_000_000_000, `"1MiB"` -> 1_048_576: HF's spelling of `max_shard_size`."""
    if isinstance(size, bool):
        raise CheckpointError(f"invalid size {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+)\s*([KMGT]I?B|B)?\s*", str(size), flags=re.IGNORECASE)
        if not match:
            raise CheckpointError(f"invalid size {size!r}; use bytes or e.g. '500MB', '5GB', '1GiB'")
        value = int(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").upper()]
    if value <= 0:
        raise CheckpointError(f"size must be positive, got {size!r}")
    return value
