"""Whole Gemma 3: a tiny model saved by transformers is told and passes ``check --hf`` in fp32 and
bf16; perturbed weights are named by part; the pieces that are Gemma 3's own (the mask that lets an
image's tokens see each other under a sliding window, the per-type RoPE, the sandwich norms'
places, the projector's transposed matrix) are pinned against transformers; what transformers'
whole class does not compute (soft-caps) is refused by name; the tied head goes over pipeline
stages as Megatron's does (the last stage's own copy of the table)."""

from __future__ import annotations

import pytest
import torch

from mmparity.models import registry as families
from mmparity.parity import harness
from tests.models.test_internvl import _bump, _run, _saved


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration with seeded weights, as save_pretrained writes it."""
    return _saved(tmp_path_factory, "gemma3")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_without_family_tells_the_family_and_passes(saved, capsys, dtype):
    assert _run("check", "--hf", saved, "--dtype", dtype) == 0
    said = capsys.readouterr()
    assert "family: gemma3 " in said.out + said.err


@pytest.mark.parametrize("mutate, module", [
    (_bump("vision_model.decoder.layers.1.self_attention.linear_qkv.weight", (7, 3)),
     "vision_model.layer.1.self_attention"),
    (_bump("vision_projection.encoder.layer_norm_weight", (11,)), "vision_projection"),
    (_bump("vision_projection.encoder.weight", (2, 5)), "vision_projection"),
    (_bump("language_model.decoder.layers.0.self_attention.k_layernorm.weight", (3,)),
     "language_model.decoder.layers.0.self_attention"),
    # The sandwich norms are their sub-layer's output, as the post-norms are HF's pairs.
    (_bump("language_model.decoder.layers.1.self_attention.linear_proj.post_layernorm.weight", (4,)),
     "language_model.decoder.layers.1.self_attention"),
    (_bump("language_model.decoder.layers.2.mlp.linear_fc1.layer_norm_weight", (6,)),
     "language_model.decoder.layers.2.pre_mlp_layernorm"),
    (_bump("language_model.decoder.layers.2.mlp.linear_fc2.post_layernorm.weight", (1,)),
     "language_model.decoder.layers.2.mlp"),
    (_bump("language_model.decoder.final_layernorm.weight", (9,)), "language_model.decoder.final_layernorm"),
])
def test_negative_controls_fail_and_name_the_part(mutate, module):
    report = harness.check("gemma3", seed=2, mutate_native=mutate)
    failures = report.failures()
    assert failures and {r.first_divergence.module for r in failures} == {module}


def test_mask_matches_transformers_image_blocks_under_the_window():
    """Full layers: OR(causal, same image); sliding layers: that, with keys no further back than
    the window. An image's first token sees its last; two images do not see each other's later
    tokens; the window cuts text off but never an image's later tokens."""
    from mmparity.models.gemma3.native import attention_mask, image_blocks

    ids = torch.tensor([[1, 9, 9, 9, 2, 9, 9, 3, 4, 5]])
    assert image_blocks(ids, 9).tolist() == [[-1, 0, 0, 0, -1, 1, 1, -1, -1, -1]]
    allowed = ~attention_mask(ids, 9)[0, 0]
    assert allowed[1, 3] and allowed[5, 6] and not allowed[3, 5] and not allowed[0, 1] and allowed[9, 0]
    # transformers' own mask functions, on the same ids.
    from transformers.masking_utils import blockwise_overlay, causal_mask_function, sliding_window_overlay
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    blocks = get_block_sequence_ids_for_mask((ids == 9).long())
    assert torch.equal(blocks, image_blocks(ids, 9))
    block = blockwise_overlay(blocks)
    window = sliding_window_overlay(3)
    s = ids.shape[1]
    for q in range(s):
        for k in range(s):
            full = bool(causal_mask_function(0, 0, q, k)) or bool(block(0, 0, q, k))
            assert bool(allowed[q, k]) == full
            # the core attention's sliding cut: keys at or before q - window are out
            assert (full and bool(window(0, 0, q, k))) == (full and k > q - 3)


def test_projector_matrix_is_transposed_exactly_and_back():
    from mmparity.mapping.ops import Transpose

    w = torch.randn(48, 40)
    (linear,) = Transpose().apply([w])
    assert linear.shape == (40, 48) and torch.equal(linear, w.t())
    (back,) = Transpose().invert([linear])
    assert torch.equal(back, w) and back.data_ptr() != linear.data_ptr()


def test_sliding_and_full_layers_rotate_with_their_own_bases():
    from mmparity.models.gemma3.config import layer_rope

    text = families.get("gemma3").tiny_config().text_config
    assert layer_rope(text, "sliding_attention") == (100.0, 1.0)
    assert layer_rope(text, "full_attention") == (3000.0, 2.0)


@pytest.mark.parametrize("field", ["final_logit_softcapping", "attn_logit_softcapping"])
def test_soft_caps_transformers_does_not_apply_are_refused(field):
    from mmparity.models.gemma3 import reference

    fam = families.get("gemma3")
    cfg = reference.tiny_config(**{field: 30.0})
    problems = fam.hooks.config.problems(cfg)
    assert any(field in p and "does not apply" in p for p in problems), problems


def test_the_tied_head_does_not_keep_check_off_pipeline_stages():
    # The last stage is handed its own copy of the table (tests/parallel/test_check_pp.py runs it).
    fam = families.get("gemma3")
    assert fam.hooks.config.pipeline_problems(fam.tiny_config(), 2) == []


def test_legacy_tp2_pp2_holds_megatron_bridge_names(saved, tmp_path):
    mcore = tmp_path / "mcore"
    assert _run("convert", "--src", saved, "--dst", mcore, "--to", "mcore", "--tp", 2, "--pp", 2,
                "--format", "legacy", "--quiet") == 0
    stage0 = torch.load(mcore / "iter_0000001" / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False)["model"]
    layer = "language_model.decoder.layers.0."
    for key in ("self_attention.linear_qkv.layer_norm_weight", "self_attention.q_layernorm.weight",
                "self_attention.linear_proj.post_layernorm.weight", "mlp.linear_fc1.layer_norm_weight",
                "mlp.linear_fc2.post_layernorm.weight"):
        assert layer + key in stage0, key
    cfg = families.get("gemma3").tiny_config()
    # The projector's linear holds half the text width per TP rank, (text / 2, vision).
    assert stage0["vision_projection.encoder.weight"].shape == (cfg.text_config.hidden_size // 2,
                                                                cfg.vision_config.hidden_size)
