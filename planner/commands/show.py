"""`planner show`: a plan's comparison table (and its groups), a profile's summary (and with --details, all it
measured), or a trials file's table (`planner trial`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from planner.commands.common import Command
from planner.commands.printing import error_line, print_plan, print_profile, print_race, print_runners_up
from planner.console import console
from planner.contracts.jsonio import read_json
from planner.contracts.kfac_section import factor_name
from planner.contracts.plan import PLAN_KIND, Plan
from planner.types import FactorKind, PlannerError


class ShowCommand(Command):
    name = "show"
    help = "print a plan's comparison table, a profile's summary, or a trials file's table"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("file", type=Path, help="a plan, profile or trials file")
        parser.add_argument("--groups", action="store_true", help="also list a plan's groups")
        parser.add_argument("--details", action="store_true",
                            help="a profile: everything it measured (each calibration, the collectives' fits, memory, "
                                 "throughput, hosts, K-FAC), not only its summary")

    def run(self, args: argparse.Namespace) -> int:
        from planner.contracts.profile import PROFILE_KIND, Profile  # deferred (start-up)
        from planner.contracts.trials import TRIALS_KIND, Trials  # deferred (start-up)

        kind = read_json(args.file, "plan, profile or trials").get("kind")
        if kind == TRIALS_KIND and (args.groups or args.details):
            flag, applies = ("--groups", "a plan") if args.groups else ("--details", "a profile")
            raise PlannerError(f"{flag} applies to {applies}; a trials file's table is all of it")
        if kind == PLAN_KIND and args.details:
            raise PlannerError("--details applies to a profile; a plan's table is all of it (--groups lists its "
                               "groups)")
        if kind == PROFILE_KIND and args.groups:
            raise PlannerError("--groups applies to a plan; a profile shows everything with --details")
        if kind == PLAN_KIND:
            plan = Plan.load(args.file)
            print_plan(plan)
            print_runners_up(plan)
            if plan.error is not None:
                console.print(error_line(plan.error), markup=False, soft_wrap=True)
            if plan.race is not None:
                print_race(plan.race)
            if args.groups:
                table = Table(title="groups in ready order")
                for col in ("#", "layers", "elements", "k"):
                    table.add_column(col)
                for i, g in enumerate(plan.groups):
                    layers = ", ".join(g.layers) if len(g.layers) <= 4 else f"{g.layers[0]} ... {g.layers[-1]}"
                    table.add_row(str(i), f"{len(g.layers)}: {layers}", f"{g.numel:,}", str(g.k or "-"))
                console.print(table)
                if plan.kfac is not None:
                    print_kfac_layout(plan)
        elif kind == PROFILE_KIND:
            print_profile(Profile.load(args.file), details=args.details)
        elif kind == TRIALS_KIND:
            from planner.sessions.trial import print_trials  # deferred (start-up)

            print_trials(Trials.load(args.file))
        else:
            raise PlannerError(f"{args.file} is neither a plan, a profile nor a trials file (kind {kind!r})")
        return 0


def print_kfac_layout(plan: object) -> None:
    """Factor buffers, inversion owners and preconditioners of a K-FAC plan."""
    assert isinstance(plan, Plan) and plan.kfac is not None
    k = plan.kfac
    for kind, buffers in ((FactorKind.A, k.a_buffers), (FactorKind.G, k.g_buffers)):
        table = Table(title=f"{kind.value} factor buffers ({'forward' if kind is FactorKind.A else 'backward'} order)")
        for col in ("#", "layers", "owners", "sent as"):
            table.add_column(col)
        for i, names in enumerate(buffers):
            owners = [k.owners[factor_name(n, kind)] for n in names]
            sent = {"whole" if k.sends_whole(factor_name(n, kind)) else "upper triangles" for n in names}
            table.add_row(str(i), ", ".join(names), ", ".join("all" if o is None else str(o) for o in owners),
                          " / ".join(sorted(sent)))
        console.print(table)
    placed = {n: r for n, r in k.preconditioners.items() if r is not None}
    if placed:
        console.print("preconditioned by one worker (which keeps the layer's factors and broadcasts the result): "
                      + ", ".join(f"{n} on {r}" for n, r in placed.items()) + "; every other layer by all workers")
    else:
        console.print("every layer preconditioned by every worker")
