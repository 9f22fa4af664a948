"""Each prediction with its interval, and a verdict that keeps a plan over DDP only when it wins beyond the noise.

A plan's rows (the plan itself and each baseline it prints) are configurations: a grouping, the way each group is
sent, and who moves it (this runtime or DDP). `plan_rows` rebuilds each one as its predicted step on any profile;
`ddp_rows` adds what a user would run instead: plain DDP and DDP with the hook of each compressor the plan may
send by (all predicted; a plan kept within an error budget is weighed against those within it only). Evaluated
under `DRAWS` profiles resampled from the samples the profile kept (`planner.costmodel.resample`), every row gets
an interval, and the plan a gain over each DDP variant, draw by draw, where what they share (the same compute, the
same network) cancels (`PairedGain`).

The verdict (`weigh`): keep the plan when it is faster than every DDP variant in at least 95% of the draws (the
lower end of the 90% interval of its gain above 0); otherwise keep DDP: plain DDP, or the DDP hook that is faster
than plain DDP beyond the noise. A verdict within the noise keeps the simpler choice.

A row is rebuilt only where the rebuilt step on the profile itself equals the step the plan printed (the plans of
older versions, or rows this module does not know, get no interval rather than a wrong one).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from planner.contracts.kfac_section import KFACSection, LayoutVerdict
from planner.contracts.layers import plan_grouping
from planner.contracts.plan import DDP_ROW, VIA_DDP_ROW, Intervals, Plan, Verdict
from planner.contracts.profile import Profile
from planner.costmodel.from_profile import gradient_problem, mixed_problem
from planner.costmodel.mixed_simulator import MixedProblem, simulate_mixed
from planner.costmodel.problem import GradientProblem, Grouping
from planner.costmodel.resample import resampled_many, spread_sources
from planner.costmodel.simulator import simulate
from planner.solvers import BASELINES, DDP_BASELINE, solve_exact
from planner.solvers.compressor_choice import MixedParetoDP
from planner.solvers.fusion import FactorBuffers
from planner.solvers.layout import Layout
from planner.spread import DRAWS, LEVEL, PairedGain, percentile_interval
from planner.strategies.gradients import ALL_FLAT, ALL_HIERARCHICAL, route_ways, sub_solve_seconds
from planner.strategies.kfac_plan import (
    LOCAL_KFAC,
    PLAN_EVERYONE,
    _reference_layouts,
    everyone_preconditions,
    kfac_problem,
    local_kfac_prediction,
    predict_kfac,
    section_layout,
)
from planner.strategies.mixed_plan import ddp_hook_grouping, plan_choice
from planner.strategies.via_ddp import via_ddp_step
from planner.types import DENSE_COMPRESSOR, Compressor, CompressorKind, Strategy

__all__ = ["KFAC_REFERENCES", "Draws", "Problems", "RowStep", "attach", "beyond_budget", "ddp_label", "ddp_rows",
           "evaluate", "evaluate_kfac", "hook_names", "hook_selector", "kfac_configuration", "kfac_problems",
           "nominal_ddp", "plan_route", "plan_row", "plan_rows", "routed_topk", "simplest_unbeaten",
           "topk_hook_selector", "weigh", "with_intervals", "with_kfac_intervals"]

#: Relative difference within which a rebuilt row's step on the profile itself counts as the printed one.
_SAME = 1e-9


class Problems:
    """The solver instances of one profile, each built once: the rows of a plan share them."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self._made: dict[tuple[object, ...], object] = {}

    def gradient(self, strategy: Strategy, density: float | None = None, *, selector: str = "exact",
                 runtime: str = "planner", route: str = "best") -> GradientProblem:
        key = ("gradient", strategy, density, selector, runtime, route)
        if key not in self._made:
            self._made[key] = gradient_problem(self.profile, strategy, density, selector=selector, runtime=runtime,
                                               route=route)
        return self._made[key]  # type: ignore[return-value]

    def mixed(self, compressors: Sequence[Compressor], *, selector: str = "exact",
              runtime: str = "planner") -> MixedProblem:
        key = ("mixed", tuple(compressors), selector, runtime)
        if key not in self._made:
            self._made[key] = mixed_problem(self.profile, compressors, selector=selector, runtime=runtime)
        return self._made[key]  # type: ignore[return-value]


#: A row of a plan's table: its predicted step (seconds) on the problems of a profile.
RowStep = Callable[[Problems], float]
Key = TypeVar("Key", bound=Hashable)


@dataclass(frozen=True)
class Draws:
    """Resampled profiles (`planner.costmodel.resample`) and which measurements they drew from."""

    profiles: tuple[Profile, ...]
    sources: tuple[str, ...]

    @classmethod
    def of(cls, profile: Profile, count: int = DRAWS, seed: int = 0) -> Draws | None:
        """`count` draws of `profile`; None when it kept no samples (a profile made before they were kept)."""
        sources = spread_sources(profile)
        if not sources:
            return None
        return cls(profiles=tuple(resampled_many(profile, count, seed)), sources=sources)


def evaluate(rows: Mapping[Key, RowStep], draws: Draws) -> dict[Key, np.ndarray]:
    """Each row's step under every draw (the same draws, in the same order, for every row)."""
    out: dict[Key, list[float]] = {name: [] for name in rows}
    for profile in draws.profiles:
        problems = Problems(profile)
        for name, step in rows.items():
            out[name].append(step(problems))
    return {name: np.asarray(values) for name, values in out.items()}


def ddp_label(variant: str) -> str:
    """What keeping a DDP variant of the verdict means, in words that name its row: "DDP" (the row "ddp"), "DDP with
    its fp16 hook (ddp+fp16)"."""
    return "DDP" if variant == DDP_ROW else f"DDP with its {variant.removeprefix('ddp+')} hook ({variant})"


def nominal_ddp(plan: Plan, profile: Profile, compressors: Sequence[Compressor] | None = None) -> dict[str, float]:
    """Each DDP variant `ddp_rows` weighs the plan against (not those beyond its error budget), predicted on
    `profile` itself (no draws: what a plan is compared with where the profile kept no samples)."""
    nominal = Problems(profile)
    left_out = hook_names(beyond_budget(plan, profile, compressors))
    return {name: step(nominal) for name, step in ddp_rows(plan, profile, compressors).items()
            if name not in left_out}


def weigh(plan: np.ndarray, ddp: dict[str, np.ndarray], nominal: dict[str, float],
          topk_selector: str | None = None, left_out: Sequence[str] = (),
          samples: Mapping[str, float] | None = None) -> Verdict:
    """The verdict of a plan's draws against each DDP variant's (the same draws; "ddp" among them).

    The plan is kept when its gain over every variant weighed is beyond the noise. Otherwise DDP is: plain DDP,
    unless a hook weighed is faster than plain DDP beyond the noise (then the one with the largest median gain over
    it). `against` is the variant the plan gains least on (at the lower end of the interval), `nominal` the variants'
    predictions, `topk_selector` the selector of the top-k hooks among them (recorded where there are), `left_out`
    the hooks predicted but not weighed, their error being beyond the plan's budget (recorded with them), `samples`
    each side's factor for the samples it needs ("plan" and variants, 1 where missing: the draws are taken times it,
    so that time to a loss is weighed; recorded in the verdict)."""
    factor = dict(samples or {})
    weighed = {name: draws * factor.get(name, 1.0) for name, draws in ddp.items() if name not in left_out}
    plan = plan * factor.get("plan", 1.0)
    gains = {name: PairedGain.of(plan, draws) for name, draws in weighed.items()}
    against = min(gains, key=lambda name: (gains[name].low, name))
    gain = gains[against]
    if gain.beyond_noise:
        keep = "plan"
    else:
        plain = ddp["ddp"] * factor.get("ddp", 1.0)
        better = {name: PairedGain.of(draws, plain) for name, draws in weighed.items() if name != "ddp"}
        beyond = [name for name, g in better.items() if g.beyond_noise]
        keep = max(beyond, key=lambda name: better[name].median) if beyond else "ddp"
    order = ["ddp", *(name for name in ddp if name != "ddp")]
    hooks_topk = any(name.startswith("ddp+topk") for name in ddp)
    return Verdict(keep=keep, against=against, gain=(gain.median, gain.low, gain.high),
                   variants={name: (nominal[name], *percentile_interval(ddp[name])) for name in order},
                   topk_selector=topk_selector if hooks_topk else None,
                   beyond_budget=tuple(name for name in order if name in left_out),
                   samples={name: f for name, f in factor.items() if name == "plan" or name in ddp})


def simplest_unbeaten(order: Sequence[str], draws: Mapping[str, np.ndarray], fallback: str) -> str:
    """The first of `order` (the simplest first) that no other of `draws` is faster than beyond the noise (a verdict
    within the noise keeps the simpler choice); `fallback` where every one is beaten by another."""
    return next((name for name in order
                 if not any(PairedGain.of(draws[other], draws[name]).beyond_noise for other in draws if other != name)),
                fallback)


def with_intervals(plan: Plan, profile: Profile, draws: Draws | None = None, *,
                   time_limit_s: float | None = 1.0) -> Plan:
    """`plan` with each of its rows' intervals and its verdict against DDP, over `draws` of `profile` (made here when
    None). Unchanged (no intervals, no verdict) for a profile that kept no samples, and for K-FAC and ABS-SGD plans,
    whose own predictions this does not cover yet. `time_limit_s`: for rows that are exact plans of their own (the
    best plan with one compressor, the plan all flat), solved again here to know their groupings."""
    if plan.kfac is not None or plan.abs is not None:
        return plan
    draws = draws if draws is not None else Draws.of(profile)
    if draws is None:
        return plan
    own, ddp = plan_rows(plan, profile, time_limit_s=time_limit_s), ddp_rows(plan, profile)
    values = evaluate({**{("own", k): v for k, v in own.items()}, **{("ddp", k): v for k, v in ddp.items()}}, draws)
    nominal = Problems(profile)
    return attach(plan, {k: values["own", k] for k in own}, {k: values["ddp", k] for k in ddp}, draws,
                  {k: step(nominal) for k, step in ddp.items()}, topk_selector=topk_hook_selector(plan, profile),
                  left_out=hook_names(beyond_budget(plan, profile)))


def attach(plan: Plan, own: dict[str, np.ndarray], ddp: dict[str, np.ndarray], draws: Draws,
           ddp_nominal: dict[str, float], *, topk_selector: str | None = None, left_out: Sequence[str] = (),
           samples: Mapping[str, float] | None = None) -> Plan:
    """`plan` with the intervals of its own rows' draws (`own`: "plan" and baselines) and its verdict against the DDP
    variants' draws (`ddp`), whose predictions on the profile itself are `ddp_nominal` (`topk_selector`: of the
    top-k hooks among them; `left_out`: the hooks beyond the plan's error budget, predicted but not weighed;
    `samples`: each side's factor for the samples it needs, `weigh`)."""
    intervals = Intervals(level=LEVEL, draws=len(draws.profiles), sources=draws.sources,
                          rows={name: percentile_interval(v) for name, v in own.items()})
    return replace(plan, intervals=intervals,
                   verdict=weigh(own["plan"], ddp, ddp_nominal, topk_selector, left_out, samples))


def hook_names(compressors: Sequence[Compressor]) -> tuple[str, ...]:
    """The DDP variant that runs each of `compressors` in DDP's hook: "ddp+powersgd:1"."""
    return tuple(f"ddp+{c}" for c in compressors)


def topk_hook_selector(plan: Plan, profile: Profile, compressors: Sequence[Compressor] | None = None) -> str | None:
    """The selector `ddp_rows` gives the top-k hooks of `compressors` (default the plan's), None without one."""
    topk = next((c for c in (compressors if compressors is not None else _allowed(plan))
                 if c.kind is CompressorKind.TOPK), None)
    return None if topk is None else hook_selector(profile, topk, plan.cluster.backend)


def plan_rows(plan: Plan, profile: Profile, *, time_limit_s: float | None = 1.0) -> dict[str, RowStep]:
    """The plan ("plan") and each baseline it prints that can be rebuilt, as steps on any profile: the same
    grouping and way of sending each group throughout (a baseline's grouping is found once, on `profile`); the
    plan run inside DDP (`VIA_DDP_ROW`) among them."""
    found: dict[str, RowStep] = {"plan": plan_row(plan, profile)}
    found.update(_baseline_rows(plan, profile, time_limit_s))
    via_ddp = via_ddp_step(plan, profile)
    if via_ddp is not None:
        found[VIA_DDP_ROW] = via_ddp
    nominal = Problems(profile)
    printed = {"plan": plan.predicted, **plan.baselines}
    return {name: step for name, step in found.items()
            if name in printed and math.isclose(step(nominal), printed[name].iteration_s, rel_tol=_SAME)}


def plan_row(plan: Plan, profile: Profile) -> RowStep:
    """A gradient plan's own step on any profile: its grouping, each group sent the plan's way (a mixed plan, and a
    top-k plan whose groups chose their way across hosts, on the mixed problem of its compressors)."""
    grouping = plan_grouping(plan, profile)
    if plan.strategy is Strategy.MIXED or routed_topk(plan, profile):
        return _mixed_row(_allowed(plan), plan.selector or "exact", grouping, _plan_choice(plan, profile))
    return _grouping_row(plan.strategy, plan.density, plan.selector or "exact", "planner", plan_route(plan), grouping)


def ddp_rows(plan: Plan, profile: Profile, compressors: Sequence[Compressor] | None = None) -> dict[str, RowStep]:
    """What a user would run instead of `plan`, as steps on any profile: plain DDP ("ddp") and DDP with the hook
    of each compressor other than dense that the plan may send by (or of `compressors`) ("ddp+C"), on DDP's buckets
    at DDP's own packing cost (one bucket for PowerSGD on gloo, `ddp_hook_grouping`). The hooks whose error is
    beyond the budget the plan was kept within are among them (`beyond_budget`): predicted, but not weighed."""
    selector = plan.selector or "exact"
    backend = plan.cluster.backend
    out: dict[str, RowStep] = {}
    if plan.strategy is Strategy.MIXED:  # predicted as the mixed plan's own "ddp" row
        out["ddp"] = _hook_row(DENSE_COMPRESSOR, selector, backend)
    else:
        ddp = next(b for b in BASELINES[Strategy.DENSE] if b.name == DDP_BASELINE)
        buckets = ddp.solve(gradient_problem(profile, Strategy.DENSE, runtime="ddp"))
        out["ddp"] = _grouping_row(Strategy.DENSE, None, "exact", "ddp", "flat", buckets)
    for c in compressors if compressors is not None else _allowed(plan):
        if c.kind is CompressorKind.TOPK:
            out[f"ddp+{c}"] = _hook_row(c, hook_selector(profile, c, backend), backend)
        elif c.kind is not CompressorKind.DENSE:
            out[f"ddp+{c}"] = _hook_row(c, selector, backend)
    return out


def beyond_budget(plan: Plan, profile: Profile, compressors: Sequence[Compressor] | None = None
                  ) -> tuple[Compressor, ...]:
    """The compressors of `compressors` (default the plan's) whose error on every layer, as the profile measured it,
    is beyond the error budget the plan was kept within: the hooks the verdict does not weigh (a user who holds to the
    budget would not run them). None for a plan solved without a budget; a compressor whose error the profile did
    not measure is not counted beyond it (its hook is weighed)."""
    budget = None if plan.error is None else plan.error.budget
    if budget is None or profile.errors is None:
        return ()
    errors = profile.errors
    return tuple(c for c in (compressors if compressors is not None else _allowed(plan))
                 if c.kind is not CompressorKind.DENSE and errors.has(c) and errors.uniform(c) > budget * (1 + _SAME))


def hook_selector(profile: Profile, compressor: Compressor, backend: str) -> str:
    """The top-k selector the profile predicts faster for the project's top-k hook on DDP, as a user would pick it
    ("exact" where the profile measured no other)."""
    nominal = Problems(profile)
    measured = profile.topk.selectors() if profile.topk is not None else []
    return min(measured or ["exact"], key=lambda s: _hook_row(compressor, s, backend)(nominal))


def _allowed(plan: Plan) -> tuple[Compressor, ...]:
    """The compressors the plan could choose from (those it uses, where it did not record them)."""
    if plan.strategy is Strategy.MIXED:
        return plan.compressors or tuple(dict.fromkeys(plan.compressor_of(g) for g in plan.groups))
    return (plan.compressor_of(plan.groups[0]),)


def routed_topk(plan: Plan, profile: Profile) -> bool:
    """A top-k plan solved with the way across hosts per group (the profile measured hierarchical top-k at its
    density): it is predicted on the mixed problem of its compressor's two ways."""
    return (plan.strategy is Strategy.TOPK and profile.hosts is not None and plan.density is not None
            and profile.hosts.topk_at(plan.density) is not None)


def plan_route(plan: Plan) -> str:
    """How a dense plan's groups were chosen to cross hosts: "best" per group (some of each, or one host)."""
    if plan.cluster.host_count < 2:
        return "best"
    routed = sum(g.hierarchical for g in plan.groups)
    return "hierarchical" if routed == len(plan.groups) else "best"


def _plan_choice(plan: Plan, profile: Profile) -> tuple[int, ...]:
    return tuple(plan_choice(plan, profile)[1])


def _grouping_row(strategy: Strategy, density: float | None, selector: str, runtime: str, route: str,
                  grouping: Grouping) -> RowStep:
    def step(problems: Problems) -> float:
        problem = problems.gradient(strategy, density, selector=selector, runtime=runtime, route=route)
        return simulate(problem, grouping).iteration_s
    return step


def _mixed_row(compressors: Sequence[Compressor], selector: str, grouping: Grouping, choice: Sequence[int],
               runtime: str = "planner") -> RowStep:
    picks = tuple(choice)

    def step(problems: Problems) -> float:
        return simulate_mixed(problems.mixed(compressors, selector=selector, runtime=runtime), grouping,
                              picks).iteration_s
    return step


def _hook_row(compressor: Compressor, selector: str, backend: str) -> RowStep:
    """DDP with `compressor`'s hook (plain DDP for dense) on the buckets DDP runs it with."""
    def step(problems: Problems) -> float:
        problem = problems.mixed((compressor,), selector=selector, runtime="ddp")
        grouping = ddp_hook_grouping(problem, compressor, backend)
        return simulate_mixed(problem, grouping, (0,) * len(grouping)).iteration_s
    return step


def _baseline_rows(plan: Plan, profile: Profile, time_limit_s: float | None) -> dict[str, RowStep]:
    """The baselines `plan` prints, rebuilt as the strategy that made it computed them."""
    names = set(plan.baselines)
    selector = plan.selector or "exact"
    out: dict[str, RowStep] = {}
    if plan.strategy in (Strategy.DENSE, Strategy.TOPK):
        flat = gradient_problem(profile, plan.strategy, plan.density, selector=selector, route="flat")
        for b in BASELINES[plan.strategy]:
            row = plan.ddp_row if b.name == DDP_BASELINE else b.name
            if row in names:
                runtime = "ddp" if b.name == DDP_BASELINE else "planner"
                out[row] = _grouping_row(plan.strategy, plan.density, selector, runtime,
                                            "best" if runtime == "ddp" else "flat", b.solve(flat))
        if plan.strategy is Strategy.DENSE and profile.hosts is not None:
            for name, route in ((ALL_FLAT, "flat"), (ALL_HIERARCHICAL, "hierarchical")):
                if name in names:
                    problem = gradient_problem(profile, Strategy.DENSE, route=route)
                    out[name] = _grouping_row(Strategy.DENSE, None, "exact", "planner", route, solve_exact(problem))
    allowed = _allowed(plan)
    mixed_plan = plan.strategy is Strategy.MIXED or routed_topk(plan, profile)
    if not mixed_plan:
        return out
    mixed = mixed_problem(profile, allowed, selector=selector)
    hosts = any(c.hierarchical for c in mixed.compressors)
    # Each of these rows solved again as the plan's solve did: within its share of the plan's limit.
    share = sub_solve_seconds(time_limit_s, (len(allowed) if plan.strategy is Strategy.MIXED else 0) + 2 * hosts)
    if plan.strategy is Strategy.MIXED:
        for c in dict.fromkeys((DENSE_COMPRESSOR, *allowed)):
            name = DDP_ROW if c.kind is CompressorKind.DENSE else f"ddp+{c}"
            if name in names:  # a top-k hook with the selector the profile predicts faster, as the plan's solve
                hook = hook_selector(profile, c, plan.cluster.backend) if c.kind is CompressorKind.TOPK else selector
                out[name] = _hook_row(c, hook, plan.cluster.backend)
        for c in allowed:
            if f"only:{c}" in names:
                only = MixedParetoDP(allowed=mixed.indices_of(c), time_limit_s=share).solve(mixed)
                out[f"only:{c}"] = _mixed_row(allowed, selector, only.grouping, only.choice)
    if hosts:
        ways = route_ways(mixed)
        for name, kept in ((ALL_FLAT, ways["flat"]), (ALL_HIERARCHICAL, ways["hierarchical"])):
            if name in names:
                best = MixedParetoDP(allowed=kept, time_limit_s=share).solve(mixed)
                out[name] = _mixed_row(allowed, selector, best.grouping, best.choice)
    return out


#: The reference K-FAC layouts a plan is weighed against, the simplest first (every factor inverted and every
#: layer preconditioned everywhere; kfac-pytorch's default; KAISA's memory-optimal one): `planner.strategies.kfac_plan`.
KFAC_REFERENCES = ("everywhere", "kfac-pytorch", "kaisa-mem-opt")


def with_kfac_intervals(plan: Plan, profile: Profile, draws: Draws | None = None) -> Plan:
    """A K-FAC plan with the intervals of its average step and of each baseline that can be rebuilt (the reference
    layouts, the plan with everyone preconditioning, plain SGD, one worker alone), over `draws` of `profile`, and
    its verdict against the reference layouts: kept where it is faster than each beyond the noise, else the
    simplest reference no other beats beyond it. Unchanged without samples or without a K-FAC section."""
    section = plan.kfac
    if section is None or section.predicted is None:
        return plan
    draws = draws if draws is not None else Draws.of(profile)
    if draws is None:
        return plan
    rows, problem = _kfac_rows(section, profile, plan_grouping(plan, profile))
    values = {name: np.asarray(v) for name, v in evaluate_kfac(rows, problem, draws.profiles).items()}
    intervals = {name: percentile_interval(v) for name, v in values.items()}
    references = [name for name in KFAC_REFERENCES if name in values]
    verdict = None
    if references:
        gains = {name: PairedGain.of(values["plan"], values[name]) for name in references}
        against = min(gains, key=lambda name: (gains[name].low, name))
        gain = gains[against]
        keep = "plan" if gain.beyond_noise else simplest_unbeaten(
            references, {name: values[name] for name in references}, references[0])
        verdict = LayoutVerdict(keep=keep, against=against, gain=(gain.median, gain.low, gain.high))
    return replace(plan, kfac=replace(section, intervals=intervals, verdict=verdict))


#: A K-FAC row: its average step given the K-FAC problems of one profile, by format ("plan": the section's own
#: formats, "triangles", "whole"), each built once per profile.
KFACRow = Callable[[Callable[[str], Any]], float]
#: The K-FAC problem of a profile in one of those formats.
KFACProblems = Callable[[Profile, str], Any]


def evaluate_kfac(rows: dict[str, KFACRow], problem: KFACProblems, profiles: Sequence[Profile]
                  ) -> dict[str, list[float]]:
    """Each K-FAC row on every profile (a profile's problems built once, shared by its rows)."""
    out: dict[str, list[float]] = {name: [] for name in rows}
    for profile in profiles:
        made: dict[str, Any] = {}

        def get(key: str, profile: Profile = profile, made: dict[str, Any] = made) -> Any:
            if key not in made:
                made[key] = problem(profile, key)
            return made[key]

        for name, row in rows.items():
            out[name].append(row(get))
    return out


def _kfac_rows(section: KFACSection, profile: Profile, grouping: Grouping) -> tuple[dict[str, KFACRow], KFACProblems]:
    """The K-FAC rows rebuilt as average steps (`KFACRow`) and the problems they read: the section's own buffers
    and layout, the reference layouts (which depend on sizes alone), the plan's owners with everyone
    preconditioning, plain SGD and one worker alone; each on the plan's gradient `grouping`, and kept where it gives
    back the section's own prediction on `profile`."""
    steps = {"factor_update_steps": section.factor_update_steps, "inv_update_steps": section.inv_update_steps}
    buffers, layout = kfac_configuration(section)
    problem = kfac_problems(section, grouping)
    rows: dict[str, KFACRow] = {
        "plan": lambda get: predict_kfac(get("plan"), buffers, layout, **steps).step_s,
        PLAN_EVERYONE: lambda get: predict_kfac(get("plan"), buffers, everyone_preconditions(get("plan"),
                                                                                            layout.owners),
                                                **steps).step_s,
        "sgd": lambda get: get("triangles").sgd_step_s,
        LOCAL_KFAC: lambda get: local_kfac_prediction(get("triangles"), **steps).step_s,
    }
    for name, (bufs, ref_layout, whole) in _reference_layouts(problem(profile, "triangles"),
                                                              problem(profile, "whole")).items():
        rows[name] = functools.partial(_reference_step, "whole" if whole else "triangles", bufs, ref_layout, steps)
    printed = {"plan": section.predicted, **(section.baselines or {})}
    nominal = evaluate_kfac(rows, problem, [profile])
    kept = {name: row for name, row in rows.items() if name in printed and printed[name] is not None
            and math.isclose(nominal[name][0], printed[name].step_s, rel_tol=_SAME)}  # type: ignore[union-attr]
    return kept, problem


def kfac_configuration(section: KFACSection) -> tuple[FactorBuffers, Layout]:
    """A K-FAC section's factor buffers (exclusive ends, A then G) and its layout of owners and preconditioners."""
    buffers = (tuple(itertools.accumulate(len(b) for b in section.a_buffers)),
               tuple(itertools.accumulate(len(b) for b in section.g_buffers)))
    return buffers, section_layout(section)


def kfac_problems(section: KFACSection, grouping: Grouping) -> KFACProblems:
    """The K-FAC problem of a profile in each format a row reads: "plan" (the section's own formats, per factor
    where it mixes them), "triangles", "whole"; each on the plan's gradient `grouping`."""
    formats: bool | dict[str, bool] = (section.whole_factors if section.mixed_whole is None
                                       else {f: f in section.mixed_whole for f in section.factor_names()})
    whole_of = {"plan": formats, "triangles": False, "whole": True}

    def problem(p: Profile, key: str) -> Any:
        return kfac_problem(p, section.method, whole_factors=whole_of[key], inv_update_steps=section.inv_update_steps,
                            grouping=grouping)
    return problem


def _reference_step(key: str, buffers: Any, layout: Any, steps: dict[str, int], get: Callable[[str], Any]) -> float:
    return predict_kfac(get(key), buffers, layout, **steps).step_s
