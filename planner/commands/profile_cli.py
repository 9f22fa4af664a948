"""`planner profile`: its arguments, checked and handed to `planner.sessions.profile`, which measures."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from planner.commands.common import (
    Command,
    _add_hosts,
    _add_link,
    _add_slowdown,
    _density,
    _nonnegative_float,
    _nonnegative_int,
    _positive,
    _positive_float,
    check_hosts,
)
from planner.commands.printing import print_profile
from planner.console import console, err_console
from planner.contracts.jsonio import check_output_path
from planner.types import MAX_POWERSGD_RANK, Compressor, CompressorError, PlannerError


class ProfileCommand(Command):
    name = "profile"
    help = "measure per-layer compute, collectives and top-k costs on N workers; write a profile"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        from planner.models import DEFAULT_MODEL  # deferred (start-up)
        from planner.profilers.layers import MAX_LAYER_REPEATS  # deferred (start-up)
        from planner.sessions.profile import DEFAULT_EFFORT, DEFAULT_LAYER_SECONDS, QUICK_EFFORT  # deferred (start-up)

        parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name or package.module:factory")
        parser.add_argument("--batch-size", type=_positive, default=None, help="per-worker batch (model default)")
        parser.add_argument("--nproc", type=_positive, default=2,
                            help="local workers to start (ignored under torchrun)")
        parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
        parser.add_argument("--quick", action="store_true",
                            help="measure what a plan needs, fewer times: under a minute for a model like the "
                                 "built-in MLP (top-k at 1%% and PowerSGD at rank 4 only); wider intervals")
        parser.add_argument("--time", type=_positive_float, default=None, metavar="S",
                            help="measure in rounds for about S seconds: a first round of everything at the --quick "
                                 "effort, then rounds of what the solve's finalists' open comparisons depend on most "
                                 "(the steps, the collectives, or compute beside communication), pooled, until none "
                                 "is open or the next round would not fit (gradient plans; not with --kfac or --only)")
        parser.add_argument("--repeats", type=_positive, default=None,
                            help=f"measured iterations per layer (default {DEFAULT_EFFORT.repeats}, --quick "
                                 f"{QUICK_EFFORT.repeats})")
        parser.add_argument("--warmup", type=_nonnegative_int, default=None,
                            help=f"unmeasured iterations first (default {DEFAULT_EFFORT.warmup}, --quick "
                                 f"{QUICK_EFFORT.warmup})")
        parser.add_argument("--layer-seconds", type=_nonnegative_float, default=None, metavar="S",
                            help="time whole steps for about S seconds: more than --repeats iterations on a fast "
                                 f"model (at most {MAX_LAYER_REPEATS}); 0: exactly --repeats (default "
                                 f"{DEFAULT_LAYER_SECONDS:g}, --quick {QUICK_EFFORT.layer_seconds:g})")
        parser.add_argument("--densities", default=None,
                            help="top-k densities to measure (default 0.001,0.01,0.1,1.0, --quick 0.01)")
        parser.add_argument("--powersgd-ranks", default=None, metavar="LIST",
                            help="PowerSGD ranks to measure (with fp16), e.g. 1,2,4; none: measure neither (default "
                                 "1,2,4, --quick 4)")
        parser.add_argument("--compressors", default=None, metavar="LIST",
                            help="the compressors your plans will be solved over (a preset or a list, as `planner "
                                 "solve --compressors`): their PowerSGD ranks and top-k densities are measured, and "
                                 "top-k is timed only where a plan over them within the default error budget "
                                 "(fp16's) could send it, as `planner demo` does (default: time everything)")
        parser.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                            help="time the runtime's own work (packing, compressing, sending) in real steps and "
                                 "calibrate the micro-benchmarks' predictions by it (default); --no-calibrate: the "
                                 "micro-benchmarks alone, a shorter profile whose plans a race settles")
        parser.add_argument("--only", choices=["comm"], default=None, help="re-measure only the network of -o")
        parser.add_argument("--kfac", action="store_true",
                            help="also measure K-FAC costs (factors, preconditioning, inversion against dimension)")
        parser.add_argument("--max-dim", type=_positive, default=2048,
                            help="largest matrix the K-FAC inversion sweep measures; larger ones scale as d^3")
        parser.add_argument("--kfac-skip", metavar="REGEX", default=None,
                            help="K-FAC layers to leave out (names matched with re.search), e.g. an unused head; "
                                 "pass the same skip_layers= to KFACPreconditioner")
        _add_link(parser)
        _add_hosts(parser)
        _add_slowdown(parser)
        parser.add_argument("--timeout", type=_positive_float, default=None, metavar="S",
                            help="seconds a worker may wait in one collective for the others (default 600); past it "
                                 "the profile fails in one line naming the phase it was in (a hung worker)")
        parser.add_argument("-o", "--output", type=Path, required=True, help="profile file to write")
        parser.add_argument("-v", "--verbose", dest="details", action="store_true",
                            help="print everything measured (each calibration, the collectives' fits, memory, "
                                 "throughput), not only the summary; later: planner show PROFILE --details")

    def run(self, args: argparse.Namespace) -> int:
        from planner.contracts.profile import Profile  # deferred (start-up)
        from planner.sessions.profile import (  # deferred (start-up)
            DEFAULT_EFFORT,
            QUICK_EFFORT,
            PlanScope,
            ProfileConfig,
            run_profile,
            skipped_topk_densities,
        )

        if args.kfac_skip is not None:
            if not args.kfac:
                raise PlannerError("--kfac-skip applies to --kfac only")
            try:
                re.compile(args.kfac_skip)
            except re.error as exc:
                raise PlannerError(
                    f"--kfac-skip is not a valid regular expression ({exc}): {args.kfac_skip!r}"
                ) from None
        if args.time is not None and (args.kfac or args.only is not None):
            raise PlannerError("--time measures the gradient finalists in rounds; a K-FAC profile (--kfac) and "
                               "--only comm measure once: drop --time")
        quick = args.quick or args.time is not None  # --time: coarse first
        effort = QUICK_EFFORT if quick else DEFAULT_EFFORT
        densities = effort.densities
        if args.densities is not None:
            try:
                densities = tuple(_density(d) for d in args.densities.split(","))
            except argparse.ArgumentTypeError as exc:
                raise PlannerError(f"--densities: {exc}") from None
        ranks = effort.powersgd_ranks if args.powersgd_ranks is None else _powersgd_ranks(args.powersgd_ranks)
        scope = None
        if args.compressors is not None:
            if args.only is not None or args.kfac:
                raise PlannerError("--compressors narrows what a gradient profile times; --only comm and --kfac "
                                   "measure all they measure: drop --compressors")
            from planner.strategies.budget import DEFAULT_BUDGETS  # deferred (start-up)
            from planner.strategies.mixed_plan import parse_compressors  # deferred (start-up)

            compressors = parse_compressors(args.compressors)
            ranks = tuple(sorted({*ranks, *(c.rank for c in compressors if c.rank is not None)}))
            densities = tuple(sorted({*densities, *(c.density for c in compressors if c.density is not None)}))
            scope = PlanScope(compressors=compressors, budget=DEFAULT_BUDGETS[0])
        given = {name: value for name, value in (("repeats", args.repeats), ("warmup", args.warmup),
                                                  ("layer_seconds", args.layer_seconds),
                                                  ("collective_timeout", args.timeout)) if value is not None}
        check_hosts(args.hosts, args.nproc)
        check_output_path(args.output, "profile")  # before minutes of measuring, not after
        base = Profile.load(args.output) if args.only == "comm" and args.output.exists() else None
        config = ProfileConfig.at(
            effort, quick=quick, model=args.model, output=args.output, batch_size=args.batch_size,
            nproc=args.nproc, backend=args.backend, densities=densities, only_comm=args.only == "comm", base=base,
            kfac=args.kfac, max_dim=args.max_dim, link=args.link, kfac_skip=args.kfac_skip, slowdown=args.slowdown,
            powersgd_ranks=ranks, hosts=args.hosts, in_situ=args.calibrate, time_s=args.time, scope=scope,
            **given,
        )
        profile = run_profile(config)
        profile.save(args.output)
        print_profile(profile, details=args.details)
        skipped = skipped_topk_densities(base, profile) if base is not None else []
        if config.only_comm and skipped:
            err_console.print(
                f"note: --only comm did not time the top-k exchange merged inside hosts at densities "
                f"{', '.join(f'{d:g}' for d in skipped)}: how much a host's picks overlap was not measured on hosts "
                f"of {profile.hosts.per_host if profile.hosts else '?'} workers, and --model {args.model} is not "
                "the profiled model, so top-k groups cross hosts flat; pass the profile's --model, or profile again "
                "without --only", markup=False, soft_wrap=True)
        if config.only_comm and profile.interference:
            err_console.print("note: --only comm kept the interference (both ways) measured with the old network; "
                              "profile again without --only to measure it on this one", markup=False)
        console.print(f"wrote profile {args.output}"
                      + ("" if args.details else f" (all it measured: planner show {args.output} --details)"),
                      markup=False, soft_wrap=True)
        narrowed = ""
        if scope is not None:
            left_out = profile.topk_left_out.compressors if profile.topk_left_out is not None else ()
            narrowed = " --compressors " + ",".join(str(c) for c in scope.compressors if c not in left_out)
        console.print(f"next: planner solve {args.output}{narrowed} -o plan.json", markup=False, soft_wrap=True)
        return 0


def _powersgd_ranks(text: str) -> tuple[int, ...]:
    """`--powersgd-ranks`: "1,2,4" as (1, 2, 4), "none" as (). Each rank is read as the compressor powersgd:R is
    (`Compressor.parse`: ASCII digits; `str.isdigit` also takes "²", which `int` refuses)."""
    if text.strip().lower() == "none":
        return ()
    ranks = []
    for part in text.split(","):
        try:
            rank = Compressor.parse(f"powersgd:{part.strip()}").rank
        except CompressorError:
            raise PlannerError(f"--powersgd-ranks must list whole numbers in 1..{MAX_POWERSGD_RANK} (e.g. 1,2,4) or "
                               f"be none, but got {text!r}") from None
        assert rank is not None  # a PowerSGD compressor has one
        ranks.append(rank)
    return tuple(sorted(set(ranks)))
