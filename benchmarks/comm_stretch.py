"""How much longer a gradient exchange takes while the workers compute, flat against hierarchical.

    sudo .venv/bin/python benchmarks/comm_stretch.py --model cnn --link 200mbit --sizes 4,16 --reps 9

The timeline model slows compute while a collective is in flight (interference σ) but takes a collective's
time as measured alone. On 2 emulated hosts of 2 workers (`planner.platform.link`, root) this times, for each
size, a flat allreduce (`dist.all_reduce(async_op=True)`) and the runtime's hierarchical one
(`planner.kernels.hierarchical.HierarchicalWork`: inside the host, across, inside again, on its own thread):
alone (started, then waited for), and busy (started, then every worker runs the model's forward and backward
passes until it sees the exchange complete, polled at every layer; `--compute matmul`: 192-wide matrix products
instead). Each cell is the median over `--reps` of the slowest rank; the stretch is busy / alone - 1.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from rich.table import Table

from planner.console import console
from planner.kernels.hierarchical import HierarchicalWork, HostGroups
from planner.models import BUILTIN_MODELS, build_workload
from planner.platform.hosts import host_names, ranks_by_host
from planner.platform.launch import run_distributed
from planner.platform.link import parse_rate, privilege_problem
from planner.types import PlannerError

ROUTES = ("flat", "hierarchical")


def _times(rank: int, world_size: int, model: str, sizes_mib: list[int], reps: int,
           compute: str) -> dict[tuple[str, int, str], float]:
    workload = build_workload(model)
    net = workload.module
    inputs, targets = workload.batch(seed=rank)
    groups = HostGroups.build(ranks_by_host(host_names()))
    square = torch.randn(192, 192)
    polled: dict[str, Any] = {"work": None, "done": None}

    def poll(*_: object) -> None:
        work = polled["work"]
        if work is not None and polled["done"] is None and work.is_completed():
            polled["done"] = time.perf_counter()

    for p in net.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(poll)
    for module in net.modules():
        if not list(module.children()):
            module.register_forward_hook(poll)

    def alone(work: Any) -> float:
        start = time.perf_counter()
        work.wait()
        return time.perf_counter() - start

    def busy(work: Any) -> float:
        start = time.perf_counter()
        polled["work"], polled["done"] = work, None
        while polled["done"] is None:
            if compute == "matmul":
                for _ in range(4):
                    square @ square
                poll()
            else:
                net.zero_grad(set_to_none=True)
                workload.loss_fn(net(inputs), targets).backward()
        polled["work"] = None
        work.wait()
        return float(polled["done"]) - start

    samples: dict[tuple[str, int, str], list[float]] = {}
    for mib in sizes_mib:
        flat = torch.zeros((mib << 20) // 4)
        starts: dict[str, Callable[[], Any]] = {
            "flat": functools.partial(dist.all_reduce, flat, async_op=True),
            "hierarchical": functools.partial(HierarchicalWork, flat, groups),
        }
        for _ in range(reps):
            for route, begin in starts.items():
                for mode, timed in (("alone", alone), ("busy", busy)):
                    dist.barrier()
                    samples.setdefault((route, mib, mode), []).append(timed(begin()))
    out = {}
    for key, values in samples.items():
        slowest = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[key] = statistics.median(slowest.tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn", help=f"built-in model ({', '.join(BUILTIN_MODELS)}; default cnn)")
    parser.add_argument("--link", default="200mbit", help="the link between the hosts (default 200mbit)")
    parser.add_argument("--sizes", default="4,16", help="message sizes in MiB, comma-separated (default 4,16)")
    parser.add_argument("--reps", type=int, default=9, help="runs of each cell (default 9)")
    parser.add_argument("--compute", choices=("backward", "matmul"), default="backward",
                        help="what the workers compute meanwhile (default backward)")
    args = parser.parse_args()
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes takes whole MiB, comma-separated (e.g. 4,16), but got {args.sizes!r}")
    try:
        rate = parse_rate(args.link)
    except PlannerError as exc:
        parser.error(str(exc))
    if args.reps < 1 or not sizes or min(sizes) < 1:
        parser.error(f"`--reps >= 1` and sizes of at least 1 MiB must hold, but got (reps={args.reps}, "
                     f"sizes={args.sizes})")
    if args.model not in BUILTIN_MODELS:
        parser.error(f"unknown model {args.model!r}: pick one of {', '.join(BUILTIN_MODELS)}")
    problem = privilege_problem()
    if problem is not None:
        sys.exit(f"comm_stretch: cannot emulate 2 hosts here: {problem}")
    times = run_distributed(_times, 4, args.model, sizes, args.reps, args.compute, hosts=2, link=rate,
                            timeout=1800)[0]
    table = Table(title=f"{args.model}, 2 hosts of 2 at {args.link}: an exchange alone and beside {args.compute} "
                        "(ms, slowest rank, median)")
    for column in ("route", "MiB", "alone", "busy", "stretch"):
        table.add_column(column, justify="left" if column == "route" else "right")
    for mib in sizes:
        for route in ROUTES:
            a, b = times[(route, mib, "alone")], times[(route, mib, "busy")]
            table.add_row(route, str(mib), f"{a * 1e3:.1f}", f"{b * 1e3:.1f}", f"{b / a - 1:+.1%}")
    console.print(table)


if __name__ == "__main__":
    main()
