"""`planner report`: its arguments, checked and handed to `planner.sessions.report`, which draws the pictures."""

from __future__ import annotations

import argparse
from pathlib import Path

from planner.commands.common import CLUSTER_HELP, KFAC, KFAC_SCALING_COLUMNS, Command
from planner.console import console, err_console, progress
from planner.contracts.jsonio import ensure_folder
from planner.contracts.plan import Plan
from planner.types import Strategy


class ReportCommand(Command):
    name = "report"
    help = "pictures of a plan: Gantt timeline of a predicted iteration, scaling with world size, predicted vs measured"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("plan", type=Path, help="plan file")
        # A str, not a Path: Path("") is ".", and an empty -o would write into the current folder.
        parser.add_argument("-o", "--output", required=True, help="folder for the PNGs and report.html")
        parser.add_argument("--profile", type=Path, default=None,
                            help="the profile the plan was solved from (default: the plan's source)")
        parser.add_argument("--cluster", default=None, metavar="SPEC",
                            help="cluster for the scaling picture: " + CLUSTER_HELP +
                                 "; default: the profile's own network, scaled by the ring model")
        parser.add_argument("--world-sizes", default=None, metavar="LIST",
                            help="world sizes of the scaling picture (default: the plan's, doubling 8 times)")
        parser.add_argument("--no-scaling", action="store_true", help="skip the scaling picture")
        parser.add_argument("--bench", type=Path, default=None,
                            help="`planner bench --json` output for the predicted-vs-measured picture")

    def run(self, args: argparse.Namespace) -> int:
        from planner.sessions.report import read_bench_json, write_report  # deferred (start-up)
        from planner.strategies.cluster import parse_cluster, parse_world_sizes, scaling_table  # deferred (start-up)
        from planner.strategies.retune_plan import load_source_profile  # deferred (start-up)

        args.output = ensure_folder(args.output, "report folder", create=False)
        plan = Plan.load(args.plan)
        profile = load_source_profile(plan, args.profile)
        bench = read_bench_json(args.bench) if args.bench is not None else None
        if plan.strategy is Strategy.MIXED and not args.no_scaling:
            err_console.print("note: the scaling picture covers dense, top-k and K-FAC plans, not mixed ones; "
                              "leaving it out", markup=False)
            args.no_scaling = True
        if not args.no_scaling:
            first = plan.cluster.world_size
            sizes = parse_world_sizes(args.world_sizes or f"{first},{2 * first},...,{first << 8}")
            source = str(args.profile or plan.source_profile)
            spec = parse_cluster(args.cluster if args.cluster is not None else f"profile={source}")
            for w in sizes:  # refuse a bad world size before the folder is made
                spec.with_world_size(w)
        ensure_folder(args.output, "report folder")  # once the inputs are known good: a bad one leaves nothing
        scaling = None
        if not args.no_scaling:
            kfac = plan.kfac
            strategy = KFAC if kfac is not None else plan.strategy.value
            options = {} if kfac is None else {
                "method": kfac.method, "factor_update_steps": kfac.factor_update_steps,
                "inv_update_steps": kfac.inv_update_steps,
            }
            with progress() as bar:
                task = bar.add_task(f"plans for {len(sizes)} world sizes", total=len(sizes))
                rows = scaling_table(profile, spec, sizes, strategy=strategy, density=plan.density,
                                     on_row=lambda _: bar.advance(task), **options)  # type: ignore[arg-type]
            names = list(KFAC_SCALING_COLUMNS) if kfac is not None else list(rows[0].baselines)
            series = {"plan": [r.plan_s for r in rows]}
            series.update({n: [r.baselines[n] for r in rows] for n in names if n in rows[0].baselines})
            scaling = ([r.world_size for r in rows], series, [r.lower_bound_s for r in rows], spec.describe())
        files = write_report(plan, profile, args.output, plan_path=str(args.plan), scaling=scaling, bench=bench,
                             bench_source=str(args.bench or ""))
        written = [p for p in (files.timeline, files.scaling, files.measured) if p is not None]
        console.print("wrote " + ", ".join(str(p) for p in written) + f" and the page {files.page}")
        return 0
