"""InternViT (the tower family) and whole InternVL: a tiny model saved by transformers is told and
passes ``check --hf`` in fp32 and bf16; perturbed weights are named by part; conversion at TP 2 x
PP 2 in both formats loads strictly into Megatron's class and comes back bit for bit; the pieces
that are InternVL's own (whole-width q/k norms, layer scales, pixel shuffle, <img> / </img>
around each tiled image) are pinned against transformers."""

from __future__ import annotations

import pytest
import torch

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state
from mmparity.models.internvl import cases as internvl_cases
from mmparity.parity import harness


def _run(*argv) -> int:
    from mmparity.cli.main import main

    return main([str(a) for a in argv])


def _saved(tmp_path_factory, family: str):
    path = tmp_path_factory.mktemp(family) / "hf"
    fam = families.get(family)
    model = fam.build_reference(fam.tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=3))
    model.save_pretrained(path, max_shard_size="60KB")
    return path


@pytest.fixture(scope="module")
def saved_whole(tmp_path_factory):
    """A tiny InternVLForConditionalGeneration with seeded weights, as save_pretrained writes it."""
    return _saved(tmp_path_factory, "internvl")


@pytest.fixture(scope="module")
def saved_tower(tmp_path_factory):
    """A tiny InternVLVisionModel (RMSNorm, q/k norms, final LayerNorm kept), save_pretrained."""
    return _saved(tmp_path_factory, "internvit")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", ["whole", "tower"])
def test_check_without_family_tells_the_family_and_passes(saved_whole, saved_tower, capsys, dtype, which):
    saved, family = (saved_whole, "internvl") if which == "whole" else (saved_tower, "internvit")
    assert _run("check", "--hf", saved, "--dtype", dtype) == 0
    said = capsys.readouterr()
    assert f"family: {family} " in said.out + said.err


def _bump(key, index=(0,), by=0.5):
    def mutate(state):
        state[key] = state[key].clone()
        state[key][index] += by
    return mutate


@pytest.mark.parametrize("mutate, module", [
    (_bump("vision_model.decoder.layers.0.self_attention.linear_qkv.weight", (7, 3)),
     "vision_model.layer.0.self_attention"),
    # A layer scale changes nothing inside the layer's modules, only the layer's output.
    (_bump("vision_model.decoder.layers.1.ls2", (5,)), "vision_model.layer.1"),
    (_bump("vision_projection.encoder.linear_fc1.layer_norm_weight", (11,)), "vision_projection"),
    (_bump("language_model.decoder.layers.1.mlp.linear_fc2.weight", (0, 0)), "language_model.decoder.layers.1.mlp"),
])
def test_whole_negative_controls_fail_and_name_the_part(mutate, module):
    report = harness.check("internvl", seed=2, mutate_native=mutate)
    failures = report.failures()
    assert failures and {r.first_divergence.module for r in failures} == {module}


@pytest.mark.parametrize("mutate, module", [
    (_bump("decoder.layers.1.self_attention.q_layernorm.weight", (13,)), "layer.1.self_attention"),
    # The attention's scale reaches the residual the MLP's norm reads first.
    (_bump("decoder.layers.0.ls1", (2,)), "layer.0.pre_mlp_layernorm"),
    (_bump("decoder.layers.2.input_layernorm.weight", (3,)), "layer.2.input_layernorm"),
])
def test_tower_negative_controls_fail_and_name_the_module(mutate, module):
    report = harness.check("internvit", seed=2, mutate_native=mutate)
    failures = report.failures()
    assert failures and {r.first_divergence.module for r in failures} == {module}


def test_q_k_norms_span_the_whole_width():
    """transformers' q/k RMSNorm takes its statistic over every head at once: the native norm is
    that function (TP ranks sum their heads' squares), and a per-head norm is another one."""
    from transformers.models.internvl.modeling_internvl import InternVLVisionRMSNorm

    from mmparity.models.internvit.native import WholeWidthQKNorm, rms_norm
    from mmparity.parallel import runtime

    fam = families.get("internvit")
    cfg = fam.tiny_config()
    runtime.init_parallel(1, 1)
    from mmparity.models.internvit.native import transformer_config

    norm = WholeWidthQKNorm(transformer_config(cfg))
    hf = InternVLVisionRMSNorm(cfg.hidden_size)
    weight = torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    norm.weight.data.copy_(weight)
    hf.weight.data.copy_(weight)
    heads, width = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    x = torch.randn(5, 2, heads, width, generator=torch.Generator().manual_seed(1)) * torch.arange(1, heads + 1).view(1, 1, -1, 1)
    assert torch.allclose(norm(x).flatten(2), hf(x.flatten(2)), rtol=0, atol=1e-6)
    per_head = rms_norm(x, weight.view(heads, width), 1e-6)
    assert not torch.allclose(per_head.flatten(2), hf(x.flatten(2)), atol=1e-3)


def test_tiles_fill_image_seq_length_slots_between_img_and_end_img():
    """Each tile gives image_seq_length tokens after the 2x2 shuffle (the processor's count), each
    image of several tiles one run of them, between <img> and </img>; two images of 1 and 2 tiles."""
    fam = families.get("internvl")
    cfg = fam.tiny_config()
    case = internvl_cases.llava.cases(cfg, 0, towers=families.tower_of,
                                      composition=internvl_cases.llava.Composition(image_wrap=internvl_cases.image_wrap))[0]
    assert case.data["num_image_tiles"] == [1, 2]
    start, end = internvl_cases.image_wrap(cfg)
    image = cfg.image_token_id
    runs = []
    for row in case.data["hf_input_ids"].tolist():
        i = 0
        while i < len(row):
            if row[i] == image:
                j = i
                while j < len(row) and row[j] == image:
                    j += 1
                assert row[i - 1] == start and row[j] == end
                runs.append(j - i)
                i = j
            else:
                i += 1
    assert runs == [cfg.image_seq_length * 1, cfg.image_seq_length * 2]
    assert sum(row.count(start) for row in case.data["hf_input_ids"].tolist()) == 2


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("which", ["whole", "tower"])
def test_convert_tp2_pp2_verify_load_and_back_with_base_is_bit_exact(saved_whole, saved_tower, tmp_path, fmt,
                                                                     which):
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    saved = saved_whole if which == "whole" else saved_tower
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert _run("convert", "--src", saved, "--dst", mcore, "--to", "mcore", "--tp", 2, "--pp", 2,
                "--format", fmt, "--quiet") == 0
    assert _run("verify", mcore) == 0
    # Megatron's CLIPViTModel is not built in stages: the tower loads from PP 1 (a torch_dist
    # checkpoint loads at any PP).
    if which == "whole" or fmt == "torch_dist":
        assert _run("verify", mcore, "--load") == 0
    assert _run("convert", "--src", mcore, "--dst", back, "--to", "hf", "--base", saved, "--quiet") == 0
    expected, got = load_safetensors_state_dict(saved), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())


def test_final_layernorm_travels_beside_the_checkpoint(saved_tower, tmp_path):
    """use_mean_pooling off: transformers' final LayerNorm has no place in CLIPViTModel; it is kept
    in the side file, not dropped, and comes back."""
    mcore = tmp_path / "mcore"
    assert _run("convert", "--src", saved_tower, "--dst", mcore, "--to", "mcore", "--format", "legacy",
                "--quiet") == 0
    fam = families.get("internvit")
    shards = fam.hf_to_mcore(fam.build_reference(fam.tiny_config()).state_dict(), fam.tiny_config(), tp_size=1)
    assert "ln_post.weight" not in shards[0] and set(shards.side[0]) == {"ln_post.weight", "ln_post.bias"}


@pytest.mark.parametrize("feature_layer", [-1, -2])
def test_a_tower_with_its_final_norm_feeds_it_only_where_the_last_layer_is_read(feature_layer):
    """use_mean_pooling off: transformers reads vision_feature_layer -1 as the tower's output, its
    final LayerNorm included, and an earlier layer as that layer's hidden state; the native
    model does the same (the norm comes from the side file)."""
    fam = families.get("internvl")
    cfg = fam.tiny_config()
    cfg.vision_config.use_mean_pooling = False
    cfg.vision_feature_layer = feature_layer
    report = harness.check("internvl", cfg=cfg, seed=1, components=False)
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
