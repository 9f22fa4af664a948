"""The import paths: `planner.runtime` and `planner.profilers` are the folders runtime/ and profilers/
(pyproject.toml's package-dir), and those are their only names: the old top-level `runtime` and `profilers` are
gone, whether run from the repository root (where the folders would be found under their own names: refused in one
line), installed (editable) and run from elsewhere, or from a wheel built and installed apart from the repository."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Imports the new names and tries the old ones; prints what it saw as JSON.
CHECK = """
import json, sys
import planner.runtime, planner.profilers.comm, planner.runtime.exchange
from planner.runtime import GradientExchange
old = {}
for name in ("runtime", "profilers"):
    try:
        __import__(name)
        old[name] = "imported"
    except ImportError as exc:
        old[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps({
    "old": old,
    "same": GradientExchange is planner.runtime.exchange.GradientExchange,
    "names": sorted(key for key in sys.modules if key.split(".")[0] in ("runtime", "profilers")),
    "files": {"planner": planner.__file__, "planner.runtime": planner.runtime.__file__,
              "planner.profilers": planner.profilers.__file__},
    "path": sys.path,
}))
"""


def _run(args: list[str], cwd: Path, code: str = CHECK) -> dict:
    proc = subprocess.run([sys.executable, *args, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_from_the_repository_root_the_folders_refuse_their_own_names_in_one_line() -> None:
    """Run from the root, the folder runtime/ itself is found first as a top-level `runtime`: it refuses, naming
    the import to write, rather than load a second copy of every module."""
    seen = _run([], ROOT)
    assert seen["old"] == {
        name: f"ImportError: `{name}` is not a module of this project: import `planner.{name}` (the folder {name}/ "
              "is installed under that name)" for name in ("runtime", "profilers")}
    assert seen["same"] and seen["names"] == []
    assert seen["files"]["planner.runtime"] == str(ROOT / "runtime" / "__init__.py")


@pytest.mark.parametrize("name", ["runtime", "profilers"])
def test_installed_and_run_elsewhere_the_old_names_are_not_found(tmp_path: Path, name: str) -> None:
    """Run elsewhere (-I: neither the working folder nor PYTHONPATH on sys.path), no old name is installed."""
    seen = _run(["-I"], tmp_path)
    assert str(ROOT) not in seen["path"] and "" not in seen["path"]
    assert seen["old"][name] == f"ModuleNotFoundError: No module named '{name}'"
    assert seen["same"] and seen["names"] == []


def test_every_package_is_listed() -> None:
    """pyproject.toml lists the packages one by one (package-dir maps two of them from outside planner/): the list
    is every folder with an __init__.py, so a new subpackage is not left out of the wheel."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    package_dir = setuptools["package-dir"]
    assert package_dir == {"planner": "planner", "planner.runtime": "runtime", "planner.profilers": "profilers"}
    found: set[str] = set()
    for package, folder in package_dir.items():
        found |= {".".join((package, *init.parent.relative_to(ROOT / folder).parts))
                  for init in (ROOT / folder).rglob("__init__.py")}
    assert sorted(setuptools["packages"]) == sorted(found)


def test_a_built_wheel_installs_the_planner_package_alone(tmp_path: Path) -> None:
    """The wheel, built from a copy of the sources and installed into a folder of its own, imported with that
    folder and the environment's site-packages (torch and the rest) alone on sys.path: no repository, no
    editable install."""
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for entry in ("planner", "runtime", "profilers"):
        shutil.copytree(ROOT / entry, source / entry, ignore=ignore)
    for entry in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / entry, source / entry)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
                    str(source)], check=True, capture_output=True, cwd=tmp_path, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("planner-*.whl")
    target = tmp_path / "installed"
    subprocess.run([*pip, "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, cwd=tmp_path, timeout=300)
    assert (target / "planner" / "runtime" / "exchange.py").is_file()
    assert (target / "planner" / "profilers" / "comm.py").is_file()
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info")) == ["bin", "planner"]

    # -I and -S: no working folder, PYTHONPATH or site (whose .pth would add the editable install's finder).
    site = list(dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib")))
    prelude = f"import sys; sys.path[:0] = {[str(target), *site]!r}\n"
    seen = _run(["-I", "-S"], tmp_path, prelude + CHECK)
    assert str(ROOT) not in seen["path"] and "" not in seen["path"]
    assert seen["files"] == {"planner": str(target / "planner" / "__init__.py"),
                             "planner.runtime": str(target / "planner" / "runtime" / "__init__.py"),
                             "planner.profilers": str(target / "planner" / "profilers" / "__init__.py")}
    assert seen["same"] and seen["names"] == []
    assert seen["old"] == {name: f"ModuleNotFoundError: No module named '{name}'" for name in ("runtime", "profilers")}


def test_a_training_job_and_a_commands_workers_import_no_table_solver_or_tuning_library() -> None:
    """The runtime a training job imports, and the modules a command's workers import (each session's module that
    holds a worker function, and the probe's), load none of pandas, matplotlib, optuna, pulp or ortools: each costs
    every worker start and every training job its import time. So the solvers import ortools and pulp inside the
    search that uses them (the K-FAC bench's and the tuner's workers import the K-FAC strategy, which imports the
    placement solvers), and the tuner imports optuna where rank 0 runs the study."""
    code = ("import json, sys; import planner.runtime, planner.commands.cli, planner.sessions.profile, "
            "planner.sessions.bench, planner.sessions.bench_abs, planner.sessions.bench_crossover, "
            "planner.sessions.bench_kfac, planner.sessions.bench_target, planner.sessions.tune, "
            "planner.profilers.probe; print(json.dumps(sorted(m for m in ('pandas', 'matplotlib', 'optuna', 'pulp', "
            "'ortools') if m in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_the_runtime_loads_no_pandas_and_no_solvers() -> None:
    """A training job imports the runtime, which reads plans and profiles: the profile contract's tables are built
    elsewhere (`planner.commands.printing`), so pandas is not among what the job loads; nor are the strategies, the
    solvers, the profilers or their libraries, which only re-planning needs (docs/layout.md)."""
    code = ("import json, sys; import planner.runtime, planner.runtime.exchange, planner.runtime.ddp_plan; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('pandas', 'pulp', 'ortools', "
            "'optuna') or m.startswith(('planner.strategies', 'planner.solvers', 'planner.profilers')))))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_the_command_line_starts_without_torch_or_the_layers_it_runs() -> None:
    """`planner --help` imports every command module: each imports at its top only the standard library, rich and
    light modules of the base and the contracts, and what a command's work needs inside its `run` (`# deferred
    (start-up)`), so listing the commands loads no torch, numpy, table, solver or tuning library, and none of the
    layers a command runs."""
    code = ("import json, sys; import planner.commands.cli; print(json.dumps(sorted(m for m in sys.modules if "
            "m.split('.')[0] in ('torch', 'numpy', 'pandas', 'matplotlib', 'optuna', 'pulp', 'ortools', 'sklearn') "
            "or m.startswith(('planner.sessions', 'planner.runtime', 'planner.profilers', 'planner.strategies', "
            "'planner.solvers', 'planner.costmodel')))))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_reading_a_plan_or_a_profile_loads_no_torch() -> None:
    """The contracts are data: a tool that reads a plan or a profile (the examples under plans/, the stored
    profiles) loads no torch; what needs it (a model's K-FAC layers, the built-in models) imports it inside."""
    code = ("import glob, json, sys; from planner.contracts.plan import Plan; "
            "from planner.contracts.profile import Profile; "
            "[Plan.load(f) for f in sorted(glob.glob('plans/*.json'))]; "
            "[Profile.load(f) for f in sorted(glob.glob('tests/profiles/*.json'))]; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
