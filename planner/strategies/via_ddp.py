"""A gradient plan run inside DDP (`planner.runtime.PlanHook`), and which way to run it.

PlanHook makes the plan's groups DDP's buckets and sends each as its group says, so the plan run inside DDP is the
plan's own grouping and compressors at DDP's costs: the cost model's `runtime="planhook"` (DDP's bucket copies at
the profile's `InSitu.ddp_pack` calibration, flat collectives, the project's compressors at their own calibrations:
PlanHook runs the project's PowerSGD kernels, not PyTorch's hook). Its prediction is the plan's row
`VIA_DDP_ROW`; a plan with groups sent hierarchically across hosts runs inside DDP too, but has no such row (the cost
model of DDP sends every group flat).

Which way to run a plan (`choose_way`): inside DDP, the simpler and more standard way, unless GradientExchange is
faster beyond the noise (a verdict within the noise keeps the simpler choice), or the plan needs GradientExchange
(what PlanHook does not run: K-FAC, ABS-SGD), or its way inside DDP is not predicted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from planner.contracts.layers import plan_grouping
from planner.contracts.plan import VIA_DDP_ROW, Plan, Prediction
from planner.contracts.profile import Profile
from planner.costmodel.from_profile import gradient_problem, mixed_problem
from planner.costmodel.mixed_simulator import MixedProblem, simulate_mixed
from planner.costmodel.problem import GradientProblem
from planner.costmodel.simulator import simulate
from planner.spread import PairedGain
from planner.types import Strategy

__all__ = ["DDP_WAY", "EXCHANGE_WAY", "Way", "choose_way", "unpredicted", "via_ddp_prediction", "via_ddp_refusal",
           "with_via_ddp"]

#: The two ways of running a gradient plan.
DDP_WAY = "ddp"
EXCHANGE_WAY = "exchange"


class Problems(Protocol):
    """Where the cost model's instances come from: `planner.strategies.intervals.Problems` (a profile's, cached, or
    a resampled profile's), which is not imported here (it imports this module)."""

    def gradient(self, strategy: Strategy, density: float | None = None, *, selector: str = "exact",
                 runtime: str = "planner", route: str = "best") -> GradientProblem: ...

    def mixed(self, compressors: Any, *, selector: str = "exact", runtime: str = "planner") -> MixedProblem: ...


class _Direct:
    """`Problems` made straight from one profile, uncached."""

    def __init__(self, profile: Profile) -> None:
        self.gradient = functools.partial(gradient_problem, profile)
        self.mixed = functools.partial(mixed_problem, profile)


def via_ddp_refusal(plan: Plan) -> str | None:
    """Why the plan does not run inside DDP (None: it does), in one clause: PlanHook refuses K-FAC and ABS-SGD plans
    (`planner.runtime.ddp_plan`)."""
    if plan.kfac is not None:
        return "a K-FAC plan runs in GradientExchange (with KFACPreconditioner), not inside DDP"
    if plan.abs is not None:
        return "an ABS-SGD plan runs in its own exchange (ABSSGD), not inside DDP"
    return None


def unpredicted(plan: Plan) -> str | None:
    """Why a plan that runs inside DDP has no prediction there (None: it has one): the cost model of DDP sends every
    group flat, and the plan sends some hierarchically across hosts."""
    hierarchical = [i for i, g in enumerate(plan.groups) if g.hierarchical]
    if not hierarchical:
        return None
    shown = ", ".join(map(str, hierarchical[:3])) + (" ..." if len(hierarchical) > 3 else "")
    return (f"the plan sends group(s) {shown} hierarchically across hosts, which the cost model of DDP (flat "
            "collectives) does not predict")


def via_ddp_prediction(plan: Plan, profile: Profile, problems: Problems | None = None) -> Prediction | None:
    """The plan's grouping and compressors predicted at DDP's costs (`runtime="planhook"`) on `problems` (default the
    profile's own); None where the plan does not run inside DDP (`via_ddp_refusal`) or is not predicted there
    (`unpredicted`).

    Raises:
        PlanMismatchError: the plan's layers are not the profile's.
    """
    if via_ddp_refusal(plan) is not None or unpredicted(plan) is not None:
        return None
    if problems is None:
        problems = _Direct(profile)
    grouping = plan_grouping(plan, profile)
    selector = plan.selector or "exact"
    if plan.strategy is Strategy.MIXED:
        allowed = plan.compressors or tuple(dict.fromkeys(plan.compressor_of(g) for g in plan.groups))
        problem = problems.mixed(allowed, selector=selector, runtime="planhook")
        return simulate_mixed(problem, grouping, [problem.index_of(plan.compressor_of(g)) for g in plan.groups])
    return simulate(problems.gradient(plan.strategy, plan.density, selector=selector, runtime="planhook"), grouping)


def via_ddp_step(plan: Plan, profile: Profile) -> Callable[[Problems], float] | None:
    """`via_ddp_prediction`'s step as a row of `planner.strategies.intervals` (None: the plan has no such row)."""
    if via_ddp_refusal(plan) is not None or unpredicted(plan) is not None:
        return None

    def step(problems: Problems) -> float:
        found = via_ddp_prediction(plan, profile, problems)
        assert found is not None
        return found.iteration_s
    return step


def with_via_ddp(plan: Plan, profile: Profile) -> Plan:
    """`plan` with its row `VIA_DDP_ROW` (unchanged where it does not run inside DDP)."""
    found = via_ddp_prediction(plan, profile)
    if found is None:
        return plan
    return replace(plan, baselines={**plan.baselines, VIA_DDP_ROW: found})


@dataclass(frozen=True)
class Way:
    """Which way to run a plan: `DDP_WAY` (inside DDP, PlanHook) or `EXCHANGE_WAY` (GradientExchange), and the one
    line that says why."""

    way: str
    line: str


def choose_way(plan: Plan, draws: dict[str, np.ndarray] | None = None) -> Way:
    """Which way to run `plan`: inside DDP unless GradientExchange is faster beyond the noise (by `draws`: the
    paired draws of the rows "plan" and `VIA_DDP_ROW`, where the noise was weighed; else as predicted, DDP on a
    tie), or the plan does not run inside DDP, or is not predicted there (then GradientExchange, which it was
    predicted for)."""
    refusal = via_ddp_refusal(plan)
    via = plan.baselines.get(VIA_DDP_ROW)
    if refusal is not None or via is None:
        why = refusal or unpredicted(plan) or "a plan made before its way inside DDP was predicted (solve again)"
        return Way(EXCHANGE_WAY, f"run it in GradientExchange: {why}")
    rows = plan.intervals.rows if plan.intervals is not None else {}
    ddp_text = _with_interval(via.iteration_s, rows.get(VIA_DDP_ROW))
    exchange_text = _with_interval(plan.predicted.iteration_s, rows.get("plan"))
    if draws is not None and "plan" in draws and VIA_DDP_ROW in draws:
        gain = PairedGain.of(draws["plan"], draws[VIA_DDP_ROW])  # > 0: GradientExchange faster
        if gain.beyond_noise:
            return Way(EXCHANGE_WAY, f"run it in GradientExchange: predicted {exchange_text} vs {ddp_text} via DDP "
                                     f"(PlanHook), {gain.describe()} faster, beyond the noise")
        why = "the simpler way, within the noise" if gain.median >= 0 else "the faster way"
        return Way(DDP_WAY, f"run it via DDP (PlanHook), {why}: predicted {ddp_text} vs {exchange_text} in "
                            "GradientExchange")
    if plan.predicted.iteration_s < via.iteration_s:
        return Way(EXCHANGE_WAY, f"run it in GradientExchange: predicted {exchange_text} vs {ddp_text} via DDP "
                                 "(PlanHook), the noise not weighed")
    return Way(DDP_WAY, f"run it via DDP (PlanHook): predicted {ddp_text} vs {exchange_text} in GradientExchange, "
                        "the noise not weighed")


def _with_interval(seconds: float, pair: tuple[float, float] | None) -> str:
    """"412.10 ms [403.20, 421.00]", or without an interval "412.10 ms"."""
    text = f"{seconds * 1e3:,.2f} ms"
    return text if pair is None else f"{text} [{pair[0] * 1e3:,.2f}, {pair[1] * 1e3:,.2f}]"
