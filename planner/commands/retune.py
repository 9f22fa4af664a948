"""`planner retune`: re-plan for the cluster this runs on (probed or described) and show what changed."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from rich.table import Table

from planner.commands.common import (
    CLUSTER_HELP,
    Command,
    _add_hosts,
    _add_link,
    _positive,
    add_race_flags,
    check_hosts,
    check_race_request,
    race_plan_file,
)
from planner.commands.printing import _ms, print_plan
from planner.console import console, err_console
from planner.contracts.jsonio import RUNS, check_output_path
from planner.contracts.plan import Plan
from planner.types import PlannerError, Strategy


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
        _add_hosts(parser)
        parser.add_argument("-o", "--output", type=Path, default=None,
                            help=f"plan file to write (default: {RUNS}/NAME-retuned.json for a plan NAME.json)")
        race = parser.add_argument_group("the race (--race)")
        race.add_argument("--race", action="store_true",
                          help="then race the re-tuned plan's finalists (gradient plans: DDP, its hooks, the plan "
                               "both ways; K-FAC: its layout and kfac-pytorch's) in real steps on the workers and "
                               "--link probed, and record which to keep in the plan written (`planner race`)")
        add_race_flags(race)

    def run(self, args: argparse.Namespace) -> int:
        from planner.strategies.retune_plan import (  # deferred (start-up)
            compare_plans,
            current_profile,
            load_source_profile,
            retune_plan,
        )

        if args.cluster is not None and args.no_probe:
            raise PlannerError("--cluster already describes the network: drop --no-probe")
        if args.link is not None and (args.cluster is not None or args.no_probe):
            raise PlannerError("--link shapes the network that retune probes: it needs the probe (drop --cluster "
                               "and --no-probe)")
        if args.hosts is not None and (args.cluster is not None or args.no_probe):
            raise PlannerError("--hosts spreads the workers that retune probes with: it needs the probe (drop "
                               "--cluster and --no-probe)")
        if not args.time_limit > 0:
            raise PlannerError(f"`--time-limit > 0` must hold, but got {args.time_limit}")
        plan = Plan.load(args.plan)
        check_race_request(args, abs_plan=plan.abs is not None, where="this machine's workers")
        check_hosts(args.hosts, args.nproc or plan.cluster.world_size)
        profile = load_source_profile(plan, args.profile)
        output = check_output_path(args.output or RUNS / f"{args.plan.stem}-retuned.json", "plan")
        if args.cluster is not None:
            from planner.strategies.cluster import parse_cluster, profile_for_cluster  # deferred (start-up)

            spec = parse_cluster(args.cluster)
            current = profile_for_cluster(profile, spec)
            console.print(f"what-if cluster {spec.describe()}")
        elif args.no_probe:
            current = profile
        else:
            from planner.profilers.probe import TopkOverlaps, run_probe  # deferred (start-up)

            nproc = args.nproc or plan.cluster.world_size
            where = f" on {args.hosts} emulated hosts" if args.hosts else ""
            overlaps = TopkOverlaps.of(profile)
            with console.status(f"probing the network on {nproc} workers{where}"):
                probed = run_probe(nproc, args.backend, link=args.link, hosts=args.hosts, overlaps=overlaps)
            if probed is None:  # a torchrun rank other than 0: rank 0 reports
                return 0
            current = current_profile(profile, cluster=probed.cluster, collectives=probed.collectives,
                                      hosts=probed.hosts)
            console.print(f"probed {probed.cluster.describe()}: " + "; ".join(
                f"{c.value} {_link(curve)}" for c, curve in probed.collectives.items()))
            if probed.hosts is not None:
                levels = probed.hosts
                named = [("inside a host", levels.intra), (f"across hosts (a 1/{levels.per_host} shard)", levels.inter),
                         ("hierarchical", levels.hierarchical)]
                console.print("allreduce " + "; ".join(f"{name} {_link(curve)}" for name, curve in named
                                                       if curve is not None))
                if levels.topk:
                    console.print("top-k merged inside hosts, at the profile's overlap of picks: " + "; ".join(
                        f"density {t.density:g} (union {t.union_ratio:.2f} k) {_link(t.exchange)}"
                        for t in levels.topk))
                elif profile.topk is not None and plan.strategy is not Strategy.DENSE:
                    measured = "" if overlaps is None else f" (it measured hosts of {overlaps.per_host})"
                    err_console.print(
                        f"note: top-k groups cross hosts flat: the profile did not measure how much a host's picks "
                        f"overlap on hosts of {levels.per_host} workers{measured}; to plan them hierarchically, "
                        "profile on such hosts (planner profile --hosts)", markup=False, soft_wrap=True)
        new = retune_plan(plan, current, cluster=current.cluster, time_limit_s=args.time_limit)
        new = replace(new, source_profile=plan.source_profile if args.profile is None else str(args.profile))
        changes = compare_plans(plan, new, current)
        new.save(output)
        print_plan(new, title=f"re-tuned plan: {new.cluster.describe()}")
        print_changes(changes)
        console.print(f"wrote plan {output}")
        if args.race:
            return race_plan_file(output, args, link=args.link, hosts=args.hosts, nproc=args.nproc)
        return 0


def _link(curve: object) -> str:
    """A fitted collective curve as latency and bandwidth."""
    from planner.contracts.profile import FittedCurve  # deferred (start-up)

    assert isinstance(curve, FittedCurve)
    bandwidth = f"{1 / curve.beta_s_per_byte / 1e9:.2f} GB/s" if curve.beta_s_per_byte > 0 else "no per-byte cost"
    return f"{curve.alpha_s * 1e6:.0f} us + {bandwidth}"


def print_changes(changes: object) -> None:
    """What re-tuning changed and its predicted gain."""
    from planner.strategies.retune_plan import PlanChanges  # deferred (start-up)

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
