"""Gemma 4's language model through Megatron-LM main's ``pretrain_gpt.py`` path and back.

Megatron-LM cannot build a whole Gemma 4 (no class has its tower). Its language model is stock
``GPTModel`` built with ``--spec mmparity.models.gemma4.megatron LAYER`` (the family's Megatron
class, docs/megatron.md): Gemma 3's Megatron layer with the smallest modules megatron-core lacks,
each layer's width, key/value heads and RoPE read from the ``hf_config.json`` that ``mmparity
convert`` keeps beside the checkpoint Megatron-LM's ``--load`` names (its flags have no place for
them), the flags it has checked against that file; TP 2 x PP 2 (the last stage keeps its own copy
of the tied table, which the legacy conversion writes).

The loop is checked on the logits: HF release -> ``mmparity convert --part language_model`` ->
Megatron-LM's own ``parse_args`` / ``validate_args`` / ``get_model(model_provider(gpt_builder))``
-> ``load_checkpoint(strict=True)``, logits equal to mmparity's own loader's bit for bit and within
the bound of HF's run as the class computes by design (no ``sqrt(hidden)`` embedding scale, no
soft-cap) -> the weights changed as training changes them -> megatron-core's optimizer (plain or
distributed, stepped) -> ``save_checkpoint`` -> that checkpoint saved in the other format ->
``mmparity convert --to hf --base RELEASE`` of both -> the whole release again, bit for bit: the
language model the trained weights, the tower and embedder the base's.

Megatron-LM's training code is in no release (its ``main`` only, Python >= 3.12): these tests run
where its ``megatron/`` is on ``PYTHONPATH`` and ``MEGATRON_LM`` names the checkout, and skip
otherwise, as in CI. The CPU stand-ins are the harness's (``tests/megatron_lm_gpt.py``).
"""

from __future__ import annotations

import functools

import pytest

from mmparity.models import registry as families
from tests import megatron_lm_gpt as lm
from tests.io.test_megatron_written import make_pair
from tests.megatron.test_megatron_lm_gpt import (
    convert_part, flag_value, recorded_args, run_ranks, run_with_checkpoint_args, train_and_export)

SKIP = lm.skip_reason()
pytestmark = [pytest.mark.skipif(SKIP is not None, reason=SKIP or ""), pytest.mark.slow]

FAMILY = "gemma4"
# (TP, PP, EP): heads and query groups over two ranks, the layers over two stages.
GRID = (2, 2, 1)
SPEC = ["--spec", "mmparity.models.gemma4.megatron", "LAYER"]


def model_flags(cfg) -> list[str]:
    """The flags a Megatron-LM user trains Gemma 4's language model with, read off its HF text
    config: the first layer's width and key/value heads (the full layers' come from the file the
    spec reads), no position embedding of the model's own (each layer rotates with its own RoPE),
    a window of ``sliding_window - 1`` keys back on the sliding layers, the tied head."""
    from mmparity.models.parts.gemma4_text.config import SLIDING, layer_groups, layer_head_dim

    text = cfg.text_config
    sliding = "[" + ",".join(str(int(kind == SLIDING)) for kind in text.layer_types) + "]"
    return SPEC + [
        "--num-layers", str(text.num_hidden_layers), "--hidden-size", str(text.hidden_size),
        "--ffn-hidden-size", str(text.intermediate_size), "--num-attention-heads", str(text.num_attention_heads),
        "--group-query-attention", "--num-query-groups", str(layer_groups(text, 0)),
        "--kv-channels", str(layer_head_dim(text, 0)), "--max-position-embeddings", str(text.max_position_embeddings),
        "--position-embedding-type", "none", "--normalization", "RMSNorm",
        "--norm-epsilon", repr(float(text.rms_norm_eps)), "--qk-layernorm", "--swiglu", "--disable-bias-linear",
        "--window-size", f"{text.sliding_window - 1},0", "--window-attn-skip-freq", sliding,
        "--attention-dropout", "0", "--hidden-dropout", "0"]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(base release, its trained copy, config)."""
    cfg = families.get(FAMILY).tiny_config()
    return (*make_pair(FAMILY, tmp_path_factory.mktemp(FAMILY), cfg), cfg)


def test_the_flags_are_the_recorded_args(capsys, tmp_path, release):
    """What ``convert`` records says what the flags say (the spec and the sizes): the two cannot
    drift apart unseen, and ``--use-checkpoint-args`` (which restores ``spec``) builds the class."""
    base, _trained, cfg = release
    args = recorded_args(capsys, base, tmp_path)
    flags = model_flags(cfg)
    value = functools.partial(flag_value, flags)

    assert list(args.spec) == SPEC[1:] and args.position_embedding_type == value("--position-embedding-type")
    assert args.kv_channels == int(value("--kv-channels")) and args.num_query_groups == int(value("--num-query-groups"))
    assert args.ffn_hidden_size == int(value("--ffn-hidden-size")) and args.num_layers == int(value("--num-layers"))
    assert args.hetereogenous_dist_checkpoint and not args.untie_embeddings_and_output_weights and args.swiglu


@pytest.mark.parametrize("fmt, optimizer", [("legacy", "plain"), ("torch_dist", "distributed")])
def test_pretrain_gpt_with_the_spec_computes_hf_logits(capsys, tmp_path, release, fmt, optimizer):
    """With ``--spec`` the model Megatron-LM builds is the family's Megatron class: its logits equal
    mmparity's loader's bit for bit and HF's (run as the class computes) within the bound; then the
    train, save and bit-exact export."""
    base, trained, cfg = release
    assert cfg.tie_word_embeddings  # the last stage's own copy of the table is part of the loop
    assert len(set(zip(*_layer_sizes(cfg)))) > 1  # the full layers are wider: what no flag says
    train_and_export(capsys, tmp_path, family=FAMILY, label=f"{FAMILY} --spec", base=base, trained=trained,
                     vocab=cfg.text_config.vocab_size, flags=model_flags(cfg), grid=GRID, fmt=fmt,
                     optimizer=optimizer)


def _layer_sizes(cfg):
    from mmparity.models.parts.gemma4_text.config import layer_groups, layer_head_dim

    text = cfg.text_config
    layers = range(text.num_hidden_layers)
    return [layer_head_dim(text, i) for i in layers], [layer_groups(text, i) for i in layers]


def test_a_flag_that_disagrees_with_the_hf_config_is_named(capsys, tmp_path, release):
    """A flag the HF config beside the checkpoint contradicts (the window one key too wide) stops
    the build in one line naming the flag and the file, before any weight is loaded."""
    base, _trained, cfg = release
    src = convert_part(capsys, base, tmp_path / "part", "legacy", (1, 1, 1))
    flags = model_flags(cfg)
    at = flags.index("--window-size") + 1
    flags[at] = f"{cfg.text_config.sliding_window},0"
    argv = flags + lm.run_flags(tp=1, pp=1, ep=1, fmt="legacy", load=str(src), save=str(tmp_path / "unused"),
                                vocab=cfg.text_config.vocab_size) + ["--no-load-optim", "--no-load-rng"]
    with pytest.raises(Exception, match=r"--window-size gives window_size=.*hf_config.json"):
        run_ranks(dict(family=FAMILY, tp=1, pp=1, ep=1, argv=argv, load=str(src), reference=False,
                       vocab=cfg.text_config.vocab_size))


# What a --use-checkpoint-args run of Gemma 4 still passes: Megatron-LM's loader does not restore
# them (``lm.NOT_RESTORED``, and the windows).
NOT_RESTORED = lm.NOT_RESTORED + ("--window-size", "--window-attn-skip-freq")


def test_use_checkpoint_args_builds_the_class_from_the_recorded_spec(capsys, tmp_path, release):
    """No ``--spec`` and no sizes: ``load_args_from_checkpoint`` restores the ``spec`` that
    ``convert`` records, so the run builds the family's class, loads strictly and computes what
    mmparity's loader computes (torch_dist at TP 2 x PP 2)."""
    base, _trained, cfg = release
    run_with_checkpoint_args(capsys, tmp_path, family=FAMILY, base=base, cfg=cfg,
                             kept=lm.only(model_flags(cfg), NOT_RESTORED), grid=GRID, fmt="torch_dist",
                             absent=("--spec", "--kv-channels", "--num-layers"))
