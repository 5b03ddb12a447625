"""megatron.core's ``dist_checkpointing`` (torch_dist): global tensors in DCP files with their
``.metadata`` and ``metadata.json``, loadable at any TP/PP size. Read by ``streaming``'s
torch_dist source (over ``torch_dist_files``), written by its DCP writer (``save_torch_dist``)."""

from __future__ import annotations

from mmparity.parallel.axes import Grid
from mmparity.convert import pipeline as streaming
from mmparity.io.verify import _verify_torch_dist, verify_mcore
from mmparity.io.formats import MCORE, Format, Written
from mmparity.io.manifest import LAYOUT_TORCH_DIST
from mmparity.io.torch_dist_files import is_torch_dist_dir


def _open(path, family, hf_format, filt, tp, vocab_multiple, complete, model_config=None, iteration=None,
          part=None):
    # model_config: --base / --hf-config describing a checkpoint Megatron-LM wrote (no manifest).
    # part: what a writer asks for; which part (or the whole) an mcore checkpoint holds is read off
    # the checkpoint itself.
    return streaming._TorchDistSource(path, family, filt, complete, model_config, iteration)


def _write(source, options, progress) -> Written:
    count, nbytes = streaming._write_torch_dist(source, options, progress)
    return Written(count, nbytes, Grid.of())


def _verify(root, records, report) -> None:
    verify_mcore(_verify_torch_dist, root, records, report)


def _load_state(rank, job, model, built):
    from mmparity.megatron import load as megatron_load

    return megatron_load.torch_dist_state(rank, job, model, built)


FORMAT = Format(
    name="torch_dist", layout=LAYOUT_TORCH_DIST, kind=MCORE,
    what="a torch_dist checkpoint (.metadata, metadata.json)",
    detect=is_torch_dist_dir, open_source=_open, write=_write, verify=_verify, load_state=_load_state,
    records_directories=True, load_unit="stored", default=True)
