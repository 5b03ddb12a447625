"""Native models across spawned tensor-parallel ranks (gloo on CPU) against the HF reference."""

from __future__ import annotations

import pytest

from mmparity import families
from mmparity.parity import harness


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
    assert {r.first_divergence.module for r in report.failures()} == {"layer.1"}
