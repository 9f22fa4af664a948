"""The `planner` command line. Each subcommand is a `Command` subclass; defining one registers it.

Errors the planner raises on purpose (PlannerError) become one line on stderr and exit status 2.
"""

from __future__ import annotations

import abc
import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, NoReturn

from rich.table import Table

from planner.console import console, err_console, progress
from planner.contracts.abs import TRIGGERS
from planner.contracts.jsonio import check_output_path, ensure_folder
from planner.types import GROUPING_STRATEGIES, InverseMethod, PlannerError, RemoteTraceback, Strategy

__all__ = ["Command", "main"]

#: `--strategy kfac`: dense gradient groups plus a K-FAC section.
KFAC = "kfac"
#: `--strategy abs`: dense gradient groups plus an ABS-SGD section (round trigger, micro-batch).
ABS = "abs"
CROSSOVER = "crossover"
#: `--strategy auto`: every allowed way of sending solved, the plan predicted fastest kept.
AUTO = "auto"
COMPRESSORS_HELP = ("what a group may be sent as (the accuracy budget): a list of dense, fp16, powersgd:R, topk:D "
                    "(e.g. dense,fp16,powersgd:4,topk:0.01) or a preset: exact (dense), light (dense,fp16), lowrank "
                    "(light and powersgd:1,2,4), all (lowrank and topk:0.01); default light")

CLUSTER_HELP = (
    "plan for a cluster you describe: a preset (eth10-8, aws-p3-32, ib100-64, dgx-a100-512), a JSON file, "
    "key=value pairs (nodes, gpus_per_node, intra_gbps, intra_latency_us, inter_gbps, inter_latency_us, "
    "algorithm, compute_factor, world_size), PRESET,key=value,... or profile=PATH (a profile measured on "
    "another cluster)"
)


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


# -- shared argument types and printing -------------------------------------------------------------

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
    from planner.platform.link import LinkError, parse_rate

    try:
        return parse_rate(text)
    except LinkError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--link ")) from None


LINK_HELP = ("emulate a slower network: each local worker in its own network namespace, its egress shaped to "
             "RATE (e.g. 1gbit, 200mbit, 10gbit); bandwidth only, needs root")


def _add_link(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link", type=_link_rate, default=None, metavar="RATE", help=LINK_HELP)


def _slowdown(text: str) -> Any:
    """`--slowdown RANK=FACTOR[,...]`: a `planner.platform.slowdown.Slowdown` (a bad one: one line, exit 2)."""
    from planner.platform.slowdown import SlowdownError, parse_slowdown

    try:
        return parse_slowdown(text)
    except SlowdownError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--slowdown: ").removeprefix("--slowdown ")) from None


SLOWDOWN_HELP = ("run local workers slower: RANK=FACTOR[,RANK=FACTOR...] (e.g. 1=2) puts each named worker under "
                 "a CPU quota of 1/FACTOR of a core (a cgroup v1 cpu group), so it computes about FACTOR times "
                 "slower; needs root")


def _add_slowdown(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slowdown", type=_slowdown, default=None, metavar="RANK=FACTOR", help=SLOWDOWN_HELP)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def print_plan(plan: object, title: str | None = None) -> None:
    """The comparison table of a plan: the plan, each baseline and the lower bound, under the same model."""
    from planner.contracts.plan import Plan

    assert isinstance(plan, Plan)
    ref = plan.baselines.get("ddp-25mb", plan.predicted).iteration_s
    lb = plan.lower_bound_s
    tag = plan.strategy.value
    if plan.strategy is Strategy.TOPK:
        tag += f" (density {plan.density:g}, {plan.selector} selector)"
    if plan.strategy is Strategy.MIXED:
        used = dict.fromkeys(str(plan.compressor_of(g)) for g in plan.groups)
        allowed = ", ".join(map(str, plan.compressors)) if plan.compressors else "not recorded"
        tag += f" (sends {', '.join(used)}; allowed {allowed})"
    table = Table(title=title or f"{plan.model.name}: {tag} plan, {plan.cluster.describe()}")
    for col in ("grouping", "groups", "iteration ms", "exposed comm ms", "vs ddp-25mb", "gap to bound"):
        table.add_column(col, justify="left" if col == "grouping" else "right")
    rows = [(f"plan ({plan.solver})", plan.predicted), *plan.baselines.items()]
    for name, p in rows:
        table.add_row(
            name, str(p.num_groups), _ms(p.iteration_s), _ms(p.exposed_comm_s),
            f"{ref / p.iteration_s:.2f}x", f"{(p.iteration_s - lb) / lb:+.1%}" if lb > 0 else "-",
            style="bold" if name.startswith("plan") else None,
        )
    table.add_row("lower bound", "", _ms(lb), "", f"{ref / lb:.2f}x" if lb > 0 else "-", "")
    console.print(table)
    console.print(
        f"solver {plan.solver} took {plan.solve_seconds * 1e3:.1f} ms; "
        f"profile {plan.source_profile or '?'} measured {plan.profiled}"
    )
    if plan.kfac is not None:
        print_kfac(plan)
    if plan.abs is not None:
        print_abs(plan)


def print_abs(plan: object) -> None:
    """ABS-SGD's trigger, and its predictions beside the synchronous baselines'."""
    from planner.contracts.plan import Plan

    assert isinstance(plan, Plan) and plan.abs is not None
    a = plan.abs
    cap = "no cap" if a.max_micro_batches is None else f"at most {a.max_micro_batches}"
    trigger = (f"rounds of {a.round_samples} samples, split by measured speed" if a.round_samples is not None
               else f"a round ends after at least {a.min_micro_batches} once the previous exchange is done ({cap})")
    table = Table(title=f"ABS-SGD, global batch {a.global_batch}: micro-batches of {a.micro_batch}, {trigger}")
    for col in ("variant", "round ms", "samples/round", "samples/s", "vs sync-equal", "share per worker",
                "idle per worker"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    ref = a.predicted["sync-equal"].samples_per_s
    for name, p in a.predicted.items():
        table.add_row(name, _ms(p.round_s), f"{sum(p.samples):,.1f}", f"{p.samples_per_s:,.0f}",
                      f"{p.samples_per_s / ref:.2f}x", " / ".join(f"{s:.0%}" for s in p.shares),
                      " / ".join(f"{f:.0%}" for f in p.idle_fraction), style="bold" if name == "abs-sgd" else None)
    console.print(table)
    from planner.strategies.abs import ON_TARGET

    rounds = sum(a.predicted["abs-sgd"].samples)
    if rounds > ON_TARGET * a.global_batch:
        console.print(f"note: ABS-SGD's rounds hold {rounds:,.0f} samples, more than {ON_TARGET:g}x the global batch "
                      f"{a.global_batch}: the exchange takes longer than the workers need for {a.global_batch} "
                      "samples, so the rounds grow to hide it (a larger --global-batch matches them)")


def print_kfac(plan: object) -> None:
    """The K-FAC comparison: average step time of the plan, each baseline and the lower bound."""
    from planner.contracts.plan import Plan

    assert isinstance(plan, Plan) and plan.kfac is not None
    k = plan.kfac
    if k.predicted is None:
        console.print("the kfac section has no predictions")
        return
    baselines = k.baselines or {}
    ref = baselines.get("kfac-pytorch", k.predicted).step_s
    lb = k.lower_bound_s or 0.0
    table = Table(title=f"K-FAC ({k.method.value}, factors every {k.factor_update_steps} step(s), inverses every "
                        f"{k.inv_update_steps}): predicted average step")
    for col in ("layout", "buffers", "step ms", "factor step ms", "inversion ms", "broadcast ms",
                "precondition ms", "vs kfac-pytorch", "gap to bound"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for name, p in [("plan", k.predicted), *baselines.items()]:
        pre = "-" if p.precondition_s is None or name == "sgd" else _ms(p.precondition_s)
        table.add_row(
            name, str(p.num_buffers), _ms(p.step_s), _ms(p.factor_step_s), _ms(p.inversion_s), _ms(p.broadcast_s),
            pre, f"{ref / p.step_s:.2f}x", f"{(p.step_s - lb) / lb:+.1%}" if lb > 0 and name != "sgd" else "-",
            style="bold" if name == "plan" else None,
        )
    table.add_row("lower bound", "", _ms(lb), "", "", "", "", f"{ref / lb:.2f}x" if lb > 0 else "-", "")
    console.print(table)
    owners = list(k.owners.values())
    everywhere = sum(o is None for o in owners)
    placed = sum(r is not None for r in k.preconditioners.values())
    gap = "proven optimal" if not k.placement_gap else f"gap {k.placement_gap:.2%}"
    console.print(
        f"{len(k.a_buffers)} A + {len(k.g_buffers)} G buffers ({k.fusion_solver}), factors sent "
        f"{k.describe_messages()}; {len(owners) - everywhere} "
        f"factors on one owner, {everywhere} everywhere; {placed} of {len(k.preconditioners)} layers "
        f"preconditioned by one worker, the rest by all ({k.placement_solver}, {gap}); "
        f"K-FAC solve {k.solve_seconds * 1e3:.1f} ms. 'sgd' is the same step without K-FAC."
    )


#: How far the bench's local steps may be from the profile's before `planner bench` says the machine drifted.
DRIFT_TOLERANCE = 0.05


def print_bench(results: list, as_json: bool, title: str | None = None, lower_bound_s: float | None = None) -> None:
    """The bench table; `lower_bound_s`: a last row with the model's lower bound (no variant can predict less)."""
    if as_json:
        console.print_json(json.dumps([r.to_dict() for r in results]))
        return
    table = Table(title=title or "bench: median step time over measured steps (slowest rank per step)")
    reference = results[0].reference if results else "ddp"
    for col in ("variant", "median ms", "p25-p75 ms", f"speedup vs {reference}", "predicted ms",
                "|pred-meas|/meas"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in results:
        table.add_row(
            r.name, _ms(r.median_s), f"{_ms(r.p25_s)}-{_ms(r.p75_s)}",
            f"{r.speedup:.2f}x" if r.speedup is not None else "-",
            _ms(r.predicted_s) if r.predicted_s is not None else "-",
            f"{r.rel_error:.1%}" if r.rel_error is not None else "-",
        )
    if lower_bound_s is not None:
        table.add_row("lower bound (model)", "", "", "", _ms(lower_bound_s), "")
    console.print(table)
    from planner.commands.bench import LOCAL, machine_drift

    drift = machine_drift(results)
    if drift is not None and abs(drift) > DRIFT_TOLERANCE:
        err_console.print(f"note: the {LOCAL} steps ran {abs(drift):.0%} {'slower' if drift > 0 else 'faster'} than "
                          "the profile predicts: this machine is busier or quieter than when it was profiled, and "
                          "every prediction is off by about as much", markup=False)


# -- commands ----------------------------------------------------------------------------------------

class ModelsCommand(Command):
    name = "models"
    help = "list the built-in models"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        pass

    def run(self, args: argparse.Namespace) -> int:
        from planner.models import BUILTIN_MODELS, DEFAULT_MODEL

        table = Table(title="built-in models (or --model package.module:factory returning a planner.models.Workload)")
        table.add_column("name")
        table.add_column("description")
        for name, desc in BUILTIN_MODELS.items():
            table.add_row(name + (" (default)" if name == DEFAULT_MODEL else ""), desc)
        console.print(table)
        return 0


class ProfileCommand(Command):
    name = "profile"
    help = "measure per-layer compute, collectives and top-k costs on N workers; write a profile"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        from planner.models import DEFAULT_MODEL

        parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name or package.module:factory")
        parser.add_argument("--batch-size", type=_positive, default=None, help="per-worker batch (model default)")
        parser.add_argument("--nproc", type=_positive, default=2,
                            help="local workers to start (ignored under torchrun)")
        parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
        parser.add_argument("--repeats", type=_positive, default=10, help="measured iterations per layer")
        parser.add_argument("--warmup", type=_nonnegative_int, default=3, help="unmeasured iterations first")
        parser.add_argument("--densities", default="0.001,0.01,0.1,1.0", help="top-k densities to measure")
        parser.add_argument("--powersgd-ranks", default="1,2,4", metavar="LIST",
                            help="PowerSGD ranks to measure (with fp16), e.g. 1,2,4; none: measure neither")
        parser.add_argument("--only", choices=["comm"], default=None, help="re-measure only the network of -o")
        parser.add_argument("--kfac", action="store_true",
                            help="also measure K-FAC costs (factors, preconditioning, inversion against dimension)")
        parser.add_argument("--max-dim", type=_positive, default=2048,
                            help="largest matrix the K-FAC inversion sweep measures; larger ones scale as d^3")
        parser.add_argument("--kfac-skip", metavar="REGEX", default=None,
                            help="K-FAC layers to leave out (names matched with re.search), e.g. an unused head; "
                                 "pass the same skip_layers= to KFACPreconditioner")
        _add_link(parser)
        _add_slowdown(parser)
        parser.add_argument("-o", "--output", type=Path, required=True, help="profile file to write")

    def run(self, args: argparse.Namespace) -> int:
        from planner.commands.profile import ProfileConfig, run_profile
        from planner.contracts.profile import Profile

        if args.kfac_skip is not None:
            if not args.kfac:
                raise PlannerError("--kfac-skip applies to --kfac only")
            try:
                re.compile(args.kfac_skip)
            except re.error as exc:
                raise PlannerError(
                    f"--kfac-skip is not a valid regular expression ({exc}): {args.kfac_skip!r}"
                ) from None
        try:
            densities = tuple(_density(d) for d in args.densities.split(","))
        except argparse.ArgumentTypeError as exc:
            raise PlannerError(f"--densities: {exc}") from None
        ranks = _powersgd_ranks(args.powersgd_ranks)
        check_output_path(args.output, "profile")  # before minutes of measuring, not after
        base = Profile.load(args.output) if args.only == "comm" and args.output.exists() else None
        config = ProfileConfig(
            model=args.model, output=args.output, batch_size=args.batch_size, nproc=args.nproc,
            backend=args.backend, repeats=args.repeats, warmup=args.warmup, densities=densities,
            only_comm=args.only == "comm", base=base, kfac=args.kfac, max_dim=args.max_dim, link=args.link,
            kfac_skip=args.kfac_skip, slowdown=args.slowdown, powersgd_ranks=ranks,
        )
        profile = run_profile(config)
        profile.save(args.output)
        print_profile(profile)
        if config.only_comm and profile.interference:
            err_console.print("note: --only comm kept the interference measured with the old network; profile "
                              "again without --only to measure it on this one", markup=False)
        console.print(f"wrote profile {args.output}")
        return 0


def _powersgd_ranks(text: str) -> tuple[int, ...]:
    """`--powersgd-ranks`: "1,2,4" as (1, 2, 4), "none" as ()."""
    from planner.types import MAX_POWERSGD_RANK

    if text.strip().lower() == "none":
        return ()
    ranks = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or len(part) > 5 or not 1 <= int(part) <= MAX_POWERSGD_RANK:
            raise PlannerError(f"--powersgd-ranks must list whole numbers in 1..{MAX_POWERSGD_RANK} (e.g. 1,2,4) or "
                               f"be none, but got {text!r}")
        ranks.append(int(part))
    return tuple(sorted(set(ranks)))


def print_rows(rows: list[dict], title: str) -> None:
    """A table of dict rows with the same keys (floats to 4 significant digits)."""
    table = Table(title=title)
    for col in rows[0]:
        table.add_column(str(col))
    for r in rows:
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()))
    console.print(table)


#: How far the sum of a profile's parts may be from its whole steps before `planner profile` warns.
PARTS_TOLERANCE = 0.10


def print_profile(profile: object) -> None:
    from planner.contracts.profile import MAX_FIT_ERROR, Profile

    assert isinstance(profile, Profile)
    console.print(profile.model.describe(), style="bold")
    console.print(
        f"{profile.cluster.describe()}, batch {profile.batch_size}/worker, "
        f"torch {profile.torch_version}, measured {profile.created}\n"
        f"forward {_ms(profile.forward_s)} ms, backward {_ms(profile.backward_s)} ms, "
        f"update {_ms(profile.update_s)} ms, {len(profile.layers)} layers"
    )
    if profile.parts_error is not None:
        assert profile.step_s is not None
        line = (f"whole local steps {_ms(profile.step_s)} ms; sum of the parts (forward + per-layer backward + "
                f"update) {_ms(profile.parts_s)} ms, off by {profile.parts_error:.1%}")
        if profile.parts_error > PARTS_TOLERANCE:
            err_console.print(f"warning: {line}: predictions from this profile will be off as much; profile "
                              "again on a quieter machine, or with more --repeats and --warmup", markup=False)
        else:
            console.print(line)
    if profile.throughput is not None:
        tp = profile.throughput
        rates = "; ".join(
            f"rank {r}: " + ", ".join(f"{rate:,.0f}" for rate in tp.samples_per_s(r)) for r in range(len(tp.step_s))
        )
        console.print(f"each worker's samples/s at micro-batches {', '.join(map(str, tp.batch_sizes))} (forward and "
                      f"backward alone): {rates}; fastest/slowest {tp.spread:.2f}x")
    if profile.interference:
        slower = ", ".join(f"{sigma:.2f} with an {coll.value}" for coll, sigma in profile.interference.items())
        console.print(f"compute while communicating: the backward pass runs 1 + sigma times slower while a "
                      f"collective is in flight, sigma = {slower}")
    if profile.pack is not None:
        console.print(f"packing a dense group: {profile.pack.alpha_s * 1e6:.1f} us + "
                      f"{profile.pack.beta_s_per_byte * 1e9:.3f} ns per element (median fit error "
                      f"{profile.pack.fit_error:.1%})")
    if profile.compress is not None:
        comp = profile.compress
        shapes = {row.shapes for row in comp.powersgd}
        ranks = ", ".join(map(str, comp.ranks())) or "none"
        console.print(f"fp16: cast {comp.fp16_cast.beta_s_per_byte * 1e9:.3f} ns and back "
                      f"{comp.fp16_uncast.beta_s_per_byte * 1e9:.3f} ns per element; PowerSGD measured at ranks "
                      f"{ranks} on {len(shapes)} distinct layer shapes")
    if profile.in_situ is not None:
        situ = profile.in_situ
        parts = [("packing", situ.pack), *((f"{n} selection", c) for n, c in situ.select.items()),
                 ("decoding", situ.decode), ("DDP's bucket copies", situ.ddp_pack),
                 *((f"PyTorch's {name.removeprefix('ddp+')} hook on DDP" if name.startswith("ddp+") else
                    f"{name} {'compression' if part == 'prepare' else 'decompression'}", c)
                   for name, calibrations in situ.compress.items() for part, c in calibrations.items())]
        shown = ", ".join(f"{what} {c.factor:.2f}x ({_ms(c.measured_s)} ms measured / {_ms(c.modelled_s)} ms "
                          "micro-benchmarked)" for what, c in parts if c is not None)
        console.print(f"in real steps (one group per layer, nothing sent): {shown}")
    table = Table(title="collectives: alpha + beta * bytes, fitted (used where it holds at every point) "
                        "or interpolated")
    for col in ("collective", "alpha us", "bandwidth GB/s", "median fit error", "worst", "model used", "points"):
        table.add_column(col, justify="left" if col == "collective" else "right")
    for coll, curve in profile.collectives.items():
        bw = 1 / curve.beta_s_per_byte / 1e9 if curve.beta_s_per_byte > 0 else float("inf")
        used = "fit" if curve.worst_error <= MAX_FIT_ERROR else "interpolated"
        table.add_row(coll.value, f"{curve.alpha_s * 1e6:.1f}", f"{bw:.2f}", f"{curve.fit_error:.1%}",
                      f"{curve.worst_error:.1%}", used, str(len(curve.points)))
    console.print(table)
    if profile.kfac is not None:
        kf = profile.kfac
        table = Table(title="K-FAC: factor work per layer (forward order) and inversion against dimension d")
        for col in ("layer", "A dim", "G dim", "A ms", "G ms", "fold ms", "precond eigen ms", "precond inverse ms"):
            table.add_column(col, justify="left" if col == "layer" else "right")
        for lt in kf.layers:
            table.add_row(lt.name, str(lt.a_dim), str(lt.g_dim), _ms(lt.a_compute_s), _ms(lt.g_compute_s),
                          _ms(lt.fold_s), _ms(lt.precondition_eigen_s), _ms(lt.precondition_inverse_s))
        console.print(table)
        for name, dc in (("eigen", kf.eigen), ("inverse", kf.inverse)):
            used = "fit" if dc.worst_error <= MAX_FIT_ERROR else "interpolated"
            pts = ", ".join(f"{d}: {_ms(t)}" for d, t in dc.points)
            console.print(f"{name}: alpha {_ms(dc.alpha_s)} ms + {dc.beta_s_per_dim3 * 1e9:.3g} ns * d^3 "
                          f"(median fit error {dc.fit_error:.1%}, worst {dc.worst_error:.1%}, {used}); "
                          f"measured ms at d = {pts}")


class SolveCommand(Command):
    name = "solve"
    help = "turn a profile into an optimal plan and compare it with the baselines"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("profile", type=Path, help="profile file from `planner profile`")
        parser.add_argument("--strategy", choices=[*(s.value for s in Strategy), AUTO, KFAC, ABS],
                            default=Strategy.DENSE.value,
                            help="gradient exchange: dense, topk, mixed (a compressor per group, from --compressors), "
                                 "auto (each of those the compressors allow, the fastest kept); kfac: dense gradients "
                                 "plus a K-FAC section; abs: ABS-SGD for workers of different speeds (needs "
                                 "--global-batch)")
        parser.add_argument("--density", type=_density, default=None, help="top-k density (default 0.01)")
        parser.add_argument("--compressors", default=None, metavar="LIST|PRESET",
                            help=f"--strategy mixed and auto: {COMPRESSORS_HELP}")
        # Checked in run(), not by argparse `choices`, so a bad name is one line (no usage block).
        parser.add_argument("--selector", default="auto", metavar="{auto,exact,sampled}",
                            help="top-k selector: exact torch.topk, sampled threshold, or auto (default): the one "
                                 "predicted faster from the profile's measurements")
        kfac = parser.add_argument_group("K-FAC (--strategy kfac)")
        kfac.add_argument("--method", choices=[m.value for m in InverseMethod], default=InverseMethod.EIGEN.value,
                          help="eigendecomposition (default) or damped inverse of each factor")
        kfac.add_argument("--factor-update-steps", type=_positive, default=None,
                          help="steps between factor updates (default 1)")
        kfac.add_argument("--inv-update-steps", type=_positive, default=None,
                          help="steps between inverse updates, a multiple of the factor interval (default 10)")
        kfac.add_argument("--placement-solver", choices=["cp-sat", "ilp-cbc"], default="cp-sat",
                          help="exact placement model in OR-Tools CP-SAT (default) or pulp/CBC")
        parser.add_argument("--time-limit", type=float, default=None,
                            help="seconds for the exact K-FAC placement (default 2) or the mixed search (default 1); "
                                 "past them the best solution found is kept, with its gap to the lower bound")
        abs_sgd = parser.add_argument_group("ABS-SGD (--strategy abs)")
        abs_sgd.add_argument("--global-batch", type=_positive, default=None,
                             help="samples per round to aim at, summed over the workers (the synchronous "
                                  "baselines split it per iteration)")
        abs_sgd.add_argument("--trigger", choices=TRIGGERS, default=None,
                             help="how rounds end: 'batch' (default) rounds of --global-batch split by measured "
                                  "speed; 'exchange' once the previous exchange is done (the paper's rule: rounds "
                                  "grow to hide a slow exchange, up to 1.25x); 'best' whichever is predicted faster")
        parser.add_argument("--cluster", default=None, metavar="SPEC", help=CLUSTER_HELP)
        parser.add_argument("-o", "--output", type=Path, required=True, help="plan file to write")

    def run(self, args: argparse.Namespace) -> int:
        from planner.contracts.profile import Profile
        from planner.strategies.gradients import make_plan

        is_kfac = args.strategy == KFAC
        is_abs = args.strategy == ABS
        is_auto = args.strategy == AUTO
        is_mixed = args.strategy == Strategy.MIXED.value
        if is_abs and args.global_batch is None:
            raise PlannerError("--strategy abs needs --global-batch B: the samples per round, summed over the "
                               "workers (e.g. the batch you train with now)")
        if not is_abs and args.global_batch is not None:
            raise PlannerError("--global-batch applies to --strategy abs only")
        if not is_abs and args.trigger is not None:
            raise PlannerError("--trigger applies to --strategy abs only")
        if is_abs and args.cluster is not None:
            raise PlannerError("--cluster does not apply to --strategy abs: its plan needs each worker's measured "
                               "speed; profile the cluster itself (with --slowdown to emulate slower workers)")
        if not is_kfac:
            kfac_only = [("--factor-update-steps", args.factor_update_steps),
                         ("--inv-update-steps", args.inv_update_steps)]
            given = [flag for flag, value in kfac_only if value is not None]
            if given:
                raise PlannerError(f"{given[0]} applies to --strategy kfac only")
        if args.compressors is not None and not (is_mixed or is_auto):
            raise PlannerError("--compressors applies to --strategy mixed and auto only")
        if args.time_limit is not None and not (is_kfac or is_mixed or is_auto):
            raise PlannerError("--time-limit applies to --strategy kfac, mixed and auto only")
        if args.time_limit is not None and not (math.isfinite(args.time_limit) and args.time_limit > 0):
            raise PlannerError(f"`--time-limit > 0` must hold, but got {args.time_limit}")
        strategy = Strategy.DENSE if is_kfac or is_abs or is_auto else Strategy(args.strategy)
        if args.density is not None and strategy is not Strategy.TOPK:
            hint = "; name top-k in --compressors instead (e.g. topk:0.01)" if is_mixed or is_auto else ""
            raise PlannerError(f"--density applies to --strategy topk only{hint}")
        from planner.contracts.plan import SELECTORS

        if args.selector not in ("auto", *SELECTORS):
            raise PlannerError(f"--selector must be one of auto, {', '.join(SELECTORS)}, but got {args.selector!r}")
        compressors = None
        if is_mixed or is_auto:
            from planner.strategies.mixed import parse_compressors

            compressors = parse_compressors(args.compressors or "light")
        topk_allowed = strategy is Strategy.TOPK or any(c.kind.value == "topk" for c in compressors or ())
        if args.selector != "auto" and not topk_allowed:
            raise PlannerError("--selector applies to top-k plans only (--strategy topk, or topk:D in --compressors)")
        density = (args.density or 0.01) if strategy is Strategy.TOPK else None
        check_output_path(args.output, "plan")
        profile = Profile.load(args.profile)
        if args.cluster is not None:
            from planner.strategies.cluster import parse_cluster, profile_for_cluster

            spec = parse_cluster(args.cluster)
            profile = profile_for_cluster(profile, spec)
            console.print(f"what-if cluster {spec.describe()}")
        selector = None if args.selector == "auto" else args.selector
        if is_kfac:
            from planner.strategies.kfac import (
                DEFAULT_FACTOR_UPDATE_STEPS,
                DEFAULT_INV_UPDATE_STEPS,
                make_kfac_plan,
            )

            plan = make_kfac_plan(
                profile,
                method=InverseMethod(args.method),
                factor_update_steps=args.factor_update_steps or DEFAULT_FACTOR_UPDATE_STEPS,
                inv_update_steps=args.inv_update_steps or DEFAULT_INV_UPDATE_STEPS,
                placement_solver=args.placement_solver,
                time_limit_s=args.time_limit or 2.0,
                source=str(args.profile),
            )
        elif is_abs:
            from planner.strategies.abs import make_abs_plan

            plan = make_abs_plan(profile, args.global_batch, trigger=args.trigger or "batch",
                                 source=str(args.profile))
        elif is_auto:
            from planner.strategies.mixed import solve_auto

            assert compressors is not None
            choice = solve_auto(profile, compressors, source=str(args.profile), selector=selector,
                                time_limit_s=args.time_limit or 1.0)
            print_auto(choice)
            plan = choice.plan
        elif is_mixed:
            from planner.strategies.mixed import make_mixed_plan

            assert compressors is not None
            plan = make_mixed_plan(profile, compressors, source=str(args.profile), selector=selector,
                                   time_limit_s=args.time_limit or 1.0)
        else:
            plan = make_plan(profile, strategy, density, source=str(args.profile), selector=selector)
        plan.save(args.output)
        print_plan(plan)
        if plan.strategy is Strategy.MIXED:
            print_mixed_groups(plan, profile)
        console.print(f"wrote plan {args.output}")
        return 0


def print_auto(choice: object) -> None:
    """The strategies `--strategy auto` solved, their predicted iterations, and which it kept."""
    from planner.strategies.mixed import AutoChoice, ddp_predictions

    assert isinstance(choice, AutoChoice)
    ddp = ddp_predictions(choice.candidates)
    reference = ddp.get("ddp")
    table = Table(title="--strategy auto: every allowed way of sending, solved exactly, beside DDP and its hooks "
                        "(predicted iteration)")
    for col in ("candidate", "iteration ms", "vs ddp", ""):
        table.add_column(col, justify="left" if col in ("candidate", "") else "right")

    def ratio(seconds: float) -> str:
        return "" if reference is None else f"{reference / seconds:.2f}x"

    for name, plan in choice.candidates.items():
        kept = plan is choice.plan
        table.add_row(name, _ms(plan.predicted.iteration_s), ratio(plan.predicted.iteration_s),
                      "kept" if kept else "", style="bold" if kept else None)
    for name, seconds in ddp.items():
        faster = choice.ddp_faster is not None and choice.ddp_faster[0] == name
        table.add_row(name, _ms(seconds), ratio(seconds), "faster than every plan" if faster else "", style="dim")
    console.print(table)
    console.print(choice.reason)


def print_mixed_groups(plan: object, profile: object) -> None:
    """Which compressor each group of a mixed plan got, and what switching it alone would cost."""
    from planner.contracts.plan import Plan
    from planner.strategies.mixed import explain

    assert isinstance(plan, Plan)
    reasons = explain(plan, profile)  # type: ignore[arg-type]
    table = Table(title="the compressor of each group (ready order), and the best other one: the predicted iteration "
                        "were that group alone sent by it")
    for col in ("#", "layers", "elements", "sent as", "next best", "iteration ms", "change ms"):
        table.add_column(col, justify="right" if col in ("#", "elements", "iteration ms", "change ms") else "left")
    base = plan.predicted.iteration_s
    for r in reasons:
        layers = ", ".join(r.layers) if len(r.layers) <= 3 else f"{r.layers[0]} ... {r.layers[-1]} ({len(r.layers)})"
        if r.alternatives:
            name, t = min(r.alternatives.items(), key=lambda kv: kv[1])
            table.add_row(str(r.index), layers, f"{r.numel:,}", str(r.compressor), name, _ms(t),
                          f"{(t - base) * 1e3:+.2f}")
        else:
            table.add_row(str(r.index), layers, f"{r.numel:,}", str(r.compressor), "-", "", "")
    console.print(table)


def print_kfac_layout(plan: object) -> None:
    """Factor buffers, inversion owners and preconditioners of a K-FAC plan."""
    from planner.contracts.kfac import factor_name
    from planner.contracts.plan import Plan
    from planner.types import FactorKind

    assert isinstance(plan, Plan) and plan.kfac is not None
    k = plan.kfac
    for kind, buffers in ((FactorKind.A, k.a_buffers), (FactorKind.G, k.g_buffers)):
        table = Table(title=f"{kind.value} factor buffers ({'forward' if kind is FactorKind.A else 'backward'} order)")
        for col in ("#", "layers", "owners", "sent as"):
            table.add_column(col)
        for i, names in enumerate(buffers):
            owners = [k.owners[factor_name(n, kind)] for n in names]
            sent = {"whole" if k.sends_whole(factor_name(n, kind)) else "upper triangles" for n in names}
            table.add_row(str(i), ", ".join(names), ", ".join("all" if o is None else str(o) for o in owners),
                          " / ".join(sorted(sent)))
        console.print(table)
    placed = {n: r for n, r in k.preconditioners.items() if r is not None}
    if placed:
        console.print("preconditioned by one worker (which keeps the layer's factors and broadcasts the result): "
                      + ", ".join(f"{n} on {r}" for n, r in placed.items()) + "; every other layer by all workers")
    else:
        console.print("every layer preconditioned by every worker")


def _kfac_options(parser: argparse.ArgumentParser) -> None:
    kfac = parser.add_argument_group("K-FAC (--strategy kfac)")
    kfac.add_argument("--method", choices=[m.value for m in InverseMethod], default=InverseMethod.EIGEN.value)
    kfac.add_argument("--factor-update-steps", type=_positive, default=1)
    kfac.add_argument("--inv-update-steps", type=_positive, default=10)


#: Columns `planner simulate` shows for K-FAC plans (the fusion:* and placement:* baselines are in --json).
KFAC_SCALING_COLUMNS = ("kfac-pytorch", "everywhere", "placement:spd-kfac", "sgd")


class SimulateCommand(Command):
    name = "simulate"
    help = "predict how the plan and each baseline scale with world size on a cluster you describe"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("profile", type=Path, help="profile file from `planner profile`")
        parser.add_argument("--cluster", default=None, metavar="SPEC",
                            help=CLUSTER_HELP + "; default: the profile's own network, scaled by the ring model")
        parser.add_argument("--world-sizes", default="8,64,512", metavar="LIST",
                            help="e.g. 8,64,512 or 4,8,...,1024 (doubling); multiples of the GPUs per node")
        parser.add_argument("--strategy", choices=[*(s.value for s in GROUPING_STRATEGIES), KFAC],
                            default=Strategy.DENSE.value)
        parser.add_argument("--density", type=_density, default=None, help="top-k density (default 0.01)")
        _kfac_options(parser)
        parser.add_argument("--json", action="store_true", help="machine-readable output")

    def run(self, args: argparse.Namespace) -> int:
        from planner.contracts.profile import Profile
        from planner.strategies.cluster import parse_cluster, parse_world_sizes, scaling_table

        if args.density is not None and args.strategy != Strategy.TOPK.value:
            raise PlannerError("--density applies to --strategy topk only")
        sizes = parse_world_sizes(args.world_sizes)
        profile = Profile.load(args.profile)
        spec = parse_cluster(args.cluster if args.cluster is not None else f"profile={args.profile}")
        for w in sizes:  # refuse a bad world size before solving anything
            spec.with_world_size(w)
        # ... and a strategy the profile has no measurements for
        if args.strategy == KFAC:
            from planner.strategies.kfac import kfac_problem

            kfac_problem(profile, InverseMethod(args.method))
        else:
            strategy = Strategy(args.strategy)
            profile.problem(strategy, (args.density or 0.01) if strategy is Strategy.TOPK else None)
        with progress(enabled=not args.json) as bar:
            task = bar.add_task(f"plans for {len(sizes)} world sizes", total=len(sizes))
            rows = scaling_table(
                profile, spec, sizes, strategy=args.strategy, density=args.density,
                method=InverseMethod(args.method), factor_update_steps=args.factor_update_steps,
                inv_update_steps=args.inv_update_steps, on_row=lambda _: bar.advance(task),
            )
        if args.json:
            console.print_json(json.dumps({"cluster": spec.to_dict(), "strategy": args.strategy, "rows": [
                {"world_size": r.world_size, "nodes": r.nodes, "gpus_per_node": r.gpus_per_node, "plan_s": r.plan_s,
                 "baselines": r.baselines, "lower_bound_s": r.lower_bound_s} for r in rows]}))
            return 0
        print_scaling(rows, args.strategy, f"{profile.model.name}: predicted "
                      f"{'average step' if args.strategy == KFAC else 'iteration'} (ms) on {spec.describe()}")
        return 0


def print_scaling(rows: list, strategy: str, title: str) -> None:
    """One row per world size: the plan, the baselines, the lower bound, and the plan's speedup."""
    reference = "kfac-pytorch" if strategy == KFAC else "ddp-25mb"
    names = list(KFAC_SCALING_COLUMNS) if strategy == KFAC else list(rows[0].baselines)
    table = Table(title=title)
    for col in ("world size", "nodes x GPUs", "plan", *names, "lower bound", f"plan vs {reference}"):
        table.add_column(col, justify="right")
    for r in rows:
        ref = r.baselines.get(reference)
        table.add_row(
            str(r.world_size), f"{r.nodes} x {r.gpus_per_node}", _ms(r.plan_s),
            *(_ms(r.baselines[n]) if n in r.baselines else "-" for n in names), _ms(r.lower_bound_s),
            f"{ref / r.plan_s:.2f}x" if ref else "-",
        )
    console.print(table)


class RetuneCommand(Command):
    name = "retune"
    help = "re-plan for the cluster this runs on: probe the network, re-solve from the stored profile, show the diff"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("plan", type=Path, help="plan file to re-tune")
        parser.add_argument("--profile", type=Path, default=None,
                            help="the per-layer profile the plan was solved from (default: the plan's source)")
        parser.add_argument("--nproc", type=_positive, default=None,
                            help="local workers to probe with (default: the plan's world size; ignored under torchrun)")
        parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
        parser.add_argument("--no-probe", action="store_true",
                            help="do not measure the network: re-solve with the stored profile's collectives")
        parser.add_argument("--cluster", default=None, metavar="SPEC",
                            help="re-tune for a described cluster instead of probing: " + CLUSTER_HELP)
        parser.add_argument("--time-limit", type=float, default=2.0, help="seconds for the K-FAC placement solver")
        _add_link(parser)
        parser.add_argument("-o", "--output", type=Path, default=None,
                            help="plan file to write (default: PLAN with -retuned before .json)")

    def run(self, args: argparse.Namespace) -> int:
        from dataclasses import replace

        from planner.contracts.plan import Plan
        from planner.strategies.retune import compare_plans, current_profile, load_source_profile, retune_plan

        if args.cluster is not None and args.no_probe:
            raise PlannerError("--cluster already describes the network: drop --no-probe")
        if args.link is not None and (args.cluster is not None or args.no_probe):
            raise PlannerError("--link shapes the network that retune probes: it needs the probe (drop --cluster "
                               "and --no-probe)")
        if not args.time_limit > 0:
            raise PlannerError(f"`--time-limit > 0` must hold, but got {args.time_limit}")
        plan = Plan.load(args.plan)
        profile = load_source_profile(plan, args.profile)
        output = check_output_path(args.output or args.plan.with_name(args.plan.stem + "-retuned.json"), "plan")
        if args.cluster is not None:
            from planner.strategies.cluster import parse_cluster, profile_for_cluster

            spec = parse_cluster(args.cluster)
            current = profile_for_cluster(profile, spec)
            console.print(f"what-if cluster {spec.describe()}")
        elif args.no_probe:
            current = profile
        else:
            from profilers.probe import run_probe

            nproc = args.nproc or plan.cluster.world_size
            with console.status(f"probing the network on {nproc} workers"):
                probed = run_probe(nproc, args.backend, link=args.link)
            if probed is None:  # a torchrun rank other than 0: rank 0 reports
                return 0
            cluster, curves = probed
            current = current_profile(profile, cluster=cluster, collectives=curves)
            console.print(f"probed {cluster.describe()}: " + "; ".join(
                f"{c.value} {_link(curve)}" for c, curve in curves.items()))
        new = retune_plan(plan, current, cluster=current.cluster, time_limit_s=args.time_limit)
        new = replace(new, source_profile=plan.source_profile if args.profile is None else str(args.profile))
        changes = compare_plans(plan, new, current)
        new.save(output)
        print_plan(new, title=f"re-tuned plan: {new.cluster.describe()}")
        print_changes(changes)
        console.print(f"wrote plan {output}")
        return 0


def _link(curve: object) -> str:
    """A fitted collective curve as latency and bandwidth."""
    from planner.contracts.profile import FittedCurve

    assert isinstance(curve, FittedCurve)
    bandwidth = f"{1 / curve.beta_s_per_byte / 1e9:.2f} GB/s" if curve.beta_s_per_byte > 0 else "no per-byte cost"
    return f"{curve.alpha_s * 1e6:.0f} us + {bandwidth}"


def print_changes(changes: object) -> None:
    """What re-tuning changed and its predicted gain."""
    from planner.strategies.retune import PlanChanges

    assert isinstance(changes, PlanChanges)
    table = Table(title="what changed")
    for col in ("", "old plan", "re-tuned plan"):
        table.add_column(col)
    table.add_row("cluster", changes.old_cluster.describe(), changes.new_cluster.describe())
    table.add_row("gradient groups", str(len(changes.old_groups)),
                  f"{len(changes.new_groups)} ({'changed' if changes.groups_changed else 'same'})")
    if changes.owners_changed is not None:
        table.add_row("K-FAC factor buffers", "", "changed" if changes.buffers_changed else "same")
        table.add_row("K-FAC inversion owners", "", f"{changes.owners_changed} changed")
    old = "cannot run here" if changes.old_s is None else _ms(changes.old_s)
    table.add_row("predicted ms on the new cluster", old, _ms(changes.new_s), style="bold")
    console.print(table)
    if changes.gain is not None:
        console.print(f"predicted gain of re-tuning: {changes.gain:.3f}x")
    else:
        console.print(f"the old plan cannot run on the new cluster: {changes.why_not}")


class ReportCommand(Command):
    name = "report"
    help = "pictures of a plan: Gantt timeline of a predicted iteration, scaling with world size, predicted vs measured"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("plan", type=Path, help="plan file")
        parser.add_argument("-o", "--output", type=Path, required=True, help="folder for the PNGs and report.html")
        parser.add_argument("--profile", type=Path, default=None,
                            help="the profile the plan was solved from (default: the plan's source)")
        parser.add_argument("--cluster", default=None, metavar="SPEC",
                            help="cluster for the scaling picture: " + CLUSTER_HELP +
                                 "; default: the profile's own network, scaled by the ring model")
        parser.add_argument("--world-sizes", default=None, metavar="LIST",
                            help="world sizes of the scaling picture (default: the plan's, doubling 8 times)")
        parser.add_argument("--no-scaling", action="store_true", help="skip the scaling picture")
        parser.add_argument("--bench", type=Path, default=None,
                            help="`planner bench --json` output for the predicted-vs-measured picture")

    def run(self, args: argparse.Namespace) -> int:
        from planner.commands.report import read_bench_json, write_report
        from planner.contracts.plan import Plan
        from planner.strategies.cluster import parse_cluster, parse_world_sizes, scaling_table
        from planner.strategies.retune import load_source_profile

        ensure_folder(args.output, "report folder", create=False)
        plan = Plan.load(args.plan)
        profile = load_source_profile(plan, args.profile)
        bench = read_bench_json(args.bench) if args.bench is not None else None
        ensure_folder(args.output, "report folder")  # once the inputs are known good: a bad one leaves nothing
        scaling = None
        if plan.strategy is Strategy.MIXED and not args.no_scaling:
            err_console.print("note: the scaling picture covers dense, top-k and K-FAC plans, not mixed ones; "
                              "leaving it out", markup=False)
            args.no_scaling = True
        if not args.no_scaling:
            first = plan.cluster.world_size
            sizes = parse_world_sizes(args.world_sizes or f"{first},{2 * first},...,{first << 8}")
            source = str(args.profile or plan.source_profile)
            spec = parse_cluster(args.cluster if args.cluster is not None else f"profile={source}")
            kfac = plan.kfac
            strategy = KFAC if kfac is not None else plan.strategy.value
            options = {} if kfac is None else {
                "method": kfac.method, "factor_update_steps": kfac.factor_update_steps,
                "inv_update_steps": kfac.inv_update_steps,
            }
            with progress() as bar:
                task = bar.add_task(f"plans for {len(sizes)} world sizes", total=len(sizes))
                rows = scaling_table(profile, spec, sizes, strategy=strategy, density=plan.density,
                                     on_row=lambda _: bar.advance(task), **options)  # type: ignore[arg-type]
            names = list(KFAC_SCALING_COLUMNS) if kfac is not None else list(rows[0].baselines)
            series = {"plan": [r.plan_s for r in rows]}
            series.update({n: [r.baselines[n] for r in rows] for n in names if n in rows[0].baselines})
            scaling = ([r.world_size for r in rows], series, [r.lower_bound_s for r in rows], spec.describe())
        files = write_report(plan, profile, args.output, plan_path=str(args.plan), scaling=scaling, bench=bench,
                             bench_source=str(args.bench or ""))
        written = [p for p in (files.timeline, files.scaling, files.measured) if p is not None]
        console.print("wrote " + ", ".join(str(p) for p in written) + f" and the page {files.page}")
        return 0


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
        from planner.commands.tune import TuneConfig, TuneSpace, check_study_file, run_tune, same_decisions
        from planner.contracts.profile import Profile

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
        check_output_path(args.output, "plan")
        check_study_file(args.study or args.output.with_suffix(".db"))
        config = TuneConfig(
            profile=profile, profile_path=str(args.profile), strategy=args.strategy,
            density=(args.density or 0.01) if args.strategy == Strategy.TOPK.value else None,
            method=InverseMethod(args.method), factor_update_steps=args.factor_update_steps if is_kfac else 1,
            inv_update_steps=args.inv_update_steps if is_kfac else 10, model=args.model,
            batch_size=args.batch_size, nproc=args.nproc or profile.cluster.world_size, trials=args.trials,
            storage=args.study or args.output.with_suffix(".db"), study_name=args.study_name, steps=args.steps,
            rungs=args.rungs, warmup=args.warmup, compare_steps=args.compare_steps, seed=args.seed, space=space,
            output=args.output, link=args.link,
        )
        result = run_tune(config)
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


class ShowCommand(Command):
    name = "show"
    help = "print a plan's comparison table, or a profile's summary"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("file", type=Path, help="a plan or profile file")
        parser.add_argument("--groups", action="store_true", help="also list a plan's groups")

    def run(self, args: argparse.Namespace) -> int:
        from planner.contracts.jsonio import read_json
        from planner.contracts.plan import PLAN_KIND, Plan
        from planner.contracts.profile import PROFILE_KIND, Profile

        kind = read_json(args.file, "plan or profile").get("kind")
        if kind == PLAN_KIND:
            plan = Plan.load(args.file)
            print_plan(plan)
            if args.groups:
                table = Table(title="groups in ready order")
                for col in ("#", "layers", "elements", "k"):
                    table.add_column(col)
                for i, g in enumerate(plan.groups):
                    layers = ", ".join(g.layers) if len(g.layers) <= 4 else f"{g.layers[0]} ... {g.layers[-1]}"
                    table.add_row(str(i), f"{len(g.layers)}: {layers}", f"{g.numel:,}", str(g.k or "-"))
                console.print(table)
                if plan.kfac is not None:
                    print_kfac_layout(plan)
        elif kind == PROFILE_KIND:
            print_profile(Profile.load(args.file))
        else:
            raise PlannerError(f"{args.file} is neither a plan nor a profile (kind {kind!r})")
        return 0


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
        from planner.commands.pair import run_pair

        run_pair(args.plans, args.batch, args.output)
        return 0


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
                                 "runs for every top-k density a plan uses")
        abs_sgd = parser.add_argument_group("time to a target loss: ABS-SGD (--strategy abs), or gradient plans "
                                            "with --target-loss")
        abs_sgd.add_argument("--samples", type=_positive, default=None,
                             help="samples per run, summed over the workers (default: abs 80000, digits task 40000, "
                                  "teacher task 4000)")
        abs_sgd.add_argument("--repeats", type=_positive, default=None,
                             help="runs of each variant, round-robin (default 3 for abs, 1 for gradient plans; also "
                                  "--strategy crossover)")
        abs_sgd.add_argument("--target-loss", type=_positive_float, default=None,
                             help="evaluation loss to reach (abs: default 0.05); with gradient plans it runs DDP, its "
                                  "hooks and the plans to this loss instead of timing steps")
        abs_sgd.add_argument("--task", choices=["digits", "teacher"], default=None,
                             help="gradient plans with --target-loss: digits (the built-in digits model) or teacher "
                                  "(the model learns a fixed random teacher's labels); default digits for the digits "
                                  "model, teacher otherwise")
        abs_sgd.add_argument("--lr", type=_positive_float, default=None,
                             help="SGD learning rate (default: abs 0.4; gradient plans the task's: digits 0.05, "
                                  "teacher 0.5 for token models, 0.02 for image models)")
        abs_sgd.add_argument("--speed-change", type=_slowdown, default=None, metavar="RANK=FACTOR",
                             help="halfway through every run, slowed workers change to these factors (e.g. "
                                  "--slowdown 1=1.5 --speed-change 1=3)")
        abs_sgd.add_argument("--momentum", type=_nonnegative_float, default=None,
                             help="SGD momentum (abs default 0: a one-round delay with momentum 0.9 costs about "
                                  "twice the updates; gradient plans default 0.9)")
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
        _add_slowdown(parser)
        parser.add_argument("--json", action="store_true", help="machine-readable output")

    def run(self, args: argparse.Namespace) -> int:
        from planner.commands.bench import BenchConfig, run_bench
        from planner.contracts.plan import Plan
        from planner.platform.launch import under_torchrun

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
        to_target = args.strategy == "gradients" and args.target_loss is not None
        runs = [flag for flag, value in (("--samples", args.samples), ("--repeats", args.repeats),
                                         ("--target-loss", args.target_loss), ("--lr", args.lr),
                                         ("--momentum", args.momentum)) if value is not None]
        if runs and args.strategy not in (ABS, "gradients"):
            raise PlannerError(f"{runs[0]} applies to --strategy abs, or to gradient plans with --target-loss")
        if runs and args.strategy == "gradients" and not to_target:
            raise PlannerError(f"{runs[0]} applies to --strategy abs, or to gradient plans with --target-loss L (the "
                               "time-to-target bench)")
        if args.speed_change is not None and args.strategy != ABS:
            raise PlannerError("--speed-change applies to --strategy abs only")
        if args.task is not None and not to_target:
            raise PlannerError("--task applies to the time-to-target bench of gradient plans (--target-loss L)")
        if args.peers is not None and args.strategy != "gradients":
            raise PlannerError("--peers applies to --strategy gradients only")
        if args.strategy == KFAC:
            return self._run_kfac(args, plans)
        if args.strategy == ABS:
            return self._run_abs(args, plans)
        if to_target:
            return self._run_to_target(args, plans)
        config = BenchConfig(
            plans=plans, model=args.model or plans[0].model.name, batch_size=args.batch_size,
            nproc=args.nproc or plans[0].cluster.world_size, steps=args.steps, warmup=args.warmup,
            show_progress=not args.json, link=args.link, slowdown=args.slowdown, peers=_peers(args.peers),
        )
        _note_link_mismatch(plans, args.link)
        results = run_bench(config)
        if results is not None:  # None on torchrun ranks other than 0: rank 0 prints
            print_bench(results, args.json)
        return 0

    @staticmethod
    def _run_to_target(args: argparse.Namespace, plans: tuple) -> int:
        from planner.commands.bench_target import (
            TASK_SAMPLES,
            TargetBenchConfig,
            print_target_bench,
            run_target_bench,
        )

        model = args.model or plans[0].model.name
        task = args.task or ("digits" if model == "digits" else "teacher")
        config = TargetBenchConfig(
            plans=plans, model=model, task=task, target_loss=args.target_loss,
            samples=args.samples or TASK_SAMPLES[task], lr=args.lr,
            momentum=0.9 if args.momentum is None else args.momentum, repeats=args.repeats or 1,
            peers=_peers(args.peers), nproc=args.nproc or plans[0].cluster.world_size, batch_size=args.batch_size,
            show_progress=not args.json, link=args.link, slowdown=args.slowdown)
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
        from planner.commands.bench_crossover import (
            CrossoverBenchConfig,
            CrossoverJob,
            print_crossover_bench,
            run_crossover_bench,
        )
        from planner.contracts.pairing import PairingPlan, check_job_plan
        from planner.platform.launch import under_torchrun

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
            steps=args.steps, warmup=args.warmup, repeats=args.repeats or 3, link=args.link, gate_dir=gate_dir,
            probe_window_s=args.probe_window or 2.0, show_progress=not args.json)
        print_crossover_bench(config, run_crossover_bench(config), args.json)
        return 0

    @staticmethod
    def _run_abs(args: argparse.Namespace, plans: tuple) -> int:
        from planner.commands.bench_abs import ABSBenchConfig, print_abs_bench, run_abs_bench

        plan = BenchCommand._one_plan(args, plans, ABS, "ABS", "abs --global-batch B")
        given = {k: v for k, v in (("samples", args.samples), ("repeats", args.repeats),
                                   ("target_loss", args.target_loss), ("lr", args.lr), ("momentum", args.momentum))
                 if v is not None}
        config = ABSBenchConfig(plan=plan, model=args.model or plan.model.name,
                                nproc=args.nproc or plan.cluster.world_size, show_progress=not args.json,
                                link=args.link, slowdown=args.slowdown, speed_change=args.speed_change, **given)
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
        from planner.commands.bench_kfac import KFACBenchConfig, run_kfac_bench

        plan = BenchCommand._one_plan(args, plans, KFAC, "K-FAC", KFAC)
        config = KFACBenchConfig(
            plan=plan, model=args.model or plan.model.name, batch_size=args.batch_size,
            nproc=args.nproc or plan.cluster.world_size, steps=args.steps, show_progress=not args.json,
            link=args.link, slowdown=args.slowdown,
        )
        _note_link_mismatch(plans, args.link)
        title = (f"K-FAC bench: median over windows of {config.window} steps of the average step time "
                 "(slowest rank per step)")
        results = run_kfac_bench(config)
        if results is not None:
            print_bench(results, args.json, title=title, lower_bound_s=plan.kfac.lower_bound_s)
        return 0


def _peers(text: str | None) -> tuple:
    """`--peers`: the DDP hooks to run (fp16, powersgd:R), the default ones when not given, none for none."""
    from planner.commands.bench import DEFAULT_PEERS
    from planner.types import Compressor, CompressorKind

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


def _note_link_mismatch(plans: tuple, link: object) -> None:
    """Say so when a plan was made for another network than the bench runs on (its predictions assume that one)."""
    here = getattr(link, "text", None)
    for plan in plans:
        if plan.cluster.link != here:
            made = f"a {plan.cluster.link} link" if plan.cluster.link else "loopback (no --link)"
            runs = f"a {here} link" if here else "loopback"
            err_console.print(f"note: {plan.model.name} {plan.strategy.value} plan was made for {made}, the bench "
                              f"runs on {runs}: its predictions are for the network it was made for")


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
        if args.factors is not None:
            from planner.solvers.placement import time_placement

            if not args.time_limit > 0:
                raise PlannerError(f"`--time-limit > 0` must hold, but got {args.time_limit}")
            rows = time_placement(args.factors, args.workers, repeats=args.repeats, time_limit_s=args.time_limit)
            title = (f"placement of {args.factors} synthetic factors on {args.workers} workers "
                     f"(median of {args.repeats}; makespan = the later of the busiest worker's inversions and "
                     "the last broadcast)")
        else:
            from planner.commands.solver_bench import time_solvers

            sigmas = (0.0,) if not args.interference else (0.0, args.interference)
            rows = time_solvers(num_layers=args.layers, repeats=args.repeats, interference=sigmas)
            title = f"solver time on {args.layers} synthetic layers (median of {args.repeats})"
        print_rows(rows, title)
        return 0


#: The network `planner demo` emulates by default: 1 Gbit/s Ethernet, the setting of the published work.
DEMO_LINK = "1gbit"


class DemoCommand(Command):
    name = "demo"
    help = "the main job: profile, solve (--strategy auto: dense, top-k and mixed), write plans, bench, compare"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        from planner.models import DEFAULT_MODEL

        parser.add_argument("--model", default=DEFAULT_MODEL)
        parser.add_argument("--nproc", type=_positive, default=2)
        parser.add_argument("--compressors", default="all", metavar="LIST|PRESET",
                            help=f"what the plans may send: {COMPRESSORS_HELP.removesuffix('; default light')}; "
                                 "default all")
        parser.add_argument("--steps", type=_positive, default=20)
        parser.add_argument("--plans-dir", type=Path, default=Path("plans"))
        parser.add_argument("--profiles-dir", type=Path, default=Path("profiles"))
        parser.add_argument("--link", default=DEMO_LINK, metavar="RATE|none",
                            help=f"{LINK_HELP}; default {DEMO_LINK} where this process may make network namespaces, "
                                 "else loopback; none: loopback")
        _add_slowdown(parser)

    def run(self, args: argparse.Namespace) -> int:
        from planner.commands.bench import BenchConfig, run_bench
        from planner.commands.profile import ProfileConfig, run_profile
        from planner.models import build_workload
        from planner.strategies.mixed import parse_compressors, solve_auto

        compressors = parse_compressors(args.compressors)
        build_workload(args.model)  # an unknown or broken model is one line, before a link or a worker starts
        if args.slowdown is not None:
            args.slowdown.check_world_size(args.nproc)
        link = self._demo_link(args.link)
        ensure_folder(args.profiles_dir, "profiles folder")
        ensure_folder(args.plans_dir, "plans folder")
        stem = args.model.replace(":", "_").replace("/", "_")
        where = f"-{link.text}" if link is not None else ""
        prof_path = args.profiles_dir / f"{stem}-{args.nproc}w{where}.json"
        on = f"behind an emulated {link.text} link" if link is not None else "over loopback"
        console.rule(f"1/3 profile {args.model} on {args.nproc} workers {on}")
        profile = run_profile(ProfileConfig(model=args.model, output=prof_path, nproc=args.nproc, link=link,
                                            slowdown=args.slowdown))
        profile.save(prof_path)
        print_profile(profile)
        console.print(f"wrote profile {prof_path}")
        console.rule(f"2/3 solve: --strategy auto over {', '.join(map(str, compressors))}")
        choice = solve_auto(profile, compressors, source=str(prof_path))
        for name, plan in choice.candidates.items():
            kind = plan.strategy.value + (f"{plan.density:g}" if plan.strategy is Strategy.TOPK else "")
            path = args.plans_dir / f"{stem}-{args.nproc}w{where}-{kind}.json"
            plan.save(path)
            console.print(f"wrote plan {path} ({name})")
        print_auto(choice)
        print_plan(choice.plan)
        if choice.plan.strategy is Strategy.MIXED:
            print_mixed_groups(choice.plan, profile)
        console.rule("3/3 bench: DDP, PyTorch's DDP hooks and the plans")
        dense = choice.candidates.get("dense")
        plans = (choice.plan,) if dense is None or dense is choice.plan else (dense, choice.plan)
        results = run_bench(BenchConfig(plans=plans, model=args.model, nproc=args.nproc, steps=args.steps,
                                        link=link, slowdown=args.slowdown))
        assert results is not None
        print_bench(results, as_json=False, title=f"bench {on}: median step time (slowest rank per step)")
        return 0

    @staticmethod
    def _demo_link(text: str) -> Any:
        """The demo's link: the one asked for; by default DEMO_LINK where the privilege is there, else loopback."""
        from planner.platform.link import parse_rate, privilege_problem

        if text.lower() == "none":
            return None
        if text != DEMO_LINK:
            try:
                return _link_rate(text)
            except argparse.ArgumentTypeError as exc:
                raise PlannerError(f"--link {exc}") from None
        problem = privilege_problem()
        if problem is not None:
            console.print(f"no emulated {DEMO_LINK} link: {problem}; falling back to loopback, where compute "
                          "dominates and plans matter little (run as root to see the slow network)", style="yellow")
            return None
        return parse_rate(DEMO_LINK)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="planner",
        description="Profile, plan and run gradient communication for data-parallel PyTorch training.",
    )
    parser.add_argument("--verbose", action="store_true",
                        help="when a worker fails, print its traceback after the one-line error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cls in Command.registry.items():
        cmd = cls()
        p = sub.add_parser(name, help=cls.help, description=cls.help)
        cmd.configure(p)
        p.set_defaults(_command=cmd)
    return parser


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line (what is wrong; `--help` for the rest), not argparse's usage block too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _first_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else "(no message)"


def _worker_traceback(exc: BaseException, verbose: bool) -> None:
    """With --verbose, the traceback text of the worker an error came from."""
    if verbose and isinstance(exc.__cause__, RemoteTraceback):
        err_console.print(exc.__cause__.text, markup=False, soft_wrap=True, highlight=False)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._command.run(args))
    except PlannerError as exc:
        err_console.print(f"planner {args.command}: error: {exc}", markup=False, soft_wrap=True)
        _worker_traceback(exc, args.verbose)
        return 2
    except Exception as exc:
        if not isinstance(exc.__cause__, RemoteTraceback):
            raise  # the planner's own bug: its traceback is what to report
        # a worker's error that is not the planner's (the user's model, a collective whose peer died): one line
        err_console.print(f"planner {args.command}: error: worker rank {exc.__cause__.rank} failed: "
                          f"{type(exc).__name__}: {_first_line(exc)}"
                          + ("" if args.verbose else " (--verbose prints its traceback)"),
                          markup=False, soft_wrap=True)
        _worker_traceback(exc, args.verbose)
        return 2
    except KeyboardInterrupt:
        err_console.print("planner: interrupted", markup=False)
        return 130


if __name__ == "__main__":
    sys.exit(main())
