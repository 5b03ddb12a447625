"""The Qwen-VL language models through Megatron-LM main's ``pretrain_gpt.py`` path and back.

Megatron-LM cannot build a whole Qwen3-VL, Qwen3-VL-MoE or Qwen2.5-VL (no class has DeepStack,
window attention or their towers), so their users train the language model alone, as
``pretrain_gpt.py`` builds it from flags: stock ``GPTModel``. Here, for

* ``qwen3_vl_whole``: a dense Qwen3 decoder (per-head q/k RMSNorms, ``--qk-layernorm``; no biases),
  TP 2 x PP 2;
* ``qwen2_5_vl_whole``: a Qwen2 decoder (q/k/v biases, ``--add-qkv-bias``), TP 2 x PP 2;
* ``qwen3_vl_moe``: a Qwen3-MoE decoder (softmax top-k router with the top-k renormalised, which is
  Megatron's softmax after top-k; no shared expert; fused experts, ``--moe-grouped-gemm``; a dense
  layer among the MoE ones, ``--moe-layer-freq``), TP 2 x EP 2:

HF release -> ``mmparity convert --part language_model`` (``GPTModel``'s layout) -> Megatron-LM's
own ``parse_args`` / ``validate_args`` / ``get_model(model_provider(gpt_builder))`` ->
``load_checkpoint(strict=True)``, logits equal to mmparity's own loader's and within the fp32 bound
of HF's -> the weights changed as training changes them (those of a perturbed copy of the release)
-> megatron-core's optimizer (plain or distributed, stepped) -> ``save_checkpoint`` -> that
checkpoint loaded back and saved in the other format, as ``--ckpt-convert-format`` does ->
``mmparity convert --to hf --base RELEASE`` of both -> the whole release again, bit for bit: the
language model the trained weights, the tower and its merger(s) the base's.

RoPE. These decoders rotate with M-RoPE: three position axes (time, height, width), each owning a
section of the rotary frequencies (Qwen3-VL interleaves the sections t h w t h w ..., Qwen2.5-VL
keeps them contiguous). ``GPTModel`` built with ``--position-embedding-type rope`` has one axis: it
rotates token ``i`` by ``i`` times every frequency. On text alone HF gives all three axes the same
position, the token's index, so every frequency is turned by the same ``i`` whichever section it
belongs to: M-RoPE is plain RoPE there, and ``GPTModel``'s logits equal HF's (checked below, and
by ``check --impl megatron``). On images the axes differ and ``GPTModel``'s rotation is another
function; that changes what a run computes, never which tensors it holds or where: the state dict
(names, shapes, splits) has no positions in it, so the loop is right for the weights whatever
positions a run feeds, and the round trip is checked on them bit for bit.

``--use-checkpoint-args``: the ``args`` ``convert`` records build the same model (logits equal to
mmparity's loader's) given only the flags Megatron-LM's ``load_args_from_checkpoint`` does not
restore, ``lm.NOT_RESTORED``; for these models those are ``--norm-epsilon``, ``--qk-layernorm``
(Qwen3's q/k norms) and ``--moe-router-dtype``. Their values are in the recorded ``args`` under
Megatron's names; its loader does not copy them (docs/megatron.md).

Megatron-LM's training code is in no release (its ``main`` only, Python >= 3.12): these tests
run where its ``megatron/`` is on ``PYTHONPATH`` and ``MEGATRON_LM`` names the checkout, and skip
otherwise, as in CI. The CPU stand-ins are the harness's (``tests/megatron_lm_gpt.py``).
"""

from __future__ import annotations

import argparse

import pytest

from mmparity.models import registry as families
from tests import megatron_lm_gpt as lm
from tests.io.test_megatron_written import make_pair
from tests.megatron.test_megatron_lm_gpt import (assert_loaded_as_mmparity_loads, convert_part, report, run_ranks,
                                                train_and_export)

SKIP = lm.skip_reason()
pytestmark = [pytest.mark.skipif(SKIP is not None, reason=SKIP or ""), pytest.mark.slow]

# (TP, PP, EP): the dense decoders' layers over two stages, the experts over two ranks (more
# ranks do not finish on a two-core machine).
GRIDS = {"qwen3_vl_whole": (2, 2, 1), "qwen2_5_vl_whole": (2, 2, 1), "qwen3_vl_moe": (2, 1, 2)}


def model_flags(cfg) -> list[str]:
    """The flags a Megatron-LM user trains the Qwen-VL model ``cfg``'s language model with, read
    off its HF text config: the dense decoder's (``lm.model_flags``), Qwen3's q/k norms or Qwen2's
    q/k/v biases, and Qwen3-MoE's experts and router."""
    text = cfg.text_config
    flags = lm.model_flags(cfg)
    if bool(getattr(text, "attention_bias", False)) or text.model_type.startswith("qwen2"):
        flags.append("--add-qkv-bias")
    if text.model_type.startswith("qwen3"):
        flags.append("--qk-layernorm")
    # HF ties the head by the whole model's flag (the MoE text config's own says True, unread).
    if getattr(cfg, "tie_word_embeddings", False):
        flags.remove("--untie-embeddings-and-output-weights")
    experts = int(getattr(text, "num_experts", 0) or 0)
    if experts:
        from mmparity.models.qwen3_vl_moe.config import moe_layers

        moe = set(moe_layers(text))
        freq = "[" + ",".join(str(int(i in moe)) for i in range(text.num_hidden_layers)) + "]"
        flags += ["--num-experts", str(experts), "--moe-layer-freq", freq,
                  "--moe-ffn-hidden-size", str(text.moe_intermediate_size),
                  "--moe-router-topk", str(text.num_experts_per_tok), "--moe-router-score-function", "softmax",
                  "--moe-router-dtype", "fp32", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "allgather",
                  "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0"]
    return flags


def tiny(family: str):
    """The family's tiny config; a dense one with 4 decoder layers, as Megatron-LM splits layers
    evenly over PP 2 unless told otherwise (``--decoder-first-pipeline-num-layers``)."""
    if GRIDS[family][1] == 1:
        return families.get(family).tiny_config()
    import importlib

    return importlib.import_module(f"mmparity.models.{family}.reference").tiny_config(num_hidden_layers=4)


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict:
    """family -> (base release, its trained copy, config)."""
    made = {}
    for family in GRIDS:
        cfg = tiny(family)
        made[family] = (*make_pair(family, tmp_path_factory.mktemp(family), cfg), cfg)
    return made


def test_the_flags_are_the_recorded_args(capsys, tmp_path, releases):
    """What ``convert`` records says what the flags say: the two cannot drift apart unseen."""
    from mmparity.io.megatron_args import read_legacy_args

    for family, (base, _trained, cfg) in releases.items():
        part = convert_part(capsys, base, tmp_path / family, "legacy", (1, 1, 1))
        args = read_legacy_args(next(part.rglob("model_optim_rng.pt")))
        flags = model_flags(cfg)
        assert args.qk_layernorm == ("--qk-layernorm" in flags), family
        assert args.add_qkv_bias == ("--add-qkv-bias" in flags), family
        assert args.untie_embeddings_and_output_weights == ("--untie-embeddings-and-output-weights" in flags)
        assert args.kv_channels == int(flags[flags.index("--kv-channels") + 1]), family
        if "--num-experts" in flags:
            freq = flags[flags.index("--moe-layer-freq") + 1]
            assert args.moe_layer_freq == [int(c) for c in freq.strip("[]").split(",")], family
            assert 0 in args.moe_layer_freq and 1 in args.moe_layer_freq  # a mix: the tiny model's dense layer
            assert args.moe_router_score_function == "softmax" and args.moe_grouped_gemm and \
                args.moe_router_pre_softmax is False and "moe_shared_expert_intermediate_size" not in vars(args)
        else:
            assert "num_experts" not in vars(args), family
        assert isinstance(args, argparse.Namespace)


@pytest.mark.parametrize("fmt, optimizer", [("legacy", "plain"), ("torch_dist", "distributed")])
@pytest.mark.parametrize("family", list(GRIDS))
def test_pretrain_gpt_loads_trains_saves_and_exports(capsys, tmp_path, releases, family, fmt, optimizer):
    base, trained, cfg = releases[family]
    train_and_export(capsys, tmp_path, family=family, label=family, base=base, trained=trained,
                     vocab=cfg.text_config.vocab_size, flags=model_flags(cfg), grid=GRIDS[family], fmt=fmt,
                     optimizer=optimizer)


@pytest.mark.parametrize("family, fmt", [("qwen3_vl_whole", "torch_dist"), ("qwen2_5_vl_whole", "legacy"),
                                         ("qwen3_vl_moe", "legacy")])
def test_use_checkpoint_args_rebuilds_the_model(capsys, tmp_path, releases, family, fmt):
    """Only the run's own flags, ``--use-checkpoint-args``, and ``lm.NOT_RESTORED`` (here the norm
    epsilon, Qwen3's ``--qk-layernorm``, the router dtype): Megatron-LM builds the model from the
    ``args`` mmparity wrote (biases, GQA, head width, experts, the MoE layer pattern), loads it
    strictly and computes what HF computes."""
    base, _trained, cfg = releases[family]
    tp, pp, ep = grid = GRIDS[family]
    vocab = cfg.text_config.vocab_size
    src = convert_part(capsys, base, tmp_path / "part", fmt, grid)
    reference = src if fmt == "legacy" else convert_part(capsys, base, tmp_path / "reference", "legacy", grid)
    given = lm.only(model_flags(cfg), lm.NOT_RESTORED)
    argv = given + lm.run_flags(tp=tp, pp=pp, ep=ep, fmt=fmt, load=str(src), save=str(tmp_path / "unused"),
                                vocab=vocab)
    argv += ["--use-checkpoint-args", "--no-load-optim", "--no-load-rng"]
    assert not {"--num-layers", "--add-qkv-bias", "--num-experts", "--moe-layer-freq", "--kv-channels"} & set(argv)
    results = run_ranks(dict(family=family, tp=tp, pp=pp, ep=ep, argv=argv, load=str(src), hf=str(base),
                             reference=str(reference), vocab=vocab))
    assert_loaded_as_mmparity_loads(results)
    report(capsys, f"--use-checkpoint-args {family} {fmt} (given {given}): logits vs HF rel_l2 "
                   f"{max(r['hf_rel_l2'] for r in results if 'hf_rel_l2' in r):.2g}")


def test_qk_layernorm_is_not_restored(capsys, tmp_path, releases):
    """Upstream: ``load_args_from_checkpoint`` does not restore ``qk_layernorm``, although the
    checkpoint records it: a Qwen3 run with ``--use-checkpoint-args`` and without ``--qk-layernorm``
    builds attention without q/k norms, and the strict load of a checkpoint that holds them fails
    naming them (docs/megatron.md)."""
    base, _trained, cfg = releases["qwen3_vl_whole"]
    src = convert_part(capsys, base, tmp_path / "part", "legacy", (1, 1, 1))
    given = [f for f in lm.only(model_flags(cfg), lm.NOT_RESTORED) if f != "--qk-layernorm"]
    argv = given + lm.run_flags(tp=1, pp=1, ep=1, fmt="legacy", load=str(src), save=str(tmp_path / "unused"),
                                vocab=cfg.text_config.vocab_size)
    (result,) = run_ranks(dict(family="qwen3_vl_whole", tp=1, pp=1, ep=1, load=str(src), reference=False,
                               argv=argv + ["--use-checkpoint-args", "--no-load-optim", "--no-load-rng"],
                               vocab=cfg.text_config.vocab_size))
    said = " ".join(result.get("strict_failed", [])) + result.get("load_error", "")
    assert "q_layernorm" in said, result
