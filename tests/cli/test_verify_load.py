"""``mmparity verify --load``: strict loads of checkpoints on disk into Megatron's own classes.

Checkpoints in Megatron's layout are made here by saving what Megatron's class holds (the
converter's output, with the empty ``_extra_state`` entries of the recorded layout) with the
project's own legacy / torch_dist writers; ``convert``'s own output is checked the same way, since
the converters write that layout.
"""

from __future__ import annotations

import pytest

from mmparity.models import registry as families
from mmparity.parallel import runtime
from mmparity.models.core.inputs import random_like_state
from mmparity.megatron import torch_dist
from mmparity.io.legacy import write_legacy
from mmparity.io.manifest import Provenance
from mmparity.io.layout import HF_CONFIG_FILE
from mmparity.models.clip.megatron import build_clip
from mmparity.models.core import megatron_classes as models
from tests.cli.test_convert_cli import run_cli
from tests.mapping.test_convert_roundtrips import save_hf
from tests.models.test_upstream import recorded


def megatron_shards(family: str, tp: int, seed: int = 5):
    fam = families.get(family)
    cfg = fam.tiny_config()
    ref = fam.build_reference(cfg)
    state = random_like_state(ref.state_dict(), seed)
    shards = fam.hf_to_mcore(state, cfg, tp_size=tp)
    # Megatron's own save also writes its TE modules' (here empty) extra states.
    empty_extra_states = dict.fromkeys(recorded(family)["extra_state"])
    return cfg, [{**shard, **empty_extra_states} for shard in shards]


def extra(cfg) -> dict:
    return {HF_CONFIG_FILE: cfg.to_json_string()}


def save_from_megatron_class(path, cfg, shards, drop=()):
    """A torch_dist checkpoint saved from Megatron's CLIP class holding ``shards[0]`` (its own
    ``sharded_state_dict()``, less the keys in ``drop``)."""
    runtime.init_parallel(1, 1)
    model = models.build(build_clip, cfg)
    models.load_strict(model, shards[0])
    sharded = {k: v for k, v in model.sharded_state_dict().items() if k not in drop}
    torch_dist.save_torch_dist(path, sharded, provenance=Provenance(family="clip"), extra_files=extra(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_legacy_tp2_in_megatrons_layout_loads(capsys, tmp_path, family):
    cfg, shards = megatron_shards(family, 2)
    write_legacy(tmp_path / "ckpt", shards, provenance=Provenance(family=family), extra_files=extra(cfg))
    code, out, err = run_cli(capsys, "verify", "--load", tmp_path / "ckpt")
    assert code == 0, out + err
    assert "rank 0: ok" in out and "rank 1: ok" in out and "TP 2" in out


def test_torch_dist_saved_from_megatrons_class_loads(capsys, tmp_path):
    cfg, shards = megatron_shards("clip", 1)
    save_from_megatron_class(tmp_path / "ckpt", cfg, shards)
    code, out, err = run_cli(capsys, "verify", "--load", tmp_path / "ckpt")
    assert code == 0, out + err
    assert "rank 0: ok" in out


def test_a_missing_and_a_foreign_key_fail_naming_both(capsys, tmp_path):
    cfg, shards = megatron_shards("clip", 1)
    shard = dict(shards[0])
    shard["ln_pre.gamma"] = shard.pop("ln_pre.weight")
    write_legacy(tmp_path / "ckpt", [shard], provenance=Provenance(family="clip"), extra_files=extra(cfg))
    code, out, err = run_cli(capsys, "verify", "--load", tmp_path / "ckpt")
    assert code == 1
    assert "rank 0: FAIL" in out and "missing 1: ln_pre.weight" in out and "unexpected 1: ln_pre.gamma" in out


def test_a_missing_torch_dist_tensor_is_named(capsys, tmp_path):
    cfg, shards = megatron_shards("clip", 1)
    save_from_megatron_class(tmp_path / "ckpt", cfg, shards, drop={"ln_pre.weight"})
    code, out, _ = run_cli(capsys, "verify", "--load", tmp_path / "ckpt")
    assert code == 1 and "missing 1: ln_pre.weight" in out


@pytest.fixture(scope="module")
def clip_hf(tmp_path_factory):
    return save_hf("clip", tmp_path_factory.mktemp("hf") / "clip", seed=8)


def test_user_errors_exit_2(capsys, tmp_path, clip_hf):
    code, _, err = run_cli(capsys, "verify", "--load", clip_hf)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    code, _, err = run_cli(capsys, "verify", "--megatron-class", "X", clip_hf)
    assert code == 2 and "--megatron-class needs --load" in err
    code, _, err = run_cli(capsys, "verify", "--tp", 2, clip_hf)
    assert code == 2 and "--tp needs --load" in err


def test_a_legacy_checkpoint_loads_only_at_its_own_tp(capsys, tmp_path):
    cfg, shards = megatron_shards("clip", 1)
    write_legacy(tmp_path / "ckpt", shards, provenance=Provenance(family="clip"), extra_files=extra(cfg))
    code, _, err = run_cli(capsys, "verify", "--load", "--tp", 2, tmp_path / "ckpt")
    assert code == 2 and "loads at its own TP size (1), not 2" in err and "Traceback" not in err


@pytest.mark.slow
def test_torch_dist_loads_at_another_tp(capsys, tmp_path):
    """torch_dist holds global tensors: Megatron's class at TP 2 reads its halves of them."""
    cfg, shards = megatron_shards("clip", 1)
    save_from_megatron_class(tmp_path / "ckpt", cfg, shards)
    code, out, err = run_cli(capsys, "verify", "--load", "--tp", 2, tmp_path / "ckpt")
    assert code == 0, out + err
    assert "TP 2" in out and "rank 0: ok" in out and "rank 1: ok" in out


@pytest.mark.slow
@pytest.mark.parametrize("fmt, tp", [("legacy", 2), ("torch_dist", 1)])
def test_convert_output_loads_into_megatron(capsys, tmp_path, clip_hf, fmt, tp):
    code, _, err = run_cli(capsys, "convert", "--family", "clip", "--src", clip_hf, "--dst",
                           tmp_path / "ckpt", "--to", "mcore", "--format", fmt, "--tp", tp)
    assert code == 0, err
    code, out, err = run_cli(capsys, "verify", "--load", tmp_path / "ckpt")
    assert code == 0, out
