"""What a family's own tests run on a tiny model saved by transformers: the CLI round trip
(``convert --to mcore`` at some layout and format, ``verify``, ``check --hf --mcore``, ``convert
--to hf --base`` back, every tensor compared bit for bit: ``torch.equal``, dtype and keys too), and
the perturbed weights of its negative controls."""

from __future__ import annotations

import torch

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state


def run_cli(*argv) -> int:
    from mmparity.cli.main import main

    return main([str(a) for a in argv])


def save_tiny(tmp_path_factory, family: str, shard: str, seed: int = 3):
    """A tiny model of ``family`` with seeded weights, as save_pretrained writes it (sharded)."""
    path = tmp_path_factory.mktemp(family) / "hf"
    fam = families.get(family)
    model = fam.build_reference(fam.tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=seed))
    model.save_pretrained(path, max_shard_size=shard)
    return path


def assert_round_trip(saved, tmp_path, *layout, fmt: str = "legacy", check: bool = True) -> None:
    """``saved`` converted at ``layout`` (``"--tp", 2, "--pp", 2`` …) in ``fmt``, verified, checked
    against transformers (``check``: where the family's check takes that layout), and converted back
    with ``--base``: the same tensors to the bit."""
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert run_cli("convert", "--src", saved, "--dst", mcore, "--to", "mcore", *layout, "--format", fmt,
                   "--quiet") == 0
    assert run_cli("verify", mcore) == 0
    assert not check or run_cli("check", "--hf", saved, "--mcore", mcore) == 0
    assert run_cli("convert", "--src", mcore, "--dst", back, "--to", "hf", "--base", saved, "--quiet") == 0
    expected, got = load_safetensors_state_dict(saved), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())


def bump(key: str, index: tuple, by: float = 0.5):
    """A ``mutate_native`` for ``harness.check``: ``by`` added to one element (``index``; ``()`` for
    a 0-d tensor) of the converted tensor ``key``."""
    def mutate(state):
        state[key] = state[key].clone()
        state[key][index] += by
    return mutate
