"""`planner pair`: its arguments, handed to `planner.sessions.pair`, which pairs the jobs."""

from __future__ import annotations

import argparse
from pathlib import Path

from planner.commands.common import Command


class PairCommand(Command):
    name = "pair"
    help = "cross over jobs that share devices (Muri): pick the pairs where one computes while the other communicates"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("plans", type=Path, nargs="+", metavar="PLAN",
                            help="the jobs' plans from `planner solve` (dense or top-k)")
        parser.add_argument("--batch", required=True, metavar="N[,N...]",
                            help="samples per iteration (global batch): one value for every job, or one per plan")
        parser.add_argument("-o", "--output", type=Path, required=True, help="the pairing plan to write")

    def run(self, args: argparse.Namespace) -> int:
        from planner.sessions.pair import run_pair  # deferred (start-up)

        run_pair(args.plans, args.batch, args.output)
        return 0
