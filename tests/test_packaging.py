"""The import paths: `planner.runtime` and `planner.profilers` are the folders runtime/ and profilers/
(pyproject.toml's package-dir), and the old `runtime` and `profilers` are the same modules, with a
DeprecationWarning naming the new path: run from the repository root, installed (editable) and run from
elsewhere, and from a wheel built and installed apart from the repository."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Imports the old names in every form, then the new ones, and prints what it saw as JSON.
CHECK = """
import importlib.util, json, sys, warnings
origins = {name: importlib.util.find_spec(name).origin for name in ("runtime", "profilers")}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import runtime
    import runtime.exchange
    from runtime import GradientExchange, calibrate
    import runtime.calibrate as calibrate_again
    import profilers.comm
    from profilers import probe
import planner.profilers.comm, planner.profilers.probe, planner.runtime.calibrate, planner.runtime.exchange
same = {
    "runtime": runtime is planner.runtime,
    "runtime.exchange": runtime.exchange is planner.runtime.exchange,
    "GradientExchange": GradientExchange is planner.runtime.GradientExchange
                        is planner.runtime.exchange.GradientExchange,
    "calibrate": calibrate is calibrate_again is planner.runtime.calibrate is sys.modules["runtime.calibrate"],
    "profilers": profilers is planner.profilers,
    "profilers.comm": profilers.comm is planner.profilers.comm,
    "probe": probe is planner.profilers.probe,
}
old = [module for key, module in sys.modules.items() if key.split(".")[0] in ("runtime", "profilers")]
names = sorted({module.__name__ for module in old})
print(json.dumps({
    "origins": origins,
    "warnings": [[w.category.__name__, str(w.message), w.filename] for w in caught],
    "same": same,
    "names": names,
    "files": {"planner": planner.__file__, "planner.runtime": planner.runtime.__file__,
              "planner.profilers": planner.profilers.__file__},
    "path": sys.path,
}))
"""


def _run(args: list[str], cwd: Path, code: str = CHECK) -> dict:
    proc = subprocess.run([sys.executable, *args, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_old_names(seen: dict) -> None:
    """Each old package warns once, naming its new path, at the line that imported it; and every old name is
    the new module itself (no module loaded twice: the names of all of them are the new ones)."""
    assert seen["warnings"] == [
        ["DeprecationWarning", "`runtime` is deprecated and will be removed: import `planner.runtime` instead "
                               "(e.g. `from planner.runtime import ...`)", "<string>"],
        ["DeprecationWarning", "`profilers` is deprecated and will be removed: import `planner.profilers` instead "
                               "(e.g. `from planner.profilers import ...`)", "<string>"],
    ]
    assert all(seen["same"].values()), seen["same"]
    assert all(name.startswith(("planner.runtime", "planner.profilers")) for name in seen["names"]), seen["names"]
    assert {"planner.runtime.calibrate", "planner.profilers.comm"} <= set(seen["names"])


def test_old_names_from_the_repository_root() -> None:
    """Run from the root, the folder runtime/ itself is found first as the top-level `runtime`."""
    seen = _run([], ROOT)
    assert seen["origins"] == {"runtime": str(ROOT / "runtime" / "__init__.py"),
                               "profilers": str(ROOT / "profilers" / "__init__.py")}
    _assert_old_names(seen)
    assert seen["files"]["planner.runtime"] == str(ROOT / "runtime" / "__init__.py")


def test_old_names_installed_and_run_elsewhere(tmp_path: Path) -> None:
    """Run elsewhere (-I: neither the working folder nor PYTHONPATH on sys.path), the installed shims answer."""
    seen = _run(["-I"], tmp_path)
    assert str(ROOT) not in seen["path"] and "" not in seen["path"]
    assert all(Path(origin).parent.name == name and Path(origin).parent.parent != ROOT
               for name, origin in seen["origins"].items()), seen["origins"]
    _assert_old_names(seen)


def test_every_package_is_listed() -> None:
    """pyproject.toml lists the packages one by one (package-dir maps two of them from outside planner/): the list
    is every folder with an __init__.py, so a new subpackage is not left out of the wheel."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    package_dir = setuptools["package-dir"]
    assert package_dir == {"planner": "planner", "planner.runtime": "runtime", "planner.profilers": "profilers",
                           "runtime": "compat/runtime", "profilers": "compat/profilers"}
    found = {"runtime", "profilers"}
    for package, folder in package_dir.items():
        if package.startswith("planner"):
            found |= {".".join((package, *init.parent.relative_to(ROOT / folder).parts))
                      for init in (ROOT / folder).rglob("__init__.py")}
    assert sorted(setuptools["packages"]) == sorted(found)


def test_a_built_wheel_installs_the_new_and_the_old_names(tmp_path: Path) -> None:
    """The wheel, built from a copy of the sources and installed into a folder of its own, imported with that
    folder and the environment's site-packages (torch and the rest) alone on sys.path: no repository, no
    editable install."""
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for entry in ("planner", "runtime", "profilers", "compat"):
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
    assert (target / "runtime" / "__init__.py").is_file() and not (target / "runtime" / "exchange.py").exists()

    # -I and -S: no working folder, PYTHONPATH or site (whose .pth would add the editable install's finder).
    site = list(dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib")))
    prelude = f"import sys; sys.path[:0] = {[str(target), *site]!r}\n"
    seen = _run(["-I", "-S"], tmp_path, prelude + CHECK)
    assert str(ROOT) not in seen["path"] and "" not in seen["path"]
    assert seen["origins"] == {"runtime": str(target / "runtime" / "__init__.py"),
                               "profilers": str(target / "profilers" / "__init__.py")}
    assert seen["files"] == {"planner": str(target / "planner" / "__init__.py"),
                             "planner.runtime": str(target / "planner" / "runtime" / "__init__.py"),
                             "planner.profilers": str(target / "planner" / "profilers" / "__init__.py")}
    _assert_old_names(seen)

    # The warning as a user sees it: shown by default, at the importing line.
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", prelude + "import planner.runtime, planner.profilers\n"
                           "import runtime"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "<string>:3: DeprecationWarning: `runtime` is deprecated" in proc.stderr
    assert "import `planner.runtime` instead" in proc.stderr


def test_a_training_job_and_a_commands_workers_import_no_table_solver_or_tuning_library() -> None:
    """The runtime a training job imports, and the modules a command's workers import, load none of pandas,
    matplotlib, optuna, pulp or ortools: each costs every worker start and every training job its import time."""
    code = ("import json, sys; import planner.runtime, planner.commands.cli, planner.commands.profile, "
            "planner.commands.bench; print(json.dumps(sorted(m for m in ('pandas', 'matplotlib', 'optuna', 'pulp', "
            "'ortools') if m in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
