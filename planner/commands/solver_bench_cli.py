"""`planner bench-solvers`: its arguments, handed to the timing harness `planner.sessions.solver_bench`."""

from __future__ import annotations

import argparse

from rich.table import Table

from planner.commands.common import Command, _nonnegative_float, _positive
from planner.console import console
from planner.types import PlannerError


class BenchSolversCommand(Command):
    name = "bench-solvers"
    help = "time the exact solvers on synthetic instances: gradient grouping, or K-FAC inversion placement"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--layers", type=_positive, default=1000, help="gradient layers (grouping solvers)")
        parser.add_argument("--repeats", type=_positive, default=5)
        parser.add_argument("--factors", type=_positive, default=None,
                            help="time the K-FAC placement solvers on this many factors instead")
        parser.add_argument("--workers", type=_positive, default=64, help="world size for --factors")
        parser.add_argument("--time-limit", type=float, default=2.0, help="seconds for each placement solve")
        parser.add_argument("--interference", type=_nonnegative_float, default=None, metavar="SIGMA",
                            help="also time instances where compute runs 1+SIGMA times slower while a collective "
                                 "is in flight (dense ones then pay packing: the two-clock search)")

    def run(self, args: argparse.Namespace) -> int:
        # Deferred: every command's module is imported at start-up, and only this one needs the solvers.
        from planner.sessions.solver_bench import time_placement, time_solvers  # deferred (start-up)

        if args.factors is not None:
            if not args.time_limit > 0:
                raise PlannerError(f"`--time-limit > 0` must hold, but got {args.time_limit}")
            rows = time_placement(args.factors, args.workers, repeats=args.repeats, time_limit_s=args.time_limit)
            title = (f"placement of {args.factors} synthetic factors on {args.workers} workers "
                     f"(median of {args.repeats}; makespan = the later of the busiest worker's inversions and "
                     "the last broadcast)")
        else:
            sigmas = (0.0,) if not args.interference else (0.0, args.interference)
            rows = time_solvers(num_layers=args.layers, repeats=args.repeats, interference=sigmas)
            title = f"solver time on {args.layers} synthetic layers (median of {args.repeats})"
        print_rows(rows, title)
        return 0


def print_rows(rows: list[dict], title: str) -> None:
    """A table of dict rows with the same keys (floats to 4 significant digits)."""
    table = Table(title=title)
    for col in rows[0]:
        table.add_column(str(col))
    for r in rows:
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()))
    console.print(table)
