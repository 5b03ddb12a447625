"""LLaVA's padded vocabulary when an mcore checkpoint changes TP size, or was padded with another
``--make-vocab-size-divisible-by``.

Megatron-LM pads the vocabulary to a multiple of ``make_vocab_size_divisible_by × TP``: resharding
must re-pad for the target TP (the real rows exactly, the old padding stripped), with the divisor
the checkpoint records, and mmparity's native LLaVA must load whatever padding a checkpoint has.
"""

from __future__ import annotations

import pytest
import torch

from mmparity.models import registry as families
from mmparity.io.manifest import read_manifest
from mmparity.io.verify import verify
from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
from mmparity.io.legacy import read_legacy
from mmparity.convert import read_mcore_shards
from mmparity.io.torch_dist_files import global_state_dict
from tests.mapping.test_convert_roundtrips import assert_same_checkpoint, run, save_hf
from tests.cli.test_convert_cli import run_cli

EMBEDDING = "language_model.embedding.word_embeddings.weight"
OUTPUT = "language_model.output_layer.weight"
VOCAB = families.get("llava").tiny_config().text_config.vocab_size  # 101: padded at every divisor


@pytest.fixture(scope="module")
def llava_hf(tmp_path_factory):
    return save_hf("llava", tmp_path_factory.mktemp("hf") / "llava", seed=6)


def converted(hf_dir, tp: int, multiple: int = 128) -> list[dict]:
    cfg = families.get("llava").tiny_config()
    return families.get("llava").hf_to_mcore(load_safetensors_state_dict(hf_dir), cfg, tp_size=tp,
                                             make_vocab_size_divisible_by=multiple)


def to_mcore(src, dst, fmt: str, tp: int, *extra) -> None:
    assert run("convert", "--family", "llava", "--src", src, "--dst", dst, "--to", "mcore",
               "--format", fmt, "--tp", tp, "--quiet", *extra) == 0


def assert_equal_shards(got, expected) -> None:
    assert len(got) == len(expected)
    for rank, (shard, want) in enumerate(zip(got, expected)):
        shard = {k: v for k, v in shard.items() if torch.is_tensor(v)}  # not the empty extra states
        assert sorted(shard) == sorted(want), rank
        for key, value in want.items():
            assert shard[key].shape == value.shape and torch.equal(shard[key], value), (rank, key)


@pytest.mark.parametrize("src_tp, fmt, tp", [(1, "legacy", 2), (2, "legacy", 1), (1, "torch_dist", 2)])
def test_reading_at_another_tp_repads_for_it(tmp_path, llava_hf, src_tp, fmt, tp):
    to_mcore(llava_hf, tmp_path / "src", fmt, src_tp)
    _, _, shards = read_mcore_shards(tmp_path / "src", tp=tp)
    assert shards[0][EMBEDDING].shape[0] * tp == -(-VOCAB // (128 * tp)) * 128 * tp
    assert_equal_shards(shards, converted(llava_hf, tp))


@pytest.mark.parametrize("src, dst", [(("legacy", 2), ("legacy", 1)), (("legacy", 1), ("legacy", 2)),
                                      (("legacy", 2), ("torch_dist", 1))])
def test_convert_mcore_to_mcore_repads_for_the_target(tmp_path, llava_hf, src, dst):
    to_mcore(llava_hf, tmp_path / "src", *src)
    to_mcore(tmp_path / "src", tmp_path / "dst", *dst)
    fmt, tp = dst
    if fmt == "legacy":
        got = read_legacy(tmp_path / "dst")
        assert_equal_shards(got, converted(llava_hf, tp))
    else:
        state = global_state_dict(tmp_path / "dst" / "iter_0000001")
        expected = converted(llava_hf, 1)[0]
        for key in (EMBEDDING, OUTPUT):
            assert torch.equal(state[key], expected[key]), key
    assert verify(tmp_path / "dst").ok
    assert run("convert", "--src", tmp_path / "dst", "--dst", tmp_path / "hf", "--to", "hf", "--quiet") == 0
    assert_same_checkpoint(tmp_path / "hf", llava_hf)


def test_the_recorded_divisor_is_kept_unless_another_is_asked(tmp_path, llava_hf):
    to_mcore(llava_hf, tmp_path / "src", "legacy", 1, "--make-vocab-size-divisible-by", 8)  # 101 -> 104
    to_mcore(tmp_path / "src", tmp_path / "tp2", "legacy", 2)  # 8 x 2 -> 112
    assert_equal_shards(read_legacy(tmp_path / "tp2"), converted(llava_hf, 2, multiple=8))
    assert read_manifest(tmp_path / "tp2").provenance.extra["make_vocab_size_divisible_by"] == 8
    to_mcore(tmp_path / "src", tmp_path / "by64", "legacy", 2, "--make-vocab-size-divisible-by", 64)
    assert_equal_shards(read_legacy(tmp_path / "by64"), converted(llava_hf, 2, multiple=64))
    assert read_manifest(tmp_path / "by64").provenance.extra["make_vocab_size_divisible_by"] == 64


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_check_mcore_runs_a_checkpoint_padded_with_another_divisor(capsys, tmp_path, llava_hf, fmt):
    to_mcore(llava_hf, tmp_path / "ckpt", fmt, 1, "--make-vocab-size-divisible-by", 8)
    assert read_manifest(tmp_path / "ckpt").provenance.extra["make_vocab_size_divisible_by"] == 8
    code, out, err = run_cli(capsys, "check", "--mcore", tmp_path / "ckpt", "--hf", llava_hf, "--no-components")
    assert code == 0, out + err
