"""``mmparity bench``: the FLOP counter against torch's own counter, published configs, timing,
parity verdicts (with a negative control), mixed-size batches, CLI."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mmparity.models import registry as families
from mmparity.config import vision_sub_config
from mmparity.parity import bench
from mmparity.models.core import attention
from mmparity.parity.harness import size_multiple


def test_flop_formula_by_hand():
    shape = bench.TowerShape(hidden=4, layers=2, heads=2, groups=1, head_dim=3, ffn=5, gated=True,
                             patch=2, channels=3, merge=2, merger=((16, 7),))
    flops = bench.count_flops(shape, [(4, 8), (2, 2)])  # 2x4 = 8 and 1x1 = 1 patches
    p = flops["parts"]
    assert p["patch_embed"] == 2 * 9 * 3 * 4 * 4
    assert p["qkv"] == 2 * 2 * 9 * 4 * (2 + 2) * 3
    assert p["attention"] == 2 * 4 * (8 * 8 + 1 * 1) * 6  # per image, never across images
    assert p["proj"] == 2 * 2 * 9 * 6 * 4
    assert p["mlp"] == 2 * 3 * 2 * 9 * 4 * 5
    assert p["merger"] == 2 * (1 * 2 + 0) * 16 * 7  # 1x2 merged tokens, then 0 (1x1 grid)
    assert flops["total"] == sum(p.values())
    plain = bench.count_flops(bench.TowerShape(4, 1, 2, 2, 2, 5, False, 2, 3, class_tokens=1), [(2, 2)])
    assert plain["parts"]["mlp"] == 2 * 2 * 2 * 4 * 5 and plain["parts"]["attention"] == 4 * 4 * 4


def _counted_native_flops(family: str, case_name: str, sizes):
    fam = families.get(family)
    cfg = fam.tiny_config()
    case = bench.bench_case(families.get(family), cfg, sizes, seed=0, case_name=case_name)
    native = fam.build_native(cfg).requires_grad_(False)
    # The math backend computes attention as two matmuls, which torch's counter sees.
    with attention.use_backend("math"), torch.no_grad(), FlopCounterMode(display=False) as counter:
        fam.hooks.native.run(native, case)
    return counter.get_total_flops(), bench.count_flops(bench.tower_shape(families.get(family), cfg),
                                                        bench._case_sizes(case))


COUNTED = [name for name in families.names() if families.get(name).hooks.bench.flop_shape is not None]


@pytest.mark.parametrize("family", COUNTED)
def test_flop_count_equals_torch_counter_on_the_native_model(family):
    """Exact for every family with a FLOP formula, up to two documented native economies: a still
    image's Conv3d folded over identical frames (Qwen), and a packed pooling head that runs on
    padded segments."""
    cfg = families.get(family).tiny_config()
    m = size_multiple(families.get(family), cfg)
    shape = bench.tower_shape(families.get(family), cfg)
    fold = shape.temporal > 1
    checks = [("static", [(2 * m, 3 * m)] * 3)]
    if shape.head is None:
        checks.append(("packed", [(2 * m, 3 * m), (4 * m, 2 * m), (2 * m, 3 * m)]))
    for case_name, sizes in checks:
        counted, analytic = _counted_native_flops(family, case_name, sizes)
        expected = analytic["total"]
        if fold:
            expected -= analytic["parts"]["patch_embed"] * (shape.temporal - 1) // shape.temporal
        assert counted == expected, (case_name, counted, analytic)


@pytest.mark.parametrize("family", sorted(set(families.names()) - set(COUNTED)))
def test_families_without_a_formula_report_flops_as_not_counted(family):
    prepared = bench.prepare_family(families.get(family))
    assert prepared.result.flops["total"] is None
    assert "no FLOP formula" in prepared.result.flops["note"]


# Towers: their FLOP formula counts the whole forward. Whole VLMs (a language model too) have none.
PUBLISHED_TOWERS = [f for f in bench.published_families() if families.get(f).hooks.bench.flop_shape is not None]
PUBLISHED_WHOLE = [f for f in bench.published_families() if f not in PUBLISHED_TOWERS]


@pytest.mark.parametrize("family", PUBLISHED_WHOLE)
def test_published_whole_vlm_configs_carry_the_released_language_model(family):
    cfg = bench.published_config(families.get(family))
    text = cfg.text_config
    # InternVL3-1B's Qwen2.5 decoder; the others' the Mistral decoder Pixtral-12B and Mistral-Small-3.1 share.
    released = {"internvl": (24, 896, 14, 2, 64, 151674)}.get(family, (40, 5120, 32, 8, 128, 131072))
    assert (text.num_hidden_layers, text.hidden_size, text.num_attention_heads, text.num_key_value_heads,
            text.head_dim, text.vocab_size) == released
    assert (cfg.vision_config.num_hidden_layers, cfg.vision_config.hidden_size) == (24, 1024)
    images, size = bench.default_batch(families.get(family), "published", cfg)
    m = size_multiple(families.get(family), cfg)
    assert size[0] % m == 0 and size[1] % m == 0 and images >= 1


@pytest.mark.parametrize("family", PUBLISHED_TOWERS)
def test_published_configs_build(family):
    cfg = bench.published_config(families.get(family))
    shape = bench.tower_shape(families.get(family), cfg)
    expected = {"qwen3_5": (27, 1152), "kimi_k25": (27, 1152), "pixtral": (24, 1024),
                "siglip": (27, 1152), "clip": (24, 1024), "internvit": (24, 1024)}[family]
    assert (shape.layers, shape.hidden) == expected
    tiny = families.get(family).tiny_config()
    assert type(vision_sub_config(cfg)) is type(vision_sub_config(tiny))
    images, size = bench.default_batch(families.get(family), "published", cfg)
    m = size_multiple(families.get(family), cfg)
    assert size[0] % m == 0 and size[1] % m == 0 and images >= 8
    assert bench.count_flops(shape, [size] * images)["total"] > 1e12


def test_published_config_refuses_unknown_families():
    with pytest.raises(bench.BenchError, match="no published config"):
        bench.published_config(families.get("pixtral_large"))


def test_time_call_warms_up_and_repeats():
    calls = []
    times = bench.time_call(lambda: calls.append(1), "cpu", warmup=2, repeats=3)
    assert len(calls) == 5 and len(times) == 3 and all(t >= 0 for t in times)
    with pytest.raises(bench.BenchError):
        bench.time_call(lambda: None, "cpu", warmup=0, repeats=0)


def test_static_case_grows_to_the_requested_batch():
    cfg = families.get("pixtral").tiny_config()
    case = bench.bench_case(families.get("pixtral"), cfg, [(16, 24)] * 5, seed=0)
    assert case.name == "static" and len(case.data["images"]) == 5
    assert bench._case_sizes(case) == [(16, 24)] * 5
    assert not torch.equal(case.data["images"][0], case.data["images"][1])
    mixed = bench.bench_case(families.get("pixtral"), cfg, [(16, 24), (8, 8)], seed=0)
    assert mixed.name == "packed"
    with pytest.raises(bench.BenchError, match="no case 'video'"):
        bench.bench_case(families.get("pixtral"), cfg, [(16, 24)], seed=0, case_name="video")


def test_bench_cli_every_family_tiny(tmp_path, capsys):
    from mmparity.cli.main import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "--size", "tiny", "--repeats", "1", "--warmup", "0", "--quiet",
               "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, [r["error"] for r in report["results"]]
    assert [r["family"] for r in report["results"]] == families.names()
    assert report["attention_backend"].startswith("auto:") and report["timer"] == "perf_counter"
    for r in report["results"]:
        assert r["error"] is None and r["native"]["median_ms"] > 0 and r["hf"]["median_ms"] > 0
        assert r["speedup_vs_hf"] == pytest.approx(r["hf"]["median_ms"] / r["native"]["median_ms"])
        if r["family"] in COUNTED:
            assert r["flops"]["total"] > 0 and r["native"]["tflops"] > 0
        else:
            assert r["flops"]["total"] is None and r["native"]["tflops"] is None
            assert "not counted" in r["flops"]["note"]
        # The kernels recorded are the image attention's dispatch (static, packed per size): a
        # language model alone has none to record.
        assert bool(r["native"]["detail"]["attention_kernels"]) == bool(r["images"]), r["family"]
        assert r["rel_l2"] is not None and r["rel_l2"] < 1e-4  # same weights, fp32
        parity = r["parity"]
        assert parity["passed"] and parity["hf_rel_l2"] is None, (r["family"], parity)
        assert parity["native_rel_l2"] <= parity["tolerance"]["rel_l2"] == 1e-5
        assert parity["output"] in parity["outputs"]
    assert report["passed"] and report["parity_checked"] and report["complete"]
    out = capsys.readouterr().out
    assert "timed, 0 failed" in out and f"parity {len(families.names())}/{len(families.names())} passed" in out


def test_bench_mixed_sizes_use_the_packed_path(tmp_path):
    from mmparity.cli.main import main

    out = tmp_path / "bench.json"
    assert main(["bench", "pixtral", "--images", "3", "--image-size", "16x24", "--image-size", "40x8",
                 "--repeats", "1", "--warmup", "0", "--quiet", "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["case"] == "packed" and r["image_sizes"] == [[16, 24], [40, 8], [16, 24]]
    assert r["native"]["detail"]["attention_kernels"] == {"grouped": 2}  # one per layer
    assert r["tokens"] == 6 + 5 + 6


@pytest.mark.parametrize("argv,message", [
    (["bench", "nosuch"], "unknown family 'nosuch'"),
    (["bench", "pixtral_large", "--size", "published"], "no published config for 'pixtral_large'"),
    (["bench", "pixtral", "--image-size", "13x13"], "not a positive multiple of 8"),
    (["bench", "pixtral", "--images", "0"], "--images must be >= 1"),
    (["bench", "pixtral", "--attention-backend", "varlen"], "'varlen' cannot run"),
    # More image tokens than the language model has positions: Megatron's LLaVAModel would cut
    # the sequence where transformers runs on.
    (["bench", "mistral3", "--images", "64", "--image-size", "96x96"],
     "64 image(s) and their text make a sequence of 1414 tokens, beyond the language model's "
     "max_position_embeddings 512"),
])
def test_bench_cli_usage_errors(argv, message, capsys):
    from mmparity.cli.main import main

    if "pixtral_large" in argv and "pixtral_large" not in families.names():
        pytest.skip("pixtral_large is not registered")
    if "varlen" in argv and torch.cuda.is_available():
        pytest.skip("varlen can run on this machine")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_bench_cli_refuses_cuda_without_cuda(capsys):
    from mmparity.cli.main import main

    assert main(["bench", "pixtral", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


# --- parity ------------------------------------------------------------------------------------------

def _perturb_first_mlp(state: dict) -> None:
    """Negative control: one MLP input projection 1.5x too large (every family has one)."""
    key = sorted(k for k in state if k.endswith("linear_fc1.weight"))[0]
    state[key] = state[key] * 1.5


def test_parity_verdict_applies_the_project_policy():
    torch.manual_seed(0)
    ref = {"out": torch.randn(64, 8), "pooled": torch.randn(4, 8)}
    hf = {k: v + 0.01 * torch.randn_like(v) for k, v in ref.items()}
    good = {k: v + 0.015 * torch.randn_like(v) for k, v in ref.items()}
    verdict = bench.parity_verdict(torch.bfloat16, good, hf, ref)
    assert verdict["passed"] and set(verdict["outputs"]) == {"out", "pooled"}
    row = verdict["outputs"]["out"]
    assert row["tolerance"]["rel_l2"] == pytest.approx(2 * row["hf_rel_l2"])
    bad = dict(good, pooled=ref["pooled"] * 1.5)
    verdict = bench.parity_verdict(torch.bfloat16, bad, hf, ref)
    assert not verdict["passed"] and verdict["output"] == "pooled"  # the decisive output is on top
    assert verdict["native_rel_l2"] > verdict["tolerance"]["rel_l2"]
    # float32: native against HF directly, the fixed bound, no reference forward needed
    same = bench.parity_verdict(torch.float32, {"out": ref["out"]}, {"out": ref["out"] * (1 + 1e-7)})
    assert same["passed"] and same["hf_rel_l2"] is None and same["tolerance"]["rel_l2"] == 1e-5
    with pytest.raises(ValueError, match="float32 reference"):
        bench.parity_verdict(torch.bfloat16, good, hf)


@pytest.mark.slow  # several seconds: the full suite runs it, the quick loops skip it
def test_bf16_parity_passes_for_every_family():
    report = bench.bench(dtype="bfloat16", repeats=1, warmup=0)
    assert [r.family for r in report.results] == families.names()
    for r in report.results:
        assert r.error is None, r.error
        p = r.parity
        assert p["passed"], (r.family, p)
        assert p["reference"] == bench.PARITY_REFERENCE and "bfloat16" in p["tolerance"]["basis"]
        # both sides measured against the float32 reference, the bound is 2x HF's own error
        assert 0 < p["hf_rel_l2"] < 0.1 and p["tolerance"]["rel_l2"] == pytest.approx(2 * p["hf_rel_l2"])
    assert report.passed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_negative_control_fails_parity_and_exits_1(dtype, tmp_path, capsys, monkeypatch):
    from mmparity.cli.main import main

    monkeypatch.setattr(bench, "bench", functools.partial(bench.bench, mutate_native=_perturb_first_mlp))
    out = tmp_path / "bench.json"
    rc = main(["bench", "pixtral", "--dtype", dtype, "--repeats", "1", "--warmup", "0", "--json", str(out)])
    (r,) = json.loads(out.read_text())["results"]
    assert rc == 1
    assert r["error"] is None and r["native"]["median_ms"] > 0  # timed all the same
    assert not r["parity"]["passed"] and r["parity"]["native_rel_l2"] > 10 * r["parity"]["tolerance"]["rel_l2"]
    printed = capsys.readouterr().out
    assert "FAIL" in printed and "parity 0/1 passed (FAILED: pixtral)" in printed


def test_no_parity_skips_the_verdict(tmp_path, capsys):
    from mmparity.cli.main import main

    out = tmp_path / "bench.json"
    assert main(["bench", "clip", "--dtype", "bfloat16", "--no-parity", "--repeats", "1", "--warmup", "0",
                 "--quiet", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["parity_checked"] is False and report["results"][0]["parity"] is None
    assert "parity not checked" in capsys.readouterr().out


def test_report_is_handed_over_after_each_family():
    seen = []
    report = bench.bench(["clip", "siglip"], repeats=1, warmup=0,
                         on_result=lambda rep: seen.append((len(rep.results), rep.complete)))
    assert seen == [(1, False), (2, False)] and report.complete


# --- mixed sizes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", PUBLISHED_TOWERS)
def test_published_mixed_sets_are_valid_and_comparable(family):
    """Every published family has a packed mixed-size set its sizes rules accept, with about the
    uniform batch's token count (so the two timings compare)."""
    if family not in families.names():
        pytest.skip(f"family {family!r} is not registered")
    cfg = bench.published_config(families.get(family))
    images, sizes = bench.mixed_batch(families.get(family), "published", cfg)
    assert len(set(sizes)) >= 6 and images >= 8
    shape = bench.tower_shape(families.get(family), cfg)
    tokens = lambda batch: sum((h // shape.patch) * (w // shape.patch) + shape.class_tokens  # noqa: E731
                               for h, w in batch)
    uniform_n, uniform_size = bench.default_batch(families.get(family), "published", cfg)
    mixed = [sizes[i % len(sizes)] for i in range(images)]
    assert 0.9 < tokens(mixed) / tokens([uniform_size] * uniform_n) < 1.1


def test_mixed_sets_refused_are_skipped_or_usage_errors(monkeypatch):
    # One patch a side is below pixtral_large's 2x2 merge block.
    monkeypatch.setattr(bench, "TINY_MIXED_UNITS", ((1, 1), (2, 2)))
    accepted, refused = bench.with_mixed_sets([families.get("pixtral"), families.get("pixtral_large")], "tiny")
    assert [fam.name for fam in accepted] == ["pixtral"]
    assert refused[0]["family"] == "pixtral_large" and "merge block" in refused[0]["reason"]
    with pytest.raises(bench.BenchError, match="mixed sizes"):
        bench.bench(["pixtral_large"], mixed=True)
    with pytest.raises(bench.BenchError, match="drop --image-size"):
        bench.bench(["pixtral"], mixed=True, image_sizes=[(16, 16)])


def test_mixed_tiny_runs_packed_with_parity(tmp_path):
    from mmparity.cli.main import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "pixtral", "siglip", "qwen3_5", "kimi_k25", "--mixed", "--dtype", "bfloat16",
               "--repeats", "1", "--warmup", "0", "--quiet", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, [(r["family"], r["error"], r["parity"]) for r in report["results"]]
    assert report["mixed"] is True
    for r in report["results"]:
        m = size_multiple(families.get(r["family"]), families.get(r["family"]).tiny_config())
        assert r["case"] == "packed" and r["images"] == len(bench.TINY_MIXED_UNITS)
        assert r["image_sizes"] == [[h * m, w * m] for h, w in bench.TINY_MIXED_UNITS]
        assert r["parity"]["passed"], (r["family"], r["parity"])
        assert "grouped" in r["native"]["detail"]["attention_kernels"]  # per-size SDPA on the CPU
