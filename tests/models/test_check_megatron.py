"""``check --impl megatron|both``: Megatron's own classes under the parity harness.

The stock classes of the installed megatron-core (CLIP, SigLIP, LLaVA) always run; Megatron-LM
main's ``vit_model`` classes skip without it, naming what to install. The upstream discrepancies
(docs/megatron.md) must show as failures located at the module where Megatron departs from HF.
"""

from __future__ import annotations

import json

import pytest

from mmparity.cli.main import main
from mmparity.parity import harness
from mmparity.parity.metrics import FP32_REL_L2
from mmparity.models.core import megatron_classes as models
from tests import megatron_interop as mi

HAVE_MAIN = models.available()
needs_main = pytest.mark.skipif(not HAVE_MAIN, reason=models.INSTALL_HINT)


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def megatron_results(report):
    return [r for r in report.results if r.impl == "megatron"]


def by_check(report) -> dict:
    return {r.check: r for r in megatron_results(report)}


@pytest.mark.parametrize("family", mi.stock_and_main_families()[0])
def test_stock_class_passes(family):
    report = harness.check(family, impl="megatron")
    results = megatron_results(report)
    assert results and report.passed, [(r.check, r.metrics, r.first_divergence) for r in results]
    assert all(r.metrics["rel_l2"] <= FP32_REL_L2 for r in results)
    assert report.megatron["te"] == ("transformer engine" if models.te_stand_ins.HAVE_TE
                                     else "cpu stand-ins")
    assert report.megatron["version"] and report.impl == "megatron"


def test_clip_compares_every_paired_module_with_hf():
    report = harness.check("clip", impl="megatron")
    static = by_check(report)["static:last_hidden_state"]
    names = [row["module"] for row in static.modules]
    assert names[:2] == ["patch_embed", "ln_pre"] and "layer.1" in names
    assert all(row["passed"] for row in static.modules)


def test_a_corrupted_weight_is_located_in_megatrons_class():
    """Negative control: the weights go through the converter and the key map into Megatron's
    class, so a wrong layer-1 MLP tensor makes layer 1's MLP the first divergence."""
    def corrupt(shard):
        key = next(k for k in shard if k.startswith("decoder.layers.1.") and k.endswith("linear_fc1.weight"))
        shard[key] = shard[key].flip(0)

    report = harness.check("clip", impl="megatron", mutate_native=corrupt)
    static = by_check(report)["static:last_hidden_state"]
    assert not static.passed and static.first_divergence.module == "layer.1.mlp"


def test_both_puts_native_and_megatron_side_by_side(capsys, tmp_path):
    path = tmp_path / "r.json"
    code, out, err = run_cli(capsys, "check", "siglip", "--impl", "both", "--no-components",
                             "--json", str(path))
    assert code == 0, out + err
    report = json.loads(path.read_text())
    assert report["impl"] == "both" and report["megatron"]["classes"] == {"siglip": "CLIPViTModel"}
    impls = [r["impl"] for r in report["results"]]
    assert impls.count("native") >= 2 and impls.count("megatron") == 2
    assert {r["check"] for r in report["results"] if r["impl"] == "megatron"} <= \
        {r["check"] for r in report["results"] if r["impl"] == "native"}
    assert "megatron" in out
    assert report["megatron"]["te"] == ("transformer engine" if models.te_stand_ins.HAVE_TE
                                        else "cpu stand-ins")


def test_native_json_keeps_its_fields(capsys, tmp_path):
    path = tmp_path / "r.json"
    code, _, _ = run_cli(capsys, "check", "siglip", "--no-components", "--json", str(path))
    assert code == 0
    report = json.loads(path.read_text())
    assert report["impl"] == "native" and "megatron" not in report
    assert {"versions", "device", "dtype", "seed", "tp", "pp", "attention_backend", "passed",
            "results"} <= set(report)
    assert all(r["impl"] == "native" for r in report["results"])


@pytest.mark.parametrize("argv, message", [
    (["clip", "--megatron-class", "ViTModel"], "--megatron-class needs --impl megatron"),
    (["clip", "--impl", "megatron", "--megatron-class", "Nope"], "no Megatron class 'Nope'"),
    (["clip", "--impl", "megatron", "--pp", "2"], "drop --pp 2"),
    (["clip", "--impl", "megatron", "--image-size", "32x48"], "only the configured image size 40x40"),
])
def test_usage_errors_exit_2(capsys, argv, message):
    code, _, err = run_cli(capsys, "check", *argv)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.skipif(HAVE_MAIN, reason="Megatron-LM main is importable here")
@pytest.mark.parametrize("family", mi.stock_and_main_families()[1])
def test_missing_megatron_lm_exits_2_naming_what_to_install(capsys, family):
    code, out, err = run_cli(capsys, "check", family, "--impl", "megatron")
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1
    assert "Megatron-LM" in err and "PYTHONPATH" in err and "pip install triton" in err


@pytest.mark.slow
def test_tp2_runs_megatron_on_spawned_ranks():
    report = harness.check("clip", impl="megatron", tp=2, components=False)
    assert report.tp == 2 and report.passed
    assert all(r.metrics["rel_l2"] <= FP32_REL_L2 for r in megatron_results(report))


# --- Megatron-LM main: vit_model classes and the upstream discrepancies ------------------------

@needs_main
def test_pixtral_vit_model_passes():
    report = harness.check("pixtral", impl="megatron")
    assert report.passed and len(megatron_results(report)) == 2


@needs_main
def test_discrepancy_vit_model_clip_mode_ln_pre_order():
    report = harness.check("clip", impl="megatron", megatron_class="ViTModel")
    static = by_check(report)["static:last_hidden_state"]
    assert not static.passed and static.first_divergence.module == "ln_pre"
    assert static.modules[0] == {**static.modules[0], "module": "patch_embed", "passed": True}
    assert 0.05 < static.metrics["rel_l2"] < 0.5


@needs_main
def test_discrepancy_pixtral_large_merger_norm_epsilon():
    """The default tiny config has vision eps 1e-5 and text rms_norm_eps 1e-3 (HF's merger norm
    takes the latter, Megatron's the former)."""
    report = harness.check("pixtral_large", impl="megatron")
    checks = by_check(report)
    for name in ("static:merger", "static:projector"):
        assert not checks[name].passed and checks[name].first_divergence.module == "merger_norm"
        assert 1e-4 < checks[name].metrics["rel_l2"] < 1e-3
    rows = {row["module"]: row for row in checks["static:merger"].modules}
    assert rows["layer.0"]["passed"] and not rows["merger_norm"]["passed"]


@needs_main
def test_discrepancy_pixtral_large_merger_raises_on_odd_grids():
    report = harness.check("pixtral_large", impl="megatron")
    odd = [r for r in megatron_results(report) if r.check.startswith("odd_")]
    assert {r.check for r in odd} == {"odd_static:run", "odd_packed:run"}
    assert all(not r.passed and r.first_divergence.module == "merger" for r in odd)
    assert all("is invalid for input of size" in r.first_divergence.metrics["error"] for r in odd)


@needs_main
def test_discrepancy_qwen_merger_tanh_gelu():
    report = harness.check("qwen3_5", impl="megatron")
    checks = by_check(report)
    assert all(r.passed for name, r in checks.items() if name.endswith("last_hidden_state"))
    static = checks["static:pooler_output"]
    assert not static.passed and static.first_divergence.module == "merger.linear_fc2"
    rows = {row["module"]: row for row in static.modules}
    assert rows["merger.norm"]["passed"] and rows["merger.linear_fc1"]["passed"]
    assert 5e-5 < static.metrics["rel_l2"] < 1e-3


@needs_main
def test_kimi_tower_passes_projector_has_no_exact_place():
    report = harness.check("kimi_k25", impl="megatron")
    results = megatron_results(report)
    assert all(r.passed for r in results if not r.check.endswith("image_embeds"))
    static = by_check(report)["static:image_embeds"]
    assert not static.passed and static.first_divergence.module == "projector"
    rows = {row["module"]: row for row in static.modules}
    assert rows["final_layernorm"]["passed"]
