"""Collective time against message size on the live process group, fitted to alpha + beta * bytes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from planner.contracts.profile import FittedCurve
from planner.kernels.topk import all_gather_flat
from planner.platform.timing import median, time_call
from planner.types import Collective

__all__ = ["log_sizes", "measure_collectives"]


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
            times = torch.tensor(samples, dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX, group=process_group)
            points.append((int(max(4, nbytes // 4 * 4)), median(times.tolist())))
            on_point()
        out[coll] = FittedCurve.fit(points)
    return out
