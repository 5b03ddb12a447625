"""Expert parallelism: expert keys in both of Megatron's layouts, split over EP ranks with local
numbering and merged back, alone and composed with TP and PP; legacy rank files per (TP, PP, EP)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.legacy import load_rank_file, open_legacy, read_legacy, write_legacy
from mmparity.io.manifest import read_manifest
from mmparity.io.verify import verify
from mmparity.parallel import ep, pp, tp
from mmparity.parallel.axes import AxisError, Grid, expert_axis
from mmparity.errors import ConversionError

ROOT = "language_model."
LAYERS = f"{ROOT}decoder.layers."
HIDDEN, FFN, SHARED_FFN, VOCAB = 6, 10, 4, 14  # not powers of two; TP 2 divides the cut dims


def moe_state(seed: int, layers: int = 3, experts: int = 4, layout: str = ep.GROUPED, bias: bool = False) -> dict:
    """A whole (TP 1, globally numbered) mcore state: a dense layer 0, MoE layers 1..layers-1."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    state = {f"{ROOT}embedding.word_embeddings.weight": rand(VOCAB, HIDDEN)}
    for layer in range(layers):
        at = f"{LAYERS}{layer}."
        state[f"{at}self_attention.linear_qkv.layer_norm_weight"] = rand(HIDDEN)
        state[f"{at}self_attention.linear_qkv.weight"] = rand(3 * HIDDEN, HIDDEN)
        state[f"{at}self_attention.linear_proj.weight"] = rand(HIDDEN, HIDDEN)
        if layer == 0:
            state[f"{at}mlp.linear_fc1.layer_norm_weight"] = rand(HIDDEN)
            state[f"{at}mlp.linear_fc1.weight"] = rand(2 * FFN, HIDDEN)
            state[f"{at}mlp.linear_fc2.weight"] = rand(HIDDEN, FFN)
            continue
        state[f"{at}pre_mlp_layernorm.weight"] = rand(HIDDEN)
        state[f"{at}mlp.router.weight"] = rand(experts, HIDDEN)
        state[f"{at}mlp.router.expert_bias"] = rand(experts)
        state[f"{at}mlp.shared_experts.linear_fc1.weight"] = rand(2 * SHARED_FFN, HIDDEN)
        state[f"{at}mlp.shared_experts.linear_fc2.weight"] = rand(HIDDEN, SHARED_FFN)
        for e in range(experts):
            tensors = {"linear_fc1.weight": rand(2 * FFN, HIDDEN, dtype=torch.bfloat16),
                       "linear_fc2.weight": rand(HIDDEN, FFN, dtype=torch.bfloat16)}
            if bias:
                tensors |= {"linear_fc1.bias": rand(2 * FFN), "linear_fc2.bias": rand(HIDDEN)}
            for rest, value in tensors.items():
                state[ep.ExpertKey(f"{at}mlp.experts.", e, rest, layout).spell()] = value
    state[f"{ROOT}decoder.final_layernorm.weight"] = rand(HIDDEN)
    state[f"{ROOT}output_layer.weight"] = rand(VOCAB, HIDDEN)
    return state


def tp_kind(key: str) -> str:
    """The TP kind a rule table gives each tensor of ``moe_state`` (experts: gated fc1, row fc2)."""
    parsed = ep.parse_expert_key(key)
    name = f"mlp.experts.{parsed.rest}" if parsed else key
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return "gated"
    if name.endswith(("linear_fc2.weight", "linear_proj.weight")):
        return "row"
    if name.endswith("linear_qkv.weight"):
        return "qkv"
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return "vocab"
    return "replicated"


def equal_states(a: dict, b: dict) -> bool:
    return list(a) == list(b) or set(a) == set(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype
                                                          for k in a)


def assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:8]
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def split_grid(state: dict, grid: Grid, num_experts: int) -> dict:
    """Whole state -> {(tp, pp, ep): locally numbered state}, as Megatron's rank files hold it."""
    counts = pp.buildable_layer_counts(len(pp.layer_stacks(list(state))[LAYERS]), grid.pp.size)
    out = {}
    for t in range(grid.tp.size):
        shard = {k: tp.shard(v, tp_kind(k), grid.tp.size)[t] for k, v in state.items()}
        stages = pp.split_pipeline_stages(shard, counts, layer_prefix=LAYERS,
                                          last_stage_prefixes=(f"{ROOT}decoder.final_layernorm.", f"{ROOT}output_layer."))
        for p, stage in enumerate(stages):
            for e, part in enumerate(ep.split_expert_ranks(stage, grid.ep, num_experts)):
                out[t, p, e] = part
    return out, counts


def merge_grid(parts: dict, grid: Grid, counts, num_experts: int | None) -> dict:
    shards = []
    for t in range(grid.tp.size):
        stages = [ep.merge_expert_ranks([parts[t, p, e] for e in range(grid.ep.size)], num_experts)
                  for p in range(grid.pp.size)]
        shards.append(pp.merge_pipeline_stages(stages, counts, layer_prefix=LAYERS))
    return {k: tp.merge([s[k] for s in shards], tp_kind(k)) for k in shards[0]}


# --- pure: keys -----------------------------------------------------------------------------------


def test_expert_keys_parse_in_both_layouts():
    grouped = ep.parse_expert_key(f"{LAYERS}3.mlp.experts.linear_fc1.weight12")
    assert grouped == ep.ExpertKey(f"{LAYERS}3.mlp.experts.", 12, "linear_fc1.weight", ep.GROUPED)
    sequential = ep.parse_expert_key(f"{LAYERS}3.mlp.experts.local_experts.12.linear_fc2.bias")
    assert sequential == ep.ExpertKey(f"{LAYERS}3.mlp.experts.", 12, "linear_fc2.bias", ep.SEQUENTIAL)
    assert grouped.layer == f"{LAYERS}3"
    assert sequential.spell(ep.GROUPED, 1) == f"{LAYERS}3.mlp.experts.linear_fc2.bias1"
    for replicated in ("mlp.router.weight", "mlp.router.expert_bias", "mlp.shared_experts.linear_fc1.weight",
                       "mlp.shared_experts.linear_fc2.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight",
                       "mlp.experts.linear_fc1._extra_state"):
        assert not ep.is_expert_key(f"{LAYERS}1.{replicated}"), replicated


@pytest.mark.parametrize("layout", ep.LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_respell_round_trips(layout, bias):
    state = moe_state(1, experts=6, layout=layout, bias=bias)
    other = ep.SEQUENTIAL if layout == ep.GROUPED else ep.GROUPED
    respelled = ep.respell(state, other)
    assert ep.expert_key_layout(respelled) == other and ep.expert_key_layout(state) == layout
    assert sum(ep.is_expert_key(k) for k in respelled) == 2 * (2 + 2 * bias) * 6
    back = ep.respell(respelled, layout)
    assert list(back) == list(state) and all(back[k] is state[k] for k in state)
    assert ep.to_grouped(ep.to_sequential(state)).keys() == ep.to_grouped(state).keys()


def test_respell_refuses_a_clash_and_what_has_no_grouped_name():
    state = moe_state(2, layers=2, experts=4)
    state[f"{LAYERS}1.mlp.experts.local_experts.2.linear_fc1.weight"] = torch.zeros(1)
    with pytest.raises(ConversionError, match="already holds"):
        ep.to_grouped(state)
    with pytest.raises(ConversionError, match="one linear_fc1._extra_state for all"):
        ep.to_grouped({f"{LAYERS}1.mlp.experts.local_experts.0.linear_fc1._extra_state": None})


def test_expert_count_is_what_the_rule_table_names():
    assert ep.expert_count(moe_state(3, experts=6)) == 6
    assert ep.expert_count(moe_state(3, layers=1)) == 0  # dense only
    state = moe_state(3, experts=4)
    del state[f"{LAYERS}2.mlp.experts.linear_fc1.weight1"], state[f"{LAYERS}2.mlp.experts.linear_fc2.weight1"]
    with pytest.raises(ConversionError, match=r"layers\.2: no expert 1"):
        ep.expert_count(state)


# --- pure: split / merge --------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), tp_size=st.sampled_from([1, 2]), pp_size=st.sampled_from([1, 2, 3]),
       experts_and_ep=st.sampled_from([(4, 1), (4, 2), (4, 4), (6, 2), (6, 3), (6, 6)]),
       layout=st.sampled_from(ep.LAYOUTS), bias=st.booleans(), infer=st.booleans())
def test_split_merge_round_trip_over_tp_pp_ep(seed, tp_size, pp_size, experts_and_ep, layout, bias, infer):
    experts, ep_size = experts_and_ep
    state = moe_state(seed, layers=4, experts=experts, layout=layout, bias=bias)
    grid = Grid.of(tp_size, pp_size, ep_size)
    assert grid.problems(experts) == []
    parts, counts = split_grid(state, grid, experts)
    assert len(parts) == len(grid.ranks())
    per_rank = experts // ep_size
    for (t, p, e), part in parts.items():
        held = {(k.layer, k.expert) for k in map(ep.parse_expert_key, part) if k}
        assert {expert for _, expert in held} <= set(range(per_rank))  # local numbering
        assert all(k in part for k in parts[t, p, 0] if not ep.is_expert_key(k))  # replicated
    merged = merge_grid(parts, grid, counts, None if infer else experts)
    assert_same(merged, state)


@pytest.mark.parametrize("layout", ep.LAYOUTS)
def test_ep_rank_holds_its_global_experts_as_local_ones(layout):
    state = moe_state(4, experts=6, layout=layout)
    ranks = ep.split_expert_ranks(state, expert_axis(3), 6)
    for rank, part in enumerate(ranks):
        for local in range(2):
            key = ep.ExpertKey(f"{LAYERS}1.mlp.experts.", local, "linear_fc2.weight", layout).spell()
            assert part[key] is state[ep.ExpertKey(f"{LAYERS}1.mlp.experts.", 2 * rank + local,
                                                   "linear_fc2.weight", layout).spell()]
        assert part[f"{LAYERS}1.mlp.router.weight"] is state[f"{LAYERS}1.mlp.router.weight"]
        assert not any(f"weight{i}" in k or f"local_experts.{i}." in k for k in part for i in (2, 3, 4, 5))
    assert ep.split_expert_ranks(state, 1, 6) == [state]


def test_a_deleted_duplicated_or_renumbered_expert_is_one_error_naming_each():
    state = moe_state(5, layers=4, experts=6)
    del state[f"{LAYERS}1.mlp.experts.linear_fc1.weight4"]  # deleted (one of its tensors)
    for rest in ("linear_fc1.weight", "linear_fc2.weight"):  # renumbered: 5 -> 9 in layer 2
        state[f"{LAYERS}2.mlp.experts.{rest}9"] = state.pop(f"{LAYERS}2.mlp.experts.{rest}5")
    state[f"{LAYERS}3.mlp.experts.local_experts.0.linear_fc2.weight"] = state[f"{LAYERS}3.mlp.experts.linear_fc2.weight0"]
    with pytest.raises(ConversionError) as caught:
        ep.split_expert_ranks(state, 2, 6)
    problems = caught.value.problems
    assert any(f"{LAYERS}1: expert 4 lacks linear_fc1.weight" in p for p in problems), problems
    assert any(f"{LAYERS}2: expert 9" in p and "outside the 6 experts" in p for p in problems), problems
    assert any(f"{LAYERS}2: expert 5 is missing" in p for p in problems), problems
    assert any(f"{LAYERS}3: expert 0 linear_fc2.weight appears 2 times" in p for p in problems), problems
    assert len(problems) == 4, problems


def test_merge_names_every_bad_expert_and_replica_at_once():
    ranks = ep.split_expert_ranks(moe_state(6, experts=4), 2, 4)
    # EP rank 1: its local expert 1 of layer 1 renumbered 1 -> 2 (beyond its share of 2) ...
    for rest in ("linear_fc1.weight", "linear_fc2.weight"):
        ranks[1][f"{LAYERS}1.mlp.experts.{rest}2"] = ranks[1].pop(f"{LAYERS}1.mlp.experts.{rest}1")
    # ... layer 2's expert 0 on rank 0 deleted, and a replicated tensor that differs on rank 1.
    del ranks[0][f"{LAYERS}2.mlp.experts.linear_fc1.weight0"], ranks[0][f"{LAYERS}2.mlp.experts.linear_fc2.weight0"]
    router = f"{LAYERS}2.mlp.router.weight"
    ranks[1][router] = ranks[1][router].clone()
    ranks[1][router][0, 0] += 1
    with pytest.raises(ConversionError) as caught:
        ep.merge_expert_ranks(ranks, 4)
    problems = caught.value.problems
    assert any("EP rank 1 holds local expert 2" in p and f"{LAYERS}1" in p for p in problems), problems
    assert any(f"{LAYERS}1: expert 3 is missing" in p for p in problems), problems
    assert any(f"{LAYERS}2: expert 0 is missing" in p for p in problems), problems
    assert any(router in p and "EP rank 1 holds other values" in p for p in problems), problems
    assert len(problems) == 4, problems


def test_merge_refuses_a_replicated_tensor_missing_from_a_rank():
    ranks = ep.split_expert_ranks(moe_state(7, experts=4), 2, 4)
    del ranks[1][f"{ROOT}output_layer.weight"]
    with pytest.raises(ConversionError, match=r"output_layer.weight: replicated over EP, but absent from EP rank\(s\) 1"):
        ep.merge_expert_ranks(ranks)


def test_ep_not_dividing_the_experts_is_one_line():
    with pytest.raises(AxisError) as caught:
        ep.split_expert_ranks(moe_state(8, experts=6), 4, 6)
    assert str(caught.value) == "--ep 4 does not divide the 6 experts"
    assert Grid.of(ep=4).problems(6) == ["--ep 4 does not divide the 6 experts"]


def test_ep_without_experts_is_one_line():
    assert Grid.of(ep=2).problems(0, "llava") == [
        "--ep 2: no experts in family llava (expert parallelism splits MoE experts)"]
    assert Grid.of(tp=2, pp=2).problems() == [] and Grid.of(ep=2).problems(4) == []


# --- legacy rank files ----------------------------------------------------------------------------


def write_tp_shards(root, state, grid: Grid, **kwargs):
    shards = [{k: tp.shard(v, tp_kind(k), grid.tp.size)[t] for k, v in state.items()} for t in range(grid.tp.size)]
    write_legacy(root, shards, pp_size=grid.pp.size, ep_size=grid.ep.size, layer_prefix=LAYERS,
                 last_stage_prefixes=(f"{ROOT}decoder.final_layernorm.", f"{ROOT}output_layer."), **kwargs)
    return shards


@pytest.mark.parametrize("layout", ep.LAYOUTS)
@pytest.mark.parametrize("sizes, names", [
    ((1, 1, 2), ["mp_rank_00_000", "mp_rank_00_001"]),
    ((2, 1, 2), ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]),
    ((1, 2, 2), ["mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"]),
])
def test_legacy_rank_files_per_tp_pp_ep_round_trip(tmp_path, sizes, names, layout):
    grid = Grid.of(*sizes)
    state = moe_state(9, layers=3, experts=4, layout=layout, bias=layout == ep.SEQUENTIAL)
    root = tmp_path / "ckpt"
    shards = write_tp_shards(root, state, grid)
    assert sorted(p.name for p in (root / "iter_0000001").iterdir()) == names
    manifest = read_manifest(root)
    assert (manifest.tensor_parallel_size, manifest.pipeline_parallel_size, manifest.expert_parallel_size) == sizes
    checkpoint = open_legacy(root)
    assert (checkpoint.tp_size, checkpoint.pp_size, checkpoint.ep_size) == sizes
    # The last EP rank's file of the last stage: experts 2 and 3 as local 0 and 1, the router whole.
    last = load_rank_file(checkpoint.files[0, grid.pp.size - 1, 1])
    local_layer = 2 if grid.pp.size == 1 else 0  # global layer 2 (stage 1 of [2, 1] holds it as 0)
    for local, expert in ((0, 2), (1, 3)):
        key = ep.ExpertKey(f"{LAYERS}{local_layer}.mlp.experts.", local, "linear_fc2.weight", layout).spell()
        source = ep.ExpertKey(f"{LAYERS}2.mlp.experts.", expert, "linear_fc2.weight", layout).spell()
        assert torch.equal(last[key], shards[0][source])
    assert not any(k.endswith("weight2") or ".local_experts.2." in k for k in last)
    assert torch.equal(last[f"{LAYERS}{local_layer}.mlp.router.weight"], state[f"{LAYERS}2.mlp.router.weight"])
    for back, shard in zip(checkpoint.tp_shards(layer_prefix=LAYERS), shards):
        assert_same(back, shard)
    assert verify(root).ok
    assert "ep=2" in str(verify(root))


def test_legacy_reader_merges_experts_and_checks_them(tmp_path):
    root = tmp_path / "ckpt"
    write_tp_shards(root, moe_state(10, experts=4), Grid.of(1, 1, 2))
    rank_file = root / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt"
    payload = torch.load(rank_file, weights_only=True)
    del payload["model"][f"{LAYERS}1.mlp.experts.linear_fc1.weight1"]
    torch.save(payload, rank_file)
    with pytest.raises(CheckpointError, match=rf"{LAYERS}1: expert 3 lacks linear_fc1.weight"):
        read_legacy(root, num_experts=4)


def test_legacy_writer_refuses_ep_without_experts_or_not_dividing(tmp_path):
    with pytest.raises(CheckpointError, match="no experts in family"):
        write_tp_shards(tmp_path / "a", moe_state(11, layers=1), Grid.of(ep=2))
    with pytest.raises(CheckpointError, match="--ep 4 does not divide the 6 experts"):
        write_tp_shards(tmp_path / "b", moe_state(11, experts=6), Grid.of(ep=4))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# --- Megatron's own MoE layers under runtime.init_parallel(ep=...) ---------------------------------


def _megatron_moe_block(rank: int, world_size: int, grouped: bool) -> dict:
    """On each of ``world_size`` gloo ranks at EP = world size: a 2-layer mcore block whose
    layers are MoE (4 experts); what its state dict and sharded state dict hold."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mmparity.parallel import runtime

    layout = runtime.init_parallel(1, 1, ep=world_size)
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN,
                               num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=FFN, gated_linear_unit=True,
                               add_bias_linear=False, expert_model_parallel_size=world_size,
                               use_cpu_initialization=True, moe_grouped_gemm=False)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    block = TransformerBlock(config, spec, post_layer_norm=False)
    sharded = block.sharded_state_dict(prefix="decoder.")
    offsets = {key: (entry.key, tuple(entry.global_offset), tuple(entry.global_shape))
               for key, entry in sharded.items() if ".experts." in key and hasattr(entry, "global_offset")}
    keys = [k for k in block.state_dict(prefix="decoder.") if not k.endswith("_extra_state")]
    return {"ep": layout.ep, "keys": keys, "offsets": offsets}


@pytest.mark.slow
def test_megatron_moe_layers_built_at_ep_2_hold_what_split_expert_ranks_gives_them():
    results = __import__("mmparity.parallel.runtime", fromlist=["spawn"]).spawn(_megatron_moe_block, 2, False)
    # The whole model's keys, globally numbered, are rank 0's with its experts 0..1 as 0..3.
    whole = {}
    for key in results[0]["keys"]:
        parsed = ep.parse_expert_key(key)
        for expert in (range(4) if parsed else [None]):
            whole[parsed.spell(expert=expert) if parsed else key] = None
    assert ep.expert_count(whole) == 4
    for rank, (result, split) in enumerate(zip(results, ep.split_expert_ranks(whole, 2, 4))):
        assert result["ep"] == 2
        assert sorted(result["keys"]) == sorted(split), rank  # Megatron's own local numbering
        # ... and its sharded state dict places local expert i at global offset 2·rank + i.
        checked = 0
        for key, (sharded_key, offset, shape) in result["offsets"].items():
            parsed = ep.parse_expert_key(key)
            if parsed is None or not parsed.rest.endswith("weight"):
                continue
            checked += 1
            assert sharded_key == "decoder.layers.mlp.experts.experts." + parsed.rest
            assert shape[:2] == (2, 4) and offset[1] == 2 * rank + parsed.expert, (key, offset)
        assert checked == 2 * 2, result["offsets"]  # fc2 of 2 local experts x 2 layers (fc1: a factory)


@pytest.mark.parametrize("moe_layer_freq", [[0, 1, 1], 1])
def test_torch_dist_expert_tensors_are_read_back_per_layer_and_expert(tmp_path, moe_layer_freq):
    """Megatron's MoE block saved as torch_dist (its sharded state dict at EP 1: global experts on
    a stacked expert axis, and a stacked layer axis unless dense layers come first), read back one
    (layer, expert) at a time under the per-expert keys, bit-exact."""
    from mmparity.parallel import runtime
    from mmparity.io.formats.torch_dist import torch_dist_index
    from mmparity.megatron.torch_dist import save_torch_dist
    from mmparity.io.torch_dist_files import TorchDistFiles
    from mmparity.mapping.rules import to_te_spelling

    with runtime.parallel_context(1, 1):
        # Dense layer 0, MoE 1 and 2: mcore's per-layer specs, and per-layer sharded keys.
        block = mcore_moe_block(moe_layer_freq)
        # mcore's local spec saves its MoE layers' pre-MLP norm under TE's fused name all the same.
        state = {k.replace(".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_"): v
                 for k, v in to_te_spelling({k: v for k, v in block.state_dict(prefix="decoder.").items()
                                             if isinstance(v, torch.Tensor)}).items()}
        save_torch_dist(tmp_path / "ckpt", block.sharded_state_dict(prefix="decoder."), grid=Grid.of())
    files = TorchDistFiles(tmp_path / "ckpt" / "iter_0000001")
    index = torch_dist_index(files, list(state))
    assert set(index) == set(state)
    assert ep.expert_count(index) == 6
    for key, (ckpt_key, position, meta) in index.items():
        if position is None:
            t = files.read(ckpt_key)
        else:
            t = files.read_region(ckpt_key, position + (0,) * len(meta.shape),
                                  (1,) * len(position) + meta.shape).reshape(meta.shape)
        assert torch.equal(t, state[key]), key


# --- end to end: the tiny whole Kimi-K2.5 through convert --ep 2 and back ------------------------


@pytest.fixture(scope="module")
def kimi_hf(tmp_path_factory):
    """The tiny whole Kimi-K2.5 as an HF directory of its module names (transformers'
    save_pretrained renames them, see the family's refusal), seeded random weights, sharded."""
    from mmparity.models import registry as families
    from mmparity.models.core.inputs import random_like_state
    from mmparity.io.fsio.safetensors_write import save_safetensors_checkpoint

    family = families.get("kimi_k25_vl")
    cfg = family.tiny_config()
    model = family.build_reference(cfg)
    path = tmp_path_factory.mktemp("kimi") / "hf"
    save_safetensors_checkpoint(path, random_like_state(model.state_dict(), seed=3), max_shard_size="40KB",
                                extra_files={"config.json": cfg.to_json_string()})
    return path


@pytest.mark.parametrize("fmt, tp_size", [("legacy", 1), ("legacy", 2), ("torch_dist", 1), ("torch_dist", 2)])
def test_kimi_k25_vl_converts_at_ep_2_and_back_bit_exact(kimi_hf, tmp_path, fmt, tp_size, capsys, monkeypatch):
    from mmparity.cli.main import main
    from tests.mapping.test_convert_roundtrips import assert_same_checkpoint

    if fmt == "torch_dist" and not torch.cuda.is_available():
        # The torch_dist writer builds the native model on the meta device, where
        # native.deepseek_v3.host_placement (CPU only) leaves mcore's torch.cuda.current_device()
        # calls unpatched; until it covers meta too, the test names the CPU itself.
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["convert", "--src", str(kimi_hf), "--dst", str(mcore), "--to", "mcore", "--format", fmt,
                 "--tp", str(tp_size), "--ep", "2"]) == 0, capsys.readouterr().err
    assert f"tp={tp_size} pp=1 ep=2" in capsys.readouterr().out or fmt == "torch_dist"
    manifest = read_manifest(mcore)
    if fmt == "legacy":
        assert manifest.expert_parallel_size == 2
        names = sorted(p.name for p in (mcore / "iter_0000001").iterdir())
        assert names == [f"mp_rank_{t:02d}_{e:03d}" for t in range(tp_size) for e in range(2)]
        # Each EP rank's file holds half of every MoE layer's 6 experts, numbered from 0.
        for name in names:
            held = {(k.layer, k.expert) for k in map(ep.parse_expert_key,
                                                     load_rank_file(mcore / "iter_0000001" / name / "model_optim_rng.pt"))
                    if k is not None}
            assert held and {e for _, e in held} == {0, 1, 2}
    assert verify(mcore).ok
    assert main(["convert", "--src", str(mcore), "--dst", str(back), "--to", "hf"]) == 0, capsys.readouterr().err
    assert_same_checkpoint(back, kimi_hf)


def test_convert_ep_refuses_a_family_without_experts_and_an_ep_not_dividing(kimi_hf, tmp_path, capsys):
    from mmparity.cli.main import main
    from tests.mapping.test_convert_roundtrips import save_hf

    clip = save_hf("clip", tmp_path / "clip")
    assert main(["convert", "--src", str(clip), "--dst", str(tmp_path / "a"), "--to", "mcore", "--ep", "2"]) == 2
    assert "--ep 2: no experts in family clip" in capsys.readouterr().err
    assert main(["convert", "--src", str(kimi_hf), "--dst", str(tmp_path / "b"), "--to", "mcore", "--ep", "4",
                 "--format", "legacy"]) == 2
    err = capsys.readouterr().err
    assert "--ep 4 does not divide the 6 experts" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_torch_dist_extra_states_of_the_moe_family_are_keyed_as_mcore_keys_them():
    """The writer's empty extra states for kimi_k25_vl's non-homogeneous decoder (dense layer 0,
    MoE layers after it): every ShardedObject mcore's own modules give the native language model
    (per-layer keys, one expert axis of the global experts) comes out under the same key, shape
    and offset; beyond them only what Megatron's TE spec adds (MLA's duplicated TELinear down
    projections and its TEDotProductAttention)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    from mmparity.models import registry as families
    from mmparity.parallel import runtime
    from mmparity.megatron import mcore_compat as mc
    from mmparity.io import extra_state
    from mmparity.mapping.tables import mcore_order, tp_kinds
    from mmparity.megatron.torch_dist import extra_state_objects
    from mmparity.parallel import pp

    family = families.get("kimi_k25_vl")
    cfg = family.tiny_config()
    rules = family.rule_set(cfg, None)
    order, kinds = mcore_order(rules), tp_kinds(rules)
    with runtime.parallel_context(1, 1), torch.device("meta"):
        sharded = family.build_native(cfg).sharded_state_dict()
    per_layer = {parts[0] for entry in sharded.values() if isinstance(entry, (mc.ShardedTensor, ShardedTensorFactory))
                 and (parts := pp.layer_key_parts(entry.key)) is not None}
    assert per_layer == {"language_model.decoder.layers."}  # the vision tower's block stays stacked
    ours = extra_state_objects(extra_state.sharded_extra_state_keys({k: kinds[k] for k in order}), order, per_layer)

    def placed(objects):
        return {(o.key, tuple(o.global_shape), tuple(o.global_offset)) for o in objects
                if o.key.startswith("language_model.")}

    native = placed(v for v in sharded.values() if isinstance(v, ShardedObject) and extra_state.is_extra_state(v.key))
    written = placed(ours.values())
    assert {o.replica_id for o in ours.values()} == {(0, 0, 0)}
    experts = {(key, shape, offset) for key, shape, offset in native if ".mlp.experts.experts." in key}
    assert len(experts) == 2 * 6 * (cfg.text_config.num_hidden_layers - 1) and {s for _, s, _ in experts} == {(6,)}
    assert native <= written
    added = {key.rsplit(".", 2)[-2] for key, _, _ in written - native}
    assert added == {"linear_q_down_proj", "linear_kv_down_proj", "core_attention"}, written - native


@pytest.mark.parametrize("moe_layer_freq", [[0, 1, 1], 1])
def test_torch_dist_expert_extra_states_match_mcores_in_stacked_and_per_layer_blocks(moe_layer_freq):
    """mcore's SequentialMLP keys its experts' extra states on the global expert axis, behind the
    layer axis when the block is homogeneous: extra_state_objects places them the same way."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from mmparity.parallel import runtime
    from mmparity.megatron.torch_dist import extra_state_objects
    from mmparity.parallel import pp

    with runtime.parallel_context(1, 1):
        block = mcore_moe_block(moe_layer_freq)
        sharded = block.sharded_state_dict(prefix="decoder.")
    tensor_keys = list(block.state_dict(prefix="decoder."))
    per_layer = {parts[0] for key, v in sharded.items() if not isinstance(v, ShardedObject)
                 and (parts := pp.layer_key_parts(v.key)) is not None}
    assert bool(per_layer) == (moe_layer_freq != 1)
    native = {k: v for k, v in sharded.items() if isinstance(v, ShardedObject) and ".local_experts." in k}
    assert len(native) == 2 * 6 * (2 if moe_layer_freq != 1 else 3)
    ours = extra_state_objects(list(native), tensor_keys, per_layer)
    for key, obj in native.items():
        assert (ours[key].key, ours[key].global_shape, ours[key].global_offset, ours[key].replica_id) == \
            (obj.key, obj.global_shape, obj.global_offset, obj.replica_id), key


def mcore_moe_block(moe_layer_freq):
    """mcore's own local-spec MoE block of 3 layers and 6 experts (under a parallel context):
    non-homogeneous for a ``moe_layer_freq`` list (per-layer specs and sharded keys), stacked for 1."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=3, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN,
                               num_moe_experts=6, moe_router_topk=2, moe_ffn_hidden_size=FFN,
                               moe_layer_freq=moe_layer_freq, gated_linear_unit=True, add_bias_linear=False,
                               use_cpu_initialization=True, moe_grouped_gemm=False)
    spec = (get_gpt_decoder_block_spec(config, use_transformer_engine=False) if moe_layer_freq != 1
            else get_gpt_layer_local_spec(num_experts=6, moe_grouped_gemm=False))
    return TransformerBlock(config, spec, post_layer_norm=False)
