"""`planner demo`: the main job, end to end: profile, solve (`--strategy auto`), write the plans, and race the kept
plan's finalists to settle by measurement what to keep (with `--bench`, a bench of every variant before the race)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from planner.commands.common import (
    COMPRESSORS_HELP,
    LINK_HELP,
    Command,
    _add_hosts,
    _add_slowdown,
    _link_rate,
    _positive,
    _positive_float,
    add_race_log,
    allowed_hooks,
    check_hosts,
    intra_linked,
    race_log_path,
)
from planner.commands.printing import (
    print_auto,
    print_bench,
    print_mixed_groups,
    print_plan,
    print_profile,
    print_race,
)
from planner.console import console
from planner.contracts.jsonio import RUNS, ensure_folder
from planner.contracts.plan import VIA_DDP_ROW
from planner.types import PlannerError, Strategy

#: The network `planner demo` emulates by default: 1 Gbit/s Ethernet, the setting of the published work.
DEMO_LINK = "1gbit"


class DemoCommand(Command):
    name = "demo"
    help = ("the main job: profile, solve (--strategy auto: dense, top-k and mixed), write plans, race the finalists "
            "to decide")

    def configure(self, parser: argparse.ArgumentParser) -> None:
        from planner.models import DEFAULT_MODEL  # deferred (start-up)

        parser.add_argument("--model", default=DEFAULT_MODEL)
        parser.add_argument("--nproc", type=_positive, default=2)
        parser.add_argument("--compressors", default="all", metavar="LIST|PRESET",
                            help=f"what the plans may send: {COMPRESSORS_HELP.removesuffix('; default light')}; "
                                 "default all")
        parser.add_argument("--bench", action="store_true",
                            help="bench DDP, its hooks and the plans (median step times beside their predictions) "
                                 "before the race")
        parser.add_argument("--steps", type=_positive, default=None, help="--bench: steps per variant (default 20, "
                                                                             "--quick 10)")
        parser.add_argument("--race-time", type=_positive_float, default=None, metavar="S",
                            help="seconds the last step races the plan's finalists (default 45, --quick 15); then "
                                 "the simplest arm not beaten is kept")
        parser.add_argument("--plans-dir", type=Path, default=RUNS / "plans",
                            help="where the plans are written")
        parser.add_argument("--profiles-dir", type=Path, default=RUNS / "profiles",
                            help="where the profile is written")
        parser.add_argument("--link", default=DEMO_LINK, metavar="RATE|none",
                            help=f"{LINK_HELP}; default {DEMO_LINK} where this process may make network namespaces, "
                                 "else loopback; none: loopback")
        parser.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=False,
                            help="the profile also calibrates the runtime's work in real steps (`planner profile "
                                 "--calibrate`: closer absolute predictions, a longer profile); by default not: the "
                                 "predictions choose the finalists, and the race decides among them")
        parser.add_argument("--quick", action="store_true",
                            help="profile with `planner profile --quick` (about a minute for a model like the MLP; "
                                 "wider intervals) and bench fewer steps")
        add_race_log(parser, "where the demo's race is added and the model's error calibrated from the races before "
                             "it")
        _add_hosts(parser)
        _add_slowdown(parser)

    def run(self, args: argparse.Namespace) -> int:
        from planner.models import build_workload  # deferred (start-up)
        from planner.sessions.bench import (  # deferred (start-up)
            BenchConfig,
            auto_tag,
            plan_labels,
            run_bench,
            via_ddp_notes,
        )
        from planner.sessions.profile import (  # deferred (start-up)
            DEFAULT_EFFORT,
            QUICK_EFFORT,
            PlanScope,
            ProfileConfig,
            run_profile,
        )
        from planner.sessions.race import (  # deferred (start-up)
            RaceConfig,
            beyond_budget,
            log_race,
            run_race,
            with_race,
        )
        from planner.strategies.auto import ddp_predictions, solve_auto  # deferred (start-up)
        from planner.strategies.budget import DEFAULT_BUDGETS  # deferred (start-up)
        from planner.strategies.mixed_plan import parse_compressors  # deferred (start-up)
        from planner.strategies.model_error import ModelError  # deferred (start-up)
        from planner.strategies.race_rule import race_summary, too_short  # deferred (start-up)

        if args.steps is not None and not args.bench:
            raise PlannerError("--steps applies with --bench only (the race runs until its rule or --race-time "
                               "decides)")
        compressors = parse_compressors(args.compressors)
        build_workload(args.model)  # an unknown or broken model is one line, before a link or a worker starts
        if args.slowdown is not None:
            args.slowdown.check_world_size(args.nproc)
        check_hosts(args.hosts, args.nproc)
        link = intra_linked(self._demo_link(args.link), args.intra_link, args.hosts)
        ensure_folder(args.profiles_dir, "profiles folder")
        ensure_folder(args.plans_dir, "plans folder")
        stem = args.model.replace(":", "_").replace("/", "_")
        where = "".join([f"-{link.text}" if link is not None else "",
                         f"-{link.intra.text}" if link is not None and link.intra is not None else "",
                         f"-{args.hosts}h" if args.hosts else ""])
        prof_path = args.profiles_dir / f"{stem}-{args.nproc}w{where}.json"
        on = f"behind an emulated {link.label} link" if link is not None else "over loopback"
        if args.hosts:
            on = f"on {args.hosts} emulated hosts, {'between them ' if link is not None else ''}{on}"
        parts = 4 if args.bench else 3
        console.rule(f"1/{parts} profile {args.model} on {args.nproc} workers {on}")
        effort = QUICK_EFFORT if args.quick else DEFAULT_EFFORT
        # Whatever the effort sweeps, the profile measures every PowerSGD rank and top-k density the compressors name
        # (--quick alone measures rank 4 and 1%: the default "all" names ranks 1 and 2 too). It times top-k only
        # where the solve below could keep it: within the default error budget (`scope`).
        ranks = sorted({*effort.powersgd_ranks, *(c.rank for c in compressors if c.rank is not None)})
        densities = sorted({*effort.densities, *(c.density for c in compressors if c.density is not None)})
        profile = run_profile(ProfileConfig.at(effort, quick=args.quick, model=args.model, output=prof_path,
                                               nproc=args.nproc, link=link, slowdown=args.slowdown, hosts=args.hosts,
                                               powersgd_ranks=tuple(ranks), densities=tuple(densities),
                                               in_situ=args.calibrate,
                                               scope=PlanScope(compressors=compressors, budget=DEFAULT_BUDGETS[0])))
        profile.save(prof_path)
        print_profile(profile)
        console.print(f"wrote profile {prof_path}")
        if (left_out := profile.topk_left_out) is not None and left_out.compressors:
            compressors = tuple(c for c in compressors if c not in left_out.compressors)
            console.print(f"note: the solve leaves {', '.join(map(str, left_out.compressors))} out (not timed, as "
                          "above)", markup=False, soft_wrap=True)
        console.rule(f"2/{parts} solve: --strategy auto over {', '.join(map(str, compressors))}")
        choice = solve_auto(profile, compressors, source=str(prof_path))
        kept_path = None
        for name, plan in choice.candidates.items():
            kind = plan.strategy.value + (f"{plan.density:g}" if plan.strategy is Strategy.TOPK else "")
            path = args.plans_dir / f"{stem}-{args.nproc}w{where}-{kind}.json"
            plan.save(path)
            console.print(f"wrote plan {path} ({name})")
            kept_path = path if plan is choice.plan else kept_path
        print_auto(choice)
        unweighed = choice.plan.verdict is None
        print_plan(choice.plan, ddp=ddp_predictions(choice.candidates, choice.beyond_budget) if unweighed else None)
        if choice.plan.strategy is Strategy.MIXED:
            print_mixed_groups(choice.plan, profile)
        dense = choice.candidates.get("dense")
        plans = (choice.plan,) if dense is None or dense is choice.plan else (dense, choice.plan)
        # The plan auto kept is named by what it sends ("plan auto (fp16)"), the dense plan beside it by its strategy.
        labels = tuple(plan_labels(plans, tags=[None if p is not choice.plan else auto_tag(p) for p in plans]))
        if args.bench:
            console.rule("3/4 bench: DDP, PyTorch's DDP hooks and the plans")
            steps = args.steps or (10 if args.quick else 20)
            for note in via_ddp_notes(plans, labels):
                console.print(f"note: {note}", markup=False, soft_wrap=True)
            results = run_bench(BenchConfig(plans=plans, model=args.model, nproc=args.nproc, steps=steps,
                                            link=link, slowdown=args.slowdown, hosts=args.hosts, labels=labels))
            assert results is not None
            print_bench(results, as_json=False, title=f"bench {on}: median step time (slowest rank per step)")
            way = choice.way.way if choice.way is not None else None
            console.print(verdict_against_bench(choice.plan, results, labels[-1], way=way), soft_wrap=True)
        console.rule(f"{parts}/{parts} race: the kept plan's finalists in real steps, until one is settled")
        if beyond := sorted(beyond_budget((choice.plan,))):
            console.print(f"note: {', '.join(beyond)} do not race: their error is beyond the plan's budget",
                          markup=False, soft_wrap=True)
        # DDP's hooks of what the plan was allowed to send, as `planner race` races them: with --compressors light,
        # fp16's alone.
        record = run_race(RaceConfig(plans=(choice.plan,), model=args.model, nproc=args.nproc, link=link,
                                     peers=allowed_hooks(choice.plan), slowdown=args.slowdown, hosts=args.hosts,
                                     labels=labels[-1:],
                                     race_time_s=args.race_time or (15.0 if args.quick else 45.0)))
        assert record is not None
        log = race_log_path(args.race_log)
        print_race(record, summary=False, model_error=ModelError.of(log_race(log, choice.plan, record, link).races),
                   calibrated=True)
        if (short := too_short(record)) is not None:
            console.print(short, markup=False, soft_wrap=True)
        if kept_path is not None:
            raced = with_race(choice.plan, record)
            raced.save(kept_path)
            promoted = (f"; its plan is now {record.kept}, the one the race kept"
                        if raced.groups != choice.plan.groups else "")
            console.print(f"recorded the race in {kept_path}{promoted}, and in the race log {log}", markup=False,
                          soft_wrap=True)
        console.print(race_summary(record), style="bold", markup=False, soft_wrap=True)
        return 0

    @staticmethod
    def _demo_link(text: str) -> Any:
        """The demo's link: the one asked for; by default DEMO_LINK where the privilege is there, else loopback."""
        from planner.platform.link import parse_rate, privilege_problem  # deferred (start-up)

        if text.lower() == "none":
            return None
        if text != DEMO_LINK:
            try:
                return _link_rate(text)
            except argparse.ArgumentTypeError as exc:
                raise PlannerError(f"--link {exc}") from None
        problem = privilege_problem()
        if problem is not None:
            console.print(f"no emulated {DEMO_LINK} link: {problem}; falling back to loopback, where compute "
                          "dominates and plans matter little (run as root to see the slow network)", style="yellow")
            return None
        return parse_rate(DEMO_LINK)


def verdict_against_bench(plan: Any, results: list[Any], label: str | None = None, *, way: str | None = None) -> str:
    """One line: what the demo kept (the plan, or a DDP variant, from the plan's verdict), the way to run the plan
    (`way`: `planner.strategies.via_ddp.DDP_WAY` inside DDP, else in GradientExchange; None: not said) and what
    the bench then measured for it, run that way, and for the alternative, with the predictions beside them.
    `label`: the plan's row in the bench (default the bench's name of it alone, `plan_labels`)."""
    from planner.sessions.bench import plan_labels, via_ddp_label  # deferred (start-up)
    from planner.strategies.intervals import ddp_label  # deferred (start-up)
    from planner.strategies.via_ddp import DDP_WAY  # deferred (start-up)

    measured = {r.name: r for r in results}
    label = label or plan_labels([plan])[0]
    verdict = plan.verdict
    kept = "the plan" if verdict is None or verdict.keep == "plan" else ddp_label(verdict.keep)
    inside = way == DDP_WAY and VIA_DDP_ROW in plan.baselines
    if kept == "the plan" and way is not None:
        kept += ", run via DDP (PlanHook)" if inside else ", run in GradientExchange"
    mine = measured.get(via_ddp_label(label) if inside else label)
    if verdict is None or mine is None:
        return f"kept {kept} (its noise not weighed: the profile has no samples)" if verdict is None else f"kept {kept}"
    against = measured.get(verdict.against)
    predicted = plan.baselines[VIA_DDP_ROW] if inside else plan.predicted
    line = (f"kept {kept}. Measured: the plan{' via DDP' if inside else ''} {mine.median_s * 1e3:,.2f} ms (predicted "
            f"{predicted.iteration_s * 1e3:,.2f})")
    if against is not None:
        line += (f", {verdict.against} {against.median_s * 1e3:,.2f} ms (predicted "
                 f"{verdict.against_s * 1e3:,.2f}): the plan ran {against.median_s / mine.median_s:.2f}x as fast")
    lossy = sorted({str(plan.compressor_of(g)) for g in plan.groups if plan.compressor_of(g).lossy})
    if lossy:
        line += (f"; it sends {', '.join(lossy)}: what that costs in samples to reach a loss was not measured here "
                 "(`planner bench --target-loss L` measures it)")
    return line
