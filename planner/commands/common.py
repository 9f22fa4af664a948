"""What the commands share: the `Command` base class and its registry, argument types and helpers, help
texts and `--strategy` names."""

from __future__ import annotations

import abc
import argparse
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

from planner.console import err_console
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
