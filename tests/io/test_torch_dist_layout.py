"""The megatron-free torch_dist writer (``torch_dist_layout`` + ``torch_dist_write``) against what
megatron-core's own save of the family's Megatron model writes from the same source
(``tests/torch_dist_reference.py``): the same DCP index, the same tensors chunk for chunk, the
same byte objects and common state, the same manifest records. Plus the layout's refusals and
the metadata encoder's corners."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmparity.models import registry as families
from mmparity.io import dcp_index, dcp_metadata, torch_dist_files, unpickle
from mmparity.convert import ConvertOptions, convert
from mmparity.convert.sources import open_source
from mmparity.io.formats import torch_dist as torch_dist_format
from mmparity.io.formats.base import Output, Progress
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.manifest import read_manifest
from mmparity.io.torch_dist_layout import plan
from tests.mapping.test_convert_roundtrips import assert_same_checkpoint, save_hf

def _all_moe_kimi():
    cfg = families.get("kimi_k25_vl").tiny_config()
    cfg.text_config.first_k_dense_replace = 0  # no dense layer: still keyed layer by layer
    return cfg


def _gemma4_e2b():
    from mmparity.models.gemma4 import reference

    return reference.tiny_e2b_config()


# Every registered family (under a second each), a MoE language model with no dense layer, and
# Gemma 4 E2B's per-layer table and query-only shared layers.
CASES = [pytest.param(name, None, id=name) for name in families.names()]
CASES.append(pytest.param("kimi_k25_vl", _all_moe_kimi, id="kimi_k25_vl-all-moe"))
CASES.append(pytest.param("gemma4", _gemma4_e2b, id="gemma4-e2b"))


def _convert_both(tmp_path: Path, family: str, cfg=None) -> tuple[Path, Path]:
    from tests.torch_dist_reference import write_with_mcore

    hf = save_hf(family, tmp_path / "hf", seed=5, cfg=cfg)
    paths = {}
    for name, write in (("ours", torch_dist_format.write), ("mcore", write_with_mcore)):
        paths[name] = tmp_path / name
        write(open_source(hf, family), Output(paths[name]), Progress())
    return paths["ours"], paths["mcore"]


@pytest.mark.parametrize("family, make_cfg", CASES)
def test_written_as_mcores_save_writes_it(tmp_path, family, make_cfg):
    ours, mcore = _convert_both(tmp_path, family, make_cfg() if make_cfg else None)
    a, b = ours / "iter_0000001", mcore / "iter_0000001"
    ma, mb = torch_dist_files.load_metadata(a), torch_dist_files.load_metadata(b)
    # megatron-core >= 0.19 also keeps the common state inside the DCP files; every version reads
    # common.pt first, which both writers write (compared below).
    in_dcp = [k for k in mb.state_dict_metadata if k.split("/")[0] == "common_state"]
    assert sorted(ma.state_dict_metadata) == sorted(k for k in mb.state_dict_metadata if k not in in_dcp)
    for key, entry in mb.state_dict_metadata.items():
        if key in in_dcp:
            continue
        mine = ma.state_dict_metadata[key]
        if hasattr(entry, "chunks"):
            # DCP's dataclasses compare field by field; chunk order is the writer's own.
            assert (mine.properties, mine.size) == (entry.properties, entry.size), key
            order = lambda c: tuple(c.offsets)  # noqa: E731
            assert sorted(mine.chunks, key=order) == sorted(entry.chunks, key=order), key
        else:
            assert type(mine) is type(entry), key
    assert {(i.fqn, i.offset) for i in ma.storage_data} == {(i.fqn, i.offset) for i in mb.storage_data
                                                            if i.fqn not in in_dcp}
    got, expected = torch_dist_files.global_state_dict(a), torch_dist_files.global_state_dict(b)
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    for key in torch_dist_files.object_keys(b):
        assert torch_dist_files.object_bytes(a, key) == torch_dist_files.object_bytes(b, key), key
    common = [unpickle.load_torch_archive((d / "common.pt").read_bytes(), unpickle.OBJECT_NAMES) for d in (a, b)]
    assert common[0] == common[1]
    for key in in_dcp:
        stored = unpickle.load_torch_archive(torch_dist_files.object_bytes(b, key), unpickle.OBJECT_NAMES)
        assert stored == [common[0]], key
    # 0.19 dropped the common backend from its config (and ignores fields it does not know);
    # 0.16 records it: we write 0.16's, a superset.
    config, theirs = json.loads((a / "metadata.json").read_text()), json.loads((b / "metadata.json").read_text())
    assert {k: config[k] for k in theirs} == theirs
    records = [{json.dumps(r.to_json(), sort_keys=True) for r in read_manifest(root).tensors} for root in (ours, mcore)]
    assert records[0] == records[1]
    for name in ("hf_config.json", "latest_checkpointed_iteration.txt"):
        assert (ours / name).read_bytes() == (mcore / name).read_bytes()


def test_the_same_source_writes_the_same_bytes(tmp_path):
    """No random ids, no destination paths, no scratch-file names in what is written: a
    conversion is reproducible, wherever it writes."""
    hf = save_hf("mistral3", tmp_path / "hf", seed=1)
    outputs = []
    for name in ("one", "two"):
        options = ConvertOptions(src=hf, dst=tmp_path / name / "ckpt", to="mcore", format="torch_dist")
        convert(options)
        outputs.append(options.dst / "iter_0000001")
    for file in sorted(p.name for p in outputs[0].iterdir()):
        assert (outputs[0] / file).read_bytes() == (outputs[1] / file).read_bytes(), file


def test_the_metadata_decodes_to_dcps_own_objects():
    """What DCP's unpickler makes of our bytes equals the objects DCP's writer would pickle, and
    byte offsets past 2 GiB survive."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    far = 5 * 2**30 + 3
    entry = dcp_metadata.TensorEntry("decoder.layers.mlp.linear_fc1.weight", (2, 6, 4), torch.bfloat16, (
        ((0, 0, 0), (1, 3, 4), ("__0_0.distcp", 0, 100)),
        ((0, 3, 0), (1, 3, 4), ("__0_0.distcp", far, 100)),
        ((1, 0, 0), (1, 6, 4), ("__0_0.distcp", 2**31, 2**31 + 7)),
    ))
    data = dcp_metadata.encode_metadata([entry], {"x._extra_state/shard_0_1": ("__0_0.distcp", 2**40, 9)})
    decoded = pickle.loads(data)
    tensor = decoded.state_dict_metadata[entry.key]
    assert tensor == TensorStorageMetadata(
        TensorProperties(dtype=torch.bfloat16), torch.Size((2, 6, 4)),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _ in entry.chunks])
    assert isinstance(decoded.state_dict_metadata["x._extra_state/shard_0_1"], BytesStorageMetadata)
    assert decoded.storage_data[MetadataIndex(entry.key, (0, 3, 0))] == _StorageInfo("__0_0.distcp", far, 100)
    assert decoded.storage_data[MetadataIndex(entry.key, (1, 0, 0))].length == 2**31 + 7
    assert decoded.storage_data[MetadataIndex("x._extra_state/shard_0_1")].offset == 2**40
    # Our own reader's allow-list takes it too.
    assert unpickle.loads(data, unpickle.DCP_METADATA_NAMES, "test").storage_data == decoded.storage_data


def test_the_metadata_bytes_are_those_of_the_first_encoder():
    """The encoder's bytes, pinned: the digest is what the first, walk-everything encoder (before
    recurring shapes and properties were copied from their first encoding) wrote for the same
    index. Over 256 memo entries (long memo ops), four dtypes, offsets past 2 and 4 GiB, two data
    files and byte objects."""
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.int8]
    entries = []
    for layer in range(7):
        for e in range(45):
            chunk = ((e, 0, 0), (1, 3, 4), (f"__{e % 3}_0.distcp", 2**31 * (e % 5) + 64 * e, 100 + e))
            entries.append(dcp_metadata.TensorEntry(
                f"decoder.layers.{layer}.mlp.experts.experts.linear_fc{1 + e % 2}.weight{e}",
                (45, 6 + layer % 3, 4), dtypes[(layer + e) % 4], (chunk,)))
        entries.append(dcp_metadata.TensorEntry(
            f"decoder.layers.{layer}.self_attention.linear_qkv.weight", (12, 8), torch.bfloat16,
            (((0, 0), (6, 8), ("__0_0.distcp", 0, 10)), ((6, 0), (6, 8), ("__0_0.distcp", 2**40, 10)))))
    objects = {f"x.{i}._extra_state/shard_0_{i}": ("__1_0.distcp", 2**33 + i, 9) for i in range(30)}
    data = dcp_metadata.encode_metadata(entries, objects)
    assert (len(data), hashlib.sha256(data).hexdigest()) == (
        97215, "6243f990c431d5fd080b477dd636adf73f08b18add7ae6e4ef527b6b531a266f")
    assert len(pickle.loads(data).storage_data) == len(entries) + 7 + len(objects)
    # Handed out in runs as it is made (how a conversion writes it): the same bytes, in several
    # runs, whatever the run length (1 byte: handed out after every entry of the index).
    for flush_bytes in (1, 977, 2**16):
        runs = []
        assert dcp_metadata.encode_metadata(entries, objects, write=lambda b: runs.append(bytes(b)),
                                            flush_bytes=flush_bytes) is None
        assert b"".join(runs) == bytes(data), flush_bytes
        assert len(runs) > 1 and all(runs), flush_bytes


def test_dcps_own_pickle_decodes_into_compact_stand_ins():
    """DCP's own pickle of its index (protocol 4, torch.Size shapes) read into dcp_index's records:
    the same fields, shapes as tuples shared within the decode, no instance dict per record
    unless the pickle names a field DCP's classes here lack (kept, not dropped)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)

    key, item = "decoder.layers.mlp.linear_fc2.weight", "x._extra_state/shard_0_1"
    chunks = [ChunkStorageMetadata(torch.Size((layer, 0)), torch.Size((1, 8))) for layer in range(3)]
    storage = {MetadataIndex(key, c.offsets, n): _StorageInfo("__0_0.distcp", 64 * n, 40) for n, c in enumerate(chunks)}
    storage[MetadataIndex(item)] = _StorageInfo("__1_0.distcp", 2**40, 9)
    later = next(iter(storage.values()))
    later.added_later = "kept"  # a field of a DCP version other than this one
    data = pickle.dumps(Metadata({key: TensorStorageMetadata(TensorProperties(torch.bfloat16), torch.Size((3, 8)), chunks),
                                  item: BytesStorageMetadata()}, storage_data=storage))

    decoded = unpickle.loads(data, unpickle.DCP_METADATA_NAMES, "test", substitutes=dcp_index.substitutes())
    tensor = decoded.state_dict_metadata[key]
    assert tensor.size == (3, 8) and type(tensor.size) is tuple and tensor.properties.dtype == torch.bfloat16
    assert [(c.offsets, c.sizes) for c in tensor.chunks] == [((n, 0), (1, 8)) for n in range(3)]
    assert all(c.sizes is tensor.chunks[0].sizes for c in tensor.chunks)  # one tuple for equal shapes
    assert dcp_index.is_tensor_entry(tensor) and not dcp_index.is_tensor_entry(decoded.state_dict_metadata[item])
    first = decoded.storage_data[dcp_index.MetadataIndex.of(key, (0, 0))]
    assert (first.relative_path, first.offset, first.length, first.added_later) == ("__0_0.distcp", 0, 40, "kept")
    second = decoded.storage_data[dcp_index.MetadataIndex.of(key, (1, 0))]
    assert (second.offset, second.transform_descriptors) == (64, None) and not hasattr(second, "__dict__")
    assert copy.deepcopy(first) == first and copy.deepcopy(tensor) == tensor
    assert decoded.storage_data[dcp_index.MetadataIndex.of(item, None)].offset == 2**40
    assert [index.index for index in decoded.storage_data] == [0, 1, 2, None]
    assert "added_later='kept'" in repr(first) and repr(second) == (
        "_StorageInfo(relative_path='__0_0.distcp', offset=64, length=40)")  # a default is not a field it was given
    # A record's state is only ever its fields (BUILD with {"__class__": None}).
    build = (b"\x80\x02ctorch.distributed.checkpoint.filesystem\n_StorageInfo\n)\x81}X\x09\x00\x00\x00__class__Nsb.")
    with pytest.raises(CheckpointError, match="a field named '__class__'"):
        unpickle.loads(build, unpickle.DCP_METADATA_NAMES, "test", substitutes=dcp_index.substitutes())


def _shapes(keys, shape=(4, 2)):
    return {k: shape for k in keys}, {k: torch.float32 for k in keys}


def test_a_stack_with_a_missing_layer_tensor_is_laid_out_layer_by_layer():
    keys = ["decoder.layers.0.mlp.linear_fc2.weight", "decoder.layers.1.mlp.linear_fc2.weight",
            "decoder.layers.1.mlp.linear_fc2.bias"]
    shapes, dtypes = _shapes(keys)
    layout = plan(keys, {k: "row" for k in keys}, shapes, dtypes)
    assert sorted(t.key for t in layout.tensors) == sorted(keys)


def test_layers_of_different_shapes_are_refused_with_both_named():
    keys = ["decoder.layers.0.mlp.linear_fc2.weight", "decoder.layers.1.mlp.linear_fc2.weight"]
    shapes, dtypes = _shapes(keys)
    shapes[keys[1]] = (4, 3)
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.linear_fc2\.weight \[4, 3\].*layers\.0\."):
        plan(keys, {k: "row" for k in keys}, shapes, dtypes)


def test_gated_halves_are_two_chunks_and_an_odd_one_is_refused():
    key = "decoder.layers.0.mlp.linear_fc1.weight"
    layout = plan([key], {key: "gated"}, {key: (6, 2)}, {key: torch.bfloat16})
    (tensor,) = layout.tensors
    assert tensor.key == "decoder.layers.mlp.linear_fc1.weight" and tensor.shape == (1, 6, 2)
    assert [(c.offsets, c.sizes, c.rows) for c in tensor.chunks] == [((0, 0, 0), (1, 3, 2), (0, 3)),
                                                                   ((0, 3, 0), (1, 3, 2), (3, 6))]
    with pytest.raises(CheckpointError, match="odd row count"):
        plan([key], {key: "gated"}, {key: (5, 2)}, {key: torch.bfloat16})


def test_regions_across_chunks_read_the_same_mapped_or_loaded(tmp_path, monkeypatch):
    """The reader without DCP: a region over several chunks (a gated FC1's halves, several
    layers) is assembled from each chunk's overlap, the same whether a chunk is mapped in place
    or its blob loaded with torch.load."""
    from mmparity.io.torch_dist_files import TorchDistFiles

    hf = save_hf("mistral3", tmp_path / "hf", seed=2)
    options = ConvertOptions(src=hf, dst=tmp_path / "ckpt", to="mcore", format="torch_dist")
    convert(options)
    files = TorchDistFiles(options.dst / "iter_0000001")
    key = "language_model.decoder.layers.mlp.linear_fc1.weight"
    layers, rows, cols = files.tensors[key][1]
    half = rows // 2
    regions = [((0, 0, 0), (layers, rows, cols)), ((0, half - 1, 1), (layers, 2, cols - 1)),
               ((layers - 1, half, 0), (1, half, cols))]
    mapped = [files.read_region(key, *region) for region in regions]
    assert not mapped[2].untyped_storage().resizable()  # one whole chunk: a view of the file
    whole = mapped[0]
    assert torch.equal(mapped[1], whole[:, half - 1:half + 1, 1:])
    monkeypatch.setattr(TorchDistFiles, "_mapped_chunk", lambda *args: None)
    for region, expected in zip(regions, mapped):
        assert torch.equal(files.read_region(key, *region), expected), region
    with pytest.raises(CheckpointError, match="outside"):
        files.read_region(key, (0, 0, 0), (layers, rows + 1, cols))


def test_a_layer_of_gated_halves_is_read_as_two_views_of_the_file(tmp_path):
    """One layer of a stacked gated FC1 spans its two chunks (gate, up): read as pieces, it is
    those chunks' views of the file, in order, equal to the assembled region; a region cut along
    another dimension, or inside one chunk, is not offered as pieces."""
    from mmparity.io.torch_dist_files import TorchDistFiles

    hf = save_hf("mistral3", tmp_path / "hf", seed=3)
    options = ConvertOptions(src=hf, dst=tmp_path / "ckpt", to="mcore", format="torch_dist")
    convert(options)
    files = TorchDistFiles(options.dst / "iter_0000001")
    key = "language_model.decoder.layers.mlp.linear_fc1.weight"
    layers, rows, cols = files.tensors[key][1]
    layer = layers - 1
    pieces = files.region_pieces(key, (layer, 0, 0), (1, rows, cols))
    assert [tuple(p.shape) for p in pieces] == [(rows // 2, cols)] * 2
    assert all(not p.untyped_storage().resizable() for p in pieces)  # views of the mapping, no copy
    assert torch.equal(torch.cat(pieces), files.read_region(key, (layer, 0, 0), (1, rows, cols))[0])
    assert files.region_pieces(key, (layer, 0, 1), (1, rows, cols - 1)) is None
    assert files.region_pieces(key, (layer, 0, 0), (1, rows // 2, cols)) is None
    back = tmp_path / "back"
    convert(ConvertOptions(src=options.dst, dst=back, to="hf"))
    assert_same_checkpoint(back, hf)  # and the pieces go back to HF bit for bit


class _CountedChunk:
    """A ``.metadata`` chunk record that counts how often a reader looks at its offsets."""

    looks = 0

    def __init__(self, offsets, sizes):
        self._offsets, self.sizes = tuple(offsets), tuple(sizes)

    @property
    def offsets(self):
        _CountedChunk.looks += 1
        return self._offsets


def _files_of(chunks_by_key: dict):
    files = object.__new__(torch_dist_files.TorchDistFiles)
    files.metadata = SimpleNamespace(state_dict_metadata={
        key: SimpleNamespace(chunks=chunks) for key, chunks in chunks_by_key.items()})
    files._chunk_order = {}
    return files


def _grid(draw_cuts, shape):
    """Chunks tiling ``shape`` on a grid whose cuts along each dim ``draw_cuts(dim, size)`` gives."""
    bounds = [[0, *sorted(set(draw_cuts(dim, size))), size] for dim, size in enumerate(shape)]
    spans = [list(zip(b, b[1:])) for b in bounds]
    return [(tuple(lo for lo, _ in cell), tuple(hi - lo for lo, hi in cell)) for cell in itertools.product(*spans)]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_chunks_a_region_overlaps_are_found_in_any_order(data):
    """The bisection over chunks in offsets order finds exactly the chunks a scan of all of them
    would, for chunk grids of 1-4 dims, regions anywhere (one chunk, across several, inside one),
    and chunks listed in any order (Megatron-LM's own saves need not list them sorted)."""
    shape = tuple(data.draw(st.lists(st.integers(1, 7), min_size=1, max_size=4), label="shape"))
    chunks = _grid(lambda dim, size: data.draw(st.lists(st.integers(1, size - 1), max_size=3)
                                               if size > 1 else st.just([]), label=f"cuts{dim}"), shape)
    order = data.draw(st.permutations(range(len(chunks))), label="order")
    files = _files_of({"t": [_CountedChunk(*chunks[i]) for i in order]})
    offsets = tuple(data.draw(st.integers(0, n - 1), label=f"o{d}") for d, n in enumerate(shape))
    sizes = tuple(data.draw(st.integers(1, n - o), label=f"n{d}") for d, (o, n) in enumerate(zip(offsets, shape)))
    expected = sorted((c, m) for c, m in chunks
                      if all(ci < o + n and o < ci + mi for o, n, ci, mi in zip(offsets, sizes, c, m)))
    assert files._overlapping("t", offsets, sizes) == expected


def test_reading_every_expert_of_a_stack_looks_at_a_few_chunks_each():
    """Reading one expert of a (layer, expert, rows, cols) stack of gated halves looks at a number
    of chunks that grows with the log of the stack's size: every expert of a 4 x 512 stack read
    costs a few dozen looks each (55 measured), where a scan of the stack's chunks per read costs
    4,096 each (the quadratic torch_dist -> HF conversion of a many-expert model)."""
    layers, experts, rows, cols = 4, 512, 6, 3
    chunks = [_CountedChunk((layer, expert, half * rows // 2, 0), (1, 1, rows // 2, cols))
              for layer in range(layers) for expert in range(experts) for half in range(2)]
    files = _files_of({"stack": chunks})
    files._overlapping("stack", (0, 0, 0, 0), (1, 1, rows, cols))  # the one-off ordering check
    _CountedChunk.looks = 0
    for layer in range(layers):
        for expert in range(experts):
            found = files._overlapping("stack", (layer, expert, 0, 0), (1, 1, rows, cols))
            assert [c for c, _ in found] == [(layer, expert, 0, 0), (layer, expert, rows // 2, 0)]
    assert _CountedChunk.looks / (layers * experts) < 200, _CountedChunk.looks / (layers * experts)
