"""Qwen3.5 / Qwen3.5-MoE whole (family qwen3_5_whole): ``check --hf`` without ``--family`` on what
transformers' own ``save_pretrained`` writes, for both model types; M-RoPE positions and angles
against transformers' own; negative controls located by part; ``convert`` -> ``verify`` ->
``convert --to hf --base`` bit-exact in both formats at TP 2 x PP 2 (x EP 2 for MoE); TP 4 refused
in one line; a release's multi-token-prediction layers left out and listed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

# The part's native DeltaNet needs megatron-core 0.16 or fla (qwen3_5_lm.cases says why).
from mmparity.models.qwen3_5_lm.cases import _build_problems  # noqa: E402

pytestmark = pytest.mark.skipif(bool(_build_problems()), reason=" ".join(_build_problems()))

from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict  # noqa: E402
from mmparity.models import registry  # noqa: E402
from mmparity.models.core.inputs import random_like_state  # noqa: E402
from mmparity.models.qwen3_5_whole import cases as whole_cases  # noqa: E402
from mmparity.models.qwen3_5_whole import native as whole_native  # noqa: E402
from mmparity.models.qwen3_5_whole import reference as whole_reference  # noqa: E402
from mmparity.models.qwen3_vl_whole.native import mrope_position_ids  # noqa: E402
from mmparity.parity import harness  # noqa: E402
from tests.faults.test_faults import one_line_error, run_cli  # noqa: E402

FAMILY = "qwen3_5_whole"
KINDS = ("dense", "moe")


def fam():
    return registry.get(FAMILY)


def _model(kind: str, seed: int):
    """Seeded weights at trained scale (``random_like_state``), where the decoder's norms scale by
    ``1 + weight`` in HF: those get small weights (an effective scale of 1 ± 0.2, not 2 ± 0.2,
    which would leave fp32 parity to the conditioning of a random network); the DeltaNet output
    norm scales by ``weight`` and keeps 1 ± 0.2."""
    cfg = whole_reference.tiny_config(moe=kind == "moe")
    model = fam().build_reference(cfg)
    state = random_like_state(model.state_dict(), seed=seed)
    for key, value in state.items():
        if key.startswith("model.language_model.") and key.endswith("norm.weight") and ".linear_attn." not in key:
            state[key] = value - 1
    model.load_state_dict(state)
    return cfg, model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("qwen3_5_whole")
    out = {}
    for seed, kind in enumerate(KINDS):
        _, model = _model(kind, seed=40 + seed)
        model.save_pretrained(root / kind)
        out[kind] = root / kind
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_check_without_family_passes_on_save_pretrained_output(capsys, saved, kind):
    code, out, err = run_cli(capsys, "check", "--hf", saved[kind])
    assert code == 0, out + err
    assert "family: qwen3_5_whole" in out + err
    assert "sample:logits" in out and "sample:token_loss" in out
    if kind == "moe":
        assert "sample:router" in out and "0 to other experts" in out


@pytest.mark.parametrize("arch, model_type, vision", [
    ("Qwen3_5ForConditionalGeneration", "qwen3_5", "qwen3_5_vision"),
    ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", "qwen3_5_moe_vision")])
def test_both_model_types_are_taken_whole_and_the_tower_family_still_takes_part(arch, model_type, vision):
    from mmparity.models.registry import ConfigFacts

    facts = ConfigFacts("config.json", (arch,), model_type, vision)
    detection = registry.detect(facts)
    assert (detection.family, detection.whole) == (FAMILY, True)
    assert registry.whole_takers(facts) == [FAMILY]
    if model_type == "qwen3_5_moe":
        assert registry.get("qwen3_5").takes(facts)[0] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_within_policy(kind):
    cfg, model = _model(kind, seed=7)
    report = harness.check(fam(), cfg, model.state_dict(), dtype="bfloat16", seed=1)
    assert report.passed, [(r.check, r.metrics, r.tolerance) for r in report.failures()]


def test_the_cases_hold_several_images_of_different_sizes_and_name_the_delta_rule():
    cfg = fam().tiny_config()
    case = whole_cases.cases(cfg, seed=3)[0]
    assert len(set(case.data["sizes"])) == len(case.data["sizes"]) >= 3
    assert "gated delta rule: torch-chunked" in case.description


def test_position_ids_are_transformers_get_rope_index():
    cfg, model = _model("dense", seed=1)
    case = whole_cases.cases(cfg, seed=4)[0]
    ids = case.data["input_ids"]
    p = case.data["patch"]
    grids = [(h // p, w // p) for h, w in case.data["sizes"]]
    expected, _ = model.model.get_rope_index(ids, (ids == cfg.image_token_id).int(),
                                             image_grid_thw=torch.tensor([[1, h, w] for h, w in grids]))
    got = mrope_position_ids(ids, cfg.image_token_id, grids, case.data["merge"])
    assert torch.equal(got, expected)
    assert not torch.equal(got[1], got[2]) and got[0, 1, -1] < ids.shape[1] - 1


@pytest.mark.parametrize("section", [[2, 1, 1], [1, 2, 1], [2, 0, 2]])
def test_partial_interleaved_mrope_angles_are_transformers(section):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": section}
    text = whole_reference.tiny_config(moe=False, rope_parameters=rope).text_config
    gen = torch.Generator().manual_seed(sum(section) + section[0])
    positions = torch.randint(0, 50, (3, 2, 7), generator=gen)
    cos, sin = Qwen3_5TextRotaryEmbedding(text)(torch.zeros(1, dtype=torch.float32), positions)
    model = torch.nn.Module()
    whole_native.use_mrope(model, text)
    angles = model.rotary_pos_emb(positions, model.mrope_section)[:, :, 0].transpose(0, 1)  # [b, s, d]
    assert angles.shape[-1] == whole_native.rotary_dim(text) == 8
    assert torch.allclose(angles.cos(), cos, atol=1e-6) and torch.allclose(angles.sin(), sin, atol=1e-6)


def _perturb(key, by=0.5):
    def mutate(state):
        state[key] = state[key] + by
    return mutate


def _swap_experts(state):
    at = "language_model.decoder.layers.2.mlp.experts."
    for fc in ("linear_fc1.weight", "linear_fc2.weight"):
        state[f"{at}{fc}0"], state[f"{at}{fc}1"] = state[f"{at}{fc}1"], state[f"{at}{fc}0"]


@pytest.mark.parametrize("kind, mutate, module", [
    ("dense", _perturb("language_model.decoder.layers.1.self_attention.A_log"),
     "language_model.decoder.layers.1.self_attention"),
    ("moe", _swap_experts, "language_model.decoder.layers.2.mlp"),
    ("dense", _perturb("vision_model.merger.linear_fc2.weight", 0.05), "vision_model.merger.linear_fc2"),
])
def test_negative_controls_fail_and_name_the_part(kind, mutate, module):
    cfg, model = _model(kind, seed=11)
    report = harness.check(fam(), cfg, model.state_dict(), mutate_native=mutate, seed=2)
    failures = report.failures()
    assert failures
    assert {r.first_divergence.module for r in failures if r.first_divergence is not None} and all(
        r.first_divergence.module.startswith(module) for r in failures if r.first_divergence is not None)
    logits = next(r for r in report.results if r.check.endswith("logits"))
    assert not logits.passed and logits.first_divergence.module.startswith(module)


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("kind", KINDS)
def test_convert_verify_and_back_are_bit_exact(capsys, tmp_path, saved, kind, fmt):
    src = saved[kind]
    mcore = tmp_path / "mcore"
    grid = ["--tp", "2", "--pp", "2"] + (["--ep", "2"] if kind == "moe" else [])
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", mcore, "--to", "mcore", "--format", fmt, *grid)
    assert code == 0, err
    assert "family: qwen3_5_whole" in out + err and "left out" not in out + err
    code, out, err = run_cli(capsys, "verify", mcore)
    assert code == 0, out + err
    back = tmp_path / "back"
    code, out, err = run_cli(capsys, "convert", "--src", mcore, "--dst", back, "--to", "hf", "--base", src)
    assert code == 0, err
    expected, got = load_safetensors_state_dict(src), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    assert any(k.startswith("model.visual.") for k in got) and any(k.startswith("model.language_model.") for k in got)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_tp_not_dividing_the_delta_net_key_heads_is_one_line(capsys, tmp_path, saved):
    code, out, err = run_cli(capsys, "convert", "--src", saved["dense"], "--dst", tmp_path / "x", "--to", "mcore",
                             "--format", "legacy", "--tp", "4")
    one_line_error(code, out, err, "linear_num_key_heads=2")
    assert not (tmp_path / "x").exists()


def test_multi_token_prediction_layers_are_left_out_with_counts_and_bytes(capsys, tmp_path, saved):
    """A release that stores an MTP layer beside the model (as Qwen3.5's do, ``mtp.*``): the
    conversion says how many tensors and bytes it left out, and converts the rest exactly."""
    from mmparity.cli.common import human_bytes
    from mmparity.io.fsio.safetensors_write import save_safetensors_checkpoint

    src = saved["moe"]
    state = load_safetensors_state_dict(src)
    gen = torch.Generator().manual_seed(9)
    mtp = {"mtp.fc.weight": torch.randn(48, 96, generator=gen), "mtp.norm.weight": torch.randn(48, generator=gen),
           "mtp.layers.0.input_layernorm.weight": torch.randn(48, generator=gen)}
    release = tmp_path / "release"
    save_safetensors_checkpoint(release, {**state, **mtp},
                                extra_files={"config.json": (src / "config.json").read_text()})
    code, out, err = run_cli(capsys, "convert", "--src", release, "--dst", tmp_path / "mcore", "--to", "mcore",
                             "--format", "legacy", "--ep", "2")
    assert code == 0, err
    size = sum(t.numel() * t.element_size() for t in mtp.values())
    line = next(line for line in (out + err).splitlines() if "left out" in line)
    assert f"left out {len(mtp)} of {len(state) + len(mtp)} source tensors" in line, line
    assert f"mtp ({len(mtp)} tensors, {human_bytes(size)})" in line, line
    code, out, err = run_cli(capsys, "convert", "--src", tmp_path / "mcore", "--dst", tmp_path / "back", "--to",
                             "hf", "--base", src)
    assert code == 0, err
    back = load_safetensors_state_dict(tmp_path / "back")
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)
