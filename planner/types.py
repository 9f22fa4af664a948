"""Errors, enums and small shared types of the planner (one module, as the style guide asks)."""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

__all__ = [
    "DENSE_COMPRESSOR",
    "GROUPING_STRATEGIES",
    "MAX_POWERSGD_RANK",
    "ROOT_NAME",
    "Collective",
    "Compressor",
    "CompressorError",
    "CompressorKind",
    "DistributedError",
    "FactorKind",
    "InvalidProfileError",
    "InverseMethod",
    "ModelLoadError",
    "PlanMismatchError",
    "PlannerError",
    "PlannerFileError",
    "RemoteTraceback",
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


class RemoteTraceback(Exception):
    """The traceback text of an exception raised in a worker; set as `__cause__` of the error the launcher
    re-raises in the parent (`planner.platform.launch`), with the rank it came from."""

    def __init__(self, text: str, rank: int | None = None, *, phase: str | None = None) -> None:
        super().__init__(text)
        self.text = text
        self.rank = rank
        self.phase = phase  # what the worker was doing (`planner.platform.phase`), where it said

    def __str__(self) -> str:
        return f'\n"""\n{self.text}"""'


class GateTimeoutError(DistributedError):
    """A crossover gate was not handed back in time: the paired job holding the device is stuck or stopped."""


class CompressorError(PlannerError, ValueError):
    """A compressor named on the command line or in a plan does not exist or has parameters out of range."""


class Strategy(enum.StrEnum):
    """How gradients are communicated: one way for every group (dense allreduce, top-k allgather), or a
    compressor chosen per group (`MIXED`, see `Compressor`)."""

    DENSE = "dense"
    TOPK = "topk"
    MIXED = "mixed"


#: The strategies whose groups are all sent one way: the gradient-grouping problems of `planner.costmodel`.
GROUPING_STRATEGIES = (Strategy.DENSE, Strategy.TOPK)


class CompressorKind(enum.StrEnum):
    """How one group of gradients is sent (`Compressor` adds the parameters)."""

    DENSE = "dense"  # fp32 allreduce
    FP16 = "fp16"  # cast to fp16 and divided by the world size, allreduced, cast back (DDP's fp16_compress_hook)
    POWERSGD = "powersgd"  # rank-r low-rank approximation with error feedback, two allreduces (Vogels et al. 2019)
    TOPK = "topk"  # the k largest of gradient plus residual, allgathered (error feedback)


#: Largest PowerSGD rank a compressor may name (the rank of the approximation of each matrix).
MAX_POWERSGD_RANK = 1024

_COMPRESSOR_FORMS = (f"dense, fp16, powersgd:R (R a whole number in 1..{MAX_POWERSGD_RANK}) or topk:D "
                     "(D a decimal number, 0 < D <= 1)")

#: How a rank and a density are written: ASCII digits only. `int` and `float` take much more ("+-3" fails deep
#: inside, "²" and "١" are digits to `str.isdigit`, "1_0", "nan", "inf" and full-width digits are numbers to
#: `float`), so the text is matched first and only then converted.
_RANK = re.compile(r"[0-9]{1,12}", re.ASCII)
_DENSITY = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,4})?", re.ASCII)


@dataclass(frozen=True)
class Compressor:
    """A compressor and its parameter: `rank` for PowerSGD, `density` for top-k (None otherwise).

    Written as text the way the command line and plans name it: "dense", "fp16", "powersgd:4", "topk:0.01".

    Raises:
        CompressorError: a parameter missing, out of range, or given to a compressor that has none.
    """

    kind: CompressorKind
    rank: int | None = None
    density: float | None = None

    def __post_init__(self) -> None:
        kind = CompressorKind(self.kind)
        object.__setattr__(self, "kind", kind)
        if kind is CompressorKind.POWERSGD:
            rank = self.rank
            if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_POWERSGD_RANK:
                raise CompressorError(f"a PowerSGD rank must be a whole number in 1..{MAX_POWERSGD_RANK}, but got "
                                      f"rank={rank!r}")
        elif self.rank is not None:
            raise CompressorError(f"only powersgd has a rank, but {kind.value} got rank={self.rank!r}")
        if kind is CompressorKind.TOPK:
            density = self.density
            if isinstance(density, bool) or not isinstance(density, int | float) or not (
                    math.isfinite(density) and 0 < density <= 1):
                raise CompressorError(f"`0 < density <= 1` must hold for topk, but got density={density!r}")
            object.__setattr__(self, "density", float(density))
        elif self.density is not None:
            raise CompressorError(f"only topk has a density, but {kind.value} got density={self.density!r}")

    def __str__(self) -> str:
        match self.kind:
            case CompressorKind.POWERSGD:
                return f"powersgd:{self.rank}"
            case CompressorKind.TOPK:
                return f"topk:{self.density!r}"
            case _:
                return self.kind.value

    @property
    def lossy(self) -> bool:
        """Whether the averaged gradient differs from the dense one by more than rounding."""
        return self.kind in (CompressorKind.POWERSGD, CompressorKind.TOPK)

    @classmethod
    def parse(cls, text: str) -> Compressor:
        """The compressor `text` names ("dense", "fp16", "powersgd:4", "topk:0.01").

        Raises:
            CompressorError: an unknown name or a parameter out of range, in one line.
        """
        if not isinstance(text, str):
            raise CompressorError(f"a compressor is named by text ({_COMPRESSOR_FORMS}), but got {text!r}")
        name, sep, param = text.strip().partition(":")
        try:
            kind = CompressorKind(name.strip().lower())
        except ValueError:
            raise CompressorError(f"unknown compressor {text!r}; known: {_COMPRESSOR_FORMS}") from None
        param = param.strip()
        try:
            return cls._of(kind, sep, param, text)
        except CompressorError as exc:
            message = str(exc)
            raise CompressorError(message if message.startswith(repr(text)) else f"{text!r}: {message}") from None

    @classmethod
    def _of(cls, kind: CompressorKind, sep: str, param: str, text: str) -> Compressor:
        match kind:
            case CompressorKind.POWERSGD:
                if not sep or not _RANK.fullmatch(param):
                    raise CompressorError(f"{text!r}: powersgd needs a rank written in digits, a whole number in "
                                          f"1..{MAX_POWERSGD_RANK} (e.g. powersgd:4)")
                return cls(kind, rank=int(param))
            case CompressorKind.TOPK:
                if not sep or len(param) > 40 or not _DENSITY.fullmatch(param):
                    raise CompressorError(f"{text!r}: topk needs a density written as a decimal number in (0, 1] "
                                          f"(e.g. topk:0.01)")
                return cls(kind, density=float(param))
            case _:
                if sep:
                    raise CompressorError(f"{text!r}: {kind.value} takes no parameter; write {kind.value}")
                return cls(kind)


#: Fp32 allreduce, the compressor of every group of a dense plan.
DENSE_COMPRESSOR = Compressor(CompressorKind.DENSE)


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
