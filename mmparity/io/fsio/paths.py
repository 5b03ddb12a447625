"""What a checkpoint may name: regular files, inside itself; plain relative paths; no link as a
destination."""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from mmparity.io.fsio.errors import CheckpointError


def require_regular_file(path: str | os.PathLike, what: str = "file") -> os.stat_result:
    """`stat`s `path` (never opens it) and refuses anything but a regular file.

    Opening a FIFO blocks until someone writes to it, and a device or socket is no checkpoint: they
    are refused before any `open`, so a hostile directory cannot make a reader hang. Symlinks are
    followed (HF's cache links every file to a blob elsewhere).
    """
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot stat {what} ({exc.strerror})") from None
    if not stat.S_ISREG(status.st_mode):
        raise CheckpointError(f"{path}: not a regular file (a {_file_kind(status.st_mode)}); a checkpoint's "
                              f"{what} must be a plain file")
    return status


# Links. A symbolic link inside a checkpoint is followed only where its target stays inside the
# checkpoint directory (a deduplicating layout linking within itself), or where the checkpoint is a
# Hugging Face hub cache snapshot (`<repo>/snapshots/<rev>/`), whose every file links to
# `<repo>/blobs/<hash>`. A link anywhere else is refused by name: the checkpoint would certify, and
# `convert` would publish, bytes that live in a file the checkpoint does not hold (and that can
# change, or vanish, under it). A hard link (st_nlink > 1) is accepted: its bytes are the file's own,
# read from the inode the checkpoint names exactly as a copy's would be, indistinguishable by path
# from a copy deduplicated by `cp --link` / `rsync --link-dest`, and certified by the manifest's
# checksums (`verify` re-reads them); mmparity never opens a source for writing and writes outputs
# only into files it creates, so nothing is written through the other name either.


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def link_outside(path: str | os.PathLike, root: str | os.PathLike) -> str | None:
    """The resolved target of symlink `path` if it lies outside checkpoint directory `root` (and is
    not a hub cache snapshot's blob), else None. `path` need not be a link."""
    if not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    real_root = os.path.realpath(root)
    if _inside(target, real_root):
        return None
    snapshots = os.path.dirname(real_root)
    if os.path.basename(snapshots) == "snapshots":
        blobs = os.path.join(os.path.dirname(snapshots), "blobs")
        if os.path.dirname(target) == blobs:
            return None  # huggingface_hub's cache layout: snapshots/<rev>/<file> -> ../../blobs/<hash>
    return target


def links_outside(root: str | os.PathLike, directories: Iterable[str | os.PathLike] = (), *,
                  recursive: bool = False, root_names: Iterable[str] | None = None) -> list[tuple[Path, str]]:
    """(link, target) for every symlink directly in `root` (only those named `root_names`, if
    given) or in `directories` (and below them with `recursive`; links to directories are not
    descended) whose target leaves `root`."""
    found = []

    def note(path) -> None:
        target = link_outside(path, root)
        if target is not None:
            found.append((Path(path), target))

    if root_names is not None:
        for name in root_names:
            note(os.path.join(root, name))
        scanned = [(str(d), recursive) for d in directories]
    else:
        scanned = [(str(root), False)] + [(str(d), recursive) for d in directories]
    for directory, deep in scanned:
        if os.path.islink(directory):
            note(directory)
            continue
        walk = os.walk(directory) if deep else [(directory, [], None)]
        for current, subdirectories, _files in walk:
            subdirectories.sort()
            try:
                entries = sorted(os.scandir(current), key=lambda e: e.name)
            except OSError:
                continue
            for entry in entries:
                if entry.is_symlink():
                    note(entry.path)
    return found


def refuse_links_outside(root: str | os.PathLike, directories: Iterable[str | os.PathLike] = (), *,
                         recursive: bool = False, root_names: Iterable[str] | None = None) -> None:
    """Raises `CheckpointError` naming the first symlink of :func:`links_outside`."""
    found = links_outside(root, directories, recursive=recursive, root_names=root_names)
    if found:
        link, target = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise CheckpointError(f"{link}: a symbolic link to {target}, outside the checkpoint {root}{more}; "
                              "mmparity reads only files inside a checkpoint: copy the file in (or link it "
                              "within the checkpoint)")


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def is_plain_relative_path(name: object) -> bool:
    """True for a relative path that stays inside the directory it is relative to (no `..`
    component, not absolute, not empty): how every path a checkpoint names must look."""
    return isinstance(name, str) and _is_plain_relative_str(name)


@functools.lru_cache(maxsize=4096)  # a manifest names the same few files in every record
def _is_plain_relative_str(name: str) -> bool:
    if not name or "\x00" in name:
        return False
    path = Path(name)
    return not path.is_absolute() and ".." not in path.parts and path.parts != ()


def refuse_link_destination(destination: str | os.PathLike) -> None:
    """A destination that is a symbolic link (to a directory, to nothing, to the source) is refused,
    with or without force: publishing renames a new directory onto the name, so it would replace
    the link and not write where it points, and removing an old checkpoint must never follow a link
    into someone else's files. The user names the target itself, or another path."""
    if os.path.islink(destination):
        try:
            target = os.readlink(destination)
        except OSError:
            target = "?"
        raise CheckpointError(f"{destination}: is a symbolic link (to {target}); mmparity neither writes through "
                              "a link nor replaces one: name the directory it points to, or a path that is not a link")
