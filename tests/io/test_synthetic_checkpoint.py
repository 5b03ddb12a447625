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


@pytest.mark.slow
def test_a_qwen3_5_moe_release_has_its_key_set_and_converts_back_but_its_mtp_layer(tmp_path):
    from mmparity.convert import ConvertOptions, convert

    info = synthetic.write(tmp_path / "hf", 0, 64, 0, "8MB", torch.bfloat16, layers=8, experts=6,
                           model="qwen3_5_moe")
    shapes = _written(tmp_path / "hf")
    assert len(shapes) == info["tensors"]
    assert 2 * sum(torch.Size(s).numel() for s in shapes.values()) == info["bytes"] == synthetic.checkpoint_bytes(
        64, 8, torch.bfloat16, 6, None, "qwen3_5_moe")
    # The release's spelling: one tensor per expert, DeltaNet layers three in four, an MTP layer.
    assert "model.language_model.layers.7.mlp.experts.5.down_proj.weight" in shapes
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in shapes
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in shapes
    mtp = {k for k in shapes if k.startswith("mtp.")}
    assert "mtp.layers.0.mlp.experts.5.gate_proj.weight" in mtp and "mtp.fc.weight" in mtp
    result = convert(ConvertOptions(src=tmp_path / "hf", dst=tmp_path / "mcore", to="mcore", format="legacy",
                                    tp=2, ep=2))
    assert result.tensors < len(shapes)
    convert(ConvertOptions(src=tmp_path / "mcore", dst=tmp_path / "back", to="hf", hf_format="hf_checkpoint"))
    from mmparity.io.fsio.safetensors_read import SafetensorsCheckpoint

    with SafetensorsCheckpoint(tmp_path / "hf") as a, SafetensorsCheckpoint(tmp_path / "back") as b:
        assert set(b.keys()) == set(shapes) - mtp
        assert all(torch.equal(a.get(k), b.get(k)) for k in b.keys())
