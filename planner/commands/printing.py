"""Tables several commands print: a plan (with its K-FAC and ABS-SGD sections), a profile, bench results,
`--strategy auto`'s choice and a mixed plan's groups; and a profile's measurements as pandas tables.

Every command imports this module as it starts, so each function imports the cost model, strategies and sessions it
reads (and pandas, numpy and the contracts that load numpy) inside itself, marked `# deferred (start-up)` (see
`planner.commands`): none of them is needed to parse a command line or to start a worker."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rich.table import Table

from planner.console import console, err_console
from planner.contracts.plan import DDP_ROW, VIA_DDP_ROW, Plan, PlanError
from planner.platform.memory import gib
from planner.types import Collective, Compressor, CompressorKind, Strategy

if TYPE_CHECKING:
    import pandas as pd

    from planner.contracts.errors import CompressionErrors
    from planner.contracts.profile import Profile
    from planner.contracts.race_record import RaceRecord
    from planner.strategies.auto import AutoChoice
    from planner.strategies.model_error import ModelError


def _ms(seconds: float) -> str:
    """Seconds as milliseconds, two decimals."""
    return f"{seconds * 1e3:,.2f}"


#: How a plan's table names its row run inside DDP (`planner.contracts.plan.VIA_DDP_ROW`).
VIA_DDP_LABEL = "plan via DDP (PlanHook)"


def print_plan(plan: Plan, title: str | None = None, ddp: dict[str, float] | None = None, samples: str = "",
               factors: dict[str, float] | None = None) -> None:
    """The comparison table of a plan: the plan (run in GradientExchange, and inside DDP where it can be), each
    baseline and the lower bound, under the same model; then its verdict (`print_spread`: `ddp`, the DDP variants'
    predicted steps, for a plan not weighed against the noise, and `factors`, the samples each needs; `samples`,
    what trials measured of the samples its lossy compressors need)."""
    reference = plan.ddp_row if plan.ddp_row in plan.baselines else "plan"
    ref = plan.baselines.get(reference, plan.predicted).iteration_s
    lb = plan.lower_bound_s
    tag = plan.strategy.value
    if plan.strategy is Strategy.TOPK:
        tag += f" (density {plan.density:g}, {plan.selector} selector)"
    if plan.strategy is Strategy.MIXED:
        used = dict.fromkeys(str(plan.compressor_of(g)) for g in plan.groups)
        allowed = ", ".join(map(str, plan.compressors)) if plan.compressors else "not recorded"
        tag += f" (sends {', '.join(used)}; allowed {allowed})"
    table = Table(title=title or f"{plan.model.name}: {tag} plan, {plan.cluster.describe()}")
    spread = plan.intervals.rows if plan.intervals is not None else None
    interval_col = f"{plan.intervals.level:.0%} interval ms" if plan.intervals is not None else None
    for col in ("grouping", "groups", "iteration ms", *([interval_col] if interval_col else []), "exposed comm ms",
                f"vs {reference}", "gap to bound"):
        table.add_column(col, justify="left" if col == "grouping" else "right")
    rows = [("plan", f"plan ({plan.solver})", plan.predicted),
            *((name, VIA_DDP_LABEL if name == VIA_DDP_ROW else name, p) for name, p in plan.baselines.items())]
    for key, name, p in rows:
        interval = [] if spread is None else [interval_ms(spread.get(key))]
        table.add_row(
            name, str(p.num_groups), _ms(p.iteration_s), *interval, _ms(p.exposed_comm_s),
            f"{ref / p.iteration_s:.2f}x", f"{(p.iteration_s - lb) / lb:+.1%}" if lb > 0 else "-",
            style="bold" if name.startswith("plan") else None,
        )
    table.add_row("lower bound", "", _ms(lb), *([""] if spread is not None else []), "",
                  f"{ref / lb:.2f}x" if lb > 0 else "-", "")
    console.print(table)
    print_spread(plan, ddp, samples, factors)
    console.print(
        f"solver {plan.solver} took {plan.solve_seconds * 1e3:.1f} ms; "
        f"profile {plan.source_profile or '?'} measured {plan.profiled}"
    )
    console.print(optimality_line(plan))
    hierarchical = [i for i, g in enumerate(plan.groups) if g.hierarchical]
    if plan.cluster.host_count > 1:
        console.print(f"{plan.cluster.host_count} hosts: {len(hierarchical)} of {len(plan.groups)} groups cross them "
                      f"hierarchically (inside each host, across, inside again)"
                      + (f": groups {', '.join(str(i) for i in hierarchical)}" if hierarchical else "")
                      + f"; {len(plan.groups) - len(hierarchical)} by one flat collective")
    if plan.kfac is not None:
        print_kfac(plan)
    if plan.abs is not None:
        print_abs(plan)


def interval_ms(pair: tuple[float, float] | None) -> str:
    """(low, high) seconds as "612.30-655.10" ms; "-" for none."""
    return "-" if pair is None else f"{_ms(pair[0])}-{_ms(pair[1])}"


def _with_interval(seconds: float, pair: tuple[float, float] | None) -> str:
    """"612.30 ms [598.10, 630.00]", or without an interval "612.30 ms"."""
    return f"{_ms(seconds)} ms" + ("" if pair is None else f" [{_ms(pair[0])}, {_ms(pair[1])}]")


#: Why a verdict without intervals did not weigh the noise (a plan whose profile kept no samples).
NO_SAMPLES = ("the profile it was solved from keeps no repeated samples (one made before they were kept: profile "
              "again) or describes a what-if cluster")


def verdict_line(keep: str, mine: str, other: str, gain: tuple[float, float, float] | float, *,
                 unweighed: str | None = None) -> str:
    """The one verdict line every plan's table ends with: what to keep, the plan's step against the alternative
    it gains least on (`other`: its row name and step), and the gain, 1 - plan / other (> 0: the plan is faster).
    `gain` is (median, low, high) where it was weighed against the noise: the plan is kept where low > 0, the
    alternative `keep` otherwise. A number alone is a prediction whose noise is not known (`unweighed` says why):
    the plan is kept where it is predicted faster."""
    if isinstance(gain, tuple):
        median, low, high = gain
        if low > 0:
            return (f"verdict: keep the plan: the plan's {mine} against {other}: {median:.1%} faster "
                    f"[{low:.1%}, {high:.1%}], beyond the noise")
        if high < 0:
            return (f"verdict: keep {keep}: the plan's {mine} is slower than {other}, by {-median:.1%} "
                    f"[{-high:.1%}, {-low:.1%}], beyond the noise")
        faster = (f"{median:.1%} faster [{low:.1%}, {high:.1%}]" if median >= 0
                  else f"{-median:.1%} slower [{-high:.1%}, {-low:.1%}]")
        return f"verdict: keep {keep}: the plan's {mine} against {other}: {faster}, within the noise"
    why = f"; its noise not weighed: {unweighed}" if unweighed else ""
    if gain > 0:
        return f"verdict: keep the plan: the plan's {mine} against {other}: {gain:.1%} faster, as predicted{why}"
    if gain == 0:
        return f"verdict: keep {keep}: the plan's {mine} is no faster than {other}, as predicted{why}"
    return f"verdict: keep {keep}: the plan's {mine} is slower than {other}, by {-gain:.1%}, as predicted{why}"


def plan_ddp_rows(plan: Plan) -> dict[str, float]:
    """The DDP variants among a plan's own rows ("ddp", "ddp+C"), predicted steps by name: what a plan without a
    verdict is compared with where no profile is at hand (`planner show`)."""
    return {name: p.iteration_s for name, p in plan.baselines.items() if name == DDP_ROW or name.startswith("ddp+")}


def print_spread(plan: Plan, ddp: dict[str, float] | None = None, samples: str = "",
                 factors: dict[str, float] | None = None) -> None:
    """Where the plan's intervals come from, and its verdict against DDP in one line: weighed against the noise
    where the plan has intervals, else as predicted against `ddp` (each DDP variant's predicted step; default the
    plan's own DDP rows), each step times its samples factor where `factors` has one ("plan" and the variants':
    the samples each needs to reach the loss over DDP's, `planner.strategies.auto.samples_factors`). `samples`:
    what trials measured of the samples the plan's lossy compressors need, said in place of "not measured"."""
    from planner.strategies.intervals import ddp_label  # deferred (start-up)

    if plan.kfac is not None or plan.abs is not None:
        return
    if plan.intervals is None or plan.verdict is None:
        variants = ddp if ddp else plan_ddp_rows(plan)
        if not variants:
            console.print(f"no intervals: {NO_SAMPLES}; the plan was not weighed against DDP")
        else:
            factor = factors or {}

            def to_loss(name: str, seconds: float) -> float:  # a step, times the samples it takes to the loss
                return seconds * factor.get(name, 1.0)

            against = min(variants, key=lambda name: (to_loss(name, variants[name]), name != DDP_ROW))
            step = plan.predicted.iteration_s
            gain = 1 - to_loss("plan", step) / to_loss(against, variants[against])
            line = verdict_line(ddp_label(against), f"{_ms(step)} ms", f"{against} {_ms(variants[against])} ms", gain,
                                unweighed=NO_SAMPLES)
            if factors:
                line += _weighed_to_the_loss({name: factor.get(name, 1.0) for name in ("plan", against)})
            lossy = sorted({str(plan.compressor_of(g)) for g in plan.groups if plan.compressor_of(g).lossy})
            if lossy and gain > 0 and samples:
                line += f"; it sends {', '.join(lossy)}, which changes the gradients: {samples}"
            console.print(line, style="bold", soft_wrap=True)
        return
    spread = plan.intervals
    console.print(f"intervals: the central {spread.level:.0%} of the predictions over {spread.draws} profiles "
                  f"resampled from the samples of its {', '.join(spread.sources)}")
    verdict = plan.verdict
    step, low, high = verdict.variants[verdict.against]
    other = f"{verdict.against} {_with_interval(step, (low, high))}"
    mine = _with_interval(plan.predicted.iteration_s, spread.rows.get("plan"))
    line = verdict_line(ddp_label(verdict.keep), mine, other, verdict.gain)
    if verdict.keep not in ("plan", DDP_ROW):
        line += f" ({verdict.keep} is faster than plain DDP beyond the noise)"
    if verdict.samples:
        line += _weighed_to_the_loss({name: verdict.samples.get(name, 1.0) for name in ("plan", verdict.against)})
    if verdict.beyond_budget and plan.error is not None and plan.error.budget is not None:
        line += (f"; not weighed against {', '.join(verdict.beyond_budget)}: beyond the error budget "
                 f"{plan.error.budget:.3g}")
    lossy = sorted({str(plan.compressor_of(g)) for g in plan.groups if plan.compressor_of(g).lossy})
    if lossy and verdict.keep == "plan" and samples:
        line += f"; it sends {', '.join(lossy)}, which changes the gradients: {samples}"
    elif lossy and verdict.keep == "plan":
        line += (f"; it sends {', '.join(lossy)}, which changes the gradients: what that costs in samples to reach "
                 "a loss was not measured (`planner bench --target-loss L` measures it)")
    console.print(line, style="bold", soft_wrap=True)


def _weighed_to_the_loss(factors: dict[str, float]) -> str:
    """"; weighed to the loss: each step times the samples it needs over DDP's, as trials measured (plan 1.07x, ..."."""
    return ("; weighed to the loss: each step times the samples it needs over DDP's, as trials measured ("
            + ", ".join(f"{name} {f:.3g}x" for name, f in factors.items()) + ")")


def optimality_line(plan: Plan) -> str:
    """One line: whether the solver proved the plan optimal, or how close to the bound its best found is."""

    what = "gradient groups" if plan.kfac is not None or plan.abs is not None else "plan"
    if plan.optimal is None:
        return f"{what}: optimality not recorded (a plan written before it was)"
    if plan.optimal:
        return f"{what}: optimal"
    return f"{what}: best found in {plan.solve_seconds:.2f} s, within {plan.gap or 0.0:.2%} of the bound"


def print_abs(plan: Plan) -> None:
    """ABS-SGD's trigger, and its predictions beside the synchronous baselines'."""

    assert plan.abs is not None
    a = plan.abs
    cap = "no cap" if a.max_micro_batches is None else f"at most {a.max_micro_batches}"
    trigger = (f"rounds of {a.round_samples} samples, split by measured speed" if a.round_samples is not None
               else f"a round ends after at least {a.min_micro_batches} once the previous exchange is done ({cap})")
    table = Table(title=f"ABS-SGD, global batch {a.global_batch}: micro-batches of {a.micro_batch}, {trigger}")
    for col in ("variant", "round ms", "samples/round", "samples/s", "vs sync-equal", "share per worker",
                "idle per worker"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    ref = a.predicted["sync-equal"].samples_per_s
    for name, p in a.predicted.items():
        table.add_row(name, _ms(p.round_s), f"{sum(p.samples):,.1f}", f"{p.samples_per_s:,.0f}",
                      f"{p.samples_per_s / ref:.2f}x", " / ".join(f"{s:.0%}" for s in p.shares),
                      " / ".join(f"{f:.0%}" for f in p.idle_fraction), style="bold" if name == "abs-sgd" else None)
    console.print(table)
    from planner.strategies.abs_plan import ON_TARGET  # deferred (start-up)

    rounds = sum(a.predicted["abs-sgd"].samples)
    if rounds > ON_TARGET * a.global_batch:
        console.print(f"note: ABS-SGD's rounds hold {rounds:,.0f} samples, more than {ON_TARGET:g}x the global batch "
                      f"{a.global_batch}: the exchange takes longer than the workers need for {a.global_batch} "
                      "samples, so the rounds grow to hide it (a larger --global-batch matches them)")
    print_abs_verdict(plan)


def print_abs_verdict(plan: Plan) -> None:
    """ABS-SGD against synchronous SGD, in the one verdict line every plan's table ends with: by samples per second
    counting at most the global batch of each round (what the plan maximises, `progress_per_s`), as predicted (an
    ABS-SGD plan has no intervals). Synchronous SGD with the batch split equally is DDP; the other split is kept
    only where it is faster."""
    from planner.strategies.abs_plan import progress_per_s  # deferred (start-up)

    assert plan.abs is not None
    a = plan.abs
    if "abs-sgd" not in a.predicted:
        return
    rates = {name: progress_per_s(p, a.global_batch) for name, p in a.predicted.items()}
    mine = rates.pop("abs-sgd")
    if not rates:
        return
    order = list(rates)  # sync-equal (DDP) first: the simpler on a tie
    against = max(rates, key=lambda name: (rates[name], -order.index(name)))
    keep = "DDP" if against == "sync-equal" else f"synchronous SGD ({against})"
    console.print(verdict_line(keep, f"{mine:,.0f} samples/s", f"{against} {rates[against]:,.0f} samples/s",
                               1 - rates[against] / mine, unweighed="ABS-SGD plans carry no intervals"),
                  style="bold", soft_wrap=True)


def print_kfac(plan: Plan) -> None:
    """The K-FAC comparison: average step time of the plan, each baseline and the lower bound."""
    from planner.strategies.kfac_plan import LOCAL_KFAC  # deferred (start-up)

    assert plan.kfac is not None
    k = plan.kfac
    if k.predicted is None:
        console.print("the kfac section has no predictions")
        return
    baselines = k.baselines or {}
    ref = baselines.get("kfac-pytorch", k.predicted).step_s
    lb = k.lower_bound_s or 0.0
    table = Table(title=f"K-FAC ({k.method.value}, factors every {k.factor_update_steps} step(s), inverses every "
                        f"{k.inv_update_steps}): predicted average step")
    spread = k.intervals
    for col in ("layout", "buffers", "step ms", *(("90% interval ms",) if spread else ()), "factor step ms",
                "inversion ms", "broadcast ms", "precondition ms", "vs kfac-pytorch", "gap to bound"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for name, p in [("plan", k.predicted), *baselines.items()]:
        pre = "-" if p.precondition_s is None or name == "sgd" else _ms(p.precondition_s)
        layout = name not in ("sgd", LOCAL_KFAC)  # the others are not K-FAC on several workers
        table.add_row(
            name, str(p.num_buffers), _ms(p.step_s), *((interval_ms(spread.get(name)),) if spread else ()),
            _ms(p.factor_step_s), _ms(p.inversion_s), _ms(p.broadcast_s),
            pre, f"{ref / p.step_s:.2f}x" if name != LOCAL_KFAC else "-",
            f"{(p.step_s - lb) / lb:+.1%}" if lb > 0 and layout else "-",
            style="bold" if name == "plan" else None,
        )
    table.add_row("lower bound", "", _ms(lb), *(("",) if spread else ()), "", "", "", "",
                  f"{ref / lb:.2f}x" if lb > 0 else "-", "")
    console.print(table)
    print_kfac_verdict(plan)
    owners = list(k.owners.values())
    everywhere = sum(o is None for o in owners)
    placed = sum(r is not None for r in k.preconditioners.values())
    gap = "proven optimal" if not k.placement_gap else f"gap {k.placement_gap:.2%}"
    console.print(
        f"{len(k.a_buffers)} A + {len(k.g_buffers)} G buffers ({k.fusion_solver}), factors sent "
        f"{k.describe_messages()}; {len(owners) - everywhere} "
        f"factors on one owner, {everywhere} everywhere; {placed} of {len(k.preconditioners)} layers "
        f"preconditioned by one worker, the rest by all ({k.placement_solver}, {gap}); "
        f"K-FAC solve {k.solve_seconds * 1e3:.1f} ms. 'sgd' is the same step without K-FAC"
        + (f"; '{LOCAL_KFAC}' is one worker doing all of K-FAC's work alone, what the bench sets beside the "
           "profile to show how far K-FAC's kernels moved since." if LOCAL_KFAC in baselines else ".")
    )
    print_left_out(len(k.layers), k.left_out, k.skip)


def print_kfac_verdict(plan: Plan) -> None:
    """A K-FAC plan's verdict against the reference layouts (`planner.strategies.intervals.KFAC_REFERENCES`), in the
    one line every plan's table ends with: weighed against the noise where the section has intervals, else as
    predicted (the reference kept is the fastest, the simplest on a tie)."""
    from planner.strategies.intervals import KFAC_REFERENCES  # deferred (start-up)

    assert plan.kfac is not None and plan.kfac.predicted is not None
    k = plan.kfac
    assert k.predicted is not None
    baselines = k.baselines or {}
    spread = k.intervals
    if k.verdict is not None and spread is not None:
        v = k.verdict
        mine = _with_interval(k.predicted.step_s, spread.get("plan"))
        other = f"{v.against} {_with_interval(baselines[v.against].step_s, spread.get(v.against))}"
        line = verdict_line(f"the {v.keep} layout", mine, other, v.gain)
        if v.keep != "plan":
            line += " (the simplest reference layout no other beats beyond it)"
        console.print(line, style="bold", soft_wrap=True)
        return
    references = [name for name in KFAC_REFERENCES if name in baselines]
    if not references:
        return
    fastest = min(references, key=lambda name: (baselines[name].step_s, references.index(name)))
    step = k.predicted.step_s
    gain = 1 - step / baselines[fastest].step_s
    console.print(verdict_line(f"the {fastest} layout", f"{_ms(step)} ms", f"{fastest} "
                               f"{_ms(baselines[fastest].step_s)} ms", gain, unweighed=NO_SAMPLES),
                  style="bold", soft_wrap=True)


def print_left_out(preconditioned: int, left_out: tuple[tuple[str, str], ...] | None, skip: str | None) -> None:
    """How many layers K-FAC preconditions, and every module it leaves to plain SGD, grouped by the reason
    (`left_out` None: a file made before they were recorded)."""
    pattern = f" (--kfac-skip {skip!r})" if skip else ""
    if left_out is None:
        console.print(f"K-FAC preconditions {preconditioned} layers{pattern}; which modules it leaves to plain SGD "
                      "was not recorded (a file made before they were listed: profile and solve again to see "
                      "them).", markup=False, soft_wrap=True)
        return
    by_reason: dict[str, list[str]] = {}
    for name, reason in left_out:
        by_reason.setdefault(reason, []).append(name)
    parts = [f"{', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''}: {reason}"
             for reason, names in by_reason.items()]
    text = f"K-FAC preconditions {preconditioned} layers{pattern}"
    console.print(text + (f"; {len(left_out)} left to plain SGD: " + "; ".join(parts) if parts else "."),
                  markup=False, soft_wrap=True)


#: How far the bench's local steps may be from the profile's before `planner bench` says the machine drifted.
DRIFT_TOLERANCE = 0.05


def _speedup(r: Any) -> str:
    """"1.04x [1.01, 1.07]", "1.04x" without an interval, "-" without a speedup."""
    if r.speedup is None:
        return "-"
    interval = getattr(r, "speedup_interval", None)
    if interval is None or r.name == r.reference:
        return f"{r.speedup:.2f}x"
    return f"{r.speedup:.2f}x [{interval[0]:.2f}, {interval[1]:.2f}]"


def print_bench(results: list, as_json: bool, title: str | None = None, lower_bound_s: float | None = None) -> None:
    """The bench table; `lower_bound_s`: a last row with the model's lower bound (no variant can predict less)."""
    if as_json:
        console.print_json(json.dumps([r.to_dict() for r in results]))
        return
    table = Table(title=title or "bench: median step time over measured steps (slowest rank per step)")
    reference = results[0].reference if results else "ddp"
    spread = any(getattr(r, "predicted_interval", None) is not None for r in results)
    for col in ("variant", "median ms", "p25-p75 ms", f"speedup vs {reference}", "predicted ms",
                *(("interval ms", "inside") if spread else ()), "|pred-meas|/meas"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in results:
        interval = getattr(r, "predicted_interval", None)
        inside = getattr(r, "inside", None)
        table.add_row(
            r.name, _ms(r.median_s), f"{_ms(r.p25_s)}-{_ms(r.p75_s)}",
            _speedup(r),
            _ms(r.predicted_s) if r.predicted_s is not None else "-",
            *((interval_ms(interval), "-" if inside is None else "yes" if inside else "no") if spread else ()),
            f"{r.rel_error:.1%}" if r.rel_error is not None else "-",
        )
    if lower_bound_s is not None:
        table.add_row("lower bound (model)", "", "", "", _ms(lower_bound_s), *(("", "") if spread else ()), "")
    console.print(table)
    if any(getattr(r, "speedup_interval", None) is not None for r in results[1:]):
        console.print(f"speedups: the median step of {reference} over the variant's; in brackets their 90% interval "
                      "(the interleaved rounds resampled, each keeping its steps of both)")
    if spread:
        counted = [r.inside for r in results if getattr(r, "inside", None) is not None]
        console.print(f"{sum(counted)} of {len(counted)} measured medians fall inside their predictions' intervals "
                      "(the profile's noise, resampled; the machine's drift since the profile is not in them)")
    from planner.sessions.bench import LOCAL, machine_drift  # deferred (start-up)
    from planner.sessions.bench_kfac import FACTOR_HOOKS_STRATEGY  # deferred (start-up)
    from planner.strategies.kfac_plan import LOCAL_KFAC  # deferred (start-up)

    for r in results:
        if getattr(r, "host_union", None) is not None:
            err_console.print(f"note: {r.name} sent {r.host_union:.2f} k pairs across per host (its hosts' union of "
                              "picks, over the measured steps); the profile predicted its hierarchical top-k "
                              "exchange at the union it measured (`planner show PROFILE` prints it)", markup=False)
    drift = machine_drift(results)
    if drift is not None and abs(drift) > DRIFT_TOLERANCE:
        err_console.print(f"note: the {LOCAL} steps ran {abs(drift):.0%} {'slower' if drift > 0 else 'faster'} than "
                          "the profile predicts: this machine is busier or quieter than when it was profiled, and "
                          "every prediction is off by about as much", markup=False)
    local_kfac = next((r for r in results if r.name == LOCAL_KFAC and r.predicted_s), None)
    if local_kfac is not None and local_kfac.rel_error is not None and local_kfac.rel_error > DRIFT_TOLERANCE:
        moved = local_kfac.median_s / local_kfac.predicted_s - 1
        err_console.print(f"note: the {LOCAL_KFAC} steps ran {abs(moved):.0%} {'slower' if moved > 0 else 'faster'} "
                          "than the profile predicts: K-FAC's kernels (factors, inversions, preconditioning) run "
                          "differently now than when they were profiled, and the K-FAC rows are off by about as "
                          "much", markup=False)
    hooks = next((r for r in results if r.strategy == FACTOR_HOOKS_STRATEGY and r.predicted_s), None)
    if hooks is not None and hooks.rel_error is not None and hooks.rel_error > DRIFT_TOLERANCE:
        off = hooks.median_s - hooks.predicted_s
        err_console.print(f"note: the plan's factor hooks took {_ms(hooks.median_s)} ms per factor-update step, "
                          f"{_ms(abs(off))} ms {'more' if off > 0 else 'less'} than the profile's "
                          f"{_ms(hooks.predicted_s)} ms, measured with nothing sent. Collectives in flight slow "
                          "them, which the predictions charge separately (interference); the rest is the machine "
                          "since the profile, and the K-FAC rows are off by about as much (profile again to "
                          "measure the factors as they run now)", markup=False)


#: How far the sum of a profile's parts may be from its whole steps before `planner profile` warns.
PARTS_TOLERANCE = 0.10


def print_profile(profile: Profile, details: bool = False) -> None:
    """What a profile measured, in a few lines (`profile_summary`); with `details`, everything: each calibration,
    the collectives' fits, memory, throughput, hosts and K-FAC's tables. Warnings (on stderr) either way."""

    console.print(profile.model.describe(), style="bold")
    if profile.quick:
        err_console.print("note: a quick profile (--quick): fewer repeats and sweeps, so its numbers are noisier and "
                          "the intervals of plans made from it wider; profile without --quick for the plan you keep",
                          markup=False, soft_wrap=True)
    for line in profile_summary(profile):
        console.print(line, markup=False, soft_wrap=True)
    parts = _parts_line(profile)
    if parts is not None and parts[1]:
        err_console.print(parts[0], markup=False, soft_wrap=True)
    if details:
        if parts is not None and not parts[1]:
            console.print(parts[0], markup=False, soft_wrap=True)
        _print_profile_details(profile)


def profile_summary(profile: Profile) -> list[str]:
    """The lines `planner profile` prints: where it measured, the step with its interval, compute against
    communication (one allreduce of every gradient), sigma and kappa, the in-situ calibrations not used, and the
    parameters that went without a gradient in some batches."""
    from planner.costmodel.curves import curve_model  # deferred (start-up)

    link = "" if profile.cluster.link else ", no emulated link"
    lines = [f"measured on {profile.cluster.describe()}{link}, batch {profile.batch_size}/worker, torch "
             f"{profile.torch_version}, {profile.created}"]
    step = profile.step_s or profile.parts_s
    spread = ""
    if profile.steps is not None:
        from planner.spread import LEVEL, statistic_interval  # deferred (start-up)

        low, high = statistic_interval(profile.steps.whole_s)
        spread = f" [{LEVEL:.0%} interval {_ms(low)}-{_ms(high)} over {profile.steps.count} steps]"
    lines.append(f"step {_ms(step)} ms{spread} on each worker, nothing sent: forward {_ms(profile.forward_s)}, "
                 f"backward {_ms(profile.backward_s)}, update {_ms(profile.update_s)} ms; {len(profile.layers)} "
                 "layers")
    allreduce = profile.collectives.get(Collective.ALLREDUCE)
    if allreduce is not None and step > 0:
        size = profile.model.numel * 4  # fp32 gradients
        comm = curve_model(allreduce)(size)
        lines.append(f"communication: one allreduce of all {size / 2**20:,.1f} MiB of gradients takes {_ms(comm)} ms; "
                     f"{step / (step + comm):.0%} compute, {comm / (step + comm):.0%} communication where nothing "
                     "overlaps")
    slow = [f"{name} ({what}) " + ", ".join(f"{value:.2f}{_slowdown_interval(profile, coll, name)} {coll.value}"
                                            for coll, value in measured.items())
            for name, what, measured in (("sigma", "backward with a collective in flight", profile.interference),
                                         ("kappa", "collectives while computing", profile.comm_stretch))
            if measured]
    if slow:
        lines.append(f"interference (each runs 1 + x times slower): {'; '.join(slow)}")
    if profile.in_situ is not None:
        named = [(what, c) for what, c in profile.in_situ.named() if c.use.used or c.modelled_s > 0]
        unused = [f"{what} ({c.use.measured:.2f}x)" for what, c in named if not c.use.used]
        if unused:
            lines.append(f"in-situ calibration: {len(named) - len(unused)} of {len(named)} used; not used (their "
                         f"micro-benchmarks stand in): {', '.join(unused)}")
        elif named:
            lines.append(f"in-situ calibration: all {len(named)} used")
    if profile.kfac is not None:
        lines.append(f"K-FAC: factors, preconditioning and inversion measured for {len(profile.kfac.layers)} layers")
    if profile.unused_params is not None and profile.unused_params.any:
        lines.append(profile.unused_params.summary())
    if profile.errors is not None:
        lines.append(errors_line(profile.errors))
    if profile.topk_left_out is not None:
        lines.append(f"top-k not timed: {profile.topk_left_out.why()}")
    return lines


def error_line(error: PlanError) -> str:
    """The plan's compression error with its interval, and the budget it was kept within."""

    low, high = error.interval
    line = f"compression error {error.predicted:.3g} [{low:.3g}, {high:.3g}] (|C(x) - x|^2 / |x|^2 over the gradient)"
    if error.budget is not None:
        of = f": {error.budget_of} on every layer" if error.budget_of is not None else ""
        line += f", within the budget {error.budget:.3g}{of}"
    return line


def errors_line(errors: CompressionErrors) -> str:
    """Each compressor's error over the whole gradient (every layer sent by it), with its interval over the steps."""
    from planner.spread import LEVEL  # deferred (start-up)

    parts = []
    for c in errors.compressors:
        low, high = errors.interval(c)
        parts.append(f"{c} {errors.uniform(c):.3g} [{low:.3g}, {high:.3g}]")
    return (f"compression error, |C(x) - x|^2 / |x|^2 over the whole gradient with error feedback ({LEVEL:.0%} "
            f"interval over {errors.steps} steps after {errors.warmup} on {errors.ranks} ranks): " + ", ".join(parts))


def layers_frame(profile: Profile) -> pd.DataFrame:
    """The profile's layers as a table in ready order: a row per layer, its parameters counted, and when its
    gradient is ready (`ready_s`, the backward times summed)."""
    import pandas as pd  # deferred (start-up)

    rows = [{**lt.to_dict(), "params": len(lt.params)} for lt in profile.layers]
    df = pd.DataFrame(rows)
    df["ready_s"] = df["backward_s"].cumsum()
    return df


def comm_frame(profile: Profile) -> pd.DataFrame:
    """The profile's collectives as a table: every measured point next to the fit's prediction at its size."""
    import pandas as pd  # deferred (start-up)

    from planner.costmodel.curves import affine  # deferred (start-up)

    rows = []
    for coll, curve in profile.collectives.items():
        for size, t in curve.points:
            pred = affine(curve).cost(size)
            rows.append({"collective": coll.value, "bytes": size, "seconds": t, "fit_s": pred,
                         "rel_err": abs(pred - t) / t if t > 0 else float("nan")})
    return pd.DataFrame(rows)


def _parts_line(profile: Profile) -> tuple[str, bool] | None:
    """How the per-layer times compare with the whole steps, and whether that is a warning (None: not timed)."""

    if profile.parts_scale is not None:
        assert profile.step_s is not None
        line = (f"whole local steps {_ms(profile.step_s)} ms, timed between the hooked ones; the per-layer "
                f"times summed to {_ms(profile.parts_s / profile.parts_scale)} ms and are scaled by "
                f"{profile.parts_scale:.3f} to match")
        if abs(profile.parts_scale - 1) > PARTS_TOLERANCE:
            return (f"warning: {line}: the timing hooks or the machine's noise moved the parts by more than "
                    f"{PARTS_TOLERANCE:.0%}; how the step splits into layers is that uncertain. Profile again with "
                    "more --repeats and --warmup"), True
        return line, False
    if profile.parts_error is not None:
        assert profile.step_s is not None
        line = (f"whole local steps {_ms(profile.step_s)} ms; sum of the parts (forward + per-layer backward + "
                f"update) {_ms(profile.parts_s)} ms, off by {profile.parts_error:.1%}")
        if profile.parts_error > PARTS_TOLERANCE:
            return (f"warning: {line}: predictions from this profile will be off as much; profile again on a "
                    "quieter machine, or with more --repeats and --warmup"), True
        return line, False
    return None


def _print_profile_details(profile: Profile) -> None:
    """Everything a profile measured beyond its summary (`planner profile --verbose`, `planner show --details`)."""
    from planner.costmodel.curves import worst_error  # deferred (start-up)
    from planner.costmodel.measured import MAX_FIT_ERROR  # deferred (start-up)

    if profile.peak_memory:
        phases = ", ".join(f"{name} {gib(b)}" for name, b in profile.peak_memory.items())
        console.print(f"peak memory of the busiest worker, per phase of the profile: {phases}", soft_wrap=True)
    if profile.throughput is not None:
        tp = profile.throughput
        rates = "; ".join(
            f"rank {r}: " + ", ".join(f"{rate:,.0f}" for rate in tp.samples_per_s(r)) for r in range(len(tp.step_s))
        )
        console.print(f"each worker's samples/s at micro-batches {', '.join(map(str, tp.batch_sizes))} (forward and "
                      f"backward alone): {rates}; fastest/slowest {tp.spread:.2f}x")
    if profile.interference:
        slower = ", ".join(f"{sigma:.2f}{_slowdown_interval(profile, coll, 'sigma')} with an {coll.value}"
                           for coll, sigma in profile.interference.items())
        console.print(f"compute while communicating: the backward pass runs 1 + sigma times slower while a "
                      f"collective is in flight, sigma = {slower}")
    if profile.comm_stretch:
        slower = ", ".join(f"{kappa:.2f}{_slowdown_interval(profile, coll, 'kappa')} for an {coll.value}"
                           for coll, kappa in profile.comm_stretch.items())
        console.print(f"communicating while computing: a chain of collectives runs 1 + kappa times slower while the "
                      f"workers run forward and backward passes, kappa = {slower} (dense plans and K-FAC charge "
                      f"the allreduce's on collectives in flight during backward)")
    if profile.pack is not None:
        console.print(f"packing a dense group: {profile.pack.alpha_s * 1e6:.1f} us + "
                      f"{profile.pack.beta_s_per_byte * 1e9:.3f} ns per element (median fit error "
                      f"{profile.pack.fit_error:.1%})")
    if profile.compress is not None:
        comp = profile.compress
        shapes = {row.shapes for row in comp.powersgd}
        ranks = ", ".join(map(str, comp.ranks())) or "none"
        console.print(f"fp16: cast {comp.fp16_cast.beta_s_per_byte * 1e9:.3f} ns and back "
                      f"{comp.fp16_uncast.beta_s_per_byte * 1e9:.3f} ns per element; PowerSGD measured at ranks "
                      f"{ranks} on {len(shapes)} distinct layer shapes")
    if profile.in_situ is not None:
        named = profile.in_situ.named()
        usable = [(what, c) for what, c in named if c.use.used]
        shown = ", ".join(f"{what} {c.use.describe()}" for what, c in usable)
        if usable:
            console.print(f"in real steps (one group per layer, nothing sent), each as a multiple of its "
                          f"micro-benchmark [90% interval]: {shown}", soft_wrap=True)
        for what, c in named:
            if not c.use.used and c.modelled_s > 0:
                pairs = f" over {len(c.samples_s)} samples" if c.samples_s else ""
                again = ", measured twice" if c.attempts > 1 else ""
                console.print(f"{what} in real steps was not used ({c.use.describe()}{pairs}{again}: {c.use.why}); "
                              "its micro-benchmark stands in for it", markup=False, soft_wrap=True)
    table = Table(title="collectives: alpha + beta * bytes, fitted (used where it holds at every point) "
                        "or interpolated")
    for col in ("collective", "alpha us", "bandwidth GB/s", "median fit error", "worst", "model used", "points"):
        table.add_column(col, justify="left" if col == "collective" else "right")
    for coll, curve in profile.collectives.items():
        bw = 1 / curve.beta_s_per_byte / 1e9 if curve.beta_s_per_byte > 0 else float("inf")
        worst = worst_error(curve)
        used = "fit" if worst <= MAX_FIT_ERROR else "interpolated"
        table.add_row(coll.value, f"{curve.alpha_s * 1e6:.1f}", f"{bw:.2f}", f"{curve.fit_error:.1%}",
                      f"{worst:.1%}", used, str(len(curve.points)))
    if profile.hosts is not None:
        h = profile.hosts
        levels = [("allreduce inside a host", h.intra), (f"allreduce across hosts (a 1/{h.per_host} shard)", h.inter),
                  ("hierarchical allreduce", h.hierarchical)]
        for name, level in levels:
            if level is None:
                continue
            curve = level
            bw = 1 / curve.beta_s_per_byte / 1e9 if curve.beta_s_per_byte > 0 else float("inf")
            worst = worst_error(curve)
            used = "fit" if worst <= MAX_FIT_ERROR else "interpolated"
            table.add_row(name, f"{curve.alpha_s * 1e6:.1f}", f"{bw:.2f}", f"{curve.fit_error:.1%}",
                          f"{worst:.1%}", used, str(len(curve.points)))
    console.print(table)
    if profile.hosts is not None:
        console.print(f"{len(profile.hosts.ranks)} hosts of {profile.hosts.per_host}: ranks "
                      + "; ".join(", ".join(map(str, host)) for host in profile.hosts.ranks)
                      + " (bytes on every level are the whole message's)")
        if profile.hosts.topk:
            console.print("top-k merged inside each host: the largest host's union of picks (each worker's top k "
                          "of gradient plus residual), "
                          + ", ".join(f"{t.union_ratio:.2f} k at {t.density:g}" for t in profile.hosts.topk))
    if profile.errors is not None:
        errors = profile.errors
        table = Table(title="compression error per layer (ready order): share of the gradient's energy, and each "
                            "compressor's |C(x) - x|^2 / |x|^2 with error feedback")
        names = [str(c) for c in errors.compressors]
        for col in ("layer", "energy share", "|g| spread", *names):
            table.add_column(col, justify="left" if col == "layer" else "right")
        weights, spread = errors.weights(), errors.grad_spread()
        contraction = {c: errors.contraction(c) for c in names}
        for i, name in enumerate(errors.layers):
            table.add_row(name, f"{weights[i]:.3f}", f"{spread[i]:.2f}", *(f"{contraction[c][i]:.3g}" for c in names))
        console.print(table)
    if profile.kfac is not None:
        kf = profile.kfac
        table = Table(title="K-FAC: factor work per layer (forward order) and inversion against dimension d")
        for col in ("layer", "A dim", "G dim", "A ms", "G ms", "fold ms", "precond eigen ms", "precond inverse ms"):
            table.add_column(col, justify="left" if col == "layer" else "right")
        for lt in kf.layers:
            table.add_row(lt.name, str(lt.a_dim), str(lt.g_dim), _ms(lt.a_compute_s), _ms(lt.g_compute_s),
                          _ms(lt.fold_s), _ms(lt.precondition_eigen_s), _ms(lt.precondition_inverse_s))
        console.print(table)
        for name, dc in (("eigen", kf.eigen), ("inverse", kf.inverse)):
            worst = worst_error(dc)
            used = "fit" if worst <= MAX_FIT_ERROR else "interpolated"
            pts = ", ".join(f"{d}: {_ms(t)}" for d, t in dc.points)
            console.print(f"{name}: alpha {_ms(dc.alpha_s)} ms + {dc.beta_s_per_dim3 * 1e9:.3g} ns * d^3 "
                          f"(median fit error {dc.fit_error:.1%}, worst {worst:.1%}, {used}); "
                          f"measured ms at d = {pts}")
        print_left_out(len(kf.layers), kf.left_out, kf.skip)


def _slowdown_interval(profile: Profile, collective: Collective, which: str) -> str:
    """" [0.81, 1.12]": the interval of sigma or kappa over its pairs resampled, where the profile kept them."""
    import numpy as np  # deferred (start-up)

    from planner.spread import percentile_interval  # deferred (start-up)

    samples = (profile.slowdown_samples or {}).get(collective)
    if samples is None:
        return ""
    rng = np.random.default_rng(0)
    count = len(samples.alone_s if which == "sigma" else samples.pace_alone_s)
    draws = [getattr(samples, which)(rng.integers(0, count, size=count)) for _ in range(500)]
    low, high = percentile_interval(draws)
    return f" [{low:.2f}, {high:.2f}]"


def print_auto(choice: AutoChoice) -> None:
    """The strategies `--strategy auto` solved, their predicted iterations (with intervals where the noise was
    weighed) beside DDP and its hooks, and which it kept."""
    from planner.strategies.auto import ddp_predictions  # deferred (start-up)

    verdict = choice.plan.verdict
    ddp = ({name: v[0] for name, v in verdict.variants.items()} if verdict is not None
           else ddp_predictions(choice.candidates, choice.beyond_budget))
    reference = ddp.get("ddp")
    spread = choice.plan.intervals
    table = Table(title="--strategy auto: every allowed way of sending, solved exactly, beside DDP and its hooks "
                        "(predicted iteration)")
    columns = ("candidate", "iteration ms", *((f"{spread.level:.0%} interval ms",) if spread else ()), "vs ddp", "")
    for col in columns:
        table.add_column(col, justify="left" if col in ("candidate", "") else "right")

    def ratio(seconds: float) -> str:
        return "" if reference is None else f"{reference / seconds:.2f}x"

    instead = kept_ddp(choice)
    for name, plan in choice.candidates.items():
        best = plan is choice.plan
        interval = () if spread is None else (interval_ms(plan.intervals.rows.get("plan") if plan.intervals
                                                          else None),)
        note = "" if not best else "best plan, not kept" if instead is not None else "kept"
        if name in choice.plan.runners_up:
            note = "runner-up: races beside the plan (`planner race`)"
        table.add_row(name, _ms(plan.predicted.iteration_s), *interval, ratio(plan.predicted.iteration_s),
                      note, style="bold" if best and instead is None else None)
    for name, seconds in ddp.items():
        interval = () if verdict is None else (interval_ms(verdict.variants[name][1:]),)
        note = ""
        if choice.ddp_faster is not None and choice.ddp_faster[0] == name:
            note = "kept: faster than every plan"
        elif verdict is not None and verdict.keep == name:
            note = "kept: the plan is not faster beyond the noise"
        elif verdict is not None and name in verdict.beyond_budget:
            note = "beyond the error budget: not weighed"
        table.add_row(name, _ms(seconds), *interval, ratio(seconds), note,
                      style="bold" if name == instead else "dim")
    console.print(table)
    if instead is None:
        console.print(choice.reason, soft_wrap=True)
    else:  # one thing said: what is kept and how to run it; the best plan only as what it was weighed against
        from planner.strategies.intervals import ddp_label  # deferred (start-up)

        why = "no plan is faster beyond the noise" if verdict is not None else "no plan is predicted faster"
        console.print(f"kept {ddp_label(instead)}: {why}; run it: {ddp_how(instead)}", style="bold", markup=False,
                      soft_wrap=True)
        console.print(f"the best plan, not kept: {choice.reason.removeprefix('kept ')}", markup=False,
                      soft_wrap=True)
    if choice.rule:
        console.print(choice.rule, markup=False, soft_wrap=True)
    if choice.way is not None and instead is None:
        console.print(choice.way.line, style="bold", soft_wrap=True)


def kept_ddp(choice: AutoChoice) -> str | None:
    """The DDP variant ("ddp", "ddp+C") `--strategy auto` keeps instead of its best plan (the plan's verdict, or
    without samples the variant predicted faster than every plan); None when it keeps the plan."""

    verdict = choice.plan.verdict
    if verdict is not None:
        return None if verdict.keep == "plan" else verdict.keep
    return None if choice.ddp_faster is None else choice.ddp_faster[0]


def ddp_how(variant: str) -> str:
    """How to run a DDP variant of the verdict ("ddp", "ddp+fp16", "ddp+powersgd:4", "ddp+topk:0.01"), in code."""
    if variant == "ddp":
        return "DDP as it is, with no communication hook"
    compressor = Compressor.parse(variant.removeprefix("ddp+"))
    match compressor.kind:
        case CompressorKind.FP16:
            return "ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)"
        case CompressorKind.POWERSGD:
            return (f"ddp.register_comm_hook(powerSGD_hook.PowerSGDState(None, matrix_approximation_rank="
                    f"{compressor.rank}), powerSGD_hook.powerSGD_hook)")
        case CompressorKind.TOPK:
            return (f"ddp.register_comm_hook(planner.runtime.TopkHookState({compressor.density:g}), "
                    "planner.runtime.topk_hook)")
        case _:
            return f"DDP with its {compressor} hook"


def print_mixed_groups(plan: Plan, profile: Profile) -> None:
    """Which compressor each group of a mixed plan got, and what switching it alone would cost."""
    from planner.strategies.mixed_plan import explain  # deferred (start-up)

    reasons = explain(plan, profile)
    table = Table(title="the compressor of each group (ready order), and the best other one: the predicted iteration "
                        "were that group alone sent by it")
    for col in ("#", "layers", "elements", "sent as", "next best", "iteration ms", "change ms"):
        table.add_column(col, justify="right" if col in ("#", "elements", "iteration ms", "change ms") else "left")
    base = plan.predicted.iteration_s
    for r in reasons:
        layers = ", ".join(r.layers) if len(r.layers) <= 3 else f"{r.layers[0]} ... {r.layers[-1]} ({len(r.layers)})"
        if r.alternatives:
            name, t = min(r.alternatives.items(), key=lambda kv: kv[1])
            table.add_row(str(r.index), layers, f"{r.numel:,}", r.label, name, _ms(t),
                          f"{(t - base) * 1e3:+.2f}")
        else:
            table.add_row(str(r.index), layers, f"{r.numel:,}", r.label, "-", "", "")
    console.print(table)


def print_runners_up(plan: Plan) -> None:
    """The plan's runners-up, each with its predicted step (a K-FAC plan's: its average K-FAC step): the finalists
    that race beside it."""

    def step_s(other: Plan) -> float:
        if other.kfac is not None and other.kfac.predicted is not None:
            return other.kfac.predicted.step_s
        return other.predicted.iteration_s

    if plan.runners_up:
        listed = ", ".join(f"{name} {_ms(step_s(other))} ms" for name, other in plan.runners_up.items())
        console.print(f"runners-up (they race beside the plan, `planner race`): {listed} predicted", markup=False,
                      soft_wrap=True)


def print_model_error(plan: Plan, error: ModelError | None) -> None:
    """The plan's and DDP's variants' predicted ratios to DDP, each with the model's error (`error`: conformal, from
    the races logged), or a line saying it is not yet known."""
    ddp = plan.baselines.get(DDP_ROW)
    if ddp is None:
        return
    if error is None:
        console.print("the model's error on ratios to DDP: not yet known (too few races logged; `planner race` "
                      "logs each)", markup=False, soft_wrap=True)
        return
    rows = {"plan": plan.predicted.iteration_s, VIA_DDP_ROW: getattr(plan.baselines.get(VIA_DDP_ROW), "iteration_s",
                                                                     None)}
    if plan.verdict is not None:
        rows.update({name: v[0] for name, v in plan.verdict.variants.items()
                     if name != DDP_ROW and name not in plan.verdict.beyond_budget})
    parts = []
    for name, seconds in rows.items():
        if seconds is not None:
            ratio = seconds / ddp.iteration_s
            low, high = error.interval(ratio)
            parts.append(f"{name} {ratio:.3f} [{low:.3f}, {high:.3f}]")
    console.print(f"predicted ratio to DDP, with {error.describe()}: {'; '.join(parts)}", markup=False,
                  soft_wrap=True)


def print_race(record: RaceRecord, *, summary: bool = True, model_error: ModelError | None = None,
               calibrated: bool = False) -> None:
    """A race's arms (simplest first) with their measured and predicted ratios to DDP, then (`summary`) the line
    that says what was kept. With `model_error` (calibrated on the races before this one), each predicted ratio
    carries its conformal interval, and a line says how many of this race's measured ratios fell inside; without
    one, `calibrated` says that the model's error is not yet known (a race just run against the log)."""
    from planner.strategies.race_rule import race_summary, ratio_interval  # deferred (start-up)

    table = Table(title=f"race of {record.raced}: {record.rounds} rounds of {record.block} steps per arm, margin "
                        f"{record.margin:.0%}, alpha {record.alpha:g} (block time = mean of the slowest rank's "
                        "steps; ratios are medians over the rounds both ran)")
    to = record.reference
    predicted = f"predicted / {to}" + ("" if model_error is None else f" [{model_error.level:.0%}, model error]")
    for column in ("arm", "rounds", "median block", f"measured / {to}", "interval", predicted, "beaten by"):
        table.add_column(column, justify="left" if column in ("arm", "beaten by") else "right")
    inside = []
    for arm in record.arms:
        guess = "-" if arm.predicted_ratio is None else f"{arm.predicted_ratio:.3f}"
        if model_error is not None and arm.predicted_ratio is not None and arm.name != record.reference:
            low, high = model_error.interval(arm.predicted_ratio)
            guess += f" [{low:.3f}, {high:.3f}]"
            if arm.ratio_to_ddp is not None:
                inside.append(low <= arm.ratio_to_ddp <= high)
        table.add_row(
            arm.name + (" (kept)" if arm.name == record.kept else ""), str(arm.rounds),
            _ms(arm.median_block_s), "-" if arm.ratio_to_ddp is None else f"{arm.ratio_to_ddp:.3f}",
            ratio_interval(arm.interval), guess, arm.beaten_by or "")
    console.print(table)
    if model_error is not None:
        console.print(f"{model_error.describe()}; {sum(inside)} of {len(inside)} measured ratios here fall inside",
                      markup=False, soft_wrap=True)
    elif calibrated:
        console.print("the model's error on ratios: not yet known (too few races logged for a conformal bound)",
                      markup=False, soft_wrap=True)
    if summary:
        console.print(race_summary(record), markup=False, soft_wrap=True)
