"""mcore checkpoint formats on CPU: pipeline renumbering, legacy files, torch_dist under gloo, verify.

The torch_dist tests run a real megatron-core `TransformerBlock` (local spec, GQA, gated MLP with
biases) in 1 and 2 gloo processes and load every checkpoint back with
`megatron.core.dist_checkpointing.load`, including at a TP size other than the writer's. Expected
values are computed here by hand (concatenate / split along the documented axes) rather than with
mmparity's own TP code, so the test checks mcore's layout, not our assumptions about it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from mmparity.io.layout import CHECKPOINT_VERSION
from mmparity.io.manifest import MANIFEST_FILE, Provenance, read_manifest
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.legacy import open_legacy, read_legacy, write_legacy
from mmparity.io.verify import verify
from mmparity.io.hf import write_hf
from mmparity.io.torch_dist_files import global_state_dict
from mmparity.parallel import pp
from mmparity.io.fsio.checksums import CHECKSUM_ALGORITHM

NUM_LAYERS = 3


def seeded(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def stable_seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def mcore_state_dict(tp_rank: int = 0, num_layers: int = NUM_LAYERS) -> dict[str, torch.Tensor]:
    """A globally numbered, TE-spelled mcore-style state dict with mixed dtypes and odd shapes."""
    state = {
        "embedding.patch_conv.weight": seeded((12, 3, 5, 5), stable_seed("conv", tp_rank)),
        "embedding.ln_pre.weight": seeded((12,), stable_seed("ln_pre", tp_rank)),
        "decoder.final_layernorm.weight": seeded((12,), stable_seed("final", tp_rank), torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),
    }
    for layer in range(num_layers):
        state[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"] = seeded((18, 12), stable_seed("qkv", layer, tp_rank))
        state[f"decoder.layers.{layer}.self_attention.linear_qkv.layer_norm_weight"] = seeded((12,), stable_seed("ln1", layer, tp_rank))
        state[f"decoder.layers.{layer}.mlp.linear_fc1.weight"] = seeded((10, 12), stable_seed("fc1", layer, tp_rank), torch.bfloat16)
        state[f"decoder.layers.{layer}.mlp.linear_fc2.weight"] = seeded((12, 5), stable_seed("fc2", layer, tp_rank), torch.float16)
    return state


def assert_same_tensors(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert torch.equal(actual[key], value), key


def entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# --------------------------------------------------------------------------------------------------
# pipeline renumbering


@pytest.mark.parametrize("layer_counts", [[3], [1, 2], [2, 0, 1], [1, 1, 1]])
def test_pipeline_index_maps_are_inverse(layer_counts):
    total = sum(layer_counts)
    seen = []
    for global_index in range(total):
        stage, local = pp.global_to_local(global_index, layer_counts)
        assert pp.local_to_global(stage, local, layer_counts) == global_index
        seen.append(stage)
    assert seen == sorted(seen)  # stages hold contiguous runs in order
    assert [seen.count(s) for s in range(len(layer_counts))] == layer_counts


@pytest.mark.parametrize("layer_counts", [[3], [1, 2], [2, 1], [1, 1, 1], [0, 3]])
def test_split_then_merge_pipeline_stages_is_identity(layer_counts):
    state = mcore_state_dict()
    stages = pp.split_pipeline_stages(state, layer_counts)
    assert len(stages) == len(layer_counts)
    for stage, stage_state in enumerate(stages):
        local_layers = {int(k.split(".")[2]) for k in stage_state if k.startswith("decoder.layers.")}
        assert local_layers == set(range(layer_counts[stage]))
    assert "embedding.patch_conv.weight" in stages[0] and "step" in stages[0]
    assert "decoder.final_layernorm.weight" in stages[-1]
    merged = pp.merge_pipeline_stages(stages, layer_counts)
    assert_same_tensors(merged, state)
    assert all(merged[k] is state[k] for k in state)  # renaming never copies


def test_pipeline_stage_holds_the_right_global_layers():
    state = mcore_state_dict()
    stages = pp.split_pipeline_stages(state, [2, 1])
    key = "decoder.layers.{}.mlp.linear_fc1.weight"
    assert stages[1][key.format(0)] is state[key.format(2)]
    assert stages[0][key.format(1)] is state[key.format(1)]


def test_a_modules_extra_state_goes_to_its_stage():
    """Last-stage keys named whole (as pipeline_layout names them): the output layer's TE slot
    goes with its weight, or the last stage's strict load misses it and the first's finds it
    unexpected."""
    state = {"embedding.word_embeddings.weight": torch.zeros(1), "decoder.layers.0.x": torch.zeros(1),
             "decoder.layers.1.x": torch.zeros(1), "output_layer.weight": torch.zeros(1),
             "output_layer._extra_state": None, "embedding.word_embeddings._extra_state": None}
    first, last = pp.split_pipeline_stages(state, [1, 1], last_stage_prefixes=("output_layer.weight",))
    assert set(last) == {"decoder.layers.0.x", "output_layer.weight", "output_layer._extra_state"}
    assert "embedding.word_embeddings._extra_state" in first


def test_pipeline_errors_are_loud():
    state = mcore_state_dict()
    with pytest.raises(pp.PipelineError, match="must be >= 1"):
        pp.buildable_layer_counts(3, 0)
    with pytest.raises(pp.PipelineError, match="beyond the 2-layer split"):
        pp.split_pipeline_stages(state, [1, 1])
    with pytest.raises(pp.PipelineError, match="outside"):
        pp.global_to_local(3, [1, 2])
    with pytest.raises(pp.PipelineError, match="no local layer"):
        pp.local_to_global(0, 1, [1, 2])
    stages = pp.split_pipeline_stages(state, [1, 2])
    stages[1]["embedding.ln_pre.weight"] = state["embedding.ln_pre.weight"] + 1
    with pytest.raises(pp.PipelineError, match="different values"):
        pp.merge_pipeline_stages(stages, [1, 2])
    gappy = {"decoder.layers.0.x": torch.zeros(1), "decoder.layers.2.x": torch.zeros(1)}
    with pytest.raises(pp.PipelineError, match="gaps"):
        pp.infer_layer_counts([gappy])


def test_identical_tied_copies_on_two_stages_merge():
    stages = pp.split_pipeline_stages(mcore_state_dict(), [2, 1])
    stages[1]["embedding.ln_pre.weight"] = stages[0]["embedding.ln_pre.weight"].clone()
    merged = pp.merge_pipeline_stages(stages)
    assert torch.equal(merged["embedding.ln_pre.weight"], stages[0]["embedding.ln_pre.weight"])


# --------------------------------------------------------------------------------------------------
# legacy format


def test_legacy_tp2_round_trip_and_megatron_layout(tmp_path):
    shards = [mcore_state_dict(tp_rank=r) for r in range(2)]
    root = tmp_path / "ckpt"
    write_legacy(root, shards, iteration=42, provenance=Provenance(family="toy", source_layout="hf_safetensors"))

    assert entries(root) == sorted(["iter_0000042", "latest_checkpointed_iteration.txt", MANIFEST_FILE])
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "42"
    assert entries(root / "iter_0000042") == ["mp_rank_00", "mp_rank_01"]
    payload = torch.load(root / "iter_0000042/mp_rank_01/model_optim_rng.pt", weights_only=True)
    assert payload["checkpoint_version"] == CHECKPOINT_VERSION and payload["iteration"] == 42
    assert_same_tensors(payload["model"], shards[1])

    assert [sorted(s) for s in read_legacy(root)] == [sorted(s) for s in shards]
    for loaded, expected in zip(read_legacy(root), shards):
        assert_same_tensors(loaded, expected)
    manifest = read_manifest(root)
    assert (manifest.layout, manifest.tensor_parallel_size, manifest.pipeline_parallel_size) == ("mcore_legacy", 2, 1)
    assert manifest.provenance.family == "toy" and manifest.provenance.key_prefixes == ("decoder.", "embedding.", "step")
    assert verify(root).ok


def test_legacy_pipeline_stages_use_local_numbering(tmp_path):
    shards = [mcore_state_dict(tp_rank=r) for r in range(2)]
    root = tmp_path / "ckpt"
    write_legacy(root, shards, pp_size=2, layer_counts=[2, 1])
    assert entries(root / "iter_0000001") == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    checkpoint = open_legacy(root)
    assert (checkpoint.tp_size, checkpoint.pp_size) == (2, 2)
    last_stage = checkpoint.load_rank(tp_rank=1, pp_rank=1)
    assert sorted(k for k in last_stage if "layers" in k)[0].startswith("decoder.layers.0.")
    assert torch.equal(last_stage["decoder.layers.0.mlp.linear_fc1.weight"], shards[1]["decoder.layers.2.mlp.linear_fc1.weight"])
    assert "decoder.final_layernorm.weight" in last_stage and "embedding.ln_pre.weight" not in last_stage
    # The uneven split is recorded, so reading back needs no hint.
    for loaded, expected in zip(read_legacy(root), shards):
        assert_same_tensors(loaded, expected)
    assert verify(root).ok


def test_legacy_writes_standalone_tensors_not_their_base_storage(tmp_path):
    base = seeded((1000, 100), 3)
    write_legacy(tmp_path / "ckpt", [{"decoder.layers.0.w": base[:2]}])
    size = (tmp_path / "ckpt/iter_0000001/mp_rank_00/model_optim_rng.pt").stat().st_size
    assert size < 10_000  # a saved view would carry all 400 kB of `base`


def test_legacy_refuses_existing_destination_and_leaves_it_alone(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        write_legacy(root, [mcore_state_dict()])
    assert entries(root) == ["keep.txt"] and entries(tmp_path) == ["ckpt"]
    write_legacy(root, [mcore_state_dict()], force=True)
    assert "keep.txt" not in entries(root) and verify(root).ok


def test_legacy_failed_write_leaves_nothing(tmp_path, monkeypatch):
    real_save = torch.save
    calls = []

    def failing_save(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        write_legacy(tmp_path / "a" / "b" / "ckpt", [mcore_state_dict(), mcore_state_dict(1)])
    assert len(calls) == 2 and entries(tmp_path) == []  # created parents are removed too


@pytest.mark.parametrize(
    "shards, message",
    [
        ([], "no TP shards"),
        ([{"decoder.layers.0.w": object()}], "weights_only"),
        ([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], "different keys"),
    ],
)
def test_legacy_refuses_unwritable_input_before_touching_disk(tmp_path, shards, message):
    with pytest.raises(CheckpointError, match=message):
        write_legacy(tmp_path / "ckpt", shards)
    assert entries(tmp_path) == []


def test_legacy_uneven_pipeline_without_counts_uses_the_one_split_policy(tmp_path):
    """3 layers over 2 stages: the split `convert --pp` makes (and mcore can build), recorded."""
    root = tmp_path / "ckpt"
    state = mcore_state_dict()
    write_legacy(root, [state], pp_size=2)
    assert pp.buildable_layer_counts(3, 2) == [2, 1]
    assert read_manifest(root).pipeline_layer_counts == (2, 1)
    first_stage = open_legacy(root).load_rank(tp_rank=0, pp_rank=0)
    assert sorted(k for k in first_stage if "layers" in k)[-1].startswith("decoder.layers.1.")
    (loaded,) = read_legacy(root)
    assert_same_tensors(loaded, state)


class NotAllowedInWeightsOnly:
    pass


def test_legacy_reader_errors(tmp_path):
    write_legacy(tmp_path / "ckpt", [mcore_state_dict(r) for r in range(2)], pp_size=3)
    root = tmp_path / "ckpt"
    rank_file = root / "iter_0000001/mp_rank_01_002/model_optim_rng.pt"

    with pytest.raises(CheckpointError, match="does not exist"):
        open_legacy(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="iteration directory does not exist"):
        open_legacy(root, iteration=5)

    moved = rank_file.with_suffix(".bak")
    rank_file.rename(moved)
    with pytest.raises(CheckpointError, match=r"incomplete TP=2 PP=3 grid, missing mp_rank_01_002"):
        open_legacy(root)
    moved.rename(rank_file)

    # Arbitrary pickled objects are refused, never executed.
    torch.save({"model": {"x": NotAllowedInWeightsOnly()}, "checkpoint_version": 3.0}, rank_file)
    with pytest.raises(CheckpointError, match="refusing to unpickle .*NotAllowedInWeightsOnly"):
        open_legacy(root).load_rank(1, 2)
    torch.save({"model": {"x": torch.zeros(1)}, "checkpoint_version": 2.0}, rank_file)
    with pytest.raises(CheckpointError, match="older than 3.0"):
        open_legacy(root).load_rank(1, 2)
    torch.save({"model0": {}, "model1": {}, "checkpoint_version": 3.0}, rank_file)
    with pytest.raises(CheckpointError, match="virtual-pipeline"):
        open_legacy(root).load_rank(1, 2)
    rank_file.write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="unreadable"):
        open_legacy(root).load_rank(1, 2)

    (root / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.raises(CheckpointError, match="expected an iteration number"):
        open_legacy(root)


def test_legacy_reads_an_iteration_directory_directly(tmp_path):
    write_legacy(tmp_path / "ckpt", [mcore_state_dict()], iteration=3)
    assert_same_tensors(read_legacy(tmp_path / "ckpt" / "iter_0000003")[0], mcore_state_dict())


# --------------------------------------------------------------------------------------------------
# verify


def test_verify_reports_every_difference_in_a_legacy_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    write_legacy(root, [mcore_state_dict(r) for r in range(2)])
    rank_file = root / "iter_0000001/mp_rank_01/model_optim_rng.pt"
    payload = torch.load(rank_file, weights_only=True)
    model = payload["model"]
    model["decoder.layers.1.mlp.linear_fc1.weight"][0, 0] += 1  # changed bytes
    model["embedding.ln_pre.weight"] = model["embedding.ln_pre.weight"].to(torch.float64)  # changed dtype
    del model["decoder.layers.0.mlp.linear_fc2.weight"]  # missing
    model["surprise"] = torch.ones(2)  # unexpected
    torch.save(payload, rank_file)

    report = verify(root)
    assert not report.ok
    found = sorted((p.key, p.message.split(" ")[0]) for p in report.problems)
    assert found == [
        ("decoder.layers.0.mlp.linear_fc2.weight", "missing"),
        ("decoder.layers.1.mlp.linear_fc1.weight", CHECKSUM_ALGORITHM),
        ("embedding.ln_pre.weight", "dtype"),
        ("surprise", "tensor"),
    ]
    assert all(p.file == "iter_0000001/mp_rank_01/model_optim_rng.pt" for p in report.problems)
    assert "4 problem(s)" in str(report)

    (root / "iter_0000001/mp_rank_00/model_optim_rng.pt").unlink()
    report = verify(root)
    assert any(p.file.endswith("mp_rank_00/model_optim_rng.pt") and "missing" in p.message for p in report.problems)


def test_verify_hf_checkpoint_and_corruption(tmp_path):
    state = mcore_state_dict()
    root = tmp_path / "hf"
    write_hf(root, state, max_shard_size=4000, extra_files={"config.json": "{}"},
             provenance=Provenance(family="toy", source_layout="mcore_legacy"))
    assert "model.safetensors.index.json" in entries(root) and (root / "config.json").read_text() == "{}"
    assert verify(root).ok
    assert read_manifest(root).layout == "hf_safetensors"

    index = json.loads((root / "model.safetensors.index.json").read_text())
    victim_file = index["weight_map"]["decoder.layers.2.mlp.linear_fc1.weight"]
    blob = bytearray((root / victim_file).read_bytes())
    needle = state["decoder.layers.2.mlp.linear_fc1.weight"].contiguous().view(torch.uint8).numpy().tobytes()
    position = bytes(blob).index(needle) + 7
    blob[position] ^= 0x01  # one flipped bit inside the tensor's bytes
    (root / victim_file).write_bytes(bytes(blob))
    report = verify(root)
    assert [(p.key, p.message) for p in report.problems] == [
        ("decoder.layers.2.mlp.linear_fc1.weight", f"{CHECKSUM_ALGORITHM} of the bytes differs")
    ]

    (root / victim_file).write_bytes(bytes(blob[:-10]))  # truncated shard
    report = verify(root)
    assert len(report.problems) == 1 and report.problems[0].key is None and "unreadable" in report.problems[0].message


def test_verify_without_manifest_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="not written by mmparity"):
        verify(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable manifest"):
        verify(tmp_path)


def test_write_hf_failure_leaves_nothing(tmp_path):
    def tensors():
        yield "a", seeded((4, 4), 1)
        raise RuntimeError("converter failed halfway")

    with pytest.raises(RuntimeError, match="halfway"):
        write_hf(tmp_path / "hf", tensors(), max_shard_size=10)
    with pytest.raises(CheckpointError, match="plain, unused file name"):
        write_hf(tmp_path / "hf", {"a": torch.ones(1)}, extra_files={MANIFEST_FILE: "{}"})
    assert entries(tmp_path) == []


# --------------------------------------------------------------------------------------------------
# torch_dist under gloo (real megatron-core model, 1 and 2 processes)


def _build_encoder():
    """A megatron-core TransformerBlock (local spec) that can be built and run on CPU.

    mcore's local DotProductAttention allocates on CUDA, so the spec gets a small core attention
    of our own; it has no parameters, so the checkpoint is the same as with the stock one.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_block import TransformerBlock

    class CpuCoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
            super().__init__(config=config)

        def forward(self, query, key, value, attention_mask, **kwargs):
            # [s, b, heads, d] -> [s, b, heads * d]; GQA groups repeated to the query heads.
            repeat = query.shape[2] // key.shape[2]
            key, value = (t.repeat_interleave(repeat, dim=2) for t in (key, value))
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            return out.permute(2, 0, 1, 3).flatten(2)

    config = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=16,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=24,
        gated_linear_unit=True,
        add_bias_linear=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = CpuCoreAttention

    class Encoder(MegatronModule):
        def __init__(self):
            super().__init__(config=config)
            self.decoder = TransformerBlock(config, spec)

    return Encoder()


def _fill(model, seed: int) -> None:
    """Seeded non-constant values; TP-split params differ per rank, replicated ones agree."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            split = getattr(param, "tensor_model_parallel", False)
            param.copy_(seeded(param.shape, stable_seed(seed, name, tp_rank if split else -1)))


def _tp_axis(name: str) -> int | None:
    if "linear_qkv." in name or "linear_fc1." in name:
        return 0
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        return 1
    return None  # norms and row-parallel biases are replicated


def _merge_tp(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    axis = _tp_axis(name)
    if axis is None:
        return parts[0]
    if "linear_fc1." in name:  # swiglu: every rank holds [gate_r; up_r]; the whole is [gate; up]
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=axis)


def _split_tp(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    axis = _tp_axis(name)
    if axis is None:
        return full
    if "linear_fc1." in name:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=axis)[rank]


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _load_into(model, root):
    from mmparity.megatron.torch_dist import load_torch_dist

    loaded = load_torch_dist(root, model.sharded_state_dict())
    model.load_state_dict(loaded)


def _expect_everywhere(error_match: str, fn) -> None:
    with pytest.raises(CheckpointError, match=error_match):
        fn()


def _two_rank_worker(rank: int, world_size: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mmparity.megatron.torch_dist import save_torch_dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    out = Path(out)
    try:
        # 1. TP=2: write A, and work out the TP=1 tensors it must contain.
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        model = _build_encoder()
        _fill(model, seed=1)
        save_torch_dist(out / "A", model.sharded_state_dict, iteration=7,
                        provenance=Provenance(family="toy-block", source_layout="test"))
        local = _params(model)
        every_rank: list = [None] * world_size
        dist.all_gather_object(every_rank, local)
        expected_a = {k: _merge_tp(k, [r[k] for r in every_rank]) for k in local}
        if rank == 0:
            torch.save(expected_a, out / "expected_A.pt")
            torch.save(every_rank, out / "tp2_locals_A.pt")

        # Failures are raised on every rank and leave nothing behind.
        _expect_everywhere("already exists", lambda: save_torch_dist(out / "A", model.sharded_state_dict()))

        def fails_on_rank_1():
            if rank == 1:
                raise RuntimeError("model could not be built")
            return model.sharded_state_dict()

        _expect_everywhere("rank 1: RuntimeError: model could not be built",
                           lambda: save_torch_dist(out / "bad1", fails_on_rank_1))

        def overlapping_replicas():
            state = model.sharded_state_dict()
            norm = state["decoder.layers.0.input_layernorm.weight"]
            norm.replica_id = (0, 0, 0)  # both TP ranks now claim to be the main copy
            return state

        _expect_everywhere("sharding validation failed", lambda: save_torch_dist(out / "bad2", overlapping_replicas))

        # 2. TP=1 (two data-parallel replicas): load A, which was written at TP=2.
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        model = _build_encoder()
        _fill(model, seed=99)  # anything but A's values
        _load_into(model, out / "A")
        got = _params(model)
        for name, expected in expected_a.items():
            assert got[name].dtype == expected.dtype and torch.equal(got[name], expected), name

        # 3. TP=1 writes B (replicas de-duplicated); TP=2 loads it and gets its own slices.
        _fill(model, seed=2)
        full_b = _params(model)
        save_torch_dist(out / "B", model.sharded_state_dict(), iteration=3,
                        content_metadata={"singleton_local_shards": False})
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        model = _build_encoder()
        _fill(model, seed=98)
        _load_into(model, out / "B")
        got = _params(model)
        for name, full in full_b.items():
            expected = _split_tp(name, full, rank, 2)
            assert torch.equal(got[name], expected), name
        if rank == 0:
            torch.save(full_b, out / "expected_B.pt")
        dist.barrier()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _one_rank_worker(rank: int, world_size: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mmparity.megatron.torch_dist import save_torch_dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    out = Path(out)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        # A single process loads the TP=2 checkpoint ...
        model = _build_encoder()
        _fill(model, seed=97)
        _load_into(model, out / "A")
        expected_a = torch.load(out / "expected_A.pt", weights_only=True)
        for name, value in _params(model).items():
            assert torch.equal(value, expected_a[name]), name
        # ... and round-trips one of its own, forward pass included.
        _fill(model, seed=5)
        before = _params(model)
        hidden = seeded((5, 2, 16), 11)
        output = model.decoder(hidden, attention_mask=None)
        save_torch_dist(out / "C", model.sharded_state_dict(), iteration=1)
        reloaded = _build_encoder()
        _fill(reloaded, seed=96)
        _load_into(reloaded, out / "C")
        for name, value in _params(reloaded).items():
            assert torch.equal(value, before[name]), name
        assert torch.equal(reloaded.decoder(hidden, attention_mask=None), output)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _spawn(worker, world_size: int, tmp: Path, out: Path) -> None:
    import torch.multiprocessing as mp

    store = tmp / f"store-{worker.__name__}"
    mp.spawn(worker, args=(world_size, str(store), str(out)), nprocs=world_size, join=True)


@pytest.fixture(scope="module")
def torch_dist_checkpoints(tmp_path_factory):
    """Runs the 2-process scenario once; later tests inspect its checkpoints."""
    pytest.importorskip("megatron.core")
    out = tmp_path_factory.mktemp("torch_dist")
    _spawn(_two_rank_worker, 2, tmp_path_factory.mktemp("store"), out)
    return out


def _te_spelling(name: str) -> str:
    return (name.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
                .replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))


@pytest.mark.slow
def test_torch_dist_tp2_write_reloads_at_tp1_and_back(torch_dist_checkpoints):
    out = torch_dist_checkpoints
    # The worker asserted bit-exact loads at the other TP size; here: the layout on disk.
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".pt")) == ["A", "B"]  # no failed leftovers
    assert entries(out / "A") == sorted(["iter_0000007", "latest_checkpointed_iteration.txt", MANIFEST_FILE])
    assert (out / "A/latest_checkpointed_iteration.txt").read_text().strip() == "7"
    files = entries(out / "A/iter_0000007")
    assert {".metadata", "metadata.json"} <= set(files) and sum(f.endswith(".distcp") for f in files) == 2
    assert json.loads((out / "A/iter_0000007/metadata.json").read_text())["sharded_backend"] == "torch_dist"
    manifest = read_manifest(out / "A")
    assert (manifest.layout, manifest.tensor_parallel_size, manifest.iteration) == ("mcore_torch_dist", 2, 7)
    assert manifest.provenance.family == "toy-block"
    # mcore < 0.19 needs common.pt (0.19 reads it too): present whichever version wrote.
    assert torch.load(out / "A/iter_0000007/common.pt", weights_only=True) == {"checkpoint_version": 3.0, "iteration": 7}
    common_b = torch.load(out / "B/iter_0000003/common.pt", weights_only=True)
    assert common_b["content_metadata"] == {"singleton_local_shards": False}


@pytest.mark.slow
def test_torch_dist_global_tensors_are_the_tp1_state_dict(torch_dist_checkpoints):
    out = torch_dist_checkpoints
    for name in ("A", "B"):
        expected = {_te_spelling(k): v for k, v in torch.load(out / f"expected_{name}.pt", weights_only=True).items()}
        iteration = {"A": "iter_0000007", "B": "iter_0000003"}[name]
        assert_same_tensors(global_state_dict(out / name / iteration), expected)


@pytest.mark.slow
def test_torch_dist_regions_map_in_place_and_match_dcps_reader(torch_dist_checkpoints, monkeypatch):
    from mmparity.io.torch_dist_files import TorchDistFiles

    files = TorchDistFiles(torch_dist_checkpoints / "A" / "iter_0000007")
    mapped = {}
    for key, (_dtype, shape) in files.tensors.items():
        for chunk in files.metadata.state_dict_metadata[key].chunks:
            region = (key, tuple(chunk.offsets), tuple(chunk.sizes))
            mapped[region] = files.read_region(*region)
    # Our writer aligns every tensor's bytes, so each saved chunk is a view of the file.
    assert all(not t.untyped_storage().resizable() for t in mapped.values())
    monkeypatch.setattr(TorchDistFiles, "_mapped_chunk", lambda *args: None)
    for region, tensor in mapped.items():
        assert torch.equal(files.read_region(*region), tensor), region


@pytest.mark.slow
def test_torch_dist_verify_and_corruption(torch_dist_checkpoints, tmp_path):
    import shutil

    for name in ("A", "B"):
        report = verify(torch_dist_checkpoints / name)
        assert report.ok, str(report)
    # TP=2 wrote 2 shards of every split tensor per layer; checksums are per written shard.
    assert verify(torch_dist_checkpoints / "A").checked > verify(torch_dist_checkpoints / "B").checked

    root = tmp_path / "A"
    shutil.copytree(torch_dist_checkpoints / "A", root)
    locals_a = torch.load(torch_dist_checkpoints / "tp2_locals_A.pt", weights_only=True)
    victim = locals_a[1]["decoder.layers.2.mlp.linear_fc2.weight"]  # TP rank 1's shard, layer 2
    needle = victim.contiguous().view(torch.uint8).numpy().tobytes()
    for shard_file in sorted((root / "iter_0000007").glob("*.distcp")):
        blob = bytearray(shard_file.read_bytes())
        position = bytes(blob).find(needle)
        if position >= 0:
            blob[position + 5] ^= 0x10
            shard_file.write_bytes(bytes(blob))
            break
    else:
        pytest.fail("shard bytes not found in any .distcp file")
    report = verify(root)
    assert {p.key for p in report.problems} == {"decoder.layers.mlp.linear_fc2.weight"}
    (root / "iter_0000007" / ".metadata").write_bytes(b"garbage")
    report = verify(root)
    assert len(report.problems) == 1 and "not checked" in report.problems[0].message


@pytest.mark.slow
def test_torch_dist_single_process_loads_tp2_checkpoint_and_round_trips(torch_dist_checkpoints, tmp_path):
    _spawn(_one_rank_worker, 1, tmp_path, torch_dist_checkpoints)
    assert verify(torch_dist_checkpoints / "C").ok


def test_torch_dist_needs_a_process_group(tmp_path):
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    from mmparity.megatron.torch_dist import load_torch_dist, save_torch_dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(CheckpointError, match="torch.distributed initialised"):
        save_torch_dist(tmp_path / "x", {})
    with pytest.raises(CheckpointError, match="torch.distributed initialised"):
        load_torch_dist(tmp_path / "x", {})
    assert entries(tmp_path) == []


def test_reading_torch_dist_needs_no_megatron(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys, mmparity.io, mmparity.io.torch_dist_files, mmparity.io.legacy;"
        "assert 'megatron' not in sys.modules, 'megatron imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_a_mapped_rank_file_stays_mapped_while_its_bytes_are_located(tmp_path):
    """A legacy source maps each rank file and registers the mapping, so that its writers copy
    bytes file to file. A rank file whose tensors a merge drops (another EP rank's replicated
    copies) must stay mapped while registered: freed, its addresses are reused by the next file
    mapped, and the copy reads the wrong file (an export of TP 2 x PP 4 x EP 2 gave other tensors'
    bytes, differently on every run)."""
    import gc
    import os

    from mmparity.io.fsio.pieces import FileRanges
    from mmparity.io.legacy import load_rank_file

    paths = []
    for name, value in (("a", 1.0), ("b", 2.0)):
        state = {f"w{i}": torch.full((64, 64), value + i) for i in range(8)}
        torch.save({"model": state, "checkpoint_version": 3.0}, tmp_path / f"{name}.pt")
        paths.append(tmp_path / f"{name}.pt")
    ranges = FileRanges()
    first = load_rank_file(paths[0], mmap=True, file_ranges=ranges)
    del first  # the tensors a merge would not keep
    gc.collect()
    second = load_rank_file(paths[1], mmap=True, file_ranges=ranges)
    for key, tensor in second.items():
        fd, offset = ranges.locate(tensor)
        assert os.pread(fd, tensor.numel() * tensor.element_size(), offset) == tensor.numpy().tobytes(), key
    ranges.close()
