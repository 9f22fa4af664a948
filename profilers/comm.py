"""Collective time against message size on the live process group, fitted to alpha + beta * bytes."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from planner.contracts.profile import FittedCurve, HostTiming
from planner.kernels.hierarchical import HostGroups, hierarchical_all_reduce
from planner.kernels.topk import all_gather_flat
from planner.platform.timing import median, time_call
from planner.types import Collective

__all__ = ["host_points", "log_sizes", "measure_collectives", "measure_hosts"]


def log_sizes(smallest: int, largest: int, factor: int = 4) -> list[int]:
    """Message sizes in bytes from `smallest` to at least `largest`, multiplying by `factor` (multiples of 4)."""
    sizes, s = [], max(4, smallest)
    while True:
        sizes.append(s)
        if s >= largest:
            return sizes
        s *= factor


def _op(coll: Collective, nbytes: int, device: torch.device, group: Any = None) -> Callable[[], object]:
    n = max(1, nbytes // 4)
    x = torch.ones(n, device=device)
    match coll:
        case Collective.ALLREDUCE:
            return lambda: dist.all_reduce(x, group=group)
        case Collective.ALLGATHER:
            out = torch.empty(n * dist.get_world_size(group), device=device)
            return lambda: all_gather_flat(out, x, group=group)
        case Collective.BROADCAST:
            src = dist.get_global_rank(group, 0) if group is not None else 0
            return lambda: dist.broadcast(x, src=src, group=group)
        case _:
            raise ValueError(f"unknown collective {coll!r}")


def measure_collectives(
    collectives: Sequence[Collective],
    sizes: Sequence[int],
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    on_point: Callable[[], object] = lambda: None,
    process_group: Any = None,
) -> dict[Collective, FittedCurve]:
    """Median seconds of each collective at each size (slowest rank per repetition), with the affine fit.

    A barrier precedes every repetition so that ranks start together; the time of a repetition is the
    largest over ranks, since a collective is over only when it is over everywhere. `process_group`:
    the group to measure (default: the default group).
    """
    out = {}
    for coll in collectives:
        points = []
        for nbytes in sizes:
            op = _op(coll, nbytes, device, process_group)
            samples = []
            # Large messages: fewer repetitions, they are slow and stable.
            reps = repeats if nbytes < (16 << 20) else max(3, repeats // 2)
            for i in range(warmup + reps):
                dist.barrier(group=process_group)
                t = time_call(op, device, repeats=1, warmup=0)[0]
                if i >= warmup:
                    samples.append(t)
            times = torch.tensor(samples, dtype=torch.float64, device=device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX, group=process_group)
            points.append((int(max(4, nbytes // 4 * 4)), median(times.tolist())))
            on_point()
        out[coll] = FittedCurve.fit(points)
    return out


def host_points(sizes: Sequence[int], layout: Sequence[Sequence[int]]) -> int:
    """How many points `measure_hosts` measures (for a progress bar)."""
    return len(sizes) * (3 if len(layout[0]) > 1 else 2)


def measure_hosts(
    layout: Sequence[Sequence[int]],
    sizes: Sequence[int],
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    on_point: Callable[[], object] = lambda: None,
) -> HostTiming:
    """The allreduce at each level of hosts `layout` (ranks per host, two or more hosts of equal size): inside
    each host (all hosts at once, as a hierarchical allreduce runs them), across hosts among the ranks of each
    local index (all at once), and the hierarchical allreduce end to end over the default group; each the
    slowest rank's median, at every size in `sizes` (bytes of the whole message per rank).

    Every rank of the default group calls it. The cross-host curve is timed at the size of one shard of the
    hierarchical allreduce's middle step (bytes / ranks per host), and recorded against the whole message's
    bytes, so all three curves share one axis."""
    groups = HostGroups.build(layout)
    per_host = groups.local_size

    def timed(op: Callable[[], object], nbytes: int) -> float:
        samples = []
        for i in range(warmup + (repeats if nbytes < (16 << 20) else max(3, repeats // 2))):
            dist.barrier()
            t = time_call(op, device, repeats=1, warmup=0)[0]
            if i >= warmup:
                samples.append(t)
        times = torch.tensor(samples, dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # over every rank: the level is done when all its groups are
        return median(times.tolist())

    curves: dict[str, list[tuple[int, float]]] = {"intra": [], "inter": [], "hierarchical": []}
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        whole = int(max(4, nbytes // 4 * 4))
        x, shard = torch.ones(n, device=device), torch.ones(max(1, -(-n // per_host)), device=device)

        intra = functools.partial(dist.all_reduce, x, group=groups.local)
        inter = functools.partial(dist.all_reduce, shard, group=groups.cross)
        hierarchical = functools.partial(hierarchical_all_reduce, x, groups)
        levels = [("intra", intra)] if groups.local is not None else []
        for name, op in [*levels, ("inter", inter), ("hierarchical", hierarchical)]:
            curves[name].append((whole, timed(op, nbytes)))
            on_point()
    return HostTiming(ranks=groups.hosts, inter=FittedCurve.fit(curves["inter"]),
                      hierarchical=FittedCurve.fit(curves["hierarchical"]),
                      intra=FittedCurve.fit(curves["intra"]) if curves["intra"] else None)
