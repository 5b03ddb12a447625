"""The HF config tables and Mistral-native release records live in the packages of the models that
read them; conversion collects them through the registry. What holds them together: every
registered package's tables are found (and a model type declared twice is named), the release
records say what the translation of a params.json builds, and whether a whole VLM merges patches
is read off its configuration class, not off a value its file happens to carry."""

from __future__ import annotations

import copy
import json
import pickle
import sys
import types

import pytest

from mmparity import config as hfconfig
from mmparity.convert.configs import hf_config_tables, read_config_facts
from mmparity.models import registry as families
from mmparity.models.parts.mistral_params import config_from_params, params_from_config


def test_every_table_comes_from_a_registered_package():
    tables = hf_config_tables()
    owners = {t: m.__name__ for m in families.config_modules() for t in getattr(m, "HF_CONFIGS", {})}
    assert set(tables) == set(owners) and tables
    # Every sub-config a table defaults to is read with a table of its own.
    defaults = {sub[0] for table in tables.values() for sub in table.subs.values()}
    assert defaults <= set(tables), defaults - set(tables)
    # Each registered family reads its own tiny config through them (sub-configs included).
    for name in families.names():
        data = json.loads(families.get(name).tiny_config().to_json_string())
        if data.get("model_type") in tables:
            assert hfconfig.config_view(data, tables).model_type == data["model_type"]


def test_a_model_type_declared_twice_is_named(monkeypatch):
    first = next(m for m in families.config_modules() if getattr(m, "HF_CONFIGS", None))
    model_type = next(iter(first.HF_CONFIGS))
    twin = types.ModuleType("mmparity.models.twin.config")
    twin.HF_CONFIGS = {model_type: first.HF_CONFIGS[model_type]}
    monkeypatch.setattr(families, "config_modules", lambda: [first, twin])
    with pytest.raises(ValueError, match=f"model_type '{model_type}' has a config table in both "
                                         f"{first.__name__} and mmparity.models.twin.config"):
        hf_config_tables()


def test_a_package_without_a_config_module_is_skipped(monkeypatch):
    """A throwaway family's package (only its modules in sys.modules) declares no tables."""
    monkeypatch.setitem(sys.modules, "mmparity.models.toy_tables.cases", types.ModuleType("cases"))
    monkeypatch.setitem(families._REGISTRY, "toy_tables",
                        families.Family(name="toy_tables", summary="", reference_classes=()))
    found = [m.__name__ for m in families.config_modules()]
    assert "mmparity.models.toy_tables.config" not in found and found


def _native_takers() -> list[str]:
    return [name for name in families.names()
            if any(t.layout == families.MISTRAL_NATIVE for t in families.get(name).takes_whole)]


@pytest.mark.parametrize("family", _native_takers())
def test_a_native_release_is_detected_as_its_translation_says(tmp_path, family):
    """The facts detection reads off params.json (from the packages' records, without
    transformers) are the model types its translation builds, and name the family back."""
    params = params_from_config(families.get(family).tiny_config())
    (tmp_path / "params.json").write_text(json.dumps(params))
    facts = read_config_facts(tmp_path)
    translated = config_from_params(params)
    assert (facts.model_type, facts.vision_model_type, facts.text_model_type) == (
        translated.model_type, translated.vision_config.model_type, translated.text_config.model_type)
    assert families.detect(facts).family == family


def test_patch_merger_is_the_class_not_a_stray_value(tmp_path):
    from transformers import AutoConfig

    tables = hf_config_tables()
    whole = {t: table.fields for t, table in tables.items() if "text_config" in table.fields}
    merged = [t for t, fields in whole.items() if "spatial_merge_size" in fields]
    plain = [t for t, fields in whole.items() if "spatial_merge_size" not in fields]
    assert merged and plain
    for model_type in merged:
        view = hfconfig.config_view({"model_type": model_type, "spatial_merge_size": 3}, tables)
        for cfg in (view, copy.copy(view), copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
            assert hfconfig.has_patch_merger(cfg) and hfconfig.spatial_merge(cfg) == 3
    for model_type in plain:
        data = {"model_type": model_type, "spatial_merge_size": 3}
        path = tmp_path / "config.json"
        path.write_text(json.dumps(data))
        real = AutoConfig.from_pretrained(str(path), local_files_only=True)
        view = hfconfig.config_view(data, tables)
        assert view.spatial_merge_size == real.spatial_merge_size == 3  # kept as a value, as transformers does
        assert not hfconfig.has_patch_merger(view) and not hfconfig.has_patch_merger(real), model_type
        assert hfconfig.spatial_merge(view) == hfconfig.spatial_merge(real) == 1
