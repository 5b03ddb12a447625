"""A dense language-model part and a whole VLM on it, written here, in the test, and registered for
its duration: the whole VLM composes a registered tower (CLIP) with the throwaway decoder, and
``check --impl megatron`` runs it in stock ``LLaVAModel`` (which holds a dense decoder whole) and
part by part, with nothing else edited. The throwaway packages of tests/models/throwaway, driven
through every command by test_throwaway_families.py, show the rest (conversion, detection, parity
with its localisation, a part with experts).
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from transformers import AutoConfig, AutoModel, LlamaConfig, LlamaModel, LlavaConfig

from mmparity.models import registry as families
from mmparity.models.llava import cases as llava_cases
from mmparity.models.llava import megatron as llava_megatron
from mmparity.models.parts.dense_decoder import mapping as dense_rules
from mmparity.mapping.rules import VOCAB_MULTIPLE, LanguageKeys
from mmparity.models.parts.dense_decoder import native as dense_native
from mmparity.models.core.layers import activation_from_hf, vision_transformer_config
from mmparity.cli.main import main
from mmparity.parity import harness
from mmparity.parity.metrics import FP32_REL_L2
from mmparity.models.clip import reference as clip_reference
from mmparity.models.parts.dense_decoder import reference as dense_reference
from mmparity.models.llava import reference as llava_reference
from mmparity.models.parts.dense_decoder import megatron as dense_decoder_megatron


# --- the language model: an HF text model transformers builds inside a VLM from its config -------

class ToyDecoderConfig(LlamaConfig):
    model_type = "toy_decoder"


class ToyDecoderModel(LlamaModel):
    config_class = ToyDecoderConfig


def _register_with_transformers():
    try:
        AutoConfig.register("toy_decoder", ToyDecoderConfig)
        AutoModel.register(ToyDecoderConfig, ToyDecoderModel)
    except ValueError:  # already registered by an earlier test in this process
        pass


def toy_transformer_config(text, params_dtype=torch.float32):
    """The decoder as mcore builds it: a Llama decoder, no bias, the config's head width."""
    return vision_transformer_config(
        num_layers=text.num_hidden_layers, hidden_size=text.hidden_size,
        num_attention_heads=text.num_attention_heads, num_query_groups=text.num_key_value_heads,
        kv_channels=text.head_dim, ffn_hidden_size=text.intermediate_size, normalization="RMSNorm",
        norm_eps=text.rms_norm_eps, activation=activation_from_hf(text.hidden_act), gated=True,
        bias=False, params_dtype=params_dtype)


def toy_builder(text, params_dtype=torch.float32):
    return dense_native.LanguageModelBuilder(text, params_dtype, config=toy_transformer_config(text, params_dtype))


BUILT = []


def toy_megatron_builder(cfg, params_dtype=torch.float32, divisible_by: int = VOCAB_MULTIPLE,
                         parallel_output: bool = True):
    """Megatron's class for the toy decoder: stock GPTModel, as for any Llama-style decoder (the
    call is recorded so the test sees its registry entry chose it)."""
    BUILT.append(cfg.text_config.model_type)
    return dense_decoder_megatron.build_language_model(cfg, params_dtype, divisible_by, parallel_output)


LANGUAGE_MODULES = {
    # Its own table: only the HF layout, the dense rules under its names.
    "mapping": dict(SPEC=LanguageKeys(layouts=("hf",), rules=dense_rules.language_rules,
                                         tp_problems=dense_rules.tp_problems)),
    "native": dict(transformer_config=toy_transformer_config, LanguageModelBuilder=toy_builder,
                   megatron_builder=toy_megatron_builder),
    "reference": dict(decoder_shapes=dense_reference.decoder_shapes),
}


# --- the whole VLM: a CLIP tower, the projector, the toy decoder -----------------------------------

def tiny_config() -> LlavaConfig:
    text = ToyDecoderConfig(vocab_size=75, hidden_size=24, intermediate_size=20, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            max_position_embeddings=256, tie_word_embeddings=False)
    return LlavaConfig(vision_config=clip_reference.tiny_config(), text_config=text, image_token_index=7,
                       projector_hidden_act="gelu", vision_feature_layer=-1,
                       vision_feature_select_strategy="default", multimodal_projector_bias=True,
                       tie_word_embeddings=False)


VLM_REFERENCE = dict(tiny_config=tiny_config, vision_config=llava_reference.vision_config,
                     build=llava_reference.build, state_shapes=llava_reference.state_shapes)


# Its Megatron classes: stock LLaVAModel holds a LLaVA on a CLIP tower whole (on the VLM's own tiny
# config), and its parts each alone.
VLM_MEGATRON = {"LLaVAModel": dataclasses.replace(llava_megatron.LLAVA_MODEL, default_config=None),
                **llava_megatron.whole_vlm_parts(why="checked beside LLaVAModel, part by part")}


def vlm_hooks(towers, languages):
    return llava_cases.hooks(towers, languages, llava_cases.Composition(megatron=VLM_MEGATRON),
                             sys.modules["mmparity.models.toy_vlm.reference"])


@pytest.fixture
def parts(monkeypatch):
    _register_with_transformers()
    for layer, names in LANGUAGE_MODULES.items():
        module = types.ModuleType(f"mmparity.models.parts.toy_decoder.{layer}")
        module.__dict__.update(names)
        monkeypatch.setitem(sys.modules, module.__name__, module)
    for layer, names in (("reference", VLM_REFERENCE), ("cases", {"hooks": vlm_hooks})):
        module = types.ModuleType(f"mmparity.models.toy_vlm.{layer}")
        module.__dict__.update(names)
        monkeypatch.setitem(sys.modules, module.__name__, module)
    # One registry entry each.
    monkeypatch.setitem(families._LANGUAGE_MODELS, "toy_decoder", families.LanguageModel(
        name="toy_decoder", summary="a throwaway decoder", text_model_types=("toy_decoder",),
        megatron="mmparity.models.parts.toy_decoder.native:megatron_builder"))
    monkeypatch.setitem(families._REGISTRY, "toy_vlm", families.Family(
        name="toy_vlm", summary="a throwaway whole VLM", reference_classes=("LlavaForConditionalGeneration",),
        composed=True, takes_whole=(
            families.Takes(architecture="LlavaForConditionalGeneration", text_model_type="toy_decoder"),
            families.Takes(model_type="llava", text_model_type="toy_decoder"))))
    return families.get("toy_vlm")


def _megatron_results(report):
    return [r for r in report.results if r.impl == "megatron"]


def test_impl_megatron_runs_its_whole_vlm_in_stock_llava_model(parts):
    assert parts.megatron_class()[0] == "LLaVAModel"
    report = harness.check("toy_vlm", seed=3, impl="megatron")
    results = _megatron_results(report)
    assert report.passed and results, [(r.check, r.metrics) for r in results]
    assert report.megatron["classes"] == {"toy_vlm": "LLaVAModel"}
    logits = next(r for r in results if r.check.endswith("logits"))
    assert logits.metrics["rel_l2"] <= FP32_REL_L2


def test_cli_check_impl_megatron_takes_it(parts, capsys):
    capsys.readouterr()
    code = main(["check", "toy_vlm", "--impl", "megatron", "--megatron-class", "MultimodalProjector"])
    out, err = capsys.readouterr()
    assert code == 0 and "MultimodalProjector" in out, out + err
