"""The bytes a conversion writes, pinned: the same source gives the same files, file for file.

A few tiny releases (seeded) are converted to legacy and torch_dist at TP/PP/EP grids and back to
HF; the SHA-256 of every file written (the manifest aside: it records paths and times) must be
the one pinned here. A refactoring of the pipeline, the formats or the rule tables that changes
one byte of output fails this test, which names the file; a change meant to alter the output
updates the pins in the same commit, saying why.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from mmparity.cli.main import main
from tests.mapping.test_convert_roundtrips import save_hf

JOBS = {"kimi_k25_vl": ["--tp", "2", "--ep", "2"], "mistral3": ["--tp", "2", "--pp", "2"], "llava": ["--tp", "2"]}
SEED = 21


def digest(directory: Path) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()[:16]
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "mmparity.json"}


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", sorted(JOBS))
def test_the_bytes_written_are_the_pinned_ones(tmp_path, family, fmt):
    hf = save_hf(family, tmp_path / family, seed=SEED)
    mcore, back = tmp_path / "mcore", tmp_path / "hf"
    assert main(["convert", "--quiet", "--src", str(hf), "--dst", str(mcore), "--to", "mcore", "--format", fmt,
                 *JOBS[family]]) == 0
    assert main(["convert", "--quiet", "--src", str(mcore), "--dst", str(back), "--to", "hf"]) == 0
    for got, key in ((digest(mcore), f"{family} {fmt}"), (digest(back), f"{family} {fmt} hf")):
        want = PINNED[key]
        assert sorted(got) == sorted(want), key
        changed = [name for name in want if got[name] != want[name]]
        assert not changed, f"{key}: other bytes in {changed}"


PINNED = {
    'kimi_k25_vl legacy': {
        'hf_config.json': 'c111b6c7bc24a2e6',
        'iter_0000001/mp_rank_00_000/model_optim_rng.pt': '241c04bc7ece12a5',
        'iter_0000001/mp_rank_00_001/model_optim_rng.pt': '782c4ae6b80c6d58',
        'iter_0000001/mp_rank_01_000/model_optim_rng.pt': '5d20d78034e916ba',
        'iter_0000001/mp_rank_01_001/model_optim_rng.pt': 'cc5ce6f922348fa4',
        'latest_checkpointed_iteration.txt': '4355a46b19d348dc',
    },
    'kimi_k25_vl legacy hf': {
        'config.json': 'c111b6c7bc24a2e6',
        'model.safetensors': 'c8a8c8a2368efa2e',
    },
    'kimi_k25_vl torch_dist': {
        'hf_config.json': 'c111b6c7bc24a2e6',
        'iter_0000001/.metadata': 'c8fe977d35eac72a',
        'iter_0000001/__0_0.distcp': 'b988001a2e9f990d',
        'iter_0000001/common.pt': 'ae1e4670d7244d26',
        'iter_0000001/metadata.json': '9817072de14c715c',
        'latest_checkpointed_iteration.txt': '4355a46b19d348dc',
    },
    'kimi_k25_vl torch_dist hf': {
        'config.json': 'c111b6c7bc24a2e6',
        'model.safetensors': 'c8a8c8a2368efa2e',
    },
    'llava legacy': {
        'hf_config.json': 'ce918112d79c72ee',
        'iter_0000001/mp_rank_00/model_optim_rng.pt': '418080aea76c78fc',
        'iter_0000001/mp_rank_01/model_optim_rng.pt': '025b06f14a53ad83',
        'latest_checkpointed_iteration.txt': '4355a46b19d348dc',
        'mcore_side.safetensors': 'ca0b4c2df49b5dc4',
    },
    'llava legacy hf': {
        'config.json': 'ce918112d79c72ee',
        'model.safetensors': 'c6859f3979c76e27',
    },
    'llava torch_dist': {
        'hf_config.json': 'ce918112d79c72ee',
        'iter_0000001/.metadata': '41ea622dfb279a38',
        'iter_0000001/__0_0.distcp': '018be21351284cfd',
        'iter_0000001/common.pt': 'e372c0a48f0f96fc',
        'iter_0000001/metadata.json': '9817072de14c715c',
        'latest_checkpointed_iteration.txt': '4355a46b19d348dc',
        'mcore_side.safetensors': 'ca0b4c2df49b5dc4',
    },
    'llava torch_dist hf': {
        'config.json': 'ce918112d79c72ee',
        'model.safetensors': 'c6859f3979c76e27',
    },
    'mistral3 legacy': {
        'hf_config.json': '069c9def228b7a71',
        'iter_0000001/mp_rank_00_000/model_optim_rng.pt': '84a20d4d8cf4aa00',
        'iter_0000001/mp_rank_00_001/model_optim_rng.pt': 'cdc59152094b227c',
        'iter_0000001/mp_rank_01_000/model_optim_rng.pt': 'cd86b2a1b76bac58',
        'iter_0000001/mp_rank_01_001/model_optim_rng.pt': 'da6c84494a81e6e7',
        'latest_checkpointed_iteration.txt': '4355a46b19d348dc',
    },
    'mistral3 legacy hf': {
        'config.json': '069c9def228b7a71',
        'model.safetensors': 'fae33c3fb0a964e9',
    },
    'mistral3 torch_dist': {
        'hf_config.json': '069c9def228b7a71',
        'iter_0000001/.metadata': '04c14299171fb8e9',
        'iter_0000001/__0_0.distcp': '9510e2d65b577b90',
        'iter_0000001/common.pt': 'e7e03494569ba807',
        'iter_0000001/metadata.json': '9817072de14c715c',
        'latest_checkpointed_iteration.txt': '4355a46b19d348dc',
    },
    'mistral3 torch_dist hf': {
        'config.json': '069c9def228b7a71',
        'model.safetensors': 'fae33c3fb0a964e9',
    },
}
