"""The user guides and the contributor pages stay true to the tree: every relative link points at
a file that exists, every ``mmparity/...`` path or ``mmparity.x.y`` module they name exists (a
placeholder such as ``<family>`` stands for any package there), and no page is too long to read
(600 lines)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
LONGEST = 600

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CODE = re.compile(r"`([^`\s]+)`")


def named_paths(text: str) -> list[str]:
    return [m for m in CODE.findall(text) if m.startswith("mmparity/")]


def named_modules(text: str) -> list[str]:
    return [m for m in CODE.findall(text) if re.fullmatch(r"mmparity(\.[A-Za-z_0-9]+)+", m) and m != "mmparity.json"]


def exists(path: str) -> bool:
    """A path of the tree, where ``<...>`` matches any one directory entry."""
    candidates = [ROOT]
    for part in path.strip("/").split("/"):
        if part.startswith("<"):
            suffix = part[part.index(">") + 1:]
            candidates = [c / e.name for c in candidates if c.is_dir() for e in c.iterdir()
                          if e.name.endswith(suffix) and not e.name.startswith(("_", "."))]
        else:
            candidates = [c / part for c in candidates if (c / part).exists()]
    return bool(candidates)


def module_exists(name: str) -> bool:
    """A module or package, or a name defined in one (``mmparity.models.registry.get``)."""
    parts = name.split(".")
    for cut in range(len(parts), 1, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        if not Path(module.__file__).resolve().is_relative_to(ROOT / "mmparity"):
            return False  # another checkout's module, found through an installed path hook
        value = module
        for attribute in parts[cut:]:
            if not hasattr(value, attribute):
                return False
            value = getattr(value, attribute)
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_is_short_and_true_to_the_tree(page):
    text = page.read_text()
    assert len(text.splitlines()) <= LONGEST, f"{len(text.splitlines())} lines"
    broken = [link for link in LINK.findall(text)
              if "://" not in link and not link.startswith("mailto:") and not (page.parent / link).exists()]
    assert not broken, broken
    missing = [p for p in named_paths(text) if not exists(p)]
    assert not missing, missing
    gone = [m for m in named_modules(text) if not module_exists(m)]
    assert not gone, gone
