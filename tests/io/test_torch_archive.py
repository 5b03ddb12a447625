"""torch.save archives on a torch without `PyTorchFileReader.get_record_size` (torch < 2.12, what
the GPU machines ship): record sizes come from the zip directory, equal to torch's own, and every
format that reads or writes torch.save files converts as it does with the newer reader."""

from __future__ import annotations

import io

import pytest
import torch

from mmparity.io.fsio import torch_archive
from mmparity.io.fsio.torch_archive import TorchArchive, directory_sizes

from tests.mapping.test_convert_roundtrips import assert_same_checkpoint, run, save_hf

needs_new_reader = pytest.mark.skipif(not torch_archive.READER_HAS_RECORD_SIZE,
                                      reason="compares against torch >= 2.12's get_record_size")


def _saved(path=None):
    generator = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(7, 5, generator=generator), "empty": torch.empty(0, 3),
             "b": torch.randint(0, 9, (13,), generator=generator, dtype=torch.int64),
             "h": torch.randn(3, 11, generator=generator).to(torch.bfloat16)}
    if path is None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()
    torch.save(state, path)
    return path


@needs_new_reader
@pytest.mark.parametrize("as_bytes", [False, True])
def test_zip_directory_sizes_are_torchs(tmp_path, as_bytes):
    source = _saved() if as_bytes else _saved(tmp_path / "model_optim_rng.pt")
    reader = torch._C.PyTorchFileReader(io.BytesIO(source) if as_bytes else str(source))
    expected = {r: reader.get_record_size(r) for r in reader.get_all_records()}
    got = directory_sizes(source if as_bytes else str(source))
    assert got == expected and any(r.startswith("data/") for r in got)


def test_archive_without_the_new_reader(tmp_path, monkeypatch):
    path = _saved(tmp_path / "x.pt")
    monkeypatch.setattr(torch_archive, "READER_HAS_RECORD_SIZE", False)
    archive = TorchArchive(path)
    data = [r for r in archive.records() if r.startswith("data/")]
    assert sorted(archive.size(r) for r in data if archive.size(r)) == [3 * 11 * 2, 13 * 8, 7 * 5 * 4]
    with pytest.raises(RuntimeError, match="not found"):
        archive.size("data/99")


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_convert_round_trip_without_the_new_reader(tmp_path, monkeypatch, fmt):
    monkeypatch.setattr(torch_archive, "READER_HAS_RECORD_SIZE", False)
    src = save_hf("pixtral", tmp_path / "hf", seed=5)
    assert run("convert", "--src", src, "--dst", tmp_path / "m", "--to", "mcore", "--format", fmt,
               "--tp", 2, "--quiet") == 0
    assert run("verify", tmp_path / "m", "--quiet") == 0
    assert run("convert", "--src", tmp_path / "m", "--dst", tmp_path / "back", "--to", "hf", "--quiet") == 0
    assert_same_checkpoint(tmp_path / "back", src)
