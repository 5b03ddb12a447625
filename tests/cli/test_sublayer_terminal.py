"""Acceptance: one MLP weight of a tiny Mistral3's decoder layer perturbed; ``check`` fails, names
that layer's MLP (not the layer) as the first divergence, and an 80-column terminal shows the name
whole. The real CLI runs in a pseudo-terminal, as a user's shell runs it."""

from __future__ import annotations

import json

from tests.cli.terminal import perturbed_mistral3, run_in_pty, widest

LAYER = 0
HF_KEY = f"language_model.model.layers.{LAYER}.mlp.up_proj.weight"
MODULE = f"language_model.decoder.layers.{LAYER}.mlp"


def test_a_perturbed_mlp_weight_is_named_by_its_mlp_whole_at_80_columns(tmp_path):
    # The reference reads a copy of the HF checkpoint with the MLP's up projection perturbed; the
    # native model reads the untouched conversion.
    mcore, perturbed = perturbed_mistral3(tmp_path, HF_KEY, seed=5, noise_seed=11)

    report_path = tmp_path / "report.json"
    code, shown = run_in_pty("check", "mistral3", "--mcore", mcore, "--hf", perturbed, "--no-components",
                             "--json", report_path, columns=80)
    assert code == 1, shown
    report = json.loads(report_path.read_text())
    failing = [r for r in report["results"] if not r["passed"]]
    assert failing and {r["first_divergence"]["module"] for r in failing} == {MODULE}, failing
    rows = {row["module"]: row for row in failing[0]["modules"]}
    # The attention before it agrees; the MLP and the layer that holds it do not.
    assert rows[f"language_model.decoder.layers.{LAYER}.self_attention"]["passed"]
    assert not rows[MODULE]["passed"] and not rows[f"language_model.decoder.layers.{LAYER}"]["passed"]
    # The terminal shows the name whole, on one line, and nothing wider than the terminal.
    assert "…" not in shown and widest(shown) <= 80, shown
    assert any(MODULE in line and f"{MODULE}." not in line for line in shown.splitlines()), shown
