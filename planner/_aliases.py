"""The old import paths `runtime` and `profilers`, kept for a while: each is the same module as
`planner.runtime` / `planner.profilers`, with a DeprecationWarning naming the new path.

The folders runtime/ and profilers/ sit at the top of the repository and setuptools maps them into the
package (`package-dir` in pyproject.toml). The old names are reached two ways, and both end here:
- installed (a wheel, or an editable install run from elsewhere): the top-level packages `runtime` and
  `profilers` are the two small shims in compat/;
- run from the repository root, where the folder itself is found first as the top-level `runtime`: its
  `__init__.py`, imported under that name, calls `alias_package` too.

`alias_package` makes `sys.modules["runtime"]` the module `planner.runtime` (the import statement returns
what sys.modules holds once the package's `__init__` has run), and puts one finder first on
`sys.meta_path` that answers `runtime.x` with the already imported (or now imported) `planner.runtime.x`,
so that no file is ever loaded twice under two names: `runtime.GradientExchange is
planner.runtime.GradientExchange`, and so are pickles and checks of `isinstance`."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: Old top-level name -> new dotted name.
RENAMED = {"runtime": "planner.runtime", "profilers": "planner.profilers"}


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`old.x` -> the module `new.x`, the same object (its name, file and spec stay the new ones)."""

    def __init__(self) -> None:
        self.prefixes: dict[str, str] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        head, _, rest = fullname.partition(".")
        if rest and head in self.prefixes:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        head, _, rest = spec.name.partition(".")
        # The import system sets only the attributes the module lacks, so the new module keeps its own.
        return importlib.import_module(f"{self.prefixes[head]}.{rest}")

    def exec_module(self, module: ModuleType) -> None:
        pass  # already run, under its new name


_FINDER = _AliasFinder()


def alias_package(old: str, new: str) -> ModuleType:
    """Warn that `old` is deprecated, and make `old` and every `old.x` the modules `new` and `new.x`."""
    warnings.warn(f"`{old}` is deprecated and will be removed: import `{new}` instead "
                  f"(e.g. `from {new} import ...`)", DeprecationWarning, stacklevel=3)
    module = importlib.import_module(new)
    _FINDER.prefixes[old] = new
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    sys.modules[old] = module
    for name, submodule in list(sys.modules.items()):
        if name.startswith(f"{new}."):
            sys.modules.setdefault(old + name.removeprefix(new), submodule)
    return module
