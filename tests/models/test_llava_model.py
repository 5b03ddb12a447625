"""The whole LLaVA model: native ``LLaVAModel`` and its converter against transformers'
``LlavaForConditionalGeneration``. The generic family checks (strict load, fp32 parity, negative
controls, TP=2) live in test_families.py / test_multirank.py; these are the LLaVA-specific ones."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmparity.models import registry as families
from mmparity.models.llava import cases as llava_cases
from mmparity.config import padded_vocab_size, tied_embeddings
from mmparity.models.llava import preprocess as llava_preprocess
from mmparity.mapping.rules import VOCAB_MULTIPLE, ConversionError
from mmparity.parity import harness
from mmparity.parity.harness import load_reference_weights
from mmparity.models.core.inputs import random_like_state
from tests.strategies import tp_sizes

TOWERS = [name for name in ("pixtral", "clip", "siglip") if name in families.names()]
FAST = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------


def vision_config(tower: str, *, heads=4, head_dim=12, ffn=44, layers=3):
    from transformers import CLIPVisionConfig, PixtralVisionConfig, SiglipVisionConfig

    common = dict(hidden_size=heads * head_dim, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, patch_size=8, num_channels=3)
    if tower == "pixtral":
        return PixtralVisionConfig(image_size=64, hidden_act="silu", **common)
    if tower == "clip":
        return CLIPVisionConfig(image_size=40, hidden_act="quick_gelu", **common)
    return SiglipVisionConfig(image_size=40, hidden_act="gelu_pytorch_tanh", vision_use_head=True,
                              **common)


def llava_config(tower="pixtral", *, feature_layer=-2, strategy="full", tied=False, vision=None,
                 projector_bias=True, image_token_index=71, **text_overrides):
    from transformers import LlavaConfig

    base = families.get("llava").tiny_config()
    text = base.text_config
    for key, value in {"tie_word_embeddings": tied, **text_overrides}.items():
        setattr(text, key, value)
    return LlavaConfig(vision_config=vision or vision_config(tower), text_config=text,
                       image_token_index=image_token_index, projector_hidden_act="gelu",
                       vision_feature_layer=feature_layer,
                       vision_feature_select_strategy=strategy,
                       multimodal_projector_bias=projector_bias, tie_word_embeddings=tied)


@st.composite
def llava_configs(draw):
    """Random whole-LLaVA configs: tower, feature layers, strategy, GQA, head_dim, vocabulary
    (padded or not), tied head, projector bias."""
    from transformers import LlamaConfig, LlavaConfig

    tower = draw(st.sampled_from(TOWERS))
    layers = draw(st.integers(1, 3))
    vision = vision_config(tower, heads=draw(st.sampled_from([2, 4])),
                           head_dim=draw(st.sampled_from([4, 8])),
                           ffn=4 * draw(st.integers(1, 6)), layers=layers)
    index = st.integers(-(layers + 1), layers)
    feature_layer = draw(index | st.lists(index, min_size=1, max_size=2))
    strategy = "full" if tower == "pixtral" else draw(st.sampled_from(["full", "default"]))
    groups = draw(st.sampled_from([1, 2]))
    heads = groups * draw(st.sampled_from([1, 2, 3]))
    vocab = draw(st.sampled_from([5, 101, 128, 257]))
    tied = draw(st.booleans())
    # transformers insists on hidden % heads == 0 even with an explicit head_dim
    text = LlamaConfig(vocab_size=vocab, hidden_size=heads * 4 * draw(st.integers(1, 3)),
                       intermediate_size=2 * draw(st.integers(1, 12)),
                       num_hidden_layers=draw(st.integers(1, 2)), num_attention_heads=heads,
                       num_key_value_heads=groups, head_dim=draw(st.sampled_from([4, 6])),
                       tie_word_embeddings=tied)
    return LlavaConfig(vision_config=vision, text_config=text,
                       image_token_index=draw(st.integers(0, vocab - 1)),
                       vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
                       multimodal_projector_bias=draw(st.booleans()), tie_word_embeddings=tied)


@st.composite
def llava_config_and_tp(draw):
    cfg = draw(llava_configs())
    return cfg, draw(st.sampled_from(tp_sizes("llava", cfg)))


def hf_state(cfg, seed: int = 0) -> dict:
    """Seeded weights in HF module names, shapes read off a meta-device model (no allocation)."""
    from transformers import LlavaForConditionalGeneration

    with torch.device("meta"):
        shapes = LlavaForConditionalGeneration(cfg).state_dict()
    return random_like_state(shapes, seed)


def as_checkpoint_files(state: dict, cfg, v4: bool) -> dict:
    """HF module names -> what save_pretrained writes (transformers 5, or 4 with nested towers)."""
    nested = "vision_model." if v4 and cfg.vision_config.model_type != "pixtral" else ""
    renames = [("model.language_model.", "language_model.model."),
               ("lm_head.", "language_model.lm_head."),
               ("model.vision_tower.", "vision_tower." + nested),
               ("model.multi_modal_projector.", "multi_modal_projector.")]
    out = {}
    for key, value in state.items():
        for old, new in renames:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = value
    return out


def without_tied_head(state: dict, cfg) -> dict:
    return {k: v for k, v in state.items() if not (tied_embeddings(cfg) and k == "lm_head.weight")}


# --------------------------------------------------------------------------------------------
# conversion
# --------------------------------------------------------------------------------------------


@FAST
@given(case=llava_config_and_tp(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 999))
def test_round_trip_bit_exact_for_random_configs_and_tp(case, dtype, seed):
    cfg, tp_size = case
    state = {k: v.to(dtype) for k, v in hf_state(cfg, seed).items()}
    shards = families.get("llava").hf_to_mcore(state, cfg, tp_size=tp_size)
    assert len(shards) == tp_size
    keys = list(shards[0])
    # Language model first, as the native module registers it (the generic negative controls
    # pick the first matching key).
    first_vision = min(i for i, k in enumerate(keys) if k.startswith("vision_model."))
    assert all(k.startswith("language_model.") for k in keys[:first_vision])
    assert ("language_model.output_layer.weight" in keys) != tied_embeddings(cfg)
    padded = padded_vocab_size(cfg.text_config.vocab_size, VOCAB_MULTIPLE, tp=tp_size)  # Megatron-LM's 128 x TP
    table = torch.cat([s["language_model.embedding.word_embeddings.weight"] for s in shards])
    assert table.shape[0] == padded and not table[cfg.text_config.vocab_size:].any()

    back = families.get("llava").mcore_to_hf(shards, cfg)
    expected = without_tied_head(state, cfg)
    assert set(back) == set(expected)
    for key, value in expected.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
    # ... and mcore -> HF -> mcore is the identity on the shards too
    again = families.get("llava").hf_to_mcore(back, cfg, tp_size=tp_size)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(shards, again) for k in a)

    # Checkpoint files (transformers 5 and 4 layouts) are detected and give the same shards.
    for v4, fmt in ((False, "hf_checkpoint"), (True, "hf_v4_checkpoint")):
        files = as_checkpoint_files(state, cfg, v4)
        if cfg.vision_config.model_type != "pixtral" or not v4:
            assert families.get("llava").hooks.converter.detect(files) == fmt
        from_files = families.get("llava").hf_to_mcore(files, cfg, tp_size=tp_size, hf_format=fmt)
        assert all(torch.equal(a[k], b[k]) for a, b in zip(shards, from_files) for k in a)
        written = families.get("llava").mcore_to_hf(shards, cfg, hf_format=fmt)
        tied_head = {"language_model.lm_head.weight"} if tied_embeddings(cfg) else set()
        assert set(written) == set(files) - tied_head
        assert all(torch.equal(written[k], files[k]) for k in written)


def test_generic_negative_controls_pick_language_model_keys():
    """test_families.py perturbs the first ``layers.1.*linear_fc2.weight`` / ``layers.0.*linear_qkv
    .weight`` key and expects ``layer.1`` / ``layer.0``: the language layers' pair names."""
    cfg = families.get("llava").tiny_config()
    (shard,) = families.get("llava").hf_to_mcore(hf_state(cfg), cfg)

    def first(layer, suffix):
        return next(k for k in shard if f"layers.{layer}." in k and k.endswith(suffix))

    assert first(1, "linear_fc2.weight") == "language_model.decoder.layers.1.mlp.linear_fc2.weight"
    assert first(0, "linear_qkv.weight") == "language_model.decoder.layers.0.self_attention.linear_qkv.weight"
    native = families.get("llava").build_native(cfg)
    assert list(native.state_dict())[0].startswith("language_model.")


def test_export_trims_any_vocabulary_padding():
    """An mcore table padded to another multiple (e.g. Megatron-LM's 128·TP) still exports."""
    cfg = families.get("llava").tiny_config()
    state = hf_state(cfg, 3)
    shards = families.get("llava").hf_to_mcore(state, cfg)
    (shard,) = shards
    for key in ("language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight"):
        assert shard[key].shape == (128, 40)
        shard[key] = torch.cat([shard[key], torch.randn(128, 40)])  # 256 rows, junk past 101
    back = families.get("llava").mcore_to_hf([shard], cfg, side=shards.side)
    assert torch.equal(back["lm_head.weight"], state["lm_head.weight"])
    assert torch.equal(back["model.language_model.embed_tokens.weight"],
                       state["model.language_model.embed_tokens.weight"])


def test_tp_that_does_not_fit_lists_every_problem():
    cfg = families.get("llava").tiny_config()
    with pytest.raises(ConversionError) as info:
        families.get("llava").hf_to_mcore(hf_state(cfg), cfg, tp_size=3)
    message = str(info.value)
    for part in ("num_attention_heads=4", "text num_key_value_heads=2"):
        assert part in message, message


def test_unexpected_and_missing_tensors_are_reported():
    cfg = families.get("llava").tiny_config()
    state = hf_state(cfg)
    state["model.language_model.layers.0.self_attn.rotary_scale"] = torch.ones(3)
    del state["model.multi_modal_projector.linear_2.bias"]
    with pytest.raises(ConversionError) as info:
        families.get("llava").hf_to_mcore(state, cfg)
    assert "unconsumed source tensor model.language_model.layers.0.self_attn.rotary_scale" in str(info.value)
    assert "missing source tensor model.multi_modal_projector.linear_2.bias" in str(info.value)


# --------------------------------------------------------------------------------------------
# parity
# --------------------------------------------------------------------------------------------


def _compared_modules(report) -> set:
    return {row["module"] for r in report.results for row in r.modules if "metrics" in row}


def test_default_parity_compares_every_stage():
    report = harness.check("llava", seed=11)
    assert report.passed, [(r.check, r.metrics) for r in report.failures()]
    by_check = {r.check: r for r in report.results}
    for check in ("sample:logits", "sample:token_loss", "sample:loss_mask"):
        assert by_check[check].metrics["rel_l2"] <= 1e-5
    # feature layer -2 of 3: vision layers 0 and 1 run, layer 2 does not
    layers = ["vision_model.layer.0", "vision_model.layer.1", "language_model.decoder.layers.0",
              "language_model.decoder.layers.1"]
    assert _compared_modules(report) == {
        "vision_model.patch_embed", "vision_model.ln_pre", "vision_projection", "language_model.decoder.final_layernorm",
        *layers, *(f"{layer}.{sub}" for layer in layers
                   for sub in ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp"))}
    assert {"component:pixel_shuffle", "component:loss_weights", "component:expansion"} <= set(by_check)


# An odd number of images of different, mostly non-square sizes (patch 8): 16, 12, 12, 9 and 8
# tokens. Before the fix the case put placeholder k round-robin over the two rows while both
# models fill placeholders in reading order, so the rows disagreed (logits rel_l2 ~0.7).
MIXED_SIZES = [(32, 32), (16, 48), (48, 16), (24, 24), (32, 16)]


def _image_runs(row, image_token_index) -> list[int]:
    """Lengths of the runs of image tokens in one row, left to right."""
    return [len(list(run)) for is_image, run in
            itertools.groupby(row, key=lambda t: t == image_token_index) if is_image]


def test_mixed_size_case_places_images_in_reading_order():
    """Image k fills the k-th placeholder in reading order on both sides: HF's image-token runs
    are the images' token counts in order, and the native expansion of the compact ids puts its
    image slots exactly where HF's are."""
    cfg = families.get("llava").tiny_config()
    (case,) = families.get("llava").hooks.parity.cases(cfg, seed=3, image_sizes=MIXED_SIZES)
    data = case.data
    hf_ids = data["hf_input_ids"]
    runs = [n for row in hf_ids.tolist() for n in _image_runs(row, cfg.image_token_index)]
    assert runs == [llava_cases.tokens_per_image(cfg, s, families.tower_of) for s in MIXED_SIZES]
    out = llava_preprocess._preprocess_data(
        None, None, data["input_ids"], data["loss_mask"], data["labels"],
        media_token_counts=runs, pre_process=False)
    keep = data["length"]
    native_slots = out.input_ids[:, :keep] == llava_preprocess.DEFAULT_IMAGE_TOKEN_INDEX
    assert torch.equal(native_slots, hf_ids == cfg.image_token_index)


def test_parity_with_an_odd_number_of_mixed_size_images():
    report = harness.check("llava", seed=0, image_sizes=MIXED_SIZES, components=False)
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]


@pytest.mark.parametrize("tower,feature_layer,strategy,tied", [
    ("pixtral", [-1, 1], "full", True),
    # The embedding output alone. As a list: transformers 5.24 reads an int 0 as
    # "output_hidden_states=False" and then fails.
    ("pixtral", [0], "full", False),
    ("clip", -2, "default", False),
    ("clip", [0, -1], "full", True),
    ("siglip", -1, "full", False),
    ("siglip", -2, "default", True),
])
def test_parity_across_towers_feature_layers_and_tying(tower, feature_layer, strategy, tied):
    if tower not in TOWERS:
        pytest.skip(f"vision family {tower!r} is not registered")
    cfg = llava_config(tower, feature_layer=feature_layer, strategy=strategy, tied=tied)
    report = harness.check("llava", cfg, seed=2, components=False)
    assert report.passed, [(r.check, r.metrics, r.first_divergence) for r in report.failures()]


def _pair(cfg, seed=0):
    fam = families.get("llava")
    ref = fam.build_reference(cfg)
    state = load_reference_weights(ref, None, seed)
    native = fam.build_native(cfg)
    native.load_state_dict(families.get("llava").hf_to_mcore(state, cfg)[0], strict=True)
    return ref, native


def _rel_l2(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
def test_native_loss_equals_transformers_causal_lm_loss():
    """HF's own loss (mean over its trained tokens) equals the native masked mean once HF stops
    training what mcore masks: each last image slot and each row's final token."""
    cfg = families.get("llava").tiny_config()
    ref, native = _pair(cfg, seed=4)
    (case,) = families.get("llava").hooks.parity.cases(cfg, seed=4)
    data = case.data
    images, sizes = llava_cases.vision_input(native, case, torch.float32, "cpu")
    loss, mask = native(images, data["input_ids"], None, None, labels=data["labels"],
                        loss_mask=data["loss_mask"], num_image_tiles=data["num_image_tiles"],
                        imgs_sizes=sizes)
    keep = data["length"]
    loss, mask = loss[:, :keep], mask[:, :keep]
    hf_ids = data["hf_input_ids"]
    trained = hf_ids != cfg.image_token_index
    trained[:, 1:] &= hf_ids[:, :-1] != cfg.image_token_index  # the token after an image
    hf_labels = hf_ids.masked_fill(~trained, -100)
    batch, padded = llava_cases._pixel_values(cfg, case, torch.float32, "cpu", families.tower_of).values()
    hf_loss = ref(input_ids=hf_ids, pixel_values=batch, image_sizes=padded, labels=hf_labels).loss
    native_mean = (loss * mask).sum() / mask.sum()
    assert mask.sum() == (hf_labels[:, 1:] != -100).sum()
    assert abs(native_mean.item() - hf_loss.item()) <= 1e-5 * hf_loss.item()


@torch.no_grad()
def test_text_only_batch_matches_transformers():
    cfg = families.get("llava").tiny_config()
    ref, native = _pair(cfg, seed=6)
    ids = torch.randint(0, 71, (2, 9), generator=torch.Generator().manual_seed(6))
    logits = native(None, ids, None, None, runtime_gather_output=True)[..., :101]
    assert _rel_l2(logits, ref(input_ids=ids).logits) <= 1e-5


@torch.no_grad()
def test_row_placeholders_with_media_token_counts_match_break_tokens():
    """Pixtral's processor ends every image row with a break token; one placeholder per row with
    ``media_token_counts`` reproduces that prompt exactly."""
    cfg = families.get("llava").tiny_config()
    ref, native = _pair(cfg, seed=7)
    rows, cols, brk, end = 3, 5, 12, 13
    image = torch.randn(3, 8 * rows, 8 * cols, generator=torch.Generator().manual_seed(7))
    hf_ids = [1, 2, 3]
    for r in range(rows):
        hf_ids += [cfg.image_token_index] * cols + [brk if r < rows - 1 else end]
    hf_ids += [4, 5]
    compact = [1, 2, 3] + [-200, brk] * (rows - 1) + [-200, end, 4, 5]
    expected = ref(input_ids=torch.tensor([hf_ids]), pixel_values=image[None],
                   image_sizes=torch.tensor([[8 * rows, 8 * cols]])).logits
    got = native(image[None], torch.tensor([compact]), None, None, runtime_gather_output=True,
                 media_token_counts=[cols] * rows)[..., :101]
    assert got.shape == expected.shape and _rel_l2(got, expected) <= 1e-5


@pytest.mark.parametrize("key,module", [
    ("vision_model.decoder.layers.0.mlp.linear_fc2.weight", "vision_model.layer.0.mlp"),
    ("vision_projection.encoder.linear_fc1.weight", "vision_projection"),
])
def test_negative_controls_locate_vision_and_projector(key, module):
    def perturb(state):
        state[key] = state[key].clone()
        state[key][0, 0] += 0.5

    report = harness.check("llava", seed=2, mutate_native=perturb, components=False)
    assert not report.passed
    assert {r.first_divergence.module for r in report.failures()} == {module}


def test_vision_layers_past_the_feature_layer_are_set_aside():
    """Feature layer -2 of 3: as in Megatron, the tower is built 2 layers deep; the last vision
    layer is not in the mcore state dict but kept aside (unused by any model) and round trips."""
    cfg = families.get("llava").tiny_config()
    state = hf_state(cfg, 2)
    shards = families.get("llava").hf_to_mcore(state, cfg)
    key = "vision_model.decoder.layers.2.mlp.linear_fc2.weight"
    assert key not in shards[0] and key in shards.side[0] and key in shards.unused
    assert "vision_model.decoder.layers.1.mlp.linear_fc2.weight" in shards[0]
    assert len(families.get("llava").build_native(cfg).vision_model.decoder.layers) == 2
    back = families.get("llava").mcore_to_hf(shards, cfg)
    assert all(torch.equal(back[k], v) for k, v in without_tied_head(state, cfg).items())


def test_causal_core_attention_against_explicit_softmax():
    """GQA grouping, the causal mask, and an extra mcore mask (True = masked) on top of it."""
    from types import SimpleNamespace

    from mmparity.models.parts.dense_decoder.native import CausalCoreAttention

    gen = torch.Generator().manual_seed(0)
    s, b, heads, groups, d = 5, 2, 4, 2, 3
    q, k, v = (torch.randn(s, b, n, d, generator=gen) for n in (heads, groups, groups))
    blocked = torch.zeros(b, 1, s, s, dtype=torch.bool)
    blocked[1, :, 3:, 1] = True  # row 1: later queries may not read key 1
    core = CausalCoreAttention(SimpleNamespace(kv_channels=d, hidden_size=heads * d,
                                               num_attention_heads=heads), layer_number=1)
    for mask in (None, blocked):
        out = core(q, k, v, attention_mask=mask).view(s, b, heads, d)
        for h in range(heads):
            g = h // (heads // groups)
            scores = torch.einsum("sbd,tbd->bst", q[:, :, h], k[:, :, g]) / d ** 0.5
            hidden = torch.ones(s, s, dtype=torch.bool).triu(1).expand(b, s, s)
            if mask is not None:
                hidden = hidden | mask[:, 0]
            weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)
            expected = torch.einsum("bst,tbd->sbd", weights, v[:, :, g])
            torch.testing.assert_close(out[:, :, h], expected)


# --------------------------------------------------------------------------------------------
# freeze
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def native_model():
    return families.get("llava").build_native(families.get("llava").tiny_config())


@pytest.mark.parametrize("lm", [False, True])
@pytest.mark.parametrize("vision", [False, True])
@pytest.mark.parametrize("projection", [False, True])
def test_freeze_sets_requires_grad_per_part(native_model, lm, vision, projection):
    model = native_model
    model.requires_grad_(True)
    model.freeze(freeze_language_model=lm, freeze_vision_model=vision,
                 freeze_vision_projection=projection, freeze_sound_model=True,
                 freeze_sound_projection=True, unfreeze_router=True)
    for name, param in model.named_parameters():
        part = name.split(".")[0]
        frozen = {"language_model": lm, "vision_model": vision, "vision_projection": projection}[part]
        assert param.requires_grad is not frozen, name


def test_frozen_parts_get_no_gradient(native_model):
    model = native_model
    model.requires_grad_(True)
    model.zero_grad(set_to_none=True)
    model.freeze(freeze_language_model=False, freeze_vision_model=True, freeze_vision_projection=False)
    cfg = families.get("llava").tiny_config()
    (case,) = families.get("llava").hooks.parity.cases(cfg, seed=1)
    images, sizes = llava_cases.vision_input(model, case, torch.float32, "cpu")
    loss, mask = model(images, case.data["input_ids"], None, None, labels=case.data["labels"],
                       loss_mask=case.data["loss_mask"], num_image_tiles=case.data["num_image_tiles"],
                       imgs_sizes=sizes)
    ((loss * mask).sum() / mask.sum()).backward()
    for name, param in model.named_parameters():
        if name.startswith("vision_model."):
            assert param.grad is None, name
    assert model.vision_projection.encoder.linear_fc1.weight.grad.abs().sum() > 0
    assert model.language_model.decoder.layers[0].self_attention.linear_qkv.weight.grad.abs().sum() > 0
    model.requires_grad_(True)


# --------------------------------------------------------------------------------------------
# refusals and the CLI
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change,message", [
    (dict(strategy="default"), "Pixtral tower has none"),
    (dict(feature_layer=-5), "does not select among the 4 hidden states"),
    (dict(sliding_window=16), "sliding_window=16"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope_type 'linear'"),
    (dict(attention_bias=True), "attention_bias=True"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        families.get("llava").build_native(llava_config(**change))


def test_unregistered_vision_tower_is_named():
    from transformers import LlavaConfig, SiglipVisionConfig

    cfg = LlavaConfig(vision_config=SiglipVisionConfig(), text_config=families.get("llava").tiny_config().text_config)
    cfg.vision_config.model_type = "dinov2"
    with pytest.raises(ValueError, match="'dinov2' is not supported; registered vision towers: pixtral"):
        families.get("llava").hf_to_mcore({}, cfg)


def test_cli_checks_a_saved_tied_checkpoint(tmp_path, capsys):
    from mmparity.cli.main import main

    cfg = llava_config(tied=True)
    model = families.get("llava").build_reference(cfg)
    model.load_state_dict(random_like_state(model.state_dict(), seed=21))
    model.save_pretrained(tmp_path)
    capsys.readouterr()
    assert main(["check", "llava", "--hf", str(tmp_path), "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "sample:logits" in out and "6 passed, 0 failed" in out
