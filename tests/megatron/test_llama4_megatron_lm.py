"""Llama 4's language model through Megatron-LM main's ``pretrain_gpt.py`` path and back.

Megatron-LM cannot build a whole Llama 4 (no class has its tower). Built from flags alone, its
NoPE layers (``--no-rope-freq``) take the weightless q/k L2 norms (``--qk-l2-norm``) that Llama 4
puts on its RoPE layers only; with ``--spec mmparity.models.parts.llama4_text.megatron LAYER`` each
layer is megatron-core's own with the norms where Llama 4 has them, the family's Megatron class
(docs/megatron.md), whose logits are HF's on rows short of the chunks and the attention
temperature megatron-core has no module for. Either way the state dict is the one mmparity writes: GQA with interleaved RoPE, dense layers of
``intermediate_size_mlp`` and MoE layers (a sigmoid top-1 router scaling the expert input,
``--moe-apply-probs-on-input``, a shared expert, grouped-GEMM experts); TP 2 x EP 2.

The loop from flags alone is checked on the weights; with ``--spec``, on the logits too: HF release -> ``mmparity convert --part
language_model`` -> Megatron-LM's own ``parse_args`` / ``validate_args`` /
``get_model(model_provider(gpt_builder))`` -> ``load_checkpoint(strict=True)``, every tensor of the
rank equal to the rank's file of a legacy conversion -> the weights changed as training changes
them -> megatron-core's optimizer (plain or distributed, stepped) -> ``save_checkpoint`` -> that
checkpoint loaded back and saved in the other format, as ``--ckpt-convert-format`` does ->
``mmparity convert --to hf --base RELEASE`` of both -> the whole release again, bit for bit (the
expert stacks as transformers saves them, ``gate_up_proj`` ``[E, H, 2I]``): the language model the
trained weights, the tower and projector the base's.

Megatron-LM's training code is in no release (its ``main`` only, Python >= 3.12): these tests
run where its ``megatron/`` is on ``PYTHONPATH`` and ``MEGATRON_LM`` names the checkout, and skip
otherwise, as in CI. The CPU stand-ins are the harness's (``tests/megatron_lm_gpt.py``).
"""

from __future__ import annotations

import functools

import pytest

from mmparity.models import registry as families
from tests import megatron_lm_gpt as lm
from tests.io.test_megatron_written import make_pair
from tests.megatron.test_megatron_lm_gpt import flag_value, recorded_args, train_and_export

SKIP = lm.skip_reason()
pytestmark = [pytest.mark.skipif(SKIP is not None, reason=SKIP or ""), pytest.mark.slow]

FAMILY = "llama4"
# (TP, PP, EP): the attention split over two ranks, the experts over two.
GRID = (2, 1, 2)


def _list(values) -> str:
    return "[" + ",".join(str(int(v)) for v in values) + "]"


def model_flags(cfg) -> list[str]:
    """The flags a Megatron-LM user trains Llama 4's language model with, read off its HF text
    config."""
    text = cfg.text_config
    layers = text.num_hidden_layers
    moe = set(text.moe_layers)
    flags = ["--num-layers", str(layers), "--hidden-size", str(text.hidden_size),
             "--ffn-hidden-size", str(text.intermediate_size_mlp), "--num-attention-heads", str(text.num_attention_heads),
             "--group-query-attention", "--num-query-groups", str(text.num_key_value_heads),
             "--kv-channels", str(text.head_dim), "--max-position-embeddings", str(text.max_position_embeddings),
             "--position-embedding-type", "rope", "--rotary-interleaved",
             "--rotary-base", lm._number(dict(text.rope_parameters)["rope_theta"]),
             # Megatron's list says 1 for a layer without RoPE; HF's says 1 for a layer with it.
             "--no-rope-freq", _list(1 - int(r) for r in text.no_rope_layers),
             "--normalization", "RMSNorm", "--norm-epsilon", repr(float(text.rms_norm_eps)), "--swiglu",
             "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
             "--num-experts", str(text.num_local_experts), "--moe-layer-freq", _list(i in moe for i in range(layers)),
             "--moe-ffn-hidden-size", str(text.intermediate_size),
             "--moe-shared-expert-intermediate-size", str(text.intermediate_size),
             "--moe-router-topk", str(text.num_experts_per_tok), "--moe-router-score-function", "sigmoid",
             "--moe-apply-probs-on-input", "--moe-router-dtype", "fp32", "--moe-grouped-gemm",
             "--moe-token-dispatcher-type", "allgather", "--moe-router-load-balancing-type", "none",
             "--moe-aux-loss-coeff", "0"]
    if text.use_qk_norm:
        flags.append("--qk-l2-norm")
    if not getattr(cfg, "tie_word_embeddings", False):
        flags.append("--untie-embeddings-and-output-weights")
    return flags


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(base release, its trained copy, config)."""
    cfg = families.get(FAMILY).tiny_config()
    return (*make_pair(FAMILY, tmp_path_factory.mktemp(FAMILY), cfg), cfg)


def test_the_flags_are_the_recorded_args(capsys, tmp_path, release):
    """What ``convert`` records says what the flags say: the two cannot drift apart unseen."""
    base, _trained, cfg = release
    args = recorded_args(capsys, base, tmp_path)
    flags = model_flags(cfg)
    value = functools.partial(flag_value, flags)

    assert args.num_experts == int(value("--num-experts")) and args.ffn_hidden_size == int(value("--ffn-hidden-size"))
    assert args.moe_layer_freq == [int(c) for c in value("--moe-layer-freq").strip("[]").split(",")]
    assert args.moe_ffn_hidden_size == int(value("--moe-ffn-hidden-size"))
    assert args.moe_shared_expert_intermediate_size == int(value("--moe-shared-expert-intermediate-size"))
    assert args.moe_router_score_function == "sigmoid" and args.moe_apply_probs_on_input
    assert args.rotary_interleaved and "--rotary-interleaved" in flags
    assert args.kv_channels == int(value("--kv-channels"))


@pytest.mark.parametrize("fmt, optimizer", [("legacy", "plain"), ("torch_dist", "distributed")])
def test_pretrain_gpt_loads_trains_saves_and_exports(capsys, tmp_path, release, fmt, optimizer):
    base, trained, cfg = release
    train_and_export(capsys, tmp_path, family=FAMILY, label=FAMILY, base=base, trained=trained,
                     vocab=cfg.text_config.vocab_size, flags=model_flags(cfg), grid=GRID, fmt=fmt,
                     optimizer=optimizer, logits=False)


SPEC = ["--spec", "mmparity.models.parts.llama4_text.megatron", "LAYER"]


@pytest.mark.parametrize("fmt, optimizer", [("legacy", "plain"), ("torch_dist", "distributed")])
def test_pretrain_gpt_with_the_spec_computes_hf_logits(capsys, tmp_path, release, fmt, optimizer):
    """With ``--spec`` the model Megatron-LM builds is the family's Megatron class (the L2 norms on
    the RoPE layers only): its logits equal mmparity's loader's bit for bit and HF's within the
    bound, on rows within the chunk and below ``floor_scale`` (megatron-core has neither the chunks
    nor the temperature); then the same train, save and bit-exact export."""
    from mmparity.models.llava.megatron import TEXT_LENGTH
    from mmparity.models.parts.llama4_text.megatron import text_length

    base, trained, cfg = release
    length, why = text_length(cfg.text_config, TEXT_LENGTH)
    assert length < TEXT_LENGTH and "floor_scale" in why
    train_and_export(capsys, tmp_path, family=FAMILY, label=f"{FAMILY} --spec", base=base, trained=trained,
                     vocab=cfg.text_config.vocab_size, flags=model_flags(cfg) + SPEC, grid=GRID, fmt=fmt,
                     optimizer=optimizer, length=length)
