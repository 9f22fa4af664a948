"""Solve a profile into a plan for any strategy: what `planner solve` runs once its arguments are checked.

    request = SolveRequest(strategy="mixed", compressors=parse_compressors("light"), error_budget=None)
    solved = solve(Profile.load("profile.json"), request, source="profile.json")
    solved.plan.save("plan.json")

`solve` reads the profile for a what-if cluster when asked, keeps of a compressor preset what the profile measured,
makes the plan with the strategy's own solver (`planner.strategies.gradients`, `mixed`, `auto`, `kfac`, `abs`),
adds its intervals (the auto strategy weighed its candidates already; a what-if cluster has no samples to draw
from), and predicts DDP's rows for the verdict. It prints nothing: `notes` says what the command should tell.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from planner.contracts.plan import Plan
from planner.contracts.profile import Profile
from planner.contracts.trials import Trials
from planner.strategies.abs_plan import make_abs_plan
from planner.strategies.auto import AutoChoice, ddp_predictions, solve_auto
from planner.strategies.budget import BY_DEFAULT, BudgetSpec
from planner.strategies.cluster import parse_cluster, profile_for_cluster
from planner.strategies.gradients import make_plan
from planner.strategies.intervals import nominal_ddp, with_intervals, with_kfac_intervals
from planner.strategies.kfac_plan import DEFAULT_FACTOR_UPDATE_STEPS, DEFAULT_INV_UPDATE_STEPS, make_kfac_plan
from planner.strategies.mixed_plan import (
    PRESETS,
    make_mixed_plan,
    measured_compressors,
    parse_compressors,
    preset_compressors,
)
from planner.types import Compressor, InverseMethod, PlannerError, Strategy

__all__ = ["GRADIENT_KINDS", "SolveRequest", "Solved", "solve"]

#: The strategies `SolveRequest.strategy` names besides `Strategy`'s gradient ones.
GRADIENT_KINDS = ("auto", "kfac", "abs")


@dataclass(frozen=True, kw_only=True)
class SolveRequest:
    """What to solve, as checked by the command (see `planner solve --help` for each).

    Attributes:
        strategy: a `Strategy` value (dense, topk, mixed), or auto, kfac or abs.
        density: top-k's density (--strategy topk).
        compressors: what a group may be sent as (mixed and auto), and `preset` the preset's name when they came
            from one (its compressors are then narrowed to those the profile measured).
        error_budget: mixed and auto's budget (auto's default: `planner.strategies.budget.BY_DEFAULT`).
        trials: auto's trials.
        selector: the top-k selector, None to let the solver choose.
        route: how groups cross hosts (dense, topk, mixed).
        time_limit_s: the solve's time limit, None for each strategy's default.
        cluster: a what-if cluster's spec.
        method, factor_update_steps, inv_update_steps, placement_solver: K-FAC's.
        global_batch, trigger: ABS-SGD's.
    """

    strategy: str
    density: float | None = None
    compressors: tuple[Compressor, ...] | None = None
    preset: str = ""
    error_budget: BudgetSpec | str | None = None
    trials: Trials | None = None
    selector: str | None = None
    route: str = "best"
    time_limit_s: float | None = None
    cluster: str | None = None
    method: InverseMethod = InverseMethod.EIGEN
    factor_update_steps: int | None = None
    inv_update_steps: int | None = None
    placement_solver: str = "cp-sat"
    global_batch: int | None = None
    trigger: str | None = None

    @classmethod
    def auto(cls) -> SolveRequest:
        """`planner solve --strategy auto` with its defaults: the light compressors and the default error budget's
        own compressor, within that budget."""
        compressors = parse_compressors("light")
        if isinstance(BY_DEFAULT, Compressor):
            compressors = tuple(dict.fromkeys((*compressors, BY_DEFAULT)))
        return cls(strategy="auto", compressors=compressors, preset="light", error_budget=BY_DEFAULT)


@dataclass(frozen=True)
class Solved:
    """A solve's plan, with what the command prints beside it.

    Attributes:
        plan: the plan (its intervals and verdict included).
        profile: the profile it was solved from (a what-if cluster's, when asked).
        ddp: DDP's predicted rows for the table, or None where the plan's own rows hold them.
        auto: the auto strategy's choice (its candidates and rule), None for the others.
        notes: lines to say before the plan (a what-if cluster, compressors a preset left out).
    """

    plan: Plan
    profile: Profile
    ddp: Any = None
    auto: AutoChoice | None = None
    notes: tuple[str, ...] = field(default=())


def solve(profile: Profile, request: SolveRequest, *, source: str) -> Solved:
    """The plan `request` asks for on `profile` (`source`: the profile's path, recorded in the plan)."""
    notes: list[str] = []
    if request.cluster is not None:
        spec = parse_cluster(request.cluster)
        profile = profile_for_cluster(profile, spec)
        notes.append(f"what-if cluster {spec.describe()}")
    compressors = request.compressors
    if compressors is not None and request.preset in PRESETS:  # a preset: what this profile measured of it
        named = preset_compressors(request.preset, profile)
        compressors, left_out = measured_compressors(profile, named)
        if not compressors:
            raise PlannerError(f"this profile measured none of --compressors {request.preset} "
                               f"({', '.join(map(str, named))}): profile again, or name compressors it measured")
        if left_out:
            notes.append(f"--compressors {request.preset}: left out {', '.join(map(str, left_out))}, which this "
                         "profile did not measure")
    choice = None
    match request.strategy:
        case "kfac":
            plan = make_kfac_plan(profile, method=request.method,
                                  factor_update_steps=request.factor_update_steps or DEFAULT_FACTOR_UPDATE_STEPS,
                                  inv_update_steps=request.inv_update_steps or DEFAULT_INV_UPDATE_STEPS,
                                  placement_solver=request.placement_solver, time_limit_s=request.time_limit_s or 2.0,
                                  source=source)
        case "abs":
            assert request.global_batch is not None
            plan = make_abs_plan(profile, request.global_batch, trigger=request.trigger or "batch", source=source)
        case "auto":
            assert compressors is not None
            choice = solve_auto(profile, compressors, source=source, selector=request.selector,
                                time_limit_s=request.time_limit_s or 1.0, weigh_noise=request.cluster is None,
                                error_budget=request.error_budget, trials=request.trials)
            plan = choice.plan
        case Strategy.MIXED.value:
            assert compressors is not None and not isinstance(request.error_budget, str)
            plan = make_mixed_plan(profile, compressors, source=source, selector=request.selector,
                                   time_limit_s=request.time_limit_s or 1.0, route=request.route,
                                   error_budget=request.error_budget)
        case Strategy.DENSE.value | Strategy.TOPK.value:
            strategy = Strategy(request.strategy)
            plan = make_plan(profile, strategy, request.density if strategy is Strategy.TOPK else None,
                             source=source, selector=request.selector, route=request.route,
                             time_limit_s=request.time_limit_s)
        case other:
            raise PlannerError(f"no strategy is named {other!r}; name one of dense, topk, mixed, auto, kfac, abs")
    if request.strategy not in ("abs", "auto") and request.cluster is None:  # auto weighed its candidates already
        plan = (with_kfac_intervals(plan, profile) if request.strategy == "kfac"
                else with_intervals(plan, profile, time_limit_s=request.time_limit_s or 1.0))
    ddp = None
    if choice is not None:
        ddp = ddp_predictions(choice.candidates, choice.beyond_budget)
    elif plan.intervals is None and plan.kfac is None and plan.abs is None:
        ddp = nominal_ddp(plan, profile)  # the verdict as predicted: the profile's noise is not known
    return Solved(plan=plan, profile=profile, ddp=ddp, auto=choice, notes=tuple(notes))
