"""Which statistic of a collective's runs predicts a sequence of collectives: the mean or the median.

    python benchmarks/collective_statistic.py --nproc 2 --rounds 6

A step's communication is a sum of collectives. In each round, on `--nproc` local gloo workers, it times every
size of `SIZES` as the profiler does (`planner.profilers.comm.interleaved_visits` order, a barrier before every run, the
slowest rank's seconds), then times `SEQUENCE` (ten allreduces of those sizes, back to back after one barrier)
20 times, and prints the sequence's median beside the sum of the sizes' medians, of their means and of their
10%-trimmed means, each with its error against the sequence. The profiler records the mean
(`planner.profilers.comm._interleaved_means`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from rich.table import Table

from planner.console import console
from planner.platform.launch import run_distributed
from planner.profilers.comm import interleaved_visits

SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
SEQUENCE = [4 << 20, 1 << 20, 256 << 10, 64 << 10, 16 << 10, 4 << 10, 1 << 10, 1 << 20, 4 << 10, 256 << 10]
STATISTICS = ("median", "mean", "10%-trimmed mean")


def _trimmed_mean(values: list[float], cut: float = 0.1) -> float:
    ordered = sorted(values)
    drop = int(len(ordered) * cut)
    return statistics.mean(ordered[:len(ordered) - drop])


def _slowest(samples: list[float]) -> list[float]:
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _rounds(rank: int, world_size: int, rounds: int, runs: int) -> list[tuple[float, dict[str, float]]]:
    x = torch.zeros(max(SIZES) // 4)
    out = []
    for _ in range(rounds):
        samples: list[list[float]] = [[] for _ in SIZES]
        for i, timed in interleaved_visits([runs] * len(SIZES), warmup=2):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x[:SIZES[i] // 4])
            if timed:
                samples[i].append(time.perf_counter() - start)
        flat = _slowest([t for s in samples for t in s])
        per_size = {size: flat[i * runs:(i + 1) * runs] for i, size in enumerate(SIZES)}
        sequence = []
        for _ in range(20):
            dist.barrier()
            start = time.perf_counter()
            for size in SEQUENCE:
                dist.all_reduce(x[:size // 4])
            sequence.append(time.perf_counter() - start)
        reducers: dict[str, Callable[[list[float]], float]] = {
            "median": statistics.median, "mean": statistics.mean, "10%-trimmed mean": _trimmed_mean}
        sums = {name: float(sum(f(per_size[size]) for size in SEQUENCE)) for name, f in reducers.items()}
        out.append((statistics.median(_slowest(sequence)), sums))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="local gloo workers (default 2)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, each one profile and one sequence (default 6)")
    parser.add_argument("--runs", type=int, default=15, help="timed runs of each size per round (default 15)")
    args = parser.parse_args()
    if args.nproc < 2 or args.rounds < 1 or args.runs < 1:
        parser.error(f"`--nproc >= 2`, `--rounds >= 1` and `--runs >= 1` must hold, but got "
                     f"(nproc={args.nproc}, rounds={args.rounds}, runs={args.runs})")
    results = run_distributed(_rounds, args.nproc, args.rounds, args.runs, timeout=1800)[0]
    table = Table(title="a sequence of ten allreduces against the sum of each size's statistic (ms, error)")
    table.add_column("round")
    table.add_column("sequence, median of 20", justify="right")
    for name in STATISTICS:
        table.add_column(f"sum of {name}s", justify="right")
    errors: dict[str, list[float]] = {name: [] for name in STATISTICS}
    for r, (measured, sums) in enumerate(results):
        cells = []
        for name in STATISTICS:
            err = abs(sums[name] - measured) / measured
            errors[name].append(err)
            cells.append(f"{sums[name] * 1e3:.2f} ({err:.0%})")
        table.add_row(str(r), f"{measured * 1e3:.2f}", *cells)
    table.add_row("mean error", "", *(f"{statistics.mean(errors[name]):.1%}" for name in STATISTICS))
    console.print(table)


if __name__ == "__main__":
    main()
