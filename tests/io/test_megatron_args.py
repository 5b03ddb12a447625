"""The ``args`` mmparity writes describe the model under Megatron-LM's own argument names, so that
``--use-checkpoint-args`` rebuilds it (``tests/megatron/test_megatron_lm_gpt.py`` runs that with
Megatron-LM main): sizes, RoPE, norm, activation, biases, and for DeepSeek-V3 / Kimi-K2.5 its
multi-latent attention, YaRN, experts and router; what differs by config (Llama 4's NoPE layers and
q/k L2 norms, Gemma 3's windows) and the ``--spec`` a run must be given, as the family's Megatron
class is configured and read back through the allow-list."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from mmparity.models import registry as families
from mmparity.io.legacy import open_legacy
from mmparity.io.megatron_args import read_legacy_args
from mmparity.io.megatron_written import read_common
from tests.cli.test_convert_cli import run_cli
from tests.mapping.test_convert_roundtrips import save_hf


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("args")
    return {name: save_hf(name, root / name, seed=4) for name in ("kimi_k25_vl", "mistral3", "clip",
                                                                   "qwen3_5_whole", "llama4", "gemma3")}


def _args(capsys, src, dst, fmt: str, *extra):
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", dst, "--to", "mcore", "--format", fmt, *extra)
    assert code == 0, out + err
    if fmt == "legacy":
        ckpt = open_legacy(dst)
        return read_legacy_args(ckpt.files[min(ckpt.files)])
    return read_common(dst / "iter_0000001")["args"]


@pytest.mark.parametrize("part", [[], ["--part", "language_model"]])
def test_deepseek_v3_args_name_its_mla_yarn_and_experts(capsys, tmp_path, releases, part):
    text = families.get("kimi_k25_vl").tiny_config().text_config
    rope = text.rope_parameters
    args = _args(capsys, releases["kimi_k25_vl"], tmp_path / "kimi", "legacy", "--tp", "2", "--ep", "2", *part)
    assert (args.multi_latent_attention, args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim,
            args.qk_pos_emb_head_dim, args.v_head_dim, args.qk_layernorm) == (
        True, text.q_lora_rank, text.kv_lora_rank, text.qk_nope_head_dim, text.qk_rope_head_dim, text.v_head_dim, True)
    assert (args.rope_type, args.rotary_scaling_factor, args.mscale, args.mscale_all_dim, args.rotary_base) == (
        "yarn", rope["factor"], rope["mscale"], rope["mscale_all_dim"], int(rope["rope_theta"]))
    assert (args.yarn_original_max_position_embeddings, args.yarn_beta_fast, args.yarn_beta_slow) == (
        rope["original_max_position_embeddings"], rope["beta_fast"], rope["beta_slow"])
    # The experts' own width: without it Megatron builds them ffn_hidden_size wide.
    assert (args.num_experts, args.moe_ffn_hidden_size, args.moe_shared_expert_intermediate_size) == (
        text.n_routed_experts, text.moe_intermediate_size, text.moe_intermediate_size * text.n_shared_experts)
    assert args.ffn_hidden_size == text.intermediate_size != args.moe_ffn_hidden_size
    first = text.first_k_dense_replace
    assert args.moe_layer_freq == [0] * first + [1] * (text.num_hidden_layers - first)
    assert (args.moe_router_topk, args.moe_router_score_function, args.moe_router_enable_expert_bias,
            args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_topk_scaling_factor,
            args.moe_router_dtype, args.moe_grouped_gemm) == (
        text.num_experts_per_tok, "sigmoid", True, text.n_group, text.topk_group, text.routed_scaling_factor,
        "fp32", True)
    assert (args.normalization, args.layernorm_epsilon, args.swiglu, args.add_bias_linear, args.add_qkv_bias) == (
        "RMSNorm", text.rms_norm_eps, True, False, False)
    assert not hasattr(args, "kv_channels")  # MLA has no single head width
    assert (args.tensor_model_parallel_size, args.expert_model_parallel_size) == (2, 2)


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_a_hybrid_decoder_records_its_linear_attention_rotated_fraction_and_gates(capsys, tmp_path, releases, fmt):
    # --use-checkpoint-args forces rotary_percent on the run: a quarter-rotating model recorded as
    # rotating every channel would train another model without a word.
    text = families.get("qwen3_5_whole").tiny_config().text_config
    args = _args(capsys, releases["qwen3_5_whole"], tmp_path / "qwen", fmt, "--part", "language_model")
    assert args.rotary_percent == text.rope_parameters["partial_rotary_factor"] != 1.0
    assert (args.experimental_attention_variant, args.linear_attention_freq) == (
        "gated_delta_net", [int(kind == "linear_attention") for kind in text.layer_types])
    assert 1 in args.linear_attention_freq and 0 in args.linear_attention_freq
    assert (args.linear_conv_kernel_dim, args.linear_key_head_dim, args.linear_value_head_dim,
            args.linear_num_key_heads, args.linear_num_value_heads) == (
        text.linear_conv_kernel_dim, text.linear_key_head_dim, text.linear_value_head_dim,
        text.linear_num_key_heads, text.linear_num_value_heads)
    assert args.attention_output_gate is True and args.layernorm_zero_centered_gamma is True
    assert (args.moe_shared_expert_intermediate_size, args.moe_shared_expert_gate) == (
        text.shared_expert_intermediate_size, True)


def test_a_plain_decoder_records_no_gate_and_rotates_every_channel(capsys, tmp_path, releases):
    args = _args(capsys, releases["mistral3"], tmp_path / "mistral", "legacy", "--part", "language_model")
    assert args.rotary_percent == 1.0
    assert not {"attention_output_gate", "experimental_attention_variant", "layernorm_zero_centered_gamma"} & set(vars(args))


@pytest.mark.parametrize("fmt, rows", [("legacy", 256), ("torch_dist", 128)])
def test_dense_decoder_args_and_the_vocabulary_padded_for_the_recorded_tp(capsys, tmp_path, releases, fmt, rows):
    """Mistral3's decoder: GQA, its own head width, RoPE base, norm epsilon, untied. The padded
    vocabulary is the recorded TP's (what Megatron-LM builds with ``--use-checkpoint-args``),
    whatever rows the stored table has (torch_dist keeps TP 1's, which load into any TP)."""
    text = families.get("mistral3").tiny_config().text_config
    args = _args(capsys, releases["mistral3"], tmp_path / "m", fmt, "--tp", "2", "--part", "language_model")
    assert (args.group_query_attention, args.num_query_groups, args.kv_channels) == (
        True, text.num_key_value_heads, text.head_dim)
    assert (args.position_embedding_type, args.rotary_base, args.rotary_interleaved) == (
        "rope", int(text.rope_parameters["rope_theta"]), False)
    assert (args.normalization, args.layernorm_epsilon, args.swiglu, args.add_bias_linear, args.add_qkv_bias,
            args.untie_embeddings_and_output_weights, args.qk_layernorm) == (
        "RMSNorm", text.rms_norm_eps, True, False, False, True, False)
    assert args.padded_vocab_size == 256 and args.tensor_model_parallel_size == 2
    assert not hasattr(args, "num_experts") and not hasattr(args, "multi_latent_attention")
    if fmt == "torch_dist":
        from mmparity.io.torch_dist_files import TorchDistFiles

        files = TorchDistFiles(tmp_path / "m" / "iter_0000001")
        assert files.tensors["embedding.word_embeddings.weight"][1][0] == rows
    else:
        assert open_legacy(tmp_path / "m").load_rank(0)["embedding.word_embeddings.weight"].shape[0] * 2 == rows


def _spec_imports(spec):
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    return isinstance(import_module(tuple(spec)), ModuleSpec)


@pytest.mark.parametrize("fmt, part", [("legacy", []), ("torch_dist", []), ("legacy", ["--part", "language_model"])])
def test_llama4_records_its_nope_layers_l2_norms_and_spec(capsys, tmp_path, releases, fmt, part):
    from mmparity.models.parts.llama4_text.megatron import megatron_config

    text = families.get("llama4").tiny_config().text_config
    args = _args(capsys, releases["llama4"], tmp_path / "llama4", fmt, *part)
    # Megatron's list says 1 where a layer has no RoPE, transformers' 1 where it has.
    assert args.no_rope_freq == [1 - int(rope) for rope in text.no_rope_layers] == [0, 0, 0, 1]
    assert args.qk_l2_norm is True and text.use_qk_norm
    config = megatron_config(text)  # the family's Megatron class is built with the same
    assert (args.no_rope_freq, args.qk_l2_norm) == (list(config.no_rope_freq), config.qk_l2_norm)
    assert args.spec == ["mmparity.models.parts.llama4_text.megatron", "LAYER"] and _spec_imports(args.spec)


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_gemma3_records_its_windows_and_spec(capsys, tmp_path, releases, fmt):
    from mmparity.models.gemma3.megatron import megatron_config

    text = families.get("gemma3").tiny_config().text_config
    args = _args(capsys, releases["gemma3"], tmp_path / "gemma3", fmt)
    # Megatron-LM's --window-size W-1,0 parses to a tuple; 1 in the skip list is a sliding layer.
    assert args.window_size == (text.sliding_window - 1, 0)
    assert args.window_attn_skip_freq == [int(kind == "sliding_attention") for kind in text.layer_types] == [1, 0, 1]
    config = megatron_config(text)
    assert (args.window_size, args.window_attn_skip_freq) == (config.window_size, config.window_attn_skip_freq)
    assert args.spec == ["mmparity.models.gemma3.megatron", "LAYER"] and _spec_imports(args.spec)
    assert args.layernorm_zero_centered_gamma is True  # the family's fixed facts stay beside them


def test_a_model_without_them_records_none(capsys, tmp_path, releases):
    args = _args(capsys, releases["mistral3"], tmp_path / "mistral3", "legacy")
    assert not {"no_rope_freq", "qk_l2_norm", "window_size", "window_attn_skip_freq", "spec"} & set(vars(args))


def test_a_tower_records_sizes_only(capsys, tmp_path, releases):
    args = _args(capsys, releases["clip"], tmp_path / "clip", "legacy")
    assert not hasattr(args, "padded_vocab_size") and not hasattr(args, "position_embedding_type")
    assert not hasattr(args, "normalization") and args.num_layers > 0


def _megatron_lm_arguments():
    if sys.version_info < (3, 12) or importlib.util.find_spec("megatron") is None:
        return None
    try:
        if importlib.util.find_spec("megatron.training.arguments") is None:
            return None
        from megatron.training import arguments
    except Exception:  # noqa: BLE001 - not importable here
        return None
    return arguments


@pytest.mark.skipif(_megatron_lm_arguments() is None,
                    reason="needs Megatron-LM main's megatron.training on PYTHONPATH (Python >= 3.12)")
def test_every_name_is_a_megatron_lm_argument(capsys, tmp_path, releases):
    arguments = _megatron_lm_arguments()
    saved, sys.argv = sys.argv, ["pretrain_gpt.py"]
    try:
        known = set(vars(arguments.parse_args()))
    finally:
        sys.argv = saved
    for name in ("kimi_k25_vl", "mistral3", "qwen3_5_whole", "llama4", "gemma3"):
        args = _args(capsys, releases[name], tmp_path / name, "legacy", "--part", "language_model")
        assert sorted(set(vars(args)) - known) == [], name
