"""`mmparity convert` round trips on disk: every family, both mcore formats, whole-VLM sources, and
mcore checkpoints loaded into native models at other TP sizes (spawned gloo ranks).

Each source is a sharded HF directory of the family's tiny reference model with seeded random
weights; HF -> mcore (TP 2, PP 2) -> HF must give back every tensor bit for bit, under its own name
and prefix, with the source's config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmparity.models import registry as families
from mmparity.io.manifest import read_manifest
from mmparity.io.verify import verify
from mmparity.cli.main import main
from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
from mmparity.io.fsio.safetensors_write import save_safetensors_checkpoint
from mmparity.models.core.inputs import random_like_state


def save_hf(family: str, path: Path, seed: int = 0, max_shard_size="20KB", cfg=None,
            module_names: bool = False) -> Path:
    """The family's tiny reference model as an HF directory (sharded), whatever its class: as its
    ``save_pretrained`` writes it, or (``module_names``) its ``state_dict()``."""
    fam = families.get(family)
    cfg = cfg if cfg is not None else fam.tiny_config()
    model = fam.build_reference(cfg)
    model.load_state_dict(random_like_state(model.state_dict(), seed=seed))
    if hasattr(model, "save_pretrained") and not module_names:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    else:  # a reference wrapper around HF modules (e.g. the Mistral3 vision path)
        save_safetensors_checkpoint(path, model.state_dict(), max_shard_size=max_shard_size,
                                    extra_files={"config.json": cfg.to_json_string()})
    return path


def run(*argv) -> int:
    return main([str(a) for a in argv])


def assert_same_checkpoint(back: Path, src: Path) -> None:
    expected, got = load_safetensors_state_dict(src), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: save_hf(name, root / name, seed=i) for i, name in enumerate(families.names())}


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", families.names())
def test_hf_to_mcore_tp2_pp2_and_back_is_bit_exact(family, fmt, hf_dirs, tmp_path):
    src = hf_dirs[family]
    assert (src / "model.safetensors.index.json").exists()  # the source is sharded
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert run("convert", "--family", family, "--src", src, "--dst", mcore, "--to", "mcore",
               "--tp", 2, "--pp", 2, "--format", fmt, "--quiet") == 0
    manifest = read_manifest(mcore)
    assert manifest.provenance.family == family
    assert (mcore / "hf_config.json").read_bytes() == (src / "config.json").read_bytes()
    if fmt == "legacy":
        assert (manifest.tensor_parallel_size, manifest.pipeline_parallel_size) == (2, 2)
        ranks = sorted(p.name for p in (mcore / "iter_0000001").iterdir())
        assert ranks == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    assert verify(mcore).ok
    assert run("convert", "--src", mcore, "--dst", back, "--to", "hf", "--max-shard-size", "30KB", "--quiet") == 0
    assert_same_checkpoint(back, src)
    assert verify(back).ok
    assert (back / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("family", families.names())
def test_streaming_convert_and_the_in_memory_api_give_the_same_shards(family, hf_dirs, tmp_path):
    """One engine: `convert` to legacy TP 2 writes exactly what `Family.hf_to_mcore` returns."""
    from mmparity.convert import read_mcore_shards
    from transformers import AutoConfig

    src = hf_dirs[family]
    fam = families.get(family)
    cfg = fam.family_config(AutoConfig.from_pretrained(src))
    in_memory = fam.hf_to_mcore(load_safetensors_state_dict(src), cfg, tp_size=2)
    assert run("convert", "--family", family, "--src", src, "--dst", tmp_path / "mcore", "--to", "mcore",
               "--tp", 2, "--format", "legacy", "--quiet") == 0
    _, _, on_disk = read_mcore_shards(tmp_path / "mcore")
    pairs = list(zip(in_memory, on_disk, strict=True)) + list(zip(in_memory.side, on_disk.side, strict=True))
    for memory_rank, disk_rank in pairs:
        assert list(disk_rank) == list(memory_rank)
        for key, tensor in memory_rank.items():
            assert disk_rank[key].dtype == tensor.dtype and torch.equal(disk_rank[key], tensor), key


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_side_file_is_certified_and_required(fmt, hf_dirs, tmp_path):
    """CLIP's ln_post has no place in Megatron's class: it is in the side file, which the manifest
    checksums and export needs; a changed or missing side file is loud, never a silent loss."""
    from safetensors.torch import load_file, save_file

    mcore = tmp_path / "mcore"
    assert run("convert", "--family", "clip", "--src", hf_dirs["clip"], "--dst", mcore, "--to", "mcore",
               "--format", fmt, "--tp", 2, "--quiet") == 0
    side = mcore / "mcore_side.safetensors"
    assert set(load_file(side)) == {"ln_post.weight", "ln_post.bias"}
    assert {r.key for r in read_manifest(mcore).tensors if r.file == side.name} == {"ln_post.weight", "ln_post.bias"}
    tensors = load_file(side)
    tensors["ln_post.weight"] = tensors["ln_post.weight"] + 1
    save_file(tensors, side)
    assert not verify(mcore).ok
    assert run("convert", "--src", mcore, "--dst", tmp_path / "back", "--to", "hf", "--quiet") == 2
    side.unlink()
    assert run("convert", "--src", mcore, "--dst", tmp_path / "back", "--to", "hf", "--quiet") == 2
    assert not (tmp_path / "back").exists()


def test_mcore_to_mcore_reshards_and_changes_format(hf_dirs, tmp_path):
    src = hf_dirs["pixtral"]
    assert run("convert", "--family", "pixtral", "--src", src, "--dst", tmp_path / "a", "--to", "mcore",
               "--format", "legacy", "--tp", 2, "--quiet") == 0
    assert run("convert", "--src", tmp_path / "a", "--dst", tmp_path / "b", "--to", "mcore",
               "--format", "torch_dist", "--quiet") == 0
    assert run("convert", "--src", tmp_path / "b", "--dst", tmp_path / "c", "--to", "mcore",
               "--format", "legacy", "--tp", 4, "--pp", 2, "--quiet") == 0
    assert read_manifest(tmp_path / "c").tensor_parallel_size == 4
    assert run("convert", "--src", tmp_path / "c", "--dst", tmp_path / "back", "--to", "hf", "--quiet") == 0
    assert_same_checkpoint(tmp_path / "back", src)


def test_hf_to_hf_changes_layout_and_shards(hf_dirs, tmp_path):
    src = hf_dirs["pixtral"]
    assert run("convert", "--family", "pixtral", "--src", src, "--dst", tmp_path / "mistral", "--to", "hf",
               "--hf-format", "mistral", "--quiet") == 0
    keys = load_safetensors_state_dict(tmp_path / "mistral")
    assert all(k.startswith("vision_encoder.") for k in keys)
    assert run("convert", "--family", "pixtral", "--src", tmp_path / "mistral", "--dst", tmp_path / "hf", "--to", "hf",
               "--hf-format", "hf", "--max-shard-size", "25KB", "--quiet") == 0
    assert_same_checkpoint(tmp_path / "hf", src)


def test_dtype_cast_is_recorded_and_applied(hf_dirs, tmp_path):
    src = hf_dirs["qwen3_5"]
    assert run("convert", "--family", "qwen3_5", "--src", src, "--dst", tmp_path / "m", "--to", "mcore",
               "--format", "legacy", "--dtype", "bfloat16", "--quiet") == 0
    assert read_manifest(tmp_path / "m").provenance.extra["dtype"] == "bfloat16"
    assert run("convert", "--src", tmp_path / "m", "--dst", tmp_path / "back", "--to", "hf", "--quiet") == 0
    back, expected = load_safetensors_state_dict(tmp_path / "back"), load_safetensors_state_dict(src)
    for key, value in expected.items():
        assert back[key].dtype == torch.bfloat16 and torch.equal(back[key], value.to(torch.bfloat16)), key


@pytest.mark.parametrize("kind, shape", [("replicated", (6, 4)), ("column", (8, 3)), ("qkv", (12, 4)),
                                         ("row", (6, 8)), ("row", (6,)), ("gated", (16, 5)), ("vocab", (8, 2))])
def test_rank_views_written_in_order_equal_tp_shard(kind, shape):
    """The legacy writer writes a rank's tp.shard_slices views one after another (row runs for a
    column range) instead of tp.shard copies: the bytes it writes are those of tp.shard."""
    from mmparity.parallel import tp as tp_mod

    full = torch.randn(shape, generator=torch.Generator().manual_seed(len(kind))).to(torch.bfloat16)
    for rank, expected in enumerate(tp_mod.shard(full, kind, 2)):
        ranges = tp_mod.shard_slices(tuple(full.shape), kind, 2, rank)
        pieces = [full.narrow(d, a, b - a) for d, a, b in ranges] or [full]
        written = torch.cat([p.contiguous().reshape(-1) for p in pieces])
        assert torch.equal(written, expected.reshape(-1)), (kind, rank)


# --------------------------------------------------------------------------------------------------
# whole-VLM sources: only the family's tensors are read, and they go back under the same prefix


def _llava_with_pixtral(path: Path) -> Path:
    """A whole LLaVA checkpoint (Pixtral tower, Llama decoder), saved sharded by transformers."""
    return save_hf("llava", path, seed=7, max_shard_size="15KB")


def _mistral3(path: Path) -> Path:
    from transformers import Mistral3ForConditionalGeneration

    cfg = families.get("pixtral_large").tiny_config()
    model = Mistral3ForConditionalGeneration(cfg)
    model.load_state_dict(random_like_state(model.state_dict(), seed=8))
    model.save_pretrained(path, max_shard_size="30KB")
    return path


@pytest.mark.parametrize("family, make, prefixes", [
    ("pixtral", _llava_with_pixtral, ("vision_tower.", "model.vision_tower.")),
    ("pixtral_large", _mistral3, ("vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                                  "model.multi_modal_projector.")),
])
def test_whole_vlm_source_converts_only_the_family(family, make, prefixes, tmp_path):
    src = make(tmp_path / "src")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    assert any("language_model" in k for k in index["weight_map"])
    for fmt in ("legacy", "torch_dist"):
        mcore, back = tmp_path / f"m-{fmt}", tmp_path / f"b-{fmt}"
        assert run("convert", "--family", family, "--src", src, "--dst", mcore, "--to", "mcore", "--tp", 2,
                   "--pp", 2, "--format", fmt, "--quiet") == 0
        assert run("convert", "--src", mcore, "--dst", back, "--to", "hf", "--quiet") == 0
        got, whole = load_safetensors_state_dict(back), load_safetensors_state_dict(src)
        family_part = {k for k in whole if k.startswith(prefixes) and "position_ids" not in k}
        assert set(got) == family_part
        assert all(torch.equal(got[k], whole[k]) for k in got)
        assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()


# --------------------------------------------------------------------------------------------------
# a checkpoint written at TP 2 loads into native models at TP 1 and TP 4 with the same outputs


def _native_outputs(rank: int, world_size: int, jobs: list) -> list | None:
    """One spawned rank: for each (family, format, checkpoint), load it at TP 4 and at TP 1, run."""
    from mmparity.megatron.torch_dist import load_torch_dist
    from mmparity.convert import read_mcore_shards
    from mmparity.parallel import runtime

    results = []
    for family, fmt, path in jobs:
        fam = families.get(family)
        cfg = fam.tiny_config()
        hooks = fam.hooks
        cases = [hooks.parity.prepare_case(c, cfg) for c in hooks.parity.cases(cfg, 3)]
        per_tp = {}
        for tp in (4, 1):
            runtime.init_parallel(tp, 1)
            model = fam.build_native(cfg)
            if fmt == "torch_dist":
                model.load_state_dict(load_torch_dist(path, model.sharded_state_dict()))
            else:
                _, _, shards = read_mcore_shards(path, tp=tp)
                model.load_state_dict(shards[runtime.tp_rank()], strict=True)
            with torch.no_grad():
                per_tp[tp] = [{k: v.float() for k, v in hooks.native.run(model, case).items()} for case in cases]
        results.append(per_tp)
    return results if rank == 0 else None


@pytest.mark.slow
def test_tp2_checkpoint_loads_at_tp1_and_tp4_with_the_same_outputs(hf_dirs, tmp_path):
    from mmparity.parallel import runtime

    jobs = []
    # Three towers with different parallel parts: plain ViT, Qwen's parallel merger MLP, Kimi's
    # projector.
    for family in ("pixtral", "qwen3_5", "kimi_k25"):
        for fmt in ("legacy", "torch_dist"):
            path = tmp_path / f"{family}-{fmt}"
            assert run("convert", "--family", family, "--src", hf_dirs[family], "--dst", path, "--to", "mcore",
                       "--tp", 2, "--format", fmt, "--quiet") == 0
            jobs.append((family, fmt, str(path)))
    results = runtime.spawn(_native_outputs, 4, jobs)[0]
    by_job = dict(zip([(f, fmt) for f, fmt, _ in jobs], results))
    for (family, fmt), per_tp in by_job.items():
        for tp1, tp4 in zip(per_tp[1], per_tp[4]):
            for name in tp1:
                torch.testing.assert_close(tp4[name], tp1[name], rtol=1e-5, atol=1e-5,
                                           msg=f"{family} {fmt} {name}: TP 4 != TP 1")
        # Both formats hold the same weights: bit-identical outputs at the same TP size.
        other = by_job[(family, "torch_dist" if fmt == "legacy" else "legacy")]
        for a, b in zip(per_tp[1], other[1]):
            assert all(torch.equal(a[k], b[k]) for k in a), (family, fmt)
