"""HF safetensors: a ``save_pretrained`` directory (``model.safetensors`` or its index), itself
the checkpoint. Read by ``streaming``'s HF source, written by its safetensors writer."""

from __future__ import annotations

from mmparity.models import registry as families
from mmparity.parallel.axes import Grid
from mmparity.convert import pipeline as streaming
from mmparity.io.verify import _verify_hf
from mmparity.io.formats import HF, Format, Written
from mmparity.io.hf import detect_family
from mmparity.io.fsio.safetensors_format import SAFETENSORS_SINGLE_FILE, has_hf_weights
from mmparity.io.manifest import LAYOUT_HF


def _open(path, family, hf_format, filt, tp, vocab_multiple, complete, model_config=None, iteration=None,
          part=None):
    """An HF source, its family told from its config when not given."""
    detection = None
    if family is None:
        try:
            detection = detect_family(path)
        except families.DetectError as exc:
            raise streaming.ConvertError(f"{path}: {exc}") from None
        family = detection.family
    families.get(family)
    source = streaming._HFSource(path, family, hf_format, filt, tp, vocab_multiple, part=part)
    source.detection = detection
    return source


def _write(source, options, progress) -> Written:
    count, nbytes, requant = streaming._write_hf(source, options, progress)
    return Written(count, nbytes, Grid.of(), requant)


FORMAT = Format(
    name="hf", layout=LAYOUT_HF, kind=HF,
    what=f"an HF safetensors directory ({SAFETENSORS_SINGLE_FILE} or its index)",
    detect=has_hf_weights, open_source=_open, write=_write, verify=_verify_hf)
