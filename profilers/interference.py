"""The slowdown of compute while a collective is in flight (interference): the model's backward pass
timed alone and while a chain of collectives is in flight on every worker, as it is during a real
step; sigma = with / alone - 1 (at least 0), the time the timeline model puts on the compute stream
per second of overlapped communication (`GradientProblem.interference`). The chain is long enough to
outlast the slowed backward pass; a repetition where it did not is measured again with a longer chain.

The other direction, kappa (`comm_stretch`): a shorter chain, each collective stamped when it completes, runs
(1 + kappa) times slower while every worker runs forward and backward passes than alone (on a CPU the
collectives' copies share the cores with compute, so kappa is large over loopback and small where the link is
the bottleneck).

What the runtime's own work costs the compute stream (packing, selection, decoding in real steps) is
measured by the runtime itself: `planner.runtime.calibrate`.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from planner.contracts.profile import SlowdownSamples
from planner.kernels.topk import all_gather_flat
from planner.models import Workload
from planner.platform.timing import gathered, median, stream_seconds, time_call
from planner.types import Collective, DistributedError

__all__ = ["INTERFERENCE_MESSAGE_BYTES", "Interference", "measure_interference"]

#: Size of each collective of the chain that runs during the timed backward passes (per rank).
INTERFERENCE_MESSAGE_BYTES = 4 << 20
#: The chain is planned to last this many times the backward pass alone (sigma up to about 2 fits in).
_CHAIN_SPAN = 3.0
#: A chain never holds more collectives than this (tiny models on fast links).
_MAX_CHAIN = 2000
#: The chains timed for kappa hold a third of the chain of the backward passes, and at least this many.
_STRETCH_CHAIN = 16


@dataclass(frozen=True)
class Interference:
    """Per collective: sigma, how much slower compute runs while one is in flight, and kappa (`comm_stretch`),
    how much slower a chain of them runs while every worker computes; and the samples both were taken from."""

    sigma: dict[Collective, float]
    comm_stretch: dict[Collective, float]
    samples: dict[Collective, SlowdownSamples]


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
) -> Interference:
    """sigma of each collective (the backward pass takes (1 + sigma) times as long while it runs) and kappa (a
    chain of it takes (1 + kappa) times as long while the workers run forward and backward passes).

    Every rank calls this (it runs collectives). Alone and with a chain alternate, `repeats` times each,
    after one unmeasured pair; sigma comes from the medians over all ranks' samples (`SlowdownSamples.sigma`, the
    samples kept). After each pair a chain a third as long (at least `_STRETCH_CHAIN`) runs alone, then again
    while every rank runs forward and backward passes until it completes: a chain's pace is the time from its
    start to its last completion over its length, and kappa = busy pace / alone pace - 1 (at least 0), from the
    medians over all ranks' samples. `on_point` is called after each pair.

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
        seconds = stream_seconds(loss.backward, device)
        outlasted = not works or not works[-1].is_completed()
        for work in works:
            work.wait()
        return seconds, outlasted

    def pace(chain: Callable[[int], list[Any]], length: int, *, busy: bool) -> float:
        """Seconds per collective of a chain of `length`: alone, or while this rank runs forward and backward
        passes until it has completed (whole passes: the chain may end in the middle of one)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group=process_group)
        started = time.perf_counter()
        works = chain(length)
        stamps, stamped = _stamped(works)
        while busy and not works[-1].is_completed():
            model.zero_grad(set_to_none=True)
            workload.loss_fn(model(inputs), targets).backward()
        for done in stamped:
            done.wait()
        seconds = _pace(stamps, started)
        assert seconds is not None  # every stamp is in: each future above completes after its callback ran
        return seconds

    sigma, kappa, samples = {}, {}, {}
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
            paces: dict[str, list[float]] = {"alone": [], "busy": []}
            outlasted = True
            backward_seconds(chain, length)  # unmeasured: the first pass under load
            short = min(length, max(_STRETCH_CHAIN, length // 3))
            for _ in range(repeats):
                alone.append(backward_seconds(None, 0)[0])
                seconds, ok = backward_seconds(chain, length)
                busy.append(seconds)
                outlasted &= ok
                paces["alone"].append(pace(chain, short, busy=False))
                paces["busy"].append(pace(chain, short, busy=True))
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
        # Every rank's pairs, in the same order for both halves of a pair.
        samples[coll] = SlowdownSamples(
            alone_s=tuple(gathered(alone, process_group)), busy_s=tuple(gathered(busy, process_group)),
            pace_alone_s=tuple(gathered(paces["alone"], process_group)),
            pace_busy_s=tuple(gathered(paces["busy"], process_group)))
        sigma[coll], kappa[coll] = samples[coll].sigma(), samples[coll].kappa()
    return Interference(sigma=sigma, comm_stretch=kappa, samples=samples)


def _stamped(works: Sequence[Any]) -> tuple[list[float | None], list[Any]]:
    """When each work completes (perf_counter seconds, filled in by a callback on its future; None until then),
    and futures that complete once each callback has run (wait on them, not on the works)."""
    stamps: list[float | None] = [None] * len(works)

    def stamp(i: int, _future: Any) -> None:
        stamps[i] = time.perf_counter()

    return stamps, [work.get_future().then(functools.partial(stamp, i)) for i, work in enumerate(works)]


def _pace(stamps: Sequence[float | None], started: float) -> float | None:
    """Seconds per collective of a chain started at `started`: to its last completion, over the collectives
    completed (a chain completes in order); None when none had."""
    done = [t for t in stamps if t is not None]
    return (max(done) - started) / len(done) if done else None


def _run_chain(chain: Callable[[int], list[Any]], length: int) -> None:
    for work in chain(length):
        work.wait()


def _agreed(value: int, group: Any, device: torch.device, op: Any = None) -> int:
    """The largest (or, with `op`, the reduced) `value` over ranks."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.MAX, group=group)
    return int(t.item())
