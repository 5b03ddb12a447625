"""The whole Qwen VLMs at tensor parallel 4: Megatron splits attention by whole key/value head
groups (and Qwen3.5's DeltaNet by whole key-head groups), so the built-in tiny configs (two of
each) refuse TP 4 in one line. Here each family is saved by transformers' ``save_pretrained``
with four key/value heads (and sizes TP 4 divides), then ``convert --tp 4`` -> ``verify`` ->
``convert --to hf --base`` is bit-exact in both formats, and the native model split four ways
computes what transformers computes (``check --hf --tp 4``, four ranks)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict  # noqa: E402
from mmparity.models import registry  # noqa: E402
from mmparity.models.core.inputs import random_like_state  # noqa: E402
from mmparity.models.qwen3_5_lm.cases import _build_problems  # noqa: E402
from tests.faults.test_faults import run_cli  # noqa: E402

# family -> text-config sizes TP 4 divides (the rest of the tiny config as it is)
WIDER = {"num_key_value_heads": 4, "linear_num_key_heads": 4, "linear_num_value_heads": 8}
FAMILIES = {
    "qwen3_5_whole": {**WIDER, "moe_intermediate_size": 20, "shared_expert_intermediate_size": 28},
    "qwen3_vl_whole": {"num_key_value_heads": 4},
    "qwen3_vl_moe": {"num_key_value_heads": 4, "moe_intermediate_size": 16},
    "qwen2_5_vl_whole": {"num_key_value_heads": 4},
}
DELTA_NET = pytest.mark.skipif(bool(_build_problems()), reason=" ".join(_build_problems()) or "-")


def _params():
    return [pytest.param(f, marks=DELTA_NET) if f == "qwen3_5_whole" else f for f in FAMILIES]


def _saved(family: str, root, seed: int = 11):
    fam = registry.get(family)
    cfg = fam.tiny_config()
    for key, value in FAMILIES[family].items():
        if hasattr(cfg.text_config, key):
            setattr(cfg.text_config, key, value)
    model = fam.build_reference(cfg)
    state = random_like_state(model.state_dict(), seed=seed)
    if family == "qwen3_5_whole":  # HF's (1 + w) norms at 1 ± 0.2, as the family's own tests seed them
        state = {k: (v - 1 if k.startswith("model.language_model.") and k.endswith("norm.weight")
                     and ".linear_attn." not in k else v) for k, v in state.items()}
    model.load_state_dict(state)
    model.save_pretrained(root)
    return root


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", _params())
def test_tp4_convert_verify_and_back_are_bit_exact(capsys, tmp_path, family, fmt):
    src = _saved(family, tmp_path / "hf")
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", mcore, "--to", "mcore", "--format", fmt,
                             "--tp", "4")
    assert code == 0, err
    assert f"family: {family}" in out + err and "left out" not in out + err
    if fmt == "legacy":  # four rank files, each holding a quarter of a split weight
        ranks = sorted(p.name for p in mcore.glob("iter_*/mp_rank_*"))
        assert ranks == [f"mp_rank_0{r}" for r in range(4)], ranks
    code, out, err = run_cli(capsys, "verify", mcore)
    assert code == 0, out + err
    code, out, err = run_cli(capsys, "convert", "--src", mcore, "--dst", back, "--to", "hf", "--base", src)
    assert code == 0, err
    expected, got = load_safetensors_state_dict(src), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@pytest.mark.slow
@pytest.mark.parametrize("family", _params())
def test_tp4_native_model_computes_what_transformers_computes(capsys, tmp_path, family):
    src = _saved(family, tmp_path / "hf", seed=12)
    code, out, err = run_cli(capsys, "check", "--hf", src, "--tp", "4", "--no-components")
    assert code == 0, out + err
    assert "TP 4" in out and "FAIL" not in out, out
