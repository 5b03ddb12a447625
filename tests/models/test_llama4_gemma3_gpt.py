"""Llama 4's and Gemma 3's language models in Megatron's own ``GPTModel``, built from megatron-core's
modules per layer (docs/megatron.md).

* Llama 4: each layer is the stock ``TransformerLayer`` megatron-core's TE spec gives its number
  (dense or MoE by ``moe_layer_freq``), RoPE skipped by ``no_rope_freq``, the weightless L2 q/k norms
  on the RoPE layers only. No chunked attention and no attention temperature: its text rows are
  cut to where both are the identity, and longer rows would differ (shown here).
* Gemma 3: megatron-core's TE layer spec with the sandwich norms on the row-parallel linears,
  zero-centred norms, windows by ``window_size`` / ``window_attn_skip_freq``. No embedding scale
  and one RoPE: the reference is HF run that way, and HF's own run differs (shown here).

``check --impl megatron`` passes and locates a perturbed weight; the class's state dict is the
``--part language_model`` checkpoint's; ``verify --load`` loads strictly (TP 2 x PP 2, x EP 2 for
Llama 4, both formats, the part alone and the whole release, whose ``--base`` export is bit-exact:
``slow``); the module-level ``LAYER`` specs Megatron-LM's ``--spec`` imports build the same model
(Gemma 3's with its tanh GeGLU and attention scale read from the ``hf_config.json`` beside
``--load``, Megatron-LM's ``get_args`` stood in for; a flag the file contradicts is named).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmparity.io.legacy import open_legacy
from mmparity.models import registry as families
from mmparity.models.core import megatron_classes as models
from mmparity.models.core import te_stand_ins
from mmparity.models.registry import megatron_class
from mmparity.parallel import runtime
from mmparity.parity import harness
from mmparity.parity.metrics import FP32_REL_L2
from tests import megatron_lm_spec as spec_stand_in
from tests.faults.test_faults import run_cli
from tests.mapping.test_convert_roundtrips import save_hf

FAMILIES = ["llama4", "gemma3"]


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gpt_parts")
    return {name: save_hf(name, root / name, seed=41 + i) for i, name in enumerate(FAMILIES)}


def _build(family: str, cfg=None):
    cfg = cfg if cfg is not None else families.get(family).tiny_config()
    with runtime.parallel_context(1, 1):
        return models.build(megatron_class(family)[1].build, cfg)


def _megatron(report) -> dict:
    return {r.check: r for r in report.results if r.impl == "megatron"}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_record_is_stock_gptmodel_on_the_language_model(family):
    name, record = megatron_class(family)
    assert name == "GPTModel" and list(families.get(family).hooks.megatron) == ["GPTModel"]
    assert record.holds == ("language_model.",) and record.root == "language_model." and record.pipelined


def test_llama4_layers_are_megatron_cores_own_per_layer():
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.torch_norm import L2Norm
    from megatron.core.transformer.transformer_layer import TransformerLayer

    text = families.get("llama4").tiny_config().text_config
    model = _build("llama4")
    assert type(model).__name__ == "GPTModel"
    assert model.config.no_rope_freq == [1 - int(r) for r in text.no_rope_layers] and model.config.qk_l2_norm
    for i, layer in enumerate(model.decoder.layers):
        attention = layer.self_attention
        assert type(layer) is TransformerLayer and type(attention).__name__ == "SelfAttention"
        norm = L2Norm if text.no_rope_layers[i] else IdentityOp
        assert type(attention.q_layernorm) is norm and type(attention.k_layernorm) is norm, i
        assert hasattr(layer.mlp, "router") == (i in text.moe_layers), i
    experts = next(layer.mlp for layer in model.decoder.layers if hasattr(layer.mlp, "router")).experts
    assert type(experts).__name__ == "TEGroupedMLP"


def test_gemma3_layers_carry_the_sandwich_norms_and_the_windows():
    text = families.get("gemma3").tiny_config().text_config
    model = _build("gemma3")
    assert type(model).__name__ == "GPTModel" and model.config.layernorm_zero_centered_gamma
    assert model.config.window_size == (text.sliding_window - 1, 0)
    for i, layer in enumerate(model.decoder.layers):
        assert hasattr(layer.self_attention.linear_proj, "post_layernorm")
        assert hasattr(layer.mlp.linear_fc2, "post_layernorm")
        window = layer.self_attention.core_attention.window
        assert (window is not None) == (text.layer_types[i] == "sliding_attention"), i


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_is_the_part_checkpoints_keys(capsys, family, releases, tmp_path):
    part = tmp_path / "lm"
    assert run_cli(capsys, "convert", "--src", releases[family], "--dst", part, "--to", "mcore", "--format",
                   "legacy", "--part", "language_model", "--quiet")[0] == 0
    stored = open_legacy(part).load_rank(0)
    own = _build(family).state_dict()
    # A tied head's output layer holds no weight, only TE's empty extra-state slot, which the
    # converter does not write (verify --load fills it).
    unwritten = {"output_layer._extra_state"} if families.get(family).tiny_config().tie_word_embeddings else set()
    assert sorted(stored) == sorted(set(own) - unwritten)
    assert [k for k, v in own.items() if torch.is_tensor(v) and v.shape != stored[k].shape] == []


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", FAMILIES)
def test_check_megatron_passes(family, tp):
    report = harness.check(family, impl="megatron", tp=tp, seed=5)
    results = _megatron(report)
    assert set(results) == {"text:logits", "text:token_loss"}
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in results.values()]
    assert all(r.metrics["rel_l2"] <= FP32_REL_L2 for r in results.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_a_perturbed_decoder_weight_is_located_in_its_layer(family):
    layer = families.get(family).tiny_config().text_config.num_hidden_layers - 1

    def perturb(shard):
        keys = [k for k in shard if f"decoder.layers.{layer}." in k and "linear_fc2.weight" in k]
        assert keys
        for key in keys:
            shard[key] = shard[key].flip(0)

    logits = _megatron(harness.check(family, impl="megatron", mutate_native=perturb))["text:logits"]
    assert not logits.passed
    assert logits.first_divergence.module.startswith(f"language_model.decoder.layers.{layer}"), \
        logits.first_divergence


def test_llama4_rows_stop_where_chunks_and_temperature_would_start():
    """The tiny config's floor_scale 4 bounds the rows to 3 tokens, said in the case; rows of the
    default length differ from HF (the chunked mask and the temperature act there), which is
    why the class is compared on short rows only."""
    from mmparity.models.llama4 import megatron as llama4_megatron
    from mmparity.models.llava import megatron as llava

    cfg = families.get("llama4").tiny_config()
    hooks = families.get("llama4").hooks
    (case,) = llama4_megatron.LANGUAGE_MODEL.cases(hooks, cfg, 0, None)
    assert case.data["input_ids"].shape[1] == 3
    assert "floor_scale 4" in case.description and "attention_chunk_size 8" in case.description
    long_rows = dataclasses.replace(llama4_megatron.LANGUAGE_MODEL, cases=llava.text_cases)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(hooks.megatron, "GPTModel", long_rows)
        report = harness.check("llama4", impl="megatron", seed=5)
    assert not _megatron(report)["text:logits"].passed


def test_gemma3_reference_is_hf_run_as_the_class_computes():
    """HF's own run (scaled embedding, a RoPE base per layer type) is another function."""
    from mmparity.models.gemma3 import megatron as gemma3_megatron
    from mmparity.models.llava import megatron as llava

    hooks = families.get("gemma3").hooks
    plain = dataclasses.replace(gemma3_megatron.LANGUAGE_MODEL, reference_run=llava.LANGUAGE_MODEL.reference_run)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(hooks.megatron, "GPTModel", plain)
        report = harness.check("gemma3", impl="megatron", seed=5)
    assert not _megatron(report)["text:logits"].passed


def test_te_stand_in_window_is_tes_left_window_on_the_layers_the_config_lists():
    """TE's (left, right) window: a query at i sees keys i - left .. i (causal), on the layers
    ``window_attn_skip_freq`` lists 1, as megatron-core's TE wrapper hands it over. (megatron-core's
    own local attention builds its window mask on the CUDA device: it cannot run on the host.)"""
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, kv_channels=8,
                               window_size=(2, 0), window_attn_skip_freq=[1, 0], use_cpu_initialization=True,
                               attention_dropout=0.0, hidden_dropout=0.0)
    q, k, v = (torch.randn(7, 1, 2, 8, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))
    at = torch.arange(7)
    windowed = (at[None, :] <= at[:, None]) & (at[None, :] >= at[:, None] - 2)
    causal = at[None, :] <= at[:, None]
    for number, allowed in ((1, windowed), (2, causal)):
        ours = te_stand_ins.TEDotProductAttention(config, number, AttnMaskType.causal, "self")
        expected = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), attn_mask=allowed)
        torch.testing.assert_close(ours(q, k, v, None), expected.permute(2, 0, 1, 3).reshape(7, 1, 16))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", FAMILIES)
def test_verify_load_of_the_language_model_part_at_tp2_pp2(capsys, releases, tmp_path, family, fmt):
    grid = ["--tp", "2", "--pp", "2"] + (["--ep", "2"] if family == "llama4" else [])
    part = tmp_path / "lm"
    assert run_cli(capsys, "convert", "--src", releases[family], "--dst", part, "--to", "mcore", "--format",
                   fmt, *grid, "--part", "language_model", "--quiet")[0] == 0
    at = ["--tp", "2", "--pp", "2"] if fmt == "torch_dist" else []
    code, out, err = run_cli(capsys, "verify", "--load", part, *at)
    assert code == 0, out + err
    assert "strict load into Megatron's GPTModel" in out and "all ranks load" in out
    ranks = 8 if family == "llama4" and fmt == "legacy" else 4
    assert out.count(": ok: loads") == ranks, out


@pytest.mark.parametrize("family", FAMILIES)
def test_the_spec_megatron_lm_imports_is_the_layer_spec_the_class_is_built_on(family):
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    module = megatron_class(family)[1].build.__module__
    spec = import_module((module, "LAYER"))
    assert isinstance(spec, ModuleSpec)
    # Gemma 3's LAYER builds its layer spec on the config completed from the file beside --load
    # (the tests below); Llama 4's is the spec itself.
    built_on = import_module((module, "LAYER_SPEC")) if family == "gemma3" else spec
    model = _build(family)
    assert model.decoder.submodules.layer_specs[0] is built_on


def _gemma3_through_spec(mp, load, flags_config=None):
    from mmparity.models.gemma3 import megatron as gemma3_megatron

    return spec_stand_in.check_through_spec(mp, "gemma3", gemma3_megatron, load, flags_config)


@pytest.mark.parametrize("whole", [True, False], ids=["release_config", "text_config"])
def test_gemma3_spec_layer_takes_the_geglu_and_scale_from_the_hf_config_beside_load(tmp_path, whole):
    """From the flags' config (SiLU, the default scale) and the file (a whole release's config, or
    its text config alone), each layer is the class's: the check passes as the class's own does."""
    cfg = families.get("gemma3").tiny_config()
    spec_stand_in.config_beside(tmp_path, cfg if whole else cfg.text_config)
    with pytest.MonkeyPatch.context() as mp:
        report = _gemma3_through_spec(mp, tmp_path)
    assert report.passed, [(r.check, r.metrics) for r in _megatron(report).values()]
    assert all(r.metrics["rel_l2"] <= FP32_REL_L2 for r in _megatron(report).values())


def test_gemma3_flags_alone_compute_another_function():
    """What Megatron-LM's flags give (``--swiglu``'s SiLU, the default attention scale) on the same
    layer spec and weights is not Gemma 3: why ``LAYER`` reads the file."""
    import torch.nn.functional as F

    from mmparity.models.gemma3 import megatron as gemma3_megatron

    def flags_only(cfg, params_dtype=torch.float32, **options):
        config = dataclasses.replace(gemma3_megatron.megatron_config(cfg.text_config, params_dtype),
                                     activation_func=F.silu, softmax_scale=None)
        return gemma3_megatron.build_language_model(cfg, params_dtype, config=config, **options)

    record = dataclasses.replace(gemma3_megatron.LANGUAGE_MODEL, build=flags_only)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(families.get("gemma3").hooks.megatron, "GPTModel", record)
        assert not _megatron(harness.check("gemma3", impl="megatron", seed=5))["text:logits"].passed


def test_gemma3_spec_layer_refuses_without_the_hf_config_beside_load(tmp_path):
    from mmparity.io.fsio.errors import CheckpointError

    with pytest.MonkeyPatch.context() as mp, pytest.raises(CheckpointError) as caught:
        _gemma3_through_spec(mp, tmp_path)
    line = str(caught.value)
    assert "\n" not in line and "hf_config.json: not found" in line and "tanh GeGLU" in line and "--load" in line


@pytest.mark.parametrize("flag, field, value", [("--window-size", "window_size", (5, 0)),
                                                ("--apply-layernorm-1p", "layernorm_zero_centered_gamma", False),
                                                ("--kv-channels", "kv_channels", 4)])
def test_gemma3_a_flag_the_hf_config_contradicts_is_named(tmp_path, flag, field, value):
    """The window one key too wide, plain norms, another head width: each refused in one line
    naming the flag and the file."""
    spec_stand_in.config_beside(tmp_path, families.get("gemma3").tiny_config())
    with pytest.MonkeyPatch.context() as mp, pytest.raises(ValueError) as caught:
        _gemma3_through_spec(mp, tmp_path, lambda c: dataclasses.replace(c, **{field: value}))
    line = str(caught.value)
    assert "\n" not in line and line.startswith(str(tmp_path / "hf_config.json")) and f"{flag} gives {field}=" in line


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", FAMILIES)
def test_whole_convert_verify_load_and_back_with_base_is_bit_exact(capsys, releases, tmp_path, family, fmt):
    """The whole release at TP 2 x PP 2 (x EP 2 for Llama 4's experts): its language model loads
    strictly into the GPTModel, the rest is counted, and the export with ``--base`` is the release."""
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    grid = ["--tp", "2", "--pp", "2"] + (["--ep", "2"] if family == "llama4" else [])
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert run_cli(capsys, "convert", "--src", releases[family], "--dst", mcore, "--to", "mcore", "--format", fmt,
                   *grid, "--quiet")[0] == 0
    assert run_cli(capsys, "verify", mcore, "--quiet")[0] == 0
    code, out, err = run_cli(capsys, "verify", "--load", mcore)
    assert code == 0 and "language_model.* -> GPTModel" in out and "not loaded: the rest" in out, out + err
    assert run_cli(capsys, "convert", "--src", mcore, "--dst", back, "--to", "hf", "--base", releases[family],
                   "--quiet")[0] == 0
    expected, got = load_safetensors_state_dict(releases[family]), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())


def test_llama4_llama3_rope_takes_the_configs_factors():
    """Llama 3 scaling with factors megatron-core's GPTModel would not pass (its high-frequency
    factor is fixed at 4): the class rescales with the config's and passes; with the scaling left
    out it fails."""
    from mmparity.models.llama4 import reference
    from mmparity.models.parts.llama4_text import megatron as text_megatron

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 2.0, "original_max_position_embeddings": 2}
    # A RoPE layer sees the rows' positions only below floor_scale: a larger one keeps them longer.
    cfg = reference.tiny_config(rope_parameters=rope, floor_scale=16, attention_chunk_size=16)
    report = harness.check("llama4", cfg=cfg, impl="megatron", seed=1)
    assert report.passed, [(r.check, r.metrics) for r in _megatron(report).values()]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(text_megatron, "LLAMA3_FIELDS", ())
        assert not harness.check("llama4", cfg=cfg, impl="megatron", seed=1).passed
