"""Pixtral specifics: the ViT's grid helpers, packed attention isolation, RoPE table."""

from __future__ import annotations

import pytest
import torch

from mmparity.models import registry as families
from mmparity.models.core.vit import _cat_rope, _dynamic_patch_grid, _dynamic_patch_grid_lists
from mmparity.parity import harness
from mmparity.models.core import inputs
from mmparity.models.core.inputs import random_like_state
from mmparity.parity.metrics import compare


def test_grid_helpers_on_lists_and_tensors():
    sizes = [(16, 40), (24, 8)]
    grids, seqlens = _dynamic_patch_grid_lists(sizes, 8)
    assert grids == [(2, 5), (3, 1)] and seqlens == [10, 3]
    assert _dynamic_patch_grid_lists(torch.tensor(sizes), 8) == (grids, seqlens)
    grid_hw, cu = _dynamic_patch_grid(sizes, 8, torch.device("cpu"))
    assert grid_hw.tolist() == [[2, 5], [3, 1]] and cu.tolist() == [0, 10, 13]
    assert cu.dtype == torch.int32


def test_grid_helpers_refuse_bad_sizes_and_device_tensors():
    with pytest.raises(ValueError, match="multiple of the patch size 8"):
        _dynamic_patch_grid_lists([(16, 12)], 8)

    class PretendCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    fake = torch.tensor([[16, 16]]).as_subclass(PretendCuda)
    with pytest.raises(ValueError, match="synchronise"):
        _dynamic_patch_grid_lists(fake, 8)


def test_cat_rope_concatenates_along_tokens():
    a, b = torch.randn(3, 1, 1, 4), torch.randn(5, 1, 1, 4)
    assert torch.equal(_cat_rope([a, b]), torch.cat([a, b]))
    with pytest.raises(ValueError):
        _cat_rope([])


@pytest.fixture(scope="module")
def loaded_native():
    fam = families.get("pixtral")
    cfg = fam.tiny_config()
    sd = random_like_state(fam.build_reference(cfg).state_dict(), seed=11)
    native = fam.build_native(cfg)
    native.load_state_dict(families.get("pixtral").hf_to_mcore(sd, cfg)[0])
    return cfg, native


@torch.no_grad()
def test_packed_images_attend_only_to_themselves(loaded_native):
    cfg, native = loaded_native
    sizes = [(16, 24), (40, 8), (24, 24)]
    imgs = inputs.images(sizes, 3, seed=4)
    out = native(inputs.packed_rows(imgs, 8), imgs_sizes=sizes)
    changed = list(imgs)
    changed[1] = changed[1] * -2.0 + 1.0
    out2 = native(inputs.packed_rows(changed, 8), imgs_sizes=sizes)
    first, second = 6, 6 + 5
    assert torch.equal(out[0, :first], out2[0, :first])
    assert not torch.allclose(out[0, first:second], out2[0, first:second])
    assert torch.equal(out[0, second:], out2[0, second:])


@torch.no_grad()
def test_packed_equals_static_for_equal_sizes(loaded_native):
    cfg, native = loaded_native
    imgs = inputs.images([(24, 40)] * 3, 3, seed=8)
    static = native(torch.stack(imgs))
    packed = native(inputs.packed_rows(imgs, 8), imgs_sizes=[(24, 40)] * 3)
    # Conv (static) and matmul (packed rows) embeddings round differently; the policy bound applies.
    assert compare(packed.reshape(static.shape), static).rel_l2 <= 1e-6


def test_dynamic_input_shape_errors_are_clear(loaded_native):
    cfg, native = loaded_native
    rows = torch.randn(1, 10, 3 * 8 * 8)
    with pytest.raises(ValueError, match="describe 6 patches but the input has 10"):
        native(rows, imgs_sizes=[(16, 24)])
    with pytest.raises(ValueError, match="width C\\*P\\*P = 192"):
        native(torch.randn(1, 6, 100), imgs_sizes=[(16, 24)])


def test_rope_refuses_grids_beyond_the_configured_table(loaded_native):
    cfg, native = loaded_native
    with pytest.raises(ValueError, match="exceeds max_patches_per_side=8"):
        native.rotary_pos_emb(9, 2, torch.device("cpu"))


def test_rope_angles_match_the_documented_formula(loaded_native):
    cfg, native = loaded_native
    hd = cfg.hidden_size // cfg.num_attention_heads
    freqs = native.rotary_pos_emb(2, 3, torch.device("cpu"))[:, 0, 0]
    f = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    i, j = 1, 2  # patch (row 1, col 2) is token 5
    expected = torch.cat([i * f[0::2], j * f[1::2]]).float().repeat_interleave(2)
    torch.testing.assert_close(freqs[5], expected)


def test_static_and_packed_checks_pass_on_custom_sizes():
    report = harness.check("pixtral", image_sizes=[(8, 56), (32, 16), (48, 40), (8, 8)], seed=9)
    assert report.passed, [(r.check, r.metrics) for r in report.failures()]
    assert {r.check for r in report.results} >= {"packed:last_hidden_state", "static:last_hidden_state",
                                                 "component:rope2d", "component:patch_embed"}


def test_low_precision_policy_uses_the_reference_noise_floor():
    report = harness.check("pixtral", dtype="bfloat16", seed=1)
    assert report.passed, [(r.check, r.metrics, r.tolerance) for r in report.failures()]
    packed = next(r for r in report.results if r.check.startswith("packed"))
    assert "bfloat16" in packed.tolerance["basis"] and packed.tolerance["rel_l2"] > 1e-4
