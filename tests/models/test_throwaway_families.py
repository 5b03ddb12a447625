"""What a family costs, held: three throwaway families, each one package under
tests/models/throwaway/ and one registry line, driven through every generic path.

- ``toy_tower``: a tower on CLIP's architecture at its own sizes (5 files), with stock
  ``CLIPViTModel`` as its Megatron class;
- ``toy_moe``: a language-model part with routed experts, DeepSeek-V3's architecture under a text
  model type of its own, its config table and transformers classes in the package (5 files);
- ``toy_vlm``: a whole VLM, LLaVA composed of a registered tower (CLIP) and ``toy_moe`` (3 files).

The line is ``registry.register(package)`` in this process, ``MMPARITY_FAMILIES`` for a command
that starts ranks; nothing under mmparity/ names them. The paths: ``tiny``, ``check`` (with a
perturbed weight located by its module), ``convert --to mcore`` at TP 2, PP 2 and EP 2 in both
formats and back ``--to hf`` bit for bit, ``verify`` (and a flipped byte named by its file),
``check --impl megatron`` (a perturbed weight located there too), ``verify --load``, ``check --hf DIR
--low-memory`` and ``bench``. Megatron has no class for the whole ``toy_vlm`` (stock LLaVAModel
builds a dense decoder, and the vision part LLaVA lists is Pixtral's), so ``verify --load`` takes
its language model converted alone (``--part language_model``), in the part's own class.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from mmparity.cli.main import main
from mmparity.models import registry
from mmparity.parity import harness
from tests.faults.test_faults import run_subprocess

THROWAWAY = Path(__file__).resolve().parent / "throwaway"
PACKAGES = {name: f"tests.models.throwaway.{name}" for name in ("toy_tower", "toy_moe", "toy_vlm")}
# The one line a command needs: every rank it starts reads the same variable.
ENV = {"MMPARITY_FAMILIES": ",".join(PACKAGES.values())}
# What each package holds, and so what each kind of family costs.
FILES = {"toy_tower": {"__init__.py", "reference.py", "native.py", "mapping.py", "cases.py"},
         "toy_moe": {"__init__.py", "config.py", "reference.py", "native.py", "mapping.py"},
         "toy_vlm": {"__init__.py", "reference.py", "cases.py"}}


@pytest.fixture(scope="module")
def registered():
    """The one line in this process: each package registered, taken back after the module."""
    records = {}
    try:
        for name, package in PACKAGES.items():
            records[name] = registry.register(package)
        yield records
    finally:
        for name in PACKAGES:
            registry.unregister(name)


@pytest.fixture(scope="module")
def tiny(registered, tmp_path_factory):
    """``mmparity tiny`` of the tower and of the whole VLM, seeded: the HF sources below."""
    root = tmp_path_factory.mktemp("tiny")
    for name, seed in (("toy_tower", 3), ("toy_vlm", 4)):
        assert main(["tiny", name, str(root / name), "--seed", str(seed)]) == 0
    return root


def hf_tensors(directory: Path) -> dict:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out |= load_file(path)
    assert out, f"no safetensors in {directory}"
    return out


def assert_same_tensors(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())[:8]
    unequal = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not unequal, unequal[:8]


def flip_a_tensor_byte(path: Path) -> None:
    """Flips a byte inside tensor data: a legacy rank file is a zip whose largest member is a
    tensor's storage (its padding and pickle are not what checksums cover); a torch_dist shard is
    tensor bytes throughout."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            member = max(archive.infolist(), key=lambda info: info.file_size)
        start = member.header_offset
        name_len, extra_len = struct.unpack("<HH", data[start + 26:start + 30])
        at = start + 30 + name_len + extra_len + member.file_size // 2
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


# --- the cost ------------------------------------------------------------------------------------

def test_each_family_is_one_package_and_one_registry_line(registered):
    for name, files in FILES.items():
        package = THROWAWAY / name
        assert {p.name for p in package.iterdir() if p.suffix == ".py"} == files, name
        assert registered[name].package == PACKAGES[name]
    assert {"toy_tower", "toy_vlm"} <= set(registry.names()) and "toy_moe" in registry.language_models()
    # The registry's own list is untouched, and no module of the package names them.
    assert not set(PACKAGES.values()) & set(registry.FAMILIES + registry.LANGUAGE_MODELS)
    source = Path(registry.__file__).resolve().parents[1]
    named = [str(p) for p in source.rglob("*.py") if any(n in p.read_text() for n in FILES)]
    assert named == [], named


def test_a_whole_vlm_is_found_by_its_text_model_and_reads_its_part(registered):
    cfg = registered["toy_vlm"].tiny_config()
    assert registry.language_of(cfg).name == "toy_moe"
    facts = registry.ConfigFacts("config.json", ("LlavaForConditionalGeneration",), "llava", "clip_vision_model",
                                 text_model_type="toy_moe")
    assert registry.detect(facts).family == "toy_vlm"
    # Its shapes, read off the config without the model, are the model's.
    shapes = registered["toy_vlm"].state_shapes(cfg)
    model = registered["toy_vlm"].build_reference(cfg)
    assert shapes == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["model.language_model.layers.2.mlp.experts.gate_up_proj"] == (6, 24, 40)
    with pytest.raises(ValueError, match="registered language models take: .*toy_moe"):
        registry.language_of(SimpleNamespace(text_config=SimpleNamespace(model_type="gpt2")))


# --- check ---------------------------------------------------------------------------------------

def test_check_of_the_tiny_checkpoints_passes(tiny, capsys):
    assert main(["check", "toy_tower", "--hf", str(tiny / "toy_tower"), "--quiet"]) == 0, capsys.readouterr()
    # No family named: the whole VLM's config (llava, text model toy_moe) tells it.
    capsys.readouterr()
    code = main(["check", "--hf", str(tiny / "toy_vlm"), "--no-components"])
    out, err = capsys.readouterr()
    assert code == 0 and "toy_vlm" in out, out + err


@pytest.mark.parametrize("family, key, module", [
    ("toy_tower", "decoder.layers.1.mlp.linear_fc2.weight", "layer.1.mlp"),
    # The part's own pairs inside an MoE layer's MLP, through the composition that names no part.
    ("toy_vlm", "language_model.decoder.layers.2.mlp.shared_experts.linear_fc2.weight",
     "language_model.decoder.layers.2.mlp.shared_experts"),
])
def test_a_perturbed_weight_is_located_by_its_module(registered, family, key, module):
    assert harness.check(family, seed=5, components=False).passed

    def perturb(state):
        state[key] = state[key].clone()
        state[key][1, 0] += 0.25

    report = harness.check(family, seed=5, components=False, mutate_native=perturb)
    assert not report.passed
    assert {r.first_divergence.module for r in report.failures()} == {module}


# --- convert both ways, verify -------------------------------------------------------------------

@pytest.mark.parametrize("family, fmt, grid", [
    ("toy_tower", "legacy", ["--tp", "2"]),
    ("toy_tower", "torch_dist", ["--pp", "2"]),
    ("toy_vlm", "legacy", ["--tp", "2", "--pp", "2"]),
    ("toy_vlm", "torch_dist", ["--ep", "2"]),
    ("toy_vlm", "legacy", ["--ep", "2", "--tp", "2"]),
])
def test_convert_both_ways_is_bit_exact_and_verified(tiny, tmp_path, capsys, family, fmt, grid):
    src, mcore, back = tiny / family, tmp_path / "mcore", tmp_path / "back"
    assert main(["convert", "--src", str(src), "--dst", str(mcore), "--to", "mcore", "--family", family,
                 "--format", fmt, *grid, "--quiet"]) == 0, capsys.readouterr()
    assert main(["convert", "--src", str(mcore), "--dst", str(back), "--to", "hf", "--quiet"]) == 0, \
        capsys.readouterr()
    assert_same_tensors(hf_tensors(back), hf_tensors(src))
    capsys.readouterr()
    assert main(["verify", str(mcore), str(back), "--quiet"]) == 0, capsys.readouterr()

    # A flipped byte in the largest tensor file is named: a legacy rank file by its path, a
    # torch_dist shard by its iteration and the tensor record it breaks.
    victim = max((p for p in mcore.rglob("*") if p.is_file() and p.suffix in (".pt", ".distcp")),
                 key=lambda p: p.stat().st_size)
    flip_a_tensor_byte(victim)
    code = main(["verify", str(mcore), "--quiet"])
    out, err = capsys.readouterr()
    where = f"{victim.parent.name}/{victim.name}" if fmt == "legacy" else f"{victim.parent.name}:"
    assert code == 1 and where in out + err and "differs" in out + err, out + err


# --- Megatron's classes, the low-memory check, the bench -----------------------------------------

def test_check_impl_megatron_takes_the_classes_the_packages_name(registered, capsys):
    capsys.readouterr()
    assert main(["check", "toy_tower", "--impl", "megatron", "--no-components"]) == 0, capsys.readouterr()
    assert "CLIPViTModel" in capsys.readouterr().out
    # The part's own entry names Megatron's class for a decoder with experts.
    assert main(["check", "toy_vlm", "--impl", "megatron", "--megatron-class", "GPTModel",
                 "--no-components"]) == 0, capsys.readouterr()
    assert "GPTModel" in capsys.readouterr().out


@pytest.mark.parametrize("family, megatron_class, key, module", [
    ("toy_tower", "CLIPViTModel", "decoder.layers.1.mlp.linear_fc1.weight", "layer.1.mlp"),
    ("toy_vlm", "GPTModel", "language_model.decoder.layers.2.mlp.shared_experts.linear_fc1.weight",
     "language_model.decoder.layers.2.mlp"),
])
def test_a_perturbed_weight_in_megatrons_class_is_located(registered, family, megatron_class, key, module):
    def perturb(state):
        state[key] = state[key].clone()
        state[key][0, 1] -= 0.25

    report = harness.check(family, seed=6, impl="megatron", megatron_class=megatron_class, components=False,
                           mutate_native=perturb)
    failed = [r for r in report.results if r.impl == "megatron" and not r.passed]
    located = {r.first_divergence.module for r in failed}
    # A case Megatron's class runs without module pairs (stock CLIPViTModel's packed one) names
    # the output instead.
    assert module in located and located <= {module} | {r.check.partition(":")[2] for r in failed}, located


def test_low_memory_check_of_the_tiny_checkpoints(tiny, capsys):
    for family in ("toy_tower", "toy_vlm"):
        code = main(["check", family, "--hf", str(tiny / family), "--low-memory", "--no-components", "--quiet"])
        assert code == 0, capsys.readouterr()


def test_bench_times_them_at_tiny_size(registered, capsys):
    code = main(["bench", "toy_tower", "toy_vlm", "--size", "tiny", "--repeats", "1", "--warmup", "0", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "2 timed, 0 failed" in out and "parity 2/2 passed" in out, out


@pytest.mark.slow
def test_verify_load_in_a_command_registered_by_the_environment(tiny, tmp_path):
    """Ranks started by ``verify --load`` find the families through MMPARITY_FAMILIES alone."""
    tower, language = tmp_path / "tower", tmp_path / "language"
    code, out, err = run_subprocess("convert", "--src", tiny / "toy_tower", "--dst", tower, "--to", "mcore",
                                    "--family", "toy_tower", "--format", "legacy", "--tp", "2", "--quiet", env=ENV)
    assert code == 0, err
    code, out, err = run_subprocess("verify", "--load", tower, env=ENV, timeout=300)
    assert code == 0 and "CLIPViTModel" in out and "rank 1: ok" in out, out + err
    # The whole VLM's language model alone, experts split over EP 2, in the part's Megatron class.
    code, out, err = run_subprocess("convert", "--src", tiny / "toy_vlm", "--dst", language, "--to", "mcore",
                                    "--part", "language_model", "--ep", "2", "--quiet", env=ENV)
    assert code == 0, err
    code, out, err = run_subprocess("verify", "--load", language, env=ENV, timeout=300)
    assert code == 0 and "GPTModel" in out and "rank 0: ok" in out, out + err


@pytest.mark.slow
def test_check_at_tp_2_in_a_command_registered_by_the_environment(tiny):
    code, out, err = run_subprocess("check", "toy_vlm", "--hf", tiny / "toy_vlm", "--tp", "2", "--no-components",
                                    env=ENV, timeout=300)
    assert code == 0 and "toy_vlm" in out, out + err
