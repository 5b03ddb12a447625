"""`check` inputs that respect the config: the images every family's cases use fit what its config
allows (a Pixtral tower's ``image_size // patch_size`` patches per side), a user's ``--image-size``
beyond it is one line naming the flag and the limit, and a config the native model cannot
reproduce (Kimi-K2.5 group-limited routing Megatron's router ranks otherwise) is refused in one
line before any model is built or rank started."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state
from mmparity.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
# Families whose tower is Pixtral (its rotary table is image_size // patch_size patches per side).
PIXTRAL_TOWERS = ("pixtral", "pixtral_large", "llava", "mistral3", "pixtral_12b")


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def small_tower(family: str, image_size: int):
    """The family's tiny config with the Pixtral tower's ``image_size`` set (patch 8)."""
    cfg = copy.deepcopy(families.get(family).tiny_config())
    vision = cfg if family == "pixtral" else cfg.vision_config
    vision.image_size = image_size
    return cfg


def case_sizes(family: str, cfg) -> list:
    hooks = families.get(family).hooks
    return [size for case in hooks.parity.cases(cfg, 0) for size in case.data.get("sizes", ())]


@pytest.mark.parametrize("family", families.names())
def test_every_family_checks_images_its_config_allows(family):
    fam = families.get(family)
    cfg = fam.tiny_config()
    sizes = case_sizes(family, cfg)
    assert fam.hooks.config.image_size_problems(cfg, sizes) == []


@pytest.mark.parametrize("image_size", [32, 48, 64])
@pytest.mark.parametrize("family", PIXTRAL_TOWERS)
def test_a_small_pixtral_image_size_bounds_the_default_images(family, image_size):
    """Defaults cut to the tower's table; still several images of more than one size."""
    cfg = small_tower(family, image_size)
    sizes = case_sizes(family, cfg)
    most = image_size // 8
    assert sizes and max(max(h, w) // 8 for h, w in sizes) <= most
    assert len(set(sizes)) > 1
    assert families.get(family).hooks.config.image_size_problems(cfg, sizes) == []


def save(model, cfg, path: Path) -> Path:
    model.load_state_dict(random_like_state(model.state_dict(), seed=3))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def small_mistral3(tmp_path_factory):
    """A whole Mistral3 whose tower takes 8 patches per side (image_size 64, patch 8), below the
    6x10-patch image the default row layout once fed it."""
    cfg = small_tower("mistral3", 64)
    return save(families.get("mistral3").build_reference(cfg), cfg, tmp_path_factory.mktemp("m3") / "hf")


def test_whole_mistral3_with_a_small_image_size_checks(capsys, small_mistral3):
    code, out, err = run_cli(capsys, "check", "mistral3", "--hf", small_mistral3, "--no-components")
    assert code == 0, err
    assert "Traceback" not in err


def test_an_image_size_beyond_the_config_is_one_line_naming_flag_and_limit(capsys, small_mistral3):
    code, _, err = run_cli(capsys, "check", "mistral3", "--hf", small_mistral3, "--image-size", "48x80")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "--image-size" in err and "6x10 patch grid" in err and "at most 64 pixels per side" in err


@pytest.mark.parametrize("family", ["pixtral", "pixtral_large"])
def test_a_tower_family_refuses_an_image_beyond_its_table(capsys, family):
    # The tiny towers take 8 patches of 8 per side.
    code, _, err = run_cli(capsys, "check", family, "--image-size", "32x72")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--image-size" in err and "4x9 patch grid" in err and "8 patches per side" in err


@pytest.fixture(scope="module")
def unrouted_kimi(tmp_path_factory):
    """A whole Kimi-K2.5 whose text config takes 3 experts over 1 of 3 groups: HF ranks a group by
    its top 2 scores, Megatron's router by its top 3."""
    from mmparity.models.kimi_k25_vl import reference

    cfg = reference.tiny_config(num_experts_per_tok=3, topk_group=1)
    return save(families.get("kimi_k25_vl").build_reference(cfg), cfg, tmp_path_factory.mktemp("kimi") / "hf")


@pytest.mark.parametrize("extra", [(), ("--tp", "2"), ("--low-memory",)], ids=["one", "tp2", "low_memory"])
def test_routing_megatron_cannot_reproduce_is_one_line_before_any_rank(capsys, unrouted_kimi, extra):
    # A spawned rank would fail this (not slow) test: conftest refuses spawns outside slow tests.
    code, _, err = run_cli(capsys, "check", "kimi_k25_vl", "--hf", unrouted_kimi, *extra)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "[rank" not in err
    assert str(unrouted_kimi) in err
    assert "num_experts_per_tok=3 over topk_group=1" in err and "twice topk_group" in err


def test_routing_refusal_from_the_command_line_prints_no_rank_traceback(unrouted_kimi):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "mmparity", "check", "kimi_k25_vl", "--hf", str(unrouted_kimi)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mmparity: error: --hf "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "[rank0]" not in proc.stderr
