"""From a profile to a plan: solve, evaluate the baselines and the lower bound with the same model."""

from __future__ import annotations

import datetime as dt
import time

from planner.layers import LayerSpec, groups_for
from planner.plan import Plan
from planner.profile import Profile
from planner.simulator import simulate
from planner.solvers import BASELINES, GroupingSolver, lower_bound, solve_exact
from planner.types import Strategy

__all__ = ["make_plan"]


def make_plan(
    profile: Profile,
    strategy: Strategy,
    density: float | None = None,
    *,
    source: str = "",
    solver: GroupingSolver | None = None,
) -> Plan:
    """The optimal plan for `profile` (or the grouping of `solver`, e.g. a baseline, when given)."""
    problem = profile.problem(strategy, density)
    t0 = time.perf_counter()
    grouping = solver.solve(problem) if solver is not None else solve_exact(problem)
    seconds = time.perf_counter() - t0
    layers = [LayerSpec(name=lt.name, params=lt.params, numel=lt.numel) for lt in profile.layers]
    return Plan(
        strategy=strategy,
        density=density if strategy is Strategy.TOPK else None,
        model=profile.model,
        cluster=profile.cluster,
        groups=groups_for(layers, grouping, strategy, density),
        predicted=simulate(problem, grouping),
        baselines={b.name: simulate(problem, b.solve(problem)) for b in BASELINES[strategy]},
        lower_bound_s=lower_bound(problem),
        solver=solver.name if solver is not None else f"{strategy.value}-exact",
        solve_seconds=seconds,
        source_profile=source,
        profiled=profile.created,
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    )
