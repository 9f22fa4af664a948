"""Clocks for measuring on CPU (perf_counter) and CUDA (events), and robust statistics (over every
rank's samples with `gathered`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Marks", "gathered", "iqr", "median", "slowest", "stream_seconds", "time_call"]


class Marks:
    """Timestamps taken at points of a computation (e.g. from autograd hooks), read after it finished.

    On CUDA each mark records an event on the current stream (asynchronous, no sync in the hook);
    on CPU it is a perf_counter reading. `seconds()` returns each mark relative to the first.
    """

    __slots__ = ("_cuda", "_marks")

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[tuple[str, Any]] = []

    def mark(self, label: str) -> None:
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append((label, ev))
        else:
            self._marks.append((label, time.perf_counter()))

    def seconds(self) -> list[tuple[str, float]]:
        """(label, seconds since the first mark) for every mark, in the order they were taken."""
        if not self._marks:
            return []
        if self._cuda:
            torch.cuda.synchronize()
            first = self._marks[0][1]
            return [(lbl, first.elapsed_time(ev) / 1e3) for lbl, ev in self._marks]
        t0 = self._marks[0][1]
        return [(lbl, t - t0) for lbl, t in self._marks]

    def clear(self) -> None:
        self._marks.clear()


def time_call(fn: Callable[[], object], device: torch.device, *, repeats: int, warmup: int,
              before: Callable[[], object] | None = None) -> list[float]:
    """Seconds of `fn()` over `repeats` runs after `warmup` runs; `before()` (untimed) runs ahead of each."""
    out = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
        if i >= warmup:
            out.append(elapsed)
    return out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def iqr(xs: Sequence[float]) -> float:
    """Interquartile range (spread that ignores outliers); 0 for fewer than two values."""
    if len(xs) < 2:
        return 0.0
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return float(q[2] - q[0])


def stream_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds `fn` takes on the compute stream; on a GPU between events on the current stream only (a
    device-wide synchronize would wait for the collectives' stream too)."""
    if device.type != "cuda":
        return time_call(fn, device, repeats=1, warmup=0)[0]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def gathered(samples: list[float], group: Any) -> list[float]:
    """Every rank's samples (the same number on each)."""
    everyone: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, samples, group=group)
    return [float(x) for xs in everyone for x in xs]  # type: ignore[attr-defined]


def slowest(seconds: float, group: Any = None) -> float:
    """The largest of every rank's `seconds` (every rank of `group` calls it): the count of a phase's repeats
    taken from its slowest rank, so that every rank passes as many barriers. On this rank's GPU for nccl."""
    nccl = dist.get_backend(group) == "nccl"
    value = torch.tensor([seconds], dtype=torch.float64,
                         device=torch.device("cuda", torch.cuda.current_device()) if nccl else None)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.item())
