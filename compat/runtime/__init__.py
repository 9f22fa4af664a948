"""The old import path `runtime`, installed as a top-level package for a while: the same module as
`planner.runtime` (and `runtime.x` as `planner.runtime.x`), with a DeprecationWarning. See planner/_aliases.py."""

from planner._aliases import alias_package

alias_package("runtime", "planner.runtime")
