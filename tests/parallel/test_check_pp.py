"""Pipeline-parallel parity (``check --pp``): each stage on its own gloo rank, against HF.

Spawned ranks cost seconds each to start, so the TP=1, PP=2 checks share one two-rank spawn: every
rank runs ``harness.check`` in-process, exactly as under ``torchrun --nproc-per-node 2``.
"""

from __future__ import annotations

import json

import pytest
import torch

from mmparity.models import registry as families
from mmparity.cli.main import main
from mmparity.parallel import runtime
from mmparity.parallel.pp import PipelineError, buildable_layer_counts, hand_tied_copy, merge_pipeline_stages
from mmparity.parity import harness
from mmparity.models.core.inputs import random_like_state

STAGE_1_WEIGHT = "decoder.layers.1.mlp.linear_fc2.weight"  # layer 1 of 2: the second stage's


def _perturb_stage_1(state):
    state[STAGE_1_WEIGHT] = state[STAGE_1_WEIGHT].clone()
    state[STAGE_1_WEIGHT][0, 0] += 0.5


def _with_layers(family: str, layers: int):
    cfg = families.get(family).tiny_config()
    (cfg.text_config if family == "llava" else cfg).num_hidden_layers = layers
    return cfg


TABLE = "language_model.embedding.word_embeddings.weight"
HEAD = "language_model.output_layer.weight"  # a tied head's last-stage copy of TABLE


def _tied(family: str):
    """The family's tiny whole VLM with its head tied to the embedding table."""
    cfg = families.get(family).tiny_config()
    cfg.tie_word_embeddings = cfg.text_config.tie_word_embeddings = True
    return cfg


def _perturb_table(state):
    state[TABLE] = state[TABLE].clone()
    state[TABLE][:, 0] += 0.5


def _copy_differs(state):
    """A last-stage copy of the tied table that is not the table (a head untied somewhere)."""
    state[HEAD] = state[TABLE].clone()
    state[HEAD][0, 0] += 0.5


def _pp2_checks(rank: int, world_size: int, plan: list) -> dict | None:
    out = {label: harness.check(family, pp=2, seed=5, **kwargs) for label, family, kwargs in plan}
    return out if rank == 0 else None


def _refuses_pp2(name: str) -> list:
    """What the family's record says against ``check --pp 2`` on its tiny config (a tower whose
    taps feed mergers on another stage, say): such a family is not checked at PP 2 here."""
    fam = families.get(name)
    return fam.hooks.config.pipeline_problems(fam.tiny_config(), 2)


@pytest.fixture(scope="module")
def pp2_reports():
    plan = [(name, name, {}) for name in families.names() if not _refuses_pp2(name)]
    # 3 layers over 2 stages: [2, 1], the first stage takes the remainder, as convert splits it.
    plan += [("pixtral 3 layers", "pixtral", {"cfg": _with_layers("pixtral", 3), "components": False}),
             ("llava 3 layers", "llava", {"cfg": _with_layers("llava", 3), "components": False}),
             ("pixtral perturbed", "pixtral", {"mutate_native": _perturb_stage_1, "components": False}),
             # gemma3 and gemma4 are tied as they come; llava and internvl tied here.
             ("llava tied", "llava", {"cfg": _tied("llava"), "components": False}),
             ("internvl tied", "internvl", {"cfg": _tied("internvl"), "components": False}),
             ("llava tied, table perturbed", "llava", {"cfg": _tied("llava"), "mutate_native": _perturb_table,
                                                       "components": False}),
             # Megatron's own classes load the same last-stage copy: LLaVAModel, and GPTModel for
             # gemma3's language model.
             ("llava tied, Megatron's class", "llava", {"cfg": _tied("llava"), "impl": "megatron"}),
             ("gemma3, Megatron's class", "gemma3", {"impl": "megatron"})]
    return runtime.spawn(_pp2_checks, 2, plan)[0]


def _failures(report):
    return [(r.check, r.metrics, r.first_divergence) for r in report.failures()]


@pytest.mark.slow
@pytest.mark.parametrize("family", families.names())
def test_check_pp2_passes_for_every_family(pp2_reports, family):
    if family not in pp2_reports:
        pytest.skip(f"{family} refuses --pp 2: {_refuses_pp2(family)}")
    report = pp2_reports[family]
    assert (report.tp, report.pp) == (1, 2)
    assert report.passed, _failures(report)
    # Module pairs and components came from both stages.
    checks = {r.check for r in report.results}
    assert {f"component:{name}" for name in families.get(family).hooks.parity.components} <= checks
    modules = {row["module"] for row in report.results[0].modules}
    assert {"layer.0", "layer.1"} <= modules or {
        "language_model.decoder.layers.0", "language_model.decoder.layers.1"} <= modules, modules


@pytest.mark.slow
def test_uneven_split_passes(pp2_reports):
    for label in ("pixtral 3 layers", "llava 3 layers"):
        report = pp2_reports[label]
        assert report.passed, (label, _failures(report))
        modules = {row["module"] for row in report.results[0].modules}
        named = "language_model.decoder.layers.{}" if label.startswith("llava") else "layer.{}"
        assert {named.format(i) for i in range(3)} <= modules, label


@pytest.mark.slow
def test_negative_control_on_the_second_stage_is_located(pp2_reports):
    report = pp2_reports["pixtral perturbed"]
    assert not report.passed
    assert {r.first_divergence.module for r in report.failures()} == {"layer.1.mlp"}


@pytest.mark.slow
def test_a_tied_head_passes_over_pipeline_stages(pp2_reports):
    """The last stage computes the logits with its own copy of the table, as Megatron's does."""
    for label in ("llava tied", "internvl tied", "gemma3", "gemma4", "llava tied, Megatron's class",
                  "gemma3, Megatron's class"):
        report = pp2_reports[label]
        assert report.passed, (label, _failures(report))
        assert any(r.check.endswith(":logits") for r in report.results), label
    assert {r.impl for r in pp2_reports["gemma3, Megatron's class"].results} == {"megatron"}


@pytest.mark.slow
def test_a_perturbed_tied_table_fails_on_both_stages(pp2_reports):
    # The table and the last stage's copy are one tensor in the converter's state: perturbed
    # together, the embedding and the head both change (the copy is the table, not a stale one).
    report = pp2_reports["llava tied, table perturbed"]
    assert not report.passed
    failed = {r.check.rpartition(":")[2] for r in report.failures()}
    assert "logits" in failed, failed


def test_the_last_stage_of_a_tied_head_holds_its_own_copy():
    fam = families.get("llava")
    cfg = _tied("llava")
    ref = fam.build_reference(cfg)
    shards = fam.hf_to_mcore(harness.load_reference_weights(ref, None, 3), cfg, tp_size=2)
    assert HEAD not in shards[0]  # the converter keeps one table
    stages, counts = harness.split_stages(fam, cfg, shards, 2)
    for rank in range(2):
        first, last = stages[0][rank], stages[1][rank]
        assert TABLE in first and HEAD not in first and TABLE not in last
        assert last[HEAD] is shards[rank][TABLE]  # Megatron's last-stage copy, as convert writes it


def test_a_handed_copy_is_held_to_the_merge_rule():
    table = torch.tensor([[1.0, float("nan")], [-0.0, 2.0]])
    tied = (TABLE, HEAD)
    assert hand_tied_copy({TABLE: table}, tied)[HEAD] is table
    same_bytes = hand_tied_copy({TABLE: table, HEAD: table.clone()}, tied)  # NaN and -0.0 alike
    assert merge_pipeline_stages([{TABLE: table}, same_bytes], [0, 0])[TABLE] is table
    for other in (table.nan_to_num(), torch.tensor([[1.0, float("nan")], [0.0, 2.0]])):
        with pytest.raises(PipelineError, match="differs from"):
            hand_tied_copy({TABLE: table, HEAD: other}, tied)
    assert hand_tied_copy({TABLE: table}, None) == {TABLE: table}


def test_a_last_stage_copy_that_is_not_the_table_is_refused():
    # merge_pipeline_stages' rule and verify --load's: a tied copy is accepted only bit-identical.
    with pytest.raises(harness.InputError, match=f"{HEAD} differs from {TABLE}"):
        harness.check("llava", _tied("llava"), pp=2, mutate_native=_copy_differs, components=False)


@pytest.mark.slow
def test_tp2_pp2_passes():
    report = harness.check("pixtral", tp=2, pp=2, seed=5, components=False)
    assert (report.tp, report.pp) == (2, 2)
    assert report.passed, _failures(report)


def test_unbuildable_pipelines_are_input_errors():
    # A split written elsewhere, [2, 2, 1, 1]: mcore can only make the first / last stage differ.
    with pytest.raises(harness.InputError, match=r"\[2, 2, 1, 1\] cannot be built"):
        harness.check("pixtral", _with_layers("pixtral", 6), pp=4, layer_counts=[2, 2, 1, 1], components=False)


def test_convert_only_writes_splits_mcore_can_build():
    for layers in range(1, 13):
        for stages in range(1, layers + 1):
            counts = buildable_layer_counts(layers, stages)
            assert sum(counts) == layers and len(counts) == stages and min(counts) >= 1
            runtime.uneven_stage_fields(counts)  # raises for a split mcore cannot build


def test_uneven_stage_fields():
    assert runtime.uneven_stage_fields([2, 2]) == {}
    assert runtime.uneven_stage_fields([2, 1]) == {"num_layers_in_first_pipeline_stage": 2}
    assert runtime.uneven_stage_fields([2, 2, 1]) == {"num_layers_in_last_pipeline_stage": 1}
    assert runtime.uneven_stage_fields([3, 2, 2, 1]) == {"num_layers_in_first_pipeline_stage": 3,
                                                         "num_layers_in_last_pipeline_stage": 1}


def _run_cli(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (("--pp", "3"), "--pp 3 is more pipeline stages than the 2 layers"),
    (("--pp", "0"), "--pp must be >= 1"),
    (("--tp", "3", "--pp", "2"), "tp=3 does not divide num_attention_heads=4"),
])
def test_cli_pipeline_errors_exit_2(capsys, argv, message):
    code, out, err = _run_cli(capsys, "check", "pixtral", *argv)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _check_legacy_pp2(capsys, tmp_path, family: str) -> dict:
    """A tiny ``family`` saved by transformers, converted to legacy at PP 2 and checked from the
    checkpoint alone: the report."""
    fam = families.get(family)
    model = fam.build_reference(fam.tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=8))
    model.save_pretrained(tmp_path / "hf")
    code, _, err = _run_cli(capsys, "convert", "--src", str(tmp_path / "hf"), "--dst", str(tmp_path / "legacy"),
                            "--to", "mcore", "--family", family, "--format", "legacy", "--pp", "2", "--quiet")
    assert code == 0, err
    code, out, err = _run_cli(capsys, "check", "--mcore", str(tmp_path / "legacy"), "--no-components",
                              "--json", str(tmp_path / "report.json"), "--quiet")
    assert code == 0, out + err
    return json.loads((tmp_path / "report.json").read_text())


@pytest.mark.slow
def test_check_mcore_runs_a_legacy_checkpoint_at_its_pipeline_size(capsys, tmp_path):
    report = _check_legacy_pp2(capsys, tmp_path, "pixtral")
    assert (report["tp"], report["pp"], report["passed"]) == (1, 2, True)


@pytest.mark.slow
def test_check_mcore_runs_a_tied_head_at_pp2_and_refuses_a_copy_that_differs(capsys, tmp_path):
    """gemma3's head is tied: the legacy checkpoint's last stage holds the copy convert writes,
    check runs it on two stages; a copy that is not the table is refused by name, exit 2."""
    report = _check_legacy_pp2(capsys, tmp_path, "gemma3")
    assert (report["tp"], report["pp"], report["passed"]) == (1, 2, True)
    stage = next((tmp_path / "legacy").rglob("mp_rank_00_001/model_optim_rng.pt"))
    payload = torch.load(stage, weights_only=False)
    payload["model"][HEAD][0, 0] += 1
    torch.save(payload, stage)
    code, out, err = _run_cli(capsys, "check", "--mcore", str(tmp_path / "legacy"), "--no-components", "--quiet")
    assert code == 2 and out == ""
    assert f"{HEAD} differs from {TABLE}" in err and len(err.strip().splitlines()) == 1
