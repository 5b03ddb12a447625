"""Megatron-LM's checkpoint directory conventions, shared by the legacy and torch_dist formats.

    <root>/latest_checkpointed_iteration.txt      "7" (or "release")
    <root>/iter_0000007/                          one iteration
        mp_rank_00/model_optim_rng.pt             legacy, PP = 1
        mp_rank_00_001/model_optim_rng.pt         legacy, TP rank 0 of PP stage 1
        mp_rank_00_001_002/model_optim_rng.pt     legacy, ... of expert-parallel rank 2
        .metadata, __0_0.distcp, metadata.json    torch_dist (megatron.core.dist_checkpointing)
    <root>/hf_config.json                         ours: the HF config of the model it holds
    <root>/mmparity.json                          ours: what was written, with checksums

Pure: no megatron import.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.paths import refuse_links_outside, require_regular_file
from mmparity.parallel.axes import Grid

__all__ = [
    "TRACKER_FILE",
    "HF_CONFIG_FILE",
    "RELEASE",
    "LEGACY_FILE",
    "DIST_CONFIG_FILE",
    "CHECKPOINT_VERSION",
    "check_checkpoint_version",
    "iteration_dirname",
    "legacy_rank_dirname",
    "rank_dirname",
    "parse_legacy_rank_dirname",
    "parse_rank_dirname",
    "write_tracker",
    "read_tracker",
    "parse_iteration_number",
    "resolve_iteration_dir",
    "checkpoint_extent",
]

TRACKER_FILE = "latest_checkpointed_iteration.txt"
# An mcore checkpoint mmparity writes keeps its source's HF config under this name, so that
# converting back (and `check --mcore`) knows the shapes without the original directory.
HF_CONFIG_FILE = "hf_config.json"
RELEASE = "release"
LEGACY_FILE = "model_optim_rng.pt"
# megatron.core.dist_checkpointing writes this last; its presence marks a complete torch_dist dir.
DIST_CONFIG_FILE = "metadata.json"
# Megatron-LM's current state-dict version: 3.0 means fused QKV in per-query-group order.
CHECKPOINT_VERSION = 3.0
# Megatron-LM has written 0 (none recorded), 1.0, 2.0 and 3.0, each a change of layout; a version
# from the next major one on would be a layout this reader does not know.
_NEXT_CHECKPOINT_VERSION = 4.0

# ASCII digits only: `\d` alone takes any script's digits, which name some other directory than
# the one the number they parse to is written as.
_ITERATION_DIR = re.compile(r"^iter_(\d{7,18})$", re.ASCII)
_LEGACY_RANK_DIR = re.compile(r"^mp_rank_(\d{2,})(?:_(\d{3,}))?(?:_(\d{3,}))?$", re.ASCII)
# What the tracker may hold: an iteration number (Megatron-LM's counter is a 64-bit int) or
# "release", and a newline; read no further than this.
MAX_TRACKER_BYTES = 64
_MAX_ITERATION_DIGITS = 18


def parse_iteration_number(text: str) -> int | None:
    """``text`` as an iteration number: ASCII digits only (``str.isdigit`` also takes '²' and
    '①', which ``int`` refuses), few enough for Megatron's 64-bit counter; None if it is none."""
    if not (text.isascii() and text.isdigit() and len(text) <= _MAX_ITERATION_DIGITS):
        return None
    return int(text)


def check_checkpoint_version(version, where) -> None:
    """Refuses a ``checkpoint_version`` whose layout is not the one read here: anything but a
    finite number from 3.0 up to the next major version. A NaN or an infinity compares false or
    true against every bound, so it is refused as no number before any comparison."""
    if isinstance(version, bool) or not isinstance(version, (int, float)) or not math.isfinite(version):
        raise CheckpointError(f"{where}: checkpoint_version {version!r} is not a version number (Megatron-LM "
                              f"writes {CHECKPOINT_VERSION}); the file is damaged or was not written by Megatron-LM")
    if version < CHECKPOINT_VERSION:
        # Before 3.0 the fused QKV rows were ordered differently; converting them as 3.0 would be
        # silently wrong.
        raise CheckpointError(f"{where}: checkpoint_version {version!r} is older than {CHECKPOINT_VERSION}; "
                              "not supported")
    if version >= _NEXT_CHECKPOINT_VERSION:
        raise CheckpointError(f"{where}: checkpoint_version {version!r} is newer than any Megatron-LM has written "
                              f"({CHECKPOINT_VERSION}); its layout is not known here")


def iteration_dirname(iteration: int | str) -> str:
    if iteration == RELEASE:
        return RELEASE
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise CheckpointError(f"iteration must be a non-negative int or {RELEASE!r}, got {iteration!r}")
    return f"iter_{iteration:07d}"


# Megatron-LM's ``get_checkpoint_name``, one slot per axis of the grid, in the grid's order: the
# digits of its rank, and whether the slot is there when the axis has one rank only.
RANK_SLOTS = {"tp": (2, True), "pp": (3, False), "ep": (3, False)}


def _named_axes(grid: Grid) -> list[str]:
    """The names of the grid's axes that get a slot in a rank directory's name."""
    return [axis.name for axis in grid.axes if RANK_SLOTS[axis.name][1] or axis.size > 1]


def rank_dirname(grid: Grid, tp_rank: int, pp_rank: int = 0, ep_rank: int = 0) -> str:
    """Megatron-LM's ``get_checkpoint_name``: a slot per axis of size > 1 after the TP rank, PP's
    then EP's; with PP = 1 and EP > 1 the one suffix is the expert rank."""
    rank = dict(zip((axis.name for axis in grid.axes), (tp_rank, pp_rank, ep_rank)))
    return "mp_rank_" + "_".join(f"{rank[name]:0{RANK_SLOTS[name][0]}d}" for name in _named_axes(grid))


def legacy_rank_dirname(tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> str:
    """Megatron-LM omits the pipeline (expert) suffix when there is no pipeline (expert) parallelism."""
    return rank_dirname(Grid.of(pp=pp_size, ep=ep_size), tp_rank, pp_rank, ep_rank)


def parse_rank_dirname(name: str, grid: Grid | None = None) -> tuple[int, int | None, int | None] | None:
    """(tp rank, pp rank, ep rank) of a rank directory's name, None for a slot the name lacks;
    anything else -> None.

    One suffix is a pipeline stage, unless ``grid`` says the checkpoint has expert parallelism and
    no pipeline: the name alone cannot tell, as Megatron's own reader cannot.
    """
    match = _LEGACY_RANK_DIR.match(name)
    if match is None:
        return None
    numbers = [int(g) for g in match.groups() if g is not None]
    # The slots the name holds, in the grid's order: every axis that always has one, then as many
    # of the others as the name has numbers left; a grid tells which of those its axes name.
    names = [axis.name for axis in (grid or Grid.of()).axes]
    always = [n for n in names if RANK_SLOTS[n][1]]
    optional = [n for n in names if not RANK_SLOTS[n][1]]
    if grid is not None and len(numbers) - len(always) == len(_named_axes(grid)) - len(always):
        optional = [n for n in _named_axes(grid) if not RANK_SLOTS[n][1]]
    rank = dict(zip(always + optional, numbers))
    return tuple(rank.get(n) for n in names)


def parse_legacy_rank_dirname(name: str) -> tuple[int, int | None] | None:
    """`mp_rank_01_002` -> (1, 2); `mp_rank_01` -> (1, None); an expert-parallel name
    (`mp_rank_01_002_003`) or anything else -> None."""
    parsed = parse_rank_dirname(name)
    if parsed is None or parsed[2] is not None:
        return None
    return parsed[0], parsed[1]


def write_tracker(root: Path, iteration: int | str) -> None:
    with open(Path(root) / TRACKER_FILE, "w", encoding="utf-8") as f:
        f.write(f"{iteration}\n")


def read_tracker(root: Path) -> int | str:
    path = Path(root) / TRACKER_FILE
    require_regular_file(path, "tracker file")
    try:
        with open(path, "rb") as f:  # a prefix: a tracker is a few bytes, whatever the file claims
            data = f.read(MAX_TRACKER_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read tracker file ({exc.strerror})") from exc
    text = data.decode("utf-8", errors="replace").strip()
    number = parse_iteration_number(text)
    if len(data) > MAX_TRACKER_BYTES or (number is None and text != RELEASE):
        shown = text[:40] + ("..." if len(data) > 40 else "")
        raise CheckpointError(f"{path}: expected an iteration number or {RELEASE!r}, found {shown!r}; write the "
                              f"iteration to load into it, or pass --iteration N|{RELEASE}")
    return RELEASE if number is None else number


def resolve_iteration_dir(path: str | os.PathLike, iteration: int | str | None = None) -> tuple[Path, Path, int | str]:
    """-> (root, iteration directory, iteration) for either a root or an iteration directory.

    A root is read through its tracker file unless `iteration` picks one explicitly; an
    `iter_NNNNNNN` / `release` directory passed directly is used as is.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    own_name = _ITERATION_DIR.match(path.name)
    if iteration is None and (own_name or path.name == RELEASE) and not (path / TRACKER_FILE).exists():
        found = int(own_name.group(1)) if own_name else RELEASE
        # The root's files (hf_config.json, mmparity.json, the side file) and the iteration's, all
        # inside the root: a link out of it is refused by name (fsio.refuse_links_outside).
        _refuse_links(path.parent, path)
        return path.parent, path, found
    _refuse_links(path, None)  # before the tracker is read
    if iteration is None:
        if not (path / TRACKER_FILE).exists():
            iterations = sorted(p.name for p in path.iterdir() if _ITERATION_DIR.match(p.name) or p.name == RELEASE)
            hint = f"; it has {', '.join(iterations[:5])}, pick one with iteration=" if iterations else ""
            raise CheckpointError(f"{path}: no {TRACKER_FILE}{hint}")
        iteration = read_tracker(path)
    iteration_dir = path / iteration_dirname(iteration)
    if not iteration_dir.is_dir():
        raise CheckpointError(f"{iteration_dir}: iteration directory does not exist")
    _refuse_links(path, iteration_dir)
    return path, iteration_dir, iteration


# The files of a root a checkpoint is read with (beside its iteration directories).
_ROOT_FILES = (TRACKER_FILE, "hf_config.json", "mmparity.json", "mcore_side.safetensors")


def _refuse_links(root: Path, iteration_dir: Path | None) -> None:
    """Refuses, by name, a symbolic link leaving `root` among the root files a checkpoint is read
    with and anywhere in its iteration directory (see `fsio.refuse_links_outside` for the policy)."""
    refuse_links_outside(root, [] if iteration_dir is None else [iteration_dir], recursive=True,
                         root_names=_ROOT_FILES)


def checkpoint_extent(path: str | os.PathLike) -> Path:
    """The directory whose files a checkpoint at `path` is read from, resolved.

    An mcore iteration directory given directly is read together with its root (the HF config, the
    manifest and the tracker live there): a destination anywhere inside that root would overwrite
    what the source still needs. Anything else is read from `path` itself.
    """
    path = Path(path).resolve()
    if path.is_dir() and (_ITERATION_DIR.match(path.name) or path.name == RELEASE) and not (path / TRACKER_FILE).exists() \
            and _holds_mcore_ranks(path):
        return path.parent
    return path


def _holds_mcore_ranks(path: Path) -> bool:
    """Whether a directory holds an mcore iteration's files, not merely its name (an HF release
    may well be called ``release``)."""
    return any(child.name.startswith("mp_rank_") or child.name in (".metadata", "metadata.json")
               for child in path.iterdir())
