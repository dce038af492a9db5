"""The error tree drawn in ``core/errors.py`` is the tree of ``IsocostError``'s subclasses.

The drawing is the one place a reader learns which errors exist and what each means; a
subclass added (or moved under another parent) without redrawing it makes the map lie.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

import isocost
from isocost.core import errors
from isocost.core.errors import IsocostError

_NODE = re.compile(r"^[ │├└─]*(?P<name>[A-Z]\w*Error)\b")


def _drawn_tree() -> dict[str, str]:
    """Child -> parent, as the docstring draws it (four columns per level)."""
    parents: dict[str, str] = {}
    path: list[str] = []
    root_column: int | None = None
    for line in (errors.__doc__ or "").splitlines():
        match = _NODE.match(line)
        if not match:
            continue
        column = match.start("name")
        root_column = column if root_column is None else root_column
        depth = (column - root_column) // 4
        del path[depth:]
        if path:
            parents[match.group("name")] = path[-1]
        path.append(match.group("name"))
    return parents


def _real_tree() -> dict[str, str]:
    for module in pkgutil.walk_packages(isocost.__path__, "isocost."):
        importlib.import_module(module.name)
    parents: dict[str, str] = {}
    todo: list[type[BaseException]] = [IsocostError]
    while todo:
        parent = todo.pop()
        for child in parent.__subclasses__():
            parents[child.__name__] = parent.__name__
            todo.append(child)
    return parents


def test_error_tree_matches_the_subclasses() -> None:
    assert _drawn_tree() == _real_tree()


def test_the_drawing_is_read_with_its_levels() -> None:
    drawn = _drawn_tree()
    assert drawn["ConfigError"] == "IsocostError"
    assert drawn["UnknownConfigEntryError"] == "UnknownEntryError"
