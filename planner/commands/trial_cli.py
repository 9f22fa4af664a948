"""`planner trial`: its arguments, checked and handed to `planner.sessions.trial`."""

from __future__ import annotations

import argparse
from pathlib import Path

from planner.commands.common import Command, _nonnegative_float, _positive, _positive_float
from planner.contracts.jsonio import check_output_path
from planner.types import PlannerError


class TrialCommand(Command):
    name = "trial"
    help = ("train the model's task with each compressor on every group, beside DDP, and record which trained like "
            "dense (for `planner solve --strategy auto --trials`)")

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("profile", type=Path, help="profile file from `planner profile` (its model and workers)")
        parser.add_argument("--compressors", default=None, metavar="LIST|PRESET",
                            help="what to try, each on every group (dense is the reference, DDP); default: every "
                                 "compressor whose error the profile measured")
        parser.add_argument("--task", choices=["digits", "text", "teacher"], default=None,
                            help="the task trained (default: digits for digits, text for charlm, else teacher)")
        parser.add_argument("--samples", type=_positive, default=None,
                            help="samples per run, summed over the workers (default: the task's, as `planner bench "
                                 "--target-loss`)")
        parser.add_argument("--repeats", type=_positive, default=3,
                            help="runs of each, each on its own batches (default 3; one gives no interval and so "
                                 "no verdict)")
        parser.add_argument("--lr", type=_positive_float, default=None, help="SGD learning rate (default: the task's)")
        parser.add_argument("--momentum", type=_nonnegative_float, default=0.9, help="SGD momentum (default 0.9)")
        parser.add_argument("--batch-size", type=_positive, default=None, help="per-worker batch (model default)")
        parser.add_argument("--tolerance", type=_nonnegative_float, default=None,
                            help="how far above DDP's final loss still counts as like dense (default 0.02: 2%%)")
        parser.add_argument("-o", "--output", type=Path, required=True, help="trials file to write")

    def run(self, args: argparse.Namespace) -> int:
        from planner.contracts.profile import Profile  # deferred (start-up)
        from planner.contracts.trials import DEFAULT_TOLERANCE  # deferred (start-up)
        from planner.sessions.bench_target import TASK_SAMPLES  # deferred (start-up)
        from planner.sessions.trial import (  # deferred (start-up)
            TrialConfig,
            print_trials,
            run_trials,
            trial_compressors,
        )
        from planner.strategies.mixed_plan import parse_compressors  # deferred (start-up)
        from planner.tasks import default_task  # deferred (start-up)

        check_output_path(args.output, "trials file")
        if args.momentum >= 1:
            raise PlannerError(f"`0 <= --momentum < 1` must hold, but got {args.momentum}")
        tolerance = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
        if tolerance >= 1:
            raise PlannerError(f"--tolerance is a fraction of DDP's loss below 1 (0.02: 2%), got {tolerance}")
        profile = Profile.load(args.profile)
        chosen = parse_compressors(args.compressors) if args.compressors is not None else None
        task = args.task or default_task(profile.model.name)
        config = TrialConfig(compressors=trial_compressors(profile, chosen), task=task,
                             samples=args.samples or TASK_SAMPLES[task], repeats=args.repeats, lr=args.lr,
                             momentum=args.momentum, batch_size=args.batch_size, tolerance=tolerance)
        trials = run_trials(profile, config)
        if trials is None:
            return 0
        trials.save(args.output)
        print_trials(trials, profile)
        return 0
