"""What each command imports, read off ``sys.modules`` of a fresh interpreter that ran it.

Start-up is most of what a small command costs, and every child process of the suite pays it, so
the imports are what is held fixed here: ``list`` and ``--help`` import no framework and no family
code at all; ``convert`` imports no transformers (it reads config.json through
``mmparity.config.ConfigView``, tests/models/test_config_view.py), no model code and no megatron,
torch_dist included (its layout comes from the rule tables, tests/io/test_torch_dist_layout.py), and
beyond what ``import torch`` itself loads, nothing but mmparity, the standard library, safetensors
and xxhash; ``report`` reads a saved report with no framework, and only a page (``--html``, of
``check`` too) imports matplotlib. A regression here is an import that crept up a module's top, so
the test names the modules. What these imports cost in CPU time is benchmarks/cli_startup.py's to
measure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmparity.cli.main import SUBCOMMANDS
from mmparity.models import registry as families
from tests.mapping.test_convert_roundtrips import save_hf

ROOT = Path(__file__).resolve().parents[2]

# Runs ``mmparity <argv>`` in this interpreter, then writes its exit code and every module it
# imported.
DRIVER = """
import json, sys
from mmparity.cli.main import main
try:
    code = main(sys.argv[2:])
except SystemExit as exc:  # --help leaves through argparse
    code = exc.code
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""


def run_child(tmp_path: Path, *argv) -> dict:
    report = tmp_path / f"modules-{len(list(tmp_path.glob('modules-*')))}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(report), *map(str, argv)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and report.exists(), proc.stderr[-2000:]
    result = json.loads(report.read_text())
    assert result["code"] in (0, None), (argv, proc.stdout[-2000:], proc.stderr[-2000:])
    return result


def frameworks(modules) -> list[str]:
    return [m for m in modules if m.split(".")[0] in ("torch", "transformers", "megatron", "safetensors")]


def third_party(modules) -> set[str]:
    """The top-level packages imported that are neither the standard library's nor mmparity's (nor
    the interpreter's and the installer's hooks, ``__main__``, ``_distutils_hack`` and the like)."""
    tops = {m.split(".")[0] for m in modules}
    return {top for top in tops - set(sys.stdlib_module_names) - {"mmparity", "_distutils_hack"}
            if not top.startswith("__")}


def family_code(modules) -> list[str]:
    """mmparity's modules past the command line's own: the families' modules, the disk layer and
    above. A family's (or a part's) package itself is its registry record, data, and not counted."""
    records = {name for package in (*families.FAMILIES, *families.LANGUAGE_MODELS)
               for name in (package, package.rpartition(".")[0])}
    return [m for m in modules if m.startswith("mmparity.") and m.split(".")[1] not in ("cli", "errors", "models")
            or m.startswith("mmparity.models.") and m.split(".")[2] not in ("registry", "record", "spec") and m not in records]


def mmparity_models(modules) -> list[str]:
    """mmparity's model code: the shared mcore blocks, each family's native model, and what runs
    them (the parity harness, Megatron's classes)."""
    return [m for m in modules if m.startswith(("mmparity.models.core", "mmparity.parity", "mmparity.megatron"))
            or (m.startswith("mmparity.models.") and m.endswith(".native"))]


def models(modules) -> list[str]:
    """Either framework's model code: megatron, transformers' modeling base and any model's
    ``modeling_*`` (``models.auto``'s are name tables, which the configuration classes load)."""
    return [m for m in modules if m.split(".")[0] == "megatron" or m == "transformers.modeling_utils"
            or (m.startswith("transformers.models.") and ".modeling_" in m
                and not m.startswith("transformers.models.auto."))]


# --------------------------------------------------------------------------------------------------
# list and help


@pytest.mark.parametrize("argv", [["list"], ["list", "--json"], ["--help"],
                                  *([name, "--help"] for name in SUBCOMMANDS)],
                         ids=" ".join)
def test_listing_and_help_import_no_framework(tmp_path, argv):
    result = run_child(tmp_path, *argv)
    assert not frameworks(result["modules"]), frameworks(result["modules"])[:10]
    # The registry reads the families' records without importing their modules.
    assert not family_code(result["modules"]), family_code(result["modules"])[:10]
    # What is left is the interpreter, argparse and (for the table) rich.
    assert third_party(result["modules"]) <= {"rich"}, third_party(result["modules"])


# --------------------------------------------------------------------------------------------------
# convert


# A tower, a LLaVA, and a whole VLM with the merger.
FAMILIES = ("clip", "llava", "mistral3")
# What a convert may import that ``import torch`` did not: it reads and writes safetensors and
# checksums what it writes with xxhash.
CONVERT_NEEDS = {"safetensors", "xxhash"}


TORCH_ONLY = """
import json, sys, torch
json.dump(sorted(sys.modules), open(sys.argv[1], "w"))
"""


@pytest.fixture(scope="module")
def torch_modules(tmp_path_factory) -> set[str]:
    """The modules of an interpreter that imports torch and nothing else."""
    report = tmp_path_factory.mktemp("torch_only") / "modules.json"
    subprocess.run([sys.executable, "-c", TORCH_ONLY, str(report)], check=True, timeout=300)
    return set(json.loads(report.read_text()))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tiny CLIP and LLaVA as HF directories, and the mcore checkpoints made from them (in
    this process, which may import anything)."""
    root = tmp_path_factory.mktemp("imports")
    paths = {}
    for family in FAMILIES:
        hf = save_hf(family, root / f"{family}_hf", seed=2)
        paths[family, "hf"] = hf
        for fmt in ("legacy", "torch_dist"):
            paths[family, fmt] = root / f"{family}_{fmt}"
            assert run_child(root, "convert", "--family", family, "--src", hf, "--dst", paths[family, fmt],
                             "--to", "mcore", "--format", fmt, "--quiet")["code"] == 0
    return paths


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("step", ["hf->legacy", "hf->torch_dist", "legacy->hf", "torch_dist->hf"])
def test_convert_imports_no_model(tmp_path, converted, torch_modules, family, step):
    source, target = step.split("->")
    argv = ["convert", "--src", converted[family, source], "--dst", tmp_path / "out", "--quiet"]
    if source == "hf":
        argv += ["--family", family, "--to", "mcore", "--format", target]
    else:
        argv += ["--to", "hf"]
    result = run_child(tmp_path, *argv)
    modules = result["modules"]
    loaded = models(modules)
    assert not loaded, loaded[:10]
    # The config was read without transformers.
    assert not [m for m in modules if m.split(".")[0] == "transformers"], "transformers imported"
    # Planning on meta tensors with torch's own cat would import torch._dynamo (see tp.cat).
    assert "torch._dynamo" not in modules
    # DCP's index is written by dcp_metadata and read into dcp_index's records, never by DCP
    # (whose import is DTensor and sympy, 0.6 CPU-s).
    assert not [m for m in modules if m.startswith("torch.distributed.checkpoint")], "DCP imported"
    # Nor the native models, the parity harness or Megatron's classes of mmparity's own.
    assert not mmparity_models(modules), mmparity_models(modules)[:10]
    # Beyond the packages torch's own import loads, only what reading, writing and checksumming take.
    beyond_torch = third_party(modules) - third_party(torch_modules)
    assert beyond_torch <= CONVERT_NEEDS, beyond_torch


def test_every_family_converts_without_its_models(tmp_path):
    """Config, shapes and key tables of every registered family load with no model code."""
    script = ("import json, sys\nfrom mmparity.models import registry as families\n"
              "for name in families.names():\n"
              "    fam = families.get(name)\n"
              "    cfg = fam.family_config(fam.tiny_config())\n"
              "    assert fam.state_shapes(cfg) and fam.rule_set(cfg).rules, name\n"
              "json.dump(sorted(sys.modules), open(sys.argv[1], 'w'))\n")
    report = tmp_path / "modules.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script, str(report)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = models(json.loads(report.read_text()))
    assert not loaded, loaded[:10]
    assert families.names()  # the loop above covered every registered family


# --------------------------------------------------------------------------------------------------
# refused before the frameworks are imported


def run_refused(tmp_path: Path, *argv) -> dict:
    """``mmparity ARGV`` in a fresh interpreter that must refuse it: exit 2, one stderr line."""
    report = tmp_path / f"modules-{len(list(tmp_path.glob('modules-*')))}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(report), *map(str, argv)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    result = json.loads(report.read_text())
    assert result["code"] == 2 and len(proc.stderr.splitlines()) == 1, (argv, proc.stderr[-2000:])
    result["stderr"] = proc.stderr.strip()
    return result


@pytest.mark.parametrize("argv, said", [
    (["check", "--hf", "{missing}"], "--hf {missing}: no such directory"),
    (["check", "llava", "--hf", "{missing}", "--tp", "2"], "--hf {missing}: no such directory"),
    (["check", "--mcore", "{missing}"], "--mcore {missing}: no such directory"),
    (["convert", "--src", "{missing}", "--dst", "{missing}2", "--to", "mcore"], "{missing}: no such file or directory"),
    (["verify", "{missing}"], "{missing}: no such directory"),
    (["verify", "--load", "{missing}"], "{missing}: no such directory"),
    (["bench", "clip", "--image-size", "48x"], "image size '48x' is not of the form HxW"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else "")
def test_a_wrong_path_or_flag_is_answered_before_any_framework_is_imported(tmp_path, argv, said):
    missing = str(tmp_path / "not-there")
    result = run_refused(tmp_path, *(word.format(missing=missing) for word in argv))
    assert said.format(missing=missing) in result["stderr"], result["stderr"]
    assert not frameworks(result["modules"]), frameworks(result["modules"])[:10]
    assert not family_code(result["modules"]), family_code(result["modules"])[:10]


def test_a_tp_size_config_json_refuses_is_answered_without_model_code(tmp_path):
    """`check --hf DIR --tp 3` for a model whose heads 3 does not divide: told from config.json
    through the rule tables, as convert tells it, before transformers or megatron is imported."""
    hf = save_hf("llava", tmp_path / "hf", seed=2)
    result = run_refused(tmp_path, "check", "--hf", hf, "--tp", "3")
    assert result["stderr"].startswith("mmparity: error: llava: tensor-parallel size does not fit this model: "
                                       "tp=3 does not divide num_attention_heads="), result["stderr"]
    assert not models(result["modules"]), models(result["modules"])[:10]
    assert not [m for m in result["modules"] if m.split(".")[0] == "transformers"], "transformers imported"
    assert not mmparity_models(result["modules"]), mmparity_models(result["modules"])[:10]


# --------------------------------------------------------------------------------------------------
# check and report: matplotlib only for a page, and a saved report read without any framework


def test_matplotlib_only_where_an_html_page_is_asked_for(tmp_path):
    saved = tmp_path / "r.json"
    checked = run_child(tmp_path, "check", "clip", "--no-components", "--quiet", "--json", saved)
    assert "matplotlib" not in third_party(checked["modules"])
    # A saved report is data: no framework, no model code, nothing of mmparity's past the CLI but
    # the report's own schema; matplotlib only when it draws the page.
    schema = {"mmparity.parity", "mmparity.parity.report"}
    for argv, plots in (([saved, "--quiet"], False), ([saved, "--quiet", "--html", tmp_path / "r.html"], True)):
        result = run_child(tmp_path, "report", *argv)
        modules = result["modules"]
        assert not frameworks(modules), frameworks(modules)[:10]
        assert set(family_code(modules)) <= schema, family_code(modules)[:10]
        assert ("matplotlib" in third_party(modules)) == plots
        assert plots or third_party(modules) <= {"rich"}, third_party(modules)
    assert (tmp_path / "r.html").exists()
