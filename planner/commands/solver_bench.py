"""Synthetic gradient problems, and the timing harness of `planner bench-solvers`: the grouping solvers (`time_solvers`)
and the K-FAC placement solvers (`time_placement`).

The instances are made up but shaped like real ones: layer sizes spread over four decades, backward time
roughly proportional to size, collectives with a start-up cost between 50 us and 1 ms, and top-k
selection that grows faster than linearly (N log N).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import numpy as np

from planner.costmodel.costs import AffineCost, PiecewiseLinearCost
from planner.costmodel.problem import GradientProblem
from planner.costmodel.simulator import simulate
from planner.solvers import BASELINES, DenseDP, GroupingSolver, TopkParetoDP, lower_bound
from planner.solvers.placement import (
    PLACEMENT_BASELINES,
    PLACEMENT_SOLVERS,
    PlacementResult,
    PlacementSolver,
    random_placement_problem,
)
from planner.types import GROUPING_STRATEGIES, SolverError, Strategy

__all__ = ["random_problem", "time_placement", "time_solvers"]


def random_problem(
    num_layers: int,
    strategy: Strategy,
    *,
    seed: int,
    density: float = 0.01,
    world_size: int = 2,
    interference: float = 0.0,
    comm_stretch: float = 0.0,
) -> GradientProblem:
    """A random but realistic `GradientProblem` with `num_layers` layers, reproducible from `seed`.

    numel is log-uniform in [1e2, 3e6]; backward is ~1 ns per element with noise plus 10 us; the collective
    is alpha + beta * bytes with alpha in [50 us, 1 ms] and beta in [1e-10, 1e-9] s/byte (log-uniform);
    top-k selection is interpolated from 20 us + c * N log2 N (superlinear) with c in [0.02, 0.3] ns,
    decoding is affine. With `interference` > 0 the compute stream runs that much slower while a
    collective is in flight, and dense groups pay a packing cost (2 us + 0.7 ns per element), as a
    measured CPU profile has them. `comm_stretch`: collectives run that much slower while backward
    runs.
    """
    if num_layers < 1:
        raise SolverError(f"`num_layers >= 1` must hold, but got num_layers={num_layers}")
    rng = np.random.default_rng(seed)
    numel = np.round(np.exp(rng.uniform(math.log(1e2), math.log(3e6), num_layers))).astype(np.int64)
    noise = rng.lognormal(mean=0.0, sigma=0.3, size=num_layers)
    backward = 1e-9 * numel * noise + 10e-6
    comm = AffineCost(
        alpha=float(np.exp(rng.uniform(math.log(50e-6), math.log(1e-3)))),
        beta=float(np.exp(rng.uniform(math.log(1e-10), math.log(1e-9)))),
    )
    select = decode = None
    topk = strategy is Strategy.TOPK
    if topk:
        sizes = [float(2**e) for e in range(6, 31, 2)]
        per_op = float(np.exp(rng.uniform(math.log(0.02e-9), math.log(0.3e-9))))
        select = PiecewiseLinearCost(xs=tuple(sizes), ys=tuple(20e-6 + per_op * x * math.log2(x) for x in sizes))
        decode = AffineCost(alpha=5e-6, beta=0.5e-9)
    return GradientProblem(
        strategy=strategy,
        forward_s=0.5 * float(backward.sum()),
        update_s=2e-9 * float(numel.sum()) + 50e-6,
        backward_s=tuple(float(b) for b in backward),
        numel=tuple(int(n) for n in numel),
        comm=comm,
        world_size=world_size,
        density=density if topk else None,
        select=select,
        decode=decode,
        pack=AffineCost(alpha=2e-6, beta=0.7e-9) if interference > 0 and not topk else None,
        interference=interference,
        comm_stretch=comm_stretch,
    )


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
