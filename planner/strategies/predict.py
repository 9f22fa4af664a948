"""One function prices any plan: `predict(plan, profile)`, the step a plan of each kind is predicted to take on a
profile, with its interval where the planner computes one, by the same evaluator `planner solve` used to make it.

It sits in the strategies layer, not in the cost model: pricing a plan reads the plan contract and the profile
(`planner.costmodel.from_profile`), and calls evaluators the cost model may not import: the K-FAC step of
`planner.strategies.kfac_plan` (on the solvers' fusion, layout and placement timelines), ABS-SGD's rounds of
`planner.strategies.abs_plan`, and the intervals of `planner.strategies.intervals` (tests/test_layout.py: strategies
stand on the contracts, the cost model and the solvers; the cost model on the contracts alone).

Each kind and its evaluator:

- dense and top-k: `planner.costmodel.simulator` (`timeline`, `simulate`) on the plan's gradient problem;
- mixed, and top-k whose groups chose their way across hosts: `planner.costmodel.mixed_simulator` (`timeline_mixed`,
  `simulate_mixed`) on the mixed problem of its compressors;
- K-FAC: `planner.strategies.kfac_plan.predict_kfac` (factor buffers by `simulate_fusion`, owners and preconditioners
  by `layout_timelines`), beside its dense gradient groups' iteration;
- ABS-SGD: `planner.strategies.abs_plan.predict_abs` (`simulate_abs` under the section's micro-batch and trigger),
  beside its dense gradient groups' iteration;
- crossover (a pairing plan, `planner.contracts.pairing`): `planner.costmodel.crossover.simulate_pair` of each pair
  crossed over, from the jobs' phases the pairing holds (no profile needed).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from planner.contracts.abs_section import ABSSection, VariantPrediction
from planner.contracts.kfac_section import KFACPrediction, KFACSection
from planner.contracts.layers import plan_grouping
from planner.contracts.pairing import PairingPlan
from planner.contracts.plan import Plan, Prediction
from planner.contracts.profile import Profile
from planner.costmodel.crossover import DEFAULT_ITERATIONS, simulate_pair
from planner.costmodel.from_profile import gradient_problem
from planner.costmodel.mixed_simulator import MixedEvent, simulate_mixed, timeline_mixed
from planner.costmodel.simulator import GroupEvent, simulate, timeline
from planner.spread import percentile_interval
from planner.strategies.abs_plan import predict_abs
from planner.strategies.intervals import (
    Draws,
    evaluate,
    evaluate_kfac,
    kfac_configuration,
    kfac_problems,
    plan_route,
    plan_row,
    routed_topk,
)
from planner.strategies.kfac_plan import predict_kfac
from planner.strategies.mixed_plan import plan_choice
from planner.types import SchemaError, Strategy

__all__ = ["PlanKind", "PlanPrediction", "plan_kind", "predict"]


class PlanKind(enum.Enum):
    """The kinds of plan `predict` prices."""

    DENSE = "dense"
    TOPK = "topk"
    MIXED = "mixed"
    KFAC = "kfac"
    ABS = "abs"
    CROSSOVER = "crossover"


@dataclass(frozen=True, kw_only=True)
class PlanPrediction:
    """What a plan is predicted to take on a profile (named apart from `planner.costmodel.problem.Prediction`, the
    gradient exchange's breakdown it holds as `gradient`).

    Attributes:
        kind: the plan's kind.
        step_s: seconds of the step the plan's kind is solved for: the iteration (dense, top-k, mixed), K-FAC's
            average step (`KFACPrediction.step_s`), ABS-SGD's round, or a crossover pairing's round of its groups
            (every job one iteration, `PairingPlan.round_s("crossover")`).
        interval: `step_s`'s central interval over the profile's resampled draws, as `planner solve` records it
            (`planner.strategies.intervals`): for dense, top-k, mixed and K-FAC plans on a profile that kept
            samples. None where the planner computes none: ABS-SGD and crossover plans, a profile without samples,
            or when not asked for.
        gradient: the iteration of the plan's gradient groups and where it goes (what `plan.predicted` holds; for
            K-FAC and ABS-SGD plans their dense groups as plain data-parallel SGD); None for a pairing.
        events: the gradient groups' timeline, in ready order (`GroupEvent` from the simulator, `MixedEvent` for a
            mixed plan or a top-k plan routed per group); () for a pairing.
        kfac: K-FAC's prediction (K-FAC plans only).
        abs: ABS-SGD's round (ABS-SGD plans only).
        crossover: each job's seconds per iteration crossed over with its partner, alone where it has none
            (pairings only).
    """

    kind: PlanKind
    step_s: float
    interval: tuple[float, float] | None = None
    gradient: Prediction | None = None
    events: tuple[GroupEvent, ...] | tuple[MixedEvent, ...] = ()
    kfac: KFACPrediction | None = None
    abs: VariantPrediction | None = None
    crossover: tuple[float, ...] = ()


def plan_kind(plan: Plan | PairingPlan) -> PlanKind:
    """The kind of `plan`.

    Raises:
        SchemaError: `plan` is neither a plan nor a pairing plan.
    """
    match plan:
        case PairingPlan():
            return PlanKind.CROSSOVER
        case Plan(kfac=KFACSection()):
            return PlanKind.KFAC
        case Plan(abs=ABSSection()):
            return PlanKind.ABS
        case Plan(strategy=Strategy.DENSE):
            return PlanKind.DENSE
        case Plan(strategy=Strategy.TOPK):
            return PlanKind.TOPK
        case Plan(strategy=Strategy.MIXED):
            return PlanKind.MIXED
        case _:
            raise SchemaError(f"only a plan or a pairing plan can be priced, but got {type(plan).__name__}")


def predict(plan: Plan | PairingPlan, profile: Profile | None = None, *, interval: bool = True,
            draws: Draws | None = None) -> PlanPrediction:
    """`plan`'s predicted step on `profile` (a pairing plan needs none), by the evaluator that made its prediction.

    Args:
        interval: compute the step's interval where the planner computes one (over `draws`, made from the profile's
            samples when None; `DRAWS` evaluations of the step); False: the step alone.

    Raises:
        SchemaError: a plan of a kind this cannot price, or a plan without a profile.
        PlanMismatchError: the plan's layers are not the profile's.
        InvalidProfileError: the profile lacks what the plan's kind needs (top-k, K-FAC or throughput measurements).
    """
    kind = plan_kind(plan)
    if isinstance(plan, PairingPlan):
        return _crossover(plan)
    if profile is None:
        raise SchemaError(f"pricing a {kind.value} plan needs the profile it is priced on")
    match kind:
        case PlanKind.DENSE | PlanKind.TOPK | PlanKind.MIXED:
            gradient, events = _gradient(plan, profile)
            return PlanPrediction(kind=kind, step_s=gradient.iteration_s, gradient=gradient, events=events,
                                  interval=_gradient_interval(plan, profile, draws) if interval else None)
        case PlanKind.KFAC:
            assert plan.kfac is not None
            gradient, events = _gradient(plan, profile)
            grouping = plan_grouping(plan, profile)
            problems = kfac_problems(plan.kfac, grouping)
            buffers, layout = kfac_configuration(plan.kfac)
            steps = {"factor_update_steps": plan.kfac.factor_update_steps,
                     "inv_update_steps": plan.kfac.inv_update_steps}
            kfac = predict_kfac(problems(profile, "plan"), buffers, layout, **steps)
            found = None
            made = draws if draws is not None or not interval else Draws.of(profile)
            if interval and made is not None:
                row = {"plan": lambda get: predict_kfac(get("plan"), buffers, layout, **steps).step_s}
                found = percentile_interval(evaluate_kfac(row, problems, made.profiles)["plan"])
            return PlanPrediction(kind=kind, step_s=kfac.step_s, interval=found, gradient=gradient, events=events,
                                  kfac=kfac)
        case PlanKind.ABS:
            assert plan.abs is not None
            gradient, events = _gradient(plan, profile)
            rounds = predict_abs(profile, plan.abs, plan_grouping(plan, profile))
            return PlanPrediction(kind=kind, step_s=rounds.round_s, gradient=gradient, events=events, abs=rounds)
        case _:
            raise SchemaError(f"cannot price a {kind.value} plan: no evaluator for it")


def _gradient(plan: Plan, profile: Profile) -> tuple[Prediction, tuple[GroupEvent, ...] | tuple[MixedEvent, ...]]:
    """The iteration of the plan's gradient groups, sent the plan's way, and their timeline."""
    grouping = plan_grouping(plan, profile)
    if plan.strategy is Strategy.MIXED or routed_topk(plan, profile):
        mixed, choice = plan_choice(plan, profile)
        return simulate_mixed(mixed, grouping, choice), tuple(timeline_mixed(mixed, grouping, choice))
    problem = gradient_problem(profile, plan.strategy, plan.density, selector=plan.selector or "exact",
                               route=plan_route(plan))
    return simulate(problem, grouping), tuple(timeline(problem, grouping))


def _gradient_interval(plan: Plan, profile: Profile, draws: Draws | None) -> tuple[float, float] | None:
    """The interval `planner.strategies.intervals.with_intervals` gives the plan's own row (None: no samples)."""
    draws = draws if draws is not None else Draws.of(profile)
    if draws is None:
        return None
    return percentile_interval(evaluate({"plan": plan_row(plan, profile)}, draws)["plan"])


def _crossover(pairing: PairingPlan) -> PlanPrediction:
    """A pairing's round of its groups crossed over, each pair simulated as `planner pair` does."""
    periods = [job.alone_s for job in pairing.jobs]
    for i, j in pairing.pairs:
        periods[i], periods[j] = simulate_pair(pairing.jobs[i].phases, pairing.jobs[j].phases, gated=True,
                                               iterations=DEFAULT_ITERATIONS)
    round_s = math.fsum([*(max(periods[i], periods[j]) for i, j in pairing.pairs),
                         *(periods[k] for k in pairing.alone)])
    return PlanPrediction(kind=PlanKind.CROSSOVER, step_s=round_s, crossover=tuple(periods))
