"""GLM-4.5V's and GLM-4.6V's language model through Megatron-LM main's ``pretrain_gpt.py`` path and back.

Megatron-LM cannot build a whole GLM-4.5V or GLM-4.6V (no class has their tower), so their users
train the GLM-4.5 MoE decoder alone, as ``pretrain_gpt.py`` builds it from flags: stock ``GPTModel`` with
q/k/v biases, rotary embeddings over part of each head (``--rotary-percent``), a dense first layer,
then MoE layers with a sigmoid group-limited router whose expert bias is the release's
``e_score_correction_bias``, a routed scale, shared experts and grouped-GEMM experts; TP 2 x EP 2.

HF release -> ``mmparity convert --part language_model`` (``GPTModel``'s layout) -> Megatron-LM's
own ``parse_args`` / ``validate_args`` / ``get_model(model_provider(gpt_builder))`` ->
``load_checkpoint(strict=True)``, logits equal to mmparity's own loader's and within the fp32 bound
of HF's -> the weights changed as training changes them -> megatron-core's optimizer (plain or
distributed, stepped) -> ``save_checkpoint`` -> that checkpoint loaded back and saved in the other
format, as ``--ckpt-convert-format`` does -> ``mmparity convert --to hf --base RELEASE`` of both ->
the whole release again, bit for bit (the experts as each class's ``save_pretrained`` wrote them:
one tensor per expert for GLM-4.5V, stacked for GLM-4.6V): the
language model the trained weights, the tower and merger the base's.

RoPE: GLM-4.5V rotates the first half of each head's dims with M-RoPE (t/h/w sections). On text
HF gives the three axes the token's index, so the rotation is plain RoPE over those dims, which is
``--rotary-percent 0.5``; on images the axes differ (the state dict holds no positions: the loop is
right for the weights whatever positions a run feeds).

Megatron-LM's training code is in no release (its ``main`` only, Python >= 3.12): these tests
run where its ``megatron/`` is on ``PYTHONPATH`` and ``MEGATRON_LM`` names the checkout, and skip
otherwise, as in CI. The CPU stand-ins are the harness's (``tests/megatron_lm_gpt.py``).
"""

from __future__ import annotations

import pytest

from mmparity.models import registry as families
from tests import megatron_lm_gpt as lm
from tests.io.test_megatron_written import make_pair
from tests.megatron.test_megatron_lm_gpt import convert_part, train_and_export

SKIP = lm.skip_reason()
pytestmark = [pytest.mark.skipif(SKIP is not None, reason=SKIP or ""), pytest.mark.slow]

FAMILIES = ("glm4v_moe", "glm46v")
# (TP, PP, EP): the attention split over two ranks, the experts over two (more ranks do not finish
# on a two-core machine).
GRID = (2, 1, 2)


def model_flags(cfg) -> list[str]:
    """The flags a Megatron-LM user trains GLM-4.5V's language model with, read off its HF text
    config: the dense decoder's (``lm.model_flags``, GQA) with q/k/v biases and partial rotary, and
    the GLM-4.5 MoE (DeepSeek-V3's router, over GQA attention)."""
    text = cfg.text_config
    rope = dict(text.rope_parameters)
    flags = lm.model_flags(cfg) + ["--add-qkv-bias", "--rotary-percent",
                                   repr(float(rope.get("partial_rotary_factor", 0.5)))]
    dense = int(text.first_k_dense_replace)
    flags += ["--num-experts", str(text.n_routed_experts),
              "--moe-layer-freq", f"[0]*{dense}+[1]*{text.num_hidden_layers - dense}",
              "--moe-ffn-hidden-size", str(text.moe_intermediate_size),
              "--moe-shared-expert-intermediate-size", str(text.moe_intermediate_size * text.n_shared_experts),
              "--moe-router-topk", str(text.num_experts_per_tok), "--moe-router-score-function", "sigmoid",
              "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor",
              repr(float(text.routed_scaling_factor)),
              "--moe-router-dtype", "fp32", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "allgather",
              "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0"]
    if int(text.n_group) > 1:
        flags += ["--moe-router-num-groups", str(text.n_group), "--moe-router-group-topk", str(text.topk_group)]
    return flags


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict:
    """family -> (base release, its trained copy, config)."""
    made = {}
    for family in FAMILIES:
        cfg = families.get(family).tiny_config()
        made[family] = (*make_pair(family, tmp_path_factory.mktemp(family), cfg), cfg)
    return made


@pytest.mark.parametrize("family", FAMILIES)
def test_the_flags_are_the_recorded_args(capsys, tmp_path, releases, family):
    """What ``convert`` records says what the flags say: the two cannot drift apart unseen."""
    from mmparity.io.megatron_args import read_legacy_args

    base, _trained, cfg = releases[family]
    part = convert_part(capsys, base, tmp_path / "part", "legacy", (1, 1, 1))
    args = read_legacy_args(next(part.rglob("model_optim_rng.pt")))
    flags = model_flags(cfg)

    def value(name):
        return flags[flags.index(name) + 1]

    assert args.add_qkv_bias and args.num_experts == int(value("--num-experts"))
    assert args.rotary_percent == float(value("--rotary-percent"))
    assert args.moe_layer_freq == [0] * cfg.text_config.first_k_dense_replace + [1] * (
        cfg.text_config.num_hidden_layers - cfg.text_config.first_k_dense_replace)
    assert args.moe_router_score_function == "sigmoid" and args.moe_router_enable_expert_bias
    assert args.moe_shared_expert_intermediate_size == int(value("--moe-shared-expert-intermediate-size"))
    assert args.moe_router_topk_scaling_factor == float(value("--moe-router-topk-scaling-factor"))
    assert args.kv_channels == int(value("--kv-channels"))


@pytest.mark.parametrize("fmt, optimizer", [("legacy", "plain"), ("torch_dist", "distributed")])
@pytest.mark.parametrize("family", FAMILIES)
def test_pretrain_gpt_loads_trains_saves_and_exports(capsys, tmp_path, releases, family, fmt, optimizer):
    base, trained, cfg = releases[family]
    train_and_export(capsys, tmp_path, family=family, label=family, base=base, trained=trained,
                     vocab=cfg.text_config.vocab_size, flags=model_flags(cfg), grid=GRID, fmt=fmt, optimizer=optimizer)
