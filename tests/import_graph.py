"""The import graph of Wick's packages, read from the source with `ast` (nothing is imported).

Every `import` / `from ... import` counts, at module level or inside a function (a deferred
import still ties the modules together), except those under `if TYPE_CHECKING:`, which never
run. Edges go from the importing module to the imported one, both inside the given packages;
`from pkg import name` counts as importing `pkg.name` when that is a module, else `pkg`.

`python -m tests.import_graph` prints the longest import chain and any cycles.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model_server", "microservice")


def module_files(packages: Iterable[str] = PACKAGES, root: Path = ROOT) -> dict[str, Path]:
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterable[str]:
    def visit(node: ast.AST) -> Iterable[str]:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from visit(child)
            return
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield f"{base}.{alias.name}"
                yield base
        for child in ast.iter_child_nodes(node):
            yield from visit(child)

    yield from visit(tree)


def import_graph(packages: Iterable[str] = PACKAGES, root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports."""
    files = module_files(packages, root)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        names = list(_imported_names(tree, module, is_package))
        for name in names:
            # `from pkg import name`: both `pkg.name` and `pkg` are offered; keep the module.
            if name in files and name != module:
                targets.add(name)
        # Drop `pkg` where `pkg.x` (a submodule imported by `from pkg import x`) was the target.
        graph[module] = {
            t for t in targets if not any(o.startswith(t + ".") and o in targets for o in targets)
        } or targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))

    def strongconnect(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest import path (the graph must have no cycles)."""
    best: dict[str, list[str]] = {}

    def chain(v: str) -> list[str]:
        if v not in best:
            tails = [chain(w) for w in graph.get(v, ())]
            best[v] = [v, *max(tails, key=len, default=[])]
        return best[v]

    return max((chain(v) for v in sorted(graph)), key=len, default=[])


if __name__ == "__main__":
    g = import_graph()
    loops = cycles(g)
    for loop in loops:
        print("cycle:", " <-> ".join(loop))
    if not loops:
        path = longest_chain(g)
        print(f"longest chain ({len(path)} modules):", " -> ".join(path))
