"""The import-layer rule of DESIGN §2, enforced by reading every module's imports.

Imports point down only: cli -> gateway | agent | autoscale | sim | bench | engine -> runtime ->
files -> scheduling | control -> prefix | workload | openai -> core; ``tables`` (Rich layouts that
fit the terminal) sits under sim, bench, demo and cli and imports nothing of isocost.
gateway, sim and bench never import each other: what two of them share moves down (the
gateway config into runtime). The pure layers import nothing that does I/O, read no wall
clock, open no file and use no global RNG (randomness arrives as an injected
``random.Random``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "isocost"

# Each package may import only these isocost packages (besides itself).
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "prefix": {"core"},
    "workload": {"core"},
    "scheduling": {"core", "prefix", "workload"},
    "control": {"core"},
    "files": {"core", "prefix", "workload", "scheduling"},
    "openai": {"core"},
    "engine": {"core", "prefix", "workload", "scheduling", "files", "openai", "serving"},
    "runtime": {"core", "prefix", "workload", "scheduling", "files", "openai"},
    "sim": {
        "core",
        "prefix",
        "workload",
        "scheduling",
        "control",
        "files",
        "engine",
        "runtime",
        "tables",
    },
    "bench": {"core", "workload", "files", "openai", "tables"},
    "gateway": {
        "core",
        "prefix",
        "workload",
        "scheduling",
        "files",
        "openai",
        "runtime",
        "serving",
    },
    # The ext_proc wire only: its brain (the gateway's runtime) is handed in by the CLI.
    "picker": {"core", "openai", "runtime", "serving"},
    "tables": set(),
    "serving": set(),
    "demo": {
        "core",
        "prefix",
        "workload",
        "scheduling",
        "files",
        "engine",
        "bench",
        "gateway",
        "runtime",
        "tables",
    },
    "drill": {"core", "workload", "files", "bench"},
    # control's decisions on a live fleet; the local actuator runs engines as the demo does.
    "autoscale": {"core", "control", "runtime"},
    "agent": {"core", "files", "openai", "runtime"},
    "__main__": {"cli"},  # ``python -m isocost``: the command and nothing else
    "cli": {
        "core",
        "prefix",
        "workload",
        "scheduling",
        "control",
        "files",
        "engine",
        "sim",
        "bench",
        "gateway",
        "picker",
        "runtime",
        "demo",
        "drill",
        "agent",
        "serving",
        "autoscale",
    },
}
PURE = {"core", "prefix", "workload", "scheduling", "control"}
FORBIDDEN_IN_PURE = {
    "asyncio",
    "aiohttp",
    "socket",
    "uvloop",
    "subprocess",
    "threading",
    "multiprocessing",
    "requests",
    "httpx",
    "urllib",
    "secrets",
    "zmq",
}
WALL_CLOCK = {
    ("time", "time"),
    ("time", "monotonic"),
    ("time", "perf_counter"),
    ("time", "sleep"),
    ("datetime", "now"),
    ("datetime", "utcnow"),
}


def _layer(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py") if rel.parts else ""


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p.name != "__init__.py" or p.parent != SRC)


def _imports(tree: ast.AST) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path: Path) -> None:
    layer = _layer(path)
    if layer not in ALLOWED:
        pytest.skip(f"{layer} is not a layer")
    tree = ast.parse(path.read_text(), filename=str(path))
    for name in _imports(tree):
        parts = name.split(".")
        if parts[0] == "isocost" and len(parts) > 1 and parts[1] != layer:
            target = parts[1]
            assert target in ALLOWED[layer], f"{path.name}: {layer} must not import {name}"
        if layer in PURE:
            assert parts[0] not in FORBIDDEN_IN_PURE, f"{path.name}: pure layer imports {name}"


@pytest.mark.parametrize(
    "path", [p for p in _modules() if _layer(p) in PURE], ids=lambda p: str(p.relative_to(SRC))
)
def test_pure_layers_read_no_wall_clock(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            assert (node.value.id, node.attr) not in WALL_CLOCK, (
                f"{path.name}:{node.lineno} reads the wall clock ({node.value.id}.{node.attr})"
            )
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "random"
        ):
            assert node.attr == "Random", (
                f"{path.name}:{node.lineno} uses the global RNG (random.{node.attr}); "
                "inject a random.Random instead"
            )
        if isinstance(node, ast.ImportFrom) and node.module == "random":
            assert [a.name for a in node.names] == ["Random"], f"{path.name} imports global RNG"
        if isinstance(node, ast.ImportFrom) and node.module in {"time", "datetime"}:
            for alias in node.names:
                assert (node.module, alias.name) not in WALL_CLOCK, f"{path.name} imports a clock"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id != "open", f"{path.name}:{node.lineno} opens a file"
