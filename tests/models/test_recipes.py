"""Each family's HF config -> ``TransformerConfig`` recipe is written once (its ``config.py``) and
both sides read it: the native model's config and the one Megatron's own class is built with
agree on every field but the activation object (each side's own function for the same HF name,
compared on values) and the attention fields a projector MLP never reads."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from mmparity.models import registry as families
from mmparity.models.clip import megatron as clip_megatron, native as clip_native
from mmparity.models.kimi_k25 import megatron as kimi_megatron, native as kimi_native
from mmparity.models.llava import megatron as llava_megatron, native as llava_native
from mmparity.models.parts.dense_decoder import megatron as dense_megatron, native as dense_native
from mmparity.models.parts.dense_decoder.config import transformer_fields as dense_fields
from mmparity.models.pixtral import megatron as pixtral_megatron, native as pixtral_native
from mmparity.models.pixtral_large import native as pixtral_large_native
from mmparity.models.qwen3_5 import megatron as qwen_megatron, native as qwen_native
from mmparity.parallel import runtime

# Random draws (initialisers) and the activation object, which each side picks for itself.
_NOT_COMPARED = ("init_method", "output_layer_init_method", "embedding_init_method", "activation_func")
# What a projector's MLP reads; its attention fields only have to pass TransformerConfig's checks.
_PROJECTOR_FIELDS = ("hidden_size", "ffn_hidden_size", "normalization", "layernorm_epsilon", "gated_linear_unit",
                     "add_bias_linear", "params_dtype", "num_layers")


@pytest.fixture(autouse=True)
def _tp1():
    if runtime.current_layout() is None:
        runtime.init_parallel(1, 1)


def _same_activation(a, b):
    x = torch.randn(37, generator=torch.Generator().manual_seed(11)) * 4
    torch.testing.assert_close(a.activation_func(x), b.activation_func(x), rtol=0, atol=0)


def _differences(a, b, names=None) -> dict:
    names = names or [f.name for f in dataclasses.fields(a) if f.name not in _NOT_COMPARED]
    return {n: (getattr(a, n), getattr(b, n)) for n in names if getattr(a, n) != getattr(b, n)}


def _configs(name: str, seeds=(0, 1, 2)):
    """The family's tiny config and a few of its random ones (awkward head counts and widths)."""
    random_config = families.get(name).hooks.config.random
    yield families.get(name).tiny_config()
    for seed in seeds:
        rng = random.Random(seed)
        yield random_config(lambda options: rng.choice(list(options)))


TOWERS = {
    "clip": (clip_native.transformer_config, clip_megatron.transformer_config),
    "siglip": (clip_native.transformer_config, clip_megatron.transformer_config),
    "pixtral": (pixtral_native.transformer_config, pixtral_megatron.transformer_config),
    "qwen3_5": (qwen_native.transformer_config, qwen_megatron.transformer_config),
    "kimi_k25": (kimi_native.transformer_config, kimi_megatron.transformer_config),
}


@pytest.mark.parametrize("name", sorted(TOWERS))
def test_a_towers_native_and_megatron_configs_are_one_recipe(name):
    native, megatron = TOWERS[name]
    for cfg in _configs(name):
        vc = getattr(cfg, "vision_config", cfg)
        for dtype in (torch.float32, torch.bfloat16):
            a, b = native(vc, dtype), megatron(vc, dtype)
            assert not _differences(a, b), (name, _differences(a, b))
            _same_activation(a, b)


@pytest.mark.parametrize("name", ["llava", "mistral3", "pixtral_12b"])
def test_the_dense_decoders_native_and_megatron_configs_are_one_recipe(name):
    for cfg in _configs(name):
        a = dense_native.transformer_config(cfg.text_config)
        b = dense_megatron.language_model_args(cfg).config
        assert not _differences(a, b), (name, _differences(a, b))
        _same_activation(a, b)


def test_an_unset_key_value_head_count_is_one_group_per_head_as_transformers_reads_it():
    text = SimpleNamespace(model_type="llama", num_hidden_layers=3, hidden_size=20, num_attention_heads=5,
                           intermediate_size=14, rms_norm_eps=1e-5, hidden_act="silu", head_dim=None)
    assert dense_fields(text)["num_query_groups"] == 5
    text.num_key_value_heads = None
    assert dense_fields(text)["num_query_groups"] == 5
    text.num_key_value_heads = 1
    assert dense_fields(text)["num_query_groups"] == 1


PROJECTORS = {
    "llava": llava_native.projection_transformer_config,
    "pixtral_12b": llava_native.projection_transformer_config,
    "mistral3": pixtral_large_native.projector_config,
    "pixtral_large": pixtral_large_native.projector_config,
}


@pytest.mark.parametrize("name", sorted(PROJECTORS))
def test_a_vlms_projector_configs_are_one_recipe(name):
    for cfg in _configs(name):
        a, b = PROJECTORS[name](cfg), llava_megatron.vlm_projection_config(cfg)
        assert not _differences(a, b, _PROJECTOR_FIELDS), (name, _differences(a, b, _PROJECTOR_FIELDS))
        _same_activation(a, b)


def test_kimis_projector_configs_are_one_recipe():
    for cfg in _configs("kimi_k25"):
        if not hasattr(cfg, "vision_config"):
            continue  # a tower alone has no projector
        a, b = kimi_native.projection_config(cfg), kimi_megatron.projection_config(cfg)
        assert not _differences(a, b, _PROJECTOR_FIELDS), _differences(a, b, _PROJECTOR_FIELDS)
        _same_activation(a, b)
