"""Collective time against message size on the live process group, fitted to alpha + beta * bytes."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from planner.contracts.profile import FittedCurve, HostTiming, HostTopk
from planner.costmodel.curves import fit_curve
from planner.costmodel.problem import topk_count
from planner.kernels.hierarchical import HostGroups, hierarchical_all_reduce, hierarchical_topk_sum
from planner.kernels.topk import all_gather_flat, pack
from planner.models import Workload
from planner.platform.memory import available_bytes
from planner.platform.timing import median, time_call
from planner.profilers.compress import fit_or_constant
from planner.types import Collective

__all__ = ["FP16_SUM_REPEATS", "TOPK_MEMORY_SHARE", "UNION_ROUNDS", "UNION_WARMUP", "collective_runs",
           "fp16_sum_runs", "host_runs", "host_topk_sizes", "host_union_ratio", "interleaved_visits", "log_sizes",
           "measure_collectives", "measure_fp16_sum", "measure_host_topk", "measure_hosts", "measure_union_ratios",
           "overlapping_picks", "topk_budget"]


def log_sizes(smallest: int, largest: int, factor: int = 4) -> list[int]:
    """Message sizes in bytes from `smallest` to at least `largest`, multiplying by `factor` (multiples of 4)."""
    sizes, s = [], max(4, smallest)
    while True:
        sizes.append(s)
        if s >= largest:
            return sizes
        s *= factor


def _op(coll: Collective, x: torch.Tensor, gathered: torch.Tensor | None,
        group: Any = None) -> Callable[[], object]:
    """One run of `coll` on the message `x` (`gathered`: the allgather's output, world size times `x`)."""
    match coll:
        case Collective.ALLREDUCE:
            return lambda: dist.all_reduce(x, group=group)
        case Collective.ALLGATHER:
            assert gathered is not None
            return lambda: all_gather_flat(gathered, x, group=group)
        case Collective.BROADCAST:
            src = dist.get_global_rank(group, 0) if group is not None else 0
            return lambda: dist.broadcast(x, src=src, group=group)
        case _:
            raise ValueError(f"unknown collective {coll!r}")


def _repetitions(nbytes: int, repeats: int) -> int:
    """Timed runs at a message of `nbytes`: fewer from 16 MiB up, where a run is slow and steady."""
    return repeats if nbytes < (16 << 20) else max(3, repeats // 2)


def interleaved_visits(counts: Sequence[int], warmup: int) -> list[tuple[int, bool]]:
    """The order in which `_interleaved_means` runs its points: (point index, timed) for `warmup` untimed
    rounds over every point, then rounds in which point i is timed `counts[i]` times in all, spread evenly.

    Rounds over the points, rather than every run of one point in a row, spread a slow spell of a shared
    machine over every point (a few runs of each) instead of bending the few points it fell on, which the
    affine fit then carries to every size."""
    rounds = max(counts, default=0)
    order = [(i, False) for _ in range(warmup) for i in range(len(counts))]
    for r in range(rounds):
        order += [(i, True) for i, c in enumerate(counts) if (r + 1) * c // rounds > r * c // rounds]
    return order


def _interleaved_means(ops: Sequence[Callable[[], object]], counts: Sequence[int], device: torch.device, *,
                       warmup: int, process_group: Any = None,
                       on_run: Callable[[], object] = lambda: None) -> tuple[list[float], list[tuple[float, ...]]]:
    """The mean over runs of each of `ops` of the slowest rank's seconds, and those runs' seconds (the samples the
    profile keeps), run in `interleaved_visits` order (`counts[i]` timed runs of `ops[i]`), each run started
    together after a barrier. Every rank of `process_group` calls it; `on_run()` after every run.

    The mean, not the median: a step's communication is a sum of collectives, whose expected time is the sum
    of their means. On a shared CPU machine a collective's time is bimodal (over loopback about 0.6 ms, or
    3-5 ms on both ranks in a third of the runs), and the median flips between the two from one profile to the
    next. A sequence of ten allreduces (`benchmarks/collective_statistic.py`, 14 rounds on 2 workers) was
    predicted within 15% on average by the sum of means, 23% by the sum of medians; the mean was closer in 10 of
    the 14 rounds."""
    samples: list[list[float]] = [[] for _ in ops]
    for i, timed in interleaved_visits(counts, warmup):
        dist.barrier(group=process_group)
        t = time_call(ops[i], device, repeats=1, warmup=0)[0]
        if timed:
            samples[i].append(t)
        on_run()
    flat = torch.tensor([t for s in samples for t in s], dtype=torch.float64, device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=process_group)  # a run is over when it is over everywhere
    means, runs, start = [], [], 0
    for s in samples:
        slowest = tuple(flat[start:start + len(s)].tolist())
        means.append(sum(slowest) / max(1, len(s)))
        runs.append(slowest)
        start += len(s)
    return means, runs


def _fitted_curves(points: Sequence[tuple[Any, int, Callable[[], object]]], device: torch.device, *, repeats: int,
                   warmup: int, process_group: Any = None,
                   on_run: Callable[[], object] = lambda: None) -> dict[Any, FittedCurve]:
    """The affine fit of each curve over its points (curve key, message bytes, one run), every point timed by
    `_interleaved_means` with `_repetitions` runs; points keep their order within a curve."""
    seconds, runs = _interleaved_means([op for _, _, op in points], [_repetitions(b, repeats) for _, b, _ in points],
                                       device, warmup=warmup, process_group=process_group, on_run=on_run)
    curves: dict[Any, list[tuple[int, float]]] = {}
    samples: dict[Any, list[tuple[float, ...]]] = {}
    for (key, nbytes, _), t, run in zip(points, seconds, runs, strict=True):
        curves.setdefault(key, []).append((int(max(4, nbytes // 4 * 4)), t))
        samples.setdefault(key, []).append(run)
    return {key: fit_curve(pts, samples[key]) for key, pts in curves.items()}


def collective_runs(collectives: int, sizes: Sequence[int], *, repeats: int, warmup: int) -> int:
    """How many runs `measure_collectives` makes (for a progress bar: it calls `on_run` after each)."""
    return collectives * sum(warmup + _repetitions(b, repeats) for b in sizes)


def measure_collectives(
    collectives: Sequence[Collective],
    sizes: Sequence[int],
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    on_run: Callable[[], object] = lambda: None,
    process_group: Any = None,
) -> dict[Collective, FittedCurve]:
    """Mean seconds of each collective at each size (slowest rank per run), with the affine fit.

    A barrier precedes every run so that ranks start together; the time of a run is the largest over ranks,
    since a collective is over only when it is over everywhere. The runs go in rounds over every collective
    and size (`interleaved_visits`), on slices of one buffer per collective (zeros: a sum of them stays
    finite however many runs). `process_group`: the group to measure (default: the default group).
    """
    largest = max(1, max(sizes) // 4)
    world = dist.get_world_size(process_group)
    x = torch.zeros(largest, device=device)
    gathered = torch.empty(largest * world, device=device) if Collective.ALLGATHER in collectives else None
    points = [(coll, nbytes, _op(coll, x[:max(1, nbytes // 4)],
                                 None if gathered is None else gathered[:max(1, nbytes // 4) * world], process_group))
              for coll in collectives for nbytes in sizes]
    return _fitted_curves(points, device, repeats=repeats, warmup=warmup, process_group=process_group, on_run=on_run)


#: The fewest timed runs of each point of `measure_fp16_sum`: its points are differences of two noisy times.
FP16_SUM_REPEATS = 7


def fp16_sum_runs(sizes: Sequence[int], *, repeats: int, warmup: int) -> int:
    """How many runs `measure_fp16_sum` makes (for a progress bar: it calls `on_run` after each)."""
    return 2 * sum(warmup + _repetitions(b, max(repeats, FP16_SUM_REPEATS)) for b in sizes)


def measure_fp16_sum(sizes: Sequence[int], device: torch.device, *, repeats: int, warmup: int,
                     on_run: Callable[[], object] = lambda: None) -> FittedCurve:
    """What an allreduce of fp16 elements costs beyond one of fp32 elements of the same bytes, at each size in
    `sizes` (message bytes): the work of summing half-precision values, which the collectives' fp32 curves leave
    out. Over gloo on a CPU it is software conversion and costs more than the transfer it halves (an allreduce of n
    fp16 elements took 0.8-1.75 times one of n fp32 elements over loopback on 2 workers, not a half); over NCCL
    it is about none.

    The two are timed in turn, each fp16 run beside an fp32 run of the same bytes (at least `FP16_SUM_REPEATS`
    pairs a size), and a point is the median of the pairs' differences: a collective over loopback is bimodal
    (`_interleaved_means`), and a difference of two means of a few runs swings by more than the work measured. A
    median below zero (fp16 no slower: nothing to add) counts as none. Every rank calls it."""
    largest = max(1, max(sizes) // 2)
    half = torch.zeros(largest, dtype=torch.float16, device=device)
    full = torch.zeros(max(1, largest // 2), device=device)
    ops, counts = [], []
    for nbytes in sizes:
        ops += [_op(Collective.ALLREDUCE, half[:max(1, nbytes // 2)], None),
                _op(Collective.ALLREDUCE, full[:max(1, nbytes // 4)], None)]
        counts += [_repetitions(nbytes, max(repeats, FP16_SUM_REPEATS))] * 2
    _, runs = _interleaved_means(ops, counts, device, warmup=warmup, on_run=on_run)
    points = [(int(max(2, nbytes // 2 * 2)),
               max(0.0, float(median([a - b for a, b in zip(runs[2 * i], runs[2 * i + 1], strict=True)]))))
              for i, nbytes in enumerate(sizes)]
    return fit_or_constant(points)


def _slowest_mean(op: Callable[[], object], nbytes: int, device: torch.device, *, repeats: int,
                  warmup: int) -> tuple[float, tuple[float, ...]]:
    """The mean over runs of `op` of the slowest rank's seconds, and those runs (every rank of the default group
    calls it, each run started together after a barrier; the mean for the reason `_interleaved_means` gives);
    fewer runs from 16 MiB up."""
    means, runs = _interleaved_means([op], [_repetitions(nbytes, repeats)], device, warmup=warmup)
    return means[0], runs[0]


#: Share of the memory available to each worker on a host that one top-k point may take (`measure_topk`).
TOPK_MEMORY_SHARE = 0.5


def topk_budget(world_size: int, device: torch.device) -> int | None:
    """Bytes one top-k point may take on every rank (the least over the ranks): `TOPK_MEMORY_SHARE` of the
    memory available, shared by the workers of a host (on a GPU: of its free memory, its worker's alone); None
    where it cannot be read. Every rank calls it."""
    if device.type == "cuda":
        mine: int | None = torch.cuda.mem_get_info(device)[0]
        local = 1
    else:
        mine = available_bytes()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    budget = torch.tensor([-1 if mine is None else int(TOPK_MEMORY_SHARE * mine / max(1, local))],
                          dtype=torch.int64, device=device)
    dist.all_reduce(budget, op=dist.ReduceOp.MIN)
    return None if budget.item() < 0 else int(budget.item())


def host_topk_sizes(sizes: Sequence[int], world_size: int, max_point_bytes: int | None) -> list[int]:
    """The gradient sizes of `sizes` at which `measure_host_topk` fits in `max_point_bytes` (None: all; the
    smallest always): the dense output and, at density up to 1, every rank's picks gathered twice over."""
    return [n for n in sizes
            if max_point_bytes is None or n == sizes[0] or 4 * n * (1 + 4 * (world_size + 2)) <= max_point_bytes]


def _host_levels(layout: Sequence[Sequence[int]]) -> int:
    """The curves `measure_hosts` times: inside a host (when a host has more than one rank), across, end to end."""
    return 3 if len(layout[0]) > 1 else 2


def host_runs(sizes: Sequence[int], layout: Sequence[Sequence[int]], *, repeats: int, warmup: int) -> int:
    """How many runs `measure_hosts` makes (for a progress bar: it calls `on_run` after each)."""
    return collective_runs(_host_levels(layout), sizes, repeats=repeats, warmup=warmup)


def measure_hosts(
    groups: HostGroups,
    sizes: Sequence[int],
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    on_run: Callable[[], object] = lambda: None,
) -> HostTiming:
    """The allreduce at each level of the hosts of `groups` (two or more hosts of equal size): inside
    each host (all hosts at once, as a hierarchical allreduce runs them), across hosts among the ranks of each
    local index (all at once), and the hierarchical allreduce end to end over the default group; each the
    slowest rank's mean, at every size in `sizes` (bytes of the whole message per rank), in rounds over
    every level and size (`interleaved_visits`).

    Every rank of the default group calls it. The cross-host curve is timed at the size of one shard of the
    hierarchical allreduce's middle step (bytes / ranks per host), and recorded against the whole message's
    bytes, so all three curves share one axis."""
    per_host = groups.local_size
    largest = max(1, max(sizes) // 4)
    x, shard = torch.zeros(largest, device=device), torch.zeros(-(-largest // per_host), device=device)
    points: list[tuple[str, int, Callable[[], object]]] = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        if groups.local is not None:
            points.append(("intra", nbytes, functools.partial(dist.all_reduce, x[:n], group=groups.local)))
        points.append(("inter", nbytes, functools.partial(dist.all_reduce, shard[:-(-n // per_host)],
                                                          group=groups.cross)))
        points.append(("hierarchical", nbytes, functools.partial(hierarchical_all_reduce, x[:n], groups)))
    curves = _fitted_curves(points, device, repeats=repeats, warmup=warmup, on_run=on_run)
    return HostTiming(ranks=groups.hosts, inter=curves["inter"], hierarchical=curves["hierarchical"],
                      intra=curves.get("intra"))


#: Rounds of error feedback a host's union of picks is measured over, and the first ones left out. The runtime
#: sends the top k of gradient plus residual, and the workers' residuals drift apart, so a host's union grows from
#: the first gradients' towards a steady value: the MLP at density 0.01 on 2 hosts of 2 had 1.77 k on the first
#: gradients, 1.92 k over rounds 12-23 of this measurement, and 1.93-1.94 k in the runtime after 20-60 steps.
UNION_ROUNDS = 16
UNION_WARMUP = 8


def host_union_ratio(picks: torch.Tensor, k: int, groups: HostGroups) -> float:
    """How much the top-k picks of one host's ranks overlap: the largest host's union of picks over k (1: the
    ranks of a host pick the same entries; the ranks per host: disjoint picks). The largest, because the
    hierarchical exchange pads every host's union to it. `picks`: this rank's k indices. Every rank of the
    default group calls it."""
    picks = picks.to(torch.int32)
    if groups.local is not None:
        host = picks.new_empty(groups.local_size * k)
        all_gather_flat(host, picks, group=groups.local)
    else:
        host = picks
    ratio = torch.tensor([torch.unique(host).numel() / k], dtype=torch.float64, device=picks.device)
    dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
    return float(ratio.item())


def measure_union_ratios(workload: Workload, groups: HostGroups, densities: Sequence[float], device: torch.device,
                         *, rounds: int = UNION_ROUNDS, warmup: int = UNION_WARMUP,
                         on_round: Callable[[], object] = lambda: None) -> dict[float, float]:
    """`host_union_ratio` at each density on the model's real gradients, picked as the runtime picks them: each
    rank draws its own batch every round (the model left as it is) and picks the top k of its gradient plus its
    residual, what it has not sent yet (error feedback); averaged over the rounds after the first `warmup`. Holds
    one residual the size of the model per density below 1. Every rank of the default group calls it."""
    if not 0 <= warmup < rounds:
        raise ValueError(f"`0 <= warmup < rounds` must hold, but got warmup={warmup}, rounds={rounds}")
    model = workload.module.to(device)
    rank = dist.get_rank()
    sums = dict.fromkeys(densities, 0.0)
    residuals: dict[float, torch.Tensor] = {}
    for step in range(rounds):
        model.zero_grad(set_to_none=True)
        inputs, targets = (t.to(device) for t in workload.batch(seed=7919 * (step + 1) + rank))
        workload.loss(inputs, targets).backward()
        grad = torch.cat([p.grad.reshape(-1).float() for p in model.parameters() if p.grad is not None])
        for d in densities:
            k = topk_count(grad.numel(), d)
            acc = grad if k == grad.numel() else grad.add(residuals.get(d, 0.0))
            picks = torch.topk(acc.abs(), k, sorted=False).indices
            if k < grad.numel():
                residuals[d] = acc.index_fill_(0, picks, 0.0)  # acc is a copy: what is left to send
            ratio = host_union_ratio(picks, k, groups)
            if step >= warmup:
                sums[d] += ratio
        del grad
        on_round()
    model.zero_grad(set_to_none=True)
    return {d: min(float(groups.local_size), total / (rounds - warmup)) for d, total in sums.items()}


def overlapping_picks(numel: int, k: int, ratio: float, groups: HostGroups, generator: torch.Generator) -> torch.Tensor:
    """This rank's k int32 picks out of `numel` such that its host's union is about `ratio` k: a share the ranks
    of a host have in common, the rest each rank's own (`generator` seeded alike on every rank)."""
    size = groups.local_size
    union = min(numel, max(k, round(ratio * k)))
    shared = k if size == 1 else min(k, max(0, -(-(size * k - union) // (size - 1))))
    order = torch.randperm(numel, generator=generator)
    own = k - shared
    start = shared + groups.local_rank * own
    return torch.cat((order[:shared], order[start:start + own])).to(torch.int32)


def measure_host_topk(
    groups: HostGroups,
    sizes: Sequence[int],
    ratios: dict[float, float],
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    on_point: Callable[[], object] = lambda: None,
) -> tuple[HostTopk, ...]:
    """The hierarchical top-k exchange (`hierarchical_topk_sum`) at each density of `ratios` (density -> the
    host's union over k measured on real gradients, `host_union_ratio`), at gradients of `sizes` elements, with
    picks overlapping as much (`overlapping_picks`); each the slowest rank's mean against the bytes of one
    rank's message (k values, k indices). Every rank of the default group calls it."""
    world = dist.get_world_size()
    out = []
    for density, ratio in ratios.items():
        points: dict[int, tuple[float, tuple[float, ...]]] = {}
        for numel in sizes:
            k = topk_count(numel, density)
            picks = overlapping_picks(numel, k, ratio, groups, torch.Generator().manual_seed(numel))
            send = pack(torch.randn(k, device=device), picks.to(device))
            dense = torch.empty(numel, device=device)
            nbytes = 2 * 4 * k
            exchange = functools.partial(hierarchical_topk_sum, send, k, dense, groups, world)
            points.setdefault(nbytes, _slowest_mean(exchange, nbytes, device, repeats=repeats, warmup=warmup))
            on_point()
        if len(points) >= 2:
            measured = sorted(points.items())
            curve = fit_curve([(n, t) for n, (t, _) in measured], [runs for _, (_, runs) in measured])
            out.append(HostTopk(density=density, union_ratio=ratio, exchange=curve))
    return tuple(out)
