"""The registry is one line per package: a family's record is its package's ``FAMILY``, a
language-model part's its ``PART``, and the name is the package's. A package outside the tree is
registered by ``MMPARITY_FAMILIES`` in every command (and every rank it starts), or in one process
by ``registry.register``; a name that is no such package is a one-line usage error."""

from __future__ import annotations

import importlib
import json
import sys

import pytest

from mmparity.models import registry
from tests.faults.test_faults import one_line_error, run_subprocess

RECORD = '''from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(summary="a family from outside the tree", reference_classes=("OutsideModel",),
                takes_whole=(Takes(architecture="OutsideModel"),))
'''


def test_every_record_is_its_packages_and_named_after_it():
    for packages, listed in ((registry.FAMILIES, registry.names()),
                             (registry.LANGUAGE_MODELS, registry.language_models())):
        assert listed == [p.rpartition(".")[2] for p in packages]
    for name in registry.names():
        record = registry.get(name)
        assert record.package == f"mmparity.models.{name}"
        assert importlib.import_module(record.package).FAMILY.summary == record.summary


@pytest.fixture
def outside(tmp_path, monkeypatch):
    package = tmp_path / "outside_family"
    package.mkdir()
    (package / "__init__.py").write_text(RECORD)
    # Another package of the same name, elsewhere.
    (tmp_path / "twin" / "outside_family").mkdir(parents=True)
    (tmp_path / "twin" / "__init__.py").write_text("")
    (tmp_path / "twin" / "outside_family" / "__init__.py").write_text(RECORD)
    monkeypatch.syspath_prepend(str(tmp_path))
    # Each test's package is its own: nothing of another test's import is kept.
    for name in [m for m in sys.modules if m.split(".")[0] in ("outside_family", "twin")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


def test_register_adds_a_package_and_unregister_takes_it_back(outside):
    record = registry.register("outside_family")
    try:
        assert record.name == "outside_family" and registry.names()[-1] == "outside_family"
        facts = registry.ConfigFacts("config.json", ("OutsideModel",))
        assert registry.detect(facts).family == "outside_family"
        with pytest.raises(registry.RegistryError, match="registered already"):
            registry.register("twin.outside_family")
    finally:
        registry.unregister("outside_family")
    assert "outside_family" not in registry.names()


def test_the_environment_registers_it_in_a_command(outside):
    code, out, err = run_subprocess("list", "--json", env={"MMPARITY_FAMILIES": "outside_family",
                                                           "PYTHONPATH": f"{registry_root()}:{outside}"})
    assert code == 0, err
    rows = json.loads(out)
    assert rows[-1]["family"] == "outside_family" and rows[-1]["summary"] == "a family from outside the tree"


@pytest.mark.fault
@pytest.mark.parametrize("value, needle", [("no_such.package", "cannot import it"),
                                           ("json", "defines no FAMILY"),
                                           ("mmparity.models.clip, ,mmparity.models.parts", "defines no FAMILY")])
def test_a_name_that_is_no_family_package_is_one_line(value, needle):
    code, out, err = run_subprocess("list", env={"MMPARITY_FAMILIES": value})
    one_line_error(code, out, err, "MMPARITY_FAMILIES" if needle == "cannot import it" else needle)


def registry_root() -> str:
    from pathlib import Path

    return str(Path(registry.__file__).resolve().parents[2])


def test_two_towers_of_one_model_type_are_refused_not_chosen_by_order(outside, monkeypatch):
    """A second family whose table serves as the LLaVA tower of CLIP's model type: which one a LLaVA
    used would depend on the registry's order, so the lookup refuses, naming both."""
    (outside / "outside_family" / "mapping.py").write_text("from mmparity.models.clip.mapping import SPEC  # noqa: F401\n")
    registry.register("outside_family")
    try:
        llava = registry.get("llava")
        with pytest.raises(registry.RegistryError, match="'clip' and 'outside_family' both serve"):
            llava.state_shapes(llava.tiny_config())
    finally:
        registry.unregister("outside_family")
