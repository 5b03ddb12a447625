"""Checkpoints Megatron-LM (or megatron-core's own savers) wrote, read back without mmparity's files.

A directory Megatron saved has its tracker, its ``iter_*`` / ``release`` directories and, in each,
legacy rank files (``model_optim_rng.pt`` with ``args``, RNG, optimizer and scheduler entries
besides the model) or a torch_dist checkpoint (``.metadata`` with megatron-core's saved plans,
``common.pt``, ``metadata.json``, the optimizer's sharded state among the weights). It lacks what
mmparity keeps beside its own output: the HF config (``hf_config.json``), the manifest naming the
family, and the side file with the tensors Megatron's class has no place for (CLIP's ``ln_post``,
tower layers past ``vision_feature_layer``). Those come from the release the checkpoint was
converted from (``--base HF_DIR``: its config, and its side tensors, which Megatron never trained)
or, config only, from ``--hf-config FILE``.

Everything here reads under the same allow-lists as the rest of ``checkpoint``: ``common.pt`` and
rank files through ``unpickle``, Megatron's own classes inside them (its enums in ``args``) as
inert records, never imported.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path

import torch

from mmparity.io import unpickle
from mmparity.io import torch_dist_files
from mmparity.io.legacy import load_rank_payload, open_legacy
from mmparity.io.megatron_args import args_parallelism
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.paths import require_regular_file
from mmparity.io.layout import (
    LEGACY_FILE, RELEASE, TRACKER_FILE, check_checkpoint_version, iteration_dirname, parse_rank_dirname,
    parse_iteration_number, read_tracker, resolve_iteration_dir)

__all__ = ["FROM_BASE", "MegatronCheckpoint", "describe", "iterations", "base_files",
           "copy_base_files", "args_parallelism", "read_common"]

# How the output and its manifest name tensors taken from the base instead of the checkpoint.
FROM_BASE = "from the base, not trained"
COMMON_FILE = "common.pt"
# An optimizer's sharded state (a chained optimizer's under ``chained_N.``: dense and expert
# parameters under expert parallelism).
_OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")

# A base release's files that are weights (or mmparity's own records), never copied to the output.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_NOT_COPIED = frozenset({"config.json", "params.json", "mmparity.json", "model.safetensors.index.json",
                         "pytorch_model.bin.index.json", "consolidated.safetensors.index.json"})


def base_files(base: Path) -> list[str]:
    """The files of an HF release copied beside exported weights: tokenizer, processor, generation
    config, chat template (every regular top-level file that is not weights or a config that the
    output writes itself)."""
    names = []
    for entry in sorted(Path(base).iterdir()):
        if entry.is_symlink() or not entry.is_file() or entry.name.startswith("."):
            continue
        if entry.name in _NOT_COPIED or entry.name.endswith(_WEIGHT_SUFFIXES):
            continue
        names.append(entry.name)
    return names


def copy_base_files(base: Path, staging: Path) -> list[str]:
    """Copies :func:`base_files` into ``staging`` (never over a file already written there)."""
    copied = []
    for name in base_files(base):
        target = staging / name
        if target.exists():
            continue
        shutil.copyfile(base / name, target)
        copied.append(name)
    return copied


# --------------------------------------------------------------------------------------------------
# what a Megatron-written directory is


def iterations(root: Path) -> list[int | str]:
    """The iterations a checkpoint root holds (``iter_*`` and ``release`` directories), sorted."""
    found: list[int | str] = []
    for entry in Path(root).iterdir():
        if entry.name == RELEASE and entry.is_dir():
            found.append(RELEASE)
        elif entry.name.startswith("iter_") and parse_iteration_number(entry.name[5:]) is not None \
                and entry.is_dir():
            found.append(int(entry.name[5:]))
    return sorted(found, key=lambda i: (isinstance(i, str), i if isinstance(i, int) else 0))


# Far above any common state (Megatron-LM's args and its small records); past it the file is not
# one, and is not read into memory.
MAX_COMMON_BYTES = 2**30


def read_common(iteration_dir: Path) -> dict | None:
    """A torch_dist iteration's ``common.pt`` or ``common_state`` item (megatron-core's non-sharded state: Megatron-LM's
    ``args``, ``iteration``, the optimizer's param groups ...), decoded under the legacy allow-list
    with Megatron's classes inert; None when absent."""

    path = Path(iteration_dir) / COMMON_FILE
    if os.path.lexists(path):
        size = require_regular_file(path, "torch_dist common state").st_size
        if size > MAX_COMMON_BYTES:
            raise CheckpointError(f"{path}: {size} bytes, more than the {MAX_COMMON_BYTES} a common state may hold "
                                  "(Megatron-LM's args and small records: kilobytes); replace it with the file the "
                                  "checkpoint was saved with")
        with open(path, "rb") as f:
            data, where = f.read(MAX_COMMON_BYTES + 1), str(path)
    else:
        # Newer savers keep it inside the DCP files, as the byte item `common_state/shard_0_1`.
        metadata = torch_dist_files.load_index(iteration_dir)
        keys = [k for k in metadata.state_dict_metadata if k.split("/")[0] == "common_state"]
        if len(keys) != 1:
            return None
        data = torch_dist_files.object_bytes(iteration_dir, keys[0], metadata)
        where = f"{iteration_dir}: object {keys[0]!r}"
    common = unpickle.load_torch_archive(data, unpickle.LEGACY_NAMES, where, unpickle.MEGATRON_INERT_MODULES)
    if isinstance(common, list) and len(common) == 1:  # a ShardedObject's item, as DCP stores it
        common = common[0]
    if not isinstance(common, dict):
        raise CheckpointError(f"{where}: expected a dict, found {type(common).__name__}")
    if "checkpoint_version" in common:  # a legacy rank file's version is checked; this one alike
        check_checkpoint_version(common["checkpoint_version"], where)
    return common


@dataclasses.dataclass
class MegatronCheckpoint:
    """What one iteration of an mcore checkpoint directory is, as found on disk."""

    root: Path
    iteration_dir: Path
    iteration: int | str
    format: str  # "legacy" or "torch_dist"
    tracker: int | str | None
    iterations: list
    tp: int | None
    pp: int | None
    ep: int | None
    vpp: int | None
    parallelism_from: str  # "args", "rank directories", ...
    has_args: bool
    has_optimizer: bool
    has_rng: bool
    has_scheduler: bool
    has_manifest: bool
    written_by: str

    def lines(self) -> list[str]:
        sizes = []
        for axis, value in (("TP", self.tp), ("PP", self.pp), ("EP", self.ep), ("VPP", self.vpp)):
            if value is not None and (axis in ("TP", "PP") or value > 1):
                sizes.append(f"{axis} {value}")
        parallel = (", ".join(sizes) + f" (from {self.parallelism_from})") if sizes else \
            f"TP/PP not recorded ({self.parallelism_from})"
        present = [what for what, there in (("args", self.has_args), ("optimizer", self.has_optimizer),
                                            ("RNG", self.has_rng), ("scheduler", self.has_scheduler)) if there]
        absent = [what for what, there in (("args", self.has_args), ("optimizer", self.has_optimizer),
                                           ("RNG", self.has_rng), ("scheduler", self.has_scheduler)) if not there]
        others = [i for i in self.iterations if i != self.iteration]
        lines = [f"{self.root}: {self.written_by} {self.format} checkpoint, iteration {self.iteration}"
                 + (f" (tracker: {self.tracker})" if self.tracker is not None else " (no tracker)"),
                 f"  {parallel}",
                 "  holds: model" + "".join(f", {w}" for w in present)
                 + (f"; no {', '.join(absent)}" if absent else "")]
        if others:
            lines.append("  other iterations: " + ", ".join(map(str, others)) + " (pick one with --iteration N)")
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


def describe(path: str | os.PathLike, iteration: int | str | None = None) -> MegatronCheckpoint:
    """What the mcore checkpoint at ``path`` is: format, iteration (the tracker's unless
    ``iteration``), TP/PP/EP (from ``args`` when recorded, else the rank directories), and whether
    it holds ``args``, optimizer, RNG and scheduler state. Reads one rank file (legacy) or
    ``common.pt`` and ``.metadata`` (torch_dist), under the allow-lists."""

    root, iteration_dir, found = resolve_iteration_dir(path, iteration)
    tracker = read_tracker(root) if (root / TRACKER_FILE).is_file() else None
    has_manifest = (root / "mmparity.json").is_file()
    written_by = "mmparity-written" if has_manifest else "Megatron-written"
    if any(parse_rank_dirname(p.name) for p in iteration_dir.iterdir()):
        ckpt = open_legacy(root, iteration=found)
        first = ckpt.files[min(ckpt.files)]
        payload = load_rank_payload(first, mmap=True)
        args = payload.get("args")
        recorded = args_parallelism(args)
        has_args = args is not None
        sizes = {"tp": ckpt.tp_size, "pp": ckpt.pp_size, "ep": ckpt.ep_size}
        vpp = len([k for k in payload if isinstance(k, str) and k.startswith("model") and k[5:].isascii()
                   and k[5:].isdigit()]) or None
        for axis in ("tp", "pp", "ep"):
            if axis in recorded and recorded[axis] != sizes[axis]:
                raise CheckpointError(f"{first}: its args record {axis.upper()} {recorded[axis]}, but the "
                                      f"iteration holds {sizes[axis]} of rank directories")
        return MegatronCheckpoint(root, iteration_dir, found, "legacy", tracker, iterations(root), ckpt.tp_size,
                                  ckpt.pp_size, ckpt.ep_size, vpp,
                                  "args and rank directories" if recorded else "rank directories", has_args,
                                  payload.get("optimizer") is not None, payload.get("rng_state") is not None,
                                  payload.get("opt_param_scheduler") is not None, has_manifest, written_by)
    if not torch_dist_files.is_torch_dist_dir(iteration_dir):
        raise CheckpointError(f"{iteration_dir}: neither legacy rank directories (mp_rank_*/{LEGACY_FILE}) "
                              "nor a torch_dist checkpoint (.metadata, metadata.json)")
    common = read_common(iteration_dir) or {}
    metadata = torch_dist_files.load_index(iteration_dir)
    stored = list(metadata.state_dict_metadata)
    args = common.get("args")
    recorded = args_parallelism(args)
    optimizer = common.get("optimizer") is not None or any(_OPTIMIZER_KEY.match(k) for k in stored)
    rng = common.get("rng_state") is not None or any(k.startswith("rng_state") for k in stored)
    return MegatronCheckpoint(root, iteration_dir, found, "torch_dist", tracker, iterations(root),
                              recorded.get("tp"), recorded.get("pp"), recorded.get("ep"), recorded.get("vpp"),
                              "args" if recorded else "global tensors: it loads at any TP/PP", args is not None,
                              optimizer, rng, common.get("opt_param_scheduler") is not None, has_manifest,
                              written_by)


def iteration_name(iteration: int | str) -> str:
    return iteration_dirname(iteration)


def equal_tensors(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

