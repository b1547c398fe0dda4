"""The top-level packages import each other in one direction only (DESIGN.md "Ownership rules").

The graph is read from the source with `ast`, not by importing: every `import` / `from ... import` anywhere in a
file counts, including the lazy ones inside functions (a loop closed by a lazy import still breaks whoever imports
the two halves in the other order), and so does `importlib.import_module("pkg.mod")` with a literal name.

    pallas_kernels  <-  cpu_kernels  <-  jaxserve  <-  training, service  <-  bench     (A <- B: B imports A)
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jaxserve", "service", "bench", "training", "cpu_kernels", "pallas_kernels")


def _imported_modules(tree: ast.AST):
    """(line, absolute module name) of every import in `tree`; relative imports come back as None (same package)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, None if node.level else node.module
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def import_graph() -> dict[str, dict[str, list[str]]]:
    """{package: {imported package: ["path:line", ...]}} over the six top-level packages (self-imports left out)."""
    graph: dict[str, dict[str, list[str]]] = {p: {} for p in PACKAGES}
    for pkg in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, pkg)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for name in filenames:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                for line, module in _imported_modules(tree):
                    top = (module or "").split(".")[0]
                    if top in PACKAGES and top != pkg:
                        graph[pkg].setdefault(top, []).append(f"{os.path.relpath(path, ROOT)}:{line}")
    return graph


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_package_import_graph_has_no_cycle(graph):
    cycle = find_cycle({pkg: set(deps) for pkg, deps in graph.items()})
    if cycle:
        where = [f"{a} -> {b}: {', '.join(graph[a][b][:3])}" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle between packages:\n  " + "\n  ".join(where))


@pytest.mark.parametrize("upper", ["service", "bench", "training"])
def test_jaxserve_never_imports_the_layers_above_it(graph, upper):
    assert upper not in graph["jaxserve"], f"jaxserve imports {upper}: {graph['jaxserve'][upper]}"


@pytest.mark.parametrize("kernels", ["pallas_kernels", "cpu_kernels"])
def test_kernel_packages_import_nothing_above_them(graph, kernels):
    above = sorted(set(graph[kernels]) & {"jaxserve", "service", "bench", "training"})
    assert not above, f"{kernels} imports {above}: {[graph[kernels][p] for p in above]}"


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
