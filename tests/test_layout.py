"""The code's layout: no import circles between the modules of planner/, profilers/ and runtime/, and
each layer imports only the layers below it. The folders profilers/ and runtime/ are the packages
`planner.profilers` and `planner.runtime` (pyproject.toml's package-dir), and their modules are named so."""

from __future__ import annotations

import ast
import io
import re
import tokenize
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
    assert {"planner.contracts.kfac_section", "planner.contracts.plan", "planner.profilers.kfac_costs",
            "planner.runtime.preconditioner", "planner.runtime", "planner.profilers"} <= set(graph)
    assert not any(name.startswith(("runtime", "profilers")) for name in graph)
    assert "planner.kernels.kfac_factors" in graph["planner.profilers.kfac_costs"]
    assert "planner.runtime.preconditioner" not in graph["planner.profilers.kfac_costs"]
    assert circles(graph) == []


#: Each layer and the layers it may import (besides itself); a layer is a folder. The base is the package's own
#: top-level modules and its two folders every layer stands on: errors and enums (`types`), the console, the built-in
#: models and tasks, the statistics of measured samples (`spread`), a worker's request to die with its launcher
#: (`_lifeline`, stdlib only: the package's first import in a worker), the kernels that both the profilers and the
#: runtime run (`kernels/`), and the platform (`platform/`: launching workers, the emulated link, timing).
#: The contracts hold the files' data and its checks; the cost model reads them and does the arithmetic; the solvers
#: search its problems; the strategies turn a profile into a plan. The profilers measure; the runtime runs a plan and,
#: as training goes or on attach, re-probes (profilers) and re-solves (strategies); the sessions do what a command
#: does (profile, bench, tune, pair, report); the commands parse flags, call one session and print, with
#: `python -m planner` (`__main__`) their entry point.
MAY_IMPORT = {
    "base": set(),
    "contracts": {"base"},
    "costmodel": {"base", "contracts"},
    "solvers": {"base", "costmodel"},
    "strategies": {"base", "contracts", "costmodel", "solvers"},
    # Random instances of the solvers' problems and brute-force references: the tests' and the solver benchmark's.
    "testing": {"base", "contracts", "costmodel", "solvers"},
    "profilers": {"base", "contracts", "costmodel"},
    "runtime": {"base", "contracts", "costmodel", "solvers", "strategies", "profilers"},
    # What each command does as a library call: the profiling session (it times the runtime's own work, so it sits
    # above the runtime), the benches, the trials, the study, the pairing, the report and the solvers' timing.
    "sessions": {"base", "contracts", "costmodel", "solvers", "strategies", "testing", "profilers", "runtime"},
    "commands": {"base", "contracts", "costmodel", "solvers", "strategies", "testing", "profilers", "runtime",
                 "sessions"},
}
#: The folders of `planner/` (and the two top-level folders installed into it) that are not layers of their own.
BASE_FOLDERS = {"kernels", "platform"}


def layer(module: str) -> str:
    """The layer of `module`: its folder under `planner`; the base for the package's top-level modules and its
    base folders; the commands for `python -m planner`."""
    parts = module.split(".")
    if parts[1:2] == ["__main__"]:
        return "commands"
    if parts[1:2] in (["runtime"], ["profilers"]):  # the top-level folders installed into the package
        return parts[1]
    if (len(parts) == 2 and not (ROOT / "planner" / parts[1]).is_dir()) or len(parts) == 1 or parts[1] in BASE_FOLDERS:
        return "base"
    return parts[1]


def test_the_layers_are_the_folders() -> None:
    """Every folder of planner/ (and runtime/, profilers/) is a layer or a base folder, and the layers stack: no two
    may import each other, through any chain."""
    folders = {p.name for p in (ROOT / "planner").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders | {"runtime", "profilers"} == (set(MAY_IMPORT) - {"base"}) | BASE_FOLDERS
    reach = {name: set(below) for name, below in MAY_IMPORT.items()}
    for _ in MAY_IMPORT:
        for below in reach.values():
            below |= {deeper for b in list(below) for deeper in reach[b]}
    assert not [name for name, below in reach.items() if name in below]


def test_layers_are_named() -> None:
    assert layer("planner.contracts.plan") == "contracts" and layer("planner.kernels.topk") == "base"
    assert layer("planner.runtime.exchange") == "runtime" and layer("planner.types") == "base"
    assert layer("planner.runtime") == "runtime" and layer("planner.profilers.comm") == "profilers"
    assert layer("planner") == "base" and layer("planner.__main__") == "commands"
    assert {layer(m) for m in import_graph()} == set(MAY_IMPORT)


def test_each_layer_imports_only_the_layers_below() -> None:
    wrong = [
        f"{module} imports {target}"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if layer(target) != layer(module)
        and layer(target) not in MAY_IMPORT[layer(module)]
    ]
    assert wrong == []
    graph = import_graph()
    assert not any(layer(t) == "runtime" for m in graph if layer(m) == "profilers" for t in graph[m])


#: Why an import stays inside a function, said on its line: it defers a heavy import off a start-up path
#: ("# deferred: ..." naming what stays unloaded, or "# deferred (start-up)" in the commands, see planner/commands/
#: __init__.py), it is an optional extra ("# optional extra: ..."), or it breaks a circle ("# cycle: ...").
INNER_IMPORT_REASON = re.compile(r"#\s*(deferred\b|optional extra\b|cycle\b)")


def inner_imports_without_reason(source: str) -> list[int]:
    """The lines of `source`'s imports inside a function (the first line of a parenthesised one) that carry no
    comment saying why."""
    comments = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    lines = {node.lineno
             for fn in ast.walk(ast.parse(source)) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}
    return sorted(line for line in lines if not INNER_IMPORT_REASON.match(comments.get(line, "")))


def test_inner_imports_are_found() -> None:
    source = ("import os\n\ndef f():\n    import json\n    from a import (  # deferred: a\n        b,\n    )\n"
              "    if os:\n        import c  # optional extra: c\n\n    def g():\n        import d  # a comment\n")
    assert inner_imports_without_reason(source) == [4, 12]


def test_an_import_inside_a_function_says_why() -> None:
    """Imports go at the top of a module unless they break a circle or defer a heavy import on a start-up path
    (`planner --help`, importing the runtime, reading a plan, a command's workers) or are an optional extra: each
    that stays inside a function says which on its line."""
    missing = [f"{path.relative_to(ROOT)}:{line}"
               for folder in PACKAGES for path in sorted((ROOT / folder).rglob("*.py"))
               for line in inner_imports_without_reason(path.read_text(encoding="utf-8"))]
    assert missing == []


#: The file names two modules still share, each pair told apart by its folder: the kernels and the profilers that time
#: them (compress, topk); the crossed-over jobs' timeline and the runtime's gates (crossover); a contract's data and
#: the profiler that measures it (errors, layers) or the solver that makes it (pairing); the profile and the profiling
#: session (profile); the built-in models and the command that lists them (models); the strategies' entry point and
#: the command that calls it (solve).
SHARED_NAMES = {
    "compress.py": {"planner/kernels/compress.py", "profilers/compress.py"},
    "topk.py": {"planner/kernels/topk.py", "profilers/topk.py"},
    "crossover.py": {"planner/costmodel/crossover.py", "runtime/crossover.py"},
    "errors.py": {"planner/contracts/errors.py", "profilers/errors.py"},
    "layers.py": {"planner/contracts/layers.py", "profilers/layers.py"},
    "pairing.py": {"planner/contracts/pairing.py", "planner/solvers/pairing.py"},
    "profile.py": {"planner/contracts/profile.py", "planner/sessions/profile.py"},
    "models.py": {"planner/models.py", "planner/commands/models.py"},
    "solve.py": {"planner/strategies/solve.py", "planner/commands/solve.py"},
}


def test_no_two_modules_share_a_file_name() -> None:
    """A module's file name says what it does in its folder, so that a traceback or an import names one module, not
    one of five `kfac.py`: no two modules of planner/, runtime/ and profilers/ share a file name (`__init__.py`
    aside), but the pairs of SHARED_NAMES, which the list names exactly (a pair renamed leaves it)."""
    paths: dict[str, set[str]] = {}
    for folder in PACKAGES:
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "__init__.py":
                paths.setdefault(path.name, set()).add(path.relative_to(ROOT).as_posix())
    assert {name: found for name, found in paths.items() if len(found) > 1} == SHARED_NAMES
