"""Llama 4's vision tower (``llama4_vision``): a tiny model saved by transformers is told and passes
``check --hf`` in fp32 and bf16; perturbed weights are named by module; conversion at TP 2 x PP 2
in both formats verifies and comes back bit for bit; the pieces that are Llama 4's own (the 2D
RoPE table with the class token last, the pixel shuffle's block layout, the unfolded-patch linear
as a convolution) are pinned against transformers. And the upstream fault the whole model's
reference works around: transformers 5.24's ``Llama4ForConditionalGeneration.forward`` raises."""

from __future__ import annotations

import pytest
import torch

from mmparity.models import registry as families
from mmparity.parity import harness
from tests.hf_roundtrip import assert_round_trip, bump, run_cli, save_tiny


@pytest.fixture(scope="module")
def saved_tower(tmp_path_factory):
    return save_tiny(tmp_path_factory, "llama4_vision", "60KB")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_without_family_tells_the_family_and_passes(saved_tower, capsys, dtype):
    assert run_cli("check", "--hf", saved_tower, "--dtype", dtype) == 0
    said = capsys.readouterr()
    assert "family: llama4_vision " in said.out + said.err


@pytest.mark.parametrize("mutate, module", [
    (bump("decoder.layers.1.self_attention.linear_qkv.weight", (7, 3)), "layer.1.self_attention"),
    (bump("decoder.layers.2.mlp.linear_fc1.layer_norm_weight", (3,)), "layer.2.pre_mlp_layernorm"),
    (bump("position_embeddings.weight", (16, 5)), "ln_pre"),
    (bump("adapter.linear_fc1.weight", (2, 9)), "adapter"),
])
def test_negative_controls_fail_and_name_the_module(mutate, module):
    report = harness.check("llama4_vision", seed=2, mutate_native=mutate)
    failures = report.failures()
    assert failures and {r.first_divergence.module for r in failures} == {module}


def test_rope_table_is_transformers_with_the_class_token_unrotated():
    """Pair t rotates by (col + 1)·f[t], pair hd/4 + t by (row + 1)·f[t]; the class token (last)
    not at all: the native angles are transformers' complex table's, each repeated for mcore."""
    from mmparity.models.llama4_vision.native import Llama4VisionRope

    fam = families.get("llama4_vision")
    cfg = fam.tiny_config()
    table = fam.build_reference(cfg).rotary_embedding.freqs_ci
    grid = cfg.image_size // cfg.patch_size
    angles = Llama4VisionRope(cfg.hidden_size // cfg.num_attention_heads, 10000.0)(grid, grid, "cpu")
    cos, sin = torch.cos(angles[:, 0, 0, ::2]), torch.sin(angles[:, 0, 0, ::2])
    assert torch.allclose(cos, table.real.reshape(cos.shape), atol=1e-6)
    assert torch.allclose(sin, table.imag.reshape(sin.shape), atol=1e-6)
    assert torch.equal(angles[-1], torch.zeros_like(angles[-1]))
    assert torch.equal(angles[..., ::2], angles[..., 1::2])


def test_pixel_shuffle_is_patch_major_two_by_two_blocks():
    """transformers' ratio-0.5 pixel shuffle puts each 2x2 block in one token as [top-left,
    top-right, bottom-left, bottom-right], blocks row-major: the "patch" fold of the mergers."""
    from transformers.models.llama4.modeling_llama4 import pixel_shuffle

    from mmparity.models.core.mergers import fold_blocks

    x = torch.arange(4 * 6 * 6 * 3, dtype=torch.float32).view(4, 36, 3)
    assert torch.equal(fold_blocks(x, 6, 6, 2, "patch"), pixel_shuffle(x, 0.5))
    assert not torch.equal(fold_blocks(x, 6, 6, 2, "channel"), pixel_shuffle(x, 0.5))


def test_tiles_of_another_size_are_refused():
    fam = families.get("llama4_vision")
    assert fam.hooks.config.image_size_problems(fam.tiny_config(), [(32, 32)]) == []
    assert fam.hooks.config.image_size_problems(fam.tiny_config(), [(40, 32)])


def test_whole_forward_raises_in_transformers_5_24():
    """The upstream fault (docs/megatron.md): ``Llama4ForConditionalGeneration.forward`` reads
    ``image_outputs`` off the language model's output, which has none, on every call."""
    import transformers
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    if not transformers.__version__.startswith("5.24"):
        pytest.skip(f"pinned on transformers 5.24 (installed: {transformers.__version__})")
    cfg = Llama4Config(
        vision_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           vision_output_dim=8, image_size=16, patch_size=8, projector_input_dim=8,
                           projector_output_dim=8),
        text_config=dict(vocab_size=40, hidden_size=16, intermediate_size=8, intermediate_size_mlp=8,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_local_experts=2),
        image_token_index=39)
    model = Llama4ForConditionalGeneration(cfg).eval()
    with pytest.raises(AttributeError, match="image_outputs"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_convert_tp2_pp2_verify_and_back_with_base_is_bit_exact(saved_tower, tmp_path, fmt):
    assert_round_trip(saved_tower, tmp_path, "--tp", 2, "--pp", 2, fmt=fmt)


# --- the whole model -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_whole(tmp_path_factory):
    return save_tiny(tmp_path_factory, "llama4", "200KB")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_whole_check_without_family_tells_the_family_and_passes(saved_whole, capsys, dtype):
    assert run_cli("check", "--hf", saved_whole, "--dtype", dtype) == 0
    said = capsys.readouterr()
    assert "family: llama4 " in said.out + said.err


@pytest.mark.parametrize("mutate, module", [
    (bump("vision_model.decoder.layers.0.self_attention.linear_qkv.weight", (7, 3)),
     "vision_model.layer.0.self_attention"),
    (bump("vision_model.adapter.linear_fc2.weight", (1, 4)), "vision_model.adapter"),
    (bump("vision_projection.encoder.linear_fc1.weight", (5, 2)), "vision_projection"),
    (bump("language_model.decoder.layers.3.self_attention.linear_qkv.weight", (20, 7)),
     "language_model.decoder.layers.3.self_attention"),
    (bump("language_model.decoder.layers.1.mlp.shared_experts.linear_fc2.weight", (3, 4)),
     "language_model.decoder.layers.1.mlp.shared_experts"),
    (bump("language_model.decoder.layers.2.mlp.linear_fc1.weight", (0, 0), by=2.0),
     "language_model.decoder.layers.2.mlp"),
])
def test_whole_negative_controls_fail_and_name_the_part(mutate, module):
    report = harness.check("llama4", seed=2, mutate_native=mutate)
    failures = report.failures()
    assert failures and {r.first_divergence.module for r in failures} == {module}


def test_the_tiny_model_exercises_every_layer_kind():
    """Chunks shorter than the rows, a NoPE layer with a temperature that changes within them, MoE
    on alternate layers, images of different tile counts."""
    from mmparity.models.llama4 import cases as llama4_cases

    fam = families.get("llama4")
    cfg = fam.tiny_config()
    text = cfg.text_config
    (case,) = fam.hooks.parity.cases(cfg, 0)
    width = case.data["input_ids"].shape[1]
    assert text.attention_chunk_size < width and "chunked_attention" in text.layer_types
    assert 0 in text.no_rope_layers and text.floor_scale < width
    assert text.moe_layers == [1, 3] and text.num_local_experts == 4 and text.num_experts_per_tok == 1
    assert len(set(llama4_cases.TILES)) == len(llama4_cases.TILES)
    image = (case.data["input_ids"] == cfg.image_token_id).sum().item()
    assert image == sum(llama4_cases.TILES) * llama4_cases.tokens_per_tile(cfg)


def test_each_layer_kind_matters():
    """The chunked mask, the NoPE temperature and the q/k norms each change the function: a native
    model without one of them fails the check (so passing it is evidence for each)."""
    from mmparity.models.parts.llama4_text import native as text_native

    for attribute, value in (("chunk", None), ("floor_scale", None)):
        original = text_native.Llama4CoreAttention.forward

        def forward(self, *args, _original=original, _attribute=attribute, _value=value, **kwargs):
            setattr(self, _attribute, _value)
            return _original(self, *args, **kwargs)

        text_native.Llama4CoreAttention.forward = forward
        try:
            report = harness.check("llama4", seed=1, components=False)
        finally:
            text_native.Llama4CoreAttention.forward = original
        assert not report.passed, attribute


def test_experts_are_read_and_written_as_saved(saved_whole):
    """transformers 5.24 saves each MoE layer's experts as two stacks, gate_up_proj [E, H, 2I]
    (gate first along the last axis) and down_proj [E, I, H]; mcore's expert e is their transpose."""
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    fam = families.get("llama4")
    cfg = fam.tiny_config()
    text = cfg.text_config
    saved = load_safetensors_state_dict(saved_whole)
    gate_up = saved["language_model.model.layers.1.feed_forward.experts.gate_up_proj"]
    down = saved["language_model.model.layers.1.feed_forward.experts.down_proj"]
    e, h, i = text.num_local_experts, text.hidden_size, text.intermediate_size
    assert tuple(gate_up.shape) == (e, h, 2 * i) and tuple(down.shape) == (e, i, h)
    shards = fam.hf_to_mcore(saved, cfg)
    root = "language_model.decoder.layers.1.mlp.experts."
    assert torch.equal(shards[0][root + "linear_fc1.weight2"], gate_up[2].T)
    assert torch.equal(shards[0][root + "linear_fc2.weight2"], down[2].T)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_whole_convert_tp2_pp2_ep2_verify_check_and_back_with_base_is_bit_exact(saved_whole, tmp_path, fmt):
    assert_round_trip(saved_whole, tmp_path, "--tp", 2, "--pp", 2, "--ep", 2, fmt=fmt)


def test_llama3_scaled_rope_is_computed_with_the_configs_factors():
    """Llama 3's RoPE scaling (``rope_type`` llama3) with a config's own factors: the native
    decoder takes mcore's scaling with the config's factors, and with mcore's fixed ones fails."""
    from mmparity.models.llama4 import reference
    from mmparity.models.parts.llama4_text import native as text_native

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 2.0, "original_max_position_embeddings": 16}
    cfg = reference.tiny_config(rope_parameters=rope)
    report = harness.check("llama4", cfg=cfg, seed=1, components=False)
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
    fields = text_native.LLAMA3_FIELDS
    text_native.LLAMA3_FIELDS = ()  # the scaling's own defaults: Llama 3's, not these
    try:
        assert not harness.check("llama4", cfg=cfg, seed=1, components=False).passed
    finally:
        text_native.LLAMA3_FIELDS = fields
