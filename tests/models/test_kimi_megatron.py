"""Kimi-K2.5 in Megatron's layout: what the converter writes, what the native model holds, what
``convert`` says, and strict loads of ``convert``'s output on disk into Megatron-LM main's
``KimiViTModel`` (+ ``MultimodalProjector``).

The Megatron-LM tests skip, naming what to install, when ``vit_model.py`` is not importable.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmparity.models import registry as families
from mmparity.parallel import runtime
from mmparity.io.legacy import load_rank_file, write_legacy
from mmparity.io.manifest import Provenance
from mmparity.megatron.torch_dist import load_torch_dist
from mmparity.cli.main import main
from mmparity.models.kimi_k25.mapping import TileBlocks
from mmparity.mapping.ops import LayoutError
from mmparity.errors import ConversionError
from mmparity.models.core import megatron_classes as models
from mmparity.models.kimi_k25.megatron import build_kimi_k25
from tests.mapping.test_convert_roundtrips import save_hf

FAMILY = "kimi_k25"
FC1_NORM = "vision_projection.encoder.linear_fc1.layer_norm_"
needs_main = pytest.mark.skipif(not models.available(), reason=models.INSTALL_HINT)


def _fam():
    return families.get(FAMILY)


def _whole():
    return _fam().tiny_config()


def _tower():
    return _fam().tiny_config().vision_config


def _hf_state(cfg, seed: int = 4) -> dict:
    ref = _fam().build_reference(cfg)
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in ref.state_dict().items()}


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- always: the layout -------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_whole_model_is_written_under_llava_names_with_the_norm_tiled(tp):
    cfg = _whole()
    hf = _hf_state(cfg)
    shards = _fam().hf_to_mcore(hf, cfg, tp_size=tp)
    assert all(not side for side in shards.side)  # nothing needs a side file
    for shard in shards:
        assert all(k.startswith(("vision_model.", "vision_projection.")) for k in shard)
        assert torch.equal(shard["vision_model.patch_embed.proj.weight"], hf["vision_tower.patch_embed.proj.weight"])
        assert torch.equal(shard["vision_model.final_ln.bias"], hf["vision_tower.final_layernorm.bias"])
        assert "vision_model.decoder.final_layernorm.weight" not in shard
        for p in ("weight", "bias"):
            assert torch.equal(shard[FC1_NORM + p], hf[f"mm_projector.pre_norm.{p}"].repeat(4))


def test_tower_alone_is_written_at_the_root():
    cfg = _tower()
    shards = _fam().hf_to_mcore(_hf_state(cfg), cfg)
    keys = set(shards[0])
    assert {"patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight", "final_ln.weight"} <= keys
    assert not any(k.startswith(("vision_model.", "vision_projection.")) for k in keys)


@pytest.mark.parametrize("cfg", [_whole(), _tower()], ids=["whole", "tower"])
def test_native_model_holds_exactly_the_megatron_state_dict(cfg):
    runtime.init_parallel(1, 1)
    shards = _fam().hf_to_mcore(_hf_state(cfg), cfg)
    native = _fam().build_native(cfg)
    own = {k for k in native.state_dict() if not k.endswith("._extra_state")}
    assert own == set(shards[0])
    native.load_state_dict(shards[0], strict=True)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_tiled_norm_gives_hf_back_exactly_and_refuses_differing_blocks(tp):
    cfg = _whole()
    hf = _hf_state(cfg)
    shards = _fam().hf_to_mcore(hf, cfg, tp_size=tp)
    back = _fam().mcore_to_hf(shards, cfg)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    for shard in shards:  # as Megatron's fused norm over the merged vector would train it
        shard[FC1_NORM + "weight"] = shard[FC1_NORM + "weight"].clone()
        shard[FC1_NORM + "weight"][-1] += 1
    with pytest.raises(ConversionError, match=FC1_NORM + "weight.*blocks differ"):
        _fam().mcore_to_hf(shards, cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_blocks_round_trip_is_bitwise_nan_included(dtype):
    op = TileBlocks(4)
    v = torch.tensor([1.5, float("nan"), -0.0, 3.0]).to(dtype)
    tiled = op.apply([v])[0]
    assert tiled.shape == (16,) and torch.equal(tiled.view(4, 4)[2].nan_to_num(7), v.nan_to_num(7))
    back = op.invert([tiled])[0]
    assert back.dtype == dtype and torch.equal(back.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                               v.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    signed = tiled.clone()
    signed[4 + 2] = 0.0  # +0 where the other blocks hold -0: equal as numbers, not as bits
    with pytest.raises(LayoutError, match="blocks differ"):
        op.invert([signed])
    with pytest.raises(LayoutError, match="equal blocks"):
        op.invert([tiled[:-1]])


def test_on_disk_mcore_to_hf_refuses_differing_blocks(capsys, tmp_path):
    """The streaming writer may take a one-input op's rows straight from the source; the check on
    the tiled norm must run there too."""
    cfg = _whole()
    shards = _fam().hf_to_mcore(_hf_state(cfg), cfg)
    good = tmp_path / "good"
    write_legacy(good, shards, provenance=Provenance(family=FAMILY),
                 extra_files={"hf_config.json": cfg.to_json_string()})
    code, _, err = run_cli(capsys, "convert", "--src", good, "--dst", tmp_path / "hf", "--to", "hf", "--quiet")
    assert code == 0, err
    shards[0][FC1_NORM + "bias"] = shards[0][FC1_NORM + "bias"].clone()
    shards[0][FC1_NORM + "bias"][0] -= 1
    bad = tmp_path / "bad"
    write_legacy(bad, shards, provenance=Provenance(family=FAMILY),
                 extra_files={"hf_config.json": cfg.to_json_string()})
    code, _, err = run_cli(capsys, "convert", "--src", bad, "--dst", tmp_path / "hf2", "--to", "hf", "--quiet")
    assert code == 2 and FC1_NORM + "bias" in err and "blocks differ" in err
    assert "Traceback" not in err and not (tmp_path / "hf2").exists()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_hf(FAMILY, tmp_path_factory.mktemp("kimi") / "hf", seed=3)


def test_convert_says_the_projector_has_no_exact_megatron_equivalent(capsys, tmp_path, hf_dir):
    code, out, err = run_cli(capsys, "convert", "--family", FAMILY, "--src", hf_dir, "--dst", tmp_path / "m",
                             "--to", "mcore", "--format", "legacy")
    assert code == 0, err
    notes = [line for line in out.splitlines() if "note:" in line]
    assert len(notes) == 1 and "no exact Megatron equivalent" in notes[0]
    assert "2.8e-2" in notes[0] and "fused LayerNorm" in notes[0] and "tiled 4x" in notes[0]
    code, out, err = run_cli(capsys, "convert", "--src", tmp_path / "m", "--dst", tmp_path / "back",
                             "--to", "hf")
    assert code == 0 and "note:" not in out  # exact both ways back
    tower = save_hf(FAMILY, tmp_path / "tower", seed=3, cfg=_tower())
    code, out, err = run_cli(capsys, "convert", "--family", FAMILY, "--src", tower, "--dst", tmp_path / "t",
                             "--to", "mcore", "--format", "legacy")
    assert code == 0 and "note:" not in out, out + err


# --- Megatron-LM main: strict loads of convert's output ----------------------------------------

def _convert(capsys, src: Path, dst: Path, fmt: str, tp: int) -> Path:
    code, _, err = run_cli(capsys, "convert", "--family", FAMILY, "--src", src, "--dst", dst, "--to", "mcore",
                           "--format", fmt, "--tp", tp, "--quiet")
    assert code == 0, err
    return dst


@needs_main
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_legacy_output_loads_strictly_with_verify(capsys, tmp_path, hf_dir, tp):
    ckpt = _convert(capsys, hf_dir, tmp_path / "mcore", "legacy", tp)
    code, out, err = run_cli(capsys, "verify", "--load", ckpt)
    assert code == 0, out + err
    assert "KimiViTModel+MultimodalProjector" in out
    assert all(f"rank {r}: ok" in out for r in range(tp)) and f"TP {tp}" in out


@needs_main
@pytest.mark.slow  # verify --load spawns the checkpoint's TP ranks
def test_tower_alone_loads_strictly_with_verify(capsys, tmp_path):
    src = save_hf(FAMILY, tmp_path / "hf", seed=3, cfg=_tower())
    ckpt = _convert(capsys, src, tmp_path / "mcore", "legacy", 2)
    code, out, err = run_cli(capsys, "verify", "--load", ckpt)
    assert code == 0 and "rank 1: ok" in out, out + err


def _load_rank(rank: int, world: int, fmt: str, path: str, expected: list) -> dict:
    """Megatron's class at TP ``world`` loads rank ``rank`` of the checkpoint: legacy rank file, or
    ``dist_checkpointing.load`` of the class's sharded state dict (less TE's ``_extra_state``,
    which mmparity does not write). Returns the strict-load problems and the keys whose loaded
    value is not the converter's."""
    from megatron.core.transformer.utils import sharded_state_dict_default

    runtime.init_parallel(world, 1)
    try:
        model = models.build(build_kimi_k25, _whole())
        if fmt == "legacy":
            state = load_rank_file(Path(path) / "iter_0000001" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt")
        else:
            wanted = {}
            for name, child in model.named_children():  # LLaVAModel's tree: vision_model., vision_projection.
                wanted.update(sharded_state_dict_default(child, f"{name}."))
            state = load_torch_dist(path, {k: v for k, v in wanted.items() if not k.endswith("._extra_state")})
        try:
            tolerated = models.load_strict(model, state)
        except models.StrictLoadError as exc:
            return {"problem": str(exc)}
        loaded = model.state_dict()
        differ = [k for k, v in expected[rank].items() if not torch.equal(loaded[k], v)]
        return {"problem": "", "tolerated": tolerated, "differ": differ}
    finally:
        runtime.teardown_parallel()


@needs_main
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_convert_output_loads_strictly_into_kimi_vit_model(capsys, tmp_path, hf_dir, fmt, tp):
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    ckpt = _convert(capsys, hf_dir, tmp_path / "mcore", fmt, tp)
    expected = [dict(s) for s in _fam().hf_to_mcore(load_safetensors_state_dict(hf_dir), _whole(), tp_size=tp)]
    if tp == 1:
        ranks = [_load_rank(0, 1, fmt, str(ckpt), expected)]
    else:
        ranks = runtime.spawn(_load_rank, tp, fmt, str(ckpt), expected)
    for rank in ranks:
        assert rank["problem"] == "", rank
        assert rank["differ"] == [] and all(k.endswith("._extra_state") for k in rank["tolerated"])


@needs_main
def test_check_runs_megatrons_kimi_vit_model_on_a_tower_alone():
    """A tower-only config is ``KimiViTModel`` itself (root keys, as the converter writes them),
    not the ``LLaVAModel`` tree; every output matches HF."""
    from mmparity.parity import harness

    report = harness.check(FAMILY, _tower(), impl="megatron")
    assert report.passed and {r.check for r in report.results} == {
        "static:pooler_output", "static:last_hidden_state", "packed:pooler_output", "packed:last_hidden_state"}
