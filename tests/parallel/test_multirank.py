"""Native models across spawned tensor-parallel ranks (gloo on CPU) against the HF reference."""

from __future__ import annotations

import pytest

from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.models import registry as families
from mmparity.config import padded_vocab_size
from mmparity.parity import harness

pytestmark = pytest.mark.slow  # spawns TP/PP ranks


@pytest.mark.parametrize("family", families.names())
def test_check_tp2_passes_for_every_family(family):
    report = harness.check(family, tp=2, seed=4, components=False)
    assert report.tp == 2
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]


def test_tp_negative_control_is_located_across_ranks():
    def perturb(state):
        key = "decoder.layers.1.mlp.linear_fc2.weight"
        state[key] = state[key].clone()
        state[key][0, 0] += 0.5

    report = harness.check("pixtral", tp=2, seed=4, components=False, mutate_native=perturb)
    assert not report.passed
    assert {r.first_divergence.module for r in report.failures()} == {"layer.1.mlp"}


def _sharded_global_shapes(rank: int, world_size: int, names: list) -> dict:
    """{family: {checkpoint key: (global shape, allow_shape_mismatch)}} as the native models
    declare them at this TP."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from mmparity.parallel import runtime

    runtime.init_parallel(world_size, 1)
    out = {}
    for name in names:
        fam = families.get(name)
        model = fam.build_native(fam.tiny_config())
        out[name] = {sh.key: (tuple(sh.global_shape), sh.allow_shape_mismatch)
                     for sh in nested_values(model.sharded_state_dict()) if isinstance(sh, ShardedTensor)}
    return out


def test_sharded_state_dicts_declare_the_same_global_shapes_at_every_tp():
    """torch_dist stores global tensors: a model whose TP=2 declaration differs cannot reload.
    The one exception is Megatron-LM's own: a vocabulary padded to a multiple of 128 x TP, declared
    with ``allow_shape_mismatch`` so that mcore's loader re-pads it (the embedding and output layer
    of every whole VLM)."""
    from mmparity.parallel import runtime

    names = families.names()
    at_tp2 = runtime.spawn(_sharded_global_shapes, 2, names)[0]
    at_tp1 = _sharded_global_shapes(0, 1, names)
    # A whole VLM's language model sits under ``language_model.``; a language model alone is
    # GPTModel's keys at the root.
    vocab_names = {f"{root}{key}" for root in ("language_model.", "")
                   for key in ("embedding.word_embeddings.weight", "output_layer.weight")}
    for name in names:
        mismatched = {k: (at_tp1[name].get(k), v) for k, v in at_tp2[name].items() if at_tp1[name].get(k) != v}
        repadded = {k for k, (one, two) in mismatched.items()
                    if one is not None and one[1] and two[1] and one[0][1:] == two[0][1:]}
        # Every whole VLM has a language model, so a padded vocabulary: re-padded where TP 2's
        # multiple of 256 differs from TP 1's of 128 (101 -> 128 / 256; 131 -> 256 either way).
        family = families.get(name)
        vocab = vocab_names & set(at_tp1[name])
        whole = bool(vocab)  # the model holds a language model's vocabulary
        cfg = family.tiny_config()
        words = getattr(cfg, "text_config", cfg).vocab_size if whole else 0  # a language model alone is its own
        repads = whole and padded_vocab_size(words, VOCAB_MULTIPLE, tp=1) != padded_vocab_size(words, VOCAB_MULTIPLE, tp=2)
        assert repadded == (vocab if repads else set()), (name, mismatched)
        assert set(mismatched) == repadded, (name, mismatched)
