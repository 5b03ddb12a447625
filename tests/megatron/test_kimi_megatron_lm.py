"""Megatron's own ``GPTModel`` for Kimi-K2.5's DeepSeek-V3 language model (``kimi_k25_vl``).

Stock megatron-core's ``GPTModel`` on its own TE block spec for MLA + grouped-GEMM MoE
(``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``), built on the CPU with the
TE stand-ins: its tensor keys are the converter's mcore keys, ``check --impl megatron`` passes at
fp32 tolerance at TP 1 and 2 (and a corrupted expert is located in its layer), and ``verify
--load`` loads legacy checkpoints written at (TP, PP, EP) strictly, one rank per grid point.
Spawning cells (world > 1) are ``slow``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmparity.models import registry as families
from mmparity.parallel import runtime
from mmparity.models.registry import megatron_class
from mmparity.io.legacy import open_legacy
from mmparity.megatron.load import grid_ranks
from mmparity.parallel.axes import Grid
from mmparity.cli.main import main
from mmparity.parity import harness
from mmparity.parity.metrics import FP32_REL_L2
from mmparity.models.core import megatron_classes as models
from mmparity.models.parts.deepseek_v3 import megatron as deepseek_v3_megatron
from tests.mapping.test_convert_roundtrips import save_hf

FAMILY = "kimi_k25_vl"
GRID = [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_hf(FAMILY, tmp_path_factory.mktemp("kimi_lm") / "hf", seed=11)


@pytest.fixture(scope="module")
def legacy(hf_dir):
    made = {}

    def _legacy(tp: int, pp: int, ep: int) -> Path:
        if (tp, pp, ep) not in made:
            dst = hf_dir.parent / f"legacy_tp{tp}_pp{pp}_ep{ep}"
            argv = ["convert", "--family", FAMILY, "--src", str(hf_dir), "--dst", str(dst), "--to", "mcore",
                    "--format", "legacy", "--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--quiet"]
            assert main(argv) == 0, argv
            made[tp, pp, ep] = dst
        return made[tp, pp, ep]

    return _legacy


def test_the_record_is_stock_gptmodel_on_the_language_model_part():
    name, record = megatron_class(FAMILY)
    assert name == "GPTModel" and families.language_of(families.get(FAMILY).tiny_config()).megatron_build is deepseek_v3_megatron.build_moe_language_model
    assert record.holds == ("language_model.",) and record.root == "language_model." and record.pipelined


def test_built_from_megatrons_te_spec_with_grouped_experts():
    cfg = families.get(FAMILY).tiny_config()
    with runtime.parallel_context(1, 1):
        model = models.build(deepseek_v3_megatron.build_moe_language_model, cfg)
    assert type(model).__name__ == "GPTModel" and model.config.moe_grouped_gemm
    moe = [layer for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    dense = [layer for layer in model.decoder.layers if not hasattr(layer.mlp, "router")]
    assert moe and dense
    attention = model.decoder.layers[0].self_attention
    assert type(attention).__name__ == "MLASelfAttention"
    assert type(attention.linear_q_down_proj).__name__ == "TELinear"
    assert type(attention.linear_kv_up_proj).__name__ == "TELayerNormColumnParallelLinear"
    experts = moe[0].mlp.experts
    assert type(experts).__name__ == "TEGroupedMLP"
    assert type(experts.linear_fc1).__name__ == "TEColumnParallelGroupedLinear"
    count = cfg.text_config.n_routed_experts
    assert sorted(n for n, _ in experts.linear_fc1.named_parameters()) == sorted(f"weight{e}" for e in range(count))


def test_state_dict_is_the_converters_keys(legacy):
    """Every key and shape of the stock class is the converted checkpoint's, the empty
    ``_extra_state`` slots of MLA's projections and core attention and of ``TEGroupedMLP``'s two
    grouped linears (one each) included: nothing is filled on load."""
    cfg = families.get(FAMILY).tiny_config()
    with runtime.parallel_context(1, 1):
        model = models.build(deepseek_v3_megatron.build_moe_language_model, cfg)
    own = model.state_dict()
    stored = {k[len("language_model."):]: v for k, v in open_legacy(legacy(1, 1, 1)).load_rank(0, 0).items()
              if k.startswith("language_model.")}
    assert sorted(stored) == sorted(own)
    assert [k for k in stored if torch.is_tensor(own[k]) and own[k].shape != stored[k].shape] == []
    assert "decoder.layers.1.mlp.experts.linear_fc1._extra_state" in stored
    assert "decoder.layers.0.self_attention.linear_q_down_proj._extra_state" in stored
    assert megatron_class(FAMILY)[1].unwritten_extra_state == ()


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_check_megatron_passes(tp):
    report = harness.check(FAMILY, impl="megatron", tp=tp)
    results = [r for r in report.results if r.impl == "megatron"]
    assert {r.check for r in results} == {"text:logits", "text:token_loss"}
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in results]
    assert all(r.metrics["rel_l2"] <= FP32_REL_L2 for r in results)


def test_a_corrupted_expert_is_located_in_its_layer():
    def corrupt(shard):
        key = next(k for k in shard if "decoder.layers.2." in k and "mlp.experts.linear_fc2.weight" in k)
        shard[key] = shard[key] * 3 + 1

    report = harness.check(FAMILY, impl="megatron", mutate_native=corrupt)
    logits = next(r for r in report.results if r.impl == "megatron" and r.check == "text:logits")
    assert not logits.passed
    assert logits.first_divergence.module.startswith("language_model.decoder.layers.2"), logits.first_divergence


@pytest.mark.parametrize("tp, pp, ep", [pytest.param(*g, marks=[pytest.mark.slow] if g[0] * g[1] * g[2] > 1 else [],
                                                     id=f"tp{g[0]}-pp{g[1]}-ep{g[2]}") for g in GRID])
def test_verify_load_at_tp_pp_ep(tp, pp, ep, legacy, capsys):
    directory = legacy(tp, pp, ep)
    capsys.readouterr()
    code = main(["verify", "--load", str(directory)])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert f"TP {tp}" in out and (ep == 1 or f"EP {ep}" in out), out
    for rank in range(tp * pp * ep):
        t, p, e = grid_ranks(rank, Grid.of(tp, pp, ep))
        assert f"rank {rank}" in out and f"rank {rank} " in out.replace(":", " "), out
        line = next(line for line in out.splitlines() if line.strip().startswith(f"rank {rank} ")
                    or line.strip().startswith(f"rank {rank}:"))
        assert ": ok:" in line, line
        if ep > 1:
            assert f"EP rank {e}" in line and f"TP rank {t}" in line, line
        if pp > 1:
            assert f"PP stage {p}" in line, line
    assert "not loaded: vision_model.*, vision_projection.*" in out or models.available(), out


def test_grid_ranks_follow_mcores_order():
    """TP fastest, then the EP (data-parallel) ranks, then the pipeline stage."""
    assert [grid_ranks(r, Grid.of(2, 1, 2)) for r in range(4)] == [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)]
    assert [grid_ranks(r, Grid.of(1, 2, 2)) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]


class _Group:
    """A process group as mcore's ``get_pg_rank`` / ``get_pg_size`` read one."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("linear, tp_axis", [("TEColumnParallelGroupedLinear", 0), ("TERowParallelGroupedLinear", 1)])
def test_grouped_linear_stand_ins_shard_as_te_groups_experts(linear, tp_axis):
    """``TEGroupedLinear._sharded_state_dict_grouped``'s layout, here at EP rank 1 of 2, expert TP
    rank 1 of 2 and expert-DP rank 1 of 3: local expert ``i`` is global ``2 + i`` of 4 on an axis
    prepended after the given offsets, the weight split over expert TP on the linear's axis, one
    extra-state object per expert, and every replica id's DP part the expert-DP rank."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig
    from mmparity.models.core import te_stand_ins

    with runtime.parallel_context(1, 1):
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
        groups = ProcessGroupCollection(ep=_Group(1, 2), expt_tp=_Group(1, 2), expt_dp=_Group(1, 3))
        module = getattr(te_stand_ins, linear)(2, 8, 12, config=config, init_method=torch.nn.init.normal_,
                                               bias=False, skip_bias_add=False, is_expert=True,
                                               pg_collection=groups)
        local = (6, 8) if tp_axis == 0 else (12, 4)
        assert module.weight0.shape == local
        shards = module.sharded_state_dict("experts.fc.", sharded_offsets=((0, 3, 5),),
                                           metadata={"dp_cp_group": _Group(0, 1)})
        assert sorted(shards) == ["experts.fc._extra_state", "experts.fc._extra_state1",
                                  "experts.fc.weight0", "experts.fc.weight1"]
        for i in range(2):
            weight = shards[f"experts.fc.weight{i}"]
            assert isinstance(weight, ShardedTensor) and weight.key == "experts.fc.weight"
            assert weight.global_shape == (5, 4, 12, 8)
            offset = [3, 2 + i, 0, 0]
            offset[2 + tp_axis] = local[tp_axis]
            assert weight.global_offset == tuple(offset) and weight.local_shape == local
            assert weight.replica_id == (0, 0, 1)
            extra = shards[f"experts.fc._extra_state{i or ''}"]
            assert isinstance(extra, ShardedObject) and extra.key == "experts.fc._extra_state"
            assert (extra.global_shape, extra.global_offset) == ((5, 4), (3, 2 + i))
            assert extra.replica_id == (0, 1, 1)  # only expert TP rank 0's copy is the main one
        # a dist-checkpoint load hands back one extra state per expert; the module keeps one
        state = {**module.state_dict(), "_extra_state1": None}
        assert not module.load_state_dict(state, strict=True).unexpected_keys


def _megatron_core_load_rank(rank: int, world: int, src: str) -> dict:
    """megatron-core's own ``dist_checkpointing.load`` (what Megatron-LM's ``load_checkpoint``
    calls, sharding validation included) of the converted checkpoint at this rank of TP 2, against
    what mmparity's own strict loader gives."""
    from megatron.core import dist_checkpointing

    from mmparity.megatron import load as megatron_load
    from tests.io.test_megatron_written import cpu_stand_ins

    job = megatron_load.load_job(src, tp=world)[0]
    job.init_parallel()
    model = megatron_load._build(rank, job)[0]
    sharded = megatron_load.sharded_state_dict(model)
    down = sharded["language_model.decoder.layers.0.self_attention.linear_q_down_proj.weight"]
    asked = sum(torch.is_tensor(getattr(v, "data", None)) for v in sharded.values())
    with cpu_stand_ins():
        loaded = dist_checkpointing.load(sharded, str(Path(src) / "iter_0000001"))
    reference = megatron_load.build_and_load(rank, world, job).state_dict()
    unequal = sorted(k for k, v in loaded.items() if torch.is_tensor(v) and not torch.equal(v, reference[k]))
    return {"replica": down.replica_id, "asked": asked, "tensors": sum(torch.is_tensor(v) for v in loaded.values()),
            "unequal": unequal[:8]}


@pytest.mark.slow
def test_megatron_cores_own_torch_dist_load_of_mla_at_tp2(hf_dir, tmp_path):
    """MLA's duplicated down projections are one replica per TP rank (TE's wrapper keeps its TP
    group), so megatron-core's sharding validation takes the TP 2 load; with every rank naming
    itself replica 0 it refused it (``Invalid access pattern … linear_q_down_proj.weight``)."""
    src = tmp_path / "torch_dist"
    assert main(["convert", "--family", FAMILY, "--src", str(hf_dir), "--dst", str(src), "--to", "mcore",
                 "--format", "torch_dist", "--quiet"]) == 0
    results = runtime.spawn(_megatron_core_load_rank, 2, str(src))
    assert [r["replica"] for r in results] == [(0, 0, 0), (0, 1, 0)], results
    assert all(r["tensors"] == r["asked"] > 0 and not r["unequal"] for r in results), results


@pytest.mark.parametrize("ep, expert_groups", [(1, False), (2, True)])
def test_grouped_linear_stand_ins_mark_expert_weights_as_te_does(ep, expert_groups):
    """TE's grouped linear marks its weights for DDP and the optimizers: under expert parallelism
    they belong to the expert groups (``allreduce=False``: gradients reduced and parameters
    gathered over expert data parallelism only), and each is split along its TP axis. Unmarked,
    a distributed optimizer gathered one EP rank's experts into the other's."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig
    from mmparity.models.core import te_stand_ins

    with runtime.parallel_context(1, 1):
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4,
                                   moe_ffn_hidden_size=12, expert_model_parallel_size=ep)
        groups = ProcessGroupCollection(ep=_Group(0, ep), expt_tp=_Group(0, 1), expt_dp=_Group(0, 1))
        for linear, axis in (("TEColumnParallelGroupedLinear", 0), ("TERowParallelGroupedLinear", 1)):
            module = getattr(te_stand_ins, linear)(2, 8, 12, config=config, init_method=torch.nn.init.normal_,
                                                   bias=False, skip_bias_add=False, is_expert=True,
                                                   pg_collection=groups)
            for weight in (module.weight0, module.weight1):
                assert weight.allreduce is (not expert_groups)
                assert (weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride) == (True, axis, 1)
