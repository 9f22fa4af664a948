"""Per-layer forward and backward time, gradient sizes, and the measured gradient-ready order."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from planner.contracts.layers import gradient_layers
from planner.contracts.profile import LayerTiming
from planner.models import Workload
from planner.platform.timing import Marks, iqr, median, time_call

__all__ = ["LayerRun", "combine_ranks", "measure_layers", "measure_steps"]


@dataclass(frozen=True, kw_only=True)
class LayerRun:
    """One rank's measurements: per-layer samples in measured ready order, and whole-phase samples."""

    order: tuple[str, ...]
    params: dict[str, tuple[str, ...]]
    numel: dict[str, int]
    forward: dict[str, list[float]]
    backward: dict[str, list[float]]
    forward_total: list[float]
    backward_total: list[float]
    update: list[float]


def measure_layers(
    workload: Workload,
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    barrier: Callable[[], object] = lambda: None,
    on_step: Callable[[], object] = lambda: None,
) -> LayerRun:
    """Run forward/backward/update `warmup + repeats` times, timing each layer from module and grad hooks.

    A layer's backward time is the gap between the previous layer's gradient becoming ready (or the start
    of backward) and its own: b_i of the timeline model. The ready order is read from the hooks, not assumed.
    """
    model = workload.module.to(device)
    specs = gradient_layers(model)
    modules = dict(model.named_modules())
    layer_of = {p: s.name for s in specs for p in s.params}
    counts = {s.name: len(s.params) for s in specs}
    remaining = dict(counts)
    fmarks, bmarks = Marks(device), Marks(device)

    def on_ready(pname: str) -> None:
        layer = layer_of[pname]
        remaining[layer] -= 1
        if remaining[layer] == 0:
            bmarks.mark(layer)

    handles = []
    for pname, p in model.named_parameters():
        if pname in layer_of:
            handles.append(p.register_post_accumulate_grad_hook(lambda _t, n=pname: on_ready(n)))
    for s in specs:
        mod = modules["" if s.name == "<root>" else s.name]
        handles.append(mod.register_forward_pre_hook(lambda _m, _i, n=s.name: fmarks.mark(">" + n)))
        handles.append(mod.register_forward_hook(lambda _m, _i, _o, n=s.name: fmarks.mark("<" + n)))

    inputs, targets = (t.to(device) for t in workload.batch(seed=1234))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    forward: dict[str, list[float]] = {s.name: [] for s in specs}
    backward: dict[str, list[float]] = {s.name: [] for s in specs}
    forward_total, backward_total, update = [], [], []
    order: tuple[str, ...] = ()
    try:
        for rep in range(warmup + repeats):
            barrier()
            optimizer.zero_grad(set_to_none=True)
            remaining.update(counts)
            fmarks.clear()
            bmarks.clear()
            fmarks.mark("start")
            loss = workload.loss_fn(model(inputs), targets)
            fmarks.mark("end")
            bmarks.mark("start")
            loss.backward()
            bmarks.mark("end")
            step = time_call(optimizer.step, device, repeats=1, warmup=0)
            on_step()
            if rep < warmup:
                continue
            f = fmarks.seconds()
            b = bmarks.seconds()
            forward_total.append(f[-1][1])
            backward_total.append(b[-1][1])
            update.extend(step)
            opened: dict[str, float] = {}
            for label, t in f[1:-1]:
                if label[0] == ">":
                    opened[label[1:]] = t
                elif label[1:] in opened:
                    forward[label[1:]].append(t - opened.pop(label[1:]))
            ready = [(label, t) for label, t in b[1:-1]]
            this_order = tuple(label for label, _ in ready)
            if not order:
                order = this_order
            prev = 0.0
            for label, t in ready:
                backward[label].append(t - prev)
                prev = t
    finally:
        for h in handles:
            h.remove()
    # Layers whose gradients never arrived (unused parameters) go last with zero backward time.
    missing = tuple(s.name for s in specs if s.name not in order)
    for name in missing:
        backward[name] = [0.0]
    return LayerRun(
        order=order + missing,
        params={s.name: s.params for s in specs},
        numel={s.name: s.numel for s in specs},
        forward={k: v or [0.0] for k, v in forward.items()},
        backward=backward,
        forward_total=forward_total,
        backward_total=backward_total,
        update=update,
    )


def measure_steps(
    workload: Workload,
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    barrier: Callable[[], object] = lambda: None,
) -> list[float]:
    """Seconds of whole local training steps (zero_grad, forward, backward, update), no hooks, no communication.

    The cross-check of the per-layer measurements: their sum F + sum(b_i) + U should match these steps.
    """
    model = workload.module.to(device)
    inputs, targets = (t.to(device) for t in workload.batch(seed=1234))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        workload.loss_fn(model(inputs), targets).backward()
        optimizer.step()

    times = []
    for _ in range(warmup + repeats):
        barrier()
        times.extend(time_call(step, device, repeats=1, warmup=0))
    return times[warmup:]


def throughput_batch_sizes(batch_size: int) -> tuple[int, ...]:
    """The micro-batch sizes a worker's throughput is measured at: a quarter, half and all of the batch."""
    return tuple(sorted({max(1, batch_size // 4), max(1, batch_size // 2), batch_size}))


#: A throughput burst runs at least this long: a CPU quota (cgroup cfs, --slowdown) or a GPU's clock throttles
#: only sustained work, and single steps between barriers slip through a quota period unthrottled.
MIN_BURST_S = 0.2


def measure_throughput(
    workload: Workload,
    device: torch.device,
    batch_sizes: tuple[int, ...],
    *,
    repeats: int,
    warmup: int,
    barrier: Callable[[], object] = lambda: None,
    bursts: int = 3,
    min_burst_s: float = MIN_BURST_S,
) -> list[float]:
    """This worker's seconds per local step (forward and backward, no communication, no update) at each
    micro-batch size, sustained: the median over `bursts` bursts of back-to-back steps (at least `repeats`
    steps and `min_burst_s` seconds each) of the burst's time per step. That is how fast the worker turns
    samples into gradients in training, which differs between the workers of a heterogeneous cluster. Every
    rank measures at the same time (each burst starts after `barrier`), as they run in training."""
    model = workload.module.to(device)
    out = []
    for size in batch_sizes:
        inputs, targets = (t.to(device) for t in workload.make_batch(size, torch.Generator().manual_seed(1234)))

        def step(inputs: torch.Tensor = inputs, targets: torch.Tensor = targets) -> None:
            model.zero_grad(set_to_none=True)
            workload.loss_fn(model(inputs), targets).backward()

        for _ in range(warmup):
            step()
        per_step = []
        for _ in range(bursts):
            barrier()
            _sync(device)
            started = time.perf_counter()
            steps = 0
            while steps < repeats or time.perf_counter() - started < min_burst_s:
                step()
                steps += 1
                if steps >= repeats:
                    _sync(device)
            per_step.append((time.perf_counter() - started) / steps)
        out.append(median(per_step))
    model.zero_grad(set_to_none=True)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def combine_ranks(runs: list[LayerRun]) -> tuple[list[LayerTiming], float, float, float]:
    """Layer timings of the slowest worker (largest median forward + backward + update), in rank 0's ready
    order, and its F, B, U medians.

    A synchronous step goes at the pace of its slowest worker, so that worker's times are the ones to
    plan with; on workers of equal speed it is whichever one the machine happened to slow down most
    (two processes sharing a few cores are seldom equal).
    """
    first = runs[0]
    slowest = max(runs, key=lambda r: median(r.forward_total) + median(r.backward_total) + median(r.update))
    layers = []
    for name in first.order:
        b = slowest.backward[name]
        layers.append(
            LayerTiming(
                name=name,
                params=first.params[name],
                numel=first.numel[name],
                forward_s=median(slowest.forward[name]),
                backward_s=median(b),
                backward_iqr_s=iqr(b),
            )
        )
    return layers, median(slowest.forward_total), median(slowest.backward_total), median(slowest.update)
