"""The layer rule, read off the source: every import of ``mmparity`` (function-level ones included)
points down the stack, and the import graph has no cycle.

Bottom to top (docs/architecture.md draws it): HF config facts; the parallel axes and splits; the
mapping engine (rules, ops with inverses); the disk layer (formats, manifest, fsio), which knows
tensors and names and never a model; the models (shared blocks and records, reusable parts, one
package per family, the registry); the conversion pipeline; Megatron's own classes under test
(verify --load, the live API); the parity harness and bench; the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "mmparity"

# Module-name prefix -> layer; the longest matching prefix wins.
LAYERS = {
    "mmparity": 0,
    "mmparity.errors": 0,
    "mmparity.config": 0,
    "mmparity.parallel": 1,
    "mmparity.mapping": 2,
    "mmparity.io": 3,
    # Shared mcore blocks, the records a family fills, and Megatron's classes built from configs.
    "mmparity.models.core": 4,
    "mmparity.models.spec": 4,
    "mmparity.models.record": 4,
    # Parts several families are made of (decoders), then the families, then the one list.
    "mmparity.models.parts": 5,
    "mmparity.models": 6,
    "mmparity.models.registry": 7,
    "mmparity.convert": 8,
    "mmparity.megatron": 9,
    "mmparity.parity": 10,
    "mmparity.cli": 11,
    "mmparity.__main__": 12,
}
# Same layer, still never importing each other: a family's (or part's) native model and its
# transformers reference, by the last component of the module name.
APART = [("native", "reference")]
# Third-party packages a layer must not import.
FORBIDDEN = {
    "mmparity.mapping": ("transformers", "megatron", "safetensors", "os", "pathlib", "mmap", "ctypes",
                         "shutil", "tempfile", "io"),
    "mmparity.config": ("transformers", "megatron", "torch"),
    "mmparity.errors": ("transformers", "megatron", "torch"),
    "mmparity.parallel.axes": ("transformers", "megatron", "torch"),
    "mmparity.io": ("transformers", "megatron"),
}
# What each family package's native / reference modules must not import.
FORBIDDEN_BY_NAME = {"native": ("transformers",), "reference": ("megatron",)}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports(module: str) -> list[tuple[str, int]]:
    """(imported name, line) for every import statement anywhere in the module."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            # `from package import module` imports that module; `from module import name` the module.
            names = [f"{target}.{alias.name}" for alias in node.names]
            found += [(name if name in MODULES else target, node.lineno) for name in names]
    return found


def internal_edges() -> dict[str, set[str]]:
    edges = {}
    for module in MODULES:
        targets = set()
        for name, _ in imports(module):
            if name == "mmparity" or name.startswith("mmparity."):
                while name not in MODULES:  # an attribute of a module: the module itself
                    name = name.rpartition(".")[0]
                if name != module:
                    targets.add(name)
        edges[module] = targets
    return edges


def layer(module: str) -> tuple[int, str]:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix], prefix


def test_every_module_has_a_layer():
    assert set(MODULES) - {"mmparity"}, "no modules found"
    for module in MODULES:
        layer(module)


def uphill(edges: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in edges.items():
        rank, _ = layer(module)
        for target in targets:
            target_rank, _ = layer(target)
            if target_rank > rank or (target_rank == rank and target == "mmparity"):
                found.append(f"{module} (layer {rank}) imports {target} (layer {target_rank})")
            for a, b in APART:
                for x, y in ((a, b), (b, a)):
                    if module.rpartition(".")[2] == x and target.rpartition(".")[2] == y:
                        found.append(f"{module} imports its sibling {target}")
    return sorted(found)


def cycles(edges: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    found = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                found.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    return found


def test_imports_only_point_down():
    assert not uphill(internal_edges()), "\n".join(uphill(internal_edges()))


def test_import_graph_has_no_cycle():
    assert not cycles(internal_edges()), "\n".join(cycles(internal_edges()))


def test_the_checks_can_fail():
    """An uphill edge, a sibling edge and a cycle inside one layer are each caught."""
    assert uphill({"mmparity.mapping.rules": {"mmparity.models.registry"}})
    assert uphill({"mmparity.models.pixtral.native": {"mmparity.models.pixtral.reference"}})
    assert uphill({"mmparity.models.core.vit": {"mmparity.models.pixtral.native"}})
    assert not uphill({"mmparity.models.pixtral.native": {"mmparity.models.core.vit", "mmparity.mapping.ops"}})
    assert cycles({"mmparity.io.a": {"mmparity.io.b"},
                   "mmparity.io.b": {"mmparity.io.a"}})


def test_function_level_imports_are_read():
    edges = internal_edges()
    function_level = [(m, n) for m in MODULES for n, line in imports(m)
                      if n.startswith("mmparity") and _indented(MODULES[m], line)]
    assert function_level, "expected some function-level imports to exercise the reader"
    module, name = function_level[0]
    while name not in MODULES:
        name = name.rpartition(".")[0]
    assert name == module or name in edges[module]


def _indented(path: Path, line: int) -> bool:
    return path.read_text().splitlines()[line - 1].startswith((" ", "\t"))


@pytest.mark.parametrize("prefix", sorted(FORBIDDEN))
def test_layers_keep_out_of_frameworks_and_files(prefix):
    bad = []
    for module in MODULES:
        if module == prefix or module.startswith(prefix + "."):
            for name, line in imports(module):
                if name.split(".")[0] in FORBIDDEN[prefix]:
                    bad.append(f"{module}:{line} imports {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("last", sorted(FORBIDDEN_BY_NAME))
def test_native_and_reference_modules_keep_to_their_framework(last):
    bad = []
    for module in MODULES:
        if module.startswith("mmparity.models.") and module.rpartition(".")[2] == last:
            for name, line in imports(module):
                if name.split(".")[0] in FORBIDDEN_BY_NAME[last]:
                    bad.append(f"{module}:{line} imports {name}")
    assert not bad, "\n".join(bad)


# A module longer than this is several modules: split it where its parts stop sharing state.
LONGEST_MODULE = 800


def test_no_module_is_longer_than_the_limit():
    long = {str(path.relative_to(ROOT)): n for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > LONGEST_MODULE}
    assert not long, f"modules over {LONGEST_MODULE} lines: {long}"
