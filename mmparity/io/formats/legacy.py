"""Megatron-LM's legacy layout: one ``torch.save`` file per rank (``mp_rank_TT[_PPP][_EEE]``) in
an iteration directory, at the TP/PP/EP sizes it was written for. Read by ``streaming``'s legacy
source (over ``checkpoint.legacy``), written by its legacy writer (``LegacyWriter``)."""

from __future__ import annotations

from pathlib import Path

from mmparity.convert import pipeline as streaming
from mmparity.io.verify import _verify_legacy, verify_mcore
from mmparity.io.formats import MCORE, Format, Written
from mmparity.io.layout import LEGACY_FILE, parse_rank_dirname
from mmparity.io.manifest import LAYOUT_LEGACY


def _detect(iteration_dir: Path) -> bool:
    return any(parse_rank_dirname(p.name) for p in iteration_dir.iterdir())


def _open(path, family, hf_format, filt, tp, vocab_multiple, complete, model_config=None, iteration=None,
          part=None):
    # model_config: --base / --hf-config describing a checkpoint Megatron-LM wrote (no manifest).
    # part: what a writer asks for; which part (or the whole) an mcore checkpoint holds is read off
    # the checkpoint itself.
    return streaming._LegacySource(path, family, filt, complete, model_config, iteration)


def _write(source, options, progress) -> Written:
    count, nbytes = streaming._write_legacy(source, options, progress)
    return Written(count, nbytes, options.grid)


def _verify(root, records, report) -> None:
    verify_mcore(_verify_legacy, root, records, report)


def _load_state(rank, job, model, built):
    from mmparity.megatron import load as megatron_load

    return megatron_load.legacy_state(rank, job, model, built)


FORMAT = Format(
    name="legacy", layout=LAYOUT_LEGACY, kind=MCORE,
    what=f"legacy rank directories (mp_rank_*/{LEGACY_FILE})",
    detect=_detect, open_source=_open, write=_write, verify=_verify, load_state=_load_state,
    stores_grid=True)
