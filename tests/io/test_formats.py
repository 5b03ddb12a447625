"""Checkpoint formats as records (``mmparity.io.formats``): the registry is the one list
the pipeline, ``verify`` and ``check --mcore`` look a format up in, so a format added by one
:func:`~mmparity.io.formats.register` call is detected, opened, written and verified with
no other edit."""

from __future__ import annotations

import json

import pytest
import torch

from mmparity.parallel.axes import Grid
from mmparity.io import formats
from mmparity.io.formats import base
from mmparity.io.fsio.checksums import tensor_checksum
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.manifest import (
    LAYOUT_HF, LAYOUT_LEGACY, LAYOUT_TORCH_DIST, LAYOUTS, Manifest, TensorRecord, write_manifest)
from mmparity.convert import ConvertOptions, convert
from mmparity.convert.sources import open_source
from mmparity.errors import ConvertError
from mmparity.io.layout import HF_CONFIG_FILE
from mmparity.io.verify import verify


def test_the_built_in_formats_are_the_registry_in_detection_order():
    assert [(f.name, f.layout, f.kind) for f in formats.formats()] == [
        ("hf", LAYOUT_HF, "hf"), ("legacy", LAYOUT_LEGACY, "mcore"), ("torch_dist", LAYOUT_TORCH_DIST, "mcore")]
    assert tuple(f.layout for f in formats.formats()) == LAYOUTS
    assert formats.writable() == ("torch_dist", "legacy")  # the default first, as --format lists them
    assert formats.target("hf", "torch_dist").name == "hf" and formats.target("mcore", "legacy").name == "legacy"
    assert [f.name for f in formats.formats() if f.stores_grid] == ["legacy"]
    assert formats.by_layout("nope") is None
    with pytest.raises(ValueError, match="already registered"):
        formats.register(formats.get("legacy"))


class _ToySource:
    def __init__(self, stored, model, complete):
        self.path, self.family, self.complete = stored.path, model.name, complete


def _toy_format(written: list, verified: list) -> base.Format:
    """An mcore format of one marker file per iteration directory, whose source and writer only
    record that they were called."""
    def write(source, out, progress):
        written.append((source.family, out.dst))
        out.dst.mkdir()
        return base.Written(3, 12, out.grid)

    def probe(path, iteration=None):
        root = path.parent if path.name.startswith("iter_") else path
        return base.Stored(path, root, root / HF_CONFIG_FILE, capacity=(100, 10**6))  # what its config may claim

    return base.Format(
        name="toy", layout="mcore_toy", kind=base.MCORE, what="a toy checkpoint (toy.json)",
        detect=lambda iteration_dir: (iteration_dir / "toy.json").is_file(),
        probe=probe, open=lambda stored, model, filt, complete, described_by: _ToySource(stored, model, complete),
        write=write, verify=lambda root, records, report: verified.append(sorted(records)), stores_grid=True)


@pytest.fixture
def toy():
    written, verified = [], []
    formats.register(_toy_format(written, verified))
    try:
        yield written, verified
    finally:
        formats.unregister("toy")
    assert "toy" not in formats.writable()


def _toy_checkpoint(root):
    (root / "iter_0000001").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1\n")
    (root / "iter_0000001" / "toy.json").write_text("{}")
    # The HF config an mcore checkpoint keeps: what tells a reader its model.
    (root / HF_CONFIG_FILE).write_text(json.dumps({
        "model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 20, "num_hidden_layers": 1,
        "num_attention_heads": 2, "image_size": 16, "patch_size": 8}))
    return root


def test_a_format_registered_by_one_entry_is_detected_opened_and_verified(toy, tmp_path):
    _written, verified = toy
    root = _toy_checkpoint(tmp_path / "toy")
    assert formats.source_format(root).name == "toy"
    source = open_source(root, "clip", complete=False)
    assert isinstance(source, _ToySource) and (source.path, source.family, source.complete) == (root, "clip", False)
    # Its manifest is one verify dispatches on (write_manifest knows the registered layouts).
    record = TensorRecord("iter_0000001/toy.json", "w", tensor_checksum(torch.arange(3.0)))
    write_manifest(root, Manifest(layout="mcore_toy", tensors=(record,)))
    report = verify(root)
    assert verified == [["iter_0000001/toy.json"]] and report.ok and report.layout == "mcore_toy"
    # The messages for a directory of no format name it beside the others.
    (root / "iter_0000001" / "toy.json").unlink()
    with pytest.raises(ConvertError, match=r"neither legacy rank directories \(mp_rank_\*/model_optim_rng.pt\), "
                                           r"a torch_dist checkpoint \(.metadata, metadata.json\) nor a toy "
                                           r"checkpoint \(toy.json\)"):
        formats.source_format(root)


def test_a_format_registered_by_one_entry_is_written_by_convert(toy, tmp_path):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    written, _verified = toy
    cfg = CLIPVisionConfig(hidden_size=16, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8)
    CLIPVisionModel(cfg).save_pretrained(tmp_path / "clip")
    assert "toy" in formats.writable()
    result = convert(ConvertOptions(src=tmp_path / "clip", dst=tmp_path / "out", to="mcore", format="toy", tp=2))
    assert written == [("clip", tmp_path / "out")]
    assert (result.layout, result.tensors, result.nbytes, result.grid) == ("mcore_toy", 3, 12, Grid.of(tp=2))


def test_without_the_entry_the_format_is_unknown(tmp_path):
    root = _toy_checkpoint(tmp_path / "toy")  # negative control: nothing but the registry knows it
    with pytest.raises(ConvertError, match="neither legacy rank directories"):
        open_source(root, "clip")
    with pytest.raises(ConvertError, match="--format must be one of torch_dist, legacy, got 'toy'"):
        convert(ConvertOptions(src=tmp_path / "toy", dst=tmp_path / "out", to="mcore", format="toy"))
    record = TensorRecord("iter_0000001/toy.json", "w", tensor_checksum(torch.arange(3.0)))
    with pytest.raises(CheckpointError, match="unknown checkpoint layout 'mcore_toy'; known: hf_safetensors, "
                                              "mcore_legacy, mcore_torch_dist"):
        write_manifest(root, Manifest(layout="mcore_toy", tensors=(record,)))


def test_the_cli_offers_the_registrys_output_formats():
    """``convert --format``'s choices are a literal (``--help`` imports no checkpoint code): the
    registry's writable formats, default first."""
    import argparse

    from mmparity.cli import convert as cli_convert

    parser = argparse.ArgumentParser()
    cli_convert.add_arguments(parser)
    choices = next(a for a in parser._actions if a.dest == "format").choices
    assert tuple(choices) == formats.writable()
