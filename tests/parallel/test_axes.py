"""Parallel axes as records: their range splits, what EP needs of a model, and rank directory names."""

import pytest

from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.layout import legacy_rank_dirname, parse_legacy_rank_dirname, parse_rank_dirname, rank_dirname
from mmparity.io.legacy import open_legacy
from mmparity.parallel import pp, tp
from mmparity.parallel.tp import axis_split
from mmparity.parallel.axes import (
    AxisError, Grid, PipelineError, expert_axis, no_experts, pipeline_axis, tensor_axis)


def test_pipeline_axis_splits_a_range_that_need_not_start_at_zero():
    assert pipeline_axis(2).ranges(range(2, 9)) == [range(2, 6), range(6, 9)]
    assert pipeline_axis(3).ranges(7) == [range(0, 3), range(3, 5), range(5, 7)]
    assert pipeline_axis(4).counts(6) == pp.buildable_layer_counts(6, 4) == [2, 1, 1, 2]
    with pytest.raises(PipelineError, match="--pp must be >= 1"):
        pipeline_axis(0)


def test_expert_axis_splits_evenly_or_not_at_all():
    assert expert_axis(2).ranges(range(0, 8)) == [range(0, 4), range(4, 8)]
    with pytest.raises(AxisError, match="does not divide"):
        expert_axis(3).ranges(8)


def test_tensor_axis_cuts_by_split_kind():
    assert axis_split(tensor_axis(2), "gated") is tp.KINDS["gated"]
    with pytest.raises(AxisError, match="splits layers, not tensors"):
        axis_split(pipeline_axis(2), "gated")
    with pytest.raises(AxisError):
        tensor_axis(2).ranges(4)


def test_ep_above_one_needs_experts_it_divides():
    assert Grid.of(tp=2, pp=2).problems() == []
    assert Grid.of(ep=2).problems(0, "clip") == [no_experts("clip", 2)]
    assert Grid.of(ep=2).problems(8) == [] and Grid.of(ep=3).problems(8) == ["--ep 3 does not divide the 8 experts"]
    assert len(Grid.of(tp=2, pp=3, ep=2).ranks()) == 12


@pytest.mark.parametrize("pp_size, ep_size", [(1, 1), (3, 1), (1, 4), (3, 4)])
def test_rank_names_round_trip(pp_size, ep_size):
    grid = Grid.of(tp=2, pp=pp_size, ep=ep_size)
    names = {rank_dirname(grid, *r): r for r in grid.ranks()}
    assert len(names) == len(grid.ranks())
    for name, (t, p, e) in names.items():
        assert parse_rank_dirname(name, grid) == (t, p if pp_size > 1 else None, e if ep_size > 1 else None)


def test_rank_names_follow_megatron():
    # EP = 1 keeps the names of before; the EP slot comes after PP's, alone when PP = 1.
    assert legacy_rank_dirname(1, 0, 1) == "mp_rank_01"
    assert legacy_rank_dirname(1, 2, 4) == "mp_rank_01_002"
    assert legacy_rank_dirname(1, 2, 4, 3, 8) == "mp_rank_01_002_003"
    assert legacy_rank_dirname(1, 0, 1, 3, 8) == "mp_rank_01_003"
    assert parse_legacy_rank_dirname("mp_rank_01_002") == (1, 2)
    assert parse_legacy_rank_dirname("mp_rank_01") == (1, None)
    assert parse_legacy_rank_dirname("mp_rank_01_002_003") is None
    assert parse_rank_dirname("mp_rank_01_002") == (1, 2, None)
    assert parse_rank_dirname("rank_01") is None


def test_an_incomplete_expert_parallel_grid_names_the_missing_rank(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release\n")
    (tmp_path / "release" / "mp_rank_00_000_001").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="incomplete TP=1 PP=1 EP=2 grid, missing mp_rank_00_000_000/"):
        open_legacy(tmp_path)


def test_convert_refuses_ep_below_one(tmp_path, capsys):
    from mmparity.cli.main import main

    assert main(["convert", "--src", str(tmp_path), "--dst", str(tmp_path / "b"), "--to", "mcore",
                 "--ep", "0"]) == 2
    assert "--ep must be >= 1, got 0" in capsys.readouterr().err
