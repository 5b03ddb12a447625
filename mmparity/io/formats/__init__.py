"""Checkpoint formats as records: one module per format (``hf``, ``legacy``, ``torch_dist``), each
exposing a :class:`Format`, and the registry the pipeline, ``verify``, ``verify --load`` and
``check --mcore`` look a format up in instead of switching on its name.

A format says how to tell a directory of it, how to open one as a conversion source, how to write
one, how to re-check one against its manifest and how to load one into Megatron's class. Its
module is a thin adapter over the readers and writers that do the work (``legacy``,
``torch_dist``, ``torch_dist_files``, ``streaming``'s sources and writers). Adding a format is its
module and one :func:`register` call (``mmparity.io`` registers the built-in ones, in the
order detection tries them).

This module imports no format: the format modules import it (and the pipeline), not the other way
round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = ["Format", "Written", "register", "unregister", "formats", "get", "by_layout", "target",
           "writable", "detect_directory", "detect_iteration", "neither", "HF", "MCORE"]

HF, MCORE = "hf", "mcore"  # what a format holds: HF safetensors, or Megatron-Core state dicts


@dataclasses.dataclass(frozen=True)
class Written:
    """What a format's writer wrote: tensors, bytes, and the parallel sizes its files are laid
    out for (a format of global tensors: all 1)."""

    tensors: int
    nbytes: int
    grid: object  # mmparity.parallel.axes.Grid
    requant: object = None  # an HF writer's --requantize report


@dataclasses.dataclass(frozen=True)
class Format:
    """One checkpoint format.

    ``kind`` is what it holds (:data:`HF`: a directory of safetensors, itself the checkpoint;
    :data:`MCORE`: a Megatron iteration directory, found through its root's tracker). ``detect``
    is asked of that directory. ``stores_grid``: its files are per rank (legacy), so a checkpoint
    keeps the TP/PP/EP sizes it was written at; otherwise it holds global tensors that load at any
    size.
    """

    name: str  # as --format names it
    layout: str  # as the manifest records it
    kind: str
    what: str  # a directory of it in words, for "neither ... nor ..." messages
    detect: Callable[[Path], bool]
    # (path, family, hf_format, tensor filter, tp, vocab_multiple, complete, *, model_config, iteration)
    # -> a streaming source; model_config and iteration describe a checkpoint Megatron-LM wrote
    # (--base / --hf-config, --iteration)
    open_source: Callable[..., object]
    # (source, ConvertOptions, Progress) -> Written
    write: Callable[..., Written]
    # (root, {file: [TensorRecord]}, VerifyReport): checks every record, appends the problems
    verify: Callable[[Path, Mapping[str, Sequence], object], None]
    # verify --load: (rank, LoadJob, model, built parts) -> (state, {prefix: not loaded}, filled);
    # None: Megatron's class does not load this format
    load_state: Callable | None = None
    stores_grid: bool = False
    records_directories: bool = False  # a tensor record names a directory of files, not a file
    load_unit: str = "keys"  # what verify --load counts of what it did not load
    default: bool = False  # the output format of its kind when none is named (listed first)


_FORMATS: dict[str, Format] = {}


def register(*records: Format) -> None:
    """Adds formats (after those registered before: detection tries them in this order)."""
    for record in records:
        if record.kind not in (HF, MCORE):
            raise ValueError(f"format {record.name!r}: kind must be {HF!r} or {MCORE!r}, got {record.kind!r}")
        if record.name in _FORMATS or any(f.layout == record.layout for f in _FORMATS.values()):
            raise ValueError(f"format {record.name!r} (layout {record.layout!r}) is already registered")
        _FORMATS[record.name] = record


def unregister(name: str) -> None:
    _FORMATS.pop(name, None)


def formats(kind: str | None = None) -> list[Format]:
    return [f for f in _FORMATS.values() if kind is None or f.kind == kind]


def get(name: str) -> Format:
    return _FORMATS[name]


def by_layout(layout: str) -> Format | None:
    """The format a manifest's ``layout`` names; None for one no format writes."""
    return next((f for f in _FORMATS.values() if f.layout == layout), None)


def writable(kind: str = MCORE) -> tuple[str, ...]:
    """The names ``--format`` takes for output of ``kind``, the default first."""
    return tuple(f.name for f in sorted(formats(kind), key=lambda f: not f.default))


def target(to: str, name: str) -> Format:
    """The format ``convert --to`` writes: HF output has one format, mcore output the one named."""
    return formats(to)[0] if to == HF else _FORMATS[name]


def detect_directory(path: Path) -> Format | None:
    """The format of a directory that is itself a checkpoint (HF), or None."""
    return next((f for f in formats(HF) if f.detect(path)), None)


def detect_iteration(iteration_dir: Path) -> Format | None:
    """The format of a Megatron iteration directory, or None."""
    return next((f for f in formats(MCORE) if f.detect(iteration_dir)), None)


def neither(whats: Sequence[str]) -> str:
    """``neither A nor B`` (``neither A, B nor C``) of directories described in words."""
    if len(whats) == 1:
        return f"not {whats[0]}"
    return f"neither {', '.join(whats[:-1])} nor {whats[-1]}"
