"""Gemma 3's language model through Megatron-LM main's ``pretrain_gpt.py`` path and back.

Megatron-LM cannot build a whole Gemma 3 (no class has its projector or its images' bidirectional
blocks); its language model is stock ``GPTModel`` built with ``--spec mmparity.models.gemma3.megatron
LAYER`` (megatron-core's TE layer spec with the sandwich norms on the row-parallel linears, the
family's Megatron class, docs/megatron.md) and the Gemma flags: q/k norms, zero-centred norms,
sliding windows on the layers ``layer_types`` says, a tied head; TP 2 x PP 2 (the last stage keeps
its own copy of the tied table, which the legacy conversion writes).

Megatron-LM's command line has no flag for Gemma's tanh GeGLU or its attention scale
(``softmax_scale``; both are left out of the flags it derives from the config): the ``LAYER`` the
spec imports takes both from the ``hf_config.json`` that ``mmparity convert`` keeps beside the
checkpoint ``--load`` names, and checks the flags it has against that file.

The loop is checked on the logits: HF release -> ``mmparity convert --part language_model`` ->
Megatron-LM's own ``parse_args`` / ``validate_args`` / ``get_model(model_provider(gpt_builder))``
-> ``load_checkpoint(strict=True)``, logits equal to mmparity's own loader's bit for bit and within
the bound of HF's run as the class computes by design (no ``sqrt(hidden)`` embedding scale, one
RoPE) -> the weights changed as training changes them -> megatron-core's optimizer (plain or
distributed, stepped) -> ``save_checkpoint`` -> that checkpoint saved in the other format ->
``mmparity convert --to hf --base RELEASE`` of both -> the whole release again, bit for bit: the
language model the trained weights, the tower and projector the base's.

Megatron-LM's training code is in no release (its ``main`` only, Python >= 3.12): these tests run
where its ``megatron/`` is on ``PYTHONPATH`` and ``MEGATRON_LM`` names the checkout, and skip
otherwise, as in CI. The CPU stand-ins are the harness's (``tests/megatron_lm_gpt.py``).
"""

from __future__ import annotations

import pytest

from mmparity.models import registry as families
from tests import megatron_lm_gpt as lm
from tests.io.test_megatron_written import make_pair
from tests.megatron.test_megatron_lm_gpt import HF_REL_L2, convert_part, report, run_ranks, train_and_export

SKIP = lm.skip_reason()
pytestmark = [pytest.mark.skipif(SKIP is not None, reason=SKIP or ""), pytest.mark.slow]

FAMILY = "gemma3"
# (TP, PP, EP): heads and query groups over two ranks, the layers over two stages.
GRID = (2, 2, 1)


def model_flags(cfg) -> list[str]:
    """The flags a Megatron-LM user trains Gemma 3's language model with, read off its HF text
    config: the full layers' RoPE (base, linear factor), a window of ``sliding_window - 1`` keys back
    on the sliding layers."""
    from mmparity.models.gemma3.config import FULL, layer_rope

    text = cfg.text_config
    base, factor = layer_rope(text, FULL)
    sliding = "[" + ",".join(str(int(kind == "sliding_attention")) for kind in text.layer_types) + "]"
    flags = ["--spec", "mmparity.models.gemma3.megatron", "LAYER",
             "--num-layers", str(text.num_hidden_layers), "--hidden-size", str(text.hidden_size),
             "--ffn-hidden-size", str(text.intermediate_size), "--num-attention-heads", str(text.num_attention_heads),
             "--group-query-attention", "--num-query-groups", str(text.num_key_value_heads),
             "--kv-channels", str(text.head_dim), "--max-position-embeddings", str(text.max_position_embeddings),
             "--position-embedding-type", "rope", "--rotary-base", lm._number(base),
             "--normalization", "RMSNorm", "--norm-epsilon", repr(float(text.rms_norm_eps)), "--apply-layernorm-1p",
             "--qk-layernorm", "--swiglu", "--disable-bias-linear",
             "--window-size", f"{text.sliding_window - 1},0", "--window-attn-skip-freq", sliding,
             "--attention-dropout", "0", "--hidden-dropout", "0"]
    if factor != 1.0:
        flags += ["--rotary-seq-len-interpolation-factor", str(int(factor))]
    return flags


# The tiny config's full layers without their linear RoPE factor: Megatron-LM's ``gpt_builder``
# (``model_provider``'s, the path this harness runs) hands ``GPTModel`` no
# ``seq_len_interpolation_factor``, so ``--rotary-seq-len-interpolation-factor`` is dropped there
# (shown below); its ``GPTModelConfig`` path passes it.
PLAIN_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
              "full_attention": {"rope_type": "default", "rope_theta": 3000.0}}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(base release, its trained copy, config)."""
    from mmparity.models.gemma3 import reference

    cfg = reference.tiny_config(rope_parameters=PLAIN_ROPE)
    return (*make_pair(FAMILY, tmp_path_factory.mktemp(FAMILY), cfg), cfg)


@pytest.mark.parametrize("fmt, optimizer", [("legacy", "plain"), ("torch_dist", "distributed")])
def test_pretrain_gpt_with_the_spec_computes_hf_logits(capsys, tmp_path, release, fmt, optimizer):
    """With ``--spec`` the model Megatron-LM builds is the family's Megatron class: its logits equal
    mmparity's loader's bit for bit and HF's (run as the class computes) within the bound; then the
    train, save and bit-exact export."""
    base, trained, cfg = release
    assert cfg.tie_word_embeddings  # the last stage's own copy of the table is part of the loop
    layers, stages = cfg.text_config.num_hidden_layers, GRID[1]
    # The converter splits an uneven stack with the longer stages first; Megatron-LM is told so.
    uneven = ["--decoder-first-pipeline-num-layers", str(-(-layers // stages))] if layers % stages else []
    train_and_export(capsys, tmp_path, family=FAMILY, label=f"{FAMILY} --spec", base=base, trained=trained,
                     vocab=cfg.text_config.vocab_size, flags=model_flags(cfg) + uneven, grid=GRID, fmt=fmt,
                     optimizer=optimizer)


def test_gpt_builder_drops_the_rope_interpolation_factor(capsys, tmp_path):
    """Upstream: ``gpt_builder`` builds ``GPTModel`` without ``seq_len_interpolation_factor``, so
    with ``--rotary-seq-len-interpolation-factor 2`` (the tiny config's full layers, linear factor
    2, as released Gemma 3 4B and up have 8) the model loads strictly and computes another RoPE:
    its logits leave mmparity's loader's."""
    cfg = families.get(FAMILY).tiny_config()
    assert "--rotary-seq-len-interpolation-factor" in model_flags(cfg)
    base, _ = make_pair(FAMILY, tmp_path / "release", cfg)
    src = convert_part(capsys, base, tmp_path / "part", "legacy", (1, 1, 1))
    argv = model_flags(cfg) + lm.run_flags(tp=1, pp=1, ep=1, fmt="legacy", load=str(src), save=str(tmp_path / "unused"),
                                           vocab=cfg.text_config.vocab_size) + ["--no-load-optim", "--no-load-rng"]
    (result,) = run_ranks(dict(family=FAMILY, tp=1, pp=1, ep=1, argv=argv, load=str(src), hf=str(base),
                               vocab=cfg.text_config.vocab_size))
    assert "load_error" not in result and not result["unequal"] and not result["strict_failed"], result
    assert not result["equal"] and result["rel_l2"] > HF_REL_L2, result
    report(capsys, f"gemma3 gpt_builder, RoPE factor 2 dropped: logits rel_l2 vs mmparity's loader {result['rel_l2']:.2g}")
