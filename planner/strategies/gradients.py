"""From a profile to a plan: solve, evaluate the baselines and the lower bound with the same model."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import replace

from planner.contracts.layers import LayerSpec, groups_for
from planner.contracts.plan import Plan, check_selector
from planner.contracts.profile import Profile
from planner.costmodel.simulator import simulate
from planner.solvers import BASELINES, DDP_BASELINE, GroupingSolver, lower_bound, solve_exact
from planner.strategies.problems import gradient_problem, hierarchical_groups
from planner.types import InvalidProfileError, SchemaError, Strategy

__all__ = ["ALL_FLAT", "ALL_HIERARCHICAL", "make_plan"]

#: Baseline rows of a plan for several hosts: the exact grouping with every group flat, and hierarchical.
ALL_FLAT = "plan, all flat"
ALL_HIERARCHICAL = "plan, all hierarchical"


def make_plan(
    profile: Profile,
    strategy: Strategy,
    density: float | None = None,
    *,
    source: str = "",
    solver: GroupingSolver | None = None,
    selector: str | None = None,
    route: str = "best",
) -> Plan:
    """The optimal plan for `profile` (or the grouping of `solver`, e.g. a baseline, when given).

    Args:
        route: how dense groups cross hosts on a profile of several (`planner.strategies.problems.ROUTES`):
            "best" per group, or every group "flat" or "hierarchical".
        selector: top-k only: the selector whose measured selection cost the plan assumes ("exact",
            "sampled"). None ("auto") solves once with each selector the profile measured and keeps the
            plan with the lower predicted iteration time (exact on a tie); its baselines and lower bound
            are evaluated with that selector. `solve_seconds` then counts every solve.

    Raises:
        SchemaError: a selector for a dense plan, or an unknown selector name.
        InvalidProfileError: the profile has no top-k measurements (or none for the forced selector).
    """
    if strategy is not Strategy.TOPK:
        if selector is not None:
            raise SchemaError(f"a selector applies to top-k plans only, but got selector={selector!r} for "
                              f"strategy {strategy.value}")
        return _solve(profile, strategy, density, source=source, solver=solver, selector=None, route=route)
    if route != "best":
        raise SchemaError(f"--route applies to dense plans; top-k groups are allgathered flat, got route={route!r}")
    if selector is not None:
        check_selector(selector, "selector")
        return _solve(profile, strategy, density, source=source, solver=solver, selector=selector)
    measured = profile.topk.selectors() if profile.topk is not None else []
    plans = [_solve(profile, strategy, density, source=source, solver=solver, selector=s)
             for s in measured or ["exact"]]  # nothing measured: "exact" raises the profile's own error
    best = min(plans, key=lambda p: p.predicted.iteration_s)  # first (exact) on a tie
    return replace(best, solve_seconds=sum(p.solve_seconds for p in plans))


def _solve(
    profile: Profile,
    strategy: Strategy,
    density: float | None,
    *,
    source: str,
    solver: GroupingSolver | None,
    selector: str | None,
    route: str = "best",
) -> Plan:
    """One plan under one selection-cost model (`selector` None for dense). On a profile of several hosts a
    dense group goes flat or hierarchically, whichever is cheaper for it; the baselines then run flat, as the
    systems they stand for do, beside the exact plan all flat and all hierarchical."""
    if route != "best" and profile.hosts is None:
        raise InvalidProfileError(f"route {route!r} needs a profile of several hosts (`planner profile --hosts H`, or "
                                  "under torchrun across hosts); this one measured one host")
    problem = gradient_problem(profile, strategy, density, selector=selector or "exact", route=route)
    flat = gradient_problem(profile, strategy, density, selector=selector or "exact", route="flat")
    # DDP's row: DDP's buckets, moved by DDP at its own measured cost.
    ddp_problem = gradient_problem(profile, strategy, density, selector=selector or "exact", runtime="ddp")
    t0 = time.perf_counter()
    grouping = solver.solve(problem) if solver is not None else solve_exact(problem)
    seconds = time.perf_counter() - t0
    layers = [LayerSpec(name=lt.name, params=lt.params, numel=lt.numel) for lt in profile.layers]
    groups = groups_for(layers, grouping, strategy, density)
    routed = (hierarchical_groups(problem, grouping) if route != "hierarchical"
              else tuple(True for _ in grouping))
    groups = tuple(replace(g, hierarchical=h) for g, h in zip(groups, routed, strict=True))
    baselines = {b.name: simulate(ddp_problem if b.name == DDP_BASELINE else flat, b.solve(flat))
                 for b in BASELINES[strategy]}
    if strategy is Strategy.DENSE and profile.hosts is not None:
        hierarchical = gradient_problem(profile, strategy, route="hierarchical")
        baselines[ALL_FLAT] = simulate(flat, solve_exact(flat))
        baselines[ALL_HIERARCHICAL] = simulate(hierarchical, solve_exact(hierarchical))
    return Plan(
        strategy=strategy,
        density=density if strategy is Strategy.TOPK else None,
        selector=selector,
        model=profile.model,
        cluster=profile.cluster,
        groups=groups,
        predicted=simulate(problem, grouping),
        baselines=baselines,
        lower_bound_s=min(lower_bound(problem), lower_bound(ddp_problem)),  # a bound for DDP's row too
        solver=solver.name if solver is not None else f"{strategy.value}-exact",
        solve_seconds=seconds,
        source_profile=source,
        profiled=profile.created,
        batch_size=profile.batch_size,
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    )
