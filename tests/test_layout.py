"""The code's layout: no import circles between the modules of planner/, profilers/ and runtime/, and
each layer imports only the layers below it. The folders profilers/ and runtime/ are the packages
`planner.profilers` and `planner.runtime` (pyproject.toml's package-dir), and their modules are named so."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Folder -> the package it is installed as: the package-dir of pyproject.toml.
PACKAGES = {folder: package
            for package, folder in tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
            ["tool"]["setuptools"]["package-dir"].items()}


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports, at module level or inside functions (a lazy import
    hides a circle from Python, not from the reader)."""
    modules: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            name = ".".join((package, *path.relative_to(ROOT / folder).with_suffix("").parts))
            modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
            visit(v)
    return found


def test_circles_are_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_has_no_circle() -> None:
    graph = import_graph()
    assert {"planner.contracts.kfac", "planner.contracts.plan", "planner.profilers.kfac", "planner.runtime.kfac",
            "planner.runtime", "planner.profilers"} <= set(graph)
    assert not any(name.startswith(("runtime", "profilers")) for name in graph)
    assert "planner.kernels.kfac" in graph["planner.profilers.kfac"]
    assert "planner.runtime.kfac" not in graph["planner.profilers.kfac"]
    assert circles(graph) == []


#: Each layer and the layers it may import (besides itself). The base is what every layer stands on:
#: errors and enums, the console, the built-in models, the kernels that both the profilers and the
#: runtime run, and the platform (launching workers, the emulated link, timing); the statistics of measured samples
#: (`planner.spread`: intervals, and whether an in-situ calibration is used, which the profile contract writes); and
#: a worker's request to die with its launcher (`planner._lifeline`, stdlib only: the package's first import in a
#: worker).
BASE = {"planner.types", "planner.console", "planner.models", "planner.tasks", "planner.kernels", "planner.platform",
        "planner.spread", "planner._lifeline"}
MAY_IMPORT = {
    "base": set(),
    "contracts": {"base"},
    "costmodel": {"base", "contracts"},
    "solvers": {"base", "costmodel"},
    "strategies": {"base", "contracts", "costmodel", "solvers"},
    # Random instances of the solvers' problems and brute-force references: the tests' and the solver benchmark's.
    "testing": {"base", "contracts", "costmodel", "solvers"},
    "profilers": {"base", "contracts", "costmodel"},
    "runtime": {"base", "contracts", "costmodel", "solvers"},
    "commands": {"base", "contracts", "costmodel", "solvers", "strategies", "testing", "profilers", "runtime"},
    "shims": {"base", "contracts", "commands"},
}
#: The contracts hold the files' data and its checks and stand on the base alone; the cost model reads them and does
#: the arithmetic (fitting and reading the profile's curves, the problems a profile poses, its resampling).
#: The two ways up, both the runtime re-planning: on attach (re-probing the cluster, then re-solving), and as training
#: goes (re-measuring the compressors' errors as the profiler does, then re-solving within the plan's budget).
EXCEPTIONS = {"planner.runtime.retune": {"profilers", "strategies"},
              "planner.runtime.adaptive": {"profilers", "strategies"}}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("profilers", "runtime"):
        return parts[1]
    if len(parts) == 1 or parts[1] in ("__main__", "plan"):  # the package, `python -m planner`, a kept import
        return "shims"
    if ".".join(parts[:2]) in BASE:
        return "base"
    return parts[1]


def test_layers_are_named() -> None:
    assert layer("planner.contracts.plan") == "contracts" and layer("planner.kernels.topk") == "base"
    assert layer("planner.runtime.exchange") == "runtime" and layer("planner.plan") == "shims"
    assert layer("planner.runtime") == "runtime" and layer("planner.profilers.comm") == "profilers"
    assert {layer(m) for m in import_graph()} == set(MAY_IMPORT)


def test_each_layer_imports_only_the_layers_below() -> None:
    wrong = [
        f"{module} imports {target}"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if layer(target) != layer(module)
        and layer(target) not in MAY_IMPORT[layer(module)] | EXCEPTIONS.get(module, set())
    ]
    assert wrong == []
    graph = import_graph()
    assert not any(layer(t) == "runtime" for m in graph if layer(m) == "profilers" for t in graph[m])
