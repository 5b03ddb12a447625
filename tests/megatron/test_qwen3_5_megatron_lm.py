"""The Qwen3.5 / Qwen3.5-MoE language model through Megatron-LM main's ``pretrain_gpt.py`` path and back.

A Megatron-LM user trains this model as ``pretrain_gpt.py`` builds it from flags: ``GPTModel`` with
megatron-core's hybrid block spec (``--experimental-attention-variant gated_delta_net``, the
DeltaNet / attention pattern as ``--linear-attention-freq``). Here, for the dense and the MoE
text model:

HF release -> ``mmparity convert --to mcore`` (the family is the language model alone, laid out
as ``GPTModel``) -> Megatron-LM's own ``parse_args`` / ``validate_args`` /
``get_model(model_provider(gpt_builder))`` -> ``load_checkpoint(strict=True)``, every tensor equal
to the rank file of the same conversion -> the weights changed as training changes them (those of a
perturbed copy of the release) -> an optimizer (megatron-core's, plain or distributed, stepped) ->
``save_checkpoint`` -> that checkpoint loaded back and saved in the other format, as
``--ckpt-convert-format`` does -> ``mmparity convert --to hf --base RELEASE`` of both -> the
trained release, bit for bit.

No logits are compared, and no forward runs: megatron-core's ``GatedDeltaNet`` (Megatron-LM main)
calls flash-linear-attention's kernels for its convolution, the q/k L2 norm and the delta rule,
and those are triton kernels, which cannot run on a CPU (``RuntimeError: 0 active drivers``,
``test_gated_delta_net_forward_needs_fla_on_a_gpu``). So the weights change without a forward, as
the other families' trained copy does (gradients set, an optimizer step). For the same reason one
CPU-only setting of the run, which leaves the state dict as it is: ``--no-initialization``
(``GatedDeltaNet`` initialises under the CUDA RNG tracker; the load overwrites every weight, and
the harness zeroes them first).

Megatron-LM's training code is in no release (its ``main`` only, Python >= 3.12); these tests run
where its ``megatron/`` is on ``PYTHONPATH``, ``MEGATRON_LM`` names the checkout and fla is
installed (``pip install flash-linear-attention``: Megatron-LM main's ``GatedDeltaNet`` refuses to
be built without it), and skip saying which is missing otherwise, as in CI.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests import megatron_lm_gpt as lm
from tests.io.test_megatron_written import make_pair
from tests.megatron.test_megatron_lm_gpt import train_and_export


def _skip_reason() -> str | None:
    reason = lm.skip_reason()
    if reason is None and importlib.util.find_spec("fla") is None:
        reason = ("needs fla (pip install flash-linear-attention): Megatron-LM main's GatedDeltaNet refuses to be "
                  "built without it")
    return reason


SKIP = _skip_reason()
pytestmark = [pytest.mark.skipif(SKIP is not None, reason=SKIP or ""), pytest.mark.slow]

# (TP, PP, EP): the dense model's hybrid pattern split over two stages (attention + DeltaNet on
# each), the MoE model's experts over two ranks.
GRIDS = {"dense": (2, 2, 1), "moe": (2, 1, 2)}


def tiny(variant: str):
    from mmparity.models.qwen3_5_lm.reference import tiny_config

    return tiny_config(moe=variant == "moe")


def model_flags(text) -> list[str]:
    """The flags a Megatron-LM user trains the Qwen3.5 (MoE) text model ``text`` with, read off its
    HF config: gated attention with q/k norms and partial RoPE, Gated DeltaNet layers where
    ``layer_types`` says ``linear_attention``, every norm zero-centred (HF's scale by ``1 + w``)."""
    moe = bool(getattr(text, "num_experts", 0))
    rope = dict(text.rope_parameters)
    pattern = "[" + ",".join(str(int(kind == "linear_attention")) for kind in text.layer_types) + "]"
    flags = ["--num-layers", str(text.num_hidden_layers), "--hidden-size", str(text.hidden_size),
             "--ffn-hidden-size", str(text.moe_intermediate_size if moe else text.intermediate_size),
             "--num-attention-heads", str(text.num_attention_heads), "--group-query-attention",
             "--num-query-groups", str(text.num_key_value_heads), "--kv-channels", str(text.head_dim),
             "--max-position-embeddings", str(text.max_position_embeddings), "--position-embedding-type", "rope",
             "--rotary-base", lm._number(rope["rope_theta"]),
             "--rotary-percent", repr(float(rope.get("partial_rotary_factor", 1.0))),
             "--normalization", "RMSNorm", "--norm-epsilon", repr(float(text.rms_norm_eps)), "--apply-layernorm-1p",
             "--swiglu", "--disable-bias-linear", "--qk-layernorm", "--attention-output-gate",
             "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", pattern,
             "--linear-conv-kernel-dim", str(text.linear_conv_kernel_dim),
             "--linear-key-head-dim", str(text.linear_key_head_dim),
             "--linear-value-head-dim", str(text.linear_value_head_dim),
             "--linear-num-key-heads", str(text.linear_num_key_heads),
             "--linear-num-value-heads", str(text.linear_num_value_heads),
             "--attention-dropout", "0", "--hidden-dropout", "0"]
    if not text.tie_word_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    if moe:
        flags += ["--num-experts", str(text.num_experts), "--moe-layer-freq", f"[1]*{text.num_hidden_layers}",
                  "--moe-ffn-hidden-size", str(text.moe_intermediate_size),
                  "--moe-shared-expert-intermediate-size", str(text.shared_expert_intermediate_size),
                  "--moe-shared-expert-gate", "--moe-router-topk", str(text.num_experts_per_tok),
                  "--moe-router-score-function", "softmax", "--moe-router-dtype", "fp32", "--moe-grouped-gemm",
                  "--moe-token-dispatcher-type", "allgather", "--moe-router-load-balancing-type", "none",
                  "--moe-aux-loss-coeff", "0"]
    return flags


# What the CPU needs beside the model's flags (module docstring).
CPU_ONLY = ["--no-initialization"]


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict:
    """variant -> (base release, its trained copy, config)."""
    made = {}
    for variant in GRIDS:
        cfg = tiny(variant)
        made[variant] = (*make_pair("qwen3_5_lm", tmp_path_factory.mktemp(variant), cfg), cfg)
    return made


@pytest.mark.parametrize("fmt, optimizer", [("legacy", "plain"), ("torch_dist", "distributed")])
@pytest.mark.parametrize("variant", list(GRIDS))
def test_pretrain_gpt_loads_trains_saves_and_exports(capsys, tmp_path, releases, variant, fmt, optimizer):
    base, trained, cfg = releases[variant]
    train_and_export(capsys, tmp_path, family="qwen3_5_lm", label=f"qwen3_5_lm {variant}", base=base, trained=trained,
                     vocab=cfg.vocab_size, flags=model_flags(cfg) + CPU_ONLY, grid=GRIDS[variant], fmt=fmt,
                     optimizer=optimizer, logits=False, alone=True)
