"""Gemma 4's language model in Megatron's own ``GPTModel`` (docs/megatron.md): Gemma 3's Megatron
layer (megatron-core's TE spec, sandwich norms on the row-parallel linears, windows by
``window_size`` / ``window_attn_skip_freq``) with plain norms, unscaled attention and the smallest
modules megatron-core lacks: a per-layer config and RoPE in the attention (the full layers wider,
their RoPE proportional), a weightless value norm, the layer scalar. No embedding scale and no
logit cap: the reference is HF run that way, and HF's own run differs (shown here).

Megatron-LM's ``--spec mmparity.models.gemma4.megatron LAYER`` builds the same class from the flags'
config and the ``hf_config.json`` beside ``--load`` (shown here with Megatron-LM's ``get_args``
stood in for; its own run: tests/megatron/test_gemma4_megatron_lm.py), and refuses in one line
without that file or with a flag it contradicts.

``check --impl megatron`` passes (``check --hf`` on a saved release too) and locates a perturbed
weight; the class's state dict is the ``--part language_model`` checkpoint's; ``verify --load``
loads strictly at TP 2 x PP 2 in both formats, the part alone and the whole release, whose
``--base`` export is bit-exact (``slow``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmparity.io.legacy import open_legacy
from mmparity.models import registry as families
from mmparity.models.core import megatron_classes as models
from mmparity.models.registry import megatron_class
from mmparity.parallel import runtime
from mmparity.parity import harness
from mmparity.parity.metrics import FP32_REL_L2
from tests import megatron_lm_spec as spec
from tests.faults.test_faults import run_cli
from tests.mapping.test_convert_roundtrips import save_hf

FAMILY = "gemma4"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return save_hf(FAMILY, tmp_path_factory.mktemp("gemma4_gpt") / "hf", seed=43)


def _build(cfg=None):
    cfg = cfg if cfg is not None else families.get(FAMILY).tiny_config()
    with runtime.parallel_context(1, 1):
        return models.build(megatron_class(FAMILY)[1].build, cfg)


def _megatron(report) -> dict:
    return {r.check: r for r in report.results if r.impl == "megatron"}


def test_the_record_is_stock_gptmodel_on_the_language_model():
    name, record = megatron_class(FAMILY)
    assert name == "GPTModel" and list(families.get(FAMILY).hooks.megatron) == ["GPTModel"]
    assert record.holds == ("language_model.",) and record.root == "language_model." and record.pipelined


def test_layers_are_gemma3s_megatron_layer_with_gemma4s_widths_windows_and_scalars():
    from mmparity.models.parts.gemma4_text.config import layer_groups, layer_head_dim

    text = families.get(FAMILY).tiny_config().text_config
    model = _build()
    assert type(model).__name__ == "GPTModel" and not model.config.layernorm_zero_centered_gamma
    assert model.config.softmax_scale == 1.0 and model.config.window_size == (text.sliding_window - 1, 0)
    widths = set()
    for i, layer in enumerate(model.decoder.layers):
        attention = layer.self_attention
        assert hasattr(attention.linear_proj, "post_layernorm") and hasattr(layer.mlp.linear_fc2, "post_layernorm")
        assert layer.layer_scalar.shape == (1,)
        d, g = layer_head_dim(text, i), layer_groups(text, i)
        assert attention.config.kv_channels == d and attention.config.num_query_groups == g, i
        assert attention.q_layernorm.weight.shape == (d,), i
        assert (attention.core_attention.window is not None) == (text.layer_types[i] == "sliding_attention"), i
        widths.add(d)
    assert len(widths) == 2  # the tiny config's full layers are wider than its sliding ones


def test_state_dict_is_the_part_checkpoints_keys(capsys, release, tmp_path):
    part = tmp_path / "lm"
    assert run_cli(capsys, "convert", "--src", release, "--dst", part, "--to", "mcore", "--format",
                   "legacy", "--part", "language_model", "--quiet")[0] == 0
    stored = open_legacy(part).load_rank(0)
    own = _build().state_dict()
    # The tied head's output layer holds only TE's empty extra-state slot (verify --load fills it).
    assert sorted(stored) == sorted(set(own) - {"output_layer._extra_state"})
    assert [k for k, v in own.items() if torch.is_tensor(v) and v.shape != stored[k].shape] == []


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_check_megatron_passes(tp):
    report = harness.check(FAMILY, impl="megatron", tp=tp, seed=5)
    results = _megatron(report)
    assert set(results) == {"text:logits", "text:token_loss"}
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in results.values()]
    assert all(r.metrics["rel_l2"] <= FP32_REL_L2 for r in results.values())


def test_check_megatron_passes_in_bf16():
    report = harness.check(FAMILY, impl="megatron", seed=5, dtype="bfloat16")
    assert report.passed, [(r.check, r.metrics) for r in _megatron(report).values()]

@pytest.mark.parametrize("overrides", [
    dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    # the block's config is a full layer's, the sliding ones replacing its width; no logit cap
    dict(layer_types=["full_attention", "sliding_attention", "full_attention"], num_hidden_layers=3,
         final_logit_softcapping=None)], ids=["keys_as_values", "full_first"])
def test_check_megatron_passes_on_other_layer_layouts(overrides):
    from mmparity.models.gemma4 import reference

    report = harness.check(FAMILY, cfg=reference.tiny_config(**overrides), impl="megatron", seed=3)
    assert report.passed, [(r.check, r.metrics) for r in _megatron(report).values()]

def test_a_perturbed_decoder_weight_is_located_in_its_layer():
    layer = families.get(FAMILY).tiny_config().text_config.num_hidden_layers - 1

    def perturb(shard):
        keys = [k for k in shard if f"decoder.layers.{layer}." in k and "linear_fc2.weight" in k]
        assert keys
        for key in keys:
            shard[key] = shard[key].flip(0)

    logits = _megatron(harness.check(FAMILY, impl="megatron", mutate_native=perturb))["text:logits"]
    assert not logits.passed
    assert logits.first_divergence.module.startswith(f"language_model.decoder.layers.{layer}"), \
        logits.first_divergence


@pytest.mark.parametrize("part", ["value_norm", "layer_rope", "layer_scalar"])
def test_each_module_megatron_core_lacks_is_needed(part):
    """Without the value norm, the per-layer RoPE or the layer scalars (seeded away from 1; set to 1
    on Megatron's side alone here) the class is another function than HF's: each module is what
    makes it pass, and the scalar's divergence is located in the first layer."""
    from mmparity.models.gemma4 import megatron as gemma4_megatron
    from mmparity.models.gemma4 import reference
    from mmparity.models.parts.gemma_blocks import PerLayerRopeSelfAttention

    cfg = reference.tiny_config()
    with pytest.MonkeyPatch.context() as mp:
        if part == "value_norm":
            mp.setattr(gemma4_megatron, "rms_norm", lambda x, weight, eps: x)
            assert not harness.check(FAMILY, cfg=cfg, impl="megatron", seed=5).passed
        elif part == "layer_rope":
            # no layer rotating (GPTModel is built with no position embedding of its own)
            mp.setattr(PerLayerRopeSelfAttention, "forward",
                       lambda self, h, m, *a, rotary_pos_emb=None, **k: super(PerLayerRopeSelfAttention, self)
                       .forward(h, m, *a, rotary_pos_emb=None, **k))
            assert not harness.check(FAMILY, cfg=cfg, impl="megatron", seed=5).passed
        else:
            def unscaled(shard):
                for key in [k for k in shard if k.endswith("layer_scalar")]:
                    shard[key] = torch.ones_like(shard[key])
            logits = _megatron(harness.check(FAMILY, cfg=cfg, impl="megatron", seed=5,
                                             mutate_native=unscaled))["text:logits"]
            assert not logits.passed
            assert logits.first_divergence.module == "language_model.decoder.layers.0", logits.first_divergence


def test_reference_is_hf_run_as_the_class_computes():
    """HF's own run (scaled embedding, soft-capped logits) is another function."""
    from mmparity.models.gemma4 import megatron as gemma4_megatron
    from mmparity.models.llava import megatron as llava

    hooks = families.get(FAMILY).hooks
    plain = dataclasses.replace(gemma4_megatron.LANGUAGE_MODEL, reference_run=llava.LANGUAGE_MODEL.reference_run)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(hooks.megatron, "GPTModel", plain)
        report = harness.check(FAMILY, impl="megatron", seed=5)
    assert not _megatron(report)["text:logits"].passed


def test_check_hf_with_no_family_passes_on_a_saved_release(capsys, release):
    code, out, err = run_cli(capsys, "check", "--hf", release, "--impl", "megatron")
    assert code == 0, out + err
    assert "GPTModel" in out + err


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_verify_load_of_the_language_model_part_at_tp2_pp2(capsys, release, tmp_path, fmt):
    part = tmp_path / "lm"
    assert run_cli(capsys, "convert", "--src", release, "--dst", part, "--to", "mcore", "--format",
                   fmt, "--tp", "2", "--pp", "2", "--part", "language_model", "--quiet")[0] == 0
    at = ["--tp", "2", "--pp", "2"] if fmt == "torch_dist" else []
    code, out, err = run_cli(capsys, "verify", "--load", part, *at)
    assert code == 0, out + err
    assert "strict load into Megatron's GPTModel" in out and "all ranks load" in out
    assert out.count(": ok: loads") == 4, out


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_whole_convert_verify_load_and_back_with_base_is_bit_exact(capsys, release, tmp_path, fmt):
    """The whole release at TP 2 x PP 2: its language model loads strictly into the GPTModel, the
    rest is counted, and the export with ``--base`` is the release."""
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert run_cli(capsys, "convert", "--src", release, "--dst", mcore, "--to", "mcore", "--format", fmt,
                   "--tp", "2", "--pp", "2", "--quiet")[0] == 0
    assert run_cli(capsys, "verify", mcore, "--quiet")[0] == 0
    code, out, err = run_cli(capsys, "verify", "--load", mcore)
    assert code == 0 and "language_model.* -> GPTModel" in out and "not loaded: the rest" in out, out + err
    assert run_cli(capsys, "convert", "--src", mcore, "--dst", back, "--to", "hf", "--base", release,
                   "--quiet")[0] == 0
    expected, got = load_safetensors_state_dict(release), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())


def _check_through_spec(mp, load, flags_config=None, **check):
    from mmparity.models.gemma4 import megatron as gemma4_megatron

    return spec.check_through_spec(mp, FAMILY, gemma4_megatron, load, flags_config, **check)


@pytest.fixture
def beside(tmp_path):
    """A checkpoint root holding the tiny config as ``convert`` keeps it (``hf_config.json``)."""
    from mmparity.models.gemma4 import reference

    cfg = reference.tiny_config()
    return spec.config_beside(tmp_path, cfg), cfg


def test_the_spec_layer_builds_the_class_from_the_hf_config_beside_load(beside):
    """From the flags' config (one width, SiLU, the default scale) and the file, each layer is the
    class's: the check passes as the class's own does."""
    root, cfg = beside
    with pytest.MonkeyPatch.context() as mp:
        report = _check_through_spec(mp, root, cfg=cfg)
    assert report.passed, [(r.check, r.metrics) for r in _megatron(report).values()]
    assert all(r.metrics["rel_l2"] <= FP32_REL_L2 for r in _megatron(report).values())


def test_the_spec_layer_keys_torch_dist_layer_by_layer(beside):
    """No flag sets the block's ``hetereogenous_dist_checkpoint``: building a layer sets it on the
    config the block hands it (the block's own), so torch_dist keys the wider layers apart."""
    root, cfg = beside
    from mmparity.models.gemma4 import megatron as gemma4_megatron

    with pytest.MonkeyPatch.context() as mp, runtime.parallel_context(1, 1):
        spec.megatron_lm_run(mp, root)
        no_keying = lambda c: dataclasses.replace(c, hetereogenous_dist_checkpoint=False)  # noqa: E731
        model = models.build(spec.flags_builder(gemma4_megatron, no_keying), cfg)
    assert model.decoder.config.hetereogenous_dist_checkpoint
    assert [type(layer).__name__ for layer in model.decoder.layers] == ["ScaledLayer"] * len(model.decoder.layers)


def test_the_spec_layer_refuses_without_the_hf_config_beside_load(tmp_path):
    from mmparity.io.fsio.errors import CheckpointError

    with pytest.MonkeyPatch.context() as mp, pytest.raises(CheckpointError) as caught:
        _check_through_spec(mp, tmp_path)
    line = str(caught.value)
    assert "\n" not in line and "hf_config.json: not found" in line and "--load" in line and "--save = --load" in line


@pytest.mark.parametrize("flag, field, value", [("--kv-channels", "kv_channels", 16),
                                                ("--window-size", "window_size", (5, 0)),
                                                ("--apply-layernorm-1p", "layernorm_zero_centered_gamma", True)])
def test_a_flag_the_hf_config_contradicts_is_named(beside, flag, field, value):
    """The full layers' width as the flags' one, the window one key too wide, zero-centred norms:
    each refused in one line naming the flag and the file."""
    root, cfg = beside
    with pytest.MonkeyPatch.context() as mp, pytest.raises(ValueError) as caught:
        _check_through_spec(mp, root, lambda c: dataclasses.replace(c, **{field: value}), cfg=cfg)
    line = str(caught.value)
    assert "\n" not in line and line.startswith(str(root / "hf_config.json")) and f"{flag} gives {field}=" in line


def test_the_recorded_spec_is_the_modules():
    from mmparity.models.gemma4 import megatron as gemma4_megatron

    recorded = dict(families.get(FAMILY).megatron_args)
    assert tuple(recorded["spec"]) == gemma4_megatron.SPEC and recorded["position_embedding_type"] == "none"
    assert isinstance(gemma4_megatron.LAYER.module, type) and gemma4_megatron.SPEC[1] == "LAYER"


def test_the_spec_layer_refuses_an_e2b_config_beside_load(tmp_path):
    """GPTModel has no per-layer inputs nor shared keys/values: a Megatron-LM run pointed at an
    E2B-like checkpoint stops at the build, in one line, instead of failing the strict load."""
    from mmparity.io.fsio.errors import CheckpointError
    from mmparity.models.gemma4 import reference

    spec.config_beside(tmp_path, reference.tiny_e2b_config())
    with pytest.MonkeyPatch.context() as mp, pytest.raises(CheckpointError) as caught:
        _check_through_spec(mp, tmp_path)
    line = str(caught.value)
    assert "\n" not in line and "per-layer input embeddings" in line and "keys and values" in line
