"""Per-layer forward and backward time, gradient sizes, and the measured gradient-ready order."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from planner.contracts.layers import gradient_layers
from planner.contracts.profile import LayerTiming, StepSamples
from planner.contracts.unused import UnusedParams
from planner.models import Workload
from planner.platform.timing import Marks, iqr, median, time_call

__all__ = ["MAX_LAYER_REPEATS", "UNUSED_CHECK_BATCHES", "LayerRun", "LayerSummary", "combine_ranks", "gradient_counts",
           "measure_layers", "unused_params"]

#: Batches each rank checks for parameters without a gradient (`gradient_counts`): a router that picks 2 of 4
#: experts per batch leaves a given expert out of all 8 with probability (1/2)**8 at the most.
UNUSED_CHECK_BATCHES = 8

#: The most repeats `measure_layers` extends to when its whole steps should span `min_seconds`.
MAX_LAYER_REPEATS = 100


@dataclass(frozen=True, kw_only=True)
class LayerRun:
    """One rank's measurements: per-layer samples in measured ready order, whole-phase samples, and whole steps
    without hooks (`whole`) taken between the hooked ones."""

    order: tuple[str, ...]
    params: dict[str, tuple[str, ...]]
    numel: dict[str, int]
    forward: dict[str, list[float]]
    backward: dict[str, list[float]]
    forward_total: list[float]
    backward_total: list[float]
    update: list[float]
    whole: list[float] = field(default_factory=list)


def measure_layers(
    workload: Workload,
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    barrier: Callable[[], object] = lambda: None,
    on_step: Callable[[], object] = lambda: None,
    min_seconds: float = 0.0,
    max_repeats: int = MAX_LAYER_REPEATS,
    agree: Callable[[float], float] = lambda seconds: seconds,
    on_total: Callable[[int], object] = lambda total: None,
) -> LayerRun:
    """Run forward/backward/update `warmup + repeats` times, timing each layer from module and grad hooks,
    and as many whole steps without hooks between them (`LayerRun.whole`).

    With `min_seconds`, a fast model gets more repeats (up to `max_repeats`) so that its measured whole steps span
    about that long, as estimated from the warm-up's whole steps (none without a warm-up): a 25 ms step timed ten
    times spans a quarter of a second, and a spell of a shared machine that short moved the median by 15%.
    `agree` turns this rank's estimate into the one every rank uses (the slowest rank's: the ranks pass barriers
    together, so they must run as many steps); `on_total` hears the new number of steps, warm-up included.

    A layer's backward time is the gap between the previous layer's gradient becoming ready (or the start
    of backward) and its own: b_i of the timeline model. The ready order is read from the hooks, not assumed.
    Hooked and plain steps alternate (plain first on odd repeats) so both see the machine in the same state:
    on a shared machine the speed of the same step drifts by tens of percent from one minute to the next,
    and the whole steps are the cross-check (and the scale, `combine_ranks`) of the sum of the parts.
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

    def install() -> list[torch.utils.hooks.RemovableHandle]:
        handles = []
        for pname, p in model.named_parameters():
            if pname in layer_of:
                handles.append(p.register_post_accumulate_grad_hook(lambda _t, n=pname: on_ready(n)))
        for s in specs:
            mod = modules["" if s.name == "<root>" else s.name]
            handles.append(mod.register_forward_pre_hook(lambda _m, _i, n=s.name: fmarks.mark(">" + n)))
            handles.append(mod.register_forward_hook(lambda _m, _i, _o, n=s.name: fmarks.mark("<" + n)))
        return handles

    inputs, targets = (t.to(device) for t in workload.batch(seed=1234))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def plain_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        workload.loss_fn(model(inputs), targets).backward()
        optimizer.step()

    def timed_plain() -> float:
        barrier()
        return time_call(plain_step, device, repeats=1, warmup=0)[0]

    forward: dict[str, list[float]] = {s.name: [] for s in specs}
    backward: dict[str, list[float]] = {s.name: [] for s in specs}
    forward_total, backward_total, update, whole = [], [], [], []
    order: tuple[str, ...] = ()
    rep = 0
    while rep < warmup + repeats:
        plain_first = rep % 2 == 1
        if plain_first:
            whole.append(timed_plain())
        handles = install()
        try:
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
        finally:
            for h in handles:
                h.remove()
        if not plain_first:
            whole.append(timed_plain())
        on_step()
        rep += 1
        if rep == warmup and min_seconds > 0:
            step_s = agree(median(whole))
            wanted = math.ceil(min_seconds / step_s) if step_s > 0 else max_repeats
            if min(max_repeats, wanted) > repeats:
                repeats = min(max_repeats, wanted)
                on_total(warmup + repeats)
        if rep <= warmup:
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
        whole=whole[warmup:],
    )


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


@dataclass(frozen=True)
class LayerSummary:
    """What the profile keeps of the layers phase: per-layer timings and F, B, U of the slowest worker, scaled
    to its whole steps; `step_s` those whole steps (None when none were timed), `scale` the factor applied."""

    layers: list[LayerTiming]
    forward_s: float
    backward_s: float
    update_s: float
    step_s: float | None
    scale: float | None
    #: The steps these are medians of (None: no whole steps timed, or layers timed a different number of times).
    steps: StepSamples | None = None


def combine_ranks(runs: list[LayerRun]) -> LayerSummary:
    """Layer timings of the slowest worker (largest median whole step, or forward + backward + update when
    no whole steps were timed), in rank 0's ready order, and its F, B, U medians, all scaled by one factor so
    that F + sum(b_i) + U equals the median over the whole steps of the slowest rank's time at each.

    A synchronous step goes at the pace of its slowest worker, so that worker's times are the ones to
    plan with; on workers of equal speed it is whichever one the machine happened to slow down most
    (two processes sharing a few cores are seldom equal). The whole steps started from a barrier on every rank,
    as a bench step does, so the step time is taken as the bench takes it: each step's slowest rank, then the
    median. That is longer than the slowest rank's median where the ranks' times scatter (four workers on two
    cores: 3-13% longer in four runs of the MLP). The scale takes out what the hooks add and what a sum of
    medians adds over the median of sums; the whole steps ran between the hooked ones, so the machine's drift
    is not in it.
    """
    first = runs[0]

    def parts(r: LayerRun) -> float:
        return median(r.forward_total) + median(r.backward_total) + median(r.update)

    timed = all(r.whole for r in runs)
    slowest = max(runs, key=lambda r: median(r.whole) if timed else parts(r))
    fwd, upd = median(slowest.forward_total), median(slowest.update)
    backward = {name: median(slowest.backward[name]) for name in first.order}
    steps = min(len(r.whole) for r in runs) if timed else 0
    step_s = median([max(r.whole[i] for r in runs) for i in range(steps)]) if steps else None
    summed = fwd + sum(backward.values()) + upd
    scale = step_s / summed if step_s is not None and summed > 0 else None
    k = 1.0 if scale is None else scale
    layers = [
        LayerTiming(
            name=name,
            params=first.params[name],
            numel=first.numel[name],
            forward_s=k * median(slowest.forward[name]),
            backward_s=k * backward[name],
            backward_iqr_s=k * iqr(slowest.backward[name]),
        )
        for name in first.order
    ]
    return LayerSummary(layers=layers, forward_s=k * fwd, backward_s=k * median(slowest.backward_total),
                        update_s=k * upd, step_s=step_s, scale=scale,
                        steps=_step_samples(slowest, runs, first.order, steps))


def _step_samples(slowest: LayerRun, runs: list[LayerRun], order: tuple[str, ...], steps: int) -> StepSamples | None:
    """The slowest worker's hooked steps beside every rank's whole steps (the slowest rank's at each), when every
    list holds one entry per measured step (a layer whose gradient never arrived holds one 0: zero every step)."""
    if not steps:
        return None
    whole = tuple(max(r.whole[i] for r in runs) for i in range(steps))
    if len(slowest.forward_total) != steps or len(slowest.update) != steps or any(
            len(slowest.backward[name]) != steps and slowest.backward[name] != [0.0] for name in order):
        return None
    per_layer = [slowest.backward[name] if len(slowest.backward[name]) == steps else [0.0] * steps for name in order]
    return StepSamples(whole_s=whole, forward_s=tuple(slowest.forward_total), update_s=tuple(slowest.update),
                       backward_s=tuple(tuple(col[i] for col in per_layer) for i in range(steps)))


def gradient_counts(workload: Workload, device: torch.device, seeds: range) -> dict[str, int]:
    """In how many of the batches drawn from `seeds` each trainable parameter got a gradient (forward and
    backward, no update). Several batches, not one: a mixture-of-experts router leaves other experts unused in
    each batch, and a parameter unused in some batches needs `find_unused_parameters` as much as one never used."""
    model = workload.module.to(device)
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    counts = dict.fromkeys((name for name, _ in params), 0)
    for seed in seeds:
        inputs, targets = (t.to(device) for t in workload.batch(seed=seed))
        model.zero_grad(set_to_none=True)
        workload.loss_fn(model(inputs), targets).backward()
        for name, p in params:
            counts[name] += p.grad is not None
    model.zero_grad(set_to_none=True)
    return counts


def unused_params(counts: list[dict[str, int]], batches: int) -> UnusedParams:
    """Every rank's `gradient_counts` (of `batches` batches each) as one record: parameters with no gradient in
    any batch of any rank (`never`) or in some (`sometimes`), in the model's order."""
    total = batches * len(counts)
    summed = {name: sum(c[name] for c in counts) for name in counts[0]}
    return UnusedParams(batches=total, never=tuple(n for n, c in summed.items() if c == 0),
                        sometimes=tuple(n for n, c in summed.items() if 0 < c < total))
