"""`mmparity.json`: what we wrote, so a checkpoint can be re-checked long after it left our hands.

Every checkpoint mmparity writes carries one at its root: the layout, family, where the weights
came from, key prefixes, TP/PP/EP sizes, the mmparity version, and a checksum record (dtype, shape,
and an xxh3-128 or sha256 digest of the bytes) per tensor, or per written shard for torch_dist, where a record also holds
the shard's offset in the global tensor. `mmparity.io.verify` re-reads everything
against it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import mmparity
from mmparity.io.fsio.checksums import TensorChecksum
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio import shared
from mmparity.io.fsio.bounded import check_bounded, json_value
from mmparity.io.fsio.json_members import object_members
from mmparity.io.fsio.paths import is_plain_relative_path, require_regular_file
from mmparity.io.fsio.publish import write_extra_files
from mmparity.io.layout import RELEASE, TRACKER_FILE, write_tracker

# Positions and iteration numbers are 64-bit in Megatron-LM and torch; past that, nothing is real.
_MAX_POSITION = 2**63

__all__ = [
    "MANIFEST_FILE",
    "LAYOUT_HF",
    "LAYOUT_LEGACY",
    "LAYOUT_TORCH_DIST",
    "Provenance",
    "TensorRecord",
    "Manifest",
    "write_manifest",
    "read_manifest",
    "key_prefixes",
    "allow_layout",
    "forget_layout",
]

MANIFEST_FILE = "mmparity.json"
MANIFEST_SCHEMA = 1
# Far above any manifest (about 430 bytes a tensor: 30 MB for a release of 70k tensors); past it the
# file is no manifest of ours, and is not read into memory.
MAX_MANIFEST_BYTES = 2**30

LAYOUT_HF = "hf_safetensors"
LAYOUT_LEGACY = "mcore_legacy"
LAYOUT_TORCH_DIST = "mcore_torch_dist"
# The manifest's "tensors_stored", by mcore layout.
TENSORS_STORED = {LAYOUT_TORCH_DIST: "global", LAYOUT_LEGACY: "per_rank"}
LAYOUTS = (LAYOUT_HF, LAYOUT_LEGACY, LAYOUT_TORCH_DIST)
# What a manifest may name: the built-in formats' layouts, and those of formats added at run time
# (``mmparity.io.formats.register`` adds theirs here, ``unregister`` takes it away).
_known_layouts = list(LAYOUTS)


def allow_layout(layout: str) -> None:
    if layout not in _known_layouts:
        _known_layouts.append(layout)


def forget_layout(layout: str) -> None:
    if layout in _known_layouts and layout not in LAYOUTS:
        _known_layouts.remove(layout)


@dataclasses.dataclass(frozen=True)
class Provenance:
    """What the caller knows about the weights; stored verbatim in the manifest."""

    family: str | None = None
    source_layout: str | None = None  # e.g. "hf_safetensors", "mcore_legacy"
    source_format: str | None = None  # e.g. the HF-side layout ("hf", "mistral") or key spelling
    source_path: str | None = None
    key_prefixes: tuple[str, ...] | None = None  # None: derived from the written keys
    extra: Mapping | None = None


@dataclasses.dataclass(frozen=True, slots=True)  # one per tensor: no __dict__
class TensorRecord:
    """One checksummed tensor: `file` is relative to the checkpoint root (for torch_dist the
    iteration directory), `offset` the shard's position in the global tensor (torch_dist only)."""

    file: str
    key: str
    checksum: TensorChecksum
    offset: tuple[int, ...] | None = None

    def to_json(self) -> dict:
        record = {"file": self.file, "key": self.key, **self.checksum.to_json()}
        if self.offset is not None:
            record["offset"] = list(self.offset)
        return record

    @classmethod
    def from_json(cls, record: Mapping) -> TensorRecord:
        offset = record.get("offset")
        if offset is not None and (not isinstance(offset, list) or not all(
                isinstance(n, int) and not isinstance(n, bool) and 0 <= n < _MAX_POSITION for n in offset)):
            raise ValueError(f"offset {json.dumps(offset)[:60]} is not a list of positions")
        return cls(
            sys.intern(_expect(record["file"], str, "file")),  # a few files, thousands of records
            shared.name(_expect(record["key"], str, "key")),
            TensorChecksum.from_json(record),
            tuple(offset) if offset is not None else None,
        )


def key_prefixes(keys: Iterable[str]) -> tuple[str, ...]:
    """The distinct first name components (`decoder.`, `embedding.` ...): a cheap "what is in here"."""
    return tuple(sorted({key.split(".", 1)[0] + "." if "." in key else key for key in keys}))


@dataclasses.dataclass(frozen=True)
class Manifest:
    layout: str
    tensors: tuple[TensorRecord, ...]
    provenance: Provenance = Provenance()
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pipeline_layer_counts: tuple[int, ...] | None = None
    iteration: int | str | None = None
    mmparity_version: str = mmparity.__version__
    # Megatron's expert_model_parallel_size: legacy rank files hold their EP rank's experts;
    # torch_dist's global tensors load at any, so it records what was asked.
    expert_parallel_size: int = 1

    def to_json(self, tensors: bool = True) -> dict:
        """The manifest as JSON; ``tensors=False`` leaves the records out (``write_manifest``
        writes them one at a time, never a list of thousands of dicts at once)."""
        p = self.provenance
        prefixes = p.key_prefixes if p.key_prefixes is not None else key_prefixes(r.key for r in self.tensors)
        return {
            "schema": MANIFEST_SCHEMA,
            "mmparity_version": self.mmparity_version,
            "layout": self.layout,
            "family": p.family,
            "source": {"layout": p.source_layout, "format": p.source_format, "path": p.source_path},
            "key_prefixes": list(prefixes),
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "pipeline_layer_counts": list(self.pipeline_layer_counts) if self.pipeline_layer_counts else None,
            "expert_parallel_size": self.expert_parallel_size,
            # How its tensors are stored, so that a reader of the sizes above knows what they bind:
            # torch_dist's are global (any TP/PP loads them; the sizes are only how it was saved),
            # legacy rank files hold each rank's slices (the sizes are the checkpoint's own).
            **({"tensors_stored": TENSORS_STORED[self.layout]} if self.layout in TENSORS_STORED else {}),
            "iteration": self.iteration,
            "extra": dict(p.extra or {}),
            "tensors": [r.to_json() for r in self.sorted_tensors()] if tensors else [],
        }

    def sorted_tensors(self) -> list[TensorRecord]:
        return sorted(self.tensors, key=lambda r: (r.file, r.key, r.offset or ()))

    @staticmethod
    def records_from_json(tensors: Iterable) -> list[TensorRecord]:
        """The ``tensors`` list's records, each checked; ``tensors`` may be an iterator that
        decodes them one at a time (``read_manifest``)."""
        records = []
        for number, record in enumerate(tensors):
            record = _expect(record, dict, f"tensors[{number}]")
            if not is_plain_relative_path(record.get("file")):
                raise ValueError(f"tensors[{number}] names file {record.get('file')!r}, which is not a path inside "
                                 "the checkpoint directory")
            records.append(TensorRecord.from_json(record))
        return records

    @classmethod
    def from_json(cls, data: Mapping, records: list[TensorRecord] | None = None) -> Manifest:
        """Parses a manifest, checking every field's type: a manifest is input like any other, and
        a wrong one must be one clear error, never an exception from deep inside a reader.
        ``records``: ``data``'s tensors, already read by :meth:`records_from_json`."""
        data = _expect(data, dict, "the manifest")
        source = _expect(data.get("source") or {}, dict, "source")
        counts = data.get("pipeline_layer_counts")
        if records is None:
            records = cls.records_from_json(_expect(data.get("tensors"), list, "tensors"))
        optional_str = {name: _expect(value, (str, type(None)), name) for name, value in (
            ("family", data.get("family")), ("source.layout", source.get("layout")),
            ("source.format", source.get("format")), ("source.path", source.get("path")))}
        return cls(
            layout=_expect(data.get("layout"), str, "layout"),
            tensors=tuple(records),
            provenance=Provenance(
                family=optional_str["family"],
                source_layout=optional_str["source.layout"],
                source_format=optional_str["source.format"],
                source_path=optional_str["source.path"],
                key_prefixes=tuple(_expect(data.get("key_prefixes") or [], list, "key_prefixes")),
                extra=_expect(data.get("extra") or {}, dict, "extra"),
            ),
            tensor_parallel_size=_positive(data.get("tensor_parallel_size", 1), "tensor_parallel_size"),
            pipeline_parallel_size=_positive(data.get("pipeline_parallel_size", 1), "pipeline_parallel_size"),
            pipeline_layer_counts=(tuple(_positive(c, "pipeline_layer_counts")
                                         for c in _expect(counts, list, "pipeline_layer_counts"))
                                   if counts is not None else None),
            iteration=_iteration(data.get("iteration")),
            mmparity_version=str(data.get("mmparity_version", "unknown")),
            expert_parallel_size=_positive(data.get("expert_parallel_size", 1), "expert_parallel_size"),
        )


def _expect(value, types, what: str):
    """`value` if it has one of `types` (never a bool: JSON's true is no number here)."""
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) or not isinstance(value, types):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ValueError(f"{what} is {json.dumps(value)[:60]}, expected {names}")
    return value


def _iteration(value) -> int | str | None:
    """What convert writes: Megatron-LM's iteration number (its tracker's range), "release", or
    null; anything else names no iteration directory there could be."""
    if value is None or value == RELEASE:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_POSITION:
        raise ValueError(f"iteration is {json.dumps(value)[:60]}, expected an iteration number, "
                         f"{json.dumps(RELEASE)} or null")
    return value


def _positive(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} is {json.dumps(value)[:60]}, expected a positive integer")
    return value


# json.dumps's own string encoder (ensure_ascii), in C where the interpreter has it.
_json_string = json.encoder.encode_basestring_ascii


def _record_text(record: Mapping) -> str:
    """``json.dumps(record, indent=1)`` as nested two deeper in the manifest, for a record of strings
    and lists of ints (any other value goes through ``json.dumps``). json's indented encoder is its
    pure-Python one: at a release's tens of thousands of records, most of writing the manifest."""
    lines = []
    for key, value in record.items():
        if type(value) is str:
            text = _json_string(value)
        elif type(value) is list and all(type(n) is int for n in value):
            text = "[\n    " + ",\n    ".join(map(repr, value)) + "\n   ]" if value else "[]"
        else:
            text = json.dumps(value, indent=1).replace("\n", "\n   ")
        lines.append("   " + _json_string(key) + ": " + text)
    return "{\n" + ",\n".join(lines) + "\n  }" if lines else "{}"


def write_manifest(directory: str | os.PathLike, manifest: Manifest) -> Path:
    if manifest.layout not in _known_layouts:
        raise CheckpointError(f"unknown checkpoint layout {manifest.layout!r}; known: {', '.join(_known_layouts)}")
    path = Path(directory) / MANIFEST_FILE
    # The same text as ``json.dump(manifest.to_json(), f, indent=1)``, the records encoded one at a
    # time: a checkpoint of many thousand tensors never holds all their JSON dicts at once.
    head = json.dumps(manifest.to_json(tensors=False), indent=1)
    marker = '\n "tensors": []'
    if not head.endswith(marker + "\n}"):
        raise AssertionError("the manifest's tensors are expected last")
    records = manifest.sorted_tensors()
    with open(path, "w", encoding="utf-8") as f:
        if not records:
            f.write(head)
        else:
            f.write(head[: -len("[]\n}")] + "[")
            for number, record in enumerate(records):
                f.write(("," if number else "") + "\n  " + _record_text(record.to_json()))
            f.write("\n ]\n}")
        f.write("\n")
    return path


def write_mcore_root(staging: str | os.PathLike, manifest: Manifest,
                     extra_files: Mapping[str, str | bytes] | None = None) -> None:
    """The small files at an mcore checkpoint's root, beside its iteration directory: extra files
    (e.g. the HF config), Megatron-LM's tracker naming the iteration, and the manifest."""
    write_extra_files(Path(staging), extra_files, (MANIFEST_FILE, TRACKER_FILE))
    write_tracker(Path(staging), manifest.iteration)
    write_manifest(staging, manifest)


def read_manifest(directory: str | os.PathLike) -> Manifest:
    path = Path(directory) / MANIFEST_FILE
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: no {MANIFEST_FILE}; this checkpoint was not written by mmparity")
    size = require_regular_file(path, "manifest").st_size
    if size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path}: {size} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may hold "
                              "(about 430 a tensor); not an mmparity manifest: re-create the checkpoint with "
                              "mmparity convert")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_MANIFEST_BYTES + 1)
        if not text.lstrip(" \t\n\r").startswith("{"):
            data = json_value(text, str(path))  # not an object: small, or the decoder's own error
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        # A release's manifest is 30 MB of text for 70k records: decoded record by record, never
        # as one tree (see json_members).
        data, records = {}, None
        for key, value in object_members(text, streamed=("tensors",)):
            if key == "tensors" and isinstance(value, Iterator):
                records = Manifest.records_from_json(value)
            else:
                check_bounded(value, f"{path}: {key!r}", len(text))  # kept whole, and walked later
                data[key] = value
        del text
        if data.get("schema") != MANIFEST_SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r}, expected {MANIFEST_SCHEMA}")
        manifest = Manifest.from_json(data, records)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({' '.join(str(exc).split())})") from exc
    if not manifest.tensors:
        raise CheckpointError(f"{path}: the manifest lists no tensors, so it certifies nothing; re-create the "
                              "checkpoint with mmparity convert")
    return manifest
