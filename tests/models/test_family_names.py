"""The registry is the one list of families: no module outside a family's own package and the
registry writes a family's name, so adding, renaming or removing a family touches its package
and one registry line, never a hand list elsewhere.

A family's name written as a string anywhere else in the package or the scripts fails here.
``PENDING`` names, module by module, what still does and why; it may only shrink: an entry whose
names are gone from its module fails too, so it is struck when the code moves.
"""

from __future__ import annotations

import ast
from pathlib import Path

from mmparity.models import registry

ROOT = Path(__file__).resolve().parents[2]

# Modules that still write family names (as HF ``model_type`` values that happen to equal them,
# or in builders of Megatron's classes not yet moved into their family's package), and the names.
PENDING = {
    # Megatron's class builders of the Pixtral-based towers, shared by the whole VLMs' vision
    # parts, not yet moved into their families' megatron.py as the other towers' are.
    "mmparity/models/core/megatron_classes.py": {"pixtral", "mistral3"},
}


def _family_of(path: Path) -> str | None:
    parts = path.relative_to(ROOT).parts
    if parts[:2] == ("mmparity", "models") and len(parts) > 3:
        return parts[2]
    return None


def _names_written(path: Path, families: set) -> set:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in families}


def _written_outside() -> dict:
    families = set(registry.names())
    found = {}
    for path in sorted([*(ROOT / "mmparity").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "mmparity/models/registry.py" or _family_of(path) in families:
            continue
        names = _names_written(path, families)
        if names:
            found[rel] = names
    return found


def test_no_family_name_is_written_outside_its_package_and_the_registry():
    found = _written_outside()
    new = {path: sorted(names - PENDING.get(path, set())) for path, names in found.items()}
    assert not {path: names for path, names in new.items() if names}, (
        "family names written outside their package and the registry: derive them from the registry "
        "(mmparity.models.registry) or move the code into the family's package")


def test_pending_only_shrinks():
    found = _written_outside()
    stale = {path: sorted(names - found.get(path, set())) for path, names in PENDING.items()}
    assert not {path: names for path, names in stale.items() if names}, "strike these from PENDING"


def test_a_family_name_written_elsewhere_is_caught(tmp_path):
    stray = tmp_path / "stray.py"
    stray.write_text(f"RUNS = {{{registry.names()[0]!r}: {{}}}}\n")
    assert _names_written(stray, set(registry.names())) == {registry.names()[0]}
