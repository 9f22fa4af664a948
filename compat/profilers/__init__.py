"""The old import path `profilers`, installed as a top-level package for a while: the same module as
`planner.profilers` (and `profilers.x` as `planner.profilers.x`), with a DeprecationWarning. See planner/_aliases.py."""

from planner._aliases import alias_package

alias_package("profilers", "planner.profilers")
