"""When the solve of one plan must end: one `Deadline`, passed down to every sub-solve of that plan.

`planner solve --time-limit T` bounds the whole solve of a plan (the exact search's tables, beams, fallback,
the baselines that are sub-solves, the lower bound), not only its search: the plan's strategy makes one
deadline and hands it (or a share of what is left of it, `share`) to each part. Each loop of a solver asks
`passed()` once per step (a row of a table, a layer of a search) and stops at the first True, keeping the best
answer it already has; so a solve ends within one step of the deadline.

The clock is injectable so that tests can prove the limit is honoured without timing anything: a fake clock that
moves on by a fixed amount per reading passes the deadline after a known number of steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from planner.types import SolverError

__all__ = ["Deadline"]


class Deadline:
    """A point on `clock` after which a solve stops and answers with the best it has.

    Args:
        seconds: from now; None: never.
        clock: seconds, non-decreasing (default `time.perf_counter`).

    Raises:
        SolverError: `seconds` not a finite number >= 0.
    """

    __slots__ = ("_at", "_clock", "_root", "late_checks", "seconds")

    def __init__(self, seconds: float | None = None, *, clock: Callable[[], float] = time.perf_counter) -> None:
        if seconds is not None and not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds >= 0):
            raise SolverError(f"a time limit must be a finite number of seconds >= 0 or None, but got {seconds!r}")
        self._clock = clock
        self.seconds = seconds
        self._at = math.inf if seconds is None else clock() + seconds
        self._root = self
        #: How many times `passed()` answered True, on this deadline and every share of it: each loop that
        #: notices stops, so this stays small.
        self.late_checks = 0

    def _until(self, at: float) -> Deadline:
        """A share of this deadline that ends at `at` (no later than this one)."""
        child = Deadline(None, clock=self._clock)
        child._at = min(at, self._at)
        child.seconds = self.seconds
        child._root = self._root
        return child

    @property
    def unlimited(self) -> bool:
        return math.isinf(self._at)

    def passed(self) -> bool:
        """Whether the deadline has passed (reads the clock unless there is none)."""
        if math.isinf(self._at):
            return False
        if self._clock() >= self._at:
            self._root.late_checks += 1
            return True
        return False

    def left(self) -> float:
        """Seconds left (inf without a deadline, 0 once passed)."""
        if math.isinf(self._at):
            return math.inf
        return max(0.0, self._at - self._clock())

    def share(self, fraction: float) -> Deadline:
        """A deadline `fraction` (in (0, 1]) of the way from now to this one (this one without a deadline)."""
        if not 0 < fraction <= 1:
            raise SolverError(f"`0 < fraction <= 1` must hold, but got fraction={fraction}")
        if math.isinf(self._at):
            return self
        now = self._clock()
        return self._until(now + fraction * max(0.0, self._at - now))

    def within(self, seconds: float | None) -> Deadline:
        """A deadline `seconds` from now, or this one if it is sooner (this one for None)."""
        if seconds is None:
            return self
        return self._until(self._clock() + seconds)

    def __repr__(self) -> str:
        return f"Deadline(seconds={self.seconds}, left={self.left():.3g})"
