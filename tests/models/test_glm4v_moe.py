"""GLM-4.5V whole: detection and check on what save_pretrained writes (fp32, bf16, router agreement
per MoE layer), the tower's position table resampled as transformers resamples it (to the bit in
fp32), negative controls located by part, and conversion round trips over TP, PP and EP in both
formats, bit for bit, with one tensor per expert as transformers saves them."""

from __future__ import annotations

import pytest
import torch

from mmparity.models import registry as families
from mmparity.models.core.inputs import random_like_state
from mmparity.models.glm4v_moe import config as glm_config
from mmparity.models.glm4v_moe import native as glm_native
from mmparity.models.glm4v_moe import reference as glm_reference
from mmparity.parity import harness, router

FAMILY = "glm4v_moe"
LAYER = "language_model.decoder.layers.{}"


def fam():
    return families.get(FAMILY)


def _run(*argv) -> int:
    from mmparity.cli.main import main

    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Glm4vMoeForConditionalGeneration with seeded weights, as save_pretrained writes it."""
    path = tmp_path_factory.mktemp("glm4v_moe") / "hf"
    model = fam().build_reference(fam().tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=3))
    model.save_pretrained(path, max_shard_size="60KB")
    return path


@pytest.fixture(scope="module")
def saved_46v(tmp_path_factory):
    """A tiny Glm46VForConditionalGeneration (MoE text model) with seeded weights, as save_pretrained writes it."""
    path = tmp_path_factory.mktemp("glm46v") / "hf"
    glm46v = families.get("glm46v")
    model = glm46v.build_reference(glm46v.tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=5))
    model.save_pretrained(path, max_shard_size="60KB")
    return path


def _routers(result) -> dict:
    return {m["module"]: m["metrics"]["router"] for m in result.modules if router.is_router(m["module"])}


def test_save_pretrained_writes_one_tensor_per_expert(saved):
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    state = load_safetensors_state_dict(saved)
    text = fam().tiny_config().text_config
    for e in range(text.n_routed_experts):
        assert state[f"model.language_model.layers.1.mlp.experts.{e}.gate_proj.weight"].shape == (
            text.moe_intermediate_size, text.hidden_size)
        assert f"model.language_model.layers.2.mlp.experts.{e}.down_proj.weight" in state
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in state)
    assert "model.language_model.layers.0.mlp.gate_proj.weight" in state  # first_k_dense_replace=1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_without_family_detects_the_whole_model_and_passes(saved, dtype, capsys):
    assert _run("check", "--hf", saved, "--dtype", dtype) == 0
    said = capsys.readouterr()
    assert f"family: {FAMILY}" in said.out + said.err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_whole_model_parity_and_router_agreement(dtype):
    report = harness.check(FAMILY, dtype=dtype, seed=4)
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
    for result in report.results:
        routers = _routers(result)
        assert set(routers) == {LAYER.format(i) + ".mlp.router" for i in (1, 2)}
        for verdict in routers.values():
            assert verdict["disagreements"] == 0
            if dtype == "float32":
                assert verdict["fraction"] == 1.0
        names = {m["module"] for m in result.modules}
        assert {LAYER.format(2) + s for s in (".self_attention", ".mlp.router", ".mlp.experts",
                                              ".mlp.shared_experts")} <= names
        assert {"vision_model.pos_embed", "vision_model.merger.downsample"} <= names
        assert LAYER.format(0) + ".mlp" in names and LAYER.format(0) + ".mlp.router" not in names
        if dtype == "float32":
            assert all(m["passed"] for m in result.modules), [m["module"] for m in result.modules if not m["passed"]]


def test_position_table_is_resampled_to_each_grid_as_transformers_does_bit_for_bit():
    """The tower's learned table, bicubically resampled to grids smaller, larger and of another
    aspect than the table: the native embedding equals HF's module's to the bit in fp32."""
    from transformers.vision_utils import get_vision_position_ids

    from mmparity.models.glm4v_vision import native as tower_native
    from mmparity.models.glm4v_vision import reference as tower_reference
    from mmparity.parallel import runtime

    if runtime.current_layout() is None:
        runtime.init_parallel(1, 1)
    cfg = tower_reference.tiny_config()
    hf = tower_reference.build(cfg)
    table = torch.randn(hf.embeddings.position_embedding.weight.shape, generator=torch.Generator().manual_seed(5))
    hf.embeddings.position_embedding.weight.data.copy_(table)
    native = tower_native.GlmPositionEmbedding(table.shape[0], table.shape[1])
    native.weight.data.copy_(table)
    grids = [(2, 4), (6, 2), (8, 12), (4, 4)]
    thw = torch.tensor([[1, h, w] for h, w in grids])
    ids = get_vision_position_ids(thw, cfg.spatial_merge_size)
    lengths = torch.tensor([h * w for h, w in grids])
    zeros = torch.zeros(int(lengths.sum()), table.shape[1])
    with torch.no_grad():
        expected = hf.embeddings(zeros, lengths, thw, ids[:, 0], ids[:, 1])
        rows, cols = zip(*[tower_native.block_first_ids(h, w, cfg.spatial_merge_size) for h, w in grids])
        heights = torch.cat([torch.full((h * w,), h) for h, w in grids])
        widths = torch.cat([torch.full((h * w,), w) for h, w in grids])
        got = native(zeros, torch.cat(rows), torch.cat(cols), heights, widths)
    assert torch.equal(got, expected)


def test_partial_rotary_and_sections_are_read_off_the_config():
    text = fam().tiny_config().text_config
    assert glm_config.rotary_dim(text) == 8 and glm_native.mrope_section(text) == [1, 2, 1]
    bad = glm_reference.tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                     "mrope_section": [2, 2, 2], "partial_rotary_factor": 0.5})
    assert any("mrope_section" in p for p in glm_native.text_config_problems(bad.text_config))


def test_config_json_read_without_transformers_gives_the_same_model(saved):
    import json

    from mmparity.config import config_view

    from mmparity.convert.configs import hf_config_tables

    view = config_view(json.loads((saved / "config.json").read_text()), hf_config_tables())
    assert view.text_config.num_local_experts == 4 and view.text_config.first_k_dense_replace == 1
    assert glm_config.rotary_dim(view.text_config) == 8
    assert view.vision_config.num_hidden_layers == 2 and view.image_start_token_id == 91


# --- negative controls: each names the part it breaks ---------------------------------------------

def _swap_experts(state, layer=2, a=0, b=3):
    for fc in ("linear_fc1", "linear_fc2"):
        root = LAYER.format(layer) + f".mlp.experts.{fc}.weight"
        state[root + str(a)], state[root + str(b)] = state[root + str(b)], state[root + str(a)]


def _bump(key, row=0, amount=0.5):
    def mutate(state):
        state[key] = state[key].clone()
        state[key][row] += amount
    return mutate


@pytest.mark.parametrize("mutate, part", [
    (_swap_experts, LAYER.format(2) + ".mlp.experts"),
    (_bump(LAYER.format(1) + ".mlp.router.weight", 1, 3.0), LAYER.format(1) + ".mlp.router"),
    (_bump(LAYER.format(2) + ".mlp.shared_experts.linear_fc2.weight"), LAYER.format(2) + ".mlp.shared_experts"),
    (_bump("vision_model.merger.linear_proj.weight"), "vision_model.merger.linear_proj"),
    (_bump("vision_model.post_conv_layernorm.weight"), "vision_model.post_conv_layernorm"),
])
def test_negative_controls_fail_and_name_the_part(mutate, part):
    report = harness.check(FAMILY, seed=2, mutate_native=mutate, components=False)
    assert not report.passed
    assert {r.first_divergence.module for r in report.failures()} == {part}


def test_sections_that_do_not_cover_the_rotated_frequencies_are_refused_in_one_line(saved, tmp_path, capsys):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    config = json.loads((bad / "config.json").read_text())
    config["text_config"]["rope_parameters"]["mrope_section"] = [3, 3, 3]
    (bad / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert _run("check", "--hf", bad) == 2
    err = capsys.readouterr().err.strip()
    assert "mrope_section" in err and "\n" not in err


# --- conversion ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("model", ["saved", "saved_46v"])
def test_convert_verify_load_and_back_with_base_is_bit_exact_at_tp2_pp2_ep2(model, request, tmp_path, fmt):
    """GLM-4.5V's class (one tensor per expert, as it saves them) and GLM-4.6V's (stacked, as it does)."""
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    saved = request.getfixturevalue(model)
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert _run("convert", "--src", saved, "--dst", mcore, "--to", "mcore", "--tp", 2, "--pp", 2, "--ep", 2,
                "--format", fmt, "--quiet") == 0
    assert _run("verify", mcore, "--quiet") == 0
    # Megatron's GPTModel loads the language model strictly; the tower it has no class for is counted.
    assert _run("verify", "--load", mcore, "--quiet") == 0
    assert _run("convert", "--src", mcore, "--dst", back, "--to", "hf", "--base", saved, "--quiet") == 0
    expected, got = load_safetensors_state_dict(saved), load_safetensors_state_dict(back)
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_language_model_loads_strictly_into_megatrons_gpt_model_at_tp2_pp2_ep2(saved, tmp_path, fmt):
    mcore = tmp_path / "lm"
    assert _run("convert", "--src", saved, "--dst", mcore, "--to", "mcore", "--part", "language_model",
                "--tp", 2, "--pp", 2, "--ep", 2, "--format", fmt, "--quiet") == 0
    assert _run("verify", "--load", mcore, "--quiet") == 0


def test_expert_parallel_size_that_does_not_divide_the_experts_is_refused(saved, tmp_path, capsys):
    assert _run("convert", "--src", saved, "--dst", tmp_path / "m", "--to", "mcore", "--ep", 3, "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert "--ep 3" in err and "\n" not in err and not (tmp_path / "m").exists()


def test_megatron_args_say_the_router_the_layer_kinds_and_the_rotated_fraction(saved, tmp_path):
    """What Megatron-LM's --use-checkpoint-args restores must build this model: dense layer 0 then
    MoE, the sigmoid group-limited router with expert bias, shared experts, q/k/v biases, half of
    each head rotated."""
    from mmparity.io.megatron_args import read_legacy_args

    assert _run("convert", "--src", saved, "--dst", tmp_path / "m", "--to", "mcore", "--format", "legacy",
                "--ep", 2, "--quiet") == 0
    args = read_legacy_args(next((tmp_path / "m").glob("iter_*/mp_rank_00_000/model_optim_rng.pt")))
    assert args.moe_layer_freq == [0, 1, 1] and args.num_experts == 4 and args.moe_router_topk == 2
    assert args.moe_router_score_function == "sigmoid" and args.moe_router_enable_expert_bias
    assert args.moe_router_num_groups == 2 and args.moe_router_group_topk == 1
    assert args.moe_router_topk_scaling_factor == 1.5 and args.moe_shared_expert_intermediate_size == 14
    assert args.add_qkv_bias and not args.add_bias_linear and args.rotary_percent == 0.5


@pytest.mark.slow
def test_parity_across_tensor_pipeline_and_expert_ranks():
    report = harness.check(FAMILY, seed=1, tp=2, pp=2, ep=2, components=False)
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]
    assert all(r.metrics["rel_l2"] <= 1e-5 for r in report.results)


# --- the tower family alone ---------------------------------------------------------------------------

@pytest.mark.parametrize("mutate, part", [
    (_bump("merger.downsample.weight"), "merger.downsample"),
    (_bump("pos_embed.weight", 7), "pos_embed"),
    (_bump("decoder.layers.1.mlp.linear_fc2.weight"), "layer.1.mlp"),
])
def test_tower_negative_controls_fail_and_name_the_module(mutate, part):
    report = harness.check("glm4v_vision", seed=2, mutate_native=mutate, components=False)
    assert not report.passed
    assert {r.first_divergence.module for r in report.failures()} == {part}


def test_tower_family_checks_the_tower_of_a_whole_checkpoint(saved, capsys):
    assert _run("check", "glm4v_vision", "--hf", saved) == 0


def test_check_mcore_fails_on_a_perturbed_converted_weight_naming_the_part(saved, tmp_path, capsys):
    """The CLI's negative control: a converted checkpoint passes ``check --mcore``; the same with one
    shared-expert weight of decoder layer 2 changed fails (exit 1), naming that part."""
    mcore = tmp_path / "mcore"
    assert _run("convert", "--src", saved, "--dst", mcore, "--to", "mcore", "--format", "legacy", "--quiet") == 0
    capsys.readouterr()
    assert _run("check", "--mcore", mcore, "--hf", saved, "--no-components", "--quiet") == 0
    rank_file = next(mcore.glob("iter_*/mp_rank_00/model_optim_rng.pt"))
    payload = torch.load(rank_file, weights_only=False)
    payload["model"][LAYER.format(2) + ".mlp.shared_experts.linear_fc2.weight"][0, 0] += 0.5
    torch.save(payload, rank_file)
    capsys.readouterr()
    assert _run("check", "--mcore", mcore, "--hf", saved, "--no-components") == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and LAYER.format(2) + ".mlp.shared_experts" in out


# --- GLM-4.6V's class over the same model -----------------------------------------------------------

def test_glm46v_saves_the_experts_stacked_and_checks_without_family(saved_46v, capsys):
    """transformers has no conversion mapping for GLM-4.6V's class: its save_pretrained writes the
    module's stacked experts, where GLM-4.5V's writes one tensor per expert; both are read as saved."""
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    state = load_safetensors_state_dict(saved_46v)
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj" in state
    capsys.readouterr()
    assert _run("check", "--hf", saved_46v) == 0
    said = capsys.readouterr()
    assert "family: glm46v" in said.out + said.err


def test_glm46v_with_the_dense_glm4_text_model_is_refused_in_one_line(saved_46v, tmp_path, capsys):
    import json
    import shutil

    dense = tmp_path / "dense"
    shutil.copytree(saved_46v, dense)
    config = json.loads((dense / "config.json").read_text())
    config["text_config"]["model_type"] = "glm4v_text"
    (dense / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert _run("check", "--hf", dense) == 2
    err = capsys.readouterr().err.strip()
    assert "glm4v_text" in err and "\n" not in err


def test_a_release_shaped_checkpoint_drops_its_mtp_layer_and_reads_the_legacy_rope_spelling(saved, tmp_path, capsys):
    """GLM-4.5V's release stores a multi-token-prediction layer after the decoder's
    (``num_nextn_predict_layers``) and spells RoPE as ``rope_theta`` / ``partial_rotary_factor`` /
    ``rope_scaling``: the layer is left out by name with its count, the RoPE read as transformers
    reads it (half of each head rotated, the sections kept), and the check passes."""
    import json

    from safetensors.torch import save_file

    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict

    src = tmp_path / "release"
    src.mkdir()
    config = json.loads((saved / "config.json").read_text())
    text = config["text_config"]
    rope = text.pop("rope_parameters")
    text.update(num_nextn_predict_layers=1, rope_theta=rope["rope_theta"], partial_rotary_factor=0.5,
                rope_scaling={"type": "default", "mrope_section": rope["mrope_section"]})
    (src / "config.json").write_text(json.dumps(config))
    state = load_safetensors_state_dict(saved)
    mtp = {k.replace(".layers.2.", ".layers.3."): v.clone() for k, v in state.items()
           if k.startswith("model.language_model.layers.2.")}
    save_file({k: v.contiguous() for k, v in {**state, **mtp}.items()}, str(src / "model.safetensors"))
    capsys.readouterr()
    assert _run("convert", "--src", src, "--dst", tmp_path / "m", "--to", "mcore", "--format", "legacy") == 0
    said = capsys.readouterr()
    assert f"left out {len(mtp)} of" in said.out + said.err
    assert _run("check", "--hf", src, "--quiet") == 0
