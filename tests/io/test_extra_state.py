"""TE's ``_extra_state`` slots in what `convert` writes: empty, exactly the ones
Megatron's class declares, certified by the manifest like every tensor, ignored on the way back.

The strict loads into Megatron's classes that depend on them are tests/megatron/test_megatron_load.py.
"""

from __future__ import annotations

import pytest
import torch

from mmparity.models import registry as families
from mmparity.parallel import runtime
from mmparity.io.manifest import read_manifest
from mmparity.io import torch_dist_files
from mmparity.io.verify import verify
from mmparity.io.extra_state import as_bytes, extra_state_keys, sharded_extra_state_keys
from mmparity.io.legacy import load_rank_file
from mmparity.megatron.load import sharded_state_dict
from mmparity.mapping import rules as R
from mmparity.models.clip.megatron import build_clip
from mmparity.models.core import megatron_classes as models
from tests.mapping.test_convert_roundtrips import assert_same_checkpoint, run, save_hf
from tests.megatron.test_megatron_load import config_for
from tests.models.test_upstream import ALL_FAMILIES, recorded

RANK_FILE = "iter_0000001/mp_rank_{:02d}/model_optim_rng.pt"


def mcore_kinds(family: str) -> dict:
    rule_set = families.get(family).rule_set(config_for(family))
    aside = set(R.side_keys(rule_set))
    return {key: kind for step in R.plan_steps(rule_set)
            for key, kind in zip(step.mcore_keys, step.rule.tp) if key not in aside}


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_the_rule_names_every_extra_state_megatrons_class_declares(family):
    assert extra_state_keys(mcore_kinds(family)) == recorded(family)["extra_state"]


def test_gpt_models_output_layer_has_no_sharded_extra_state():
    kinds = mcore_kinds("llava")
    assert "language_model.output_layer._extra_state" in extra_state_keys(kinds)
    assert set(extra_state_keys(kinds)) - set(sharded_extra_state_keys(kinds)) == {
        "language_model.output_layer._extra_state"}


@pytest.fixture(scope="module")
def clip_hf(tmp_path_factory):
    return save_hf("clip", tmp_path_factory.mktemp("hf") / "clip", seed=4)


def test_legacy_holds_them_empty_and_certified(tmp_path, clip_hf):
    dst = tmp_path / "legacy"
    assert run("convert", "--family", "clip", "--src", clip_hf, "--dst", dst, "--to", "mcore",
               "--format", "legacy", "--tp", 2, "--quiet") == 0
    expected = recorded("clip")["extra_state"]
    for rank in range(2):
        model = load_rank_file(dst / RANK_FILE.format(rank))
        assert {k: v for k, v in model.items() if k.endswith("._extra_state")} == dict.fromkeys(expected)
    certified = {r.key for r in read_manifest(dst).tensors if r.key.endswith("._extra_state")}
    assert certified == set(expected)
    assert verify(dst).ok
    assert run("convert", "--family", "clip", "--src", dst, "--dst", tmp_path / "hf", "--to", "hf", "--quiet") == 0
    assert_same_checkpoint(tmp_path / "hf", clip_hf)

    # An extra state that holds something, and one that is gone: both named.
    path = dst / RANK_FILE.format(1)
    payload = torch.load(path, weights_only=True)
    payload["model"][expected[0]] = torch.ones(3, dtype=torch.uint8)
    del payload["model"][expected[1]]
    torch.save(payload, path)
    report = verify(dst)
    problems = {(p.key, p.message.split(" ")[0]) for p in report.problems}
    assert (expected[1], "missing") in problems, report
    assert any(p.key == expected[0] for p in report.problems), report


def test_torch_dist_holds_megatrons_objects_certified(tmp_path, clip_hf):
    dst = tmp_path / "dist"
    assert run("convert", "--family", "clip", "--src", clip_hf, "--dst", dst, "--to", "mcore",
               "--format", "torch_dist", "--quiet") == 0
    runtime.init_parallel(1, 1)
    asked = {v.unique_key for v in sharded_state_dict(models.build(build_clip, config_for("clip"))).values()
             if v.key.endswith("._extra_state")}
    stored = torch_dist_files.object_keys(dst / "iter_0000001")
    assert set(stored) == asked and len(asked) == 10
    certified = {r.key for r in read_manifest(dst).tensors if "_extra_state" in r.key}
    assert certified == asked
    assert verify(dst).ok
    assert run("convert", "--family", "clip", "--src", dst, "--dst", tmp_path / "hf", "--to", "hf", "--quiet") == 0
    assert_same_checkpoint(tmp_path / "hf", clip_hf)

    # One changed byte of an object's stored pickle is found without unpickling it.
    metadata = torch_dist_files.load_metadata(dst / "iter_0000001")
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == stored[0])
    data_file = dst / "iter_0000001" / info.relative_path
    blob = bytearray(data_file.read_bytes())
    blob[info.offset + info.length - 30] ^= 0xFF
    data_file.write_bytes(bytes(blob))
    report = verify(dst)
    assert [p.key for p in report.problems] == [stored[0]], report


def test_as_bytes_refuses_what_is_not_an_extra_state():
    assert as_bytes(None).numel() == 0
    with pytest.raises(TypeError):
        as_bytes(3)
