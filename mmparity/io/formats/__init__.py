"""The checkpoint formats: one module each (:mod:`.hf`, :mod:`.legacy`, :mod:`.torch_dist`), each
holding its detect, probe, reader, writer and verifier behind one :class:`~.base.Format` record, and
this list of them, which the pipeline, ``verify``, ``verify --load`` and ``check --mcore`` look a
format up in instead of switching on its name.

The list is written out here, in the order detection tries them. A format added at run time (a
throwaway in the tests) is one :func:`register` call; nothing else names a format.
"""

from __future__ import annotations

from pathlib import Path

from mmparity.errors import ConvertError
from mmparity.io.formats import hf, legacy, torch_dist
from mmparity.io.formats.base import HF, MCORE, Format, neither
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.layout import TRACKER_FILE, resolve_iteration_dir
from mmparity.io.manifest import allow_layout, forget_layout

__all__ = ["BUILT_IN", "register", "unregister", "formats", "get", "by_layout", "target", "writable",
           "detect_directory", "detect_iteration", "source_format"]

BUILT_IN = (hf.FORMAT, legacy.FORMAT, torch_dist.FORMAT)
_FORMATS: dict[str, Format] = {f.name: f for f in BUILT_IN}


def register(*records: Format) -> None:
    """Adds formats (after those there: detection tries them in this order)."""
    for record in records:
        if record.kind not in (HF, MCORE):
            raise ValueError(f"format {record.name!r}: kind must be {HF!r} or {MCORE!r}, got {record.kind!r}")
        if record.name in _FORMATS or any(f.layout == record.layout for f in _FORMATS.values()):
            raise ValueError(f"format {record.name!r} (layout {record.layout!r}) is already registered")
        _FORMATS[record.name] = record
        allow_layout(record.layout)


def unregister(name: str) -> None:
    record = _FORMATS.pop(name, None) if name not in {f.name for f in BUILT_IN} else None
    if record is not None:
        forget_layout(record.layout)


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


def source_format(path: Path, iteration: int | str | None = None) -> Format:
    """The format of a source directory (an HF directory, or an mcore root or iteration
    directory), or a :class:`ConvertError` saying what it is not."""
    if not path.exists():
        raise ConvertError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise ConvertError(f"{path}: not a directory (expected an HF save_pretrained directory or an mcore checkpoint)")
    found = detect_directory(path)
    if found is not None:
        return found
    try:
        _, iteration_dir, _ = resolve_iteration_dir(path, iteration)
    except CheckpointError as exc:
        if (path / TRACKER_FILE).exists() or path.name.startswith("iter_"):
            raise ConvertError(str(exc)) from None
        whats = [f.what for f in formats(HF)] + [f"an mcore checkpoint ({TRACKER_FILE})"]
        raise ConvertError(f"{path}: {neither(whats)}") from None
    found = detect_iteration(iteration_dir)
    if found is not None:
        return found
    raise ConvertError(f"{iteration_dir}: {neither([f.what for f in formats(MCORE)])}")
