"""The layer rule, read off the source: every import of ``mmparity`` (function-level ones included)
points down the stack, and the import graph has no cycle.

Bottom to top: config facts and the parallel runtime; the converters; the native (mcore) and
reference (HF) models side by side; the parity cases and hook records; the family registry; the
checkpoint layer (disk and the convert pipeline); the parity harness and bench; the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "mmparity"

# Module-name prefix -> layer; the longest matching prefix wins.
LAYERS = {
    "mmparity": 0,
    "mmparity.hfconfig": 0,
    "mmparity.runtime": 0,
    "mmparity.axes": 0,
    "mmparity.errors": 0,
    "mmparity.converters": 1,
    # Megatron's own classes and the key map onto them: megatron and the converters' records below.
    "mmparity.upstream": 2,
    "mmparity.native.core": 2,
    "mmparity.native": 3,
    "mmparity.reference": 3,
    "mmparity.cases": 4,
    "mmparity.families": 5,
    "mmparity.checkpoint": 6,
    "mmparity.parity": 7,
    "mmparity.cli": 8,
    "mmparity.__main__": 9,
}
# Same layer, still never importing each other.
APART = [("mmparity.native", "mmparity.reference")]
# Third-party packages a layer must not import.
FORBIDDEN = {
    "mmparity.converters": ("transformers", "megatron", "safetensors", "os", "pathlib", "mmap", "ctypes",
                            "shutil", "tempfile", "io"),
    "mmparity.hfconfig": ("transformers", "megatron", "torch"),
    "mmparity.errors": ("transformers", "megatron", "torch"),
    "mmparity.axes": ("transformers", "megatron", "torch"),
    "mmparity.native": ("transformers",),
    "mmparity.reference": ("megatron",),
}


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
                    if (module == x or module.startswith(x + ".")) and (target == y or target.startswith(y + ".")):
                        found.append(f"{module} imports its sibling layer {target}")
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
    assert uphill({"mmparity.converters.rules": {"mmparity.families"}})
    assert uphill({"mmparity.native.pixtral": {"mmparity.reference.pixtral"}})
    assert uphill({"mmparity.native.core.vit": {"mmparity.native.pixtral"}})
    assert not uphill({"mmparity.native.pixtral": {"mmparity.native.core.vit", "mmparity.converters.ops"}})
    assert cycles({"mmparity.checkpoint.a": {"mmparity.checkpoint.b"},
                   "mmparity.checkpoint.b": {"mmparity.checkpoint.a"}})


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
