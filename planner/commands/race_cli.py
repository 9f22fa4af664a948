"""`planner race`: its arguments, checked and handed to `planner.sessions.race`, and the race's table."""

from __future__ import annotations

import argparse
from pathlib import Path

from planner.commands.common import (
    Command,
    _add_hosts,
    _add_link,
    _add_slowdown,
    _positive,
    add_race_flags,
    race_plan_file,
)


class RaceCommand(Command):
    name = "race"
    help = ("decide by measurement: race the plan's finalists (DDP, its hooks, the plan both ways, its runners-up; "
            "K-FAC: its layout and kfac-pytorch's) in real steps")

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("plan", type=Path, metavar="PLAN",
                            help="a gradient or K-FAC plan from `planner solve`: its finalists race, and the race is "
                                 "recorded in it (a runner-up or layout the race keeps becomes its plan)")
        add_race_flags(parser)
        parser.add_argument("--model", default=None, help="model (default: the plan's built-in model)")
        parser.add_argument("--batch-size", type=_positive, default=None)
        parser.add_argument("--nproc", type=_positive, default=None, help="workers (default: the plan's world size)")
        parser.add_argument("--peers", default=None, metavar="LIST",
                            help="PyTorch's DDP hooks that race beside DDP: fp16, powersgd:R, or none (default: "
                                 "the hooks of what the plan's solve was allowed to send, within its error budget; "
                                 "fp16,powersgd:1,powersgd:4 for a dense or top-k plan solved alone; a K-FAC race "
                                 "has none)")
        _add_link(parser)
        _add_hosts(parser)
        _add_slowdown(parser)
        parser.add_argument("--json", action="store_true", help="machine-readable output")

    def run(self, args: argparse.Namespace) -> int:
        return race_plan_file(args.plan, args, link=args.link, hosts=args.hosts, slowdown=args.slowdown,
                              model=args.model, batch_size=args.batch_size, nproc=args.nproc, peers=args.peers,
                              as_json=args.json)
