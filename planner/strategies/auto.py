"""`--strategy auto`: every way of sending the allowed compressors permit, solved, and the plan to keep.

The candidates (a dense plan, a top-k plan per allowed density, the mixed plan over all of them) are predicted
under the same profiles resampled from the samples the profile kept (`planner.strategies.intervals`): the plan kept
is the simplest that no other candidate beats beyond the noise, and it is weighed against DDP and DDP with the hook
of every allowed compressor (its `Plan.verdict`). A profile without samples gives predictions without their noise:
the fastest predicted is kept, beside DDP's predictions. Either way the kept plan is told which way to run
(`planner.strategies.via_ddp.choose_way`): inside DDP (PlanHook) unless GradientExchange is faster beyond the noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from planner.contracts.layers import plan_grouping
from planner.contracts.plan import DDP_ROW, Plan, plan_simplicity
from planner.contracts.profile import Profile
from planner.costmodel.from_profile import mixed_problem
from planner.costmodel.problem import Grouping
from planner.solvers.compressor_choice import MixedParetoDP
from planner.solvers.deadline import Deadline
from planner.spread import PairedGain
from planner.strategies.budget import (
    BY_DEFAULT,
    DEFAULT_BUDGETS,
    BudgetSpec,
    default_budget,
    plan_error,
    resolve_budget,
    solver_budget,
    uniform_error,
)
from planner.strategies.gradients import make_plan
from planner.strategies.intervals import (
    Draws,
    Problems,
    attach,
    beyond_budget,
    ddp_rows,
    evaluate,
    hook_names,
    plan_rows,
    simplest_unbeaten,
    topk_hook_selector,
)
from planner.strategies.mixed_plan import make_mixed_plan
from planner.strategies.via_ddp import Way, choose_way
from planner.types import (
    DENSE_COMPRESSOR,
    Compressor,
    CompressorKind,
    PlanMismatchError,
    PlannerError,
    SolverError,
    Strategy,
)

if TYPE_CHECKING:
    from planner.contracts.trials import Trials

__all__ = ["NEXT_GROUPING", "RUNNERS_UP", "AutoChoice", "ddp_predictions", "neighbouring_groupings", "next_grouping",
           "plan_simplicity", "runners_up", "solve_auto", "trial_budget"]


@dataclass(frozen=True)
class AutoChoice:
    """What `--strategy auto` solved and kept: the plan it keeps among the candidates, and why.

    Where the profile kept samples, every candidate carries its intervals and verdict against DDP
    (`planner.strategies.intervals`), the kept plan is the simplest that no other candidate beats beyond the noise,
    and its verdict weighs it against plain DDP and DDP with the hook of every allowed compressor."""

    plan: Plan
    candidates: dict[str, Plan]
    reason: str
    #: Without samples (the noise unknown): the DDP variant predicted faster than every plan, and its predicted
    #: iteration; None when the kept plan is predicted at least as fast as each of them, or the noise was weighed.
    ddp_faster: tuple[str, float] | None = None
    #: Which way to run the kept plan, inside DDP (PlanHook) or in GradientExchange, and why (`choose_way`).
    way: Way | None = None
    #: The rule the plan was kept by, in one line: by predicted step alone, or within an error budget (and the
    #: candidates left out beyond it).
    rule: str = ""
    #: The DDP hooks ("ddp+C") beyond the error budget: predicted, not compared with (`ddp_predictions`).
    beyond_budget: tuple[str, ...] = ()
    #: What the trials measured of the samples the kept plan's lossy compressors need ("" without trial curves).
    samples: str = ""
    #: The samples each needs to reach the loss over DDP's, as the trials measured them (`samples_factors`): "plan"
    #: (the kept plan's) and each DDP variant's ("ddp", "ddp+C"); None without trial curves.
    factors: dict[str, float] | None = None


def ddp_predictions(candidates: dict[str, Plan], left_out: Sequence[str] = ()) -> dict[str, float]:
    """What DDP and its hooks are predicted to take, by the candidates' baselines: "ddp" (plain DDP) and "ddp+C"
    (a top-k plan's DDP row is DDP with the top-k hook at its density); not the hooks `left_out` (beyond the error
    budget: `AutoChoice.beyond_budget`)."""
    out: dict[str, float] = {}
    for plan in candidates.values():
        for name, prediction in plan.baselines.items():
            if (name == DDP_ROW or name.startswith("ddp+")) and name not in left_out:
                out.setdefault(name, prediction.iteration_s)
    return out


def solve_auto(profile: Profile, compressors: Sequence[Compressor], *, source: str = "",
               selector: str | None = None, time_limit_s: float | None = 1.0, weigh_noise: bool = True,
               error_budget: BudgetSpec | str | None = BY_DEFAULT, trials: Trials | None = None) -> AutoChoice:
    """Every way of sending that `compressors` allow, each solved exactly: a dense plan (if dense is allowed), a
    top-k plan per allowed density, and the mixed plan over all of them. Each candidate's solve takes at most
    `time_limit_s` (past it, the best found, recorded as not proven optimal).

    Where the profile kept samples, the candidates are predicted under the same resampled profiles: the one kept
    is the simplest (dense, then a plan sending lossless groups only, then the others, each in that order) that no
    other candidate is faster than beyond the noise, and it is weighed against DDP and its hooks (`Plan.verdict`).
    Without samples (or with `weigh_noise` False: a what-if cluster, not measured), the one with the least predicted
    iteration is kept (on a tie the first: dense, then top-k, then mixed) and compared with DDP's predictions alone.

    With `error_budget` (`planner.strategies.budget`) only plans within it are candidates: the top-k plans whose
    error is within it, and the mixed plan solved under it. By default (`BY_DEFAULT`) the budget is the error of
    `DEFAULT_BUDGETS`' first compressor the profile measured, on every layer (fp16, which trained like dense); None:
    no budget (so also where the profile measured no error).

    With `trials` (`planner trial`: which compressors trained like dense on the model's task), the budget and the
    compressors come from them instead (`trial_budget`); where the trials kept curves, each candidate's predicted
    step is taken times the samples its compressors needed to reach DDP's half-way loss (`samples_factors`), so that
    the plan kept is the one predicted to reach a loss first, not the one with the shortest step.

    Raises:
        InvalidProfileError: a compressor the profile did not measure (or, with a budget, whose error it did not).
        PlanMismatchError: trials of another model or world size than the profile's.
        PlannerError: trials together with an error budget given.
    """
    allowed = tuple(compressors)
    trial_rule = None
    if trials is not None:
        if error_budget != BY_DEFAULT:
            raise PlannerError("give trials or an error budget, not both: the trials set the budget")
        allowed, error_budget, trial_rule = trial_budget(profile, allowed, trials)
    by_default = isinstance(error_budget, str)
    if isinstance(error_budget, str):
        if error_budget != BY_DEFAULT:
            raise ValueError(f"error_budget is a number, a Compressor, None or {BY_DEFAULT!r}, got {error_budget!r}")
        error_budget = default_budget(profile)
    budget = None if error_budget is None else resolve_budget(profile, error_budget)
    candidates: dict[str, Plan] = {}
    beyond: dict[str, float] = {}  # candidates left out: their error over the budget
    if DENSE_COMPRESSOR in allowed:
        candidates["dense"] = make_plan(profile, Strategy.DENSE, source=source, time_limit_s=time_limit_s)
    for c in allowed:
        if c.kind is not CompressorKind.TOPK:
            continue
        name = f"topk at {c.density:g}"
        if budget is not None and (error := uniform_error(profile, c)) > budget[0]:
            beyond[name] = error
            continue
        candidates[name] = make_plan(profile, Strategy.TOPK, c.density, source=source, selector=selector,
                                     time_limit_s=time_limit_s)
    if len(allowed) > 1 or not candidates:
        candidates[f"mixed over {', '.join(map(str, allowed))}"] = make_mixed_plan(
            profile, allowed, source=source, selector=selector, time_limit_s=time_limit_s, error_budget=error_budget)
    if trials is not None and trials.curves is not None:  # what to leave out to need fewer samples
        for fewer in _needing_fewer_samples(allowed, trials):
            name = f"mixed over {', '.join(map(str, fewer))}"
            if fewer != (DENSE_COMPRESSOR,) and name not in candidates:
                candidates[name] = make_mixed_plan(profile, fewer, source=source, selector=selector,
                                                   time_limit_s=time_limit_s, error_budget=error_budget)
    candidates = {name: with_error(plan, profile, budget) for name, plan in candidates.items()}
    left_out = hook_names(beyond_budget(next(iter(candidates.values())), profile, allowed))
    factors = samples_factors(candidates, trials) if trials is not None else None
    draws = Draws.of(profile) if weigh_noise else None
    if draws is None:
        choice = _auto_by_prediction(candidates, left_out, factors)
    else:
        choice = _auto_beyond_noise(profile, candidates, allowed, draws, time_limit_s, left_out, factors)
    why = "--error-budget bounds how far the plan may move the gradient"
    if by_default and profile.errors is None:
        why = "the profile measured no compression error; profile again to keep the plan within one"
    elif by_default:
        why = (f"the profile measured no error of {DEFAULT_BUDGETS[0]}, the default budget's; profile with it, or give "
               "--error-budget")
    rule = trial_rule or _rule(budget, beyond, by_default=by_default, why_none=why)
    samples = ""
    if factors is not None and trials is not None:
        lossy = dict.fromkeys(c for g in choice.plan.groups if (c := choice.plan.compressor_of(g)).lossy)
        results = [trials.result(c) for c in lossy if c in trials.compressors]
        samples = "; ".join(f"{r.compressor} {'' if r.samples is None else 'needed '}{r.describe_samples()} in the "
                            "trials" for r in results)
    if factors is not None:
        rule = rule.replace("rule: fastest within", "rule: least predicted step x samples to DDP's half-way loss (as "
                            "the trials measured them, the upper end of their interval, at least 1x) within", 1)
    kept = None
    if factors is not None:
        name = next(name for name, plan in choice.candidates.items() if plan is choice.plan)
        kept = {"plan": factors[name], **{row: f for row, f in factors.items() if row not in choice.candidates}}
    pool = dict(choice.candidates)
    if profile.hosts is not None:  # on several hosts: the kept plan's way of sending, every group one way across them
        name = next(name for name, plan in choice.candidates.items() if plan is choice.plan)
        routed = route_variants(profile, name, choice.plan, source=source, selector=selector,
                                time_limit_s=time_limit_s, error_budget=error_budget)
        pool.update({label: with_error(plan, profile, budget) for label, plan in routed.items()})
        if factors is not None:
            factors = {**factors, **dict.fromkeys(routed, factors[name])}  # the same compressors: the same samples
    ups = runners_up(choice.plan, pool, factors)
    nearest = next_grouping(profile, choice.plan, time_limit_s=time_limit_s, error_budget=error_budget)
    if nearest is not None and _decisions(nearest) not in {_decisions(p) for p in ups.values()}:
        ups[NEXT_GROUPING] = with_error(nearest, profile, budget)
    plan = replace(choice.plan, runners_up=ups)
    return replace(choice, plan=plan, rule=rule, beyond_budget=left_out, samples=samples, factors=kept)


def neighbouring_groupings(grouping: Grouping) -> list[Grouping]:
    """Every grouping one step from `grouping` (exclusive group ends): two adjacent groups merged into one, or one
    group split in two; merges first, each grouping once."""
    ends = tuple(grouping)
    out = [ends[:i] + ends[i + 1:] for i in range(len(ends) - 1)]
    start = 0
    for i, end in enumerate(ends):
        out += [(*ends[:i], cut, *ends[i:]) for cut in range(start + 1, end)]
        start = end
    return out


def next_grouping(profile: Profile, kept: Plan, *, time_limit_s: float | None = 1.0,
                  error_budget: BudgetSpec | None = None) -> Plan | None:
    """The best plan one grouping away from `kept`: among the groupings one step from its own (two adjacent groups
    merged, or one group split in two: `neighbouring_groupings`), the one predicted fastest with each group's
    compressor chosen again, exactly, among the kept plan's compressors and within the same error budget
    (`MixedParetoDP` with the grouping fixed), as a mixed plan of those compressors. The model chose the kept plan's
    grouping over this one by its prediction alone; the race measures both.

    None: a plan of one layer (no other grouping), or no neighbour within the budget. Past `time_limit_s`, the best of
    the neighbours solved by then."""
    compressors = kept.compressors or tuple(dict.fromkeys(kept.compressor_of(g) for g in kept.groups))
    selector = kept.selector if any(c.kind is CompressorKind.TOPK for c in compressors) else None
    problem = mixed_problem(profile, compressors, selector=selector or "exact")
    budget = None if error_budget is None else resolve_budget(profile, error_budget)
    error = None if budget is None else solver_budget(profile, problem, *budget)
    deadline = Deadline(time_limit_s)
    best: tuple[float, Grouping] | None = None
    for grouping in neighbouring_groupings(plan_grouping(kept, profile)):
        if best is not None and deadline.passed():
            break
        try:
            found = MixedParetoDP(grouping=grouping, error=error).solve(problem, deadline=deadline)
        except SolverError:  # no plan of this grouping within the budget
            continue
        if best is None or found.iteration_s < best[0]:
            best = (found.iteration_s, grouping)
    if best is None:
        return None
    return make_mixed_plan(profile, compressors, source=kept.source_profile or "", selector=selector,
                           time_limit_s=time_limit_s, error_budget=error_budget, grouping=best[1])


def _decisions(plan: Plan) -> tuple:
    """What a plan decides: its groups, each sent one way (two plans deciding alike are the same finalist)."""
    return tuple((g.params, str(plan.compressor_of(g)), g.hierarchical) for g in plan.groups)


def route_variants(profile: Profile, name: str, kept: Plan, *, source: str = "", selector: str | None = None,
                   time_limit_s: float | None = 1.0, error_budget: BudgetSpec | None = None) -> dict[str, Plan]:
    """The plan of the kept candidate `name`'s way of sending (its strategy, density or compressors) with every group
    crossing hosts flat, and with every group crossing them hierarchically where its compressor can ("NAME, all
    flat", "NAME, all hierarchical"): the best plan per route, which the race may settle where the model cannot."""
    out = {}
    for route in ("flat", "hierarchical"):
        if kept.strategy is Strategy.MIXED:
            plan = make_mixed_plan(profile, kept.compressors or (), source=source, selector=selector,
                                   time_limit_s=time_limit_s, route=route, error_budget=error_budget)
        else:
            plan = make_plan(profile, kept.strategy, kept.density, source=source, selector=selector, route=route,
                             time_limit_s=time_limit_s)
        out[f"{name}, all {route}"] = plan
    return out


#: The runner-up that is the plan's next grouping (`next_grouping`): its compressors on a grouping one step from its.
NEXT_GROUPING = "next grouping"
#: How many of auto's other candidates the kept plan names as runners-up (finalists of the race beside it).
RUNNERS_UP = 2


def runners_up(kept: Plan, candidates: dict[str, Plan], factors: dict[str, float] | None = None,
               most: int = RUNNERS_UP) -> dict[str, Plan]:
    """The `most` candidates other than `kept` predicted fastest (times their samples factor, where the trials
    measured one), by name: the best plan of each other way of sending, for the race to settle what the model
    cannot. A candidate that makes the same decisions as the kept plan (the same groups, sent the same way) is
    the kept plan, not a runner-up."""
    factor = factors or {}
    seen = {_decisions(kept)}
    out: dict[str, Plan] = {}
    for name, plan in sorted(candidates.items(), key=lambda kv: kv[1].predicted.iteration_s * factor.get(kv[0], 1)):
        if len(out) < most and plan is not kept and _decisions(plan) not in seen:
            seen.add(_decisions(plan))
            out[name] = plan
    return out


def samples_factors(candidates: dict[str, Plan], trials: Trials) -> dict[str, float] | None:
    """Each candidate's factor for the samples it needs: the largest `Trials.samples_factor` of the compressors it
    sends (a compressor sent on some groups taken to cost at most what it cost sent on all), 1 for those the trials
    did not measure; and each DDP hook's ("ddp+C": C's). None: trials without curves (a version 1 file), so steps
    are compared alone."""
    if trials.curves is None:
        return None
    out = {}
    for name, plan in candidates.items():
        sent = dict.fromkeys(plan.compressor_of(g) for g in plan.groups)
        out[name] = max((f for c in sent if (f := trials.samples_factor(c)) is not None), default=1.0)
    for name in ddp_predictions(candidates):
        hook = Compressor.parse(name.removeprefix("ddp+")) if name.startswith("ddp+") else DENSE_COMPRESSOR
        out[name] = trials.samples_factor(hook) or 1.0
    return out


def _needing_fewer_samples(allowed: Sequence[Compressor], trials: Trials) -> list[tuple[Compressor, ...]]:
    """The allowed compressors without those whose trials needed more samples than a threshold, for each threshold
    below the largest (the mixed plan over all of `allowed` is the largest's): the mixed plans over these are the
    candidates that trade a longer step for fewer samples."""
    factor = {c: trials.samples_factor(c) or 1.0 for c in allowed}
    levels = sorted(set(factor.values()))[:-1]
    return [tuple(c for c in allowed if factor[c] <= level) for level in levels]


def _factors_text(factors: dict[str, float] | None, names: Sequence[str]) -> str:
    """"; times the samples each needs over DDP's (the trials): mixed ... 1.24x, dense 1x"."""
    if factors is None:
        return ""
    return ("; each predicted step times the samples it needs over DDP's (the trials): "
            + ", ".join(f"{name} {factors[name]:.3g}x" for name in names))


def trial_budget(profile: Profile, compressors: Sequence[Compressor], trials: Trials
                 ) -> tuple[tuple[Compressor, ...], BudgetSpec | str | None, str]:
    """The compressors and the error budget that `trials` allow, and the rule line that says so.

    Allowed: dense, the default budget's compressor (fp16: lossless in effect, shown to train like dense on the
    tasks of docs/results/error-budget.md) and the compressors whose trial trained like dense, each where
    `compressors` has it. The budget: the error of the loosest of those on every layer (as the profile measured
    it), at least the default budget. The compressors whose trial did not train like dense, and those not tried,
    are left out.

    Raises:
        PlanMismatchError: trials of another model or world size than the profile's.
        InvalidProfileError: a compressor that trained like dense whose error the profile did not measure.
    """
    if trials.model.fingerprint != profile.model.fingerprint:
        raise PlanMismatchError(f"the trials were run on {trials.model.name} and the profile measured "
                                f"{profile.model.name} (another model): run `planner trial` on this profile")
    if trials.world_size != profile.cluster.world_size:
        raise PlanMismatchError(f"the trials were run on {trials.world_size} workers and the profile measured "
                                f"{profile.cluster.world_size}: run `planner trial` on this profile")
    default = default_budget(profile)
    results = {r.compressor: r for r in trials.results()}
    passed = [c for c in compressors if c in results and results[c].passed]
    allowed = tuple(c for c in compressors if not c.lossy or c == default or c in passed)
    loosest = max(passed, key=lambda c: uniform_error(profile, c), default=None)
    if loosest is not None and (default is None or uniform_error(profile, loosest) > uniform_error(profile, default)):
        budget: BudgetSpec | str | None = loosest
        line = (f"rule: fastest within the error budget {uniform_error(profile, loosest):.3g} ({loosest} on every "
                f"layer, the loosest that trained like dense in the trials: {results[loosest].describe()}")
    else:
        budget = BY_DEFAULT
        line = "rule: fastest within the default error budget"
        line += (f" {uniform_error(profile, default):.3g} ({default} on every layer" if default is not None
                 else " (none: the profile measured no error of the default budget's compressor")
        lossy = [c for c in passed if c.lossy]
        line += ("; no lossier compressor allowed trained like dense in the trials" if not lossy
                 else f"; of the trials, {', '.join(map(str, lossy))} trained like dense, within it")
    line += f" ({trials.samples:,} samples of the {trials.task} task, {trials.repeats} repeats))"
    failed = [results[c] for c in compressors if c.lossy and c != default and c in results and not results[c].passed]
    untried = [c for c in compressors if c.lossy and c != default and c not in results]
    if failed:
        line += "; left out, not like dense in the trials: " + ", ".join(
            f"{r.compressor} ({r.describe()})" for r in failed)
    if untried:
        line += "; left out, not tried: " + ", ".join(map(str, untried))
    return allowed, budget, line


def _rule(budget: tuple[float, Compressor | None] | None, beyond: dict[str, float], *, by_default: bool = False,
          why_none: str = "") -> str:
    """The line that says which rule kept the plan."""
    if budget is None:
        return f"rule: by predicted step alone, among the compressors allowed (no error budget: {why_none})"
    value, of = budget
    default = "default " if by_default else ""
    line = f"rule: fastest within the {default}error budget {value:.3g}"
    line += f" ({of} on every layer{', which trained like dense' if by_default else ''})" if of is not None else ""
    if beyond:
        line += "; left out beyond it: " + ", ".join(f"{name} (error {e:.3g})" for name, e in beyond.items())
    return line


def with_error(plan: Plan, profile: Profile, budget: tuple[float, Compressor | None] | None) -> Plan:
    """`plan` with its compression error recorded (where the profile measured its compressors' errors)."""
    if plan.error is not None:
        return plan
    error = plan_error(profile, plan.groups, [plan.compressor_of(g) for g in plan.groups], budget)
    return plan if error is None else replace(plan, error=error)


def _auto_by_prediction(candidates: dict[str, Plan], left_out: Sequence[str] = (),
                        factors: dict[str, float] | None = None) -> AutoChoice:
    """The candidate predicted fastest (times its samples factor, `samples_factors`), beside DDP's predictions (a
    profile without samples: no noise to weigh); the hooks `left_out` (beyond the error budget) are not compared
    with."""
    factor = factors or {}

    def to_loss(name: str, seconds: float) -> float:  # a step, times the samples it takes to the loss
        return seconds * factor.get(name, 1.0)

    ranked = sorted(candidates.items(), key=lambda kv: to_loss(kv[0], kv[1].predicted.iteration_s))
    (name, best), runner_up = ranked[0], ranked[1:2]
    best_s = to_loss(name, best.predicted.iteration_s)
    faster = "faster to the loss" if factors is not None else "faster"
    reason = f"kept {name}: {best.predicted.iteration_s * 1e3:,.2f} ms predicted"
    if runner_up:
        other, plan = runner_up[0]
        reason += (f", {to_loss(other, plan.predicted.iteration_s) / best_s:.3f}x {faster} than {other} "
                   f"({plan.predicted.iteration_s * 1e3:,.2f} ms)")
    if best.strategy is Strategy.MIXED:
        used = dict.fromkeys(str(best.compressor_of(g)) for g in best.groups)
        reason += f"; its groups are sent as {', '.join(used)}"
    reason += _factors_text(factors, [name for name, _ in ranked])
    reason += " (the profile has no repeated samples, so the noise of these predictions was not weighed)"
    ddp = ddp_predictions(candidates, left_out)
    fastest = min(ddp.items(), key=lambda kv: to_loss(*kv)) if ddp else None
    ddp_faster = fastest if fastest is not None and to_loss(*fastest) < best_s else None
    if ddp_faster is not None:  # the plan's verdict line says to keep it (`planner.commands.printing.print_spread`)
        reason += (f". No plan is predicted {faster} than {ddp_faster[0]} ({ddp_faster[1] * 1e3:,.2f} ms, "
                   f"{best_s / to_loss(*ddp_faster):.3f}x {faster} than the plan kept)")
    return AutoChoice(plan=best, candidates=candidates, reason=reason, ddp_faster=ddp_faster, way=choose_way(best))


def _error(plan: Plan) -> float:
    """The plan's compression error as predicted (0 where not recorded)."""
    return plan.error.predicted if plan.error is not None else 0.0


def _auto_beyond_noise(profile: Profile, candidates: dict[str, Plan], allowed: tuple[Compressor, ...],
                       draws: Any, time_limit_s: float | None, left_out: Sequence[str] = (),
                       factors: dict[str, float] | None = None) -> AutoChoice:
    """Every candidate and the DDP variants under the same draws; the simplest candidate no other beats beyond the
    noise is kept (each candidate's steps times its samples factor, `samples_factors`), and weighed against DDP and
    the hook of every allowed compressor but those `left_out` (beyond the error budget: predicted, not weighed)."""
    # Every candidate's rows and the DDP variants, under the same draws. Each candidate is weighed against plain DDP
    # and DDP with the hook of every allowed compressor, not only its own.
    own = {name: plan_rows(plan, profile, time_limit_s=time_limit_s) for name, plan in candidates.items()}
    ddp = ddp_rows(next(iter(candidates.values())), profile, allowed)
    values = evaluate({**{(name, row): step for name, steps in own.items() for row, step in steps.items()},
                       **{("", row): step for row, step in ddp.items()}}, draws)
    nominal = Problems(profile)
    ddp_values, ddp_nominal = {row: values["", row] for row in ddp}, {row: step(nominal) for row, step in ddp.items()}
    selector = topk_hook_selector(next(iter(candidates.values())), profile, allowed)
    hooks = {row: f for row, f in (factors or {}).items() if row in ddp}

    def samples(name: str) -> dict[str, float] | None:  # the verdict weighs time to the loss, where trials say
        return None if factors is None else {"plan": factors[name], **hooks}

    weighed = {name: attach(plan, {row: values[name, row] for row in own[name]}, ddp_values, draws, ddp_nominal,
                            topk_selector=selector, left_out=left_out, samples=samples(name))
               for name, plan in candidates.items()}
    factor = factors or dict.fromkeys(candidates, 1.0)
    step = {name: values[name, "plan"] * factor[name] for name in candidates}  # to the loss, where trials say
    order = sorted(candidates, key=lambda name: plan_simplicity(candidates[name]))  # stable: dense, top-k, mixed
    if factors is not None:  # among lossy plans, the one that moves the gradient least is the simpler
        order.sort(key=lambda name: (plan_simplicity(candidates[name]), _error(candidates[name])))
    fastest = min(candidates, key=lambda name: candidates[name].predicted.iteration_s * factor[name])
    kept = simplest_unbeaten(order, step, fastest)
    plan = weighed[kept]
    reason = f"kept {kept}: {_with_interval(plan, 'plan')}"
    faster = "faster to the loss (step x samples)" if factors is not None else "faster"
    if kept == fastest:
        others = [name for name in candidates if name != kept]
        if others:
            second = min(others, key=lambda name: candidates[name].predicted.iteration_s * factor[name])
            gain = PairedGain.of(step[kept], step[second])
            reason += (f", the fastest predicted: {gain.describe()} {faster} than {second} "
                       f"({_with_interval(weighed[second], 'plan')})"
                       + (", beyond the noise" if gain.beyond_noise else ", within the noise"))
    else:
        gain = PairedGain.of(step[fastest], step[kept])
        reason += (f", the simplest within the noise of the fastest: {fastest} "
                   f"({_with_interval(weighed[fastest], 'plan')}) is {gain.describe()} {faster}, not beyond the noise")
    if plan.strategy is Strategy.MIXED:
        used = dict.fromkeys(str(plan.compressor_of(g)) for g in plan.groups)
        reason += f"; its groups are sent as {', '.join(used)}"
    reason += _factors_text(factors, [*order, *hooks])
    way = choose_way(plan, {row: values[kept, row] for row in own[kept]})
    return AutoChoice(plan=plan, candidates=weighed, reason=reason, way=way)


def _with_interval(plan: Plan, row: str) -> str:
    """A row's prediction and its interval: "66.29 ms [62.53, 71.41]"."""
    seconds = plan.predicted.iteration_s if row == "plan" else plan.baselines[row].iteration_s
    pair = plan.intervals.rows.get(row) if plan.intervals is not None else None
    text = f"{seconds * 1e3:,.2f} ms"
    return text if pair is None else f"{text} [{pair[0] * 1e3:,.2f}, {pair[1] * 1e3:,.2f}]"
