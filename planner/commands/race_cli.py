"""`planner race`: its arguments, checked and handed to `planner.sessions.race`, and the race's table."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from planner.commands.common import (
    Command,
    _add_hosts,
    _add_link,
    _add_slowdown,
    _batch_size,
    _nonnegative_float,
    _nonnegative_int,
    _note_link_mismatch,
    _peers,
    _positive,
    check_hosts,
)
from planner.commands.printing import print_race
from planner.console import console
from planner.contracts.plan import Plan
from planner.types import PlannerError


def _fraction(text: str) -> float:
    """`--margin`: a fraction in [0, 1) (0.02 is 2%)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.02 (2%), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1) such as 0.02 (2%), got {text!r}")
    return value


class RaceCommand(Command):
    name = "race"
    help = "decide by measurement: race the plan's finalists (DDP, its hooks, the plan both ways) in real steps"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("plan", type=Path, metavar="PLAN",
                            help="a gradient plan from `planner solve`: its finalists race, and the race is recorded "
                                 "in it")
        parser.add_argument("--margin", type=_fraction, default=0.02,
                            help="the practical margin: a less simple arm is kept only when it is faster than every "
                                 "other by more than this (default 0.02, 2%%)")
        parser.add_argument("--race-time", type=_nonnegative_float, default=60.0, metavar="S",
                            help="seconds of racing after the warm-up; then the simplest arm not beaten is kept "
                                 "(default 60; 0: after one round)")
        parser.add_argument("--block", type=_positive, default=4,
                            help="steps each arm runs per round (default 4)")
        parser.add_argument("--warmup", type=_nonnegative_int, default=5, help="unmeasured steps per arm (default 5)")
        parser.add_argument("--model", default=None, help="model (default: the plan's built-in model)")
        parser.add_argument("--batch-size", type=_positive, default=None)
        parser.add_argument("--nproc", type=_positive, default=None, help="workers (default: the plan's world size)")
        parser.add_argument("--peers", default=None, metavar="LIST",
                            help="PyTorch's DDP hooks that race beside DDP: fp16, powersgd:R (default "
                                 "fp16,powersgd:1,powersgd:4), or none")
        _add_link(parser)
        _add_hosts(parser)
        _add_slowdown(parser)
        parser.add_argument("--json", action="store_true", help="machine-readable output")

    def run(self, args: argparse.Namespace) -> int:
        from planner.contracts.jsonio import check_output_path  # deferred (start-up)
        from planner.platform.launch import under_torchrun  # deferred (start-up)
        from planner.sessions.bench import file_labels  # deferred (start-up)
        from planner.sessions.race import RaceConfig, beyond_budget, run_race  # deferred (start-up)
        from planner.strategies.race_rule import race_summary  # deferred (start-up)

        check_output_path(args.plan, "plan")  # the race is recorded in it: refused now, not after the race
        plans = (Plan.load(args.plan),)
        if plans[0].kfac is not None or plans[0].abs is not None:
            raise PlannerError(f"{args.plan} is not a gradient plan: the race runs dense, top-k and mixed plans; bench "
                               "a K-FAC or ABS-SGD plan with `planner bench --strategy kfac|abs`")
        if under_torchrun():
            args.nproc = int(os.environ["WORLD_SIZE"])
        nproc = args.nproc or plans[0].cluster.world_size
        check_hosts(args.hosts, nproc)
        config = RaceConfig(
            plans=plans, model=args.model or plans[0].model.name, batch_size=_batch_size(args.batch_size, plans),
            nproc=nproc, block=args.block, warmup=args.warmup, margin=args.margin, race_time_s=args.race_time,
            peers=_peers(args.peers), show_progress=not args.json, link=args.link, slowdown=args.slowdown,
            hosts=args.hosts, labels=file_labels(plans, [args.plan]))
        _note_link_mismatch(plans, args.link)
        if beyond := sorted(beyond_budget(plans)):
            console.print(f"note: {', '.join(beyond)} do not race: their error is beyond the plan's budget",
                          markup=False, soft_wrap=True)
        record = run_race(config)
        if record is None:  # a torchrun rank other than 0: rank 0 prints and records
            return 0
        plan = dataclasses.replace(plans[0], race=record)
        plan.save(args.plan)
        if args.json:
            print(json.dumps({**record.to_dict(), "summary": race_summary(record)}, indent=2))
            return 0
        print_race(record)
        console.print(f"recorded the race in {args.plan}", markup=False, soft_wrap=True)
        return 0
