"""No import cycle between the modules of ``src/isocost``, not even under TYPE_CHECKING.

A cycle means two modules are one idea split badly (or one knows too much about the other);
it also makes import order matter. The layering test checks packages; this one checks
modules inside a package too. An edge is every ``import`` / ``from … import`` naming an
isocost module (relative imports resolved), including those inside functions and
``if TYPE_CHECKING:`` blocks. ``from pkg import name`` is an edge to ``pkg.name`` when that
is a module, else to ``pkg`` (its ``__init__``).
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / "isocost").rglob("*.py"))}


def _targets(name: str, is_package: bool, source: str, known: Collection[str]) -> set[str]:
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                found.add(submodule if submodule in known else module)
    return {target for target in found if target in known and target != name}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {
        name: _targets(name, path.name == "__init__.py", path.read_text(), known)
        for name, path in known.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def test_no_import_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_check_finds_a_cycle() -> None:
    """The detector itself: a three-module ring and a self-contained pair are found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"], ["d", "e"]]


def test_relative_and_type_checking_imports_are_edges() -> None:
    source = """
from typing import TYPE_CHECKING
from . import sibling
from ..other import thing
if TYPE_CHECKING:
    from isocost.pkg.typed import Name
def late() -> None:
    import isocost.pkg.lazy
"""
    known = {
        "isocost.pkg",
        "isocost.pkg.sibling",
        "isocost.other",
        "isocost.pkg.typed",
        "isocost.pkg.lazy",
    }
    # ``from . import sibling`` reaches the submodule, not the package's __init__
    assert _targets("isocost.pkg.mod", False, source, known) == known - {"isocost.pkg"}
