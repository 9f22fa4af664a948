"""Parameters without a gradient: which ones `planner profile` found over several batches, as recorded in the
profile and carried by the plans solved from it, so that the runtime knows `find_unused_parameters` is needed.

Schema (inside the profile and the plan, version 1 like them; absent or null: not checked, as in files written
before it was):

    "unused_params": {
      "batches": 16,                       # forward and backward passes checked, each on its own batch
      "never": ["aux.weight", ...],        # no gradient in any of them (a head the loss never touches)
      "sometimes": ["experts.0.weight"]    # no gradient in some (a mixture-of-experts router's choice)
    }

Either kind of parameter needs `find_unused_parameters=True`, in DDP (which otherwise fails on the next step) as in
`GradientExchange` (which otherwise refuses such a plan): without it a missing gradient is averaged as zeros, and
the optimizer then applies its momentum and weight decay to a parameter DDP would leave alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.contracts.jsonio import check_fields, expect, expect_int
from planner.types import SchemaError

__all__ = ["MAX_CHECKED_BATCHES", "UnusedParams"]

#: The most batches a record may say were checked (a bound for reading files).
MAX_CHECKED_BATCHES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class UnusedParams:
    """The parameters that had no gradient in every one (`never`) or some (`sometimes`) of `batches` batches."""

    batches: int
    never: tuple[str, ...] = ()
    sometimes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        expect_int(self.batches, "unused_params.batches", 1, MAX_CHECKED_BATCHES)
        for name, names in (("never", self.never), ("sometimes", self.sometimes)):
            for i, n in enumerate(names):
                if not isinstance(n, str) or not n:
                    raise SchemaError(f"unused_params.{name}[{i}] must be a parameter name, got {n!r}")
            if len(set(names)) != len(names):
                raise SchemaError(f"unused_params.{name} names a parameter twice: {sorted(names)}")
        both = sorted(set(self.never) & set(self.sometimes))
        if both:
            raise SchemaError(f"unused_params names {both} both never and sometimes unused")

    @property
    def any(self) -> bool:
        """Whether some parameter went without a gradient: then `find_unused_parameters=True` is needed."""
        return bool(self.never or self.sometimes)

    @property
    def names(self) -> tuple[str, ...]:
        """Every parameter that went without a gradient in some batch."""
        return self.never + self.sometimes

    def check_names(self, known: set[str], where: str) -> None:
        """Refuse names that are not among `known` (the parameters of the profile's layers or the plan's groups)."""
        stray = [n for n in self.names if n not in known]
        if stray:
            raise SchemaError(f"{where}.unused_params names {stray[:3]}, which {where} does not hold")

    def summary(self) -> str:
        """One line: how many parameters went without a gradient, a few names, and what that needs."""
        parts = []
        if self.never:
            parts.append(f"{len(self.never)} never ({_first(self.never)})")
        if self.sometimes:
            parts.append(f"{len(self.sometimes)} only in some ({_first(self.sometimes)})")
        return (f"unused parameters: over {self.batches} batches, {' and '.join(parts)} had no gradient; "
                "a plan made from this profile carries it, so GradientExchange and PlanHook turn "
                "find_unused_parameters on themselves (plain DDP needs find_unused_parameters=True)")

    def to_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "never": list(self.never), "sometimes": list(self.sometimes)}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> UnusedParams:
        data = expect(data, dict, where)
        check_fields(data, where, ["batches", "never", "sometimes"])
        return cls(batches=expect_int(data["batches"], f"{where}.batches", 1, MAX_CHECKED_BATCHES),
                   never=tuple(expect(data["never"], list, f"{where}.never")),
                   sometimes=tuple(expect(data["sometimes"], list, f"{where}.sometimes")))


def _first(names: tuple[str, ...], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", and {len(names) - limit} more" if len(names) > limit else "")
