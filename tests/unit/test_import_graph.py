"""The import graph of commlayer/, built from the source (function-level imports included), at
two grains: modules, and packages (package A imports B when any module of A imports one of B's).
At both: no cycle, no import up a layer, and the side systems never imported by the runtime
(DESIGN.md: data flows down, nothing reaches up). No exceptions: a package is in one layer."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "commlayer"
DESIGN = ROOT.parent / "docs" / "design.md"
# DESIGN.md's layers, top to bottom: a module imports its own layer and those below, never one
# above. The longest prefix names a module's layer.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "api",
        (
            "commlayer",
            "commlayer.ops",
            "commlayer.functions",
            "commlayer.optimizer",
            "commlayer.state_sync",
            "commlayer.sync_batch_norm",
            "commlayer.elastic",
            "commlayer.integrations",
            "commlayer.comm",
        ),
    ),
    # the engine, and auto's selection of an allreduce algorithm (core/selection.py)
    ("core", ("commlayer.core",)),
    # sums schedules and sizes payloads: above what it costs
    ("costmodel", ("commlayer.costmodel",)),
    ("algorithms", ("commlayer.algorithms", "commlayer.compression")),
    ("backends", ("commlayer.backends",)),
    ("kernels", ("commlayer.kernels",)),
    # the vocabulary every layer shares: settings, errors, reduction operators, machine shape
    ("common", ("commlayer.common",)),
)
# Side systems use the runtime without the engine running; no layer above imports them.
SIDE = (
    "commlayer.sim",
    "commlayer.oracle",
    "commlayer.cli",
    # commlayerrun, the elastic driver, host lists, the calibration's measuring
    "commlayer.launch",
    "commlayer.launcher",  # the old path of commlayer.launch.launcher
)
# What users add around training: they may use the API layer; the layers never import them.
EXTRAS = ("commlayer.data", "commlayer.model_parallel")


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> str:
    """The layer (or "side", "extras") of a module: its longest matching prefix."""
    found = [(len(p), name) for name, prefixes in LAYERS for p in prefixes if _within(module, p)]
    found += [(len(p), "side") for p in SIDE if _within(module, p)]
    found += [(len(p), "extras") for p in EXTRAS if _within(module, p)]
    return max(found)[1]


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


def package_of(module: str) -> str:
    """The package a module belongs to: ``commlayer.<first part>`` (a subpackage, or a module
    directly under commlayer/, which is a package of its own here), or ``commlayer`` itself."""
    return ".".join(module.split(".")[:2])


def _packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """package -> the packages it imports: A -> B when any module of A imports one of B."""
    packages: dict[str, set[str]] = {package_of(m): set() for m in graph}
    for module, targets in graph.items():
        mine = package_of(module)
        packages[mine] |= {package_of(t) for t in targets} - {mine}
    return packages


def test_no_import_cycle_in_commlayer() -> None:
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles (each a set of modules that import each other): {cycles}"


def test_no_import_cycle_between_packages() -> None:
    cycles = _cycles(_packages(_graph()))
    assert not cycles, f"package cycles (each a set of packages that import each other): {cycles}"


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a layer to one above it, or from the layers to a side system or an extra."""
    order = [name for name, _ in LAYERS]
    found = []
    for module, targets in graph.items():
        mine = layer_of(module)
        for target in targets:
            theirs = layer_of(target)
            if mine in ("side", "extras"):
                continue  # they may use anything
            if theirs in ("side", "extras") or order.index(theirs) < order.index(mine):
                found.append(f"{module} ({mine}) -> {target} ({theirs})")
    return sorted(found)


def test_no_import_points_up_a_layer_or_into_a_side_system() -> None:
    upward = _upward(_graph())
    assert not upward, "imports that point up a layer (DESIGN.md):\n" + "\n".join(upward)


def test_no_package_imports_a_package_above_it() -> None:
    upward = _upward(_packages(_graph()))
    assert not upward, "packages that import one a layer up (DESIGN.md):\n" + "\n".join(upward)


def test_comm_reaches_the_engine_through_the_core_submit_not_ops() -> None:
    """The communicator, its sparse reduction and the per-host levels build requests for the
    core's submit (core/submit.py); the public, argument-checking collectives (ops.py) are
    for users, and no module of commlayer.comm imports them (DESIGN.md)."""
    graph = _graph()
    comm = sorted(m for m in graph if _within(m, "commlayer.comm"))
    assert "commlayer.comm.communicator" in comm
    through_ops = [m for m in comm if "commlayer.ops" in graph[m]]
    assert not through_ops, f"comm modules that import commlayer.ops: {through_ops}"
    assert "commlayer.core.submit" in graph["commlayer.comm.communicator"]


def test_every_module_has_a_layer() -> None:
    for module in _graph():
        assert layer_of(module), module


def test_design_md_draws_the_layers_in_this_order() -> None:
    """The layer picture in DESIGN.md names commlayer's packages (``core/``, ``costmodel/``...)
    top to bottom in the order of LAYERS, and every layer's packages."""
    text = DESIGN.read_text()
    picture = text[text.index("```text") : text.index("```", text.index("```text") + 7)]
    named = [f"commlayer.{m}" for m in re.findall(r"(?<![\w/])(\w+)/", picture)]
    order = [name for name, _ in LAYERS]
    named = [m for m in named if (ROOT / m.split(".")[1]).is_dir() and layer_of(m) in order]
    drawn = [order.index(layer_of(m)) for m in named]
    assert drawn == sorted(drawn), list(zip(named, drawn))
    folders = {p for _, prefixes in LAYERS for p in prefixes if p.count(".") == 1}
    folders = {p for p in folders if (ROOT / p.split(".")[1]).is_dir()}
    assert folders <= set(named), f"not in the picture: {sorted(folders - set(named))}"


def test_the_checker_sees_an_upward_import() -> None:
    graph = {
        "commlayer.core.engine": {"commlayer.ops", "commlayer.backends.base"},
        "commlayer.backends.mpi": {"commlayer.common.errors", "commlayer.sim.learn"},
        "commlayer.sim.learn": {"commlayer.core.engine"},
    }
    assert _upward(graph) == [
        "commlayer.backends.mpi (backends) -> commlayer.sim.learn (side)",
        "commlayer.core.engine (core) -> commlayer.ops (api)",
    ]


def test_the_checker_sees_a_cycle() -> None:
    """The checker itself: a two-module cycle and a three-module one are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(_cycles(graph)) == [["a", "b"], ["c", "d", "e"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
