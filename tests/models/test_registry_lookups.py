"""A command resolves its family once and hands the record down: the package calls the registry's
lookups (``get``, ``resolve``, and the helpers that look a family up by name) in a few places only,
one per command path or public entry point, read here off the source by its syntax tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mmparity.models import registry

PACKAGE = Path(__file__).resolve().parents[2] / "mmparity"
REGISTRY = PACKAGE / "models" / "registry.py"
REGISTRY_MODULE = "mmparity.models.registry"
# The registry's functions that turn a family name into its record.
LOOKUPS = {"get", "resolve", "megatron_class", "converts_whole"}
MOST = 8


def lookups_in(tree: ast.AST) -> list[int]:
    """Line numbers of calls of a registry lookup: through a name the registry module is bound to
    (``registry.get(...)``, ``families.resolve(...)``) or a lookup imported by name from it."""
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "mmparity.models":
            modules |= {a.asname or a.name for a in node.names if a.name == "registry"}
        elif isinstance(node, ast.ImportFrom) and node.module == REGISTRY_MODULE:
            functions |= {a.asname or a.name for a in node.names if a.name in LOOKUPS}
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == REGISTRY_MODULE and a.asname}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in LOOKUPS and isinstance(func.value, ast.Name)
                and func.value.id in modules):
            lines.append(node.lineno)
        elif isinstance(func, ast.Name) and func.id in functions:
            lines.append(node.lineno)
    return sorted(lines)


def registry_lookups() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == REGISTRY:
            continue  # the lookups' own definitions
        for line in lookups_in(ast.parse(path.read_text(), str(path))):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return found


def test_the_package_looks_a_family_up_at_most_once_per_command_path():
    found = registry_lookups()
    assert len(found) <= MOST, (f"{len(found)} registry lookups in mmparity/ (at most {MOST}: resolve the "
                                f"family where a command starts and pass the record down): {', '.join(found)}")


@pytest.mark.parametrize("source, count", [
    ("from mmparity.models import registry\nregistry.get('clip')\nregistry.names()", 1),
    ("from mmparity.models import registry as families\nfamilies.resolve(x)\nfamilies.families()", 1),
    ("from mmparity.models.registry import megatron_class as m\nm('clip')\n", 1),
    ("import mmparity.models.registry as r\nr.converts_whole('clip', f)\nr.get('a')", 2),
    ("d = {}\nd.get('clip')\n", 0),  # a dict's get is no registry lookup
])
def test_the_count_sees_each_way_of_calling_the_registry(source, count):
    assert len(lookups_in(ast.parse(source))) == count


def test_families_are_the_records_in_registry_order_and_resolve_passes_a_record_through():
    records = registry.families()
    assert [fam.name for fam in records] == registry.names()
    assert all(isinstance(fam, registry.Family) for fam in records)
    clip = registry.resolve("clip")
    assert registry.resolve(clip) is clip
    with pytest.raises(registry.UnknownFamilyError, match="valid families"):
        registry.resolve("no_such_family")


def test_a_record_crosses_to_another_process_by_name():
    import pickle

    fam = registry.resolve("siglip")
    fam.hooks  # loaded hooks hold closures, which do not pickle
    assert pickle.loads(pickle.dumps(fam)) is fam
