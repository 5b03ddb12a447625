"""`verify(dir)`: re-reads every tensor a checkpoint's `mmparity.json` names and reports every
difference instead of stopping at the first.

Above every format: what the manifest covers and what is missing or outside it is checked here,
each record by its format's own verifier (``io.formats``: legacy files through
`torch.load(weights_only=True)`, safetensors through `safe_open`, torch_dist through its DCP index;
see `torch_dist_files` for the trust note).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from mmparity.io import formats as ckpt_formats
from mmparity.io.formats.base import HF, Problem, VerifyReport
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.paths import link_outside, links_outside, require_regular_file
from mmparity.io.manifest import MANIFEST_FILE, TensorRecord, read_manifest

__all__ = ["verify", "refuse_manifest_link"]


def _held(extra) -> str:
    """What the manifest says an mcore checkpoint is laid out for, in words (nothing unrecorded)."""
    megatron_class, part = extra.get("megatron_class"), extra.get("part")
    if not isinstance(megatron_class, str) or not megatron_class.isidentifier():
        return ""
    return f"for Megatron's {megatron_class}" + (f" (the {part} alone)" if isinstance(part, str) and part.isidentifier()
                                                 else "")


def _global(manifest) -> str:
    """Global tensors: the recorded TP/PP sizes bind nothing (``tp=1 pp=1`` would read as flags
    lost); how experts were spread is still what was asked."""
    saved = (f", saved at tp={manifest.tensor_parallel_size} pp={manifest.pipeline_parallel_size}"
             if (manifest.tensor_parallel_size, manifest.pipeline_parallel_size) != (1, 1) else "")
    ep = f" ep={manifest.expert_parallel_size}" if manifest.expert_parallel_size != 1 else ""
    return f"global (loads at any TP/PP{saved}){ep}"


def _left_out(record) -> str:
    """The manifest's record of what the conversion left out (``SourceUse.to_json``) in
    words; nothing for a record of another shape (it certifies no tensor, so it is not a problem)."""
    try:
        converted = record["converted"]
        parts = [(str(m), int(n)) for m, n, _ in record["left_out"]]
        if not isinstance(converted, int) or not parts:
            return ""
    except (TypeError, KeyError, ValueError):
        return ""
    total = converted + sum(n for _, n in parts)
    return f"left out {total - converted} of {total} source tensors: {', '.join(m for m, _ in parts)}"


# What holds weights in any layout: safetensors shards, legacy rank files, and torch_dist data files
# with their metadata (a torch_dist record names the directory of those, so that is the unit).
_DATA_FILE_NAMES = ("model_optim_rng.pt",)
_DATA_SUFFIXES = (".safetensors",)
_DIST_FILE_SUFFIXES = (".distcp",)


def _data_units(root: Path) -> set[str]:
    """Every weight-holding file under `root` (relative paths), torch_dist files by their directory:
    what a manifest must cover for `verify` to certify the directory."""
    units = set()
    for current, directories, files in os.walk(root):
        directories.sort()
        relative = Path(current).relative_to(root)
        for name in files:
            if name.endswith(_DIST_FILE_SUFFIXES) or name == ".metadata":
                units.add(relative.as_posix())
            elif name.endswith(_DATA_SUFFIXES) or name in _DATA_FILE_NAMES:
                units.add((relative / name).as_posix())
    return units


def refuse_manifest_link(root: Path) -> None:
    """The manifest is what certifies the directory: one linked from outside is no usable manifest."""
    target = link_outside(root / MANIFEST_FILE, root)
    if target is not None:
        raise CheckpointError(f"{root / MANIFEST_FILE}: a symbolic link to {target}, outside the checkpoint; "
                              "a manifest must be the directory's own file: copy it in")


def verify(directory: str | os.PathLike) -> VerifyReport:
    """Re-reads every tensor named in `mmparity.json` and lists every way it differs.

    Raises `CheckpointError` only when there is no usable manifest; damage to the checkpoint itself
    (missing files, unreadable files, changed bytes, extra tensors) is reported, not raised.
    """
    root = Path(directory)
    refuse_manifest_link(root)
    manifest = read_manifest(root)
    fmt = ckpt_formats.by_layout(manifest.layout)
    if fmt is None:
        raise CheckpointError(f"{root / MANIFEST_FILE}: unknown layout {manifest.layout!r}")
    parallel = ("" if fmt.kind == HF else
                f"tp={manifest.tensor_parallel_size} pp={manifest.pipeline_parallel_size} "
                f"ep={manifest.expert_parallel_size}" if fmt.stores_grid else _global(manifest))
    extra = manifest.provenance.extra or {}
    report = VerifyReport(root, manifest.layout, partial=_left_out(extra.get("left_out")), parallel=parallel,
                          held=_held(extra))
    # A symbolic link leaving the directory is damage: what it points to is no part of what the
    # manifest certifies (fsio.refuse_links_outside has the policy). Listed, and not read.
    escaping = links_outside(root, [root], recursive=True, root_names=())
    for link, target in escaping:
        report.problems.append(Problem(link.relative_to(root).as_posix(), None,
                                       f"a symbolic link to {target}, outside the checkpoint; not read"))
    escaped = [link.relative_to(root).as_posix() for link, _ in escaping]
    by_file: dict[str, list[TensorRecord]] = defaultdict(list)
    for record in manifest.tensors:
        by_file[record.file].append(record)
    present = {}
    for file_name, records in sorted(by_file.items()):
        path = root / file_name
        if any(file_name == e or file_name.startswith(e + "/") or e.startswith(file_name + "/") for e in escaped):
            continue  # already reported
        if not os.path.lexists(path):
            report.problems.append(Problem(file_name, None, f"missing; {len(records)} record(s) not checked"))
            continue
        # A torch_dist record names its directory; a side file is a file in any layout.
        if not fmt.records_directories or file_name.endswith(_DATA_SUFFIXES):
            try:
                require_regular_file(path, "data file")
            except CheckpointError as exc:
                report.problems.append(Problem(file_name, None, f"{exc}; {len(records)} record(s) not checked"))
                continue
        present[file_name] = records
    for unit in sorted(_data_units(root) - set(by_file)):
        report.problems.append(Problem(unit, None, "data file not covered by the manifest: nothing certifies it"))
    fmt.verify(root, present, report)
    return report
