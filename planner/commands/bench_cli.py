"""`planner bench`: its arguments, checked and handed to the bench of each `--strategy`
(`planner.sessions.bench`, bench_kfac, bench_abs, bench_target, bench_crossover)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from planner.commands.common import (
    ABS,
    KFAC,
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
    _positive_float,
    _slowdown,
    check_hosts,
)
from planner.commands.printing import print_bench
from planner.console import err_console
from planner.contracts.plan import Plan
from planner.types import PlannerError, Strategy

#: `--strategy crossover`: two jobs on the same devices, crossed over as a pairing plan says.
CROSSOVER = "crossover"


class BenchCommand(Command):
    name = "bench"
    help = "measure real training steps: DDP, one group per layer, and the plans"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--plan", type=Path, action="append", default=None,
                            help="plan file (repeat for a dense and a top-k plan; one plan with --strategy kfac)")
        parser.add_argument("--strategy", choices=["gradients", KFAC, ABS, CROSSOVER], default="gradients",
                            help="gradients: DDP against the gradient plans; kfac: SGD and K-FAC layouts against "
                                 "a K-FAC plan; abs: time to a target loss of ABS-SGD against synchronous SGD with "
                                 "equal and speed-proportional batches (an ABS plan; use --slowdown); crossover: "
                                 "two jobs one after the other, side by side and crossed over (--pairing)")
        parser.add_argument("--model", default=None, help="model (default: the plan's built-in model)")
        parser.add_argument("--batch-size", type=_positive, default=None)
        parser.add_argument("--nproc", type=_positive, default=None, help="workers (default: the plan's world size)")
        parser.add_argument("--steps", type=_positive, default=20,
                            help="measured steps per variant (default 20; fewer give a noisier median)")
        parser.add_argument("--warmup", type=_nonnegative_int, default=5,
                            help="unmeasured steps per variant (--strategy kfac: one window of inv_update_steps)")
        parser.add_argument("--peers", default=None, metavar="LIST",
                            help="--strategy gradients: PyTorch's DDP hooks to run beside DDP: fp16, powersgd:R "
                                 "(default fp16,powersgd:1,powersgd:4), or none; DDP with the project's top-k hook "
                                 "runs for every top-k density a plan uses; --strategy kfac: kfac-pytorch (the "
                                 "default: the real library in COMM_OPT, MEM_OPT and HYBRID_OPT, where it is "
                                 "importable) or none")
        abs_sgd = parser.add_argument_group("time to a target loss: ABS-SGD (--strategy abs), or gradient plans "
                                            "with --target-loss")
        abs_sgd.add_argument("--samples", type=_positive, default=None,
                             help="samples per run, summed over the workers (default: abs 80000, digits task 40000, "
                                  "text task 8000, teacher task 4000)")
        abs_sgd.add_argument("--repeats", type=_positive, default=None,
                             help="runs of each variant, round-robin (default 3 for abs, 1 for gradient plans; also "
                                  "--strategy crossover)")
        abs_sgd.add_argument("--target-loss", type=_positive_float, default=None,
                             help="evaluation loss to reach (abs: default 0.05); with gradient plans it runs DDP, its "
                                  "hooks and the plans to this loss instead of timing steps")
        abs_sgd.add_argument("--task", choices=["digits", "text", "teacher"], default=None,
                             help="gradient plans with --target-loss: digits (the built-in digits model), text (the "
                                  "built-in charlm model on the Python standard library's sources, held-out files) "
                                  "or teacher (the model learns a fixed random teacher's labels); default digits for "
                                  "the digits model, text for charlm, teacher otherwise")
        abs_sgd.add_argument("--lr", type=_positive_float, default=None,
                             help="SGD learning rate (default: abs 0.4; gradient plans the task's: digits 0.05, text "
                                  "1.0, teacher 0.5 for token models, 0.02 for image models)")
        abs_sgd.add_argument("--speed-change", type=_slowdown, default=None, metavar="RANK=FACTOR",
                             help="halfway through every run, slowed workers change to these factors (e.g. "
                                  "--slowdown 1=1.5 --speed-change 1=3)")
        abs_sgd.add_argument("--momentum", type=_nonnegative_float, default=None,
                             help="SGD momentum (abs default 0: a one-round delay with momentum 0.9 costs about "
                                  "twice the updates; gradient plans default 0.9)")
        abs_sgd.add_argument("--density-warmup", type=_density_warmup, default=None, metavar="START,STEPS",
                             help="gradient plans with --target-loss: the top-k plans' exchange decays the density "
                                  "from START to the plan's over STEPS steps (GradientExchange(density_warmup=)); "
                                  "the other variants run without it")
        abs_sgd.add_argument("--adaptive", type=_positive, default=None, metavar="STEPS",
                             help="gradient plans with --target-loss: also run each plan kept within an error budget "
                                  "re-planned every STEPS steps as training goes (GradientExchange(adaptive=)), as "
                                  "a row of its own")
        abs_sgd.add_argument("--via-ddp", action="store_true",
                             help="gradient plans with --target-loss: also run each plan inside DDP (PlanHook), as a "
                                  "row 'plan X via DDP' (with --adaptive re-planned there too, its buckets kept)")
        crossover = parser.add_argument_group("crossover (--strategy crossover)")
        crossover.add_argument("--pairing", type=Path, default=None,
                               help="the pairing plan of two jobs (`planner pair PLAN PLAN --batch N -o P`); the "
                                    "jobs' plans are the ones it names")
        crossover.add_argument("--gate-dir", type=Path, default=None,
                               help="where the jobs' device gates live (default: a fresh temporary folder)")
        crossover.add_argument("--probe-window", type=_positive_float, default=None, metavar="S",
                               help="the probed mode's windows in seconds: it runs the pair gated and free for two "
                                    "windows each, then the better (default 2)")
        _add_link(parser)
        _add_hosts(parser)
        _add_slowdown(parser)
        parser.add_argument("--json", action="store_true", help="machine-readable output")

    def run(self, args: argparse.Namespace) -> int:
        from planner.platform.launch import under_torchrun  # deferred (start-up)
        from planner.sessions.bench import BenchConfig, file_labels, run_bench, via_ddp_notes  # deferred (start-up)

        crossover_only = [flag for flag, value in (("--pairing", args.pairing), ("--gate-dir", args.gate_dir),
                                                   ("--probe-window", args.probe_window))
                          if value is not None]
        if crossover_only and args.strategy != CROSSOVER:
            raise PlannerError(f"{crossover_only[0]} applies to --strategy crossover only")
        if args.strategy == CROSSOVER:
            return self._run_crossover(args)
        if not args.plan:
            raise PlannerError(f"--strategy {args.strategy} needs --plan PLAN (from `planner solve`)")
        plans = tuple(Plan.load(p) for p in args.plan)
        if under_torchrun():  # one rank of torchrun's group, maybe across hosts: its size is the world size
            args.nproc = int(os.environ["WORLD_SIZE"])
        check_hosts(args.hosts, args.nproc or plans[0].cluster.world_size)
        to_target = args.strategy == "gradients" and args.target_loss is not None
        runs = [flag for flag, value in (("--samples", args.samples), ("--repeats", args.repeats),
                                         ("--target-loss", args.target_loss), ("--lr", args.lr),
                                         ("--momentum", args.momentum)) if value is not None]
        if args.via_ddp and not to_target:
            raise PlannerError("--via-ddp applies to the time-to-target bench of gradient plans (--target-loss L); "
                               "the step-time bench runs every plan inside DDP already")
        if args.adaptive is not None and not to_target:
            raise PlannerError("--adaptive applies to the time-to-target bench of gradient plans (--target-loss L)")
        if args.adaptive is not None:
            from planner.runtime.adaptive import Replanning  # deferred (start-up)

            least = Replanning.steps + Replanning.warmup
            if args.adaptive < least:
                raise PlannerError(f"--adaptive must be at least {least} steps (the errors are measured over the "
                                   f"last {least} steps before each re-plan), got {args.adaptive}")
        if args.density_warmup is not None and not to_target:
            raise PlannerError("--density-warmup applies to the time-to-target bench of gradient plans "
                               "(--target-loss L)")
        if runs and args.strategy not in (ABS, "gradients"):
            raise PlannerError(f"{runs[0]} applies to --strategy abs, or to gradient plans with --target-loss")
        if runs and args.strategy == "gradients" and not to_target:
            raise PlannerError(f"{runs[0]} applies to --strategy abs, or to gradient plans with --target-loss L (the "
                               "time-to-target bench)")
        if args.speed_change is not None and args.strategy != ABS:
            raise PlannerError("--speed-change applies to --strategy abs only")
        if args.task is not None and not to_target:
            raise PlannerError("--task applies to the time-to-target bench of gradient plans (--target-loss L)")
        if args.peers is not None and args.strategy not in ("gradients", KFAC):
            raise PlannerError("--peers applies to --strategy gradients and kfac only")
        if args.strategy == KFAC:
            return self._run_kfac(args, plans)
        if args.strategy == ABS:
            return self._run_abs(args, plans)
        if to_target:
            return self._run_to_target(args, plans)
        config = BenchConfig(
            plans=plans, model=args.model or plans[0].model.name, batch_size=_batch_size(args.batch_size, plans),
            nproc=args.nproc or plans[0].cluster.world_size, steps=args.steps, warmup=args.warmup,
            show_progress=not args.json, link=args.link, slowdown=args.slowdown, peers=_peers(args.peers),
            hosts=args.hosts, labels=file_labels(plans, args.plan),
        )
        _note_link_mismatch(plans, args.link)
        for note in via_ddp_notes(plans, config.labels):
            err_console.print(f"note: {note}", markup=False, soft_wrap=True)
        results = run_bench(config)
        if results is not None:  # None on torchrun ranks other than 0: rank 0 prints
            print_bench(results, args.json)
        return 0

    @staticmethod
    def _run_to_target(args: argparse.Namespace, plans: tuple) -> int:
        from planner.sessions.bench import file_labels  # deferred (start-up)
        from planner.sessions.bench_target import (  # deferred (start-up)
            TASK_SAMPLES,
            TargetBenchConfig,
            print_target_bench,
            run_target_bench,
        )
        from planner.tasks import default_task  # deferred (start-up)

        if args.density_warmup is not None:
            start = args.density_warmup[0]
            for path, plan in zip(args.plan, plans, strict=True):
                if plan.strategy is Strategy.TOPK and plan.density is not None and not plan.density < start:
                    raise PlannerError(f"--density-warmup must start above the plan's density, but got "
                                       f"start={start:g} for {path} (density {plan.density:g})")
        model = args.model or plans[0].model.name
        task = args.task or default_task(model)
        config = TargetBenchConfig(
            plans=plans, model=model, task=task, target_loss=args.target_loss,
            samples=args.samples or TASK_SAMPLES[task], lr=args.lr,
            momentum=0.9 if args.momentum is None else args.momentum, repeats=args.repeats or 1,
            peers=_peers(args.peers), nproc=args.nproc or plans[0].cluster.world_size, batch_size=args.batch_size,
            show_progress=not args.json, link=args.link, slowdown=args.slowdown, hosts=args.hosts,
            labels=file_labels(plans, args.plan), density_warmup=args.density_warmup, adaptive=args.adaptive,
            via_ddp=args.via_ddp)
        _note_link_mismatch(plans, args.link)
        runs = run_target_bench(config)
        if runs is not None:
            print_target_bench(config, runs, args.json)
        return 0

    @staticmethod
    def _one_plan(args: argparse.Namespace, plans: tuple, section: str, what: str, solve: str) -> Any:
        """The one plan `--strategy SECTION` benches, which must have that section."""
        if len(plans) != 1:
            raise PlannerError(f"--strategy {section} benches one {what} plan, but {len(plans)} --plan were given")
        if getattr(plans[0], section) is None:
            raise PlannerError(f"{args.plan[0]} has no {section} section; make one with `planner solve PROFILE "
                               f"--strategy {solve}`")
        return plans[0]

    @staticmethod
    def _run_crossover(args: argparse.Namespace) -> int:
        from planner.contracts.pairing import PairingPlan, check_job_plan  # deferred (start-up)
        from planner.platform.launch import under_torchrun  # deferred (start-up)
        from planner.sessions.bench_crossover import (  # deferred (start-up)
            CrossoverBenchConfig,
            CrossoverJob,
            print_crossover_bench,
            run_crossover_bench,
        )

        if args.pairing is None:
            raise PlannerError("--strategy crossover needs --pairing P: the pairing plan of two jobs, from `planner "
                               "pair PLAN PLAN --batch N -o P`")
        given = [flag for flag, value in (("--plan", args.plan), ("--model", args.model),
                                          ("--batch-size", args.batch_size), ("--nproc", args.nproc),
                                          ("--slowdown", args.slowdown), ("--samples", args.samples),
                                          ("--target-loss", args.target_loss), ("--lr", args.lr),
                                          ("--momentum", args.momentum), ("--speed-change", args.speed_change))
                 if value is not None]
        if given:
            raise PlannerError(f"{given[0]} does not apply to --strategy crossover: the jobs, their plans and "
                               "batches are the pairing plan's")
        if under_torchrun():
            raise PlannerError("--strategy crossover starts its two jobs itself; run it without torchrun")
        pairing = PairingPlan.load(args.pairing)
        if len(pairing.pairs) != 1 or pairing.alone:
            raise PlannerError(f"--strategy crossover benches one pair of jobs, but {args.pairing} has "
                               f"{len(pairing.pairs)} pair(s) and {len(pairing.alone)} job(s) alone; make it from "
                               "two plans: planner pair PLAN PLAN --batch N -o P")
        jobs = []
        for index in pairing.pairs[0]:
            entry = pairing.jobs[index]
            plan = check_job_plan(entry)
            if entry.samples % entry.world_size:
                raise PlannerError(f"job {entry.name} has {entry.samples} samples per iteration, not a multiple of "
                                   f"its {entry.world_size} workers; re-run planner pair with --batch a multiple")
            check_hosts(args.hosts, entry.world_size, f"job {entry.name}'s {{n}} workers")
            plan.check_compatible(plan.model, entry.world_size, hosts=args.hosts or 1)
            jobs.append(CrossoverJob(name=entry.name, plan=plan, model=plan.model.name,
                                     batch=entry.samples // entry.world_size))
        gate_dir = None
        if args.gate_dir is not None:
            try:
                args.gate_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise PlannerError(f"cannot create the gate folder {args.gate_dir}: {exc.strerror or exc}; give a "
                                   "writable --gate-dir") from None
            gate_dir = str(args.gate_dir)
        config = CrossoverBenchConfig(
            pairing=str(args.pairing), jobs=tuple(jobs),
            predicted={pairing.jobs[i].name: pairing.predicted[i].to_dict() for i in pairing.pairs[0]},
            steps=args.steps, warmup=args.warmup, repeats=args.repeats or 3, link=args.link, hosts=args.hosts,
            gate_dir=gate_dir,
            probe_window_s=args.probe_window or 2.0, show_progress=not args.json)
        print_crossover_bench(config, run_crossover_bench(config), args.json)
        return 0

    @staticmethod
    def _run_abs(args: argparse.Namespace, plans: tuple) -> int:
        from planner.sessions.bench_abs import ABSBenchConfig, print_abs_bench, run_abs_bench  # deferred (start-up)

        plan = BenchCommand._one_plan(args, plans, ABS, "ABS", "abs --global-batch B")
        given = {k: v for k, v in (("samples", args.samples), ("repeats", args.repeats),
                                   ("target_loss", args.target_loss), ("lr", args.lr), ("momentum", args.momentum))
                 if v is not None}
        config = ABSBenchConfig(plan=plan, model=args.model or plan.model.name,
                                nproc=args.nproc or plan.cluster.world_size, show_progress=not args.json,
                                link=args.link, slowdown=args.slowdown, speed_change=args.speed_change,
                                hosts=args.hosts, **given)
        _note_link_mismatch(plans, args.link)
        if plan.cluster.slowdown != (args.slowdown.text if args.slowdown is not None else None):
            made = plan.cluster.slowdown or "no slowed worker"
            err_console.print(f"note: the plan was made for {made}, the bench runs with "
                              f"{args.slowdown.text if args.slowdown else 'none'}: its predictions are for the "
                              "speeds it was profiled at", markup=False)
        runs = run_abs_bench(config)
        if runs is not None:
            print_abs_bench(config, runs, args.json)
        return 0

    @staticmethod
    def _run_kfac(args: argparse.Namespace, plans: tuple) -> int:
        from planner.sessions.bench_kfac import KFACBenchConfig, run_kfac_bench  # deferred (start-up)

        plan = BenchCommand._one_plan(args, plans, KFAC, "K-FAC", KFAC)
        peers = (args.peers or "kfac-pytorch").strip()
        if peers not in ("kfac-pytorch", "none"):
            raise PlannerError(f"--strategy kfac takes --peers kfac-pytorch (the default: the real library where it "
                               f"is importable) or --peers none, not {args.peers!r}")
        config = KFACBenchConfig(
            plan=plan, model=args.model or plan.model.name, batch_size=_batch_size(args.batch_size, plans),
            nproc=args.nproc or plan.cluster.world_size, steps=args.steps, show_progress=not args.json,
            link=args.link, slowdown=args.slowdown, peer=peers == "kfac-pytorch", hosts=args.hosts,
        )
        _note_link_mismatch(plans, args.link)
        title = (f"K-FAC bench: median over windows of {config.window} steps of the average step time "
                 "(slowest rank per step)")
        results = run_kfac_bench(config)
        if results is not None:
            print_bench(results, args.json, title=title, lower_bound_s=plan.kfac.lower_bound_s)
        return 0


def _density_warmup(text: str) -> tuple[float, int]:
    """`--density-warmup START,STEPS`: 0 < START <= 1 and a whole number of steps >= 1."""
    start_text, _, steps_text = text.partition(",")
    try:
        start, steps = float(start_text), int(steps_text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START,STEPS (e.g. 0.25,500), got {text!r}") from None
    if not (0 < start <= 1 and steps >= 1):
        raise argparse.ArgumentTypeError(f"`0 < START <= 1` and `STEPS >= 1` must hold, but got {text!r}")
    return start, steps
