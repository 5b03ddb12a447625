"""Whole VLMs composed from parts (``mistral3``, ``pixtral_12b``): the Pixtral processor's image
layout, and negative controls that name the part a fault belongs to."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mmparity.models import registry as families
from mmparity.models.core import inputs, processor
from mmparity.models.llava import cases as llava
from mmparity.models.core.inputs import random_like_state
from mmparity.mapping.rules import with_side
from mmparity.parity import harness
from mmparity.parity.metrics import compare

WHOLE_ROWS = ("mistral3", "pixtral_12b")


@pytest.fixture
def real_pixtral_processor(monkeypatch):
    """transformers' PixtralProcessor module, importable here only with torchvision stood in for:
    it imports torchvision at module level though the PIL image backend needs none of it."""
    import transformers  # noqa: F401  (probes torchvision's presence before the stand-in exists)

    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                 "torchvision.transforms.v2.functional"):
        if name not in sys.modules:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for name in ("transformers.models.pixtral.processing_pixtral",
                 "transformers.models.pixtral.image_processing_pixtral"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield
    for name in ("transformers.models.pixtral.processing_pixtral",
                 "transformers.models.pixtral.image_processing_pixtral"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("family", WHOLE_ROWS)
def test_processor_layout_is_hf_processors_token_for_token(real_pixtral_processor, family):
    cfg = families.get(family).tiny_config()
    assert processor.real_processor(cfg, 64) is not None
    # Odd sizes the processor resizes (33x70), and three images in one row.
    imgs = [llava._as_uint8(i) for i in inputs.images([(48, 80), (80, 32), (33, 70)], 3, 1)]
    text = [f"{processor.word(1)} [IMG] {processor.word(3)} [IMG] [IMG] {processor.word(4)}"]
    real = processor.process(cfg, text, [imgs], 64)
    ours = processor.process(cfg, text, [imgs], 64, use_real=False)
    for key in ("input_ids", "pixel_values", "image_sizes"):
        assert torch.equal(real[key], ours[key]), key
    ids = processor.special_ids(cfg)
    row = real["input_ids"][0].tolist()
    assert row.count(ids.image_end) == 3 and row.count(ids.image_break) > 0


@pytest.mark.parametrize("family", WHOLE_ROWS)
def test_cases_carry_break_and_end_tokens_as_text(family):
    cfg = families.get(family).tiny_config()
    case = families.get(family).hooks.parity.cases(cfg, 3)[0]
    ids = processor.special_ids(cfg)
    hf = case.data["hf_input_ids"]
    assert (hf == ids.image_end).sum() == len(case.data["images"]) == 3
    # One placeholder per image row, in the compact ids the native side reads.
    assert (case.data["input_ids"] == llava.PLACEHOLDER).sum() == len(case.data["media_token_counts"])
    assert sum(case.data["media_token_counts"]) == (hf == cfg.image_token_index).sum()


def _one_run_per_image(case, cfg):
    """The LLaVA layout on the native side: each image's rows in one run, its break and end tokens
    after it (so the rows have the same length, only the layout is wrong)."""
    ids = processor.special_ids(cfg)
    compact, counts = [], []
    for row in case.data["hf_input_ids"].tolist():
        out, pending = [], []
        for token in row:
            if token == cfg.image_token_index:
                if not pending and (not out or out[-1] != llava.PLACEHOLDER):
                    out.append(llava.PLACEHOLDER)
                    counts.append(0)
                counts[-1] += 1
            elif token == ids.image_break:
                pending.append(token)
            elif token == ids.image_end:
                out += pending + [token]
                pending = []
            else:
                out.append(token)
        compact.append(out)
    wrong = llava._mcore_side(cfg, compact, 0)
    data = dict(case.data, media_token_counts=counts, **wrong)
    return type(case)(case.name, data, case.outputs, case.description)


@pytest.mark.parametrize("family", WHOLE_ROWS)
def test_negative_control_wrong_image_layout_fails(family):
    fam = families.get(family)
    cfg = fam.tiny_config()
    ref = fam.build_reference(cfg)
    state = random_like_state(ref.state_dict(), seed=7)
    ref.load_state_dict(state)
    native = fam.build_native(cfg)
    native.load_state_dict(with_side(fam.hf_to_mcore(state, cfg))[0])
    case = fam.hooks.parity.prepare_case(fam.hooks.parity.cases(cfg, 5)[0], cfg)
    with torch.no_grad():
        expected = fam.hooks.reference.run(ref, case)["logits"]
        right = fam.hooks.native.run(native, case)["logits"]
        wrong = fam.hooks.native.run(native, _one_run_per_image(case, cfg))["logits"]
    assert compare(right, expected).rel_l2 < 1e-5
    assert compare(wrong, expected).rel_l2 > 1e-2


@pytest.mark.parametrize("family,key,part", [
    ("mistral3", "language_model.decoder.layers.1.mlp.linear_fc2.weight", "language_model.decoder.layers.1.mlp"),
    ("mistral3", "vision_model.merger.linear_fc1.weight", "vision_model.merger"),
    ("mistral3", "vision_projection.encoder.linear_fc2.weight", "vision_projection"),
    ("pixtral_12b", "vision_model.decoder.layers.0.self_attention.linear_proj.weight",
     "vision_model.layer.0.self_attention"),
    ("pixtral_12b", "language_model.decoder.final_layernorm.weight", "language_model.decoder.final_layernorm"),
])
def test_negative_control_names_the_part(family, key, part):
    def perturb(state):
        state[key] = state[key].clone()
        state[key].view(-1)[0] += 0.5

    report = harness.check(family, seed=2, mutate_native=perturb, components=False)
    assert not report.passed
    assert {r.first_divergence.module for r in report.failures()} == {part}


# --- conversion grid: HF <-> Megatron's LLaVAModel layout, TP 1/4 x PP 1/2, both formats -----------
# (TP 2 x PP 2 runs for every family in tests/mapping/test_convert_roundtrips.py.)

@pytest.fixture(scope="module")
def whole_hf_dirs(tmp_path_factory):
    from tests.mapping.test_convert_roundtrips import save_hf

    root = tmp_path_factory.mktemp("whole")
    return {name: save_hf(name, root / name, seed=11 + i) for i, name in enumerate(WHOLE_ROWS)}


@pytest.mark.slow  # torch_dist writes spawn one rank per TP x PP cell
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (4, 1), (1, 2), (4, 2)])
@pytest.mark.parametrize("family", WHOLE_ROWS)
def test_whole_vlm_round_trip_grid_is_bit_exact(family, tp, pp, fmt, whole_hf_dirs, tmp_path):
    from mmparity.io.manifest import read_manifest
    from mmparity.io.verify import verify
    from mmparity.cli.main import main
    from tests.mapping.test_convert_roundtrips import assert_same_checkpoint

    src = whole_hf_dirs[family]
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["convert", "--src", str(src), "--dst", str(mcore), "--to", "mcore", "--family", family,
                 "--tp", str(tp), "--pp", str(pp), "--format", fmt, "--quiet"]) == 0
    if fmt == "legacy":  # torch_dist holds global tensors, whatever the TP/PP it was cut for
        manifest = read_manifest(mcore)
        assert (manifest.tensor_parallel_size, manifest.pipeline_parallel_size) == (tp, pp)
    assert verify(mcore).ok
    assert main(["convert", "--src", str(mcore), "--dst", str(back), "--to", "hf", "--quiet"]) == 0
    assert_same_checkpoint(back, src)


def test_whole_vlm_vocabulary_is_padded_as_megatron_lm_pads_it():
    fam = families.get("mistral3")
    cfg = fam.tiny_config()
    state = random_like_state(fam.build_reference(cfg).state_dict(), seed=1)
    for tp, rows in ((1, 128), (4, 512)):
        shards = fam.hf_to_mcore(state, cfg, tp_size=tp)
        for key in ("language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight"):
            assert sum(s[key].shape[0] for s in shards) == rows, (key, tp)
            full = torch.cat([s[key] for s in shards])
            assert torch.equal(full[:97], state[key.replace("language_model.embedding.word_embeddings", "model.language_model.embed_tokens").replace("language_model.output_layer", "lm_head")])
            assert not full[97:].any()


# --- the Mistral-native layout (consolidated.safetensors) of whole models -----------------------
# Names after transformers' convert_pixtral_weights_to_hf.py / convert_mistral3_weights_to_hf.py
# tables; HF's q/k rows are the native ones permuted for rotate-half RoPE (permute_for_rope).

_WHOLE_TO_MISTRAL = [
    (r"^model\.language_model\.embed_tokens\.", "tok_embeddings."),
    (r"^model\.language_model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.", r"layers.\1.attention.w\2."),
    (r"^model\.language_model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attention_norm."),
    (r"^model\.language_model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.ffn_norm."),
    (r"^model\.language_model\.layers\.(\d+)\.mlp\.gate_proj\.", r"layers.\1.feed_forward.w1."),
    (r"^model\.language_model\.layers\.(\d+)\.mlp\.down_proj\.", r"layers.\1.feed_forward.w2."),
    (r"^model\.language_model\.layers\.(\d+)\.mlp\.up_proj\.", r"layers.\1.feed_forward.w3."),
    (r"^model\.language_model\.norm\.", "norm."),
    (r"^lm_head\.", "output."),
]


def _whole_mistral_name(key: str) -> str:
    import re

    from tests.io.test_mistral_layout import _TO_MISTRAL, _rename

    for pattern, repl in _WHOLE_TO_MISTRAL:
        new, n = re.subn(pattern, repl, key)
        if n:
            return new
    return _rename(key[len("model."):], _TO_MISTRAL)


def _native_qk(hf_value: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo permute_for_rope: rotate-half halves per head -> interleaved pairs."""
    rows, cols = hf_value.shape
    return hf_value.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _mistral_native_state(family: str, seed: int) -> tuple[dict, dict, object]:
    import re

    fam = families.get(family)
    cfg = fam.tiny_config()
    hf = random_like_state(fam.build_reference(cfg).state_dict(), seed=seed)
    text, vision = cfg.text_config, cfg.vision_config
    native = {}
    for key, value in hf.items():
        if re.search(r"language_model\.layers\.\d+\.self_attn\.q_proj\.weight$", key):
            value = _native_qk(value, text.num_attention_heads)
        elif re.search(r"language_model\.layers\.\d+\.self_attn\.k_proj\.weight$", key):
            value = _native_qk(value, text.num_key_value_heads)
        elif re.search(r"vision_tower\.transformer\.layers\.\d+\.attention\.[qk]_proj\.weight$", key):
            value = _native_qk(value, vision.num_attention_heads)
        native[_whole_mistral_name(key)] = value
    return hf, native, cfg


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("family", WHOLE_ROWS)
def test_mistral_native_layout_gives_the_same_mcore_and_round_trips(family, tp):
    fam = families.get(family)
    hf, native, cfg = _mistral_native_state(family, seed=tp)
    assert any(k.startswith("vision_encoder.") for k in native) and "tok_embeddings.weight" in native
    from_native = fam.hf_to_mcore(native, cfg, tp_size=tp)
    from_hf = fam.hf_to_mcore(hf, cfg, tp_size=tp)
    for a, b in zip(from_native, from_hf):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
    back = fam.mcore_to_hf(from_native, cfg, hf_format="mistral")
    assert back.keys() == native.keys()
    for key, value in native.items():
        assert torch.equal(back[key], value), key


@pytest.fixture(scope="module")
def mistral_native_dirs(tmp_path_factory):
    """Mistral-native releases as they ship: consolidated.safetensors + params.json, no config.json."""
    import json

    from safetensors.torch import save_file

    from mmparity.models.parts.mistral_params import params_from_config

    out = {}
    for family in WHOLE_ROWS:
        hf, native, cfg = _mistral_native_state(family, seed=21)
        path = tmp_path_factory.mktemp("native") / family
        path.mkdir()
        save_file({k: v.contiguous() for k, v in native.items()}, str(path / "consolidated.safetensors"))
        (path / "params.json").write_text(json.dumps(params_from_config(cfg)))
        out[family] = (path, hf, cfg)
    return out


@pytest.mark.parametrize("family", WHOLE_ROWS)
def test_mistral_native_release_converts_without_config_json_or_family(family, mistral_native_dirs, tmp_path, capsys):
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
    from mmparity.cli.main import main

    path, hf, cfg = mistral_native_dirs[family]
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["convert", "--src", str(path), "--dst", str(mcore), "--to", "mcore", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert f"family: {family} (from params.json" in out and "left out" not in out
    assert main(["convert", "--src", str(mcore), "--dst", str(back), "--to", "hf", "--quiet"]) == 0
    exported = load_safetensors_state_dict(back)
    # The HF export of a Mistral-native source is the model transformers would hold, bit for bit.
    expected = families.get(family).mcore_to_hf(families.get(family).hf_to_mcore(hf, cfg, tp_size=2), cfg,
                                                hf_format="hf_checkpoint")
    assert exported.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(exported[key], value), key


@pytest.mark.parametrize("family", WHOLE_ROWS)
def test_check_reads_a_mistral_native_release(family, mistral_native_dirs, capsys):
    from mmparity.cli.main import main

    path, _, _ = mistral_native_dirs[family]
    code = main(["check", "--hf", str(path), "--no-components"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"family: {family}" in out


@pytest.mark.parametrize("family", WHOLE_ROWS)
def test_params_json_translates_to_the_same_hf_config(family):
    from mmparity.models.parts.mistral_params import config_from_params, params_from_config

    cfg = families.get(family).tiny_config()
    back = config_from_params(params_from_config(cfg))
    assert type(back) is type(cfg)
    skip = {"transformers_version", "architectures", "_name_or_path"}
    assert ({k: v for k, v in back.to_dict().items() if k not in skip}
            == {k: v for k, v in cfg.to_dict().items() if k not in skip})


@pytest.mark.parametrize("change, message", [
    (lambda p: p.update(moe={"num_experts": 8}), "fields not translated: moe"),
    (lambda p: p["vision_encoder"].update(mm_projector_id="mlp"), "only the patch merger"),
    (lambda p: p.update(sliding_window=4096), "sliding_window=4096"),
    (lambda p: p.pop("dim"), "missing dim"),
])
def test_params_json_that_cannot_be_translated_is_refused_by_name(change, message):
    from mmparity.models.parts.mistral_params import ParamsError, config_from_params, params_from_config

    params = params_from_config(families.get("mistral3").tiny_config())
    change(params)
    with pytest.raises(ParamsError, match=message):
        config_from_params(params)
