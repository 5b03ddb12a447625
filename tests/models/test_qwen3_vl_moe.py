"""Qwen3-VL-MoE whole: detection and check on what save_pretrained writes (fp32, bf16, router
agreement per MoE layer), the dense / MoE layer kinds, negative controls located by part, and
conversion round trips over TP, PP and EP in both formats, bit for bit."""

from __future__ import annotations

import pytest
import torch

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state
from mmparity.models.qwen3_vl_moe import config as moe_config
from mmparity.models.qwen3_vl_moe import mapping as moe_mapping
from mmparity.models.qwen3_vl_moe import reference as moe_reference
from mmparity.parity import harness, router

FAMILY = "qwen3_vl_moe"
LAYER = "language_model.decoder.layers.{}"


def fam():
    return families.get(FAMILY)


def _run(*argv) -> int:
    from mmparity.cli.main import main

    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Qwen3VLMoeForConditionalGeneration with seeded weights, as save_pretrained writes it."""
    path = tmp_path_factory.mktemp("qwen3_vl_moe") / "hf"
    model = fam().build_reference(fam().tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=3))
    model.save_pretrained(path, max_shard_size="60KB")
    return path


def _routers(result) -> dict:
    return {m["module"]: m["metrics"]["router"] for m in result.modules if router.is_router(m["module"])}


def test_save_pretrained_writes_the_experts_stacked_as_the_module_holds_them(saved):
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    state = load_safetensors_state_dict(saved)
    text = fam().tiny_config().text_config
    assert state["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (
        text.num_experts, 2 * text.moe_intermediate_size, text.hidden_size)
    assert state["model.language_model.layers.2.mlp.experts.down_proj"].shape == (
        text.num_experts, text.hidden_size, text.moe_intermediate_size)
    assert "model.language_model.layers.1.mlp.gate_proj.weight" in state  # mlp_only_layers=[1]


def test_check_without_family_detects_the_whole_model_and_passes(saved, capsys):
    assert _run("check", "--hf", saved) == 0
    said = capsys.readouterr()
    assert "family: qwen3_vl_moe" in said.out + said.err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_whole_model_parity_and_router_agreement(dtype):
    report = harness.check(FAMILY, dtype=dtype, seed=4)
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
    for result in report.results:
        routers = _routers(result)
        assert set(routers) == {LAYER.format(i) + ".mlp.router" for i in (0, 2)}
        for verdict in routers.values():
            assert verdict["disagreements"] == 0
            if dtype == "float32":
                assert verdict["fraction"] == 1.0
        names = {m["module"] for m in result.modules}
        assert {LAYER.format(2) + s for s in (".self_attention", ".mlp.router", ".mlp.experts")} <= names
        assert LAYER.format(1) + ".mlp" in names and LAYER.format(1) + ".mlp.router" not in names
        # Each pair holds on its own, not only the outputs: a pair that compared the wrong tensor
        # would pass the check and fail here.
        if dtype == "float32":
            assert all(m["passed"] for m in result.modules), [m["module"] for m in result.modules if not m["passed"]]


@pytest.mark.parametrize("only, step, expected", [([1], 1, (0, 2)), ([], 2, (1,)), ([], 1, (0, 1, 2)),
                                                  ([0, 2], 1, (1,))])
def test_moe_layers_are_the_ones_transformers_builds_sparse(only, step, expected):
    cfg = moe_reference.tiny_config(mlp_only_layers=only, decoder_sparse_step=step)
    assert moe_config.moe_layers(cfg.text_config) == expected
    model = fam().build_reference(cfg)
    sparse = tuple(i for i, layer in enumerate(model.model.language_model.layers) if hasattr(layer.mlp, "gate"))
    assert sparse == expected


def test_config_json_read_without_transformers_gives_the_same_layer_kinds(saved):
    import json

    from mmparity.config import config_view

    view = config_view(json.loads((saved / "config.json").read_text()), moe_config.HF_CONFIGS)
    assert view.text_config.num_experts == 8 and moe_config.moe_layers(view.text_config) == (0, 2)


def test_stacked_experts_unstack_to_grouped_names_and_back_bit_exact():
    cfg = fam().tiny_config()
    rules = moe_mapping.rule_set(cfg)
    rule = next(r for r in rules.rules if r.hf == ("model.language_model.layers.0.mlp.experts.gate_up_proj",))
    text = cfg.text_config
    gen = torch.Generator().manual_seed(7)
    stacked = torch.randn(text.num_experts, 2 * text.moe_intermediate_size, text.hidden_size, generator=gen)
    per_expert = rule.op.apply([stacked])
    assert len(per_expert) == text.num_experts == len(rule.mcore)
    assert rule.mcore[3] == LAYER.format(0) + ".mlp.experts.linear_fc1.weight3"
    assert torch.equal(per_expert[3], stacked[3])  # [gate; up] rows, as SwiGLU's linear_fc1 takes them
    back = rule.op.invert(per_expert)[0]
    assert torch.equal(back, stacked) and back.data_ptr() != stacked.data_ptr()


# --- negative controls: each names the part it breaks ---------------------------------------------

def _swap_experts(state, layer=2, a=0, b=5):
    for fc in ("linear_fc1", "linear_fc2"):
        root = LAYER.format(layer) + f".mlp.experts.{fc}.weight"
        state[root + str(a)], state[root + str(b)] = state[root + str(b)], state[root + str(a)]


def _perturb_deepstack(state, k=1):
    key = f"vision_model.deepstack_merger_list.{k}.linear_fc2.weight"
    state[key] = state[key].clone()
    state[key][0, 0] += 0.5


def _perturb_router(state, layer=0):
    key = LAYER.format(layer) + ".mlp.router.weight"
    state[key] = state[key].clone()
    state[key][1] += 3.0


@pytest.mark.parametrize("mutate, part", [
    (_swap_experts, LAYER.format(2) + ".mlp.experts"),
    (_perturb_deepstack, "vision_model.deepstack_merger_list.1.linear_fc2"),
    (_perturb_router, LAYER.format(0) + ".mlp.router"),
])
def test_negative_controls_fail_and_name_the_part(mutate, part):
    report = harness.check(FAMILY, seed=2, mutate_native=mutate, components=False)
    assert not report.passed
    assert {r.first_divergence.module for r in report.failures()} == {part}


# --- conversion ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("tp, pp, ep", [(2, 2, 2), (1, 1, 4)])
def test_convert_verify_and_back_with_base_is_bit_exact(saved, tmp_path, fmt, tp, pp, ep):
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert _run("convert", "--src", saved, "--dst", mcore, "--to", "mcore", "--tp", tp, "--pp", pp, "--ep", ep,
                "--format", fmt, "--quiet") == 0
    assert _run("verify", mcore, "--quiet") == 0
    assert _run("convert", "--src", mcore, "--dst", back, "--to", "hf", "--base", saved, "--quiet") == 0
    expected, got = load_safetensors_state_dict(saved), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())


def test_expert_parallel_size_that_does_not_divide_the_experts_is_refused(saved, tmp_path, capsys):
    assert _run("convert", "--src", saved, "--dst", tmp_path / "m", "--to", "mcore", "--ep", 3, "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert "--ep 3" in err and "\n" not in err and not (tmp_path / "m").exists()


def test_a_missing_expert_tensor_is_named_and_nothing_is_written(saved, tmp_path, capsys):
    from safetensors.torch import save_file

    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text((saved / "config.json").read_text())
    state = load_safetensors_state_dict(saved)
    missing = "model.language_model.layers.2.mlp.experts.down_proj"
    save_file({k: v.contiguous() for k, v in state.items() if k != missing}, str(src / "model.safetensors"))
    assert _run("convert", "--src", src, "--dst", tmp_path / "m", "--to", "mcore", "--quiet") == 2
    err = capsys.readouterr().err
    assert missing in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "m").exists()


def test_language_model_alone_reports_the_tower_left_out(saved, tmp_path, capsys):
    assert _run("convert", "--src", saved, "--dst", tmp_path / "m", "--to", "mcore", "--part", "language_model",
                "--ep", 2, "--format", "legacy") == 0
    out = capsys.readouterr()
    assert "left out" in out.out + out.err


def _transposed_release(src, dst):
    """``src`` with its stacked experts stored as Qwen's releases store them (``[E, H, 2F]``,
    ``[E, F, H]``): what transformers' ``from_pretrained`` turns back on load."""
    from safetensors.torch import save_file

    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    dst.mkdir(parents=True)
    for name in ("config.json", "tokenizer_config.json", "preprocessor_config.json"):
        if (src / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())
    state = load_safetensors_state_dict(src)
    save_file({k: (v.transpose(1, 2) if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v).contiguous()
               for k, v in state.items()}, str(dst / "model.safetensors"))
    return dst


def _rank_tensors(path) -> dict:
    state = torch.load(next(path.glob("iter_*/mp_rank_00/model_optim_rng.pt")), weights_only=False)["model"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def test_the_transposed_expert_layout_is_read_by_shape_as_transformers_reads_it(saved, tmp_path):
    """Qwen's release stores the stacked experts transposed; transformers' ``from_pretrained``
    turns each whose shape is not the module's. ``convert`` tells the layout from the shapes, with
    no flag: the same Megatron checkpoint as from the module's layout (and as through transformers'
    own mapping, ``--hf-format transformers``), tensor for tensor; exported back, the experts are
    stored transposed again, bit for bit; and ``check --hf`` passes on it."""
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    src = _transposed_release(saved, tmp_path / "hf")
    loaded = fam().build_reference(fam().tiny_config()).from_pretrained(src).state_dict()
    own = load_safetensors_state_dict(saved)
    assert all(torch.equal(loaded[k], v) for k, v in own.items())  # transformers reads it as the module's
    for name, source, extra in (("a", saved, ()), ("b", src, ()), ("c", src, ("--hf-format", "transformers"))):
        assert _run("convert", "--src", source, "--dst", tmp_path / name, "--to", "mcore", "--format", "legacy",
                    "--quiet", *extra) == 0
    a, b, c = (_rank_tensors(tmp_path / n) for n in "abc")
    assert any(".mlp.experts.linear_fc1.weight" in k for k in a)
    assert sorted(a) == sorted(b) == sorted(c) and all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    assert _run("convert", "--src", tmp_path / "b", "--dst", tmp_path / "back", "--to", "hf", "--quiet") == 0
    back, stored = load_safetensors_state_dict(tmp_path / "back"), load_safetensors_state_dict(src)
    assert sorted(back) == sorted(stored) and all(torch.equal(back[k], v) for k, v in stored.items())
    assert back["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape != \
        own["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape
    assert _run("check", "--hf", src) == 0  # no --family, no --hf-format: the release as it is stored


def test_the_transposed_expert_layout_is_refused_in_one_line_only_where_shapes_are_ambiguous(tmp_path, capsys):
    """hidden = 2F: a ``gate_up_proj`` is ``[E, H, H]`` in both layouts, and transformers keeps it
    unturned (it compares shapes only) while turning the ``down_proj`` beside it, which misreads
    a transposed release: run here. mmparity refuses that in one line, writing nothing; the same
    model stored in the module's layout converts, and so does the release with its layout said."""
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
    from tests.io.test_megatron_written import save_hf_state

    cfg = moe_reference.tiny_config(moe_intermediate_size=20)
    assert cfg.text_config.hidden_size == 2 * cfg.text_config.moe_intermediate_size
    model = fam().build_reference(cfg)
    plain = save_hf_state(FAMILY, tmp_path / "plain", random_like_state(model.state_dict(), seed=4), cfg)
    src = _transposed_release(plain, tmp_path / "hf")
    key = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    misread = type(model).from_pretrained(src).state_dict()[key]
    assert not torch.equal(misread, load_safetensors_state_dict(plain)[key])  # transformers' own misreading
    capsys.readouterr()  # transformers' progress bars
    assert _run("convert", "--src", src, "--dst", tmp_path / "m", "--to", "mcore", "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert "gate_up_proj" in err and "transposed" in err and "--hf-format" in err and "\n" not in err, err
    assert not (tmp_path / "m").exists()
    # The fix it names: the layout said, the same checkpoint as from the module's layout.
    for name, source, extra in (("ok", plain, ()), ("told", src, ("--hf-format", moe_mapping.TRANSPOSED))):
        assert _run("convert", "--src", source, "--dst", tmp_path / name, "--to", "mcore", "--format", "legacy",
                    "--quiet", *extra) == 0
    ok, told = _rank_tensors(tmp_path / "ok"), _rank_tensors(tmp_path / "told")
    assert sorted(ok) == sorted(told) and all(torch.equal(ok[k], told[k]) for k in ok)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, ep", [(2, 2, 2), (1, 1, 4)])
def test_parity_across_tensor_pipeline_and_expert_ranks(tp, pp, ep):
    report = harness.check(FAMILY, seed=1, tp=tp, pp=pp, ep=ep, components=False)
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
    assert all(r.metrics["rel_l2"] <= 1e-5 for r in report.results)


def test_megatron_args_say_the_layer_kinds_and_the_softmax_router(saved, tmp_path):
    """What Megatron-LM's --use-checkpoint-args restores must build this model: MoE where the
    routers are (layer 1 dense), softmax routing (no expert bias), q/k norms."""
    from mmparity.io.megatron_args import read_legacy_args

    assert _run("convert", "--src", saved, "--dst", tmp_path / "m", "--to", "mcore", "--format", "legacy",
                "--ep", 2, "--quiet") == 0
    args = read_legacy_args(next((tmp_path / "m").glob("iter_*/mp_rank_00_000/model_optim_rng.pt")))
    assert args.moe_layer_freq == [1, 0, 1] and args.num_experts == 8
    assert args.moe_router_score_function == "softmax" and not args.moe_router_enable_expert_bias
    assert args.qk_layernorm and args.moe_router_topk == 3
