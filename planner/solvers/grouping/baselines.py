"""The baselines each plan is compared with (`BASELINES`; `exact = False`, evaluated with the same model so that
comparisons are fair): one collective per layer (WFBP), one bucket for everything, PyTorch DDP's buckets, Horovod's
fusion cycle, fixed 64 MiB buckets, and the greedy merge rules published with MG-WFBP and MGS. Every row groups
whole layers in ready order; DDP and Horovod bucket parameter tensors, so a layer's weight and bias can land in
different buckets there.
"""

from __future__ import annotations

import math
from typing import ClassVar

from planner.costmodel.costs import AffineCost, CostModel
from planner.costmodel.problem import GradientProblem, Grouping, advance
from planner.solvers.grouping.base import GroupingSolver
from planner.types import SolverError, Strategy

__all__ = [
    "BASELINES",
    "DDP_BASELINE",
    "DDP_BUCKET_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "FIXED_64MB_BYTES",
    "HOROVOD_CYCLE_S",
    "HOROVOD_FUSION_BYTES",
    "FixedBuckets",
    "HorovodCycle",
    "MGSGreedy",
    "MGWFBPGreedy",
    "PerLayer",
    "SingleBucket",
]


#: PyTorch DDP's first bucket (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`, 1 MiB).
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
#: PyTorch DDP's `bucket_cap_mb=25` default, in bytes.
DDP_BUCKET_BYTES = 25 * 1024 * 1024
#: Name of the grouping rule of PyTorch DDP's default buckets (a plan's row of DDP on them is named by what it sends:
#: `planner.contracts.plan.ddp_row`).
DDP_BASELINE = "ddp-25mb"
#: The fixed 64 MiB buckets once documented as Horovod's fusion threshold (the "fixed-64mb" row).
FIXED_64MB_BYTES = 64 * 1024 * 1024
#: Horovod's defaults since v0.21: `HOROVOD_CYCLE_TIME` 1 ms (1e-3 s) and `HOROVOD_FUSION_THRESHOLD`
#: 128 MiB (the "horovod" row, `HorovodCycle`).
HOROVOD_CYCLE_S = 1e-3
HOROVOD_FUSION_BYTES = 128 * 1024 * 1024


class PerLayer(GroupingSolver):
    """WFBP: one collective per layer, launched as soon as its gradient is ready."""

    name = "wfbp"
    exact = False
    description = "one collective per layer (wait-free backpropagation)"

    def solve(self, problem: GradientProblem) -> Grouping:
        return tuple(range(1, problem.num_layers + 1))


class SingleBucket(GroupingSolver):
    """One collective for all gradients, after the whole backward pass."""

    name = "single"
    exact = False
    description = "one collective for all gradients"

    def solve(self, problem: GradientProblem) -> Grouping:
        return (problem.num_layers,)


class FixedBuckets(GroupingSolver):
    """Size-capped buckets filled in ready order by dense gradient bytes (numel * element_bytes).

    A bucket closes as soon as its size reaches the cap (>=), as in PyTorch DDP's
    `_compute_bucket_assignment_by_size`; the first bucket may have its own, smaller cap
    (DDP's `_DEFAULT_FIRST_BUCKET_BYTES`), later ones use `cap_bytes`. The last bucket holds the rest.
    """

    name: ClassVar[str] = "fixed"
    exact = False
    description: ClassVar[str] = "fixed-size buckets"

    def __init__(self, cap_bytes: int, first_cap_bytes: int | None = None, *, name: str | None = None) -> None:
        if cap_bytes <= 0 or (first_cap_bytes is not None and first_cap_bytes <= 0):
            raise SolverError(
                f"`cap_bytes > 0 and first_cap_bytes > 0` must hold, but got "
                f"(cap_bytes={cap_bytes}, first_cap_bytes={first_cap_bytes})"
            )
        self.cap_bytes = cap_bytes
        self.first_cap_bytes = first_cap_bytes
        first = "" if first_cap_bytes is None else f", first bucket {first_cap_bytes} B"
        # Instances carry their own name and description (one class, several configured baselines).
        self.name = name or f"fixed-{cap_bytes}b"  # type: ignore[misc]
        self.description = f"buckets closed at >= {cap_bytes} B{first}"  # type: ignore[misc]

    def solve(self, problem: GradientProblem) -> Grouping:
        ends: list[int] = []
        cap = self.cap_bytes if self.first_cap_bytes is None else self.first_cap_bytes
        size = 0
        for i, numel in enumerate(problem.numel):
            size += numel * problem.element_bytes
            if size >= cap:
                ends.append(i + 1)
                size, cap = 0, self.cap_bytes
        if not ends or ends[-1] != problem.num_layers:
            ends.append(problem.num_layers)
        return tuple(ends)

    def __repr__(self) -> str:
        return f"FixedBuckets(cap_bytes={self.cap_bytes}, first_cap_bytes={self.first_cap_bytes}, name={self.name!r})"


def _startup_cost(model: CostModel) -> float:
    """The start-up (latency) term alpha of a collective: exact for AffineCost, else the cost of 1 byte."""
    if isinstance(model, AffineCost):
        return model.alpha
    return model.cost(1.0)


class _GreedyWalk:
    """Shared state of the greedy merge rules: the clocks after the closed groups, and the open group."""

    def __init__(self, problem: GradientProblem) -> None:
        self.problem = problem
        self.compute = 0.0  # C after the closed groups (backward + selection on the compute stream)
        self.channel = 0.0  # E after the closed groups
        self.numel = 0  # N of the open group
        self.backward = 0.0  # backward time of the open group's layers
        self.ends: list[int] = []

    def select(self, numel: int) -> float:
        """Selection (top-k) or packing (dense) of a group of `numel` elements."""
        return self.problem.prepare_s(numel)

    def comm(self, numel: int) -> float:
        return self.problem.comm.cost(self.problem.message_bytes(numel))

    def add(self, layer: int) -> None:
        self.numel += self.problem.numel[layer]
        self.backward += self.problem.backward_s[layer]

    def closed_clocks(self) -> tuple[float, float, float]:
        """If the open group closed now: (end of its selection, start of its collective, end of it)."""
        compute = advance(self.compute, self.channel, self.backward + self.select(self.numel),
                          self.problem.interference)
        comm_start = max(compute, self.channel)
        return compute, comm_start, comm_start + self.comm(self.numel)

    def close(self, end: int) -> None:
        self.compute, _, self.channel = self.closed_clocks()
        self.ends.append(end)
        self.numel, self.backward = 0, 0.0


class MGWFBPGreedy(GroupingSolver):
    """MG-WFBP's merge rule (Shi, Chu, Li, INFOCOM 2019), as in the authors' code.

    Source: HKBU-HPML/MG-WFBP, `distributed_optimizer.py`, `_generate_groups_mgwfbp`. Walking layers in
    ready order with the open group's collective placed on the timeline as if it closed now
    (start tau_c = max(ready, end of the previous collective), duration t_c), the next layer is merged
    into the open group when its gradient is ready before that collective would end and either the
    collective could not have started before it (tau_c > ready_next) or the wait it adds is below the
    start-up cost it saves (ready_next - tau_c < alpha). alpha is the cost model's start-up term
    (AffineCost.alpha; otherwise the cost of a 1-byte message). On top-k problems the same rule runs on
    the top-k timeline (the next gradient is ready after the open group's selection; t_c is the allgather).
    """

    name = "mg-wfbp"
    exact = False
    description = "MG-WFBP greedy merge (Shi et al., INFOCOM 2019)"

    def solve(self, problem: GradientProblem) -> Grouping:
        walk = _GreedyWalk(problem)
        alpha = _startup_cost(problem.comm)
        for layer in range(problem.num_layers - 1):
            walk.add(layer)
            compute, comm_start, comm_end = walk.closed_clocks()
            ready_next = advance(compute, comm_end, problem.backward_s[layer + 1], problem.interference)
            merge = ready_next < comm_end and (comm_start > ready_next or ready_next - comm_start < alpha)
            if not merge:
                walk.close(layer + 1)
        walk.ends.append(problem.num_layers)
        return tuple(walk.ends)


class MGSGreedy(GroupingSolver):
    """The greedy merge rule published with MGS (Shi et al., INFOCOM 2020), as in the authors' code.

    Source: HKBU-HPML/OMGS-SGD, `hv_distributed_optimizer.py`, `_generate_groups_mgs`. Walking layers in
    ready order, with the open group (N elements) closed now its collective would wait
    t_idle = max(0, end of the previous collective - end of its selection). Merging the next layer
    (n elements, backward b) delays that collective by t_w = b + s(N + n) - s(N) - s(n) - t_idle and saves
    t_save = T(N) + T(n) - T(N + n) of communication; merge when t_w < t_save. Decoding is not part of
    the rule (as in the source). Deviation: the source always puts the first two layers in one group
    (its loop starts one layer late); here the rule also decides that first merge. On dense problems
    s = 0 and T is the allreduce.
    """

    name = "mgs-greedy"
    exact = False
    description = "MGS greedy merge (Shi et al., INFOCOM 2020)"

    def solve(self, problem: GradientProblem) -> Grouping:
        walk = _GreedyWalk(problem)
        for layer in range(problem.num_layers - 1):
            walk.add(layer)
            compute, comm_start, _ = walk.closed_clocks()
            n, big = problem.numel[layer + 1], walk.numel
            idle = comm_start - compute
            wait = problem.backward_s[layer + 1] + walk.select(big + n) - walk.select(big) - walk.select(n) - idle
            save = walk.comm(big) + walk.comm(n) - walk.comm(big + n)
            merge = wait < save
            if not merge:
                walk.close(layer + 1)
        walk.ends.append(problem.num_layers)
        return tuple(walk.ends)


class HorovodCycle(GroupingSolver):
    """Horovod's tensor fusion: every cycle, fuse whatever gradients are ready, up to the fusion threshold.

    Horovod's background thread wakes every `cycle_s` (HOROVOD_CYCLE_TIME), collects the tensors every rank
    has ready and performs their allreduces, fused in order into buffers of at most `threshold_bytes`
    (HOROVOD_FUSION_THRESHOLD); it does not wait for a threshold's worth to accumulate. Its collectives run
    one after the other, so a cycle that finds the previous one still communicating waits for it, and then
    fuses everything that became ready meanwhile. On the model's timeline (ready times with the packing and
    interference of the groups already formed) a group closes at the first cycle tick (multiples of
    `cycle_s` from the start of backward) at or after both its first gradient's ready time and the end of
    the previous collective, and holds every gradient ready by then, up to the threshold (at least one
    layer). The grouping is then evaluated like every other (its collective starts when its last gradient
    is ready, not at the tick: the up to `cycle_s` of waiting for a tick per group is not counted).
    """

    name = "horovod"
    exact = False
    description = "Horovod: fuse what is ready every cycle (1 ms), up to 128 MiB"

    def __init__(self, cycle_s: float = HOROVOD_CYCLE_S, threshold_bytes: int = HOROVOD_FUSION_BYTES) -> None:
        if not (cycle_s > 0 and threshold_bytes > 0):
            raise SolverError(f"`cycle_s > 0 and threshold_bytes > 0` must hold, but got "
                              f"(cycle_s={cycle_s}, threshold_bytes={threshold_bytes})")
        self.cycle_s = cycle_s
        self.threshold_bytes = threshold_bytes

    def solve(self, problem: GradientProblem) -> Grouping:
        walk = _GreedyWalk(problem)
        sigma = problem.interference
        layer = 0
        while layer < problem.num_layers:
            ready = advance(walk.compute, walk.channel, problem.backward_s[layer], sigma)
            tick = math.ceil(max(ready, walk.channel) / self.cycle_s - 1e-9) * self.cycle_s
            walk.add(layer)
            layer += 1
            size = problem.numel[layer - 1] * problem.element_bytes
            while layer < problem.num_layers:
                size += problem.numel[layer] * problem.element_bytes
                ready = advance(walk.compute, walk.channel, walk.backward + problem.backward_s[layer], sigma)
                if ready > tick or size > self.threshold_bytes:
                    break
                walk.add(layer)
                layer += 1
            walk.close(layer)
        return tuple(walk.ends)

    def __repr__(self) -> str:
        return f"HorovodCycle(cycle_s={self.cycle_s}, threshold_bytes={self.threshold_bytes})"


_COMMON: tuple[GroupingSolver, ...] = (
    PerLayer(),
    SingleBucket(),
    FixedBuckets(DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, name=DDP_BASELINE),
    HorovodCycle(),
    FixedBuckets(FIXED_64MB_BYTES, name="fixed-64mb"),
)

#: The baselines each plan is compared with, per strategy.
BASELINES: dict[Strategy, tuple[GroupingSolver, ...]] = {
    Strategy.DENSE: (*_COMMON, MGWFBPGreedy()),
    Strategy.TOPK: (*_COMMON, MGSGreedy()),
}
