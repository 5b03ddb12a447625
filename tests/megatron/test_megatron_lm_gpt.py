"""A whole VLM's language model through Megatron-LM main's ``pretrain_gpt.py`` path and back.

Megatron-LM's ``LLaVAModel`` builds neither the Kimi-K2.5 nor the Mistral3 tower, so their users
train the language model as ``pretrain_gpt.py`` builds it: ``GPTModel`` from their flags. Here:

HF release -> ``mmparity convert --part language_model`` (``GPTModel``'s layout) -> Megatron-LM's
own ``parse_args`` / ``validate_args`` / ``get_model(model_provider(gpt_builder))`` ->
``load_checkpoint(strict=True)``, logits equal to mmparity's own loader's and to HF's -> the
weights changed as training changes them (those of a perturbed copy of the release) -> an
optimizer (megatron-core's, plain or distributed, stepped) -> ``save_checkpoint`` -> that
checkpoint loaded back and saved in the other format, as ``--ckpt-convert-format`` does ->
``mmparity convert --to hf --base RELEASE`` of both -> the whole release again, bit for bit: the
language model the trained weights, the tower and projector the base's.

Kimi-K2.5 (DeepSeek-V3: MLA, routed and shared experts) at TP 2 x EP 2, Mistral3 at TP 2 x PP 2,
legacy (``--ckpt-format torch``) and torch_dist. The Kimi config keeps YaRN's
``original_max_position_embeddings`` / ``beta_fast`` / ``beta_slow`` at the values Megatron-LM's
MLA cannot be told otherwise (4096 / 32 / 1): with any other values the flags build another
function (``test_yarn_parameters_the_command_line_cannot_express``, docs/megatron.md).

Megatron-LM's training code is in no release (its ``main`` only, Python >= 3.12): these tests
run where its ``megatron/`` is on ``PYTHONPATH`` and ``MEGATRON_LM`` names the checkout (for
``gpt_builders.py`` / ``model_provider.py``), and skip otherwise, as in CI. The CPU stand-ins are
the harness's (``tests/megatron_lm_gpt.py``), never mmparity's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mmparity.models import registry as families
from mmparity.parallel import runtime
from tests import megatron_lm_gpt as lm
from tests.cli.test_convert_cli import run_cli
from tests.io.test_megatron_written import check_export, make_pair

SKIP = lm.skip_reason()
pytestmark = [pytest.mark.skipif(SKIP is not None, reason=SKIP or ""), pytest.mark.slow]

# (TP, PP, EP) each family's language model is trained at.
GRIDS = {"kimi_k25_vl": (2, 1, 2), "mistral3": (2, 2, 1)}
# Logits of the model Megatron-LM builds from the flags against mmparity's loader of the same
# checkpoint (the same class and weights: equal) and against HF (fp32 policy).
HF_REL_L2 = 1e-5


def family_config(family: str, **yarn):
    """The family's tiny config; Kimi's with YaRN's correction range at Megatron's MLA defaults
    (or at ``yarn``)."""
    if family != "kimi_k25_vl":
        return families.get(family).tiny_config()
    from mmparity.models.kimi_k25_vl.reference import tiny_config, tiny_text

    rope = {**tiny_text()["rope_parameters"], "original_max_position_embeddings": 4096, "beta_fast": 32.0,
            "beta_slow": 1.0, **yarn}
    return tiny_config(rope_parameters=rope)


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict:
    """family -> (base release, its trained copy, config)."""
    made = {}
    for family in GRIDS:
        root = tmp_path_factory.mktemp(family)
        cfg = family_config(family)
        made[family] = (*make_pair(family, root, cfg), cfg)
    return made


def convert_part(capsys, src: Path, dst: Path, fmt: str, grid: tuple) -> Path:
    tp, pp, ep = grid
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", dst, "--to", "mcore", "--part", "language_model",
                             "--format", fmt, "--tp", tp, "--pp", pp, "--ep", ep)
    assert code == 0, out + err
    assert "laid out for Megatron's GPTModel" in out
    return dst


def report(capsys, line: str) -> None:
    """A measured number, on the terminal (``-s``) even where the test reads its own output."""
    with capsys.disabled():
        print(f"MEASURED {line}")


def run_ranks(params: dict) -> list[dict]:
    """Every rank in a process of its own (Megatron-LM's globals are set once per process)."""
    return runtime.spawn(lm.gpt_rank, params["tp"] * params["pp"] * params["ep"], params)


def assert_loaded_as_mmparity_loads(results: list[dict], iteration: int = 1) -> None:
    for r in results:
        assert "load_error" not in r, r
        assert r["iteration"] == iteration and r["tensors"] > 0 and not r["unequal"], r
        assert not r.get("strict_failed"), r  # a strict load Megatron-LM retried non-strict loaded nothing
    last = [r for r in results if "rel_l2" in r]
    assert last, results
    for r in last:
        assert r["equal"], r  # the same class and weights: the same logits, bit for bit
        assert r["hf_rel_l2"] <= HF_REL_L2, r


def convert_whole(capsys, src: Path, dst: Path, fmt: str, grid: tuple) -> Path:
    """A language model that is the whole release (no tower): converted whole."""
    tp, pp, ep = grid
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", dst, "--to", "mcore", "--format", fmt,
                             "--tp", tp, "--pp", pp, "--ep", ep)
    assert code == 0, out + err
    return dst


def assert_weights_loaded(results: list[dict]) -> None:
    """Every tensor of each rank's file, and no other, bit for bit: where the model Megatron-LM
    builds is not run against HF (Megatron-LM's legacy loader retries a failed strict load
    non-strictly and goes on, so only the values tell)."""
    for r in results:
        assert "load_error" not in r, r
        assert r["iteration"] == 1 and r["tensors"] > 0 and not r["unequal"] and not r["strict_failed"], r


def train_and_export(capsys, tmp_path: Path, *, family: str, label: str, base: Path, trained: Path, vocab: int,
                     flags: list, grid: tuple, fmt: str, optimizer: str, logits: bool = True,
                     alone: bool = False, verify_saved: bool = False, length: int | None = None) -> list[dict]:
    """The whole loop for one model, format and optimizer: ``base`` converted (the language model
    part, or the whole release where it is a language model ``alone``) at ``grid`` -> Megatron-LM
    built from ``flags``, loading it strictly (its logits equal to mmparity's loader's and within
    the bound of HF's where ``logits``, on rows of ``length`` tokens; otherwise its every tensor
    equal to the legacy conversion's)
    -> ``trained``'s weights in place, an optimizer stepped -> ``save_checkpoint``, and that saved
    again in the other format -> each exported with ``--base`` bit-exact against ``trained``: the
    language model the trained weights, anything else (tower, projector) the base's."""
    convert = convert_whole if alone else convert_part
    tp, pp, ep = grid
    src = convert(capsys, base, tmp_path / "part", fmt, grid)
    changed = convert(capsys, trained, tmp_path / "trained_part", "legacy", grid)
    reference = src if fmt == "legacy" else convert(capsys, base, tmp_path / "reference", "legacy", grid)
    save, converted = tmp_path / "megatron_lm", tmp_path / "converted"
    other = "torch_dist" if fmt == "legacy" else "torch"
    argv = flags + lm.run_flags(tp=tp, pp=pp, ep=ep, fmt=fmt, load=str(src), save=str(save), vocab=vocab)
    argv += ["--no-load-optim", "--no-load-rng"] + (["--use-distributed-optimizer"] if optimizer == "distributed" else [])
    params = dict(family=family, tp=tp, pp=pp, ep=ep, argv=argv, load=str(src), vocab=vocab, save=str(save),
                  trained=str(changed), optimizer=optimizer, convert_to=other, convert_save=str(converted),
                  length=length)
    if logits:
        params.update(hf=str(base), reference=str(reference))
    else:
        params.update(reference=False, expected=str(reference), forward=False)
    results = run_ranks(params)
    if logits:
        assert_loaded_as_mmparity_loads(results)
        measured = f", logits vs HF rel_l2 {max(r['hf_rel_l2'] for r in results if 'hf_rel_l2' in r):.2g}"
    else:
        assert_weights_loaded(results)
        measured = ""
    report(capsys, f"{label} {fmt} {optimizer} TP {tp} PP {pp} EP {ep}: "
                   f"{sum(r['tensors'] for r in results)} tensors loaded strictly by Megatron-LM{measured}")
    assert all(r["converted_iteration"] == lm.ITERATION and not r["moved_by_optimizer"] for r in results), results
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(lm.ITERATION)
    if verify_saved:
        code, out, err = run_cli(capsys, "verify", save)
        assert code == 0 and "Megatron-written" in out and "optimizer" in out.split("holds:")[1].split(";")[0], \
            out + err
    for ckpt, name in ((save, "hf_saved"), (converted / other, "hf_converted")):
        result = check_export(capsys, ckpt, tmp_path / name, base, trained)
        if alone:
            assert not result["from_base"], result["from_base"]  # every tensor is the trained one
        else:
            # What the trained language model never held (tower, projector) is the base's; every
            # language-model tensor is the trained one.
            assert result["from_base"] and all(not k.startswith(("model.language_model.", "lm_head."))
                                               for k in result["from_base"]), result["from_base"]
        report(capsys, f"{label} {fmt} {name}: bit-exact, {len(result['from_base'])} tensors from the base")
    return results


@pytest.mark.parametrize("fmt, optimizer", [("legacy", "plain"), ("torch_dist", "distributed")])
@pytest.mark.parametrize("family", list(GRIDS))
def test_pretrain_gpt_loads_trains_saves_and_exports(capsys, tmp_path, releases, family, fmt, optimizer):
    base, trained, cfg = releases[family]
    train_and_export(capsys, tmp_path, family=family, label=family, base=base, trained=trained,
                     vocab=cfg.text_config.vocab_size, flags=lm.model_flags(cfg), grid=GRIDS[family], fmt=fmt,
                     optimizer=optimizer, verify_saved=True)


def recorded_args(capsys, release: Path, tmp_path: Path):
    """The ``args`` that ``convert --part language_model`` records for ``release`` (legacy, TP 1)."""
    from mmparity.io.megatron_args import read_legacy_args

    return read_legacy_args(next(convert_part(capsys, release, tmp_path / "part", "legacy", (1, 1, 1))
                                 .rglob("model_optim_rng.pt")))


def flag_value(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def run_with_checkpoint_args(capsys, tmp_path: Path, *, family: str, base: Path, cfg, kept: list[str], grid: tuple,
                             fmt: str, absent: tuple) -> None:
    """A run given its own flags, ``--use-checkpoint-args`` and ``kept`` (what Megatron-LM's
    ``load_args_from_checkpoint`` does not restore), none of ``absent``: built from the ``args``
    mmparity wrote, it loads strictly and computes what mmparity's loader and HF compute."""
    tp, pp, ep = grid
    src = convert_part(capsys, base, tmp_path / "part", fmt, grid)
    reference = src if fmt == "legacy" else convert_part(capsys, base, tmp_path / "reference", "legacy", grid)
    argv = kept + lm.run_flags(tp=tp, pp=pp, ep=ep, fmt=fmt, load=str(src), save=str(tmp_path / "unused"),
                               vocab=cfg.text_config.vocab_size)
    argv += ["--use-checkpoint-args", "--no-load-optim", "--no-load-rng"]
    assert not set(absent) & set(argv), argv
    results = run_ranks(dict(family=family, tp=tp, pp=pp, ep=ep, argv=argv, load=str(src), hf=str(base),
                             reference=str(reference), vocab=cfg.text_config.vocab_size))
    assert_loaded_as_mmparity_loads(results)
    report(capsys, f"--use-checkpoint-args {family} {fmt}: logits vs HF rel_l2 "
          f"{max(r['hf_rel_l2'] for r in results if 'hf_rel_l2' in r):.2g}")


@pytest.mark.parametrize("family, fmt", [("kimi_k25_vl", "legacy"), ("mistral3", "torch_dist")])
def test_use_checkpoint_args_rebuilds_the_model(capsys, tmp_path, releases, family, fmt):
    """Only the run's own flags, ``--use-checkpoint-args``, and what Megatron-LM's
    ``load_args_from_checkpoint`` does not restore (``lm.NOT_RESTORED``: the norm epsilon, and for
    MLA its ranks, head widths, YaRN and router groups): the model is built from the ``args``
    mmparity wrote (MoE widths included), loads strictly and computes what HF computes."""
    base, _trained, cfg = releases[family]
    run_with_checkpoint_args(capsys, tmp_path, family=family, base=base, cfg=cfg,
                             kept=lm.only(lm.model_flags(cfg), lm.NOT_RESTORED), grid=GRIDS[family], fmt=fmt,
                             absent=("--num-experts", "--moe-ffn-hidden-size", "--num-layers"))


def test_use_checkpoint_args_alone_cannot_build_mla(capsys, tmp_path):
    """Upstream: ``load_args_from_checkpoint`` restores neither ``multi_latent_attention`` nor MLA's
    sizes, so with ``--use-checkpoint-args`` and nothing else Megatron-LM builds plain attention
    and a torch_dist load of the MLA checkpoint fails on its shapes (docs/megatron.md)."""
    cfg = family_config("kimi_k25_vl")
    base, _ = make_pair("kimi_k25_vl", tmp_path, cfg)
    src = convert_part(capsys, base, tmp_path / "part", "torch_dist", (1, 1, 1))
    argv = lm.run_flags(tp=1, pp=1, ep=1, fmt="torch_dist", load=str(src), save=str(tmp_path / "unused"),
                        vocab=cfg.text_config.vocab_size) + ["--use-checkpoint-args", "--no-load-optim",
                                                             "--no-load-rng"]
    (result,) = run_ranks(dict(family="kimi_k25_vl", tp=1, pp=1, ep=1, argv=argv, load=str(src), reference=False,
                               vocab=cfg.text_config.vocab_size))
    # Plain attention's output projection (heads x kv_channels wide) where MLA's (heads x v_head_dim).
    heads, hidden, v = cfg.text_config.num_attention_heads, cfg.text_config.hidden_size, cfg.text_config.v_head_dim
    error = result.get("load_error", "")
    assert "self_attention.linear_proj.weight" in error, result
    assert f"({hidden}, {hidden})" in error and f"[{hidden}, {heads * v}]" in error, result


# YaRN's correction range as the HF config has it, against the MLATransformerConfig defaults the
# flags leave: the tiny config's own (original 12 positions) and Kimi-K2's published values
# (beta_fast 1, beta_slow 1, recalled, not read from the hub here).
YARN_CASES = {"tiny": {"original_max_position_embeddings": 12},
              "kimi_k2_published": {"beta_fast": 1.0, "beta_slow": 1.0}}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_parameters_the_command_line_cannot_express(capsys, tmp_path, case):
    """Upstream: ``--yarn-original-max-position-embeddings`` / ``--yarn-beta-fast`` /
    ``--yarn-beta-slow`` are parsed but never reach ``MLATransformerConfig`` (whose fields are
    named without ``yarn_``; ``_apply_yarn_config_from_args`` skips MLA), so a model whose HF
    config differs from 4096 / 32 / 1 is built with another RoPE: its logits leave HF's and
    mmparity's, by the rel_l2 printed (docs/megatron.md), with or without those flags."""
    yarn = YARN_CASES[case]
    cfg = family_config("kimi_k25_vl", **yarn)
    base, _ = make_pair("kimi_k25_vl", tmp_path, cfg)
    src = convert_part(capsys, base, tmp_path / "part", "legacy", (1, 1, 1))
    rope = cfg.text_config.rope_parameters
    told = ["--yarn-original-max-position-embeddings", str(rope["original_max_position_embeddings"]),
            "--yarn-beta-fast", str(rope["beta_fast"]), "--yarn-beta-slow", str(rope["beta_slow"])]
    measured = {}
    for name, extra in (("without", []), ("with_yarn_flags", told)):
        argv = lm.model_flags(cfg) + extra + lm.run_flags(tp=1, pp=1, ep=1, fmt="legacy", load=str(src),
                                                          save=str(tmp_path / "unused"),
                                                          vocab=cfg.text_config.vocab_size)
        (result,) = run_ranks(dict(family="kimi_k25_vl", tp=1, pp=1, ep=1, argv=argv + ["--no-load-optim",
                                                                                         "--no-load-rng"],
                                   load=str(src), hf=str(base), vocab=cfg.text_config.vocab_size))
        assert "load_error" not in result and not result["unequal"], result  # the weights are right
        measured[name] = (result["rel_l2"], result["hf_rel_l2"])
    report(capsys, f"yarn {case} {yarn}: logits rel_l2 vs mmparity's loader / vs HF: {measured}")
    for vs_mmparity, vs_hf in measured.values():
        assert vs_mmparity > 1e-3 and vs_hf > 1e-3, measured
    assert measured["without"] == measured["with_yarn_flags"], measured  # the flags change nothing


def test_use_checkpoint_args_leaves_the_norm_epsilon(capsys, tmp_path):
    """Upstream: ``load_args_from_checkpoint`` does not restore ``layernorm_epsilon`` (``--norm-epsilon``),
    so a run that passes only ``--use-checkpoint-args`` normalises with Megatron's default 1e-5
    where the model has another (Mistral3's tiny config: 1e-3): it loads strictly and computes
    something else, by the rel_l2 printed (docs/megatron.md)."""
    cfg = family_config("mistral3")
    assert cfg.text_config.rms_norm_eps != 1e-5
    base, _ = make_pair("mistral3", tmp_path, cfg)
    src = convert_part(capsys, base, tmp_path / "part", "legacy", (1, 1, 1))
    argv = lm.run_flags(tp=1, pp=1, ep=1, fmt="legacy", load=str(src), save=str(tmp_path / "unused"),
                        vocab=cfg.text_config.vocab_size) + ["--use-checkpoint-args", "--no-load-optim",
                                                             "--no-load-rng"]
    (result,) = run_ranks(dict(family="mistral3", tp=1, pp=1, ep=1, argv=argv, load=str(src), hf=str(base),
                               vocab=cfg.text_config.vocab_size))
    assert "load_error" not in result and not result["unequal"], result  # every weight in place
    report(capsys, f"norm epsilon left at 1e-5 (model {cfg.text_config.rms_norm_eps}): logits rel_l2 vs "
          f"mmparity's loader {result['rel_l2']:.3g}, vs HF {result['hf_rel_l2']:.3g}")
    assert result["rel_l2"] > HF_REL_L2 and result["hf_rel_l2"] > HF_REL_L2, result
