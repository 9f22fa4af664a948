"""What communication costs the compute stream: packing gradients for a collective, the runtime's work in
real steps, and the slowdown of compute while a collective is in flight (interference).

All are times the timeline model puts on the compute stream (`GradientProblem.pack`, `.select`,
`.decode`, `.interference`):

- packing: the runtime's own `write_scaled` (a group's gradients into its flat buffer, divided by the
  world size) against the number of elements;
- in situ: the runtime itself (`GradientExchange`, one group per layer, sending nothing) in real steps
  beside steps without it, against what the micro-benchmarked curves predict for the same groups
  (`planner.contracts.profile.InSitu`);
- interference: the model's backward pass timed alone and while a chain of collectives is in flight on
  every worker, as it is during a real step; sigma = with / alone - 1 (at least 0). The chain is long
  enough to outlast the slowed backward pass; a repetition where it did not is measured again with a
  longer chain.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from planner.contracts.profile import Calibration, FittedCurve, InSitu, LayerTiming, TopkTiming
from planner.costmodel.costs import CostModel
from planner.kernels.topk import all_gather_flat
from planner.models import Workload
from planner.platform.timing import median, time_call
from planner.types import Collective, DistributedError, Strategy
from runtime.ddp_hooks import has_unused_parameters, silent_hook
from runtime.exchange import GradientExchange, write_scaled

__all__ = ["INTERFERENCE_MESSAGE_BYTES", "measure_in_situ", "measure_interference", "measure_packing"]

#: Size of each collective of the chain that runs during the timed backward passes (per rank).
INTERFERENCE_MESSAGE_BYTES = 4 << 20
#: The chain is planned to last this many times the backward pass alone (sigma up to about 2 fits in).
_CHAIN_SPAN = 3.0
#: A chain never holds more collectives than this (tiny models on fast links).
_MAX_CHAIN = 2000


def measure_packing(
    sizes: Sequence[int], world_size: int, device: torch.device, *, repeats: int, warmup: int,
    on_point: Callable[[], object] = lambda: None,
) -> FittedCurve:
    """Median seconds of `write_scaled` writing N gradient elements into a flat buffer, scaled by 1/P, for
    each N in `sizes`, with the affine fit."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    points = []
    for n in sizes:
        grad = torch.randn(n, generator=gen).to(device)
        flat = torch.empty(n, device=device)
        samples = time_call(functools.partial(write_scaled, grad, flat, 1.0 / world_size), device,
                            repeats=repeats, warmup=warmup)
        points.append((int(n), median(samples)))
        on_point()
    return FittedCurve.fit(points)


class _SilentExchange(GradientExchange):
    """The runtime with every collective skipped: each rank's message stands for every rank's (top-k decodes
    P copies of its own), so prepare and finish do all their usual work and nothing is sent."""

    def _start_collective(self, st: Any) -> Any:
        if st.recv is not None:
            size = st.k_now * 2
            for r in range(self.world_size):
                st.recv[r * size : (r + 1) * size].copy_(st.send[:size])
        return None


def measure_in_situ(
    workload: Workload,
    device: torch.device,
    layers: Sequence[LayerTiming],
    world_size: int,
    *,
    pack: CostModel,
    topk: TopkTiming | None,
    density: float,
    repeats: int,
    process_group: Any = None,
    on_point: Callable[[], object] = lambda: None,
) -> InSitu:
    """Calibrate packing, each selector and decoding against the runtime in real steps (every rank calls it).

    For dense and for top-k at `density` with each selector `topk` measured, the runtime with one group per
    layer (in `layers`' ready order) and a plain copy of the model run alternately, `repeats` steps each
    after one of each unmeasured. The runtime's extra backward time (its hooks pack or select) and its
    synchronize time (top-k: decoding) are compared with the curves' sum over the same groups; medians are
    over every rank's samples. With more than one worker, PyTorch DDP with a comm hook that sends nothing
    is measured the same way against packing on its default buckets (`InSitu.ddp_pack`). `on_point` is
    called after each pair of steps.
    """
    from planner.contracts.fingerprint import ClusterInfo, model_info
    from planner.contracts.layers import LayerSpec, groups_for
    from planner.contracts.plan import Plan
    from planner.costmodel.problem import Prediction, topk_count

    specs = [LayerSpec(name=lt.name, params=lt.params, numel=lt.numel) for lt in layers]
    per_layer = tuple(range(1, len(specs) + 1))
    configs: list[tuple[Strategy, str | None]] = [(Strategy.DENSE, None)]
    if world_size > 1:
        configs.append((Strategy.DENSE, "ddp"))
    if topk is not None:
        configs += [(Strategy.TOPK, selector) for selector in topk.selectors()]
    inputs, targets = (t.to(device) for t in workload.batch(seed=2468))
    plain = workload.module.to(device)
    name = workload.name
    pack_calibration = decode_calibration = ddp_calibration = None
    select_calibration: dict[str, Calibration] = {}
    sizes = [s.numel for s in specs]
    for strategy, selector in configs:
        if selector == "ddp":
            extra_s = _ddp_extra_seconds(workload, plain, inputs, targets, device, repeats, process_group, on_point)
            ddp_calibration = Calibration(measured_s=max(0.0, extra_s),
                                          modelled_s=sum(pack.cost(n) for n in _ddp_buckets(sizes)))
            continue
        d = density if strategy is Strategy.TOPK else None
        plan = Plan(
            strategy=strategy, density=d, selector=selector, model=model_info(plain, name),
            cluster=ClusterInfo(world_size=world_size, backend=dist.get_backend(process_group), device=str(device)),
            groups=groups_for(specs, per_layer, strategy, d),
            predicted=Prediction(iteration_s=0, compute_s=0, exposed_comm_s=0, comm_s=0), baselines={},
            lower_bound_s=0.0, solver="in-situ", solve_seconds=0.0, source_profile="", profiled="", created="",
        )
        hooked = copy.deepcopy(plain)
        exchange = _SilentExchange(hooked, plan, process_group=process_group)
        extra, finish = [], []
        try:
            for i in range(repeats + 1):
                alone, with_hooks = _pair(workload, plain, hooked, inputs, targets, device, flip=bool(i % 2))
                synchronize = _stream_seconds(exchange.synchronize, device)
                if i:
                    extra.append(with_hooks - alone)
                    finish.append(synchronize)
                    on_point()
        finally:
            exchange.close()
        extra_s, finish_s = median(_gathered(extra, process_group)), median(_gathered(finish, process_group))
        if strategy is Strategy.DENSE:
            pack_calibration = Calibration(measured_s=max(0.0, extra_s), modelled_s=sum(pack.cost(n) for n in sizes))
            continue
        assert topk is not None and selector is not None
        select = topk.select_model(density, selector)
        select_calibration[selector] = Calibration(measured_s=max(0.0, extra_s),
                                                   modelled_s=sum(select.cost(n) for n in sizes))
        if decode_calibration is None:  # the same decode for either selector: calibrate it once
            decode = topk.decode.model
            decode_calibration = Calibration(
                measured_s=finish_s, modelled_s=sum(decode.cost(world_size * topk_count(n, density)) for n in sizes))
    return InSitu(pack=pack_calibration, select=select_calibration, decode=decode_calibration,
                  ddp_pack=ddp_calibration)


def _ddp_extra_seconds(workload: Workload, plain: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                       device: torch.device, repeats: int, group: Any, on_point: Callable[[], object]) -> float:
    """Median over ranks of how much longer DDP's backward pass is than `plain`'s, when its comm hook sends
    nothing: DDP's own work, copying gradients into its buckets and back."""
    from torch.nn.parallel import DistributedDataParallel

    unused = has_unused_parameters(plain, lambda m: workload.loss_fn(m(inputs), targets), group)
    wrapped = DistributedDataParallel(copy.deepcopy(plain), process_group=group, find_unused_parameters=unused)
    wrapped.register_comm_hook(None, silent_hook)
    extra = []
    for i in range(repeats + 1):
        alone, with_ddp = _pair(workload, plain, wrapped, inputs, targets, device, flip=bool(i % 2))
        if i:
            extra.append(with_ddp - alone)
            on_point()
    return median(_gathered(extra, group))


def _ddp_buckets(sizes: Sequence[int]) -> list[int]:
    """Elements of each of DDP's default buckets over layers of `sizes` elements, in ready order (as the
    "ddp-25mb" baseline forms them)."""
    from planner.costmodel.costs import AffineCost
    from planner.costmodel.problem import GradientProblem, groups_of
    from planner.solvers import BASELINES, DDP_BASELINE

    problem = GradientProblem(strategy=Strategy.DENSE, forward_s=0.0, update_s=0.0, backward_s=(0.0,) * len(sizes),
                              numel=tuple(sizes), comm=AffineCost(alpha=0.0, beta=0.0), world_size=2)
    ddp = next(b for b in BASELINES[Strategy.DENSE] if b.name == DDP_BASELINE)
    return [sum(sizes[i] for i in r) for r in groups_of(ddp.solve(problem))]


def _pair(workload: Workload, plain: torch.nn.Module, other: torch.nn.Module, inputs: torch.Tensor,
          targets: torch.Tensor, device: torch.device, *, flip: bool) -> tuple[float, float]:
    """Backward seconds of `plain` and of `other`, one after the other; `flip` runs `other` first (the
    second of two passes in a row tends to be a little slower: alternating cancels that out)."""
    if flip:
        second = _backward_seconds(workload, other, inputs, targets, device)
        return _backward_seconds(workload, plain, inputs, targets, device), second
    first = _backward_seconds(workload, plain, inputs, targets, device)
    return first, _backward_seconds(workload, other, inputs, targets, device)


def _backward_seconds(workload: Workload, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                      device: torch.device) -> float:
    """Seconds of one backward pass of `model` (gradients dropped first, forward untimed)."""
    model.zero_grad(set_to_none=True)
    loss = workload.loss_fn(model(inputs), targets)
    return _stream_seconds(loss.backward, device)


def _chain(coll: Collective, nbytes: int, device: torch.device, group: Any) -> Callable[[int], list[Any]]:
    """A function starting n asynchronous collectives of `nbytes` per rank, returning their work handles."""
    x = torch.ones(max(1, nbytes // 4), device=device)
    match coll:
        case Collective.ALLREDUCE:
            return lambda n: [dist.all_reduce(x, group=group, async_op=True) for _ in range(n)]
        case Collective.ALLGATHER:
            out = torch.empty(x.numel() * dist.get_world_size(group), device=device)
            return lambda n: [all_gather_flat(out, x, group=group, async_op=True) for _ in range(n)]
        case _:
            raise ValueError(f"interference is measured for allreduce and allgather, not {coll.value}")


def measure_interference(
    workload: Workload,
    device: torch.device,
    collectives: Sequence[Collective],
    *,
    repeats: int,
    message_bytes: int = INTERFERENCE_MESSAGE_BYTES,
    process_group: Any = None,
    on_point: Callable[[], object] = lambda: None,
) -> dict[Collective, float]:
    """sigma of each collective: the backward pass takes (1 + sigma) times as long while it runs.

    Every rank calls this (it runs collectives). Alone and with a chain alternate, `repeats` times each,
    after one unmeasured pair; sigma comes from the medians over all ranks' samples. `on_point` is called
    after each pair.

    Raises:
        DistributedError: the chain ended before the backward pass in every attempt (it then cannot tell).
    """
    model = workload.module.to(device)
    inputs, targets = (t.to(device) for t in workload.batch(seed=4321))

    def backward_seconds(chain: Callable[[int], list[Any]] | None, length: int) -> tuple[float, bool]:
        """Seconds of one backward pass (the forward is not timed), and whether the chain outlasted it."""
        model.zero_grad(set_to_none=True)
        loss = workload.loss_fn(model(inputs), targets)
        if device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the forward is done; the chain's stream is not waited for
        dist.barrier(group=process_group)
        works = chain(length) if chain is not None else []
        seconds = _stream_seconds(loss.backward, device)
        outlasted = not works or not works[-1].is_completed()
        for work in works:
            work.wait()
        return seconds, outlasted

    out = {}
    alone_one = backward_seconds(None, 0)[0]
    for coll in collectives:
        chain = _chain(coll, message_bytes, device, process_group)
        one = time_call(functools.partial(_run_chain, chain, 1), device, repeats=3, warmup=1)
        length = _agreed(min(_MAX_CHAIN, math.ceil(_CHAIN_SPAN * alone_one / max(median(one), 1e-6)) + 1),
                         process_group, device)
        # A chain that ended before some backward pass did (a tiny model, or a pass that a busy machine
        # preempted) is doubled and the pairs measured again, until the chain is as long as allowed.
        for attempt in itertools.count():
            alone, busy = [], []
            outlasted = True
            backward_seconds(chain, length)  # unmeasured: the first pass under load
            for _ in range(repeats):
                alone.append(backward_seconds(None, 0)[0])
                seconds, ok = backward_seconds(chain, length)
                busy.append(seconds)
                outlasted &= ok
                if not attempt:  # progress counts the first attempt; a retry with a longer chain is extra
                    on_point()
            if _agreed(int(outlasted), process_group, device, op=dist.ReduceOp.MIN):
                break
            if length >= _MAX_CHAIN:
                raise DistributedError(
                    f"could not keep {coll.value}s in flight for a whole backward pass ({length} of "
                    f"{message_bytes} bytes were not enough); interference was not measured"
                )
            length = min(_MAX_CHAIN, 2 * length)
        everyone_alone, everyone_busy = _gathered(alone, process_group), _gathered(busy, process_group)
        out[coll] = max(0.0, median(everyone_busy) / median(everyone_alone) - 1.0)
    return out


def _run_chain(chain: Callable[[int], list[Any]], length: int) -> None:
    for work in chain(length):
        work.wait()


def _stream_seconds(fn: Callable[[], object], device: torch.device) -> float:
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


def _agreed(value: int, group: Any, device: torch.device, op: Any = None) -> int:
    """The largest (or, with `op`, the reduced) `value` over ranks."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.MAX, group=group)
    return int(t.item())


def _gathered(samples: list[float], group: Any) -> list[float]:
    """Every rank's samples (the same number on each)."""
    everyone: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, samples, group=group)
    return [float(x) for xs in everyone for x in xs]  # type: ignore[attr-defined]
