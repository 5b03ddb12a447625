"""Pixtral-Large (Mistral3): the 2x2 merger, conversion of a whole Mistral3 checkpoint, parity at
the merger and projector outputs, static and packed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Mistral3ForConditionalGeneration
from transformers.models.mistral3.modeling_mistral3 import Mistral3PatchMerger

from mmparity.models import registry as families
from mmparity.models.core.mergers import fold_blocks
from mmparity.parity import harness
from mmparity.models.core.inputs import random_like_state
from tests.strategies import config_and_tp


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_merger_and_projector_shard_as_mcore_expects(data):
    """Round trips are tests/mapping/test_converters.py's, for every family; here the per-rank shapes."""
    cfg, tp = data.draw(config_and_tp("pixtral_large"))
    sd = random_like_state(families.get("pixtral_large").build_reference(cfg).state_dict(),
                           data.draw(st.integers(0, 999)))
    shards = families.get("pixtral_large").hf_to_mcore(sd, cfg, tp_size=tp)
    m = cfg.spatial_merge_size
    h = cfg.vision_config.hidden_size
    assert shards[0]["vision_model.merger.linear_fc1.weight"].shape == (h, h * m * m)
    assert shards[0]["vision_projection.encoder.linear_fc1.weight"].shape == (
        cfg.text_config.hidden_size // tp, h)


@settings(max_examples=25, deadline=None)
@given(h=st.integers(2, 7), w=st.integers(2, 7), m=st.sampled_from([2, 3]), hidden=st.integers(1, 5))
def test_channel_major_fold_is_f_unfold_and_patch_major_is_not(h, w, m, hidden):
    if h < m or w < m:
        return
    x = torch.randn(h * w, hidden)
    folded = fold_blocks(x, h, w, m, "channel", drop_remainder=True)
    image = x.view(h, w, hidden).permute(2, 0, 1).unsqueeze(0)
    unfolded = F.unfold(image, kernel_size=m, stride=m).view(hidden * m * m, -1).t()
    assert torch.equal(folded, unfolded)
    patch_major = fold_blocks(x, h, w, m, "patch", drop_remainder=True)
    block0 = x.view(h, w, hidden)[:m, :m].reshape(-1)
    assert torch.equal(patch_major[0], block0)
    if hidden > 1:
        assert not torch.equal(patch_major, folded)


def test_fold_refuses_what_it_cannot_tile():
    with pytest.raises(ValueError, match="does not tile"):
        fold_blocks(torch.zeros(15, 2), 3, 5, 2, "patch")
    with pytest.raises(ValueError, match="no complete 2x2 block"):
        fold_blocks(torch.zeros(5, 2), 1, 5, 2, "channel", drop_remainder=True)


def test_native_merger_is_hf_patch_merger_on_a_packed_batch_with_odd_grids():
    fam = families.get("pixtral_large")
    cfg = fam.tiny_config()
    hf = Mistral3PatchMerger(cfg)
    native = fam.build_native(cfg).vision_model.merger
    with torch.no_grad():
        native.linear_fc1.weight.copy_(torch.randn_like(hf.merging_layer.weight))
        hf.merging_layer.weight.copy_(native.linear_fc1.weight)
        grids = [(5, 7), (2, 2), (3, 6), (7, 3)]
        tokens = torch.randn(sum(a * b for a, b in grids), cfg.vision_config.hidden_size)
        expected = hf(tokens, torch.tensor([(a * 8, b * 8) for a, b in grids]))
        assert torch.equal(native.merge(tokens, grids), expected)
        # static path: one grid, a batch dimension (compared with HF on that image alone, so that
        # both matmuls see the same row count and block the same way)
        static = native.linear_fc1(native.fold(tokens[:35].view(1, 35, -1), 5, 7))[0]
        assert torch.equal(static, hf(tokens[:35], torch.tensor([(40, 56)])))


def test_merger_norm_takes_the_text_config_epsilon():
    fam = families.get("pixtral_large")
    cfg = fam.tiny_config()
    native = fam.build_native(cfg)
    assert native.vision_model.merger.pre_norm.eps == cfg.text_config.rms_norm_eps != 1e-5
    assert native.vision_model.ln_pre.eps == 1e-5


def test_the_wrong_epsilon_fails_parity(monkeypatch):
    from mmparity.models.pixtral_large import native as native_module

    build = native_module.ViTModel

    def vision_epsilon(*args, **kwargs):
        kwargs["merger_norm_eps"] = 1e-5
        return build(*args, **kwargs)

    monkeypatch.setattr(native_module, "ViTModel", vision_epsilon)
    report = harness.check("pixtral_large", seed=1, components=False)
    assert not report.passed
    assert {r.first_divergence.module for r in report.failures()} == {"merger_norm"}


def _perturb(key):
    def mutate(state):
        state[key] = state[key].clone()
        state[key].view(-1)[3] += 0.5
    return mutate


def test_negative_controls_name_the_merger_and_the_projector():
    merger = harness.check("pixtral_large", seed=2, components=False,
                           mutate_native=_perturb("vision_model.merger.linear_fc1.weight"))
    assert {r.first_divergence.module for r in merger.failures()} == {"merger"}
    assert len(merger.failures()) == 4
    projector = harness.check("pixtral_large", seed=2, components=False,
                              mutate_native=_perturb("vision_projection.encoder.linear_fc1.bias"))
    assert {r.check.split(":")[1] for r in projector.failures()} == {"projector"}
    assert {r.first_divergence.module for r in projector.failures()} == {"projector"}


def test_parity_static_and_packed_at_other_sizes_with_and_without_projector_bias():
    cfg = families.get("pixtral_large").tiny_config()
    sizes = [(16, 56), (48, 32), (40, 24), (24, 24)]
    report = harness.check("pixtral_large", cfg, image_sizes=sizes, seed=7)
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
    cfg.multimodal_projector_bias = False
    report = harness.check("pixtral_large", cfg, image_sizes=sizes[:2], seed=8, components=False)
    assert report.passed, [(r.check, r.metrics) for r in report.failures()]


def test_only_the_last_vision_feature_layer_is_supported():
    cfg = families.get("pixtral_large").tiny_config()
    cfg.vision_feature_layer = -2
    with pytest.raises(ValueError, match="vision_feature_layer=-2"):
        families.get("pixtral_large").build_native(cfg)


@pytest.fixture(scope="module")
def mistral3_dir(tmp_path_factory):
    cfg = families.get("pixtral_large").tiny_config()
    model = Mistral3ForConditionalGeneration(cfg)
    model.load_state_dict(random_like_state(model.state_dict(), seed=13))
    path = tmp_path_factory.mktemp("hf") / "mistral3"
    model.save_pretrained(path)
    return path, model


def test_whole_mistral3_checkpoint_converts_without_its_language_model(mistral3_dir):
    _, model = mistral3_dir
    cfg = model.config
    in_memory = model.state_dict()  # transformers 5 keeps model.vision_tower.* in memory
    assert any(k.startswith("model.language_model.") for k in in_memory)
    shards = families.get("pixtral_large").hf_to_mcore(in_memory, cfg, tp_size=2)
    assert not any("language" in k for k in shards[0])
    back = families.get("pixtral_large").mcore_to_hf(shards, cfg, prefix="model.")
    assert set(back) == {k for k in in_memory if k.startswith(("model.vision_tower.",
                                                               "model.multi_modal_projector."))}
    assert all(torch.equal(back[k], in_memory[k]) for k in back)


def test_cli_checks_a_saved_whole_mistral3_model(mistral3_dir, capsys):
    from mmparity.cli.main import main

    path, _ = mistral3_dir
    capsys.readouterr()
    assert main(["check", "pixtral_large", "--hf", str(path), "--quiet"]) == 0
    # the same checkpoint also holds a plain Pixtral tower
    assert main(["check", "pixtral", "--hf", str(path), "--quiet"]) == 0
