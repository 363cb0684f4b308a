"""The lower packages import only downwards and without cycles (function-level and TYPE_CHECKING
imports included): kernels < platforms < layers < models, none of them importing the engine, and
nothing in `model_server` importing the developer `tools/`.

Read from the source with `ast`, so a lazy import inside a function counts as much as one at the
top of a module: either ties the modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "model_server"

# What each package may import from model_server, besides itself (layer order, low to high).
BASE = ("model_server.utils", "model_server.sampling_params", "model_server.config")
ALLOWED: dict[str, tuple[str, ...]] = {
    "model_server.kernels": BASE,
    "model_server.platforms": (*BASE, "model_server.kernels"),
    "model_server.layers": (
        *BASE,
        "model_server.distributed",
        "model_server.kernels",
        "model_server.platforms",
    ),
    "model_server.models": (
        *BASE,
        "model_server.distributed",
        "model_server.kernels",
        "model_server.layers",
    ),
}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the tree (and top-level names) that `name` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in modules and target.count("."):
                target = target.rpartition(".")[0]
            if target in modules or target == "tools":
                found.add(target)
    found.discard(name)
    return found


GRAPH = {name: _imports(name, path, _modules()) for name, path in _modules().items()}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_down(package: str) -> None:
    allowed = (package, *ALLOWED[package])
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if _within(name, package)
        for target in targets
        if not any(_within(target, ok) for ok in allowed)
    )
    assert not upward, upward


def test_no_import_cycles_below_the_engine() -> None:
    # Tarjan's strongly connected components over the whole tree; report those touching the
    # lower packages.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH.get(v, ()):
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    ours = [c for c in cycles if any(_within(m, p) for m in c for p in ALLOWED)]
    assert not ours, ours


def test_the_package_never_imports_the_developer_tools() -> None:
    assert not [name for name, targets in GRAPH.items() if "tools" in targets]
