"""`planner simulate`: how a plan and the baselines are predicted to scale with world size."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table

from planner.commands.common import CLUSTER_HELP, KFAC, KFAC_SCALING_COLUMNS, Command, _density, _kfac_options
from planner.commands.printing import _ms
from planner.console import console, progress
from planner.types import GROUPING_STRATEGIES, InverseMethod, PlannerError, Strategy


class SimulateCommand(Command):
    name = "simulate"
    help = "predict how the plan and each baseline scale with world size on a cluster you describe"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("profile", type=Path, help="profile file from `planner profile`")
        parser.add_argument("--cluster", default=None, metavar="SPEC",
                            help=CLUSTER_HELP + "; default: the profile's own network, scaled by the ring model")
        parser.add_argument("--world-sizes", default="8,64,512", metavar="LIST",
                            help="e.g. 8,64,512 or 4,8,...,1024 (doubling); multiples of the GPUs per node")
        parser.add_argument("--strategy", choices=[*(s.value for s in GROUPING_STRATEGIES), KFAC],
                            default=Strategy.DENSE.value)
        parser.add_argument("--density", type=_density, default=None, help="top-k density (default 0.01)")
        _kfac_options(parser)
        parser.add_argument("--json", action="store_true", help="machine-readable output")

    def run(self, args: argparse.Namespace) -> int:
        from planner.contracts.profile import Profile  # deferred (start-up)
        from planner.costmodel.from_profile import gradient_problem  # deferred (start-up)
        from planner.strategies.cluster import parse_cluster, parse_world_sizes, scaling_table  # deferred (start-up)

        if args.density is not None and args.strategy != Strategy.TOPK.value:
            raise PlannerError("--density applies to --strategy topk only")
        sizes = parse_world_sizes(args.world_sizes)
        profile = Profile.load(args.profile)
        spec = parse_cluster(args.cluster if args.cluster is not None else f"profile={args.profile}")
        for w in sizes:  # refuse a bad world size before solving anything
            spec.with_world_size(w)
        # ... and a strategy the profile has no measurements for
        if args.strategy == KFAC:
            from planner.strategies.kfac_plan import kfac_problem  # deferred (start-up)

            if args.inv_update_steps % args.factor_update_steps:  # refused before the progress bar draws
                raise PlannerError(f"--inv-update-steps must be a multiple of --factor-update-steps, but got "
                                   f"{args.inv_update_steps} and {args.factor_update_steps} (the default "
                                   f"--inv-update-steps is 10)")

            kfac_problem(profile, InverseMethod(args.method))
        else:
            strategy = Strategy(args.strategy)
            gradient_problem(profile, strategy, (args.density or 0.01) if strategy is Strategy.TOPK else None)
        with progress(enabled=not args.json) as bar:
            task = bar.add_task(f"plans for {len(sizes)} world sizes", total=len(sizes))
            rows = scaling_table(
                profile, spec, sizes, strategy=args.strategy, density=args.density,
                method=InverseMethod(args.method), factor_update_steps=args.factor_update_steps,
                inv_update_steps=args.inv_update_steps, on_row=lambda _: bar.advance(task),
            )
        if args.json:
            console.print_json(json.dumps({"cluster": spec.to_dict(), "strategy": args.strategy, "rows": [
                {"world_size": r.world_size, "nodes": r.nodes, "gpus_per_node": r.gpus_per_node, "plan_s": r.plan_s,
                 "baselines": r.baselines, "lower_bound_s": r.lower_bound_s} for r in rows]}))
            return 0
        print_scaling(rows, args.strategy, f"{profile.model.name}: predicted "
                      f"{'average step' if args.strategy == KFAC else 'iteration'} (ms) on {spec.describe()}")
        return 0


def print_scaling(rows: list, strategy: str, title: str) -> None:
    """One row per world size: the plan, the baselines, the lower bound, and the plan's speedup."""
    names = list(KFAC_SCALING_COLUMNS) if strategy == KFAC else list(rows[0].baselines)
    # DDP's row: "ddp", or for top-k plans DDP with the top-k hook ("ddp+topk:D").
    reference = "kfac-pytorch" if strategy == KFAC else next((n for n in names if n == "ddp" or n.startswith("ddp+")),
                                                             "ddp")
    table = Table(title=title)
    for col in ("world size", "nodes x GPUs", "plan", *names, "lower bound", f"plan vs {reference}"):
        table.add_column(col, justify="right")
    for r in rows:
        ref = r.baselines.get(reference)
        table.add_row(
            str(r.world_size), f"{r.nodes} x {r.gpus_per_node}", _ms(r.plan_s),
            *(_ms(r.baselines[n]) if n in r.baselines else "-" for n in names), _ms(r.lower_bound_s),
            f"{ref / r.plan_s:.2f}x" if ref else "-",
        )
    console.print(table)
