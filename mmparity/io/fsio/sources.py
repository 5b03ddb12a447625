"""Sources watched while a conversion reads them: a publish refuses what changed underneath."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

from mmparity.io.fsio.errors import CheckpointError


# A conversion publishes only what it read from one state of its source: `sources_unchanged(paths)`
# records (inode, size, mtime) of every file under the source while a conversion runs, and
# `publish_staging_directory` re-checks them before the rename. A file rewritten in place, truncated
# or replaced by another under the converter is refused by name (the bytes read may mix two versions
# of it, and a checksum of them certifies neither); nothing is published.

_WATCHED_SOURCES: list[dict[str, tuple]] = []


def _signature(path: str) -> tuple | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def _source_files(paths: Iterable[str | os.PathLike]) -> dict[str, tuple]:
    files: dict[str, tuple] = {}
    for path in paths:
        path = os.fspath(path)
        walk = os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [os.path.basename(path)])]
        for current, _directories, names in walk:
            for name in names:
                full = os.path.join(current, name)
                if os.path.isfile(full):
                    files[full] = _signature(full)
    return files


def changed_sources() -> list[tuple[str, str]]:
    """(path, how) for every watched source file that is not as it was when the watch began."""
    found = []
    for files in _WATCHED_SOURCES:
        for path, before in files.items():
            now = _signature(path)
            if now == before:
                continue
            if now is None:
                how = "removed"
            elif now[:2] != before[:2]:
                how = "replaced by another file"
            elif now[2] != before[2]:
                how = f"resized from {before[2]} to {now[2]} bytes"
            else:
                how = "rewritten in place"
            found.append((path, how))
    return found


def check_sources_unchanged() -> None:
    changed = changed_sources()
    if changed:
        path, how = changed[0]
        more = f" (and {len(changed) - 1} more file(s))" if len(changed) > 1 else ""
        raise CheckpointError(f"{path}: changed while the conversion read it ({how}){more}; nothing was "
                              "published: convert again once the source is no longer being written")


@contextlib.contextmanager
def sources_unchanged(paths: Iterable[str | os.PathLike]) -> Iterator[None]:
    """Watches every file under `paths` (stat only, no reads) while the block runs; any publish in
    the block first checks that none changed (see above)."""
    files = _source_files(paths)
    _WATCHED_SOURCES.append(files)
    try:
        yield
    finally:
        _WATCHED_SOURCES.remove(files)
