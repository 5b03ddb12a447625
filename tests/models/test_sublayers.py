"""Every family pairs its layers at sub-layer depth (norms, attention, MLP; an MoE layer's router
and experts), and a fault is named by the deepest module that holds it: a layer's sub-modules come
before the layer, in the order its forward runs them, so when a layer and its MLP both diverge the
MLP is the first divergence."""

from __future__ import annotations

import re

import pytest
import torch

from mmparity.models.core.sublayers import SUBLAYERS
from mmparity.parity import harness

LAYER = re.compile(r"(^|\.)layers?\.\d+$")


def _perturbed(key: str, seed: int):
    """Seeded noise on every element of one native tensor (its shape and sign pattern awkward)."""
    def mutate(state):
        noise = torch.randn(state[key].shape, generator=torch.Generator().manual_seed(seed))
        state[key] = state[key] + 0.05 * noise.to(state[key].dtype)
    return mutate


@pytest.mark.parametrize("family, key, module", [
    # The acceptance case: one MLP weight of a Mistral3 decoder layer.
    ("mistral3", "language_model.decoder.layers.1.mlp.linear_fc2.weight", "language_model.decoder.layers.1.mlp"),
    ("mistral3", "language_model.decoder.layers.0.self_attention.linear_qkv.weight",
     "language_model.decoder.layers.0.self_attention"),
    ("mistral3", "vision_model.decoder.layers.0.mlp.linear_fc1.weight", "vision_model.layer.0.mlp"),
    ("llava", "language_model.decoder.layers.1.self_attention.linear_proj.weight",
     "language_model.decoder.layers.1.self_attention"),
    # A fused norm (the checkpoint keeps it inside the next linear) is paired with HF's own norm.
    ("llava", "language_model.decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
     "language_model.decoder.layers.1.pre_mlp_layernorm"),
    ("clip", "decoder.layers.1.self_attention.linear_qkv.weight", "layer.1.self_attention"),
    ("pixtral", "decoder.layers.0.self_attention.linear_proj.weight", "layer.0.self_attention"),
    ("qwen3_5", "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", "layer.1.input_layernorm"),
])
def test_a_perturbed_weight_is_located_to_its_sub_module(family, key, module):
    report = harness.check(family, seed=4, components=False, mutate_native=_perturbed(key, seed=9))
    failures = report.failures()
    assert failures and {r.first_divergence.module for r in failures} == {module}
    rows = {row["module"]: row for row in failures[0].modules}
    # The layer holding the module diverged too: the sub-module is named because it comes first.
    layer = module.rsplit(".", 1)[0]
    assert not rows[layer]["passed"], rows[layer]
    assert list(rows).index(module) < list(rows).index(layer)
    # Every layer of the run is paired at sub-layer depth, each sub-module before its layer, in
    # the order the layer runs them.
    layers = [name for name in rows if LAYER.search(name)]
    assert layers
    for name in layers:
        subs = [f"{name}.{sub}" for sub in SUBLAYERS]
        assert [n for n in rows if n in subs] == subs, (name, list(rows))
        assert list(rows).index(subs[-1]) < list(rows).index(name)


def test_an_unperturbed_check_compares_every_sub_module_within_tolerance():
    """The paired sub-modules capture tensors that really correspond: all pass on a clean model,
    the residual-stream norms and the MLPs included."""
    report = harness.check("mistral3", seed=4, components=False)
    assert report.passed, [(r.check, r.first_divergence) for r in report.failures()]
    modules = report.results[0].modules
    subs = [row for row in modules if row["module"].rsplit(".", 1)[-1] in SUBLAYERS]
    assert len(subs) == 4 * sum(1 for row in modules if LAYER.search(row["module"]))
    assert all(row["passed"] and row["metrics"]["rel_l2"] <= row["tolerance"] for row in subs)


@pytest.mark.slow
def test_attention_and_mlp_biases_returned_beside_the_output_are_added_at_tp2():
    """Under TP > 1 mcore hands the row-parallel bias back beside the output; CLIP has biases, so a
    sub-module that left it out would fail here."""
    report = harness.check("clip", seed=4, tp=2, components=False)
    assert report.passed, [(r.check, r.first_divergence) for r in report.failures()]
    # A module row that fails does not fail a check whose outputs pass: each is asserted here.
    rows = {row["module"]: row for row in report.results[0].modules}
    assert {"layer.1.self_attention", "layer.1.mlp"} <= set(rows)
    assert all(row["passed"] for row in rows.values()), [r for r in rows.values() if not r["passed"]]
