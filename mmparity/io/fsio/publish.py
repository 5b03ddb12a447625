"""Atomic publishing: writers write into `atomic_directory(...)` (or a staging directory that several
ranks share), which takes the destination's name only after everything succeeded and was fsynced,
and the next writer to a destination cleans up after dead ones."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from mmparity.io.fsio import faults, interrupts
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.paths import refuse_link_destination
from mmparity.io.fsio.sources import check_sources_unchanged
from mmparity.io.fsio.syscalls import fsync_path, fsync_tree, libc_function


# A destination is always either the old complete checkpoint or the new complete one. The new one is
# written into a hidden sibling `.<name>.tmp-<host>.<pid>-<random>`, locked (`flock`) by its writer for as
# long as it lives, and published by one `renameat2(RENAME_EXCHANGE)`: the old checkpoint stays in
# place until the new one takes its name, then the old one (now under the staging name) is removed.
# Where the filesystem cannot exchange (EINVAL, e.g. NFS), the old one is first renamed aside to
# `.<name>.old-<host>.<pid>-<random>/old`; a writer killed between that rename and the next leaves no
# destination, and the next run to the same destination puts the old one back. Litter of dead
# writers (on this host, their lock free and their pid gone) is removed by the next run to the same destination
# and reported on the `mmparity` logger.


_log = logging.getLogger("mmparity.io")
_STAGING_LOCKS: dict[str, int] = {}  # staging path -> descriptor holding its flock
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2 = None


def _litter_pattern(name: str) -> re.Pattern:
    # The owner part is absent in the names of writers before the owner was recorded.
    return re.compile(rf"^\.{re.escape(name)}\.(tmp|old)-(?:([A-Za-z0-9_-]+)\.(\d+)-)?[a-z0-9_]{{8}}$")


@functools.cache
def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def _owner() -> str:
    """`<host>.<pid>` for staging names: a pid only says something about a writer on this host (a
    shared filesystem may hold another machine's live staging directory)."""
    return f"{_host()}.{os.getpid()}"


def _lock(path: Path) -> int | None:
    """A descriptor holding an exclusive flock on directory `path`, or None if another holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _unlock(path: Path) -> None:
    fd = _STAGING_LOCKS.pop(str(path), None)
    if fd is not None:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def recover_destination(destination: str | os.PathLike, *, quiet: bool = False) -> list[str]:
    """Cleans up after writers to `destination` that died: puts back an old checkpoint a killed
    `--force` publish had moved aside (when nothing took its place), and removes their staging and
    displaced directories. Leaves alone everything a live writer holds. Returns what it did, one
    line each (also logged)."""
    destination = Path(destination).absolute()
    parent = destination.parent
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return []
    pattern = _litter_pattern(destination.name)
    notes = []
    for entry in entries:
        match = pattern.match(entry)
        if match is None:
            continue
        kind, host, pid = match.group(1), match.group(2), int(match.group(3)) if match.group(3) else None
        if pid is not None and (host != _host() or pid == os.getpid() or _pid_alive(pid)):
            continue  # another host's writer, or one alive here
        path = parent / entry
        fd = _lock(path)
        if fd is None:
            continue  # a live writer holds it
        try:
            owner = f"pid {pid}" if pid is not None else "a writer"
            if kind == "old" and not os.path.lexists(destination) and os.path.lexists(path / "old"):
                os.replace(path / "old", destination)
                fsync_path(parent)
                notes.append(f"restored {destination} from {entry}, where {owner} (killed while replacing it) "
                             "had moved it")
            _remove(path)
            notes.append(f"removed {parent / entry}, left by {owner}, which is no longer running")
        finally:
            os.close(fd)
    if not quiet:  # quiet: the caller cleans up after processes it started and says so itself
        for note in notes:
            _log.warning(note)
    return notes


def _unwritable(directory: Path, destination: Path, exc: OSError) -> CheckpointError:
    return CheckpointError(f"{directory}: cannot create {destination.name if directory == destination.parent else 'directories'} "
                           f"there ({exc.strerror or exc}); choose a destination in a directory you can write to")


def make_staging_directory(destination: str | os.PathLike, *, force: bool = False) -> tuple[Path, list[Path]]:
    """Checks `destination` may be written and creates an empty, locked sibling staging directory.

    Returns the staging path and the parent directories created on the way (so a failed write can
    remove them again). Split out of `atomic_directory` so multi-process writers can create the
    staging directory on one rank and share its name. A caller makes the call, and records what it
    returns where its cleanup finds it, inside ``interrupts.deferred()`` (see `atomic_directory`):
    an interrupt between the two would leave the directory behind. Nothing here can be
    interrupted halfway either, and it fails leaving nothing.
    """
    destination = Path(destination).absolute()
    refuse_link_destination(destination)
    recover_destination(destination)
    if os.path.lexists(destination) and not force:
        raise CheckpointError(f"{destination}: already exists; pass force=True to replace it")
    created: list[Path] = []
    missing = []
    parent = destination.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            # Another writer (a rank on another node of a shared filesystem, a second conversion)
            # made it between our look and our mkdir: it is theirs to remove, not ours.
            if directory.is_dir() and not directory.is_symlink():
                continue
            remove_created_directories(created)
            raise _unwritable(directory.parent, destination, FileExistsError(17, "File exists")) from None
        except OSError as exc:
            remove_created_directories(created)
            raise _unwritable(directory.parent, destination, exc) from None
        created.append(directory)
    staging = None
    try:
        with interrupts.deferred():
            try:
                staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-{_owner()}-",
                                                dir=destination.parent))
            except OSError as exc:
                raise _unwritable(destination.parent, destination, exc) from None
            fd = _lock(staging)
            if fd is not None:
                _STAGING_LOCKS[str(staging)] = fd
            # mkdtemp creates 0700; a published checkpoint should get the usual permissions.
            os.chmod(staging, 0o777 & ~_current_umask())
    except BaseException:
        if staging is not None:
            discard_staging_directory(staging, created)
        else:
            remove_created_directories(created)
        raise
    return staging, created


def remove_created_directories(created: list[Path]) -> None:
    for directory in reversed(created):
        with contextlib.suppress(OSError):
            directory.rmdir()  # only if still empty: never delete what someone else put there


def discard_staging_directory(staging: Path, created: list[Path]) -> None:
    """Undoes `make_staging_directory` after a failure (whole: a second Ctrl-C waits for it)."""
    with interrupts.deferred():
        shutil.rmtree(staging, ignore_errors=True)
        _unlock(staging)
        remove_created_directories(created)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps the names `a` and `b` (both exist); False where this system cannot."""
    global _renameat2
    if faults.injected("noexchange"):
        return False
    if _renameat2 is None:
        _renameat2 = libc_function("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                                                  ctypes.c_uint])
    if not _renameat2:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # a filesystem (or kernel) without RENAME_EXCHANGE
    raise OSError(code, os.strerror(code), str(b))


def publish_staging_directory(staging: Path, destination: str | os.PathLike, *, force: bool = False) -> None:
    """fsyncs `staging` and gives it the name `destination`, replacing an old one only if `force`;
    at every instant `destination` is the old checkpoint or the new one (see above)."""
    destination = Path(destination).absolute()
    fsync_tree(staging)
    faults.fault_point("synced")
    check_sources_unchanged()  # the last moment before the new checkpoint takes the name
    if not os.path.lexists(destination):
        os.replace(staging, destination)
        faults.fault_point("published")
        fsync_path(destination.parent)
        _unlock(staging)
        return
    if not force:
        raise CheckpointError(f"{destination}: appeared while writing; pass force=True to replace it")
    if _exchange(staging, destination):
        faults.fault_point("published")
        fsync_path(destination.parent)
        _unlock(staging)
        _remove(staging)  # the old checkpoint, under the staging name
        faults.fault_point("removed")
        return
    # os.replace cannot overwrite a non-empty directory: the old one goes aside first, and is
    # deleted only once the new one is in place.
    displaced = Path(tempfile.mkdtemp(prefix=f".{destination.name}.old-{_owner()}-", dir=destination.parent))
    fd = _lock(displaced)
    try:
        os.replace(destination, displaced / "old")
        faults.fault_point("aside")
        try:
            os.replace(staging, destination)
        except BaseException:
            os.replace(displaced / "old", destination)
            raise
        faults.fault_point("published")
        fsync_path(destination.parent)
        _unlock(staging)
        _remove(displaced)
        faults.fault_point("removed")
    finally:
        if fd is not None:
            os.close(fd)
        if not os.path.lexists(displaced / "old"):
            shutil.rmtree(displaced, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(destination: str | os.PathLike, *, force: bool = False) -> Iterator[Path]:
    """Yields an empty staging directory that becomes `destination` only if the block succeeds.

    The staging directory is a hidden sibling of `destination` (same filesystem, so publishing is
    one atomic rename). On success everything is fsynced before the rename; on any exception
    (KeyboardInterrupt included) the staging directory and any parent directories created for it
    are removed, leaving the filesystem as it was.
    """
    staging, created = None, []
    try:
        with interrupts.deferred():  # made and recorded as one step: an interrupt is raised after both
            staging, created = make_staging_directory(destination, force=force)
        faults.fault_point("staged")
        yield staging
        publish_staging_directory(staging, destination, force=force)
    except BaseException:
        if staging is not None:
            discard_staging_directory(staging, created)
        raise


def write_extra_files(staging: Path, files: Mapping[str, str | bytes] | None,
                      reserved: Iterable[str] = ()) -> None:
    """Small files (e.g. ``config.json``) written next to the tensors in the same atomic step.

    Names must be plain file names that nothing else in the directory uses: an extra file must
    never shadow a shard, the manifest or the tracker.
    """
    reserved = set(reserved)
    for file_name, content in (files or {}).items():
        if Path(file_name).name != file_name or file_name in reserved or (staging / file_name).exists():
            raise CheckpointError(f"extra file name {file_name!r} is not a plain, unused file name")
        if isinstance(content, bytes):
            (staging / file_name).write_bytes(content)
        else:
            (staging / file_name).write_text(content, encoding="utf-8")
