"""Every HF-side layout transformers reads, per family: what its ``save_pretrained`` writes, the
release spelling where a release differs, and a ``state_dict()`` of module names. Each converts to
mcore and back bit for bit, in the layout it came in (same keys, ``torch.equal`` tensors), and the
saved layout also decodes through transformers' own conversion mapping at run time
(``--hf-format transformers``) to the very mcore tensors the family's table gives.

The model saved is the transformers class of the family's tiny config (for the tower families of a
whole model, Pixtral-Large and Kimi-K2.5's tower, that whole model: its language model is what the
family leaves out), with seeded random weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state
from mmparity.io.manifest import read_manifest
from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
from mmparity.io.fsio.safetensors_write import save_safetensors_checkpoint
from mmparity.cli.main import main

def _llava_clip():
    from mmparity.models.llava.megatron import llava_clip_config

    return llava_clip_config()


# Every family on its tiny config, and LLaVA on a CLIP tower too (the tower whose transformers 4
# release spelling differs: one level deeper).
CASES = {name: (name, None) for name in families.names()} | {"llava_clip": ("llava", _llava_clip)}
# The original hub spelling, where a release differs from what transformers saves.
RELEASES = {"pixtral": "mistral", "pixtral_large": "mistral", "kimi_k25": "release", "kimi_k25_vl": "release",
            "llava_clip": "hf_v4_checkpoint", "mistral3": "mistral", "pixtral_12b": "mistral",
            "gemma3": "hf_v4_checkpoint"}
# What a family leaves out of a whole model's checkpoint (the tower families of a whole VLM).
LEFT_OUT = ("language_model.", "model.language_model.", "lm_head.")


def run(*argv) -> int:
    return main([str(a) for a in argv])


def hf_model(family: str, cfg, seed: int):
    """The transformers model whose checkpoints the family reads: the reference itself, or for a
    family that is part of a whole model, that whole model."""
    from mmparity.models.core.saved_layout import _model_class

    fam = families.get(family)
    model = fam.build_reference(cfg)
    if not hasattr(model, "save_pretrained"):
        model = _model_class(cfg)(cfg).float().eval()
    model.load_state_dict(random_like_state(model.state_dict(), seed=seed))
    return model


def module_names_dir(model, cfg, path: Path) -> Path:
    save_safetensors_checkpoint(path, {k: v.contiguous() for k, v in model.state_dict().items()},
                                max_shard_size="30KB", extra_files={"config.json": cfg.to_json_string()})
    return path


def family_part(family: str, state: dict) -> dict:
    """The tensors of ``state`` the family converts (a tower family leaves the language model out;
    tied heads are the embedding's)."""
    return {k: v for k, v in state.items() if not k.startswith(LEFT_OUT)} if family in ("pixtral_large", "kimi_k25") \
        else state


def assert_round_trip(family: str, src: Path, tmp: Path, fmt: str, *export) -> Path:
    """HF ``src`` -> mcore (TP 2, ``fmt``) -> HF (with ``export`` options): the family's part of
    ``src`` back, key for key and bit for bit. Returns the mcore checkpoint."""
    mcore, back = tmp / f"mcore_{fmt}", tmp / f"back_{fmt}"
    assert run("convert", "--family", family, "--src", src, "--dst", mcore, "--to", "mcore", "--tp", 2,
               "--format", fmt, "--quiet") == 0
    assert run("convert", "--src", mcore, "--dst", back, "--to", "hf", "--quiet", *export) == 0
    expected = family_part(family, load_safetensors_state_dict(src))
    got = load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    return mcore


def mcore_tensors(mcore: Path) -> list:
    from mmparity.convert import read_mcore_shards

    _, _, shards = read_mcore_shards(mcore)
    return list(shards) + list(shards.side)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per case: (family, config, the model, its save_pretrained directory)."""
    root = tmp_path_factory.mktemp("saved")
    out = {}
    for seed, (case, (family, config)) in enumerate(CASES.items()):
        cfg = config() if config else families.get(family).tiny_config()
        model = hf_model(family, cfg, seed=seed)
        model.save_pretrained(root / case, max_shard_size="30KB")
        out[case] = family, cfg, model, root / case
    return out


@pytest.mark.parametrize("case", CASES)
def test_save_pretrained_layout_converts_and_comes_back_as_saved(case, saved, tmp_path):
    family, cfg, model, src = saved[case]
    stored = load_safetensors_state_dict(src)
    assert assert_round_trip(family, src, tmp_path, "legacy")
    # The table's reading and transformers' own mapping's reading give the same mcore tensors.
    by_table = mcore_tensors(tmp_path / "mcore_legacy")
    assert run("convert", "--family", family, "--src", src, "--dst", tmp_path / "through", "--to", "mcore",
               "--tp", 2, "--format", "legacy", "--hf-format", "transformers", "--quiet") == 0
    through = mcore_tensors(tmp_path / "through")
    assert len(through) == len(by_table)
    for a, b in zip(through, by_table):
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) for k in a)
    # And back through the mapping, as save_pretrained writes.
    assert run("convert", "--src", tmp_path / "through", "--dst", tmp_path / "through_back", "--to", "hf",
               "--quiet") == 0
    got = load_safetensors_state_dict(tmp_path / "through_back")
    expected = family_part(family, stored)
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("case", CASES)
def test_module_names_layout_converts_and_comes_back(case, saved, tmp_path):
    family, cfg, model, _ = saved[case]
    src = module_names_dir(model, cfg, tmp_path / "modules")
    assert_round_trip(family, src, tmp_path, "torch_dist")


@pytest.mark.parametrize("case", sorted(RELEASES))
def test_release_layout_converts_and_comes_back(case, saved, tmp_path):
    family, cfg, _, _ = saved[case]
    _, _, release = release_state(case, saved)
    src = tmp_path / "release"
    save_safetensors_checkpoint(src, release, max_shard_size="30KB", extra_files={"config.json": cfg.to_json_string()})
    # A Mistral-native release goes out as transformers saves it unless asked (docs/convert.md).
    export = ("--hf-format", "mistral") if RELEASES[case] == "mistral" else ()
    assert_round_trip(family, src, tmp_path, "legacy", *export)
    assert read_manifest(tmp_path / "mcore_legacy").provenance.extra["hf_format"] == RELEASES[case]


def release_state(case: str, saved) -> tuple:
    """(family, family config, the case's model in its release spelling)."""
    family, cfg, model, _ = saved[case]
    fam = families.get(family)
    fcfg = fam.family_config(cfg)
    part, _, _ = fam.select_tensors(fcfg, dict(model.state_dict()))
    return family, fcfg, fam.mcore_to_hf(fam.hf_to_mcore(part, fcfg, hf_format="hf"), fcfg, hf_format=RELEASES[case])


@pytest.mark.parametrize("case", ["kimi_k25", "kimi_k25_vl", "llava_clip"])
def test_transformers_mapping_reads_the_releases_it_was_written_for(case, saved):
    """Kimi-K2.5's release (``wqkv``, ``norm0``, ``mm_projector.proj.N``) and a transformers 4 LLaVA
    are what transformers' mapping loads: read through it, they give the table's very mcore
    tensors. The table stays first because export writes the release's spelling back, where
    transformers' reverse mapping writes its own save's (the table's note says how many differ)."""
    family, fcfg, release = release_state(case, saved)
    fam = families.get(family)
    by_table = fam.hf_to_mcore(release, fcfg, tp_size=2)
    through = fam.hf_to_mcore(release, fcfg, tp_size=2, hf_format="transformers")
    for a, b in zip(list(through) + through.side, list(by_table) + by_table.side, strict=True):
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert "differ from what its save_pretrained writes" in fam.rule_set(fcfg, "transformers", keys=release).mcore_note


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["saved", "modules", "release"])
@pytest.mark.parametrize("case", CASES)
def test_every_layout_checks(case, layout, saved, tmp_path):
    """``check --hf`` on each layout of each case: the weights are read (whatever the spelling)
    and the native model matches the reference."""
    family, cfg, model, src = saved[case]
    if layout == "modules":
        src = module_names_dir(model, cfg, tmp_path / "modules")
    elif layout == "release":
        if case not in RELEASES:
            pytest.skip(f"{case}: the release spelling is what transformers saves")
        _, _, release = release_state(case, saved)
        src = tmp_path / "release"
        save_safetensors_checkpoint(src, release, extra_files={"config.json": cfg.to_json_string()})
    assert run("check", family, "--hf", src, "--quiet") == 0


# --- a whole Kimi-K2.5 as transformers saves it ----------------------------------------------------

@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_whole_kimi_saved_by_transformers_converts_over_tp_ep_pp_and_back(fmt, saved, tmp_path):
    """The decoder as ``language_model.model.blocks.N``, the projector norm under ``model.``: to
    mcore at TP 2 x EP 2 x PP 2 and back in the same layout, bit for bit, and transformers loads
    the export into the model that was saved."""
    from transformers import Kimi_K25ForConditionalGeneration

    _, cfg, model, src = saved["kimi_k25_vl"]
    stored = load_safetensors_state_dict(src)
    assert any(k.startswith("language_model.model.blocks.") for k in stored)
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert run("convert", "--src", src, "--dst", mcore, "--to", "mcore", "--tp", 2, "--ep", 2, "--pp", 2,
               "--format", fmt, "--quiet") == 0
    assert read_manifest(mcore).provenance.extra["hf_format"] == "transformers"
    assert run("convert", "--src", mcore, "--dst", back, "--to", "hf", "--quiet") == 0
    got = load_safetensors_state_dict(back)
    assert sorted(got) == sorted(stored)
    assert all(got[k].dtype == stored[k].dtype and torch.equal(got[k], stored[k]) for k in stored)
    loaded = Kimi_K25ForConditionalGeneration.from_pretrained(back).state_dict()
    expected = model.state_dict()
    assert sorted(loaded) == sorted(expected)
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_a_save_transformers_cannot_read_back_is_refused_with_what_its_mapping_did(tmp_path, capsys):
    """Without a q LoRA rank, transformers 5.24 saves the decoder's q projection as ``self_wqkv``
    and its own from_pretrained fails on it (its Chunk splits one tensor in three): the same
    refusal here, one line naming the directory and the way out, which converts."""
    from transformers import Kimi_K25ForConditionalGeneration

    from mmparity.models.kimi_k25_vl import reference

    cfg = reference.tiny_config(q_lora_rank=None)
    model = hf_model("kimi_k25_vl", cfg, seed=4)
    src = tmp_path / "saved"
    model.save_pretrained(src)
    assert any(".self_wqkv." in k for k in load_safetensors_state_dict(src))
    with pytest.raises(RuntimeError):
        Kimi_K25ForConditionalGeneration.from_pretrained(src)
    capsys.readouterr()
    assert run("convert", "--src", src, "--dst", tmp_path / "mcore", "--to", "mcore", "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(src) in err and "self_wqkv" in err and "save_original_format=False" in err
    assert not (tmp_path / "mcore").exists()
    assert_round_trip("kimi_k25_vl", module_names_dir(model, cfg, tmp_path / "modules"), tmp_path, "legacy")
    # Export to the layout transformers would not read back is refused the same way.
    assert run("convert", "--src", tmp_path / "mcore_legacy", "--dst", tmp_path / "out", "--to", "hf",
               "--hf-format", "transformers", "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--hf-format hf" in err and "self_wqkv" in err


def _missing_expert(state):
    del state["language_model.model.blocks.1.mlp.experts.3.gate_proj.weight"]
    return "no language_model.model.blocks.1.mlp.experts.3.gate_proj.weight"


def _short_wqkv(state):
    state["vision_tower.encoder.blocks.0.wqkv.weight"] = state["vision_tower.encoder.blocks.0.wqkv.weight"][:-4].clone()
    return "vision_tower.encoder.blocks.0.wqkv.weight is (140, 48), save_pretrained writes (144, 48)"


def _wide_norm(state):
    state["language_model.model.blocks.0.input_layernorm.weight"] = torch.ones(41)
    return "language_model.model.blocks.0.input_layernorm.weight is (41,)"


def _stray(state):
    state["language_model.model.blocks.0.self_attn.extra.weight"] = torch.ones(3)
    return "unconsumed source tensor language_model.model.blocks.0.self_attn.extra.weight"


@pytest.mark.parametrize("damage", [_missing_expert, _short_wqkv, _wide_norm, _stray],
                         ids=["missing_expert", "short_wqkv", "wide_norm", "stray"])
def test_a_damaged_save_is_one_line_naming_the_directory_and_what_differs(damage, saved, tmp_path, capsys):
    _, cfg, _, src = saved["kimi_k25_vl"]
    state = load_safetensors_state_dict(src)
    expected = damage(state)
    bad = tmp_path / "bad"
    save_safetensors_checkpoint(bad, state, extra_files={"config.json": cfg.to_json_string()})
    capsys.readouterr()
    assert run("convert", "--src", bad, "--dst", tmp_path / "out", "--to", "mcore", "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(bad) in err and expected in err, err
    assert not (tmp_path / "out").exists()
