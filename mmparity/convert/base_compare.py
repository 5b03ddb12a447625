"""Tensors an export took from the base release, compared against it (``verify --base``)."""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import load_file

from mmparity.convert.sources import model_config_for
from mmparity.errors import ConvertError
from mmparity.io.formats.mcore import SIDE_FILE
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.safetensors_read import SafetensorsCheckpoint
from mmparity.io.manifest import LAYOUT_HF, MANIFEST_FILE, read_manifest
from mmparity.io.megatron_written import equal_tensors

__all__ = ["compare_with_base"]


def compare_with_base(directory: str | os.PathLike, base: str | os.PathLike) -> tuple[int, list[str]]:
    """``(tensors compared, problems)``: the tensors of ``directory`` that were never trained, each
    against the base release's own. An HF export lists them in its manifest (``from_base``); an
    mcore checkpoint mmparity wrote keeps them in its side file, compared with what the family's
    rules make of the base's."""

    directory, base = Path(directory), Path(base)
    if not (directory / MANIFEST_FILE).is_file():
        return 0, []
    manifest = read_manifest(directory)
    problems: list[str] = []
    if manifest.layout == LAYOUT_HF:
        keys = list((manifest.provenance.extra or {}).get("from_base", {}).get("tensors", []))
        if not keys:
            return 0, []
        with SafetensorsCheckpoint(directory) as ours, SafetensorsCheckpoint(base) as theirs:
            have_ours, have_theirs = ours.infos(), theirs.infos()
            for key in keys:
                if key not in have_theirs or key not in have_ours:
                    problems.append(f"{key}: not in {'the base' if key not in have_theirs else directory}")
                elif not equal_tensors(ours.map(key), theirs.map(key)):
                    problems.append(f"{key}: differs from the base's")
        return len(keys), problems
    side_path = directory / SIDE_FILE
    if not side_path.is_file():
        return 0, []
    side = load_file(str(side_path))
    try:
        config = model_config_for(directory, manifest.provenance.family, base, None)
    except ConvertError as exc:
        raise CheckpointError(str(exc)) from None
    made = config.side_tensors(list(side))
    for key, tensor in side.items():
        if not equal_tensors(tensor, made[key]):
            problems.append(f"{key}: differs from what the base gives")
    return len(side), problems
