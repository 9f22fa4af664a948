"""The timing harness of `planner bench-solvers`: the grouping solvers (`time_solvers`) and the K-FAC placement
solvers (`time_placement`), each on a random instance (`planner.testing`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from planner.costmodel.simulator import simulate
from planner.solvers import BASELINES, DenseDP, GroupingSolver, TopkParetoDP, lower_bound
from planner.solvers.placement import PLACEMENT_BASELINES, PLACEMENT_SOLVERS, PlacementResult, PlacementSolver
from planner.testing import random_placement_problem, random_problem
from planner.types import GROUPING_STRATEGIES, SolverError, Strategy

__all__ = ["time_placement", "time_solvers"]


def _exact_solver(strategy: Strategy) -> GroupingSolver:
    match strategy:
        case Strategy.DENSE:
            return DenseDP()
        case Strategy.TOPK:
            return TopkParetoDP()
        case other:
            raise SolverError(f"no exact solver for strategy={other!r}")


def time_solvers(num_layers: int = 1000, repeats: int = 5, seed: int = 0,
                 interference: tuple[float, ...] = (0.0,)) -> list[dict[str, Any]]:
    """Median wall time of each solver on one random problem per strategy and interference, with its
    grouping's prediction (a dense problem with interference also has a packing cost, so its exact solver
    is the two-clock search).

    Returns one row per (strategy, interference, solver): solver, strategy, interference, exact, median_s
    (seconds to solve), iteration_s (predicted iteration of its grouping), num_groups, lower_bound_s.
    """
    if repeats < 1:
        raise SolverError(f"`repeats >= 1` must hold, but got repeats={repeats}")
    rows: list[dict[str, Any]] = []
    for strategy, sigma in ((st, sg) for st in GROUPING_STRATEGIES for sg in interference):
        problem = random_problem(num_layers, strategy, seed=seed, interference=sigma)
        bound = lower_bound(problem)
        for solver in (_exact_solver(strategy), *BASELINES[strategy]):
            times = []
            grouping: tuple[int, ...] = ()
            for _ in range(repeats):
                start = time.perf_counter()
                grouping = solver.solve(problem)
                times.append(time.perf_counter() - start)
            prediction = simulate(problem, grouping)
            rows.append(
                {
                    "solver": solver.name,
                    "strategy": strategy.value,
                    "interference": sigma,
                    "exact": solver.exact,
                    "median_s": statistics.median(times),
                    "iteration_s": prediction.iteration_s,
                    "num_groups": prediction.num_groups,
                    "lower_bound_s": bound,
                }
            )
    return rows


def time_placement(
    n: int, world_size: int, repeats: int = 3, time_limit_s: float = 1.5, seed: int = 0
) -> list[dict[str, Any]]:
    """Median wall time and result of every exact solver and baseline on one random instance.

    Returns one row per solver: solver, exact (a model solver), factors, world_size, median_s, makespan_s,
    lower_bound_s, gap, optimal, num_everywhere, and vs_best_baseline (best baseline makespan / this one).
    """
    if repeats < 1:
        raise SolverError(f"`repeats >= 1` must hold, but got repeats={repeats}")
    problem = random_placement_problem(n, world_size, seed)
    solvers: list[tuple[PlacementSolver, bool]] = [
        *((cls(time_limit_s=time_limit_s), True) for cls in PLACEMENT_SOLVERS.values()),
        *((cls(), False) for cls in PLACEMENT_BASELINES),
    ]
    measured: list[tuple[PlacementSolver, bool, float, PlacementResult]] = []
    for solver, exact in solvers:
        times, result = [], None
        for _ in range(repeats):
            begin = time.perf_counter()
            result = solver.solve(problem)
            times.append(time.perf_counter() - begin)
        assert result is not None
        measured.append((solver, exact, statistics.median(times), result))
    best_baseline = min(r.makespan_s for _, exact, _, r in measured if not exact)
    return [
        {
            "solver": solver.name,
            "exact": exact,
            "factors": n,
            "world_size": world_size,
            "median_s": median,
            "makespan_s": result.makespan_s,
            "lower_bound_s": result.lower_bound_s,
            "gap": result.gap,
            "optimal": result.optimal,
            "num_everywhere": result.num_everywhere,
            "vs_best_baseline": best_baseline / result.makespan_s if result.makespan_s > 0 else 1.0,
        }
        for solver, exact, median, result in measured
    ]
