"""`planner solve`: a plan from a profile, for each `--strategy`, and its comparison with the baselines."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

from planner.commands.common import (
    ABS,
    CLUSTER_HELP,
    COMPRESSORS_HELP,
    KFAC,
    Command,
    _density,
    _positive,
    add_race_flags,
    check_race_request,
    race_log_path,
    race_plan_file,
)
from planner.commands.printing import (
    error_line,
    print_auto,
    print_mixed_groups,
    print_model_error,
    print_plan,
    print_runners_up,
)
from planner.console import console
from planner.contracts.abs_section import TRIGGERS
from planner.contracts.jsonio import check_output_path
from planner.contracts.plan import SELECTORS
from planner.types import Compressor, InverseMethod, PlannerError, Strategy

if TYPE_CHECKING:
    from planner.strategies.solve import SolveRequest

#: `--strategy auto`: every allowed way of sending solved, the plan predicted fastest kept.
AUTO = "auto"


class SolveCommand(Command):
    name = "solve"
    help = "turn a profile into an optimal plan and compare it with the baselines"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("profile", type=Path, help="profile file from `planner profile`")
        parser.add_argument("--strategy", choices=[*(s.value for s in Strategy), AUTO, KFAC, ABS],
                            default=Strategy.DENSE.value,
                            help="gradient exchange: dense, topk, mixed (a compressor per group, from --compressors), "
                                 "auto (each of those the compressors allow, the fastest kept); kfac: dense gradients "
                                 "plus a K-FAC section; abs: ABS-SGD for workers of different speeds (needs "
                                 "--global-batch)")
        parser.add_argument("--density", type=_density, default=None, help="top-k density (default 0.01)")
        parser.add_argument("--compressors", default=None, metavar="LIST|PRESET",
                            help=f"--strategy mixed and auto: {COMPRESSORS_HELP}")
        parser.add_argument("--error-budget", default=None, metavar="NUMBER|COMPRESSOR",
                            help="--strategy mixed and auto: keep the fastest plan whose compression error (as the "
                                 "profile measured it, the contraction of the whole gradient) is at most this: a "
                                 "number, or a compressor whose error with every layer sent by it is the budget "
                                 "(e.g. powersgd:4; allowed too, where --compressors is not given), or none; "
                                 "default: none for mixed, and for auto the error of fp16 on every layer (measured "
                                 "to train like dense)")
        parser.add_argument("--trials", type=Path, default=None, metavar="FILE",
                            help="--strategy auto: the trials file of `planner trial` on this profile; the plan is "
                                 "kept among the compressors that trained like dense there, within the error of the "
                                 "loosest of them (default --compressors: dense, fp16 and those)")
        # Checked in run(), not by argparse `choices`, so a bad name is one line (no usage block).
        parser.add_argument("--selector", default="auto", metavar="{auto,exact,sampled}",
                            help="top-k selector: exact torch.topk, sampled threshold, or auto (default): the one "
                                 "predicted faster from the profile's measurements")
        kfac = parser.add_argument_group("K-FAC (--strategy kfac)")
        kfac.add_argument("--method", choices=[m.value for m in InverseMethod], default=InverseMethod.EIGEN.value,
                          help="eigendecomposition (default) or damped inverse of each factor")
        kfac.add_argument("--factor-update-steps", type=_positive, default=None,
                          help="steps between factor updates (default 1)")
        kfac.add_argument("--inv-update-steps", type=_positive, default=None,
                          help="steps between inverse updates, a multiple of the factor interval (default 10)")
        kfac.add_argument("--placement-solver", choices=["cp-sat", "ilp-cbc"], default="cp-sat",
                          help="exact placement model in OR-Tools CP-SAT (default) or pulp/CBC")
        parser.add_argument("--time-limit", type=float, default=None,
                            help="seconds the solve of a plan may take, its baselines' searches and bounds included "
                                 "(default: 1 for mixed and each plan of auto, 10 for top-k choosing its way across "
                                 "hosts, none for dense and top-k otherwise; K-FAC: its placement, default 2); past "
                                 "them the best plan found is kept, never slower than a baseline it prints, and "
                                 "recorded as not proven optimal, with its gap to the lower bound")
        abs_sgd = parser.add_argument_group("ABS-SGD (--strategy abs)")
        abs_sgd.add_argument("--global-batch", type=_positive, default=None,
                             help="samples per round to aim at, summed over the workers (the synchronous "
                                  "baselines split it per iteration)")
        abs_sgd.add_argument("--trigger", choices=TRIGGERS, default=None,
                             help="how rounds end: 'batch' (default) rounds of --global-batch split by measured "
                                  "speed; 'exchange' once the previous exchange is done (the paper's rule: rounds "
                                  "grow to hide a slow exchange, up to 1.25x); 'best' whichever is predicted faster")
        parser.add_argument("--route", choices=["best", "flat", "hierarchical"], default="best",
                            help="--strategy dense, topk or mixed on a profile of several hosts: send each "
                                 "group flat or hierarchically, whichever makes the step fastest (best, the "
                                 "default; mixed plans choose the way with each group's compressor), or every "
                                 "group one way")
        parser.add_argument("--cluster", default=None, metavar="SPEC", help=CLUSTER_HELP)
        parser.add_argument("-o", "--output", type=Path, required=True, help="plan file to write")
        race = parser.add_argument_group("the race (--race)")
        race.add_argument("--race", action="store_true",
                          help="then race the plan's finalists in real steps on the workers and network the profile "
                               "measured (gradient plans: DDP, its hooks, the plan both ways, its runners-up; K-FAC: "
                               "the plan's layout and kfac-pytorch's), and record which to keep in the plan file "
                               "(`planner race`)")
        add_race_flags(race)

    def run(self, args: argparse.Namespace) -> int:
        # Deferred: every command's module is imported at start-up, and only this one needs the strategies.
        from planner.contracts.profile import Profile  # deferred (start-up)
        from planner.contracts.race_log import RaceLog  # deferred (start-up)
        from planner.platform.link import recorded_link  # deferred (start-up)
        from planner.strategies.model_error import ModelError  # deferred (start-up)
        from planner.strategies.solve import solve  # deferred (start-up)

        request = _request(args)
        check_output_path(args.output, "plan")
        solved = solve(Profile.load(args.profile), request, source=str(args.profile))
        for note in solved.notes:
            console.print(note)
        if solved.auto is not None:
            print_auto(solved.auto)
        plan = solved.plan
        plan.save(args.output)  # once DDP's rows are predicted: one the profile cannot predict refuses the plan
        print_plan(plan, ddp=solved.ddp, samples=solved.auto.samples if solved.auto is not None else "",
                   factors=solved.auto.factors if solved.auto is not None else None)
        if plan.error is not None:
            console.print(error_line(plan.error), markup=False, soft_wrap=True)
        if plan.strategy is Strategy.MIXED:
            print_mixed_groups(plan, solved.profile)
        print_runners_up(plan)
        if plan.kfac is None and plan.abs is None:
            print_model_error(plan, ModelError.of(RaceLog.load(race_log_path(args.race_log)).races))
        kept = plan.verdict.keep if plan.verdict is not None else "plan"
        if args.race:
            console.print(f"wrote plan {args.output}; now the race decides what to keep, by measurement",
                          markup=False, soft_wrap=True)
            hosts = plan.cluster.host_count if plan.cluster.host_count > 1 else None
            return race_plan_file(args.output, args, link=recorded_link(plan.cluster.link), hosts=hosts)
        console.print(f"wrote plan {args.output}" + ("" if kept == "plan" else
                      f" (the verdict keeps {kept}: the file holds the best plan, for reference; `planner race` "
                      "settles it by measurement)"), markup=False, soft_wrap=True)
        return 0


def _request(args: argparse.Namespace) -> SolveRequest:
    """The solve the arguments ask for, each flag checked against the strategy it applies to (one line each)."""
    from planner.contracts.trials import Trials  # deferred (start-up)
    from planner.strategies.budget import BY_DEFAULT, parse_error_budget  # deferred (start-up)
    from planner.strategies.mixed_plan import parse_compressors  # deferred (start-up)
    from planner.strategies.solve import SolveRequest  # deferred (start-up)

    is_kfac, is_abs, is_auto = args.strategy == KFAC, args.strategy == ABS, args.strategy == AUTO
    is_mixed = args.strategy == Strategy.MIXED.value
    if is_abs and args.global_batch is None:
        raise PlannerError("--strategy abs needs --global-batch B: the samples per round, summed over the "
                           "workers (e.g. the batch you train with now)")
    if not is_abs and args.global_batch is not None:
        raise PlannerError("--global-batch applies to --strategy abs only")
    if not is_abs and args.trigger is not None:
        raise PlannerError("--trigger applies to --strategy abs only")
    if is_abs and args.cluster is not None:
        raise PlannerError("--cluster does not apply to --strategy abs: its plan needs each worker's measured "
                           "speed; profile the cluster itself (with --slowdown to emulate slower workers)")
    if not is_kfac:
        kfac_only = [("--factor-update-steps", args.factor_update_steps),
                     ("--inv-update-steps", args.inv_update_steps)]
        given = [flag for flag, value in kfac_only if value is not None]
        if given:
            raise PlannerError(f"{given[0]} applies to --strategy kfac only")
    if args.route != "best" and args.strategy not in (Strategy.DENSE.value, Strategy.TOPK.value,
                                                      Strategy.MIXED.value):
        raise PlannerError("--route applies to --strategy dense, topk and mixed only")
    if args.compressors is not None and not (is_mixed or is_auto):
        raise PlannerError("--compressors applies to --strategy mixed and auto only")
    if args.error_budget is not None and not (is_mixed or is_auto):
        raise PlannerError("--error-budget applies to --strategy mixed and auto only")
    check_race_request(args, abs_plan=is_abs, where="the workers the profile measured")
    if args.trials is not None and not is_auto:
        raise PlannerError("--trials applies to --strategy auto only")
    if args.trials is not None and args.error_budget is not None:
        raise PlannerError("give --trials or --error-budget, not both: the trials set the budget")
    error_budget = (parse_error_budget(args.error_budget) if args.error_budget is not None
                    else BY_DEFAULT if is_auto else None)
    if args.time_limit is not None and is_abs:
        raise PlannerError("--time-limit does not apply to --strategy abs")
    if args.time_limit is not None and not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise PlannerError(f"`--time-limit > 0` must hold, but got {args.time_limit}")
    if args.density is not None and args.strategy != Strategy.TOPK.value:
        hint = "; name top-k in --compressors instead (e.g. topk:0.01)" if is_mixed or is_auto else ""
        raise PlannerError(f"--density applies to --strategy topk only{hint}")
    if args.selector not in ("auto", *SELECTORS):
        raise PlannerError(f"--selector must be one of auto, {', '.join(SELECTORS)}, but got {args.selector!r}")
    compressors = None
    if is_mixed or is_auto:
        compressors = parse_compressors("light" if args.compressors is None else args.compressors)  # "" refused
        if args.compressors is None and isinstance(error_budget, Compressor):  # light, and the budget's own
            compressors = tuple(dict.fromkeys((*compressors, error_budget)))
    trials = None
    if args.trials is not None:
        trials = Trials.load(args.trials)
        if args.compressors is None:  # light, and every compressor the trials tried
            compressors = tuple(dict.fromkeys((*(compressors or ()), *trials.compressors)))
    topk_allowed = args.strategy == Strategy.TOPK.value or any(c.kind.value == "topk" for c in compressors or ())
    if args.selector != "auto" and not topk_allowed:
        raise PlannerError("--selector applies to top-k plans only (--strategy topk, or topk:D in --compressors)")
    return SolveRequest(
        strategy=args.strategy, density=(args.density or 0.01) if args.strategy == Strategy.TOPK.value else None,
        compressors=compressors, preset=(args.compressors or "").strip().lower(), error_budget=error_budget,
        trials=trials, selector=None if args.selector == "auto" else args.selector, route=args.route,
        time_limit_s=args.time_limit, cluster=args.cluster, method=InverseMethod(args.method),
        factor_update_steps=args.factor_update_steps, inv_update_steps=args.inv_update_steps,
        placement_solver=args.placement_solver, global_batch=args.global_batch, trigger=args.trigger)
