"""benchmarks/synthetic_moe_checkpoint.py: the synthetic MoE checkpoint that the
memory figures of ``convert`` are measured on.

``--by-width`` must give checkpoints whose names and count are the same at every size, so that
what grows between two sizes is the bytes alone, and whose size is the one it predicted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import synthetic_moe_checkpoint as synthetic  # noqa: E402

DEPTH, EXPERTS, HEADS = 3, 8, 4


def _written(root: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    index = json.loads((root / "model.safetensors.index.json").read_text())
    shapes = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(root / shard), framework="pt") as f:
            for key in f.keys():
                shapes[key] = f.get_slice(key).get_shape()
    return shapes


def test_scale_for_picks_the_scale_whose_size_is_nearest():
    size = 60 * 2**20
    scale = synthetic.scale_for(size, DEPTH, torch.bfloat16, EXPERTS, HEADS)
    nearest = abs(synthetic.checkpoint_bytes(scale, DEPTH, torch.bfloat16, EXPERTS, HEADS) - size)
    for other in (scale - 1, scale + 1):
        assert abs(synthetic.checkpoint_bytes(other, DEPTH, torch.bfloat16, EXPERTS, HEADS) - size) >= nearest


@pytest.mark.slow
def test_by_width_keeps_the_key_set_and_writes_the_predicted_bytes(tmp_path):
    small = synthetic.write(tmp_path / "small", 20 * 2**20, 0, 0, "8MB", torch.bfloat16,
                            layers=DEPTH, experts=EXPERTS, heads=HEADS, by_width=True)
    large = synthetic.write(tmp_path / "large", 80 * 2**20, 0, 0, "8MB", torch.bfloat16,
                            layers=DEPTH, experts=EXPERTS, heads=HEADS, by_width=True)
    assert small["scale"] > large["scale"]
    a, b = _written(tmp_path / "small"), _written(tmp_path / "large")
    assert sorted(a) == sorted(b) and len(a) == small["tensors"] == large["tensors"]
    assert a != b, "only the widths may differ, and they must"
    for info, shapes in ((small, a), (large, b)):
        nbytes = sum(2 * torch.Size(s).numel() for s in shapes.values())
        assert nbytes == info["bytes"] == synthetic.checkpoint_bytes(info["scale"], DEPTH, torch.bfloat16,
                                                                      EXPERTS, HEADS)
