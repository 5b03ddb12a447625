"""One part of a whole VLM as the Megatron class that trains it alone: ``convert --part``.

Megatron-LM cannot build every whole VLM (its ``LLaVAModel`` takes neither the Kimi-K2.5 nor the
Mistral3 tower), so users train the language model the way ``pretrain_gpt.py`` builds it, as a
``GPTModel`` whose keys carry no ``language_model.`` root. ``--part language_model`` writes exactly
that layout (and says what it left out, in counts and bytes); its manifest names the part and the
class; ``verify --load`` loads it into ``GPTModel`` and refuses another class by name; ``convert
--to hf --base`` makes the whole release again, the other parts from the base.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmparity.models import registry as families
from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
from mmparity.io.legacy import open_legacy
from tests.mapping.test_convert_roundtrips import assert_same_checkpoint, save_hf
from tests.faults.test_faults import one_line_error, run_cli

WHOLE = ["llava", "mistral3", "pixtral_12b", "kimi_k25_vl"]
ROOT = "language_model."


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("part")
    return {name: save_hf(name, root / name, seed=7 + i) for i, name in enumerate(WHOLE)}


def _whole_keys(family: str, release: Path) -> dict:
    """The whole model's mcore tensors at TP 1 (the in-memory converter), TE spelling."""
    fam = families.get(family)
    cfg = fam.tiny_config()
    return dict(fam.hf_to_mcore(load_safetensors_state_dict(release), cfg)[0])


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", WHOLE)
def test_language_model_alone_is_gptmodels_layout_and_comes_back_whole(capsys, tmp_path, releases, family, fmt):
    release = releases[family]
    part = tmp_path / "lm"
    code, out, err = run_cli(capsys, "convert", "--src", release, "--dst", part, "--to", "mcore", "--part",
                             "language_model", "--format", fmt)
    assert code == 0, err
    assert "laid out for Megatron's GPTModel" in out and "--part language_model: left out" in out
    manifest = json.loads((part / "mmparity.json").read_text())
    assert manifest["extra"]["part"] == "language_model" and manifest["extra"]["megatron_class"] == "GPTModel"
    whole = _whole_keys(family, release)
    expected = {k[len(ROOT):]: v for k, v in whole.items() if k.startswith(ROOT)}
    if fmt == "legacy":
        stored = {k: v for k, v in open_legacy(part).load_rank(0).items()
                  if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
        assert sorted(stored) == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(stored[key], value), key
    # What it left out is the rest, by module, adding up to the whole source.
    left = manifest["extra"]["left_out"]
    assert left["converted"] + sum(n for _, n, _ in left["left_out"]) == len(load_safetensors_state_dict(release))
    back = tmp_path / "back"
    code, out, err = run_cli(capsys, "convert", "--src", part, "--dst", back, "--to", "hf", "--base", release)
    assert code == 0, err
    assert_same_checkpoint(back, release)
    # What came from the base is exactly what the part never held.
    from_base = set(json.loads((back / "mmparity.json").read_text())["extra"]["from_base"]["tensors"])
    assert from_base and not any("language_model" in k or k in ("lm_head.weight", "output.weight") for k in from_base)


def test_args_describe_the_gpt_model(capsys, tmp_path, releases):
    part = tmp_path / "lm"
    code, _, err = run_cli(capsys, "convert", "--src", releases["mistral3"], "--dst", part, "--to", "mcore",
                           "--part", "language_model", "--format", "legacy", "--tp", "2", "--pp", "2")
    assert code == 0, err
    cfg = families.get("mistral3").tiny_config().text_config
    args = torch.load(part / "iter_0000001" / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False)["args"]
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    # The first stage holds the embedding and its layers, the last the final norm and the head.
    first = open_legacy(part).load_rank(0, 0)
    last = open_legacy(part).load_rank(0, 1)
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" in last
    assert not any(k.startswith(("vision_model.", "vision_projection.", ROOT)) for k in {**first, **last})


def test_whole_mcore_checkpoint_to_its_language_model(capsys, tmp_path, releases):
    """An mcore checkpoint of the whole (LLaVAModel's layout) re-laid out as the part alone."""
    release = releases["kimi_k25_vl"]
    whole = tmp_path / "whole"
    assert run_cli(capsys, "convert", "--src", release, "--dst", whole, "--to", "mcore", "--format", "legacy")[0] == 0
    part = tmp_path / "part"
    code, out, err = run_cli(capsys, "convert", "--src", whole, "--dst", part, "--to", "mcore", "--part",
                             "language_model", "--format", "legacy", "--tp", "2", "--ep", "2")
    assert code == 0, err
    assert "left out" in out and "vision_model" in out and "vision_projection" in out
    back = tmp_path / "back"
    assert run_cli(capsys, "convert", "--src", part, "--dst", back, "--to", "hf", "--base", release)[0] == 0
    assert_same_checkpoint(back, release)


def test_refusals_are_one_line(capsys, tmp_path, releases):
    release = releases["llava"]
    # A tower family is one model: it has no parts.
    clip = save_hf("clip", tmp_path / "clip", seed=3)
    one_line_error(*run_cli(capsys, "convert", "--src", clip, "--dst", tmp_path / "a", "--to", "mcore", "--part",
                            "language_model"), "--part language_model", "one model")
    # An unknown part names the parts there are.
    one_line_error(*run_cli(capsys, "convert", "--src", release, "--dst", tmp_path / "b", "--to", "mcore",
                            "--part", "tower"), "--part tower", "language_model, vision_model, vision_projection")
    # HF output is the whole model.
    one_line_error(*run_cli(capsys, "convert", "--src", release, "--dst", tmp_path / "c", "--to", "hf",
                            "--part", "language_model"), "--part", "--base")
    part = tmp_path / "lm"
    assert run_cli(capsys, "convert", "--src", release, "--dst", part, "--to", "mcore", "--part",
                   "language_model")[0] == 0
    # A part is not another part, nor a whole model to check or export without its base.
    one_line_error(*run_cli(capsys, "convert", "--src", part, "--dst", tmp_path / "d", "--to", "mcore",
                            "--part", "vision_model"), "language_model alone", "GPTModel")
    one_line_error(*run_cli(capsys, "convert", "--src", part, "--dst", tmp_path / "e", "--to", "hf"),
                   "language_model alone", "--base HF_DIR")
    one_line_error(*run_cli(capsys, "check", "--mcore", part), "language_model alone", "verify --load")
    for name in "abcde":
        assert not (tmp_path / name).exists()


def test_a_manifest_naming_another_part_is_not_believed(capsys, tmp_path, releases):
    whole = tmp_path / "whole"
    assert run_cli(capsys, "convert", "--src", releases["mistral3"], "--dst", whole, "--to", "mcore")[0] == 0
    manifest = json.loads((whole / "mmparity.json").read_text())
    manifest["extra"]["part"] = "language_model"
    (whole / "mmparity.json").write_text(json.dumps(manifest))
    one_line_error(*run_cli(capsys, "convert", "--src", whole, "--dst", tmp_path / "x", "--to", "hf"),
                   "mmparity.json", "records part 'language_model'", "the whole model")


def test_verify_says_what_it_is_laid_out_for(capsys, tmp_path, releases):
    part = tmp_path / "lm"
    assert run_cli(capsys, "convert", "--src", releases["mistral3"], "--dst", part, "--to", "mcore",
                   "--part", "language_model")[0] == 0
    code, out, _ = run_cli(capsys, "verify", part)
    assert code == 0 and "for Megatron's GPTModel (the language_model alone)" in out
    # Megatron's LLaVAModel cannot build Mistral3's Pixtral tower: the whole is named in its module
    # layout, and the manifest claims no class for it; InternVL's whole is LLaVAModel's.
    whole = tmp_path / "whole"
    assert run_cli(capsys, "convert", "--src", releases["mistral3"], "--dst", whole, "--to", "mcore")[0] == 0
    code, out, _ = run_cli(capsys, "verify", whole)
    assert code == 0 and "for Megatron's" not in out and "alone" not in out
    llava = tmp_path / "internvl"
    assert run_cli(capsys, "convert", "--src", save_hf("internvl", tmp_path / "internvl_hf", seed=3), "--dst",
                   llava, "--to", "mcore")[0] == 0
    code, out, _ = run_cli(capsys, "verify", llava)
    assert code == 0 and "for Megatron's LLaVAModel" in out and "alone" not in out


@pytest.mark.parametrize("family", ["mistral3", "kimi_k25_vl"])
def test_verify_load_takes_gptmodel_and_refuses_another_class_by_name(capsys, tmp_path, releases, family):
    part = tmp_path / "lm"
    assert run_cli(capsys, "convert", "--src", releases[family], "--dst", part, "--to", "mcore",
                   "--part", "language_model")[0] == 0
    code, out, err = run_cli(capsys, "verify", "--load", part)
    assert code == 0, out + err
    assert "strict load into Megatron's GPTModel" in out and "all ranks load" in out
    other = next(name for name in families.get(family).hooks.megatron if name != "GPTModel")
    one_line_error(*run_cli(capsys, "verify", "--load", part, "--megatron-class", other),
                   "language_model alone", "GPTModel", other)


def _hooks_whole_class(family: str, cfg) -> str:
    """The class of the whole the family's Megatron hooks build for ``cfg`` ("" where none)."""
    from mmparity.models.spec import NoMegatron, NoMegatronClass

    fam = families.get(family)
    if isinstance(fam.hooks.megatron, NoMegatron) or "LLaVAModel" not in fam.hooks.megatron:
        return ""
    try:
        _, record = fam.megatron_class("LLaVAModel", cfg)
    except NoMegatronClass:
        return ""
    return "" if record.holds else "LLaVAModel"


@pytest.mark.parametrize("family", families.names())
def test_the_class_a_manifest_names_is_the_one_megatron_builds(family):
    """``convert`` names the class of the whole from the family's record, which reads the config
    alone (no model code): it must say what the family's Megatron hooks build, config by config."""
    from tests.io.test_megatron_written import llava_clip_config

    fam = families.get(family)
    configs = [fam.tiny_config()]
    if family == "llava":
        configs.append(llava_clip_config())
    if family == "internvl":
        configs.append(fam.tiny_config())
        configs[-1].vision_feature_layer, configs[-1].vision_config.use_mean_pooling = -1, False
    for cfg in configs:
        named = fam.megatron_whole(cfg) if fam.megatron_whole is not None else ""
        assert named == _hooks_whole_class(family, cfg), (family, named)
