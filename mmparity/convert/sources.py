"""Opening a source checkpoint for a conversion: its format found, its family looked up once (given,
told from its config, or named by its manifest), its config read once, and the format's reader
handed the :class:`~mmparity.convert.model.Model` built from them.

An mcore checkpoint Megatron-LM wrote carries none of mmparity's files (manifest, HF config, side
file): ``--base HF_DIR`` (the release it was converted from) or ``--hf-config FILE`` describe its
model instead (:func:`model_config_for`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from mmparity.convert.checks import check_shapes
from mmparity.convert.configs import HF_CONFIG, detect_family, family_config, read_hf_config
from mmparity.convert.model import Model
from mmparity.errors import ConvertError
from mmparity.io.formats import source_format
from mmparity.io.formats.base import HF, Format, Source, TensorFilter
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.pieces import joined
from mmparity.io.fsio.safetensors_format import has_hf_weights
from mmparity.io.hf import bound_config
from mmparity.io.layout import HF_CONFIG_FILE, resolve_iteration_dir
from mmparity.io.manifest import MANIFEST_FILE, Manifest, read_manifest
from mmparity.mapping import rules as R
from mmparity.models import registry

__all__ = ["ModelConfig", "open_source", "open_as", "model_config_for", "MISTRAL_LAYOUT", "HF_SAVE_LAYOUT"]

MISTRAL_LAYOUT, HF_SAVE_LAYOUT = "mistral", "hf_checkpoint"


@dataclasses.dataclass
class ModelConfig:
    """Where the model of an mcore checkpoint is described, when not (only) by its own files."""

    model: Model
    hf_format: str
    prefix: str
    origin: str  # "--base DIR" / "--hf-config FILE", for messages
    base: Path | None = None  # the HF release, when given
    # mcore side keys -> their tensors, made from the base by the family's own rules (None: no base)
    side_tensors: Callable[[Sequence[str]], dict] | None = None
    # mcore key -> the base's HF keys it is made from (for naming what came from the base)
    hf_sources: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    # The base as a whole mcore source (its HF source): the parts of a whole VLM a checkpoint of one
    # part never held come from it, tensor by tensor (None: no base)
    base_source: object = None

    @property
    def family(self) -> str:
        return self.model.name

    @property
    def cfg(self):
        return self.model.cfg

    @property
    def config_bytes(self) -> bytes:
        return self.model.config_bytes


def open_source(path, family: str | None = None, hf_format: str | None = None, *,
                dtype: torch.dtype | None = None, check_finite: bool = False, tp: int = 1,
                vocab_multiple: int = R.VOCAB_MULTIPLE, complete: bool = True,
                model_config: ModelConfig | None = None, iteration: int | str | None = None,
                part: str | None = None, spec=None) -> Source:
    """Opens and fully validates a source checkpoint (HF, legacy or torch_dist); reads no weights.
    An HF source is planned for ``tp`` ranks with vocabularies padded to ``vocab_multiple × tp``,
    and for one ``part`` of a whole VLM where asked (the rest left out). ``complete=False`` opens an
    mcore checkpoint that may lack tensors or hold foreign ones (see
    ``McoreSource._init_common``); which part an mcore checkpoint holds is read off it. ``spec``:
    the family's spec where the caller looked it up already (``family`` is then its name)."""
    path = Path(path)
    return open_as(source_format(path, iteration), path, family, hf_format, TensorFilter(dtype, check_finite), tp,
                   vocab_multiple, complete, model_config, iteration, part, spec)


def open_as(fmt: Format, path: Path, family: str | None, hf_format: str | None, filt: TensorFilter, tp: int = 1,
            vocab_multiple: int = R.VOCAB_MULTIPLE, complete: bool = True, model_config: ModelConfig | None = None,
            iteration: int | str | None = None, part: str | None = None, spec=None) -> Source:
    """:func:`open_source` of a directory whose format is known (``fmt``)."""
    if fmt.kind == HF:
        return _open_hf(fmt, path, family, hf_format, filt, tp, vocab_multiple, part, spec)
    # part: what a writer asks for; which part (or the whole) an mcore checkpoint holds is read off
    # the checkpoint itself.
    stored = fmt.probe(path, iteration)
    root, manifest = stored.root, stored.manifest
    if model_config is not None:
        recorded = manifest.provenance.family if manifest is not None else None
        if recorded is not None and recorded != model_config.family:
            raise ConvertError(f"{root}: holds a {recorded!r} checkpoint (its {MANIFEST_FILE}), but "
                               f"{model_config.origin} describes a {model_config.family!r} model")
        model = model_config.model
    else:
        if manifest is None and not (root / HF_CONFIG_FILE).is_file():
            raise ConvertError(f"{root}: no {MANIFEST_FILE} and no {HF_CONFIG_FILE}: a checkpoint Megatron-LM "
                               "wrote needs the model it was converted from: --base HF_DIR (the HF release: "
                               "config, tokenizer and the tensors Megatron keeps no place for) or "
                               "--hf-config FILE (with --family)")
        spec = _manifest_spec(manifest, spec.name if spec is not None else family, root, spec)
        model = Model(spec, *family_config(spec, stored.config, root, stored.capacity))
    return fmt.open(stored, model, filt, complete, model_config)


def _open_hf(fmt: Format, path: Path, family: str | None, hf_format: str | None, filt: TensorFilter, tp: int,
             vocab_multiple: int, part: str | None, spec) -> Source:
    """An HF source, its family told from its config when not given."""
    spec, detection = _told(spec, family, path, str(path))
    stored = fmt.probe(path)
    model = Model(spec, *family_config(spec, stored.config, path, stored.capacity))
    source = fmt.open(stored, model, hf_format, filt, tp, vocab_multiple, part)
    source.detection = detection
    return source


def _told(spec, family: str | None, directory: Path | None, where: str):
    """``(spec, detection)``: the spec given, else the registry record of the family named, else of
    the one told from ``directory``'s config (its ``Detection``; a failure is a ``ConvertError``
    led by ``where``). The convert layer's one registry lookup: a command resolves its family
    here once and carries the record on; ``registry.UnknownFamilyError`` lists the families."""
    if spec is not None:
        return spec, None
    detection = None
    if family is None:
        try:
            detection = detect_family(directory)
        except registry.DetectError as exc:
            raise ConvertError(f"{where}: {exc}") from None
        family = detection.family
    return registry.resolve(family), detection


def family_for(directory, family: str | None):
    """The registry record of ``family``, or of the family told from ``directory``'s config: what a
    command that reads an HF checkpoint before converting it (``check``'s early refusals) looks up,
    the same way convert does."""
    return _told(None, family, Path(directory), str(directory))[0]


def _manifest_spec(manifest: Manifest | None, family: str | None, where: Path, spec=None):
    """The spec of the family an mcore checkpoint holds: the one given, which its manifest must
    record where it records one, else the one it records."""
    recorded = manifest.provenance.family if manifest is not None else None
    if family is None and recorded is None:
        raise ConvertError(f"{where}: no {MANIFEST_FILE} naming the family; pass --family")
    if family is not None and recorded is not None and family != recorded:
        raise ConvertError(f"{where}: holds a {recorded!r} checkpoint, not {family!r} (from its {MANIFEST_FILE})")
    if spec is not None:
        return spec
    try:
        return _told(None, family or recorded, None, str(where))[0]  # unknown names raise, listing the valid ones
    except registry.UnknownFamilyError as exc:
        raise ConvertError(f"{where / MANIFEST_FILE}: records {exc}; pass --family" if family is None
                           else str(exc)) from None


def model_config_for(src: Path, family: str | None, base: Path | None, hf_config: Path | None,
                     iteration: int | str | None = None, spec=None) -> ModelConfig | None:
    """The model of an mcore checkpoint at ``src`` as ``--base HF_DIR`` or ``--hf-config FILE``
    describe it (None: neither given, the checkpoint's own files describe it). The family is the
    one given (``spec``, where looked up already), else the checkpoint's manifest's, else told from
    the base's (the file's) config."""
    if base is None and hf_config is None:
        return None
    if base is not None and hf_config is not None:
        raise ConvertError("--base and --hf-config both describe the model; pass one (--base also gives "
                           "the tensors Megatron has no place for)")
    if source_format(src, iteration).kind == HF:
        raise ConvertError(f"{src}: an HF source has its own config; --base / --hf-config describe an mcore "
                           "checkpoint that lacks one")
    root = resolve_iteration_dir(src, iteration)[0]
    if spec is not None:
        family = spec.name
    if family is None and (root / MANIFEST_FILE).is_file():
        family = read_manifest(root).provenance.family
    if base is not None:
        return _described_by_base(Path(base), family, spec)
    path = Path(hf_config)
    if not path.is_file():
        raise ConvertError(f"--hf-config {path}: no such file (an HF config.json of the model)")
    if family is None and path.name != HF_CONFIG:
        raise ConvertError(f"--hf-config {path}: pass --family too (the family is told only from a file "
                           f"named {HF_CONFIG})")
    spec = _told(spec, family, path.parent, f"--hf-config {path}")[0]
    family = spec.name
    try:
        full, raw = read_hf_config(path.parent, path.name)
        cfg = spec.family_config(full)
    except CheckpointError as exc:
        raise ConvertError(str(exc)) from None
    except ValueError as exc:
        raise ConvertError(f"--hf-config {path}: {exc} (family {family!r})") from None
    bound_config(cfg, path, root)
    formats = spec.converter.formats
    fmt = HF_SAVE_LAYOUT if HF_SAVE_LAYOUT in formats else formats[0]
    return ModelConfig(Model(spec, cfg, raw), fmt, "", f"--hf-config {path}")


def _described_by_base(base: Path, family: str | None, spec) -> ModelConfig:
    if not base.is_dir() or not has_hf_weights(base):
        raise ConvertError(f"--base {base}: not an HF save_pretrained directory (config.json and safetensors "
                           "weights: the release the checkpoint was converted from)")
    spec = _told(spec, family, base, f"--base {base}")[0]
    try:
        hf = open_source(base, spec=spec)
    except ConvertError as exc:
        raise ConvertError(f"--base {exc}") from None
    # The base's own tensors against its config before any is taken: a mis-shaped one is the
    # base's fault, not the checkpoint's it would be copied beside.
    check_shapes(hf, f"--base {base}")

    def side(keys: Sequence[str]) -> dict[str, torch.Tensor]:
        return {key: joined(hf.mcore_pieces(key)).contiguous() for key in keys}

    return ModelConfig(hf.model, hf.hf_format, hf.prefix, f"--base {base}", base, side, hf.hf_sources, hf)
