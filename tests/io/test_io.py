"""checkpoint.fsio: streaming safetensors reading, sharded writing, atomic directories, checksums."""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from mmparity.io import manifest as manifest_module
from mmparity.io.fsio.checksums import PieceHasher, TensorChecksum, tensor_checksum
from mmparity.io.manifest import LAYOUT_TORCH_DIST, Manifest, TensorRecord
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.publish import atomic_directory
from mmparity.io.fsio.safetensors_format import (
    SAFETENSORS_CODES, SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE, parse_size)
from mmparity.io.fsio.safetensors_read import SafetensorsCheckpoint, load_safetensors_state_dict
from mmparity.io.fsio import safetensors_write as writer_module
from mmparity.io.fsio.safetensors_write import save_safetensors_checkpoint, write_safetensors_shards


def seeded(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def sample_state() -> dict[str, torch.Tensor]:
    """Mixed dtypes, odd shapes, a scalar, an empty tensor, and a non-contiguous view."""
    return {
        "vision.patch_conv.weight": seeded((7, 3, 5, 5), 0),
        "vision.layers.0.attn.q.weight": seeded((9, 7), 1, torch.bfloat16),
        "vision.layers.0.attn.q.bias": seeded((9,), 2, torch.float16),
        "vision.layers.0.mlp.fc1.weight": seeded((11, 7), 3).t(),  # non-contiguous
        "vision.position_ids": torch.arange(13, dtype=torch.int64),
        "vision.mask": seeded((4, 4), 4) > 0,
        "vision.scale": torch.tensor(0.25, dtype=torch.float64),
        "vision.empty": torch.zeros((0, 3)),
    }


def assert_same_tensors(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert actual[key].shape == value.shape, key
        assert torch.equal(actual[key], value), key


def entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# --------------------------------------------------------------------------------------------------
# round trips


def test_single_file_round_trip_is_bit_exact(tmp_path):
    state = sample_state()
    checksums = save_safetensors_checkpoint(tmp_path / "ckpt", state)
    assert entries(tmp_path / "ckpt") == [SAFETENSORS_SINGLE_FILE]
    assert_same_tensors(load_safetensors_state_dict(tmp_path / "ckpt"), state)
    assert checksums == {k: tensor_checksum(v) for k, v in state.items()}


def test_sharded_writer_respects_max_shard_size_and_writes_an_hf_index(tmp_path):
    state = {f"layers.{i}.weight": seeded((10, 10), i) for i in range(7)}  # 400 bytes each
    state["big"] = seeded((30, 30), 99)  # 3600 bytes: larger than a shard, gets one of its own
    save_safetensors_checkpoint(tmp_path / "ckpt", state, max_shard_size=1000)

    index = json.loads((tmp_path / "ckpt" / SAFETENSORS_INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
    assert entries(tmp_path / "ckpt") == sorted(files + [SAFETENSORS_INDEX_FILE])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.itemsize for t in state.values())
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in state.values())
    with SafetensorsCheckpoint(tmp_path / "ckpt") as checkpoint:
        assert checkpoint.layout == "sharded"
        assert checkpoint.header_metadata == {"format": "pt"}  # transformers refuses files without it
        for file_name in files:
            names = [n for n, f in index["weight_map"].items() if f == file_name]
            size = sum(checkpoint.info(n).nbytes for n in names)
            assert size <= 1000 or names == ["big"]
        assert_same_tensors(checkpoint.state_dict(), state)


def test_writer_assigns_shards_greedily_in_order(tmp_path):
    state = {"a": seeded((10, 10), 0), "b": seeded((10, 10), 1), "c": seeded((10, 10), 2)}
    writer = write_safetensors_shards(tmp_path, state, max_shard_size=500)
    assert writer.written == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                              "model-00003-of-00003.safetensors", SAFETENSORS_INDEX_FILE]
    assert writer.weight_map == {"a": "model-00001-of-00003.safetensors", "b": "model-00002-of-00003.safetensors",
                                 "c": "model-00003-of-00003.safetensors"}
    assert_same_tensors(load_safetensors_state_dict(tmp_path), state)


def test_writer_refuses_duplicates_non_tensors_and_empty_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="written twice"):
        write_safetensors_shards(tmp_path, [("a", torch.ones(2)), ("a", torch.ones(2))])
    with pytest.raises(CheckpointError, match="not a tensor"):
        write_safetensors_shards(tmp_path, {"a": torch.ones(2), "b": [1, 2]})
    with pytest.raises(CheckpointError, match="no tensors"):
        write_safetensors_shards(tmp_path, {})
    assert entries(tmp_path) == []  # nothing was started for a refused set


def test_views_of_one_storage_are_written_independently(tmp_path):
    base = seeded((6, 4), 0)
    state = {"first": base[:3], "second": base[3:], "alias": base}
    save_safetensors_checkpoint(tmp_path / "ckpt", state)
    assert_same_tensors(load_safetensors_state_dict(tmp_path / "ckpt"), state)


# --------------------------------------------------------------------------------------------------
# streaming reads


def test_listing_reads_headers_only(tmp_path):
    state = sample_state()
    save_safetensors_checkpoint(tmp_path / "ckpt", state, max_shard_size=300)
    with SafetensorsCheckpoint(tmp_path / "ckpt") as checkpoint:
        assert checkpoint.keys() == sorted(state) and len(checkpoint) == len(state)
        for name, tensor in state.items():
            info = checkpoint.info(name)
            assert (info.dtype, info.shape) == (tensor.dtype, tuple(tensor.shape))
            assert info.nbytes == tensor.numel() * tensor.itemsize
            assert info.file in checkpoint.files
        with pytest.raises(CheckpointError, match="no tensor 'nope'"):
            checkpoint.info("nope")
    with pytest.raises(CheckpointError, match="closed"):
        checkpoint.get("vision.scale")


def test_tp_slices_read_only_their_part(tmp_path):
    weight = seeded((12, 10), 5, torch.bfloat16)
    save_safetensors_checkpoint(tmp_path / "ckpt", {"w": weight, "b": seeded((12,), 6)})
    with SafetensorsCheckpoint(tmp_path / "ckpt") as checkpoint:
        for dim in (0, 1, -1):
            for rank, expected in enumerate(weight.chunk(2, dim=dim)):
                got = checkpoint.get_tp_slice("w", dim, rank, 2)
                assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
        assert torch.equal(checkpoint.get_slice("w", 1, 3, 7), weight[:, 3:7])
        assert torch.equal(checkpoint.get_tp_slice("b", 0, 2, 3), checkpoint.get("b")[8:])
        with pytest.raises(CheckpointError, match="does not divide by TP size 3"):
            checkpoint.get_tp_slice("w", 1, 0, 3)
        with pytest.raises(CheckpointError, match="out of range"):
            checkpoint.get_slice("w", 0, 5, 13)
        with pytest.raises(CheckpointError, match="cannot slice dim 2"):
            checkpoint.get_slice("w", 2, 0, 1)
        with pytest.raises(CheckpointError, match="not in a TP group"):
            checkpoint.get_tp_slice("w", 0, 2, 2)


def test_reads_a_transformers_save_pretrained_directory_and_transformers_reads_ours(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPVisionConfig(hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                           num_attention_heads=3, image_size=30, patch_size=6)
    torch.manual_seed(0)
    model = transformers.CLIPVisionModel(config).eval()
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / SAFETENSORS_INDEX_FILE).exists()  # really sharded
    expected = model.state_dict()
    with SafetensorsCheckpoint(tmp_path / "hf") as checkpoint:
        loaded = checkpoint.state_dict()
    assert_same_tensors(loaded, {k: v for k, v in expected.items() if k in loaded})
    assert set(expected) - set(loaded) <= {k for k in expected if k.endswith("position_ids")}

    save_safetensors_checkpoint(tmp_path / "ours", loaded, max_shard_size="10KB",
                                extra_files={"config.json": config.to_json_string()})
    reloaded = transformers.CLIPVisionModel.from_pretrained(tmp_path / "ours").eval()
    pixels = seeded((2, 3, 30, 30), 7)
    with torch.no_grad():
        assert torch.equal(reloaded(pixels).last_hidden_state, model(pixels).last_hidden_state)


# --------------------------------------------------------------------------------------------------
# reader failures: one exception class, one line, naming the path


def one_line_error(directory) -> str:
    with pytest.raises(CheckpointError) as info:
        SafetensorsCheckpoint(directory)
    message = str(info.value)
    assert "\n" not in message
    return message


def write_sharded(directory: Path) -> dict:
    state = {f"t{i}": seeded((8, 8), i) for i in range(4)}
    save_safetensors_checkpoint(directory, state, max_shard_size=600)
    return json.loads((directory / SAFETENSORS_INDEX_FILE).read_text())


def test_missing_directory_and_not_a_directory(tmp_path):
    assert "does not exist" in one_line_error(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    assert "not a directory" in one_line_error(tmp_path / "file")


def test_directory_without_safetensors(tmp_path):
    assert "no model.safetensors or model.safetensors.index.json" in one_line_error(tmp_path)
    save_file({"a": torch.ones(1)}, str(tmp_path / "adapter_model.safetensors"))
    assert "found adapter_model.safetensors but no index" in one_line_error(tmp_path)


@pytest.mark.parametrize("cut", [-3, 40, 5, 0])
def test_truncated_safetensors_file(tmp_path, cut):
    save_safetensors_checkpoint(tmp_path / "ckpt", sample_state())
    path = tmp_path / "ckpt" / SAFETENSORS_SINGLE_FILE
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut > 0 else data[: len(data) + cut] if cut else b"")
    message = one_line_error(tmp_path / "ckpt")
    assert str(path) in message and "not a readable safetensors file" in message


def test_garbage_and_appended_bytes(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / SAFETENSORS_SINGLE_FILE).write_bytes(os.urandom(4096))
    assert "not a readable safetensors file" in one_line_error(directory)
    save_safetensors_checkpoint(tmp_path / "ok", {"a": torch.ones(3)})
    path = tmp_path / "ok" / SAFETENSORS_SINGLE_FILE
    path.write_bytes(path.read_bytes() + b"trailing")
    assert "not a readable safetensors file" in one_line_error(tmp_path / "ok")


def test_index_naming_a_missing_shard(tmp_path):
    directory = tmp_path / "ckpt"
    index = write_sharded(directory)
    victim = sorted(set(index["weight_map"].values()))[1]
    (directory / victim).unlink()
    assert f"index names missing shard file(s) {victim}" in one_line_error(directory)


def test_index_and_shard_disagree(tmp_path):
    directory = tmp_path / "ckpt"
    index = write_sharded(directory)
    first, second = sorted(set(index["weight_map"].values()))[:2]
    moved = next(n for n, f in index["weight_map"].items() if f == first)
    index["weight_map"][moved] = second  # the index now sends `moved` to the wrong shard
    (directory / SAFETENSORS_INDEX_FILE).write_text(json.dumps(index))
    message = one_line_error(directory)
    assert "index/shard key mismatch" in message and moved in message

    del index["weight_map"][moved]  # the shard holds a tensor the index does not know
    (directory / SAFETENSORS_INDEX_FILE).write_text(json.dumps(index))
    message = one_line_error(directory)
    assert "index/shard key mismatch" in message and f"shard holds {moved}" in message


def test_corrupt_or_hostile_index(tmp_path):
    directory = tmp_path / "ckpt"
    write_sharded(directory)
    (directory / SAFETENSORS_INDEX_FILE).write_text("{\"weight_map\": ")
    assert "unreadable index" in one_line_error(directory)
    (directory / SAFETENSORS_INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "../outside.safetensors"}}))
    assert "not a plain file name" in one_line_error(directory)


def test_mapped_offsets_are_the_headers(tmp_path):
    from mmparity.io.fsio.safetensors_read import _data_offsets

    state = sample_state()
    save_safetensors_checkpoint(tmp_path / "ckpt", state, max_shard_size=300)
    with SafetensorsCheckpoint(tmp_path / "ckpt") as checkpoint:
        for file_name in checkpoint.files:
            data = (tmp_path / "ckpt" / file_name).read_bytes()
            header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
            names, spans = _data_offsets(json.dumps(header, indent=1))  # whitespace JSON allows anywhere
            assert names == sorted(k for k in header if k != "__metadata__")
            assert [tuple(spans[i:i + 2]) for i in range(0, len(spans), 2)] == [
                tuple(header[k]["data_offsets"]) for k in names]
        for name, tensor in state.items():
            assert torch.equal(checkpoint.map(name), tensor), name


@pytest.mark.parametrize("edit,needle", [
    ((b'"t1"', b'"t0"'), "'t0' appears twice"),
    ((b'"data_offsets"', b'"data_offsetz"'), "has no data_offsets pair"),
    ((b'{"', b'["'), "expected '{'"),
    ((b'"t1"', b'"u1"'), "no 't1' in its header"),
])
def test_header_changed_after_open_is_refused_when_mapped(tmp_path, edit, needle):
    """Opening validated the headers; the first read of a file parses its header again, and a
    header rewritten in between is refused in one line, never read as some other layout."""
    save_safetensors_checkpoint(tmp_path / "ckpt", {"t0": seeded((4,), 0), "t1": seeded((4,), 1)})
    path = tmp_path / "ckpt" / SAFETENSORS_SINGLE_FILE
    with SafetensorsCheckpoint(tmp_path / "ckpt") as checkpoint:
        data = path.read_bytes()
        with open(path, "r+b") as f:  # in place, same length: only the header's text differs
            f.write(data.replace(*edit, 1))
        with pytest.raises(CheckpointError) as info:
            checkpoint.map("t1")
    assert needle in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)


def test_reader_never_writes_to_the_source(tmp_path):
    """Files are mapped privately (copy-on-write) and never held open for writing; bytes unchanged."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs Linux /proc to inspect mappings")
    directory = tmp_path / "ckpt"
    save_safetensors_checkpoint(directory, sample_state(), max_shard_size=300)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    with SafetensorsCheckpoint(directory) as checkpoint:
        for name in checkpoint.keys():
            checkpoint.get(name)
        mappings = [line.split() for line in Path("/proc/self/maps").read_text().splitlines() if str(directory) in line]
        assert mappings and all(fields[1].endswith("p") for fields in mappings)  # never MAP_SHARED
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith(str(directory)):
                flags = int(Path(f"/proc/self/fdinfo/{fd}").read_text().split("flags:")[1].split()[0], 8)
                assert flags & os.O_ACCMODE == os.O_RDONLY, target
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before


# --------------------------------------------------------------------------------------------------
# atomic directories


def test_atomic_directory_publishes_only_on_success(tmp_path):
    destination = tmp_path / "out"
    with atomic_directory(destination) as staging:
        (staging / "a.txt").write_text("a")
        assert not destination.exists() and staging.parent == tmp_path and staging.name.startswith(".out.tmp-")
    assert entries(tmp_path) == ["out"] and (destination / "a.txt").read_text() == "a"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(destination.stat().st_mode) == 0o777 & ~umask  # not mkdtemp's private 0700


def test_atomic_directory_refuses_an_existing_destination(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with pytest.raises(CheckpointError, match="already exists; pass force=True"):
        with atomic_directory(tmp_path / "out"):
            pytest.fail("must not be entered")
    assert entries(tmp_path) == ["out"] and entries(tmp_path / "out") == ["old.txt"]


def test_atomic_directory_force_replaces_directories_and_files(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with atomic_directory(tmp_path / "out", force=True) as staging:
        (staging / "new.txt").write_text("new")
    assert entries(tmp_path) == ["out"] and entries(tmp_path / "out") == ["new.txt"]
    (tmp_path / "plain").write_text("a file")
    with atomic_directory(tmp_path / "plain", force=True) as staging:
        (staging / "x").write_text("x")
    assert entries(tmp_path / "plain") == ["x"] and entries(tmp_path) == ["out", "plain"]


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_atomic_directory_cleans_up_on_any_exception(tmp_path, error):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with pytest.raises(type(error)):
        with atomic_directory(tmp_path / "deep" / "er" / "new") as staging:
            (staging / "partial").write_text("x")
            raise error
    with pytest.raises(type(error)):
        with atomic_directory(tmp_path / "out", force=True) as staging:
            (staging / "partial").write_text("x")
            raise error
    assert entries(tmp_path) == ["out"] and entries(tmp_path / "out") == ["old.txt"]


def test_a_parent_another_writer_makes_first_is_used_and_left_to_them(tmp_path, monkeypatch):
    """Two writers (ranks on two nodes of one shared filesystem) making the same missing parent:
    the one whose mkdir loses the race uses the directory and does not count it as its own."""
    real_mkdir = Path.mkdir

    def beaten_to_it(self, *args, **kwargs):
        if self == tmp_path / "shared":
            os.mkdir(self)  # the other writer's mkdir lands between our look and ours
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", beaten_to_it)
    from mmparity.io.fsio.publish import discard_staging_directory, make_staging_directory
    staging, created = make_staging_directory(tmp_path / "shared" / "deeper" / "out")
    assert created == [tmp_path / "shared" / "deeper"] and staging.parent == tmp_path / "shared" / "deeper"
    discard_staging_directory(staging, created)
    assert entries(tmp_path) == ["shared"] and entries(tmp_path / "shared") == []


def test_failed_streaming_save_leaves_nothing(tmp_path):
    def tensors():
        for i in range(5):
            yield f"t{i}", seeded((10, 10), i)  # shards of 400 bytes get written before the failure
        raise RuntimeError("source went away")

    with pytest.raises(RuntimeError, match="source went away"):
        save_safetensors_checkpoint(tmp_path / "ckpt", tensors(), max_shard_size=500)
    assert entries(tmp_path) == []


# --------------------------------------------------------------------------------------------------
# checksums and sizes


def test_checksums_see_bytes_dtype_and_shape():
    tensor = seeded((4, 6), 0)
    reference = tensor_checksum(tensor)
    assert tensor_checksum(tensor.clone()) == reference
    assert tensor_checksum(tensor.t().contiguous().t()) == reference  # layout in memory is irrelevant
    assert tensor_checksum(tensor.reshape(6, 4)).digest != reference.digest
    assert tensor_checksum(tensor.view(torch.int32)).digest != reference.digest  # same bytes, other dtype
    flipped = tensor.clone()
    flipped.view(torch.int32)[2, 3] ^= 1  # one bit
    assert tensor_checksum(flipped).digest != reference.digest
    assert reference.differences(tensor_checksum(flipped)) == [f"{reference.algorithm} of the bytes differs"]
    assert reference.differences(tensor_checksum(tensor.double())) == ["dtype float64 != expected float32"]
    assert tensor_checksum(torch.zeros(0, 3)).digest != tensor_checksum(torch.zeros(3, 0)).digest
    assert tensor_checksum(seeded((3,), 1, torch.bfloat16)).dtype == "bfloat16"


@pytest.mark.parametrize(
    "text, expected",
    [(123, 123), ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("1GiB", 2**30), ("10kib", 10 * 2**10), ("42", 42)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "5 parsecs", "-1", 0, True, "1.5GB"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(CheckpointError):
        parse_size(text)


def test_io_imports_neither_framework():
    import subprocess

    fsio = Path(__file__).parents[2] / "mmparity" / "io" / "fsio"
    modules = ", ".join(sorted(f"mmparity.io.fsio.{p.stem}" for p in fsio.glob("*.py") if p.stem != "__init__"))
    code = (f"import sys, {modules}, mmparity.parallel.pp;"
            "bad = [m for m in ('megatron', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_piece_hasher_equals_whole_tensor_and_sha256_records_still_verify():
    tensor = seeded((6, 5), 3, torch.bfloat16)
    hasher = PieceHasher(tensor.dtype, tuple(tensor.shape))
    for piece in tensor.split([1, 3, 2]):
        hasher.update(piece)
    assert hasher.result() == tensor_checksum(tensor)
    # A manifest written with sha256 names it; verification must use the record's algorithm.
    old = tensor_checksum(tensor, "sha256")
    assert TensorChecksum.from_json(old.to_json()) == old and "sha256" in old.to_json()
    assert old.differences(tensor_checksum(tensor, old.algorithm)) == []


# Row runs gathered in one block, or a row or two at a time; small tensors of several pieces
# written piece by piece, or gathered into one buffer first (as they are by default).
@pytest.mark.parametrize("block_bytes, gather", [(None, False), (7, False), (None, True)])
def test_slot_writer_puts_pieces_column_joins_and_row_runs_in_place(tmp_path, monkeypatch, block_bytes, gather):
    from mmparity.io.fsio import slots as slots_module
    from mmparity.io.fsio.pieces import route_pieces
    from mmparity.io.fsio.slots import Slot, SlotWriter

    if block_bytes is not None:
        monkeypatch.setattr(slots_module, "_ROW_BLOCK_BYTES", block_bytes)
    if not gather:
        monkeypatch.setattr(slots_module, "_GATHER_BYTES", 0)
    gathered = []
    real_gathered = slots_module._gathered
    monkeypatch.setattr(slots_module, "_gathered", lambda pieces, nbytes: gathered.append(
        len(real_gathered(pieces, nbytes)) < len(pieces)) or real_gathered(pieces, nbytes))
    from mmparity.mapping.ops import RegroupQKV
    from mmparity.parallel.tp import ColumnJoin, merge, shard

    whole = seeded((6, 10), 5, torch.bfloat16)
    parts = shard(whole, "row", 2)
    cases = {
        "join": [ColumnJoin(parts)],  # a row-parallel matrix merged without the copy
        "runs": [whole[:, 3:7], whole[:, 7:9]],  # column ranges written row by row
        "rows": list(whole.split([1, 4, 1])),
    }
    expected = {"join": merge(parts, "row"), "rows": whole,
                # two column ranges one after the other, each row by row: 6x4 then 6x2 elements
                "runs": torch.cat([whole[:, 3:7].reshape(-1), whole[:, 7:9].reshape(-1)]).view(6, 6)}
    # A dtype torch.cat may not know, in pieces (one of them strided): gathered as bytes.
    fp8 = torch.arange(40, dtype=torch.uint8).mul(3).view(torch.float8_e4m3fn).view(4, 10)
    cases["fp8"] = [fp8[:1], fp8[1:3, :].t().contiguous().t(), fp8[3:]]
    expected["fp8"] = fp8
    slots, offset = {}, 16
    for name, tensor in expected.items():
        slots[name] = Slot(0, offset, tensor.numel() * tensor.element_size(), tensor.dtype, tuple(tensor.shape))
        offset += tensor.numel() * tensor.element_size() + 5
    fd = os.open(tmp_path / "blob", os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, offset)
    writer = SlotWriter(tmp_path, [fd], slots)
    for name, pieces in cases.items():
        writer.write(name, pieces)
    writer.close()
    blob = (tmp_path / "blob").read_bytes()
    for name, tensor in expected.items():
        slot = slots[name]
        found = torch.frombuffer(bytearray(blob[slot.offset:slot.offset + slot.nbytes]), dtype=torch.uint8)
        assert torch.equal(found, tensor.reshape(-1).view(torch.uint8)), name
        assert writer.checksums[name] == tensor_checksum(tensor), name
    assert gathered == [False, gather, gather, gather]  # a ColumnJoin is never gathered

    # q/k/v regrouping only moves row blocks: routed through TP parts it needs no joined copy.
    op = RegroupQKV(num_heads=4, num_groups=2, head_dim=3)
    fused = seeded((24, 5), 6)
    mcore = op.apply([fused])[0]
    routed = route_pieces(op.invert_pieces, list(mcore.split([12, 12])), tuple(mcore.shape), mcore.dtype)
    assert routed is not None and all(p.data_ptr() != 0 for p in routed[0])
    assert torch.equal(torch.cat(routed[0]), fused)


def test_slot_writer_never_writes_one_file_from_two_threads_at_once(tmp_path, monkeypatch):
    """The filesystem serialises writes to one file anyway; two writers racing for it spin a CPU
    in the kernel."""
    import threading
    import time

    from mmparity.io.fsio import slots as slots_module
    from mmparity.io.fsio.slots import Slot, SlotWriter

    state = threading.Lock()
    inside: dict[int, int] = {}
    most = {"same file": 0}

    def watched(fd, data, offset):
        with state:
            inside[fd] = inside.get(fd, 0) + 1
            most["same file"] = max(most["same file"], inside[fd])
        time.sleep(0.02)  # long enough that an unguarded second writer would overlap
        with state:
            inside[fd] -= 1
        os.pwrite(fd, bytes(memoryview(data).cast("B")), offset)

    monkeypatch.setattr(slots_module, "pwrite_all", watched)
    tensors = {f"t{i}": seeded((7, 3), i, torch.bfloat16) for i in range(8)}
    fds, slots = [], {}
    for number in range(2):
        fds.append(os.open(tmp_path / f"blob{number}", os.O_RDWR | os.O_CREAT))
        os.ftruncate(fds[-1], 4 * 42)
    for i, (name, tensor) in enumerate(tensors.items()):
        slots[name] = Slot(i % 2, (i // 2) * 42, 42, tensor.dtype, tuple(tensor.shape))
    writer = SlotWriter(tmp_path, fds, slots)
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    assert most == {"same file": 1}
    for i, (name, tensor) in enumerate(tensors.items()):
        blob = (tmp_path / f"blob{i % 2}").read_bytes()[(i // 2) * 42:(i // 2) * 42 + 42]
        assert torch.equal(torch.frombuffer(bytearray(blob), dtype=torch.bfloat16).view(7, 3), tensor)


def test_file_ranges_locate_only_views_of_registered_mappings(tmp_path):
    state = {"a": seeded((8, 6), 1), "b": seeded((5,), 2, torch.bfloat16)}
    save_safetensors_checkpoint(tmp_path / "ckpt", state)
    ckpt = SafetensorsCheckpoint(tmp_path / "ckpt")
    a = ckpt.map("a")
    fd, offset = ckpt.file_ranges.locate(a)
    assert os.pread(fd, a.nbytes, offset) == a.contiguous().view(torch.uint8).numpy().tobytes()
    fd, offset = ckpt.file_ranges.locate(a[2:5])  # a row block is a range of the file too
    assert os.pread(fd, a[2:5].nbytes, offset) == a[2:5].contiguous().view(torch.uint8).numpy().tobytes()
    assert ckpt.file_ranges.locate(a[:, 1:3]) is None  # not contiguous
    assert ckpt.file_ranges.locate(a.clone()) is None  # anonymous memory
    ckpt.close()
    assert ckpt.file_ranges.locate(a) is None  # closed: never trusted again


def test_start_writeback_is_harmless_where_it_cannot_apply(tmp_path):
    from mmparity.io.fsio import syscalls as io

    path = tmp_path / "f"
    path.write_bytes(b"x" * 10000)
    fd = os.open(path, os.O_RDWR)
    try:
        io.start_writeback(fd, 0, 10000)
        io.start_writeback(fd, 5000, 0)
    finally:
        os.close(fd)
    read_end, write_end = os.pipe()
    try:
        io.start_writeback(write_end, 0, 100)  # a pipe: the kernel says ESPIPE, nothing happens
    finally:
        os.close(read_end)
        os.close(write_end)
    assert path.read_bytes() == b"x" * 10000
    if sys.platform == "linux":
        assert io._sync_file_range, "one fd's refusal must not switch writeback off for every file"


_JSON_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
_RECORD_VALUES = st.one_of(_JSON_TEXT, st.lists(st.integers(-2**70, 2**70), max_size=5),
                           st.lists(st.one_of(st.booleans(), st.none(), st.floats(allow_nan=False), _JSON_TEXT), max_size=3),
                           st.dictionaries(_JSON_TEXT, st.integers(), max_size=2), st.integers(), st.booleans(), st.none())


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_JSON_TEXT, _RECORD_VALUES, max_size=6))
def test_a_manifest_record_is_written_as_json_indents_it(record):
    """The record writer's text is json.dumps(indent=1), nested two deeper, for any record: strings
    with escapes and non-ASCII, empty and long-int lists, and values it leaves to json."""
    assert manifest_module._record_text(record) == json.dumps(record, indent=1).replace("\n", "\n  ")


def test_a_whole_manifest_is_the_json_dump_of_its_records(tmp_path):
    records = tuple(TensorRecord(f"__{n % 2}_0.distcp", f"decoder.layers.{n}.w\u00e9ight",
                                 tensor_checksum(torch.arange(n + 1, dtype=torch.float32).reshape(1, -1)),
                                 (n, 0) if n % 3 else None) for n in range(7))
    manifest = Manifest(layout=LAYOUT_TORCH_DIST, tensors=records)
    path = manifest_module.write_manifest(tmp_path, manifest)
    assert path.read_text() == json.dumps(manifest.to_json(), indent=1) + "\n"


@settings(max_examples=60, deadline=None)
@given(entries=st.lists(st.tuples(st.text(min_size=1, max_size=12),
                                  st.sampled_from([torch.bfloat16, torch.float32, torch.int8]),
                                  st.lists(st.integers(0, 9), max_size=3)), max_size=40, unique_by=lambda e: e[0]),
       metadata=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3), run=st.integers(1, 300))
def test_a_shard_header_written_in_runs_is_json_dumps_of_the_header_dict(entries, metadata, run, tmp_path_factory):
    """The header, made entry by entry and written in runs of any length, has the bytes of the
    dict-of-dicts ``json.dumps`` (names that need escaping included), padded to 8 behind its length."""
    ordered = [(name, dtype, tuple(shape), math.prod(shape) * dtype.itemsize) for name, dtype, shape in entries]
    header, offset = {"__metadata__": metadata}, 0
    for name, dtype, shape, nbytes in ordered:
        header[name] = {"dtype": SAFETENSORS_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    expected = json.dumps(header, separators=(",", ":")).encode()
    expected += b" " * (-len(expected) % 8)
    path = tmp_path_factory.mktemp("header") / "shard"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        start, offsets = writer_module._write_header(fd, metadata, ordered, run)
    finally:
        os.close(fd)
    assert path.read_bytes() == len(expected).to_bytes(8, "little") + expected
    assert start == 8 + len(expected) and offsets == [0, *(h["data_offsets"][1] for h in list(header.values())[1:])]
