"""Gemma 4's vision tower (``gemma4_vision``): a tiny model saved by transformers is told and passes
``check --hf`` in fp32 and bf16; perturbed weights and clamp bounds are named by module;
conversion at TP 2 x PP 2 (and TP 4) in both formats verifies and comes back bit for bit. The
pieces that are Gemma 4's own are pinned against transformers: the processor's patch rows and
positions, the axial RoPE under the converter's q/k reordering, the norms (scaled by ``w``, not
``1 + w``), the padding rows (dropped natively: the same soft tokens as each image alone), and the
clipped linears (their bounds cut values at the seeded weights, and are held exactly)."""

from __future__ import annotations

import pytest
import torch

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state
from mmparity.parity import harness
from tests.hf_roundtrip import assert_round_trip, bump, run_cli, save_tiny

FAMILY = "gemma4_vision"


@pytest.fixture(scope="module")
def saved_tower(tmp_path_factory):
    return save_tiny(tmp_path_factory, FAMILY, "60KB")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_without_family_tells_the_family_and_passes(saved_tower, capsys, dtype):
    assert run_cli("check", "--hf", saved_tower, "--dtype", dtype) == 0
    said = capsys.readouterr()
    assert f"family: {FAMILY} " in said.out + said.err


@pytest.mark.parametrize("mutate, module", [
    (bump("decoder.layers.1.self_attention.linear_qkv.weight", (7, 3)), "layer.1.self_attention"),
    (bump("decoder.layers.0.self_attention.k_layernorm.weight", (5,)), "layer.0.self_attention"),
    (bump("decoder.layers.2.self_attention.linear_qkv.v_output_max", (), -0.6), "layer.2.self_attention"),
    (bump("decoder.layers.1.self_attention.linear_proj.post_layernorm.weight", (4,)), "layer.1.self_attention"),
    (bump("decoder.layers.2.mlp.linear_fc1.layer_norm_weight", (3,)), "layer.2.pre_mlp_layernorm"),
    (bump("decoder.layers.0.mlp.linear_fc1.up_input_min", (), 0.6), "layer.0.mlp"),
    (bump("decoder.layers.1.mlp.linear_fc2.output_min", (), 0.6), "layer.1.mlp"),
    (bump("position_embeddings.weight", (1, 2, 5)), "layer.0.input_layernorm"),
    (bump("patch_embed.proj.weight", (2, 9)), "patch_embed"),
])
def test_negative_controls_fail_and_name_the_module(mutate, module):
    report = harness.check(FAMILY, seed=2, mutate_native=mutate)
    failures = report.failures()
    assert failures and {r.first_divergence.module for r in failures} == {module}


def test_a_perturbed_standardize_vector_fails_the_output():
    """After the last layer only the output is compared: it fails, no layer is blamed."""
    report = harness.check(FAMILY, seed=2, mutate_native=bump("standardize.scale", (3,), 0.5))
    assert report.failures() and all(not r.passed for r in report.results)


def test_patch_rows_and_positions_are_the_processors():
    """Rows in raster order, each patch flattened (P, P, C); positions (column, row); padding rows
    zero at (-1, -1): transformers' image processor's output for images of the right sizes (its
    PIL backend: the torchvision one patchifies alike and needs torchvision)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from mmparity.models.gemma4_vision.cases import processor_batch

    sizes, patch, pooling = [(24, 36), (12, 48)], 4, 3
    images = [torch.rand(3, h, w, generator=torch.Generator().manual_seed(h + w)) for h, w in sizes]
    processor = Gemma4ImageProcessorPil(patch_size=patch, pooling_kernel_size=pooling, max_soft_tokens=70,
                                        do_resize=False, do_rescale=False, do_normalize=False)
    theirs = processor(images=[i.numpy() for i in images], return_tensors="pt")
    values, positions = processor_batch(images, patch, pooling)
    n = values.shape[1]
    assert torch.equal(values, theirs["pixel_values"][:, :n])
    assert torch.equal(positions, theirs["image_position_ids"][:, :n])
    assert (theirs["image_position_ids"][:, n:] == -1).all()


def test_axial_rope_is_transformers_after_the_quarter_swap():
    """mcore's whole-head rotate-half on q rows whose middle quarters are swapped (the converter's
    ``AxialRopeHalves``) is transformers' rotation of each half by its own axis, swapped back."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionRotaryEmbedding, apply_multidimensional_rope

    from mmparity.mapping.ops import AxialRopeHalves
    from mmparity.models.gemma4_vision.native import axial_rope

    fam = families.get(FAMILY)
    cfg = fam.tiny_config()
    heads, d = cfg.num_attention_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(5)
    positions = torch.stack([torch.randint(0, 9, (30,), generator=gen), torch.randint(0, 7, (30,), generator=gen)], -1)
    q = torch.randn(1, 30, heads, d, generator=gen)
    cos, sin = Gemma4VisionRotaryEmbedding(cfg)(q, positions[None])
    theirs = apply_multidimensional_rope(q, cos, sin, positions[None])
    swap = AxialRopeHalves(1, d)
    swapped = swap.apply([q.reshape(-1, d).T])[0].T.reshape(q.shape)
    ours = _apply_rotary_pos_emb_bshd(swapped[0].unsqueeze(1), axial_rope(positions, d, 100.0), rotary_interleaved=False)
    back = swap.invert([ours.reshape(-1, d).T])[0].T.reshape(q.shape)
    assert torch.allclose(back, theirs, atol=1e-6)
    assert not torch.allclose(ours.reshape(q.shape), theirs, atol=1e-3)


def test_quarter_swap_refuses_rows_that_are_not_whole_heads():
    from mmparity.mapping.ops import AxialRopeHalves

    assert AxialRopeHalves(1, 8).apply([torch.arange(8)])[0].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    with pytest.raises(ValueError, match="AxialRopeHalves"):
        AxialRopeHalves(3, 8).apply([torch.arange(8)])
    with pytest.raises(ValueError, match="multiple of 4"):
        AxialRopeHalves(1, 6).apply([torch.arange(6)])


def test_norms_scale_by_the_weight_not_one_plus_it():
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    from mmparity.models.gemma4_vision.native import gemma_rms_norm

    x, w = torch.randn(6, 10), 0.3 + torch.rand(10)
    norm = Gemma4RMSNorm(10, eps=1e-6)
    norm.weight.data.copy_(w)
    assert torch.equal(gemma_rms_norm(x, w, 1e-6), norm(x))
    assert not torch.allclose(gemma_rms_norm(x, 1 + w, 1e-6), norm(x))
    bare = Gemma4RMSNorm(10, eps=1e-6, with_scale=False)
    assert torch.equal(gemma_rms_norm(x, None, 1e-6), bare(x)) and not list(bare.state_dict())


def _native_with_seeded_weights(cfg):
    from mmparity.mapping.rules import convert_hf_to_mcore, with_side
    from mmparity.parallel import runtime

    fam = families.get(FAMILY)
    ref = fam.build_reference(cfg)
    ref.load_state_dict(random_like_state(ref.state_dict(), seed=4))
    if runtime.current_layout() is None:
        runtime.init_parallel(1, 1)
    native = fam.build_native(cfg)
    shards = convert_hf_to_mcore(fam.converter.rule_set(cfg, "hf"), ref.state_dict())
    native.load_state_dict(with_side(shards)[0], strict=True)
    return ref, native.eval()


def test_padding_rows_change_nothing():
    """The padded batch's soft tokens are each image's alone, concatenated: padding is dropped
    natively, masked and zeroed by transformers."""
    from mmparity.models.gemma4_vision.cases import cases

    fam = families.get(FAMILY)
    cfg = fam.tiny_config()
    ref, native = _native_with_seeded_weights(cfg)
    case = cases(cfg, seed=1)[0]
    assert (~case.data["valid"]).any(), "the padded case pads"
    with torch.no_grad():
        whole = native(case.data["pixel_values"], case.data["positions"])
        alone = []
        for b in range(len(case.data["sizes"])):
            n = int(case.data["valid"][b].sum())
            alone.append(native(case.data["pixel_values"][b:b + 1, :n], case.data["positions"][b:b + 1, :n]))
        theirs = ref(pixel_values=case.data["pixel_values"], pixel_position_ids=case.data["positions"])
    assert torch.allclose(whole, torch.cat(alone), rtol=1e-5, atol=1e-5)
    assert torch.allclose(whole, theirs.last_hidden_state, rtol=1e-4, atol=1e-4)


def test_seeded_clamp_bounds_cut_values():
    """At the seeded bounds the clamps change transformers' output (so parity checks them)."""
    from mmparity.models.gemma4_vision.cases import cases

    fam = families.get(FAMILY)
    cfg = fam.tiny_config()
    ref = fam.build_reference(cfg)
    seeded = random_like_state(ref.state_dict(), seed=4)
    assert all(v < 0 for k, v in seeded.items() if k.endswith("_min"))
    assert all(v > 0 for k, v in seeded.items() if k.endswith("_max"))
    case = cases(cfg, seed=1)[1]
    outputs = []
    for bounded in (True, False):
        state = dict(seeded)
        if not bounded:
            state = {k: (v.sign() * torch.inf if k.endswith(("_min", "_max")) else v) for k, v in state.items()}
        ref.load_state_dict(state)
        with torch.no_grad():
            outputs.append(ref(pixel_values=case.data["pixel_values"], pixel_position_ids=case.data["positions"])
                           .last_hidden_state)
    assert not torch.allclose(*outputs, atol=1e-3)


def test_image_sizes_off_the_pooling_grid_or_table_are_refused():
    fam = families.get(FAMILY)
    cfg = fam.tiny_config()
    problems = fam.hooks.config.image_size_problems
    assert problems(cfg, [(24, 36)]) == []
    assert problems(cfg, [(24, 40)])
    assert problems(cfg, [(24, 12 * 10)])


@pytest.mark.slow
@pytest.mark.parametrize("layout, fmt", [((2, 2), "legacy"), ((2, 2), "torch_dist"), ((4, 1), "legacy")])
def test_convert_verify_check_and_back_with_base_is_bit_exact(saved_tower, tmp_path, layout, fmt):
    """TP 2 x PP 2 in both formats, and TP 4 (one head and one key/value head per rank, each rank's
    clamp bounds whole)."""
    tp, pp = layout
    assert_round_trip(saved_tower, tmp_path, "--tp", tp, "--pp", pp, fmt=fmt)


def test_the_tower_of_a_whole_gemma4_checkpoint_converts_and_checks(tmp_path, capsys):
    """A whole ``Gemma4ForConditionalGeneration`` saved by transformers: its ``model.vision_tower.*``
    converts (the language model and ``embed_vision`` left out by name) and checks. Detection gives
    the whole to the ``gemma4`` family (per-layer inputs included); the tower is this family's on
    request."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, hidden_size_per_layer_input=8, vocab_size_per_layer_input=64,
                layer_types=["sliding_attention", "full_attention"])
    cfg = Gemma4Config(text_config=text, vision_config=families.get(FAMILY).tiny_config().to_dict(), audio_config=None)
    model = Gemma4ForConditionalGeneration(cfg)
    model.load_state_dict(random_like_state(model.state_dict(), seed=3))
    model.save_pretrained(tmp_path / "hf")
    assert run_cli("convert", "--src", tmp_path / "hf", "--dst", tmp_path / "whole", "--to", "mcore",
                   "--format", "legacy") == 0
    said = capsys.readouterr()
    assert "family: gemma4 " in said.out + said.err
    assert run_cli("convert", "--family", FAMILY, "--src", tmp_path / "hf", "--dst", tmp_path / "mcore", "--to",
                   "mcore", "--format", "legacy") == 0
    said = capsys.readouterr()
    assert "model.language_model" in said.out + said.err and "model.embed_vision" in said.out + said.err
    assert run_cli("check", FAMILY, "--hf", tmp_path / "hf", "--mcore", tmp_path / "mcore") == 0


def test_unpooled_towers_are_refused_transformers_keeps_their_padding():
    """The upstream fault (docs/families.md): with ``pooling_kernel_size`` 1 transformers 5.24's
    pooler hands back its padding mask as the mask of rows to keep, so the tower returns the
    padding rows and drops the patches (none at all for a batch without padding). ``check``
    refuses such a config by name."""
    import transformers
    from transformers import Gemma4VisionConfig, Gemma4VisionModel

    from mmparity.models.gemma4_vision.cases import processor_batch

    cfg = Gemma4VisionConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=2, head_dim=4, patch_size=2, pooling_kernel_size=1,
                             position_embedding_size=8)
    assert families.get(FAMILY).hooks.config.problems(cfg)
    assert families.get(FAMILY).hooks.config.problems(families.get(FAMILY).tiny_config()) == []
    if not transformers.__version__.startswith("5.24"):
        pytest.skip(f"pinned on transformers 5.24 (installed: {transformers.__version__})")
    model = Gemma4VisionModel(cfg).eval()
    values, positions = processor_batch([torch.rand(3, 4, 6), torch.rand(3, 2, 4)], 2, 1)
    with torch.no_grad():
        out = model(pixel_values=values, pixel_position_ids=positions).last_hidden_state
    assert out.shape[0] == int((positions == -1).all(-1).sum()) == 4  # the padding rows, not the 8 patches
