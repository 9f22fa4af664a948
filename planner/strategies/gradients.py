"""From a profile to a plan: solve, evaluate the baselines and the lower bound with the same model."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import replace
from typing import Any

from planner.contracts.layers import LayerSpec
from planner.contracts.plan import Plan, check_selector, ddp_row
from planner.contracts.profile import Profile
from planner.costmodel.from_profile import gradient_problem, hierarchical_groups, mixed_problem
from planner.costmodel.mixed_simulator import MixedProblem, simulate_mixed
from planner.costmodel.problem import GradientProblem, Grouping, groups_for
from planner.costmodel.simulator import simulate
from planner.solvers import BASELINES, DDP_BASELINE, DenseDP, GroupingSolver, Solved, TopkParetoDP, lower_bound
from planner.solvers.compressor_choice import MixedParetoDP, MixedSolution, mixed_lower_bound
from planner.solvers.deadline import Deadline
from planner.strategies.via_ddp import with_via_ddp
from planner.types import Compressor, CompressorKind, InvalidProfileError, SchemaError, Strategy

__all__ = ["ALL_FLAT", "ALL_HIERARCHICAL", "check_route", "from_profile", "make_plan", "optimality",
           "route_solutions", "route_ways", "sub_solve_seconds"]

#: Baseline rows of a plan for several hosts: the exact grouping with every group flat, and hierarchical.
ALL_FLAT = "plan, all flat"
ALL_HIERARCHICAL = "plan, all hierarchical"
#: Seconds the solve of a top-k plan whose groups choose their way across hosts may take (`MixedParetoDP`, and the
#: plans all flat and all hierarchical beside it), unless `--time-limit` says otherwise.
ROUTES_TIME_LIMIT_S = 10.0
#: The share of a plan's time limit that the sub-solves printed beside it (a plan all flat, all hierarchical, or
#: with one compressor) may take together: they leave the plan's own search at least the rest.
SUB_SOLVES_SHARE = 0.5


def optimality(proven: bool, iteration_s: float, bound_s: float | None) -> dict[str, Any]:
    """The plan fields `optimal` and `gap` of a solve: proven optimal (gap 0), or (iteration - bound) / bound."""
    if proven:
        return {"optimal": True, "gap": 0.0}
    gap = max(0.0, iteration_s / bound_s - 1) if bound_s and bound_s > 0 else 0.0
    return {"optimal": False, "gap": gap}


def _exact_solver(strategy: Strategy) -> GroupingSolver:
    return DenseDP() if strategy is Strategy.DENSE else TopkParetoDP()


def from_profile(profile: Profile, source: str) -> dict[str, Any]:
    """The fields every plan takes from the profile it was solved from (`source`: that profile's path)."""
    return {"model": profile.model, "cluster": profile.cluster, "source_profile": source, "profiled": profile.created,
            "batch_size": profile.batch_size, "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "unused_params": profile.unused_params}


def make_plan(
    profile: Profile,
    strategy: Strategy,
    density: float | None = None,
    *,
    source: str = "",
    solver: GroupingSolver | None = None,
    selector: str | None = None,
    route: str = "best",
    time_limit_s: float | None = None,
    via_ddp: bool = True,
) -> Plan:
    """The optimal plan for `profile` (or the grouping of `solver`, e.g. a baseline, when given), with its row run
    inside DDP (`planner.strategies.via_ddp`; not with `via_ddp` False: a plan made into a K-FAC or ABS-SGD plan).

    Args:
        time_limit_s: seconds the solve of one plan may take, its sub-solves included (None: dense and top-k on
            one host, no limit; top-k choosing its way across hosts, `ROUTES_TIME_LIMIT_S`). Past them the best
            plan found is kept, never slower than a baseline row it could have used, and recorded as not proven
            optimal with its gap to the bound.
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
    plan = _make_plan(profile, strategy, density, source=source, solver=solver, selector=selector, route=route,
                      time_limit_s=time_limit_s)
    if not via_ddp:
        return plan
    return with_via_ddp(plan, profile)


def _make_plan(profile: Profile, strategy: Strategy, density: float | None, *, source: str,
               solver: GroupingSolver | None, selector: str | None, route: str, time_limit_s: float | None) -> Plan:
    """`make_plan` without the row run inside DDP."""
    if strategy is not Strategy.TOPK:
        if selector is not None:
            raise SchemaError(f"a selector applies to top-k plans only, but got selector={selector!r} for "
                              f"strategy {strategy.value}")
        return _solve(profile, strategy, density, source=source, solver=solver, selector=None, route=route,
                      time_limit_s=time_limit_s)
    if selector is not None:
        check_selector(selector, "selector")
        return _solve(profile, strategy, density, source=source, solver=solver, selector=selector, route=route,
                      time_limit_s=time_limit_s)
    measured = profile.topk.selectors() if profile.topk is not None else []
    plans = [_solve(profile, strategy, density, source=source, solver=solver, selector=s, route=route,
                    time_limit_s=time_limit_s)
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
    time_limit_s: float | None = None,
) -> Plan:
    """One plan under one selection-cost model (`selector` None for dense). On a profile of several hosts a
    dense group goes flat or hierarchically, whichever is cheaper for it; the baselines then run flat, as the
    systems they stand for do, beside the exact plan all flat and all hierarchical."""
    check_route(profile, route)
    if strategy is Strategy.TOPK and profile.hosts is not None:
        assert density is not None
        if profile.hosts.topk_at(density) is not None:
            return _solve_topk_routes(profile, density, source=source, solver=solver, selector=selector or "exact",
                                      route=route, time_limit_s=time_limit_s)
        if route == "hierarchical":
            measured = ", ".join(f"{t.density:g}" for t in profile.hosts.topk) or "none"
            raise InvalidProfileError(
                f"route 'hierarchical' for top-k needs the hierarchical top-k exchange measured at density "
                f"{density:g} (this profile measured it at: {measured}); profile again with --hosts and "
                f"--densities including {density:g}")
    deadline = Deadline(time_limit_s)
    problem = gradient_problem(profile, strategy, density, selector=selector or "exact", route=route)
    flat = gradient_problem(profile, strategy, density, selector=selector or "exact", route="flat")
    # DDP's row: DDP's buckets, moved by DDP at its own measured cost (another runtime's costs: not a grouping this
    # plan could use under its problem, so not one it must beat).
    ddp_problem = gradient_problem(profile, strategy, density, selector=selector or "exact", runtime="ddp")
    t0 = time.perf_counter()
    # The rows that are groupings the plan could use on its own problem: the rules run flat, and (a dense plan
    # choosing its way per group) the exact plan all flat and all hierarchical, each within a share of the limit.
    rows = {b.name: b.solve(flat) for b in BASELINES[strategy]}
    routed: dict[str, Solved] = {}
    if strategy is Strategy.DENSE and profile.hosts is not None:
        hierarchical = gradient_problem(profile, strategy, route="hierarchical")
        for name, sub in ((ALL_FLAT, flat), (ALL_HIERARCHICAL, hierarchical)):
            routed[name] = DenseDP().solve_within(sub, deadline.within(sub_solve_seconds(time_limit_s, 2)))
    if solver is not None:
        solved = solver.solve_within(problem, deadline)
    else:
        solved = _exact_solver(strategy).solve_within(problem, deadline)
    grouping = solved.grouping
    if solver is None and not solved.proven:  # stopped early: never slower than a row it could have used
        usable = [g for name, g in rows.items() if name != DDP_BASELINE]
        usable += [r.grouping for name, r in routed.items() if route == "best" or _route_of(name) == route]
        grouping = _fastest(problem, [grouping, *usable])
    seconds = time.perf_counter() - t0
    layers = [LayerSpec(name=lt.name, params=lt.params, numel=lt.numel) for lt in profile.layers]
    groups = groups_for(layers, grouping, strategy, density)
    routed_groups = (hierarchical_groups(problem, grouping) if route != "hierarchical"
                     else tuple(True for _ in grouping))
    groups = tuple(replace(g, hierarchical=h) for g, h in zip(groups, routed_groups, strict=True))
    baselines = {ddp_row(strategy, density) if name == DDP_BASELINE else name:
                 simulate(ddp_problem if name == DDP_BASELINE else flat, g) for name, g in rows.items()}
    for name, r in routed.items():
        baselines[name] = simulate(flat if name == ALL_FLAT else hierarchical, r.grouping)
    predicted = simulate(problem, grouping)
    bound = solved.lower_bound_s if solved.lower_bound_s is not None else lower_bound(problem)
    return Plan(
        strategy=strategy,
        density=density if strategy is Strategy.TOPK else None,
        selector=selector,
        groups=groups,
        predicted=predicted,
        baselines=baselines,
        lower_bound_s=min(lower_bound(problem), lower_bound(ddp_problem)),  # a bound for DDP's row too
        solver=solver.name if solver is not None else f"{strategy.value}-exact",
        solve_seconds=seconds,
        **optimality(solved.proven, predicted.iteration_s, bound),
        **from_profile(profile, source),
    )


def sub_solve_seconds(time_limit_s: float | None, count: int) -> float | None:
    """Seconds of a plan's limit that each of `count` sub-solves printed beside it may take (None: no limit)."""
    return None if time_limit_s is None else SUB_SOLVES_SHARE * time_limit_s / max(1, count)


def _route_of(row: str) -> str:
    """The route a plan must have been asked for to use the grouping of row `ALL_FLAT` or `ALL_HIERARCHICAL`."""
    return "flat" if row == ALL_FLAT else "hierarchical"


def _fastest(problem: GradientProblem, groupings: list[Grouping]) -> Grouping:
    """The grouping predicted fastest on `problem` (the first on a tie)."""
    return min(groupings, key=lambda g: simulate(problem, g).iteration_s)


def _solve_topk_routes(profile: Profile, density: float, *, source: str, solver: GroupingSolver | None,
                       selector: str, route: str, time_limit_s: float | None = None) -> Plan:
    """A top-k plan on a profile that measured the hierarchical top-k exchange at `density`: each group flat
    or hierarchical ("best": whichever the exact search over groupings and ways finds fastest, `MixedParetoDP`
    on the two ways of one compressor), or every group one way ("flat", "hierarchical"). With `solver` (a
    baseline rule) its grouping is kept and every group goes flat, or hierarchical with route "hierarchical".
    The baselines run flat, as the systems they stand for do, beside the exact plan all flat and all
    hierarchical. The whole solve, those two plans included, takes at most `time_limit_s` (None:
    `ROUTES_TIME_LIMIT_S`)."""
    limit = ROUTES_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    deadline = Deadline(limit)
    compressor = Compressor(CompressorKind.TOPK, density=density)
    mixed = mixed_problem(profile, [compressor], selector=selector)
    flat_way, routed_way = mixed.index_of(compressor), mixed.index_of(compressor, hierarchical=True)
    flat = gradient_problem(profile, Strategy.TOPK, density, selector=selector, route="flat")
    ddp_problem = gradient_problem(profile, Strategy.TOPK, density, selector=selector, runtime="ddp")
    t0 = time.perf_counter()
    rows = {b.name: b.solve(flat) for b in BASELINES[Strategy.TOPK]}
    routes = route_solutions(mixed, deadline, sub_solve_seconds(limit, 2))
    allowed = {"best": (flat_way, routed_way), "flat": (flat_way,), "hierarchical": (routed_way,)}[route]
    if solver is not None:
        grouping = solver.solve(flat)
        choice = tuple(routed_way if route == "hierarchical" else flat_way for _ in grouping)
        found = MixedSolution(grouping, choice, simulate_mixed(mixed, grouping, choice).iteration_s, proven=False)
    else:
        # Never slower than a row it could have used: the rules' groupings sent flat (DDP's row is another
        # runtime's), and the plans all flat and all hierarchical.
        incumbents = [MixedSolution(g, (flat_way,) * len(g), 0.0) for name, g in rows.items()
                      if name != DDP_BASELINE and flat_way in allowed]
        incumbents += [s for s in routes.values() if set(s.choice) <= set(allowed)]
        found = MixedParetoDP(allowed=allowed).solve(mixed, deadline=deadline, incumbents=incumbents)
        grouping, choice = found.grouping, found.choice
    seconds = time.perf_counter() - t0
    layers = [LayerSpec(name=lt.name, params=lt.params, numel=lt.numel) for lt in profile.layers]
    groups = tuple(replace(g, hierarchical=c == routed_way)
                   for g, c in zip(groups_for(layers, grouping, Strategy.TOPK, density), choice, strict=True))
    baselines = {ddp_row(Strategy.TOPK, density) if name == DDP_BASELINE else name:
                 simulate(ddp_problem if name == DDP_BASELINE else flat, g) for name, g in rows.items()}
    baselines.update({name: simulate_mixed(mixed, s.grouping, s.choice) for name, s in routes.items()})
    predicted = simulate_mixed(mixed, grouping, choice)
    # A bound for every row: over both ways (a plan kept to one way has its own, `found.lower_bound_s`).
    every_way = found.lower_bound_s if route == "best" and found.lower_bound_s is not None else \
        mixed_lower_bound(mixed, deadline=deadline)
    # The bounds' sums may round a few ulps above an optimum they equal: a bound is never above a found step.
    bound = min(every_way, lower_bound(ddp_problem), predicted.iteration_s)
    own = found.lower_bound_s if found.lower_bound_s is not None else mixed_lower_bound(mixed, allowed,
                                                                                        deadline=deadline)
    return Plan(
        strategy=Strategy.TOPK,
        density=density,
        selector=selector,
        groups=groups,
        predicted=predicted,
        baselines=baselines,
        lower_bound_s=bound,
        solver=solver.name if solver is not None else f"{Strategy.TOPK.value}-exact",
        solve_seconds=seconds,
        **optimality(found.proven, predicted.iteration_s, own),
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


def route_solutions(problem: MixedProblem, deadline: Deadline | None = None, share_s: float | None = None
                    ) -> dict[str, MixedSolution]:
    """The exact plan of `problem` (which has hierarchical ways) with every group flat, and with every group
    hierarchical where its compressor can be (`ALL_FLAT`, `ALL_HIERARCHICAL`): each solved by `deadline`, and
    within `share_s` seconds (None: no more limit than the deadline's)."""
    out = {}
    ways = route_ways(problem)
    deadline = deadline if deadline is not None else Deadline()
    for name, allowed in ((ALL_FLAT, ways["flat"]), (ALL_HIERARCHICAL, ways["hierarchical"])):
        out[name] = MixedParetoDP(allowed=allowed).solve(problem, deadline=deadline.within(share_s))
    return out
