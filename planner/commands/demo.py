"""`planner demo`: the main job, end to end: profile, solve (`--strategy auto`), write the plans, bench."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from planner.commands.common import (
    COMPRESSORS_HELP,
    LINK_HELP,
    Command,
    _add_hosts,
    _add_slowdown,
    _link_rate,
    _positive,
    check_hosts,
    intra_linked,
)
from planner.commands.printing import print_auto, print_bench, print_mixed_groups, print_plan, print_profile
from planner.console import console
from planner.contracts.jsonio import ensure_folder
from planner.types import PlannerError, Strategy

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
        _add_hosts(parser)
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
        check_hosts(args.hosts, args.nproc)
        link = intra_linked(self._demo_link(args.link), args.intra_link, args.hosts)
        ensure_folder(args.profiles_dir, "profiles folder")
        ensure_folder(args.plans_dir, "plans folder")
        stem = args.model.replace(":", "_").replace("/", "_")
        where = "".join([f"-{link.text}" if link is not None else "",
                         f"-{link.intra.text}" if link is not None and link.intra is not None else "",
                         f"-{args.hosts}h" if args.hosts else ""])
        prof_path = args.profiles_dir / f"{stem}-{args.nproc}w{where}.json"
        on = f"behind an emulated {link.label} link" if link is not None else "over loopback"
        if args.hosts:
            on = f"on {args.hosts} emulated hosts, {'between them ' if link is not None else ''}{on}"
        console.rule(f"1/3 profile {args.model} on {args.nproc} workers {on}")
        profile = run_profile(ProfileConfig(model=args.model, output=prof_path, nproc=args.nproc, link=link,
                                            slowdown=args.slowdown, hosts=args.hosts))
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
                                        link=link, slowdown=args.slowdown, hosts=args.hosts))
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
