"""Telling a checkpoint's family from its config, and saying what a partial conversion left out.

`check --hf DIR` and `convert --src HF_DIR` without `--family` read `architectures`, `model_type`
and `vision_config.model_type` (or Mistral's params.json) and name the family on one line; a
family that takes only part of a checkpoint (a tower family on a whole VLM) converts that part
and reports the rest, counted independently here from the safetensors headers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state
from mmparity.io.fsio.errors import CheckpointError
from mmparity.convert.configs import detect_family, read_config_facts
from mmparity.convert import ConvertOptions, convert
from mmparity.cli.common import human_bytes
from mmparity.cli.main import main
from mmparity.models.registry import ConfigFacts, Family, Takes
from tests.mapping.test_convert_roundtrips import save_hf


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, out, err, *needles) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and out == "" and len(lines) == 1, (code, out, err)
    assert "Traceback" not in err and all(n in lines[0] for n in needles), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def own_dirs(tmp_path_factory):
    """Each family's tiny reference model as saved (transformers' save_pretrained where it has one)."""
    root = tmp_path_factory.mktemp("own")
    return {name: save_hf(name, root / name, seed=i) for i, name in enumerate(families.names())}


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory) -> Path:
    """A whole Mistral3ForConditionalGeneration (tower, projector, language model) as transformers saves it."""
    from transformers import Mistral3ForConditionalGeneration

    model = Mistral3ForConditionalGeneration(families.get("pixtral_large").tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=3))
    path = tmp_path_factory.mktemp("whole") / "mistral3"
    model.save_pretrained(path)
    return path


def _config_dir(path: Path, config: dict | None = None, params: dict | None = None) -> Path:
    """A directory with a config (or params.json) and a one-tensor safetensors file beside it."""
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if params is not None:
        (path / "params.json").write_text(json.dumps(params))
    name = "consolidated.safetensors" if params is not None else "model.safetensors"
    save_file({"w": torch.zeros(2)}, path / name)
    return path


# --------------------------------------------------------------------------------------------------
# detection from the config


@pytest.mark.parametrize("family", families.names())
def test_each_family_is_told_from_its_own_tiny_checkpoint(family, own_dirs):
    facts = read_config_facts(own_dirs[family])
    detection = families.detect(facts)
    # A checkpoint holding part of a whole model goes to the whole-model family where one is
    # registered (config.json says what the model is, not which tensors were saved).
    assert detection.family == family or (detection.whole and families.get(family).takes(facts)[0] == 1)
    assert detection.line().startswith(f"family: {detection.family} (from config.json: ")


def test_every_family_says_what_it_takes():
    for name in families.names():
        family = families.get(name)
        assert family.takes_whole or family.takes_part, name
        assert all(isinstance(t, Takes) for t in family.takes_whole + family.takes_part), name


def test_whole_llava_is_llava_and_its_tower_family_takes_part(own_dirs):
    facts = read_config_facts(own_dirs["llava"])
    assert facts.architectures == ("LlavaForConditionalGeneration",) and facts.vision_model_type == "pixtral"
    detection = detect_family(own_dirs["llava"])
    assert detection.family == "llava" and detection.whole
    assert detection.line() == ("family: llava (from config.json: architectures LlavaForConditionalGeneration, "
                                "model_type llava, vision_config.model_type pixtral, text_config.model_type llama)")
    assert families.get("pixtral").takes(facts)[0] == 1 and families.whole_takers(facts) == ["llava"]


@pytest.mark.parametrize("facts, family, whole", [
    (ConfigFacts("config.json", ("LlavaForConditionalGeneration",), "llava", "clip_vision_model"), "llava", True),
    (ConfigFacts("config.json", ("SiglipModel",), "siglip"), "siglip", False),
    (ConfigFacts("config.json", ("CLIPModel",), "clip"), "clip", False),
    (ConfigFacts("config.json", ("Qwen3_5MoeForConditionalGeneration",), "qwen3_5_moe", "qwen3_5_moe_vision"),
     "qwen3_5_whole", True),
    (ConfigFacts("config.json", ("Kimi_K25ForConditionalGeneration",), "kimi_k25", "kimi_k25_vision"),
     "kimi_k25", False),
    (ConfigFacts("config.json", (), "clip_vision_model"), "clip", True),  # a config saved without a model
])
def test_whole_vlm_configs_and_their_part_families(facts, family, whole):
    detection = families.detect(facts)
    assert (detection.family, detection.whole) == (family, whole)
    if not whole:
        assert "takes part of it, no registered family takes the whole" in detection.line()


def test_the_tower_of_a_llava_is_its_tower_family_part():
    facts = ConfigFacts("config.json", ("LlavaForConditionalGeneration",), "llava", "clip_vision_model")
    assert families.get("clip").takes(facts)[0] == 1 and families.get("siglip").takes(facts) == (0, 0)
    assert families.whole_clause(facts) == "family llava takes the whole LlavaForConditionalGeneration checkpoint"


def test_whole_mistral3_is_mistral3_and_pixtral_large_takes_part(mistral3):
    facts = read_config_facts(mistral3)
    assert facts.architectures == ("Mistral3ForConditionalGeneration",)
    detection = families.detect(facts)
    assert detection.family == "mistral3" and detection.whole
    assert not families.converts_whole("pixtral_large", facts)
    assert families.whole_clause(facts).startswith("family mistral3 takes the whole")


def test_pixtral_12b_is_told_from_another_llava_by_its_text_model(own_dirs):
    assert families.detect(read_config_facts(own_dirs["pixtral_12b"])).family == "pixtral_12b"
    assert families.detect(read_config_facts(own_dirs["llava"])).family == "llava"  # a Llama decoder


def test_mistral_native_release_is_detected_from_params_json(tmp_path):
    merged = _config_dir(tmp_path / "small31", params={"dim": 8, "vision_encoder": {"hidden_size": 8,
                                                                                     "spatial_merge_size": 2}})
    facts = read_config_facts(merged)
    assert (facts.source, facts.layout, facts.vision_model_type) == ("params.json", "mistral_native", "pixtral")
    assert families.detect(facts).family == "mistral3"
    plain = _config_dir(tmp_path / "pixtral12b", params={"dim": 8, "vision_encoder": {"hidden_size": 8}})
    assert families.detect(read_config_facts(plain)).family == "pixtral_12b"
    text_only = _config_dir(tmp_path / "text", params={"dim": 8})
    with pytest.raises(families.DetectError, match="no registered family takes this checkpoint"):
        detect_family(text_only)


# --------------------------------------------------------------------------------------------------
# what cannot be told: exit 2, one line


def test_ambiguous_config_is_one_line_naming_the_candidates(tmp_path, capsys):
    src = _config_dir(tmp_path / "src", {"architectures": ["CLIPVisionModel"], "model_type": "siglip_vision_model"})
    with pytest.raises(families.DetectError):
        detect_family(src)
    code, out, err = run_cli(capsys, "check", "--hf", src, "--quiet")
    one_line_error(code, out, err, "clip and siglip", "--family", "CLIPVisionModel")
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / "out", "--to", "mcore")
    one_line_error(code, out, err, "clip and siglip", "--family")
    assert not (tmp_path / "out").exists()


def test_config_no_family_takes_is_one_line_listing_what_was_seen(tmp_path, capsys):
    src = _config_dir(tmp_path / "src", {"architectures": ["BertModel"], "model_type": "bert"})
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp_path / "out", "--to", "mcore")
    one_line_error(code, out, err, "BertModel", "model_type bert", *families.names())
    code, out, err = run_cli(capsys, "check", "--hf", src)
    one_line_error(code, out, err, "BertModel", "registered families: " + ", ".join(families.names()))


@pytest.mark.parametrize("config, match", [
    ('{"architectures": "LlavaForConditionalGeneration"}', "expected a list of class names"),
    ('{"model_type": 7}', "model_type is 7, expected a string"),
    ('{"vision_config": {"model_type": ["pixtral"]}}', "vision_config.model_type"),
    ('[1, 2]', "not an object"),
    ('{"a": ' * 100_000 + '1' + '}' * 100_000, "unreadable config"),
])
def test_config_of_the_wrong_shape_is_refused(tmp_path, capsys, config, match):
    src = _config_dir(tmp_path / "src")
    (src / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match=match):
        read_config_facts(src)
    code, out, err = run_cli(capsys, "check", "--hf", src)
    one_line_error(code, out, err, match)


def test_config_that_is_no_regular_file_or_links_out_is_refused(tmp_path):
    src = _config_dir(tmp_path / "fifo")
    os.mkfifo(src / "config.json")  # reading it would block forever
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_config_facts(src)
    outside = tmp_path / "elsewhere.json"
    outside.write_text('{"model_type": "pixtral"}')
    linked = _config_dir(tmp_path / "linked")
    (linked / "config.json").symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        read_config_facts(linked)


# --------------------------------------------------------------------------------------------------
# a family that converts part of a checkpoint says what it left out


def _expected_left_out(directory: Path, converted_prefixes: tuple) -> dict:
    """Per top module, (tensors, bytes) of what is not under ``converted_prefixes``, from the headers."""
    out: dict[str, list[int]] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            for key in handle.keys():
                sliced = handle.get_slice(key)
                dtype = getattr(torch, {"F32": "float32", "BF16": "bfloat16", "F16": "float16",
                                        "I64": "int64"}[sliced.get_dtype()])
                nbytes = torch.Size(sliced.get_shape()).numel() * dtype.itemsize
                module = "total" if key.startswith(converted_prefixes) else key.split(".")[0]
                for group in (module, "all"):
                    entry = out.setdefault(group, [0, 0])
                    entry[0] += 1
                    entry[1] += nbytes
    return out


def test_convert_part_of_whole_mistral3_reports_what_it_left_out(mistral3, tmp_path, capsys):
    expected = _expected_left_out(mistral3, ("vision_tower.", "multi_modal_projector."))
    modules = {m: v for m, v in expected.items() if m not in ("all", "total")}
    assert set(modules) == {"language_model"}  # transformers writes the legacy names to disk
    code, out, err = run_cli(capsys, "convert", "--family", "pixtral_large", "--src", mistral3, "--dst",
                             tmp_path / "m", "--to", "mcore")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and "left out" not in lines[0], out
    n, nbytes = modules["language_model"]
    all_n, all_bytes = expected["all"]
    whole = families.whole_takers(read_config_facts(mistral3))
    assert lines[1] == (
        f"pixtral_large: left out {n} of {all_n} source tensors ({human_bytes(nbytes)} of {human_bytes(all_bytes)}): "
        f"language_model ({n} tensors, {human_bytes(nbytes)}); converted the other {all_n - n} "
        f"({human_bytes(all_bytes - nbytes)}); "
        + (f"family {whole[0]} takes" if whole else "no registered family takes")
        + " the whole Mistral3ForConditionalGeneration checkpoint")
    code, out, _ = run_cli(capsys, "verify", tmp_path / "m")
    assert code == 0 and f"made from part of its source: left out {n} of {all_n} source tensors: language_model" in out

    # The API: exact numbers, converted + left out = the whole source; the family told from config.
    result = convert(ConvertOptions(src=mistral3, dst=tmp_path / "api", to="mcore",
                                    family=None if not whole else "pixtral_large"))
    use = result.source_use
    assert (use.converted, use.converted_bytes) == tuple(expected["total"])
    assert use.left_out == (("language_model", n, nbytes),)
    assert (use.tensors, use.nbytes) == (all_n, all_bytes)
    if not whole:
        assert result.detection.family == "pixtral_large" and not result.detection.whole


def test_convert_of_a_whole_checkpoint_by_its_own_family_reports_nothing_left_out(own_dirs, tmp_path, capsys):
    code, out, err = run_cli(capsys, "convert", "--src", own_dirs["pixtral"], "--dst", tmp_path / "m", "--to", "mcore")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "family: pixtral (from config.json: architectures PixtralVisionModel, model_type pixtral)"
    assert len(lines) == 2 and "left out" not in out
    code, out, _ = run_cli(capsys, "verify", tmp_path / "m")
    assert code == 0 and "part of its source" not in out


def test_module_names_of_left_out_tensors():
    from mmparity.mapping.rules import module_of

    assert module_of("model.language_model.layers.0.mlp.up_proj.weight") == "model.language_model"
    assert module_of("language_model.model.layers.0.mlp.up_proj.weight") == "language_model"
    assert module_of("lm_head.weight") == "lm_head"
    assert module_of("logit_scale") == "logit_scale"


# --------------------------------------------------------------------------------------------------
# check --hf without a family


def test_check_hf_without_family_tells_it_and_runs(own_dirs, capsys):
    code, out, err = run_cli(capsys, "check", "--hf", own_dirs["pixtral"], "--no-components")
    assert code == 0, err
    assert out.splitlines()[0] == ("family: pixtral (from config.json: architectures PixtralVisionModel, "
                                   "model_type pixtral)")


def test_check_of_a_tower_family_on_a_whole_llava_says_what_it_leaves_out(own_dirs, capsys):
    code, out, err = run_cli(capsys, "check", "pixtral", "--hf", own_dirs["llava"], "--no-components")
    assert code == 0, err
    note = out.splitlines()[0]
    expected = _expected_left_out(own_dirs["llava"], ("vision_tower.",))
    n = expected["all"][0] - expected["total"][0]
    assert note.startswith(f"pixtral: checks part of the checkpoint: left out {n} of {expected['all'][0]} ")
    for module, (count, nbytes) in expected.items():
        if module not in ("all", "total"):
            assert f"{module} ({count} tensor{'' if count == 1 else 's'}, {human_bytes(nbytes)})" in note
    assert note.endswith("; family llava takes the whole LlavaForConditionalGeneration checkpoint")
