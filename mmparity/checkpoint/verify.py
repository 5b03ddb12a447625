"""`verify(dir)`: re-reads every tensor a checkpoint's `mmparity.json` names and reports every
difference instead of stopping at the first.

Above every format: reads legacy files with `torch.load(weights_only=True)` (`legacy`),
safetensors with `safe_open`, torch_dist with torch's own DCP reader (see `torch_dist_files` for
the trust note).
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from mmparity.checkpoint import extra_state, torch_dist_files
from mmparity.checkpoint import formats as ckpt_formats
from mmparity.checkpoint.fsio.checksums import TensorChecksum, tensor_checksum
from mmparity.checkpoint.fsio.safetensors_format import SAFETENSORS_DTYPES
from mmparity.checkpoint.fsio.errors import CheckpointError
from mmparity.checkpoint.fsio.paths import link_outside, links_outside, require_regular_file
from mmparity.checkpoint.legacy import load_rank_file
from mmparity.checkpoint.megatron_written import read_common
from mmparity.checkpoint.manifest import MANIFEST_FILE, TensorRecord, read_manifest

__all__ = ["Problem", "VerifyReport", "verify"]

_ABSENT = object()


@dataclasses.dataclass(frozen=True)
class Problem:
    file: str
    key: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.key}" if self.key is not None else self.file
        return f"{where}: {self.message}"


@dataclasses.dataclass
class VerifyReport:
    directory: Path
    layout: str
    checked: int = 0
    problems: list[Problem] = dataclasses.field(default_factory=list)
    # What the manifest says the conversion left out of its HF source (a tower family's checkpoint
    # made from a whole VLM), e.g. "left out 11 of 37 source tensors: language_model".
    partial: str = ""
    # An mcore checkpoint's parallel sizes as its manifest records them, e.g. "tp=2 pp=1 ep=2".
    parallel: str = ""
    # The Megatron class it is laid out for and the part of a whole VLM it holds, as recorded.
    held: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        layout = f"{self.layout} {self.parallel}" if self.parallel else self.layout
        layout = f"{layout}, {self.held}" if self.held else layout
        head = f"{self.directory} ({layout}): {self.checked} tensor records checked"
        if self.partial:
            head = f"{head} (made from part of its source: {self.partial})"
        if self.ok:
            return f"{head}, all match"
        return "\n".join([f"{head}, {len(self.problems)} problem(s)"] + [f"  {p}" for p in self.problems])


def _held(extra) -> str:
    """What the manifest says an mcore checkpoint is laid out for, in words (nothing unrecorded)."""
    megatron_class, part = extra.get("megatron_class"), extra.get("part")
    if not isinstance(megatron_class, str) or not megatron_class.isidentifier():
        return ""
    return f"for Megatron's {megatron_class}" + (f" (the {part} alone)" if isinstance(part, str) and part.isidentifier()
                                                 else "")


def _left_out(record) -> str:
    """The manifest's record of what the conversion left out (``streaming.SourceUse.to_json``) in
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


def _compare(report: VerifyReport, record: TensorRecord, found: torch.Tensor) -> None:
    report.checked += 1
    for difference in record.checksum.differences(tensor_checksum(found, record.checksum.algorithm)):
        report.problems.append(Problem(record.file, record.key, difference))


def _unexpected(report: VerifyReport, file: str, keys: Iterable[str]) -> None:
    for key in sorted(keys):
        report.problems.append(Problem(file, key, "tensor present in the checkpoint but not in the manifest"))


def _verify_hf(root: Path, by_file: Mapping[str, list[TensorRecord]], report: VerifyReport) -> None:
    for file_name, records in sorted(by_file.items()):
        try:
            handle = safe_open(str(root / file_name), framework="pt", device="cpu")
            present = set(handle.keys())
        except Exception as exc:
            report.problems.append(Problem(file_name, None, f"unreadable ({' '.join(str(exc).split())}); {len(records)} tensor(s) not checked"))
            continue
        for record in records:
            if record.key not in present:
                report.problems.append(Problem(file_name, record.key, "missing from the file"))
                continue
            try:
                # What the header declares, before it is allocated: a header may declare a tensor of
                # any size (over a sparse file), and the record says what it must be.
                view = handle.get_slice(record.key)
                dtype = SAFETENSORS_DTYPES.get(view.get_dtype())
                declared = TensorChecksum(str(dtype).removeprefix("torch."), tuple(view.get_shape()), "")
                wrong = [d for d in record.checksum.differences(declared) if not d.endswith("differs")]
                if wrong:
                    report.checked += 1
                    report.problems += [Problem(file_name, record.key, f"its header declares {d}") for d in wrong]
                    continue
                found = handle.get_tensor(record.key)
            except Exception as exc:
                report.problems.append(Problem(file_name, record.key, f"unreadable ({' '.join(str(exc).split())})"))
                continue
            _compare(report, record, found)
        _unexpected(report, file_name, present - {r.key for r in records})


def _verify_legacy(root: Path, by_file: Mapping[str, list[TensorRecord]], report: VerifyReport) -> None:
    for file_name, records in sorted(by_file.items()):
        try:
            model = load_rank_file(root / file_name)
        except CheckpointError as exc:
            report.problems.append(Problem(file_name, None, f"{exc}; {len(records)} tensor(s) not checked"))
            continue
        for record in records:
            found = model.get(record.key, _ABSENT)
            if not isinstance(found, torch.Tensor) and (found is _ABSENT or not extra_state.is_extra_state(record.key)):
                report.problems.append(Problem(file_name, record.key, "missing from the file"))
                continue
            try:
                _compare(report, record, found if isinstance(found, torch.Tensor) else extra_state.as_bytes(found))
            except TypeError as exc:
                report.problems.append(Problem(file_name, record.key, str(exc)))
        certifiable = {k for k, v in model.items() if isinstance(v, torch.Tensor) or extra_state.is_extra_state(k)}
        _unexpected(report, file_name, certifiable - {r.key for r in records})


def _shard_of(global_tensor: torch.Tensor, record: TensorRecord) -> torch.Tensor:
    """The region a record describes: leading offsets index prepended (layer) axes."""
    offset, shape = record.offset or (), record.checksum.shape
    prepended = len(offset) - len(shape)
    ends = [o + 1 for o in offset[:prepended]] + [o + n for o, n in zip(offset[prepended:], shape)]
    if prepended < 0 or global_tensor.dim() != len(offset) or any(
            end > size for end, size in zip(ends, global_tensor.shape)):
        raise CheckpointError(f"offset {list(offset)} does not fit global shape {list(global_tensor.shape)}")
    index = tuple(offset[:prepended]) + tuple(slice(o, o + n) for o, n in zip(offset[prepended:], shape))
    return global_tensor[index]


def _verify_torch_dist(root: Path, by_file: Mapping[str, list[TensorRecord]], report: VerifyReport) -> None:
    for dir_name, records in sorted(by_file.items()):
        path = root / dir_name
        try:
            files = torch_dist_files.TorchDistFiles(path)  # the index decoded once for every record
        except CheckpointError as exc:
            report.problems.append(Problem(dir_name, None, f"{exc}; {len(records)} shard record(s) not checked"))
            continue
        try:
            read_common(path)  # a checkpoint_version that is no version is damage, as in a legacy file
        except CheckpointError as exc:
            report.problems.append(Problem(dir_name, None, str(exc)))
        metadata = files.tensors
        objects = torch_dist_files.object_keys(path, files.metadata)
        by_key: dict[str, list[TensorRecord]] = defaultdict(list)
        for record in records:
            by_key[record.key].append(record)
        for key, key_records in sorted(by_key.items()):
            if key in objects:  # an _extra_state object: its stored bytes, never unpickled
                try:
                    found = extra_state.bytes_tensor(torch_dist_files.object_bytes(path, key, files.metadata))
                except CheckpointError as exc:
                    report.problems.append(Problem(dir_name, key, str(exc)))
                    continue
                for record in key_records:
                    _compare(report, record, found)
                continue
            if key not in metadata:
                report.problems.append(Problem(dir_name, key, "missing from the checkpoint"))
                continue
            try:
                global_tensor = files.read(key)
            except CheckpointError as exc:
                report.problems.append(Problem(dir_name, key, str(exc)))
                continue
            for record in key_records:
                try:
                    found = _shard_of(global_tensor, record)
                except CheckpointError as exc:
                    report.problems.append(Problem(dir_name, key, str(exc)))
                    continue
                _compare(report, record, found)
        _unexpected(report, dir_name, (set(metadata) | set(objects)) - set(by_key) - {"common_state"})


def verify_mcore(own, root: Path, by_file: Mapping[str, list[TensorRecord]], report: VerifyReport) -> None:
    """An mcore format's records: its side file (tensors Megatron's class has no place for) is
    safetensors, the rest its own files, checked by ``own``."""
    side = {f: r for f, r in by_file.items() if f.endswith(_DATA_SUFFIXES)}
    _verify_hf(root, side, report)
    own(root, {f: r for f, r in by_file.items() if f not in side}, report)


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
    parallel = ("" if fmt.kind == ckpt_formats.HF else
                f"tp={manifest.tensor_parallel_size} pp={manifest.pipeline_parallel_size} "
                f"ep={manifest.expert_parallel_size}")
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
