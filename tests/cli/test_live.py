"""Weights to and from a live Megatron model (``mmparity.megatron.live``), across spawned gloo
ranks: Megatron's own classes (``upstream.models``) at TP 2 and PP 2, checked bit for bit against
what ``mmparity convert`` writes for the same weights, both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmparity.models import registry as families
from mmparity.parallel import runtime
from mmparity.models.llava.megatron import llava_clip_config
from mmparity.megatron import live
from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
from mmparity.io.fsio.safetensors_write import save_safetensors_checkpoint
from mmparity.io.legacy import open_legacy
from mmparity.mapping import rules as R
from mmparity.errors import ConversionError
from tests.mapping.test_convert_roundtrips import run, save_hf

pytestmark = pytest.mark.slow  # spawns gloo ranks


def _model_state(model) -> dict:
    """The model's tensors as the converter spells them (locally numbered, no extra states)."""
    return R.to_te_spelling({k: v.detach().clone() for k, v in model.state_dict().items()
                             if isinstance(v, torch.Tensor)})


def _differences(state: dict, expected: dict, what: str) -> list[str]:
    out = [f"{what}: {k} missing" for k in expected if k not in state]
    out += [f"{what}: {k} not expected" for k in state if k not in expected]
    out += [f"{what}: {k} differs" for k in expected if k in state
            and not (state[k].dtype == expected[k].dtype and torch.equal(state[k], expected[k]))]
    return out


def _rank_file(mcore: Path, tp_rank: int, pp_rank: int) -> dict:
    ckpt = open_legacy(mcore)
    return R.to_te_spelling({k: v for k, v in ckpt.load_rank(tp_rank, pp_rank).items() if isinstance(v, torch.Tensor)})


def _zero_vocabulary_padding(model, cfg) -> None:
    """HF has no rows past its vocabulary: what a model holds there does not come back, and
    ``convert`` pads with zeros. Each TP rank holds an even share of the padded rows."""
    from megatron.core import parallel_state as ps

    text = getattr(cfg, "text_config", None)
    if text is None:
        return
    with torch.no_grad():
        for key, tensor in model.state_dict(keep_vars=True).items():
            if key.endswith(("word_embeddings.weight", "output_layer.weight")):
                start = ps.get_tensor_model_parallel_rank() * tensor.shape[0]
                tensor[max(0, text.vocab_size - start):] = 0


def _both_ways(rank: int, world: int, family: str, tp: int, pp: int, hf_dir: str, imported_mcore: str,
               out: str) -> dict:
    """Export of a randomly initialised Megatron model -> HF, converted by ``mmparity convert``,
    equals the model's own shards; ``import_hf`` of an HF release equals what ``convert`` makes
    of it. Returns this rank's differences."""
    from megatron.core import parallel_state as ps

    from mmparity.models.core import megatron_classes as models

    runtime.init_parallel(tp, pp, seed=11)
    cfg = live.family_config(hf_dir, family)
    model = models.build(families.get(family).megatron_class()[1].build, cfg)
    _zero_vocabulary_padding(model, cfg)
    exported = dict(live.export_hf(model, family, cfg, base=hf_dir))
    out = Path(out)
    if rank == 0:
        save_safetensors_checkpoint(out / "exported", exported, max_shard_size="30KB",
                                    extra_files={"config.json": (Path(hf_dir) / "config.json").read_bytes()})
        assert run("convert", "--family", family, "--src", out / "exported", "--dst", out / "mcore", "--to", "mcore",
                   "--format", "legacy", "--tp", tp, "--pp", pp, "--quiet") == 0
    torch.distributed.barrier()
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    problems = _differences(_model_state(model), _rank_file(out / "mcore", tp_rank, pp_rank), "export")

    fresh = models.build(families.get(family).megatron_class()[1].build, cfg)
    report = live.import_hf(fresh, hf_dir, family)
    problems += _differences(_model_state(fresh), _rank_file(Path(imported_mcore), tp_rank, pp_rank), "import")
    # And the export of what was imported is the release itself (the base fills only the aside).
    again = dict(live.export_hf(fresh, family, cfg, base=hf_dir))
    release = load_safetensors_state_dict(Path(hf_dir))
    problems += _differences(again, release, "re-export")
    return {"problems": problems, "exported": len(exported), "loaded_here": report.loaded_here,
            "aside": report.aside}


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    # LLaVA with a CLIP tower: the tower stock megatron-core's LLaVAModel builds.
    return {"llava": save_hf("llava", root / "llava", seed=7, cfg=llava_clip_config()),
            "clip": save_hf("clip", root / "clip", seed=7)}


@pytest.mark.parametrize("family,tp,pp", [("llava", 2, 1), ("clip", 2, 1), ("llava", 1, 2)])
def test_export_and_import_are_bit_exact_against_convert(releases, tmp_path, family, tp, pp):
    hf_dir = releases[family]
    imported = tmp_path / "imported"
    assert run("convert", "--family", family, "--src", hf_dir, "--dst", imported, "--to", "mcore",
               "--format", "legacy", "--tp", tp, "--pp", pp, "--quiet") == 0
    results = runtime.spawn(_both_ways, tp * pp, family, tp, pp, str(hf_dir), str(imported), str(tmp_path))
    assert [r["problems"] for r in results] == [[]] * (tp * pp)
    hf_names = load_safetensors_state_dict(hf_dir)
    assert {r["exported"] for r in results} == {len(hf_names)}
    # Every rank loads only its part, the parts together are the model.
    assert all(r["loaded_here"] > 0 for r in results)


def _negative(rank: int, world: int, hf_dir: str, broken_dir: str) -> dict:
    from mmparity.models.core import megatron_classes as models

    runtime.init_parallel(world, 1, seed=3)
    cfg = live.family_config(hf_dir, "clip")
    model = models.build(families.get("clip").megatron_class()[1].build, cfg)
    found = {}
    try:
        live.export_hf(model, "clip", cfg)
    except ConversionError as exc:
        found["no_base"] = exc.problems
    if rank == 1:  # a tensor only one rank holds: every rank must refuse, none may hang
        model.register_parameter("stray", torch.nn.Parameter(torch.zeros(3)))
    for name, call in (("export", lambda: live.export_hf(model, "clip", cfg, base=hf_dir)),
                       ("import", lambda: live.import_hf(model, hf_dir, "clip"))):
        try:
            call()
        except ConversionError as exc:
            found[name] = exc.problems
    if rank == 1:
        del model.stray
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    try:
        live.import_hf(model, broken_dir, "clip")
    except Exception as exc:  # the checkpoint is planned before anything is loaded
        found["broken"] = str(exc)
    found["untouched"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items() if k in before)
    return found


def test_missing_and_stray_tensors_are_listed_on_every_rank(releases, tmp_path):
    hf_dir = releases["clip"]
    broken = tmp_path / "broken"
    state = load_safetensors_state_dict(hf_dir)
    dropped = next(k for k in state if "layers.1.mlp.fc2.weight" in k)
    del state[dropped]
    save_safetensors_checkpoint(broken, state, max_shard_size="30KB",
                                extra_files={"config.json": (hf_dir / "config.json").read_bytes()})
    results = runtime.spawn(_negative, 2, str(hf_dir), str(broken))
    for r in results:
        assert any("ln_post" in p for p in r["no_base"]), r["no_base"]
        assert any("stray" in p for p in r["export"]) and any("stray" in p for p in r["import"])
        assert dropped in r["broken"]
        assert r["untouched"]
