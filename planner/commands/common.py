"""What the commands share: the `Command` base class and its registry, argument types and helpers, help
texts and `--strategy` names."""

from __future__ import annotations

import abc
import argparse
import json
import math
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from planner.commands.printing import print_race
from planner.console import console, err_console
from planner.contracts.plan import Plan
from planner.types import Compressor, CompressorKind, InverseMethod, PlannerError

#: `--strategy kfac`: dense gradient groups plus a K-FAC section.
KFAC = "kfac"
#: `--strategy abs`: dense gradient groups plus an ABS-SGD section (round trigger, micro-batch).
ABS = "abs"
COMPRESSORS_HELP = ("what a group may be sent as (the accuracy budget): a list of dense, fp16, powersgd:R, topk:D "
                    "(e.g. dense,fp16,powersgd:4,topk:0.01) or a preset: exact (dense), light (dense,fp16), lowrank "
                    "(light and powersgd at every rank the profile measured: 1,2,4 by default), all (lowrank and "
                    "topk:0.01); default light")

CLUSTER_HELP = (
    "plan for a cluster you describe: a preset (eth10-8, aws-p3-32, ib100-64, dgx-a100-512), a JSON file, "
    "key=value pairs (nodes, gpus_per_node, intra_gbps, intra_latency_us, inter_gbps, inter_latency_us, "
    "algorithm, compute_factor, world_size), PRESET,key=value,... or profile=PATH (a profile measured on "
    "another cluster)"
)

#: Columns `planner simulate` shows for K-FAC plans (the fusion:* and placement:* baselines are in --json).
KFAC_SCALING_COLUMNS = ("kfac-pytorch", "everywhere", "placement:spd-kfac", "sgd")


class Command(abc.ABC):
    """A subcommand: `configure` adds its arguments, `run` does the work and returns the exit status."""

    name: ClassVar[str]
    help: ClassVar[str]
    registry: ClassVar[dict[str, type[Command]]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        Command.registry[cls.name] = cls

    @abc.abstractmethod
    def configure(self, parser: argparse.ArgumentParser) -> None: ...

    @abc.abstractmethod
    def run(self, args: argparse.Namespace) -> int: ...


def _density(text: str) -> float:
    try:
        d = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"density must be a number in (0, 1], got {text!r}") from None
    if not 0 < d <= 1:
        raise argparse.ArgumentTypeError(f"`0 < density <= 1` must hold, but got {d}")
    return d


def _whole_number_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= `low`."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {v}")
        return v

    return parse


_positive = _whole_number_at_least(1)
_nonnegative_int = _whole_number_at_least(0)


def _nonnegative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return v


def _positive_float(text: str) -> float:
    v = _nonnegative_float(text)
    if v == 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return v


def _link_rate(text: str) -> Any:
    """`--link RATE`: a `planner.platform.link.LinkRate` (argparse turns a bad rate into one line and exit 2)."""
    from planner.platform.link import LinkError, parse_rate  # deferred (start-up)

    try:
        return parse_rate(text)
    except LinkError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--link ")) from None


LINK_HELP = ("emulate a slower network: each local worker in its own network namespace, its egress shaped to "
             "RATE (e.g. 1gbit, 200mbit, 10gbit); bandwidth only, needs root")


def _add_link(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link", type=_link_rate, default=None, metavar="RATE", help=LINK_HELP)


HOSTS_HELP = ("emulate H hosts: the --nproc workers split into H network namespaces of equal size, each with its "
              "own host name; workers of one host talk over its loopback, hosts over the --link RATE (unshaped "
              "without --link); needs root")


def _add_hosts(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", type=_positive, default=None, metavar="H", help=HOSTS_HELP)
    parser.add_argument("--intra-link", type=_link_rate, default=None, metavar="RATE",
                        help="with --hosts and --link: shape each emulated host's loopback too, to RATE shared by "
                             "its workers (e.g. 10gbit); unshaped without it")


def merge_intra_link(args: argparse.Namespace) -> None:
    """Fold `--intra-link` into `args.link` (a LinkRate, or None; `demo` parses its own and calls
    `intra_linked`), or one line (a PlannerError) saying what it needs."""
    if hasattr(args, "intra_link") and not isinstance(getattr(args, "link", None), str):
        args.link = intra_linked(getattr(args, "link", None), args.intra_link, getattr(args, "hosts", None))


def intra_linked(link: Any, intra: Any, hosts: int | None) -> Any:
    """`link` (a LinkRate or None) with `intra` as the rate inside each emulated host, when given."""
    if intra is None:
        return link
    if hosts is None:
        raise PlannerError("--intra-link shapes the loopback inside each emulated host: it needs --hosts H")
    if link is None:
        raise PlannerError("--intra-link needs --link RATE too: the rate between hosts, slower than inside one")

    return replace(link, intra=intra)


def check_hosts(hosts: int | None, nproc: int, workers: str = "--nproc {n}") -> None:
    """One line (a PlannerError) unless `--hosts` divides `--nproc` (or the `workers` named) into hosts of equal
    size."""
    if hosts is not None and nproc % hosts:
        divisors = [h for h in range(1, min(nproc, 64) + 1) if nproc % h == 0]
        named = workers.replace("{n}", str(nproc))
        raise PlannerError(f"--hosts {hosts} does not divide {named} into hosts of equal size: use one of "
                           f"{', '.join(map(str, divisors))}{' or another divisor' if nproc > 64 else ''}")


def _slowdown(text: str) -> Any:
    """`--slowdown RANK=FACTOR[,...]`: a `planner.platform.slowdown.Slowdown` (a bad one: one line, exit 2)."""
    from planner.platform.slowdown import SlowdownError, parse_slowdown  # deferred (start-up)

    try:
        return parse_slowdown(text)
    except SlowdownError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--slowdown: ").removeprefix("--slowdown ")) from None


SLOWDOWN_HELP = ("run local workers slower: RANK=FACTOR[,RANK=FACTOR...] (e.g. 1=2) puts each named worker under "
                 "a CPU quota of 1/FACTOR of a core (a cgroup v1 cpu group), so it computes about FACTOR times "
                 "slower; needs root")


def _add_slowdown(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slowdown", type=_slowdown, default=None, metavar="RANK=FACTOR", help=SLOWDOWN_HELP)


def _kfac_options(parser: argparse.ArgumentParser) -> None:
    """The K-FAC options of `planner simulate` and `planner tune` (`planner solve` has its own)."""
    kfac = parser.add_argument_group("K-FAC (--strategy kfac)")
    kfac.add_argument("--method", choices=[m.value for m in InverseMethod], default=InverseMethod.EIGEN.value)
    kfac.add_argument("--factor-update-steps", type=_positive, default=1)
    kfac.add_argument("--inv-update-steps", type=_positive, default=10)


def _peers(text: str | None) -> tuple:
    """`--peers`: the DDP hooks to run (fp16, powersgd:R), the default ones when not given, none for none."""
    from planner.sessions.bench import DEFAULT_PEERS  # deferred (start-up)

    if text is None:
        return DEFAULT_PEERS
    if text.strip().lower() == "none":
        return ()
    peers = tuple(dict.fromkeys(Compressor.parse(part) for part in text.split(",") if part.strip()))
    wrong = [str(c) for c in peers if c.kind not in (CompressorKind.FP16, CompressorKind.POWERSGD)]
    if wrong or not peers:
        raise PlannerError(f"--peers lists PyTorch's DDP hooks: fp16 and powersgd:R (e.g. fp16,powersgd:4) or none, "
                           f"but got {text!r}; the top-k hook runs for every top-k density a plan uses")
    return peers


def _batch_size(given: int | None, plans: tuple) -> int | None:
    """The per-worker batch a step bench runs: `--batch-size`, else the one the plans were profiled at (what their
    predictions are for; None: the model's default, for plans that do not record it)."""
    recorded = sorted({p.batch_size for p in plans if p.batch_size is not None})
    if given is not None:
        if recorded and recorded != [given]:
            err_console.print(f"note: --batch-size {given}, but the plans were profiled at batch "
                              f"{', '.join(map(str, recorded))}: their predictions are for that batch")
        return given
    if len(recorded) > 1:
        raise PlannerError(f"the plans were profiled at different batch sizes ({', '.join(map(str, recorded))}): "
                           f"bench them apart, or choose one with --batch-size")
    return recorded[0] if recorded else None


def _note_link_mismatch(plans: tuple, link: object) -> None:
    """Say so when a plan was made for another network than the bench runs on (its predictions assume that one)."""
    here = getattr(link, "label", None)
    for plan in plans:
        if plan.cluster.link != here:
            made = f"a {plan.cluster.link} link" if plan.cluster.link else "loopback (no --link)"
            runs = f"a {here} link" if here else "loopback"
            err_console.print(f"note: {plan.model.name} {plan.strategy.value} plan was made for {made}, the bench "
                              f"runs on {runs}: its predictions are for the network it was made for")


def _fraction(text: str) -> float:
    """`--margin`: a fraction in [0, 1) (0.02 is 2%)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.02 (2%), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1) such as 0.02 (2%), got {text!r}")
    return value


#: Where races are logged by default (`--race-log`): the pairs the model's error is calibrated from.
DEFAULT_RACE_LOG = Path("runs") / "races.json"


def add_race_log(parser: argparse.ArgumentParser | Any, what: str) -> None:
    """`--race-log FILE`: the races run here (`planner.contracts.race_log`)."""
    parser.add_argument("--race-log", type=Path, default=None, metavar="FILE",
                        help=f"the log of the races run here, {what} (default runs/races.json)")


def race_log_path(given: Path | None) -> Path:
    """`--race-log`, or the default (read when called: tests move it)."""
    return given if given is not None else DEFAULT_RACE_LOG


def add_race_flags(parser: argparse.ArgumentParser | Any, *, race_time: float = 60.0) -> None:
    """The race's rule and budget (`planner race`, `planner solve --race`), and its log."""
    parser.add_argument("--margin", type=_fraction, default=0.02,
                        help="the practical margin: a less simple arm is kept only when it is faster than every "
                             "other by more than this (default 0.02, 2%%)")
    parser.add_argument("--race-time", type=_nonnegative_float, default=race_time, metavar="S",
                        help=f"seconds of racing after the warm-up; then the simplest arm not beaten is kept "
                             f"(default {race_time:g}; 0: after one round)")
    parser.add_argument("--block", type=_positive, default=2, help="steps each arm runs per round (default 2)")
    parser.add_argument("--warmup", type=_nonnegative_int, default=5, help="unmeasured steps per arm (default 5)")
    add_race_log(parser, "where the race is added and the model's error calibrated from the races before it")


def allowed_hooks(plan: Plan) -> tuple:
    """PyTorch's DDP hooks (fp16, PowerSGD) of what the plan's solve was allowed to send: those its verdict weighed
    it against (within its error budget), else a mixed plan's allowed compressors; `DEFAULT_PEERS` for a dense or
    top-k plan without a verdict (its solve was allowed no hook's compressor). These race beside it unless `--peers`
    says otherwise."""
    if plan.verdict is not None:
        hooks = [Compressor.parse(name.removeprefix("ddp+")) for name in plan.verdict.variants
                 if name.startswith("ddp+") and name not in plan.verdict.beyond_budget]
    elif plan.compressors is not None:
        hooks = list(plan.compressors)
    else:
        return _peers(None)
    return tuple(c for c in hooks if c.kind in (CompressorKind.FP16, CompressorKind.POWERSGD))


def check_race_request(args: argparse.Namespace, *, abs_plan: bool, where: str) -> None:
    """Refuse `--race` where it cannot run, in one line: an ABS-SGD plan (its variants run to a target loss in
    `planner bench --strategy abs`, not step by step), and a `--cluster` what-if plan (`where`: whose workers the race
    would run on)."""
    if not getattr(args, "race", False):
        return
    if abs_plan:
        raise PlannerError("--race races gradient and K-FAC plans; an ABS-SGD plan's variants differ in how many "
                           "samples a round takes, not in its steps' time: bench it with `planner bench --strategy "
                           "abs`")
    if args.cluster is not None:
        raise PlannerError(f"--race runs the plan on {where}; a --cluster what-if plan is for another cluster: race "
                           "it there")


def race_plan_file(path: Any, args: argparse.Namespace, *, link: Any, hosts: int | None, slowdown: Any = None,
                   model: str | None = None, batch_size: int | None = None, nproc: int | None = None,
                   peers: str | None = None, as_json: bool = False) -> int:
    """Race the finalists of the plan in the file `path` with `args`' rule and budget (`add_race_flags`): a gradient
    plan's (`planner.sessions.race`: DDP, its hooks, the plan both ways, its runners-up) or a K-FAC plan's
    (`planner.sessions.race_kfac`: the plan's layout and kfac-pytorch's). Write the race into the file (`with_race`:
    a runner-up or layout the race kept becomes the file's plan), and print it, or its JSON with `as_json`. The DDP
    hooks that race: `peers` (`--peers`), by default those of what the plan's solve was allowed
    (`allowed_hooks`)."""
    from planner.contracts.jsonio import check_output_path  # deferred (start-up)
    from planner.platform.launch import under_torchrun  # deferred (start-up)
    from planner.sessions.bench import file_labels  # deferred (start-up)
    from planner.sessions.race import RaceConfig, beyond_budget, log_race, run_race, with_race  # deferred (start-up)
    from planner.sessions.race_kfac import run_kfac_race, with_kfac_race  # deferred (start-up)
    from planner.strategies.model_error import ModelError  # deferred (start-up)
    from planner.strategies.race_rule import race_summary, too_short  # deferred (start-up)

    check_output_path(path, "plan")  # the race is recorded in it: refused now, not after the race
    plans = (Plan.load(path),)
    if plans[0].abs is not None:
        raise PlannerError(f"{path} is an ABS-SGD plan: the race runs gradient and K-FAC plans; bench an ABS-SGD "
                           "plan with `planner bench --strategy abs`")
    kfac = plans[0].kfac is not None
    if under_torchrun():
        nproc = int(os.environ["WORLD_SIZE"])
    nproc = nproc or plans[0].cluster.world_size
    check_hosts(hosts, nproc)
    config = RaceConfig(
        plans=plans, model=model or plans[0].model.name, batch_size=_batch_size(batch_size, plans), nproc=nproc,
        block=args.block, warmup=args.warmup, margin=args.margin, race_time_s=args.race_time,
        peers=_peers(peers) if peers is not None else allowed_hooks(plans[0]),
        show_progress=not as_json, link=link, slowdown=slowdown, hosts=hosts, labels=file_labels(plans, [path]))
    _note_link_mismatch(plans, link)
    if beyond := sorted(beyond_budget(plans)):
        console.print(f"note: {', '.join(beyond)} do not race: their error is beyond the plan's budget",
                      markup=False, soft_wrap=True)
    record = run_kfac_race(config) if kfac else run_race(config)
    if record is None:  # a torchrun rank other than 0: rank 0 prints and records
        return 0
    plan = with_kfac_race(plans[0], record) if kfac else with_race(plans[0], record)
    plan.save(path)
    log = race_log_path(args.race_log)
    # From the races before this one, against the same reference.
    error = ModelError.of(log_race(log, plans[0], record, link).races, reference=record.reference)
    if as_json:
        print(json.dumps({**record.to_dict(), "summary": race_summary(record)}, indent=2))
        return 0
    print_race(record, model_error=error, calibrated=True)
    if (note := too_short(record)) is not None:
        console.print(note, markup=False, soft_wrap=True)
    changed = plan.groups != plans[0].groups or plan.kfac != plans[0].kfac
    promoted = f"; its plan is now {record.kept}, the one the race kept" if changed else ""
    console.print(f"recorded the race in {path}{promoted}, and in the race log {log}", markup=False,
                  soft_wrap=True)
    return 0
