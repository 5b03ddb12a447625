"""``hfconfig.ConfigView`` (config.json read without transformers, for conversion) against
transformers' own configuration classes, on both sides of every case.

The view holds transformers' defaults in a table of its own; these tests are what keep that table
true. A case is a config.json mapping; the same mapping is loaded by ``AutoConfig`` and by the view,
and the two must agree on ``to_dict()`` and on every attribute the conversion path reads of them
(recorded while it runs). The mappings: every registered family's tiny config, a few of its random
configs and its published config where it has one, the Mistral-native translations, each as
transformers saves it (the values that differ from defaults) and as its full ``to_dict()``; every
saved form with one field left out (so each default and each derived field is taken from the
table); and a bare ``{"model_type": ...}`` for every model type the table has. A transformers
release that changes a default, a derived field or the RoPE standardisation fails here.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
from transformers import AutoConfig

from mmparity.models import registry as families
from mmparity import config as hfconfig
from mmparity.config import ConfigView
from mmparity.convert.configs import hf_config_tables

# The tables of every registered package, as conversion reads config.json with them.
TABLES = hf_config_tables()


def config_view(data: dict) -> ConfigView:
    return hfconfig.config_view(data, TABLES)

IGNORED = {"transformers_version", "_name_or_path"}
MISSING = object()


def _configs() -> dict[str, object]:
    """transformers config objects, by a readable id."""
    from mmparity.parity import bench
    from mmparity.models.parts.mistral_params import config_from_params, params_from_config

    found = {}
    for name in families.names():
        fam = families.get(name)
        found[f"{name}.tiny"] = fam.tiny_config()
        rng = random.Random(name)
        for i in range(3):
            found[f"{name}.random{i}"] = fam.hooks.config.random(lambda options: rng.choice(list(options)))
        if fam.hooks.bench.published is not None:
            found[f"{name}.published"] = bench.published_config(fam)
    for name in ("mistral3", "pixtral_12b"):
        found[f"{name}.params_json"] = config_from_params(params_from_config(families.get(name).tiny_config()))
    return found


CONFIGS = _configs()


def _saved(cfg) -> dict:
    return json.loads(cfg.to_json_string())  # what save_pretrained writes: the non-default values


def _full(cfg) -> dict:
    return {k: v for k, v in json.loads(json.dumps(cfg.to_dict())).items() if k not in IGNORED}


def _without(data: dict) -> list[tuple[str, dict]]:
    """``data`` with one field left out, for every field (sub-configs' fields included)."""
    out = []
    for key, value in data.items():
        if key in ("model_type",):
            continue
        out.append((key, {k: v for k, v in data.items() if k != key}))
        if isinstance(value, dict) and "model_type" in value:
            for sub_key, sub in _without(value):
                out.append((f"{key}.{sub_key}", {**data, key: sub}))
    return out


def _cases() -> list:
    cases = []
    for name, cfg in CONFIGS.items():
        cases += [pytest.param(_saved(cfg), id=f"{name}.saved"), pytest.param(_full(cfg), id=f"{name}.full")]
        if name.endswith(".tiny") or name.endswith(".params_json"):
            cases += [pytest.param(d, id=f"{name}.saved-{k}") for k, d in _without(_saved(cfg))]
    cases += [pytest.param({"model_type": t}, id=f"{t}.bare") for t in TABLES]
    return cases


def _transformers(tmp_path, data: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def _differences(ours, theirs, where: str = "") -> list[str]:
    found = []
    for key in sorted(set(ours) | set(theirs)):
        if key in IGNORED:
            continue
        a, b = ours.get(key, MISSING), theirs.get(key, MISSING)
        if isinstance(a, dict) and isinstance(b, dict):
            found += _differences(a, b, f"{where}{key}.")
        elif a != b:
            found.append(f"{where}{key}: view {'(none)' if a is MISSING else repr(a)}, transformers "
                         f"{'(none)' if b is MISSING else repr(b)}")
    return found


def _pairs(view: ConfigView, real) -> list[tuple[ConfigView, object, str]]:
    """(view, transformers' object, where) for the config and each of its sub-configs."""
    pairs = [(view, real, "")]
    for key in view.to_dict():
        sub = getattr(view, key, None)
        if isinstance(sub, ConfigView):
            pairs += [(v, r, f"{key}.{w}") for v, r, w in _pairs(sub, getattr(real, key))]
    return pairs


def _same(a, b) -> bool:
    if isinstance(a, ConfigView) or (hasattr(b, "to_dict") and not isinstance(b, dict)):
        return isinstance(a, ConfigView) and not _differences(a.to_dict(), b.to_dict())
    if b is not MISSING and type(b).__module__ == "torch":  # transformers holds dtype as torch's
        return a == str(b).split(".")[-1]
    return a == b


def _conversion_reads(view: ConfigView, family: str) -> list[tuple[ConfigView, str]]:
    """Every attribute the conversion path reads of ``view`` (family config, shapes, key tables,
    the config bound check), in order."""
    from mmparity.mapping.rules import expected_keys

    read = []
    original = ConfigView.__getattr__

    def recording(self, name):
        read.append((self, name))
        return original(self, name)

    ConfigView.__getattr__ = recording
    try:
        fam = families.get(family)
        cfg = fam.family_config(view)
        fam.state_shapes(cfg)
        expected_keys(fam.rule_set(cfg))
        cfg.to_dict()
    finally:
        ConfigView.__getattr__ = original
    return read


@pytest.mark.parametrize("data", _cases())
def test_view_is_what_transformers_holds(tmp_path, data):
    try:
        theirs = _transformers(tmp_path, data)
    except Exception as exc:  # a field left out that transformers cannot do without (its validators)
        pytest.skip(f"transformers refuses it: {str(exc).splitlines()[-1].strip()[:100]}")
    ours = config_view(data)
    assert not _differences(ours.to_dict(), theirs.to_dict()), _differences(ours.to_dict(), theirs.to_dict())
    for view, real, where in _pairs(ours, theirs):
        assert view.model_type == real.model_type, where
        for name in dir(type(real)):  # transformers' aliases and properties the conversion may read
            if name in ("rope_scaling", "num_labels") or name in real.attribute_map:
                assert _same(getattr(view, name, MISSING), getattr(real, name, MISSING)), f"{where}{name}"


def _their(real, attr: str):
    """transformers' value of ``attr``. A heterogeneous config (Gemma 4's per-layer head widths)
    refuses a read of a per-layer field off the whole config unless asked (the view holds the
    global value), and its ``per_layer_config`` is a view of configs, compared as it is saved."""
    if not getattr(real, "is_heterogeneous", False):
        return getattr(real, attr, MISSING)
    if attr == "per_layer_config":
        return real.to_dict().get(attr, MISSING)
    # Read without the check, not by setting allow_global_per_layer_attribute_access: setting it
    # would leave it in the config's to_dict.
    return real._getattr_without_heterogeneous_validation(attr, MISSING)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_conversion_reads_the_same_values(tmp_path, name):
    cfg = CONFIGS[name]
    family = name.split(".")[0]
    for data in (_saved(cfg), _full(cfg)):
        theirs = _transformers(tmp_path, data)
        ours = config_view(data)
        counterpart = {id(v): r for v, r, _ in _pairs(ours, theirs)}
        read = _conversion_reads(ours, family)
        assert read, "the recorder saw nothing"
        bad = [f"{view.model_type}.{attr}" for view, attr in read
               if not _same(getattr(view, attr, MISSING), _their(counterpart[id(view)], attr))]
        assert not bad, bad
        # And the conversion's results are the same from either config.
        fam = families.get(family)
        assert fam.state_shapes(fam.family_config(ours)) == fam.state_shapes(fam.family_config(theirs))


def test_rope_parameters_as_transformers_5_standardises_them(tmp_path):
    """Legacy spellings (``rope_scaling`` with ``type``, a top-level ``rope_theta``) end up where
    transformers puts them, and the facts read from them agree."""
    legacy = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 5e5,
              "max_position_embeddings": 64,
              "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}
    for data in (legacy, {"model_type": "pixtral", "rope_theta": 7.0},
                 {"model_type": "mistral3", "text_config": {"model_type": "mistral", "rope_theta": 3.0}}):
        ours, theirs = config_view(data), _transformers(tmp_path, data)
        assert not _differences(ours.to_dict(), theirs.to_dict())
        for view, real, _ in _pairs(ours, theirs):
            if hasattr(real, "rope_parameters"):
                assert hfconfig.rope_parameters(view) == hfconfig.rope_parameters(real)
                assert hfconfig.rope_theta(view) == hfconfig.rope_theta(real)


def test_the_comparison_can_fail(tmp_path, monkeypatch):
    """A default the table gets wrong, a derived field it forgets, and an alias it lacks are each
    caught."""
    data = {"model_type": "clip_vision_model", "hidden_size": 96}
    monkeypatch.setitem(TABLES["clip_vision_model"].fields, "patch_size", 33)
    assert _differences(config_view(data).to_dict(), _transformers(tmp_path, data).to_dict())
    monkeypatch.setattr(TABLES["mistral"], "before", None)
    data = {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4}
    assert _differences(config_view(data).to_dict(), _transformers(tmp_path, data).to_dict())
    monkeypatch.setattr(TABLES["qwen3_5_moe_vision"], "aliases", {})
    data = {"model_type": "qwen3_5_moe_vision", "hidden_size": 64, "num_attention_heads": 4}
    assert _differences(config_view(data).to_dict(), _transformers(tmp_path, data).to_dict())


def test_view_is_read_only_and_loud():
    view = config_view({"model_type": "clip_vision_model"})
    with pytest.raises(AttributeError, match="read-only"):
        view.hidden_size = 3
    edited = copy.copy(view)
    edited.num_hidden_layers = 1
    assert (edited.num_hidden_layers, view.num_hidden_layers) == (1, 12)
    with pytest.raises(AttributeError, match="no field .not_a_field."):
        view.not_a_field
    with pytest.raises(hfconfig.ConfigViewError, match="not one mmparity reads"):
        config_view({"model_type": "bert"})
