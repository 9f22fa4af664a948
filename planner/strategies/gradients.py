"""From a profile to a plan: solve, evaluate the baselines and the lower bound with the same model."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import replace
from typing import Any

from planner.contracts.layers import LayerSpec, groups_for
from planner.contracts.plan import Plan, check_selector
from planner.contracts.profile import Profile
from planner.costmodel.from_profile import gradient_problem, hierarchical_groups, mixed_problem
from planner.costmodel.mixed import MixedProblem, simulate_mixed
from planner.costmodel.problem import Prediction
from planner.costmodel.simulator import simulate
from planner.solvers import BASELINES, DDP_BASELINE, GroupingSolver, lower_bound, solve_exact
from planner.solvers.mixed import MixedParetoDP, mixed_lower_bound
from planner.types import Compressor, CompressorKind, InvalidProfileError, SchemaError, Strategy

__all__ = ["ALL_FLAT", "ALL_HIERARCHICAL", "check_route", "from_profile", "make_plan", "route_baselines",
           "route_ways"]

#: Baseline rows of a plan for several hosts: the exact grouping with every group flat, and hierarchical.
ALL_FLAT = "plan, all flat"
ALL_HIERARCHICAL = "plan, all hierarchical"
#: Seconds the exact search over groupings and ways across hosts of a top-k plan may take (`MixedParetoDP`).
ROUTES_TIME_LIMIT_S = 10.0


def from_profile(profile: Profile, source: str) -> dict[str, Any]:
    """The fields every plan takes from the profile it was solved from (`source`: that profile's path)."""
    return {"model": profile.model, "cluster": profile.cluster, "source_profile": source, "profiled": profile.created,
            "batch_size": profile.batch_size, "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}


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
        route: how dense groups cross hosts on a profile of several (`planner.costmodel.from_profile.ROUTES`):
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
    if selector is not None:
        check_selector(selector, "selector")
        return _solve(profile, strategy, density, source=source, solver=solver, selector=selector, route=route)
    measured = profile.topk.selectors() if profile.topk is not None else []
    plans = [_solve(profile, strategy, density, source=source, solver=solver, selector=s, route=route)
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
    check_route(profile, route)
    if strategy is Strategy.TOPK and profile.hosts is not None:
        assert density is not None
        if profile.hosts.topk_at(density) is not None:
            return _solve_topk_routes(profile, density, source=source, solver=solver, selector=selector or "exact",
                                      route=route)
        if route == "hierarchical":
            measured = ", ".join(f"{t.density:g}" for t in profile.hosts.topk) or "none"
            raise InvalidProfileError(
                f"route 'hierarchical' for top-k needs the hierarchical top-k exchange measured at density "
                f"{density:g} (this profile measured it at: {measured}); profile again with --hosts and "
                f"--densities including {density:g}")
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
        groups=groups,
        predicted=simulate(problem, grouping),
        baselines=baselines,
        lower_bound_s=min(lower_bound(problem), lower_bound(ddp_problem)),  # a bound for DDP's row too
        solver=solver.name if solver is not None else f"{strategy.value}-exact",
        solve_seconds=seconds,
        **from_profile(profile, source),
    )


def _solve_topk_routes(profile: Profile, density: float, *, source: str, solver: GroupingSolver | None,
                       selector: str, route: str) -> Plan:
    """A top-k plan on a profile that measured the hierarchical top-k exchange at `density`: each group flat
    or hierarchical ("best": whichever the exact search over groupings and ways finds fastest, `MixedParetoDP`
    on the two ways of one compressor), or every group one way ("flat", "hierarchical"). With `solver` (a
    baseline rule) its grouping is kept and every group goes flat, or hierarchical with route "hierarchical".
    The baselines run flat, as the systems they stand for do, beside the exact plan all flat and all
    hierarchical."""
    compressor = Compressor(CompressorKind.TOPK, density=density)
    mixed = mixed_problem(profile, [compressor], selector=selector)
    flat_way, routed_way = mixed.index_of(compressor), mixed.index_of(compressor, hierarchical=True)
    flat = gradient_problem(profile, Strategy.TOPK, density, selector=selector, route="flat")
    ddp_problem = gradient_problem(profile, Strategy.TOPK, density, selector=selector, runtime="ddp")
    t0 = time.perf_counter()
    if solver is not None:
        grouping = solver.solve(flat)
        choice = tuple(routed_way if route == "hierarchical" else flat_way for _ in grouping)
        name = solver.name
    else:
        allowed = {"best": (flat_way, routed_way), "flat": (flat_way,), "hierarchical": (routed_way,)}[route]
        found = MixedParetoDP(allowed=allowed, time_limit_s=ROUTES_TIME_LIMIT_S).solve(mixed)
        grouping, choice = found.grouping, found.choice
        name = (f"{Strategy.TOPK.value}-exact" if found.proven
                else f"{Strategy.TOPK.value}-routes (time limit; within {found.gap:.1%})")
    seconds = time.perf_counter() - t0
    layers = [LayerSpec(name=lt.name, params=lt.params, numel=lt.numel) for lt in profile.layers]
    groups = tuple(replace(g, hierarchical=c == routed_way)
                   for g, c in zip(groups_for(layers, grouping, Strategy.TOPK, density), choice, strict=True))
    baselines = {b.name: simulate(ddp_problem if b.name == DDP_BASELINE else flat, b.solve(flat))
                 for b in BASELINES[Strategy.TOPK]}
    baselines.update(route_baselines(mixed, ROUTES_TIME_LIMIT_S))
    predicted = simulate_mixed(mixed, grouping, choice)
    # The bounds' sums may round a few ulps above an optimum they equal: a bound is never above a found step.
    bound = min(mixed_lower_bound(mixed), lower_bound(ddp_problem), predicted.iteration_s)
    return Plan(
        strategy=Strategy.TOPK,
        density=density,
        selector=selector,
        groups=groups,
        predicted=predicted,
        baselines=baselines,
        lower_bound_s=bound,
        solver=name,
        solve_seconds=seconds,
        **from_profile(profile, source),
    )


def check_route(profile: Profile, route: str) -> None:
    """Raise InvalidProfileError where `route` forces a way across hosts on a profile of one host."""
    if route != "best" and profile.hosts is None:
        raise InvalidProfileError(f"route {route!r} needs a profile of several hosts (`planner profile --hosts H`, or "
                                  "under torchrun across hosts); this one measured one host")


def route_ways(problem: MixedProblem) -> dict[str, tuple[int, ...]]:
    """The ways of `problem` (indices of its compressors) a plan may use when every group crosses hosts flat
    ("flat"), or hierarchically where its compressor can ("hierarchical")."""
    routed = {c.compressor for c in problem.compressors if c.hierarchical}
    return {"flat": tuple(i for i, c in enumerate(problem.compressors) if not c.hierarchical),
            "hierarchical": tuple(i for i, c in enumerate(problem.compressors)
                                  if c.hierarchical or c.compressor not in routed)}


def route_baselines(problem: MixedProblem, time_limit_s: float | None) -> dict[str, Prediction]:
    """The exact plan of `problem` (which has hierarchical ways) with every group flat, and with every group
    hierarchical where its compressor can be (`ALL_FLAT`, `ALL_HIERARCHICAL`)."""
    out = {}
    ways = route_ways(problem)
    for name, allowed in ((ALL_FLAT, ways["flat"]), (ALL_HIERARCHICAL, ways["hierarchical"])):
        best = MixedParetoDP(allowed=allowed, time_limit_s=time_limit_s).solve(problem)
        out[name] = simulate_mixed(problem, best.grouping, best.choice)
    return out
