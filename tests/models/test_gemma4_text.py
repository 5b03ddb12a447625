"""The Gemma 4 language-model part against transformers' ``Gemma4ForCausalLM``: fp32 parity per
position and per layer with sliding and (wider, proportional-RoPE) full layers and soft-capped
logits, each Gemma 4 departure from Gemma 3 shown to matter, negative controls located, what is not
built refused by name, the config read without transformers, and the rule table's bit-exact round
trips (TP 1 / 2, legacy rank files at TP 2 x PP 2)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mmparity import config as hfconfig  # noqa: E402
from mmparity.config import padded_vocab_size  # noqa: E402
from mmparity.mapping.rules import RuleSet, convert_hf_to_mcore, convert_mcore_to_hf  # noqa: E402
from mmparity.models import registry  # noqa: E402
from mmparity.models.parts.gemma4_text import config as text_config  # noqa: E402
from mmparity.models.parts.gemma4_text import mapping, reference  # noqa: E402
from mmparity.parallel import runtime  # noqa: E402

VOCAB = 97
SEQ = 13  # longer than the window of 5


def tiny(**overrides):
    return transformers.Gemma4TextConfig(**reference.tiny_text(tie_word_embeddings=False, **overrides))


def hf_model(seed: int = 0, **overrides):
    """Seeded, non-constant weights: norms around 1 (Gemma 4 scales by ``w``), layer scalars apart."""
    cfg = tiny(**overrides)
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) * 0.8 + 0.6)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand(1, generator=gen) + 0.5)
    return cfg, model


def rule_set(cfg) -> RuleSet:
    return RuleSet(rules=mapping.language_rules(cfg, "model.", "lm_head.weight", tied=False),
                   variables=mapping.SPEC.variables_of(cfg), validate_tp=lambda tp: text_config.tp_problems(cfg, tp))


@pytest.fixture(scope="module", autouse=True)
def tp1():
    if runtime.current_layout() is None:
        runtime.init_parallel(1, 1)


def native_of(cfg, model):
    from mmparity.models.parts.gemma4_text.native import LanguageModelBuilder

    native = LanguageModelBuilder(cfg)(padded_vocab_size(VOCAB, 128), pre_process=True, post_process=True).eval()
    shards = convert_hf_to_mcore(rule_set(cfg), model.state_dict(), 1)
    state = {k[len(mapping.MCORE_ROOT):]: v for k, v in shards[0].items()}
    missing, unexpected = native.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("_extra_state")]
    return native


def _ids(seed: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_both(cfg, model, native, ids):
    """(native logits, HF logits, per layer (native, HF) outputs ``[b, s, h]``)."""
    seen: dict = {}

    def keep(i, side, sbh):
        def hook(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            seen.setdefault(i, {})[side] = (out.transpose(0, 1) if sbh else out).clone()
        return hook

    handles = []
    for i in range(cfg.num_hidden_layers):
        handles += [native.decoder.layers[i].register_forward_hook(keep(i, 0, True)),
                    model.model.layers[i].register_forward_hook(keep(i, 1, False))]
    try:
        with torch.no_grad():
            ours = native(ids, torch.arange(ids.shape[1]).expand_as(ids), None)[..., :VOCAB]
            theirs = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    return ours, theirs, [(seen[i][0], seen[i][1]) for i in range(cfg.num_hidden_layers)]


def first_divergence(layers, bound: float = 1e-5):
    return next((i for i, (a, b) in enumerate(layers) if _relative(a, b) > bound), None)


# --- what the config says ------------------------------------------------------------------------

def test_full_layers_are_wider_and_rotate_a_quarter_of_their_frequencies():
    cfg = tiny()
    assert [text_config.layer_head_dim(cfg, i) for i in range(3)] == [12, 16, 16]
    inv = text_config.layer_inv_freq(cfg, 1)
    assert inv.numel() == 8 and int((inv > 0).sum()) == 2  # a quarter of 16 / 2 pairs turn
    assert text_config.layer_inv_freq(cfg, 0).numel() == 6


def test_the_config_read_without_transformers_gives_the_same_layers():
    cfg = tiny()
    view = hfconfig.config_view(json.loads(cfg.to_json_string()), text_config.HF_CONFIGS)
    for i in range(cfg.num_hidden_layers):
        assert text_config.layer_head_dim(view, i) == cfg.per_layer_config[i].head_dim
        assert text_config.layer_groups(view, i) == cfg.per_layer_config[i].num_key_value_heads
        assert torch.equal(text_config.layer_inv_freq(view, i), text_config.layer_inv_freq(cfg, i))
    # A file that names the full layers' width as Google's releases do, not per layer.
    data = {k: v for k, v in json.loads(cfg.to_json_string()).items() if k != "per_layer_config"}
    view = hfconfig.config_view({**data, "global_head_dim": 20}, text_config.HF_CONFIGS)
    assert [text_config.layer_head_dim(view, i) for i in range(3)] == [12, 20, 20]


def test_registry_takes_the_text_model_type():
    cfg = type("Cfg", (), {"text_config": type("Text", (), {"model_type": "gemma4_text"})()})()
    assert registry.language_of(cfg).name == "gemma4_text"


def test_reference_shapes_are_what_transformers_builds():
    cfg, model = hf_model()
    state = {k[len("model."):]: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith("model.")}
    assert state == reference.decoder_shapes(cfg)


@pytest.mark.parametrize("overrides, named", [
    ({"enable_moe_block": True, "num_experts": 2, "top_k_experts": 3, "moe_intermediate_size": 8}, "top_k_experts=3"),
    ({"num_kv_shared_layers": 3}, "num_kv_shared_layers"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
])
def test_what_is_not_built_is_refused_by_name(overrides, named):
    from mmparity.models.parts.gemma4_text.native import LanguageModelBuilder

    problems = text_config.config_problems(tiny(**overrides))
    assert len(problems) == 1 and named in problems[0]
    with pytest.raises(ValueError, match=named):
        LanguageModelBuilder(tiny(**overrides))


@pytest.mark.parametrize("overrides, named", [
    ({"hidden_size_per_layer_input": 8}, "hidden_size_per_layer_input"),
    ({"num_kv_shared_layers": 1}, "num_kv_shared_layers"),
])
def test_per_layer_inputs_and_shared_layers_are_the_per_layer_builders(overrides, named):
    """E2B / E4B's additions are built (tests/models/test_gemma4_ple.py), by the per-layer builder:
    the plain one refuses them by name rather than build a model without them."""
    from mmparity.models.parts.gemma4_text import per_layer_native
    from mmparity.models.parts.gemma4_text.native import LanguageModelBuilder

    assert text_config.config_problems(tiny(**overrides)) == []
    with pytest.raises(ValueError, match=named):
        LanguageModelBuilder(tiny(**overrides))
    assert per_layer_native.needed(tiny(**overrides))
    per_layer_native.LanguageModelBuilder(tiny(**overrides))


# --- parity ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair():
    cfg, model = hf_model(seed=2)
    return cfg, model, native_of(cfg, model)


def test_logits_match_at_every_position(pair):
    cfg, model, native = pair
    ours, theirs, layers = run_both(cfg, model, native, _ids())
    assert ours.shape == theirs.shape == (2, SEQ, VOCAB)
    assert _relative(ours, theirs) < 1e-5
    per_position = ((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)).max()
    assert per_position < 1e-5
    assert first_divergence(layers) is None
    # Soft-capped: the cap bounds every logit.
    assert theirs.abs().max() < cfg.final_logit_softcapping


@pytest.mark.parametrize("layer, tensor", [
    (0, "self_attn.v_proj.weight"), (1, "self_attn.q_norm.weight"), (2, "mlp.down_proj.weight"),
    (1, "post_feedforward_layernorm.weight"), (2, "layer_scalar")])
def test_a_perturbed_weight_is_located_at_its_layer(pair, layer, tensor):
    cfg, model, native = pair
    state = dict(model.state_dict())
    perturbed = transformers.Gemma4ForCausalLM(cfg).eval()
    # Scaled and shifted: the value norm would cancel a scale alone (see below).
    state[f"model.layers.{layer}.{tensor}"] = state[f"model.layers.{layer}.{tensor}"] * 1.5 + 0.05
    perturbed.load_state_dict(state)
    _, _, layers = run_both(cfg, perturbed, native, _ids())
    assert first_divergence(layers) == layer


def test_the_value_norm_cancels_a_scaled_value_projection(pair):
    """HF's ``v_norm`` normalises each value head: a scaled ``v_proj`` computes the same function,
    which is why the negative control above shifts as well as scales."""
    cfg, model, native = pair
    state = dict(model.state_dict())
    state["model.layers.0.self_attn.v_proj.weight"] = state["model.layers.0.self_attn.v_proj.weight"] * 1.5
    scaled = transformers.Gemma4ForCausalLM(cfg).eval()
    scaled.load_state_dict(state)
    _, _, layers = run_both(cfg, scaled, native, _ids())
    assert first_divergence(layers) is None


@pytest.mark.parametrize("what", ["window", "proportional", "v_norm", "softcap"])
def test_each_gemma4_departure_matters(pair, what):
    """The native model computes the HF function only with each piece in place: without it, the
    logits leave the bound (so the parity above is not vacuous about any of them)."""
    from mmparity.models.parts.gemma4_text import native as module

    cfg, model, native = pair
    saved = {}
    if what == "window":
        for layer in native.decoder.layers:
            saved[layer] = layer.self_attention.core_attention.window
            layer.self_attention.core_attention.window = None
    elif what == "proportional":
        rope = native.decoder.layers[1].self_attention.rope
        saved[rope] = rope.inv_freq
        rope.inv_freq = text_config.layer_inv_freq(tiny(rope_parameters={
            **cfg.rope_parameters, "full_attention": {"rope_type": "default", "rope_theta": 3000.0}}), 1)
    elif what == "v_norm":
        saved["norm"] = module.Gemma4CoreAttention.forward
        module.Gemma4CoreAttention.forward = module.WindowedCoreAttention.forward
    try:
        ids = _ids()
        if what == "softcap":
            capped, _, _ = run_both(cfg, model, native, ids)
            model.config.final_logit_softcapping = None
            try:
                with torch.no_grad():
                    raw = model(ids).logits
            finally:
                model.config.final_logit_softcapping = cfg.final_logit_softcapping
            assert _relative(capped, raw) > 1e-4
            return
        ours, theirs, _ = run_both(cfg, model, native, ids)
        assert _relative(ours, theirs) > 1e-4
    finally:
        for layer, window in ((k, v) for k, v in saved.items() if hasattr(k, "self_attention")):
            layer.self_attention.core_attention.window = window
        for rope, inv in ((k, v) for k, v in saved.items() if hasattr(k, "get_emb")):
            rope.inv_freq = inv
        if "norm" in saved:
            module.Gemma4CoreAttention.forward = saved["norm"]


# --- conversion -----------------------------------------------------------------------------------

def _assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_bit_exact(tp, dtype):
    cfg, model = hf_model(seed=tp)
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    rules = rule_set(cfg)
    shards = convert_hf_to_mcore(rules, state, tp)
    assert len(shards) == tp
    # Every rank holds whole query groups of each layer's own width.
    full = shards[0]["language_model.decoder.layers.1.self_attention.linear_qkv.weight"]
    assert full.shape[0] == (4 + 2 * 2) * 16 // tp
    _assert_same(convert_mcore_to_hf(rules, shards), state)


def test_tp_2_refuses_what_it_cannot_divide():
    problems = text_config.tp_problems(tiny(num_attention_heads=3, num_key_value_heads=3), 2)
    assert any("num_attention_heads=3" in p for p in problems) and any("key/value heads=3" in p for p in problems)


def test_legacy_rank_files_at_tp_2_pp_2_round_trip(tmp_path):
    from mmparity.io.legacy import open_legacy, write_legacy

    cfg, model = hf_model(seed=13, num_hidden_layers=4,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    state = model.state_dict()
    rules = rule_set(cfg)
    shards = convert_hf_to_mcore(rules, state, 2)
    layers = "language_model.decoder.layers."
    last = ("language_model.decoder.final_layernorm.", "language_model.output_layer.")
    write_legacy(tmp_path / "ckpt", list(shards), pp_size=2, layer_prefix=layers, last_stage_prefixes=last)
    checkpoint = open_legacy(tmp_path / "ckpt")
    assert (checkpoint.tp_size, checkpoint.pp_size) == (2, 2)
    back = [{k: v for k, v in s.items() if isinstance(v, torch.Tensor)} for s in checkpoint.tp_shards(layer_prefix=layers)]
    _assert_same(convert_mcore_to_hf(rules, back), state)


# --- keys as values (attention_k_eq_v: full layers without a value projection) -----------------------

KEQV = dict(attention_k_eq_v=True, num_global_key_value_heads=1)


def test_keys_as_values_full_layers_match_transformers():
    cfg, model = hf_model(seed=4, **KEQV)
    assert "model.layers.1.self_attn.v_proj.weight" not in model.state_dict()
    assert "model.layers.0.self_attn.v_proj.weight" in model.state_dict()  # sliding layers keep theirs
    assert [text_config.layer_groups(cfg, i) for i in range(3)] == [2, 1, 1]
    state = {k[len("model."):]: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith("model.")}
    assert state == reference.decoder_shapes(cfg)
    ours, theirs, layers = run_both(cfg, model, native_of(cfg, model), _ids())
    assert _relative(ours, theirs) < 1e-5 and first_divergence(layers) is None


@pytest.mark.parametrize("tp", [1, 2])
def test_keys_as_values_round_trip_is_bit_exact_and_the_value_rows_repeat_the_keys(tp):
    cfg, model = hf_model(seed=5, **{**KEQV, "num_global_key_value_heads": 2})
    state = model.state_dict()
    rules = rule_set(cfg)
    shards = convert_hf_to_mcore(rules, state, tp)
    qkv = torch.cat([s["language_model.decoder.layers.1.self_attention.linear_qkv.weight"] for s in shards])
    grouped = qkv.reshape(2, 4 // 2 + 2, 16, -1)
    assert torch.equal(grouped[:, -1], grouped[:, -2])
    _assert_same(convert_mcore_to_hf(rules, shards), state)


def test_value_rows_apart_from_the_key_rows_are_refused_by_name():
    from mmparity.errors import ConversionError
    from mmparity.mapping.ops import LayoutError

    cfg, model = hf_model(seed=6, **KEQV)
    rules = rule_set(cfg)
    shards = convert_hf_to_mcore(rules, model.state_dict(), 1)
    key = "language_model.decoder.layers.1.self_attention.linear_qkv.weight"
    shards[0][key] = shards[0][key].clone()
    shards[0][key][-1, 0] += 1.0  # the last group's value rows
    with pytest.raises((ConversionError, LayoutError), match="value rows differ from the key rows"):
        convert_mcore_to_hf(rules, shards)
