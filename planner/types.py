"""Errors, enums and small shared types of the planner (one module, as the style guide asks)."""

from __future__ import annotations

import enum

__all__ = [
    "ROOT_NAME",
    "Collective",
    "DistributedError",
    "FactorKind",
    "InvalidProfileError",
    "InverseMethod",
    "ModelLoadError",
    "PlanMismatchError",
    "PlannerError",
    "PlannerFileError",
    "SchemaError",
    "SolverError",
    "Strategy",
    "UnknownModelError",
]


#: The layer name of parameters registered on the model itself (its qualified module name is "").
ROOT_NAME = "<root>"


class PlannerError(Exception):
    """Root of every error the planner raises on purpose; the CLI prints it as one line."""


class PlannerFileError(PlannerError, OSError):
    """A file the user named is missing or unreadable."""


class SchemaError(PlannerError, ValueError):
    """A plan or profile document is malformed: bad JSON, unknown version, unknown or missing field."""


class InvalidProfileError(SchemaError):
    """A profile holds values no measurement can produce (NaN, negative times, empty tables)."""


class PlanMismatchError(PlannerError, ValueError):
    """A plan was made for another model, world size or strategy than the one it is applied to."""


class UnknownModelError(PlannerError, ValueError):
    """A built-in model name that does not exist."""


class ModelLoadError(PlannerError, ImportError):
    """A user model given as `package.module:factory` could not be loaded."""


class SolverError(PlannerError, RuntimeError):
    """A solver was given an instance it cannot solve (empty, inconsistent)."""


class DistributedError(PlannerError, RuntimeError):
    """Worker processes failed or the process group is not in the expected state."""


class GateTimeoutError(DistributedError):
    """A crossover gate was not handed back in time: the paired job holding the device is stuck or stopped."""


class Strategy(enum.StrEnum):
    """How gradients are communicated."""

    DENSE = "dense"
    TOPK = "topk"


class Collective(enum.StrEnum):
    """Collectives the profiler measures and the cost model knows."""

    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"


class FactorKind(enum.StrEnum):
    """The two Kronecker factors of a layer: A from its inputs (forward), G from its output gradients (backward)."""

    A = "A"
    G = "G"


class InverseMethod(enum.StrEnum):
    """How K-FAC turns a factor into a preconditioner: a damped inverse, or an eigendecomposition."""

    INVERSE = "inverse"
    EIGEN = "eigen"
