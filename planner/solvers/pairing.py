"""Which jobs to cross over: the exact pairing of N jobs that share the devices (Muri-style, two per group).

The jobs take turns on the devices, one group at a time: a job alone, or a pair crossed over
(`planner.costmodel.crossover`). Each group runs for one period, in which each of its jobs makes one iteration:
t_i = `alone_s[i]` for job i alone, T_ij = `pair_s[(i, j)]` (the larger of the two jobs' periods crossed over)
for the pair. A round in which every job makes one iteration thus takes

    sum over groups of the group's period = sum_i t_i - sum over pairs (i, j) of (t_i + t_j - T_ij),

and minimising it maximises the rate at which every job progresses, all at the same rate: the total
throughput at equal progress. (The faster job of a pair could make more than one iteration in the pair's
period; the round counts one, so pairs of very different periods are valued conservatively.) That is a
maximum-weight matching with weight w_ij = t_i + t_j - T_ij, in which only pairs with a positive saving are
worth taking.

`best_pairing` solves it exactly with OR-Tools CP-SAT: one Boolean per candidate pair (positive saving), each
job in at most one chosen pair, maximise the sum of the chosen pairs' weights. Times are scaled to integers, the
largest to `MAX_UNITS` (2^40) and each rounded: a weight is then off by at most 1.5 units, so the answer's round
is within 1.5 N units (N * 1.4e-12 of the largest time) of the best one's. The search is deterministic (one
worker, a fixed seed and a deterministic time budget), so one instance gets one answer however busy the machine
is; ties between matchings of equal integer weight are broken by that search, the same way on every run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from planner.types import SolverError

__all__ = ["MAX_UNITS", "Pairing", "best_pairing", "pairing_period", "pairing_weights"]

#: The integer the largest time maps to in the CP-SAT model.
MAX_UNITS = 2**40
#: CP-SAT's deterministic time budget (about seconds on an unloaded core); N <= 16 jobs take milliseconds.
TIME_LIMIT_S = 10.0
#: A wall-clock stop at this many times the deterministic budget, for a badly overloaded machine.
WALL_BACKSTOP = 10.0
#: Most jobs `best_pairing` accepts (the model has N (N - 1) / 2 Booleans).
MAX_JOBS = 256


@dataclass(frozen=True)
class Pairing:
    """The groups of a pairing and the time of one round of them.

    Attributes:
        pairs: the crossed-over pairs (i, j), i < j, sorted.
        alone: the jobs left alone, ascending.
        total_period_s: seconds of one round (every job one iteration): sum of the pairs' periods and the
            alone jobs' times.
        optimal: whether the solver proved no pairing has a shorter round (up to the integer scaling).
    """

    pairs: tuple[tuple[int, int], ...]
    alone: tuple[int, ...]
    total_period_s: float
    optimal: bool

    def partner(self, job: int) -> int | None:
        """The job `job` is paired with, or None when it runs alone."""
        for i, j in self.pairs:
            if job in (i, j):
                return j if job == i else i
        return None


def _check(alone_s: Sequence[float], pair_s: Mapping[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """The candidate pairs as (i, j) with i < j; SolverError for bad times, indices or a pair given twice."""
    n = len(alone_s)
    if n > MAX_JOBS:
        raise SolverError(f"`len(alone_s) <= {MAX_JOBS}` must hold, but got {n} jobs")
    for i, t in enumerate(alone_s):
        if not (math.isfinite(t) and t > 0):
            raise SolverError(f"`0 < alone_s[{i}] < inf` must hold, but got alone_s[{i}]={t}")
    pairs: dict[tuple[int, int], float] = {}
    for key, t in pair_s.items():
        if len(key) != 2 or not all(isinstance(k, int) and not isinstance(k, bool) for k in key):
            raise SolverError(f"a pair must be two job indices, but got {key!r}")
        i, j = min(key), max(key)
        if i == j or i < 0 or j >= n:
            raise SolverError(f"`0 <= i != j < {n}` must hold for a pair (i, j), but got {key!r}")
        if not (math.isfinite(t) and t > 0):
            raise SolverError(f"`0 < pair_s[{key!r}] < inf` must hold, but got {t}")
        if (i, j) in pairs:
            raise SolverError(f"the pair ({i}, {j}) is given twice (as ({i}, {j}) and ({j}, {i}))")
        pairs[(i, j)] = float(t)
    return pairs


def pairing_period(alone_s: Sequence[float], pair_s: Mapping[tuple[int, int], float],
                   pairs: Sequence[tuple[int, int]]) -> float:
    """Seconds of one round with `pairs` crossed over and every other job alone (see the module docstring)."""
    paired = {k for pair in pairs for k in pair}
    times = {(min(p), max(p)): t for p, t in pair_s.items()}
    return math.fsum([*(times[(min(p), max(p))] for p in pairs), *(t for k, t in enumerate(alone_s)
                                                                   if k not in paired)])


def pairing_weights(alone_s: Sequence[float], pair_s: Mapping[tuple[int, int], float]) -> dict[tuple[int, int], int]:
    """The integer saving t_i + t_j - T_ij of every pair worth taking (a saving of at least one unit)."""
    pairs = _check(alone_s, pair_s)
    largest = max([*alone_s, *pairs.values()], default=0.0)
    if largest <= 0:
        return {}
    scale = MAX_UNITS / largest
    weights = {(i, j): round(alone_s[i] * scale) + round(alone_s[j] * scale) - round(t * scale)
               for (i, j), t in pairs.items()}
    return {pair: w for pair, w in sorted(weights.items()) if w > 0}


def best_pairing(alone_s: Sequence[float], pair_s: Mapping[tuple[int, int], float], *,
                 time_limit_s: float = TIME_LIMIT_S) -> Pairing:
    """The pairing with the shortest round (see the module docstring).

    Args:
        alone_s: t_i, seconds per iteration of each job alone.
        pair_s: T_ij, seconds of one period of the pair (i, j) crossed over, for each pair that may be crossed
            over (either order of the indices; absent pairs are never taken).
        time_limit_s: CP-SAT's deterministic time budget; past it the best pairing found is returned with
            optimal=False.

    Raises:
        SolverError: a time that is not finite and positive, a pair of a job with itself, an index out of
            range, a pair given twice.
    """
    if not (math.isfinite(time_limit_s) and time_limit_s > 0):
        raise SolverError(f"`time_limit_s > 0` must hold, but got time_limit_s={time_limit_s}")
    weights = pairing_weights(alone_s, pair_s)
    n = len(alone_s)
    chosen: list[tuple[int, int]] = []
    optimal = True
    if weights:
        model = cp_model.CpModel()
        take = {pair: model.new_bool_var(f"x{pair[0]}_{pair[1]}") for pair in weights}
        for k in range(n):
            touching = [v for pair, v in take.items() if k in pair]
            if len(touching) > 1:
                model.add_at_most_one(touching)
        model.maximize(cp_model.LinearExpr.weighted_sum(list(take.values()), list(weights.values())))
        solver = cp_model.CpSolver()
        solver.parameters.max_deterministic_time = time_limit_s
        solver.parameters.max_time_in_seconds = WALL_BACKSTOP * time_limit_s
        solver.parameters.num_workers = 1
        solver.parameters.random_seed = 0
        began = time.perf_counter()
        status = solver.solve(model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            raise SolverError(f"CP-SAT found no pairing in {time.perf_counter() - began:.1f} s (status "
                              f"{solver.status_name(status)}); every job alone is always a pairing: report this")
        chosen = [pair for pair, v in take.items() if solver.boolean_value(v)]
        optimal = status == cp_model.OPTIMAL
    paired = {k for pair in chosen for k in pair}
    pairs = tuple(sorted(chosen))
    return Pairing(pairs=pairs, alone=tuple(k for k in range(n) if k not in paired),
                   total_period_s=pairing_period(alone_s, pair_s, pairs), optimal=optimal)
