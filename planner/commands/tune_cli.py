"""`planner tune`: its arguments, checked and handed to `planner.sessions.tune`, which runs the study."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from rich.table import Table

from planner.commands.common import (
    KFAC,
    Command,
    _add_hosts,
    _add_link,
    _density,
    _kfac_options,
    _nonnegative_int,
    _positive,
    check_hosts,
)
from planner.commands.printing import _ms, print_bench
from planner.console import console
from planner.contracts.jsonio import check_output_path
from planner.types import GROUPING_STRATEGIES, InverseMethod, PlannerError, Strategy


def _range_arg(kind: type) -> Callable[[str], tuple | None]:
    """An argparse type for "LOW,HIGH" (or "none" for no range)."""

    def parse(text: str) -> tuple | None:
        if text.strip().lower() == "none":
            return None
        parts = text.split(",")
        try:
            low, high = (kind(p) for p in parts) if len(parts) == 2 else (None, None)
        except ValueError:
            low = high = None
        if low is None or high is None:
            raise argparse.ArgumentTypeError(f"expected LOW,HIGH (e.g. 1,4) or none, got {text!r}")
        return (low, high)

    return parse


class TuneCommand(Command):
    name = "tune"
    help = "autotune a plan with optuna by measuring real steps (resumable SQLite study); write the best plan"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("profile", type=Path, help="profile file from `planner profile`")
        parser.add_argument("--strategy", choices=[*(s.value for s in GROUPING_STRATEGIES), KFAC],
                            default=Strategy.DENSE.value)
        parser.add_argument("--density", type=_density, default=None, help="starting top-k density (default 0.01)")
        _kfac_options(parser)
        parser.add_argument("--model", default=None, help="model (default: the profile's)")
        parser.add_argument("--batch-size", type=_positive, default=None)
        parser.add_argument("--nproc", type=_positive, default=None, help="workers (default: the profile's world size)")
        _add_link(parser)
        _add_hosts(parser)
        parser.add_argument("--trials", type=_positive, default=20,
                            help="finished trials the study should hold (running again resumes up to it)")
        parser.add_argument("--study", type=Path, default=None,
                            help="SQLite file of the study (default: OUTPUT with .db instead of .json)")
        parser.add_argument("--study-name", default="planner-tune")
        parser.add_argument("--steps", type=_positive, default=30, help="measured steps per trial")
        parser.add_argument("--rungs", type=_positive, default=3, help="chunks of a trial after which it may be pruned")
        parser.add_argument("--warmup", type=_nonnegative_int, default=5, help="unmeasured steps before each trial")
        parser.add_argument("--compare-steps", type=_positive, default=30,
                            help="steps of each of tuned and untuned in the final comparison")
        parser.add_argument("--seed", type=int, default=0)
        space = parser.add_argument_group("search space (LOW,HIGH, or none to leave a knob alone)")
        space.add_argument("--alpha-scale", type=_range_arg(float), default=(0.25, 4.0),
                           help="correction factor on every fitted collective start-up time (default 0.25,4)")
        space.add_argument("--beta-scale", type=_range_arg(float), default=(0.25, 4.0),
                           help="correction factor on every fitted per-byte time (default 0.25,4)")
        space.add_argument("--max-group-mb", type=_range_arg(float), default=argparse.SUPPRESS,
                           help="largest gradient group in MB, or no bound (default 0.25,64; none for K-FAC)")
        space.add_argument("--min-group-mb", type=_range_arg(float), default=None,
                           help="smallest gradient group but the last, in MB (default: not tuned)")
        space.add_argument("--density-range", type=_range_arg(float), default=None,
                           help="top-k density range (default: keep --density)")
        space.add_argument("--factor-update-range", type=_range_arg(int), default=None,
                           help="K-FAC factor update interval range (default: keep --factor-update-steps)")
        space.add_argument("--inv-update-range", type=_range_arg(int), default=None,
                           help="K-FAC inverse update interval range (default: keep --inv-update-steps)")
        parser.add_argument("-o", "--output", type=Path, required=True, help="tuned plan file to write")

    def run(self, args: argparse.Namespace) -> int:
        from planner.contracts.profile import Profile  # deferred (start-up)
        from planner.platform.launch import under_torchrun  # deferred (start-up)
        from planner.sessions.tune import (  # deferred (start-up)
            TuneConfig,
            TuneSpace,
            check_study_file,
            run_tune,
            same_decisions,
        )

        if args.density is not None and args.strategy != Strategy.TOPK.value:
            raise PlannerError("--density applies to --strategy topk only")
        profile = Profile.load(args.profile)
        max_group = getattr(args, "max_group_mb", TuneSpace.default_for(args.strategy).max_group_mb)
        space = TuneSpace(
            alpha_scale=args.alpha_scale or (1.0, 1.0), beta_scale=args.beta_scale or (1.0, 1.0),
            max_group_mb=max_group, min_group_mb=args.min_group_mb, density=args.density_range,
            factor_update_steps=args.factor_update_range, inv_update_steps=args.inv_update_range,
        )
        is_kfac = args.strategy == KFAC
        nproc = args.nproc or profile.cluster.world_size
        if under_torchrun():  # torchrun's group, maybe across hosts: its size is the world size
            nproc = int(os.environ["WORLD_SIZE"])
        check_hosts(args.hosts, nproc)
        check_output_path(args.output, "plan")
        check_study_file(args.study or args.output.with_suffix(".db"))
        config = TuneConfig(
            profile=profile, profile_path=str(args.profile), strategy=args.strategy,
            density=(args.density or 0.01) if args.strategy == Strategy.TOPK.value else None,
            method=InverseMethod(args.method), factor_update_steps=args.factor_update_steps if is_kfac else 1,
            inv_update_steps=args.inv_update_steps if is_kfac else 10, model=args.model,
            batch_size=args.batch_size, nproc=nproc, trials=args.trials,
            storage=args.study or args.output.with_suffix(".db"), study_name=args.study_name, steps=args.steps,
            rungs=args.rungs, warmup=args.warmup, compare_steps=args.compare_steps, seed=args.seed, space=space,
            output=args.output, link=args.link, hosts=args.hosts,
        )
        result = run_tune(config)
        if result is None:  # not rank 0 of torchrun's group: rank 0 prints and writes
            return 0
        print_trials(result.trials, result.best_trial)
        if result.resumed_from:
            console.print(f"resumed a study that held {result.resumed_from} finished trial(s): {config.storage}")
        console.print(f"best trial {result.best_trial}: median {_ms(result.best_value_s)} ms; "
                      f"plan: {result.tuned_plan.solver}")
        print_bench(result.comparison, as_json=False,
                    title="tuned against untuned, measured interleaved in the same run (slowest rank per step)")
        if same_decisions(result.tuned_plan, result.untuned_plan):
            console.print("the tuned plan makes the same decisions as the untuned one (same groups"
                          f"{', buffers and owners' if is_kfac else ''}): the difference above is noise")
        console.print(f"wrote plan {args.output}; study {config.storage} (name {config.study_name})")
        return 0


def print_trials(trials: list[dict], best: int) -> None:
    """The study's trials: parameters, measured median, prediction, state."""
    table = Table(title="trials (median measured step; predicted by the model with the trial's corrections)")
    for col in ("#", "state", "params", "median ms", "predicted ms", "note"):
        table.add_column(col, justify="right" if col.endswith("ms") or col == "#" else "left")
    for t in trials:
        params = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in t["params"].items())
        table.add_row(str(t["number"]), t["state"], params, _ms(t["value"]) if t["value"] is not None else "-",
                      _ms(t["predicted"]) if t["predicted"] is not None else "-", t["note"],
                      style="bold" if t["number"] == best else None)
    console.print(table)
