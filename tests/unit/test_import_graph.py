"""The import graph of commlayer/, built from the source (function-level imports included): no
cycle anywhere, and the lower layers import nothing of the API layer (DESIGN.md: data flows
down, nothing reaches up)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "commlayer"
# The API layer: what users call, and the modules that move bytes through it.
API = (
    "commlayer.ops",
    "commlayer.core.runtime",
    "commlayer.functions",
    "commlayer.optimizer",
    "commlayer.state_sync",
    "commlayer.sync_batch_norm",
    "commlayer.integrations",
    "commlayer.elastic",
    "commlayer.comm.communicator",
    "commlayer.comm.sparse_reduction",
)
LOWER = ("commlayer.algorithms", "commlayer.backends", "commlayer.kernels", "commlayer.costmodel")


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _graph() -> dict[str, set[str]]:
    """module -> the commlayer modules it imports (a name imported from a package counts as
    its submodule when there is one, else as the package)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package
                    for _ in range(node.level - 1):
                        up = up.rpartition(".")[0]
                    base = f"{up}.{base}" if base else up
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                found = resolve(target) if target.startswith("commlayer") else None
                if found is not None and found != module:
                    graph[module].add(found)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_in_commlayer() -> None:
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles (each a set of modules that import each other): {cycles}"


@pytest.mark.parametrize("layer", LOWER)
def test_lower_layers_import_nothing_of_the_api_layer(layer: str) -> None:
    graph = _graph()
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module == layer or module.startswith(layer + ".")
        for target in targets
        if any(target == api or target.startswith(api + ".") for api in API)
    )
    assert not upward, f"imports that point up a layer: {upward}"


def test_the_checker_sees_a_cycle() -> None:
    """The checker itself: a two-module cycle and a three-module one are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(_cycles(graph)) == [["a", "b"], ["c", "d", "e"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
