"""torch.save's zip archive, read through torch's own reader, on every torch the project supports.

`torch._C.PyTorchFileReader` gained `get_record_size` only in torch 2.12; the GPU machines this
project runs on still ship torch 2.11, where every caller of it failed (`convert` to torch_dist
among them). A record's size is also in the zip's central directory, which the standard library
reads without touching any record's data, so that is where it comes from when torch cannot say.
Records are stored uncompressed by torch.save, so a directory entry's size is the record's size.
"""

from __future__ import annotations

import io
import os
import zipfile

import torch

# False on torch < 2.12; a test turns it off to run the zip-directory path on a newer torch.
READER_HAS_RECORD_SIZE = hasattr(torch._C.PyTorchFileReader, "get_record_size")
_BUFFERS = (bytes, bytearray, memoryview)


def _readable(source):
    """A path as it is; an archive held in memory as a stream over it (each reader its own)."""
    return io.BytesIO(source) if isinstance(source, _BUFFERS) else source


class TorchArchive:
    """One torch.save archive (a path, or its bytes): record names, offsets, sizes and contents."""

    def __init__(self, source: str | os.PathLike | bytes | bytearray | memoryview):
        self._source = source if isinstance(source, _BUFFERS) else os.fspath(source)
        self._reader = torch._C.PyTorchFileReader(_readable(self._source))
        self._sizes: dict[str, int] | None = None

    def records(self) -> list[str]:
        return list(self._reader.get_all_records())

    def offset(self, record: str) -> int:
        return self._reader.get_record_offset(record)

    def read(self, record: str) -> bytes:
        return self._reader.get_record(record)

    def size(self, record: str) -> int:
        """The record's size in bytes; RuntimeError when the archive has no such record (as torch's
        own `get_record_size` raises)."""
        if READER_HAS_RECORD_SIZE:
            return self._reader.get_record_size(record)
        if self._sizes is None:
            self._sizes = directory_sizes(self._source)
        try:
            return self._sizes[record]
        except KeyError:
            raise RuntimeError(f"record {record!r} not found in the archive") from None


def directory_sizes(source: str | bytes | bytearray | memoryview) -> dict[str, int]:
    """Record name -> size from the archive's zip directory, named as torch's reader names them:
    without the archive's top-level folder (`model_optim_rng/data/0` is `data/0`)."""
    try:
        with zipfile.ZipFile(_readable(source)) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise RuntimeError(f"unreadable zip directory ({exc})") from None
    sizes = {}
    for entry in entries:
        _, _, record = entry.filename.partition("/")
        if record:
            sizes[record] = entry.file_size
    return sizes
