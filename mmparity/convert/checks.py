"""Everything a conversion checks before a byte is read or written: each stored shape against the
shapes the HF config implies, the vocabulary divisor recorded or asked for against the tables, and
that the destination overlaps nothing the conversion reads.

Only then is the destination's staging directory created; output becomes visible by one rename
when complete, and any failure leaves nothing behind.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from mmparity.errors import ConvertError, problems_line
from mmparity.io import formats as ckpt_formats
from mmparity.io.formats.base import MCORE, Source
from mmparity.io.formats.hf import HFSource
from mmparity.io.fsio.publish import recover_destination
from mmparity.io.layout import checkpoint_extent
from mmparity.io.manifest import MANIFEST_FILE
from mmparity.mapping.ops import MAX_EXTRA_PAD_ROWS
from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.mapping.tables import padded_tables, tp_kinds

__all__ = ["check_shapes", "check_vocab_divisor", "check_paths"]


def _check_recorded_divisor(source: Source) -> None:
    """The vocabulary divisor an mcore checkpoint's manifest records must be the one its stored
    tables were padded with: each padded table (at least the real vocabulary; a shorter one is a
    shape mismatch) holds exactly the rows the divisor implies at the TP size it was stored for
    (legacy: its own; torch_dist: global tensors, padded as for TP 1, or for the TP it records).
    So the padding stays below divisor x TP rows of what is present, and nothing sized by the
    divisor (a re-padded table, Megatron's class) can outgrow the checkpoint."""
    divisor = getattr(source, "recorded_divisor", None)
    if divisor is None:
        return
    if ckpt_formats.by_layout(source.layout).stores_grid:
        tps = {source.tp}
    else:
        tps = {1, source.manifest.tensor_parallel_size if source.manifest is not None else 1}
    for key, padding in padded_tables(source.rules).items():
        meta = source.metas.get(key)
        if meta is None or not meta.shape or meta.shape[0] < padding.rows:
            continue  # absent (the key check names it) or too short (the shape check does)
        implied = {tp: padding.at_tp(tp, divisor).padded for tp in sorted(tps)}
        if meta.shape[0] not in implied.values():
            tp, rows = min(implied.items())
            raise ConvertError(f"{source.root / MANIFEST_FILE}: the recorded vocabulary divisor {divisor} is not "
                               f"plausible: it pads {padding.rows} rows to {rows}"
                               f"{f' at TP {tp}' if tp > 1 else ''} (stored: {meta.shape[0]}) in {key}; "
                               "its make_vocab_size_divisible_by is not the one this checkpoint was padded "
                               "with (re-create it with mmparity convert)")


def check_shapes(source: Source, label: str | None = None) -> None:
    """Every tensor of ``source`` against the shapes its HF config implies (and an mcore source's
    recorded vocabulary divisor against its tables), before any tensor is read or anything is
    built from the config: ``convert``, ``check --mcore`` and ``verify --load`` all call this, on
    the source as stored (an mcore source before ``repad_vocab``). ``label`` names the source in
    the message (``--base DIR``); an HF source's tensors are named with their files."""
    _check_recorded_divisor(source)
    expected = source.model.expected_shapes(source.vocab_tp, source.vocab_multiple, source.part)
    if expected is None:
        return
    kinds = tp_kinds(source.rules)
    real_rows = {key: padding.rows for key, padding in padded_tables(source.rules).items()}
    problems = []
    for key, meta in source.metas.items():
        want = expected.get(key)
        if (want is not None and ckpt_formats.by_layout(source.layout).kind == MCORE
                and kinds.get(key) == "vocab"
                and tuple(meta.shape[1:]) == want[1:] and meta.shape[0] >= real_rows.get(key, want[0])):
            # Padded for another TP size or divisor (a smaller one than assumed too: Megatron-LM's
            # --make-vocab-size-divisible-by 64): export trims it all the same.
            continue
        if want is not None and tuple(meta.shape) != want:
            origin = source.hf_sources.get(key)
            named = f"{', '.join(origin)} -> {key}" if origin else key
            problems.append((origin, f"{named} is {list(meta.shape)}, the config implies {list(want)}"))
    if problems:
        infos = source.ckpt.infos() if isinstance(source, HFSource) else {}
        lines = [f"{', '.join(sorted({infos[k].file for k in origin if k in infos}))}: {line}"
                 if origin and any(k in infos for k in origin) else line for origin, line in problems]
        raise ConvertError(problems_line(f"{label or source.path}: shape mismatch with its HF config", lines))


def check_vocab_divisor(source: Source, tp: int, multiple: int | None) -> None:
    """``--make-vocab-size-divisible-by``, before a padded table is made: the padding it implies
    for each of the source's vocabularies stays within what Megatron-LM could ask for."""
    if multiple is None:
        return
    for key, padding in padded_tables(source.rules).items():
        target = padding.at_tp(tp, multiple)
        if target.excessive:
            raise ConvertError(f"--make-vocab-size-divisible-by {multiple}: pads {key} from {target.rows} to "
                               f"{target.padded} rows at TP {tp}, past twice its rows plus {MAX_EXTRA_PAD_ROWS}; "
                               f"Megatron-LM pads to a multiple of its divisor (default {VOCAB_MULTIPLE}) x TP: "
                               "give the one the model is trained with")


def check_paths(src: Path, dst: Path, force: bool,
                inputs: Mapping[str, Path | None] = MappingProxyType({})) -> None:
    """Refuses a destination that overlaps anything the conversion reads: the source, and the other
    ``inputs`` (flag -> path: ``--base``'s directory, ``--hf-config``'s file), symlinks resolved.
    Publishing replaces the destination whole, so a destination inside an input, or holding one,
    would destroy what the user converts from."""
    b = dst.resolve()
    a = checkpoint_extent(src)
    if a == b or a in b.parents or b in a.parents:
        raise ConvertError(f"destination {dst} overlaps the source {src} (which is read from {a}); "
                           "choose a separate directory")
    for flag, path in inputs.items():
        a = Path(path).resolve() if path is not None else None
        if a is not None and (a == b or b in a.parents or (a.is_dir() and a in b.parents)):
            raise ConvertError(f"--dst {dst} overlaps {flag} {path} (read from {a}), which a conversion never "
                               "replaces; choose a --dst outside it")
    recover_destination(dst)  # a killed earlier run may have left the old destination aside
    if os.path.lexists(dst) and not force:
        raise ConvertError(f"{dst}: already exists; pass --force to replace it")
