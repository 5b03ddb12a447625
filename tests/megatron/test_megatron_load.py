"""What `mmparity convert` writes loads strictly into Megatron's own classes.

Each family's Megatron class (the installed megatron-core's stock ``CLIPViTModel`` for clip and
siglip, ``LLaVAModel`` for llava; Megatron-LM main's ``vit_model`` classes for the others, which
skip where that is not on ``PYTHONPATH``), built as ``mmparity verify --load`` builds it, receives
the legacy rank files (``load_state_dict(strict=True)`` per rank) and the torch_dist checkpoint
(``dist_checkpointing.load`` against the class's whole ``sharded_state_dict()``, its
``_extra_state`` objects included) at TP 1 and TP 2 (spawned gloo ranks). Nothing may be
unexpected, missing (TE's ``_extra_state`` slots included: convert writes them empty) or
mis-shaped, and what was loaded must be the converted tensors themselves. What the class has no
place for is in the side file, never in the state dict.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlavaConfig

from mmparity.models import registry as families
from mmparity.parallel import runtime
from mmparity.io.manifest import read_manifest
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
from mmparity.megatron.load import build_and_load, load_job
from mmparity.io.formats.mcore import SIDE_FILE
from mmparity.cli.main import main
from mmparity.parallel import pp as pp_mod
from mmparity.mapping.rules import side_keys
from mmparity.models.core import megatron_classes as models
from mmparity.models.pixtral import megatron as pixtral_megatron
from tests import megatron_interop as mi
from tests.mapping.test_convert_roundtrips import save_hf

NEEDS_MAIN = pytest.mark.skipif(not models.available(),
                                reason="needs Megatron-LM main (vit_model) on PYTHONPATH")
# Every family whose Megatron class holds the whole checkpoint, from the registry. The stock ones
# always run; the vit_model ones where Megatron-LM main is importable (CI cannot fetch it).
FAMILIES = [pytest.param(f, marks=NEEDS_MAIN) if mi.needs_megatron_lm_main(f) else pytest.param(f)
            for f in mi.whole_class_families()]


def llava_clip_config():
    """LLaVA on the CLIP tiny tower (stock megatron-core's LLaVAModel builds CLIP-like towers
    only): penultimate-layer features, class token dropped, the llava tiny text model."""
    base = families.get("llava").tiny_config()
    return LlavaConfig(vision_config=families.get("clip").tiny_config(), text_config=base.text_config,
                       image_token_index=base.image_token_index, projector_hidden_act="gelu",
                       vision_feature_layer=-2, vision_feature_select_strategy="default",
                       multimodal_projector_bias=True, tie_word_embeddings=False)


def config_for(family: str):
    return llava_clip_config() if family == "llava" else families.get(family).tiny_config()


def _rank(rank: int, world: int, job, family: str, hf_dir: str) -> dict:
    job.init_parallel()
    try:
        model = build_and_load(rank, world, job)
        # The weights are the converter's for this TP size (torch_dist's vocabulary, padded as for
        # TP 1, is re-padded by Megatron's own load), not whatever the class was initialised with.
        expected = families.get(family).hf_to_mcore(load_safetensors_state_dict(hf_dir), job.cfg,
                                                    tp_size=world)
        loaded = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        differ = [k for k, v in expected[rank].items() if not torch.equal(loaded[k], v)]
        return {"differ": differ, "keys": sorted(expected[rank])}
    finally:
        runtime.teardown_parallel()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Each family's seeded HF directory, made once when a test first asks for it."""
    root = tmp_path_factory.mktemp("hf")
    made = {}

    def _hf_dir(family: str) -> Path:
        if family not in made:
            made[family] = save_hf(family, root / family, seed=3, cfg=config_for(family))
        return made[family]

    return _hf_dir


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", FAMILIES)
def test_convert_output_loads_strictly_into_megatron(family, fmt, tp, hf_dirs, tmp_path):
    hf_dir = hf_dirs(family)
    dst = tmp_path / "mcore"
    assert main(["convert", "--family", family, "--src", str(hf_dir), "--dst", str(dst),
                 "--to", "mcore", "--format", fmt, "--tp", str(tp), "--quiet"]) == 0
    # torch_dist holds global tensors (written once, TP 1): it is loaded at the TP size asked for.
    job, _, _, world = load_job(dst, tp=tp)
    assert world == tp
    if tp == 1:
        results = [_rank(0, 1, job, family, str(hf_dir))]
    else:
        results = runtime.spawn(_rank, tp, job, family, str(hf_dir))
    for rank, result in enumerate(results):
        assert result["differ"] == [] and result["keys"], (family, fmt, tp, rank)
    side = {r.key for r in read_manifest(dst).tensors if r.file == SIDE_FILE}
    assert side == set(side_keys(families.get(family).rule_set(config_for(family))))


def _stage(rank: int, world: int, job, hf_dir: str) -> dict:
    """This rank's stage of LLaVAModel, loaded from its legacy file, against the converter's
    tensors split into stages as Megatron-LM numbers them (locally)."""
    job.init_parallel()
    try:
        model = build_and_load(rank, world, job)
        shards = families.get("llava").hf_to_mcore(load_safetensors_state_dict(hf_dir), job.cfg, tp_size=job.grid.tp.size)
        layout = pp_mod.pipeline_layout(list(shards[0]))
        stage = pp_mod.split_pipeline_stages(shards[rank % job.grid.tp.size], job.layer_counts, layer_prefix=layout.layer_prefix,
                                             last_stage_prefixes=layout.last_stage_keys)[rank // job.grid.tp.size]
        loaded = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        return {"differ": [k for k, v in stage.items() if not torch.equal(loaded[k], v)],
                "keys": sorted(stage), "loaded": sorted(loaded)}
    finally:
        runtime.teardown_parallel()


@pytest.mark.slow
def test_llava_pipeline_stages_load_strictly_into_llava_model(tmp_path):
    """PP 2 over three language layers ([2, 1]): stage 0 holds the tower, projector, embedding and
    two layers, stage 1 one layer (numbered 0), the final norm and the output layer, each rank
    loading into LLaVAModel built for its stage."""
    cfg = llava_clip_config()
    cfg.text_config.num_hidden_layers = 3
    hf_dir = save_hf("llava", tmp_path / "hf", seed=4, cfg=cfg)
    dst = tmp_path / "mcore"
    assert main(["convert", "--family", "llava", "--src", str(hf_dir), "--dst", str(dst), "--to", "mcore",
                 "--format", "legacy", "--pp", "2", "--quiet"]) == 0
    job, _, _, world = load_job(dst)
    assert (job.grid.tp.size, job.grid.pp.size, job.layer_counts, world) == (1, 2, (2, 1), 2)
    first, last = runtime.spawn(_stage, world, job, str(hf_dir))
    for stage in (first, last):
        assert stage["differ"] == [] and stage["keys"] == [k for k in stage["loaded"] if k in stage["keys"]]
    assert any(k.startswith("vision_model.") for k in first["keys"])
    assert not any(k.startswith(("vision_model.", "language_model.embedding.")) for k in last["keys"])
    assert "language_model.output_layer.weight" in last["keys"]
    assert {k.split(".")[3] for k in last["keys"] if k.startswith("language_model.decoder.layers.")} == {"0"}


def _tied_tables(rank: int, world: int, job) -> dict:
    """This rank's stage of LLaVAModel loaded strictly from its legacy file: its embedding table
    (first stage) or its output layer (last stage)."""
    job.init_parallel()
    try:
        model = build_and_load(rank, world, job)
        state = {k: v.clone() for k, v in model.state_dict().items()
                 if k.endswith(("word_embeddings.weight", "output_layer.weight")) and torch.is_tensor(v)}
        return state
    finally:
        runtime.teardown_parallel()


@pytest.mark.slow
def test_a_tied_head_goes_to_the_last_stage_as_megatron_keeps_it(tmp_path):
    """With a tied head at PP 2, Megatron's last stage keeps its own copy of the table as
    ``output_layer.weight`` (the gradients of the two are summed, so they stay equal): a legacy
    file of that stage without it fails a strict load. ``convert`` writes the copy; reading it back,
    the copy must equal the table, and the export is the release again."""
    cfg = llava_clip_config()
    cfg.text_config.num_hidden_layers = 3
    cfg.tie_word_embeddings = cfg.text_config.tie_word_embeddings = True
    hf_dir = save_hf("llava", tmp_path / "hf", seed=4, cfg=cfg)
    dst = tmp_path / "mcore"
    assert main(["convert", "--family", "llava", "--src", str(hf_dir), "--dst", str(dst), "--to", "mcore",
                 "--format", "legacy", "--pp", "2", "--quiet"]) == 0
    job, _, _, world = load_job(dst)
    first, last = runtime.spawn(_tied_tables, world, job)
    assert list(first) == ["language_model.embedding.word_embeddings.weight"]
    assert list(last) == ["language_model.output_layer.weight"]
    assert torch.equal(first["language_model.embedding.word_embeddings.weight"], last["language_model.output_layer.weight"])
    back = tmp_path / "back"
    assert main(["convert", "--src", str(dst), "--dst", str(back), "--to", "hf", "--quiet"]) == 0
    want, got = load_safetensors_state_dict(hf_dir), load_safetensors_state_dict(back)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # A copy that is not the table (a last stage trained apart) is refused by name, not dropped.
    stage = next(dst.rglob("mp_rank_00_001/model_optim_rng.pt"))
    payload = torch.load(stage, weights_only=False)
    payload["model"]["language_model.output_layer.weight"] += 1
    torch.save(payload, stage)
    assert main(["convert", "--src", str(dst), "--dst", str(tmp_path / "bad"), "--to", "hf", "--quiet"]) == 2


def test_a_pipelined_tower_is_refused_by_name(tmp_path):
    hf_dir = save_hf("clip", tmp_path / "hf", seed=4)
    dst = tmp_path / "mcore"
    assert main(["convert", "--family", "clip", "--src", str(hf_dir), "--dst", str(dst), "--to", "mcore",
                 "--format", "legacy", "--pp", "2", "--quiet"]) == 0
    with pytest.raises(CheckpointError, match="PP 2: Megatron's CLIPViTModel is not built in pipeline stages"):
        load_job(dst)


def test_llava_on_a_pixtral_tower_loads_part_by_part(tmp_path, capsys):
    """LLaVAModel cannot be built on a vit_model tower (discrepancy 5): the family's default LLaVA,
    whose tiny tower is Pixtral, loads into GPTModel and the tower part (Megatron-LM main's
    ViTModel with the projector) or, where that cannot be imported, into GPTModel and
    MultimodalProjector with the tower named as not loaded; asking for LLaVAModel is refused in
    one line, before anything is spawned."""
    assert families.get("llava").tiny_config().vision_config.model_type == "pixtral"
    hf_dir = save_hf("llava", tmp_path / "hf", seed=5)
    dst = tmp_path / "mcore"
    assert main(["convert", "--src", str(hf_dir), "--dst", str(dst), "--to", "mcore", "--quiet"]) == 0
    job, _, name, _ = load_job(dst)
    assert "LLaVAModel" not in name and name.startswith("GPTModel + ")
    assert any("discrepancy 5" in note for note in job.notes)
    held = [prefix for part in job.parts for prefix in part.holds]
    if models.available(pixtral_megatron.build_pixtral):
        assert name == "GPTModel + ViTModel+MultimodalProjector" and not job.not_loaded
    else:
        assert name == "GPTModel + MultimodalProjector" and "vision_model." not in held
        assert [n.prefixes for n in job.not_loaded] == [("vision_model.",)]
    capsys.readouterr()
    assert main(["verify", "--load", str(dst)]) == 0
    assert "rank 0: ok" in capsys.readouterr().out
    assert main(["verify", "--load", str(dst), "--megatron-class", "LLaVAModel"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "discrepancy 5" in err[0] and "leave --megatron-class out" in err[0]
