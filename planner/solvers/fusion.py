"""K-FAC factor fusion: which Kronecker factors share one allreduce on a factor-update step.

On a factor-update step every layer's A factor (ready in forward, forward order) and G factor (ready in
backward, backward order) is allreduced, upper triangle only. A buffer is a contiguous run of factors of
one kind in that kind's order, written like a gradient grouping (`planner.costmodel.problem.Grouping`, exclusive
ends). The factor buffers share ONE channel with the fixed gradient collectives of the step.

The channel model (the reference is `simulate_fusion`): a collective is issued when its last member is
ready and starts at max(its ready time, the channel free time); it takes `allreduce.cost(bytes)` s.
Every A buffer goes first (all A factors are ready before any backward item); after them, G buffers and
gradient collectives go in ready order, a gradient collective first on a tie.

Solvers: `FusionDP` (exact, SPD-KFAC's problem) and the baselines of `FUSION_BASELINES`: one allreduce
per factor, one buffer per kind, 25 MiB buffers, and SPD-KFAC's greedy dynamic tensor fusion.
"""

from __future__ import annotations

import abc
import itertools
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, SupportsIndex

import numpy as np

from planner.costmodel.costs import CostModel
from planner.costmodel.problem import Grouping, groups_of
from planner.costmodel.simulator import validate_ends
from planner.solvers.grouping import DDP_BUCKET_BYTES
from planner.solvers.grouping.base import _ends_from_back_pointers
from planner.solvers.grouping.baselines import _startup_cost
from planner.types import SolverError

__all__ = [
    "FUSION_BASELINES",
    "CommEvent",
    "EventKind",
    "FactorBuffers",
    "FixedBytes",
    "FusionDP",
    "FusionProblem",
    "FusionSolver",
    "FusionTimeline",
    "PerFactor",
    "SingleBuffer",
    "SpdKfacGreedy",
    "simulate_fusion",
    "validate_buffers",
]

#: (A buffer ends over A's forward order, G buffer ends over G's backward order).
FactorBuffers = tuple[Grouping, Grouping]

#: What a collective on the channel carries: an A buffer, a G buffer, or a fixed gradient collective.
EventKind = Literal["A", "G", "grad"]


def _check_items(what: str, ready: tuple[float, ...], nbytes: tuple[int, ...], *, allow_empty: bool) -> None:
    """Lengths, finite ready times >= 0 in non-decreasing order, and sizes > 0 of one sequence of items."""
    if not allow_empty and not ready:
        raise SolverError(f"the fusion problem has no {what} factors: `len({what.lower()}_ready_s) >= 1` must hold")
    prefix = "grad" if what == "gradient" else what.lower()
    if len(ready) != len(nbytes):
        raise SolverError(
            f"`len({prefix}_ready_s) == len({prefix}_bytes)` must hold, but got ({len(ready)}, {len(nbytes)})"
        )
    for i, t in enumerate(ready):
        if not math.isfinite(t) or t < 0:
            raise SolverError(f"`{prefix}_ready_s[{i}] >= 0` must hold (finite), but got {prefix}_ready_s[{i}]={t}")
    for i, (s, t) in enumerate(itertools.pairwise(ready)):
        if t < s:
            raise SolverError(
                f"`{prefix}_ready_s` must be non-decreasing (ready order), but got "
                f"({prefix}_ready_s[{i}]={s}, {prefix}_ready_s[{i + 1}]={t})"
            )
    for i, b in enumerate(nbytes):
        if b <= 0:
            raise SolverError(f"`{prefix}_bytes[{i}] > 0` must hold, but got {prefix}_bytes[{i}]={b}")


@dataclass(frozen=True, kw_only=True)
class FusionProblem:
    """The factor allreduces of one K-FAC factor-update step and the gradient collectives they share the channel with.

    Attributes:
        a_ready_s, a_bytes: ready time (s) and upper-triangle bytes of each A factor, forward order.
        g_ready_s, g_bytes: the same for each G factor, backward order; every G is ready after every A.
        grad_ready_s, grad_bytes: the fixed gradient collectives, ready order (may be empty).
        allreduce: seconds for an allreduce of x bytes.
        a_names, g_names: optional labels of the factors.
    """

    a_ready_s: tuple[float, ...]
    a_bytes: tuple[int, ...]
    g_ready_s: tuple[float, ...]
    g_bytes: tuple[int, ...]
    grad_ready_s: tuple[float, ...]
    grad_bytes: tuple[int, ...]
    allreduce: CostModel
    a_names: tuple[str, ...] = ()
    g_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Accept any sequences (lists, numpy arrays); store plain tuples of floats and ints.
        for name in ("a_ready_s", "g_ready_s", "grad_ready_s"):
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))
        for name in ("a_bytes", "g_bytes", "grad_bytes"):
            object.__setattr__(self, name, tuple(operator.index(x) for x in getattr(self, name)))
        for name in ("a_names", "g_names"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        _check_items("A", self.a_ready_s, self.a_bytes, allow_empty=False)
        _check_items("G", self.g_ready_s, self.g_bytes, allow_empty=False)
        _check_items("gradient", self.grad_ready_s, self.grad_bytes, allow_empty=True)
        last_a = self.a_ready_s[-1]
        if self.g_ready_s[0] < last_a:
            raise SolverError(
                f"`g_ready_s[0] >= a_ready_s[-1]` must hold (G factors are ready in backward), but got "
                f"(g_ready_s[0]={self.g_ready_s[0]}, a_ready_s[-1]={last_a})"
            )
        if self.grad_ready_s and self.grad_ready_s[0] < last_a:
            raise SolverError(
                f"`grad_ready_s[0] >= a_ready_s[-1]` must hold (gradients are ready in backward), but got "
                f"(grad_ready_s[0]={self.grad_ready_s[0]}, a_ready_s[-1]={last_a})"
            )
        for kind, names, count in (("a", self.a_names, self.num_a), ("g", self.g_names, self.num_g)):
            if names and len(names) != count:
                raise SolverError(
                    f"`len({kind}_names) == len({kind}_ready_s)` must hold, but got ({len(names)}, {count})"
                )

    @property
    def num_a(self) -> int:
        return len(self.a_ready_s)

    @property
    def num_g(self) -> int:
        return len(self.g_ready_s)

    @property
    def num_grads(self) -> int:
        return len(self.grad_ready_s)


@dataclass(frozen=True, kw_only=True)
class CommEvent:
    """One collective on the channel (seconds on the problem's clock).

    Attributes:
        kind: "A" or "G" (a factor buffer) or "grad" (a fixed gradient collective).
        index: position of the buffer among its kind's buffers, or of the gradient collective.
        members: the factor indices of a buffer (in its kind's order); range(index, index + 1) for "grad".
        ready_s: when its last member is ready. start_s: max(ready_s, channel free). end_s: start_s + T(bytes).
    """

    kind: EventKind
    index: int
    members: range
    ready_s: float
    start_s: float
    end_s: float
    bytes: int


@dataclass(frozen=True, kw_only=True)
class FusionTimeline:
    """The channel under a choice of buffers (seconds).

    Attributes:
        a_end_s: when the channel is free after the last A buffer.
        end_s: when the channel is free after everything (A, G and gradients).
        factor_comm_s: summed durations of the factor buffers' allreduces; grad_comm_s: of the gradients'.
        num_buffers: A buffers + G buffers.
        events: every collective in channel order.
    """

    a_end_s: float
    end_s: float
    factor_comm_s: float
    grad_comm_s: float
    num_buffers: int
    events: tuple[CommEvent, ...]


def validate_buffers(problem: FusionProblem, buffers: Sequence[Iterable[SupportsIndex]]) -> FactorBuffers:
    """Check that `buffers` is (A ends, G ends) of `problem`; return it as a pair of tuples of ints.

    Raises:
        SolverError: not a pair, or either grouping is empty, not strictly ascending or does not end at the count.
    """
    if not isinstance(buffers, Sequence) or len(buffers) != 2:
        raise SolverError(f"buffers must be a pair (A ends, G ends), but got {buffers!r}")
    a_raw, g_raw = buffers
    return (
        validate_ends(a_raw, problem.num_a, prefix="A buffers: ", unit="buffer"),
        validate_ends(g_raw, problem.num_g, prefix="G buffers: ", unit="buffer"),
    )


def simulate_fusion(problem: FusionProblem, buffers: FactorBuffers) -> FusionTimeline:
    """Walk the channel under `buffers` with scalar costs, no shortcuts (the reference the solvers are checked on).

    Raises:
        SolverError: `buffers` is not valid for `problem` (see `validate_buffers`).
    """
    a_ends, g_ends = validate_buffers(problem, buffers)
    cost = problem.allreduce.cost
    events: list[CommEvent] = []
    channel = 0.0

    def issue(kind: EventKind, index: int, members: range, ready: float, nbytes: int) -> None:
        nonlocal channel
        start = max(ready, channel)
        channel = start + cost(nbytes)
        event = CommEvent(
            kind=kind, index=index, members=members, ready_s=ready, start_s=start, end_s=channel, bytes=nbytes
        )
        events.append(event)

    for index, members in enumerate(groups_of(a_ends)):
        issue("A", index, members, problem.a_ready_s[members[-1]], sum(problem.a_bytes[i] for i in members))
    a_end = channel
    grad = 0
    for index, members in enumerate(groups_of(g_ends)):
        ready = problem.g_ready_s[members[-1]]
        while grad < problem.num_grads and problem.grad_ready_s[grad] <= ready:  # a tie: the gradient first
            issue("grad", grad, range(grad, grad + 1), problem.grad_ready_s[grad], problem.grad_bytes[grad])
            grad += 1
        issue("G", index, members, ready, sum(problem.g_bytes[i] for i in members))
    for k in range(grad, problem.num_grads):
        issue("grad", k, range(k, k + 1), problem.grad_ready_s[k], problem.grad_bytes[k])
    return FusionTimeline(
        a_end_s=a_end,
        end_s=channel,
        factor_comm_s=sum(cost(e.bytes) for e in events if e.kind != "grad"),
        grad_comm_s=sum(cost(e.bytes) for e in events if e.kind == "grad"),
        num_buffers=len(a_ends) + len(g_ends),
        events=tuple(events),
    )


class FusionSolver(abc.ABC):
    """A way to cut the A and G factors of a `FusionProblem` into buffers (one allreduce each).

    Attributes:
        name: short identifier used in plans and reports ("fusion-dp", "25mb", ...).
        exact: whether the buffers minimise `FusionTimeline.end_s`.
        description: one line for reports.
    """

    name: ClassVar[str]
    exact: ClassVar[bool]
    description: ClassVar[str]

    @abc.abstractmethod
    def solve(self, problem: FusionProblem) -> FactorBuffers:
        """The buffers chosen for `problem`: (A ends, G ends)."""

    def solve_with_value(self, problem: FusionProblem) -> tuple[FactorBuffers, float]:
        """The buffers and the simulated time the channel is free after everything (`FusionTimeline.end_s`)."""
        buffers = self.solve(problem)
        return buffers, simulate_fusion(problem, buffers).end_s

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# ----------------------------------------------------------------------------------------------------
# Exact solver


def _phase_dp(
    ready: np.ndarray,
    nbytes: np.ndarray,
    start: float,
    grad_ready: np.ndarray,
    grad_cost: np.ndarray,
    allreduce: CostModel,
) -> tuple[Grouping, float]:
    """Best buffers of one phase: (ends, channel free time after the last buffer and the gradients before it).

    State m (prefix of m factors): the least channel free time E*(m) after the buffers of factors 0..m-1
    and every gradient collective ready <= ready[m-1]; E*(0) = `start`. The gradient collectives k in
    [lo, hi) run before a buffer, as one max-plus step with P = prefix sums of their durations:
    E -> max(E + P[hi] - P[lo], max over k of grad_ready[k] + P[hi] - P[k]).
    """
    count = len(ready)
    prefix = np.concatenate(([0], np.cumsum(nbytes, dtype=np.int64))).astype(float)
    durations = np.concatenate(([0.0], np.cumsum(grad_cost)))  # P
    lead = grad_ready - durations[:-1]  # grad_ready[k] - P[k]
    # before[m]: gradient collectives that precede the buffer ending at factor m - 1 (before[0] = 0).
    before = np.concatenate(([0], np.searchsorted(grad_ready, ready, side="right")))
    channel = np.empty(count + 1)
    channel[0] = start
    starts = np.zeros(count, dtype=np.int64)
    for j in range(count):
        lo, hi = before[: j + 1], int(before[j + 1])
        free = channel[: j + 1]
        if hi > 0:
            # latest[k] = max(lead[k:hi]), -inf past hi: the gradients' own chain from k on.
            latest = np.append(np.maximum.accumulate(lead[hi - 1 :: -1])[::-1], -np.inf)
            free = np.maximum(free + (durations[hi] - durations[lo]), latest[lo] + durations[hi])  # lo <= hi
        candidates = np.maximum(free, ready[j]) + allreduce.cost_many(prefix[j + 1] - prefix[: j + 1])
        best = int(np.argmin(candidates))
        starts[j] = best
        channel[j + 1] = candidates[best]
    return _ends_from_back_pointers(starts, count), float(channel[-1])


class FusionDP(FusionSolver):
    """Exact buffers: the least time the channel is free after every factor and gradient collective.

    A phase: E*(j) = min over i <= j of max(E*(i-1), RA_j) + T(bytes of A_i..A_j), E*(-1) = 0 (the dense
    gradient DP). Minimising the end of the A phase first is optimal: whatever the G buffers, every step
    after it is max(E, ready) + T, non-decreasing in E, so the end is a non-decreasing function of the A end.
    G phase, from E*(n_a): E*(j) is the least channel free time after G buffers through G_j and every
    gradient collective ready <= RG_j; buffer [i..j] runs the gradient collectives ready in (RG_{i-1}, RG_j]
    (a tie: the gradient first), then itself at max(E, RG_j) + T. That transition is non-decreasing in E, so
    a larger prefix end never helps and the DP is exact; the gradients after RG_{n_g-1} follow the last
    buffer whatever it is. (The tie rule orders the events but never moves end_s: two collectives ready at
    the same time leave the channel free at the same time in either order.) O(n^2 + n * gradients) per
    phase, vectorised over i.
    """

    name = "fusion-dp"
    exact = True
    description = "exact dynamic program over prefixes of the A and G factors"

    def solve(self, problem: FusionProblem) -> FactorBuffers:
        no_grads = np.zeros(0)
        a_ends, a_end = _phase_dp(
            np.asarray(problem.a_ready_s), np.asarray(problem.a_bytes), 0.0, no_grads, no_grads, problem.allreduce
        )
        grad_cost = problem.allreduce.cost_many(np.asarray(problem.grad_bytes, dtype=float))
        g_ends, _ = _phase_dp(
            np.asarray(problem.g_ready_s),
            np.asarray(problem.g_bytes),
            a_end,
            np.asarray(problem.grad_ready_s, dtype=float),
            grad_cost,
            problem.allreduce,
        )
        return a_ends, g_ends


# ----------------------------------------------------------------------------------------------------
# Baselines


class PerFactor(FusionSolver):
    """One allreduce per factor, issued as soon as the factor is ready."""

    name = "per-factor"
    exact = False
    description = "one allreduce per factor"

    def solve(self, problem: FusionProblem) -> FactorBuffers:
        return tuple(range(1, problem.num_a + 1)), tuple(range(1, problem.num_g + 1))


class SingleBuffer(FusionSolver):
    """One buffer for all A factors and one for all G factors."""

    name = "single"
    exact = False
    description = "one A buffer and one G buffer"

    def solve(self, problem: FusionProblem) -> FactorBuffers:
        return (problem.num_a,), (problem.num_g,)


def _capped(nbytes: Sequence[int], cap: int) -> Grouping:
    """Ends of buffers filled in order and closed as soon as they hold >= `cap` bytes; the rest is the last."""
    ends: list[int] = []
    size = 0
    for i, b in enumerate(nbytes):
        size += b
        if size >= cap:
            ends.append(i + 1)
            size = 0
    if not ends or ends[-1] != len(nbytes):
        ends.append(len(nbytes))
    return tuple(ends)


class FixedBytes(FusionSolver):
    """Size-capped buffers filled in ready order, closed as soon as they hold >= cap bytes (A and G apart).

    The rule of PyTorch DDP's buckets and of kfac-pytorch's factor allreduce buckets (25 MiB by default).
    """

    name: ClassVar[str] = "25mb"
    exact = False
    description: ClassVar[str] = "buffers closed at >= 25 MiB"

    def __init__(self, cap_bytes: int = DDP_BUCKET_BYTES, *, name: str | None = None) -> None:
        if cap_bytes <= 0:
            raise SolverError(f"`cap_bytes > 0` must hold, but got cap_bytes={cap_bytes}")
        self.cap_bytes = cap_bytes
        default = "25mb" if cap_bytes == DDP_BUCKET_BYTES else f"fixed-{cap_bytes}b"
        # Instances carry their own name and description (one class, several configured baselines).
        self.name = name or default  # type: ignore[misc]
        self.description = f"buffers closed at >= {cap_bytes} B"  # type: ignore[misc]

    def solve(self, problem: FusionProblem) -> FactorBuffers:
        return _capped(problem.a_bytes, self.cap_bytes), _capped(problem.g_bytes, self.cap_bytes)

    def __repr__(self) -> str:
        return f"FixedBytes(cap_bytes={self.cap_bytes}, name={self.name!r})"


def _greedy_phase(
    problem: FusionProblem, ready: tuple[float, ...], nbytes: tuple[int, ...], start: float, with_grads: bool
) -> tuple[Grouping, float]:
    """SpdKfacGreedy over one kind: (ends, channel free time after its last buffer)."""
    cost, alpha = problem.allreduce.cost, _startup_cost(problem.allreduce)
    grad_ready = problem.grad_ready_s if with_grads else ()
    channel, grad, size = start, 0, 0
    ends: list[int] = []
    for j in range(len(ready)):
        size += nbytes[j]
        # Gradient collectives ready by the open buffer's last factor go before it, however it ends.
        while grad < len(grad_ready) and grad_ready[grad] <= ready[j]:
            channel = max(channel, grad_ready[grad]) + cost(problem.grad_bytes[grad])
            grad += 1
        sent_end = max(channel, ready[j]) + cost(size)  # the open buffer's allreduce if sent now
        if j + 1 == len(ready):
            channel = sent_end
            break
        ready_next = ready[j + 1]
        if not (ready_next < sent_end or ready_next - ready[j] < alpha):
            ends.append(j + 1)
            channel, size = sent_end, 0
    ends.append(len(ready))
    return tuple(ends), channel


class SpdKfacGreedy(FusionSolver):
    """SPD-KFAC's dynamic tensor fusion (Shi et al., 2021), on A and on G separately.

    Walking the factors in ready order with the channel clock (in the G phase including the gradient
    collectives that go before the open buffer), the next factor joins the open buffer when it is ready
    before the open buffer's allreduce would end if sent now (max(channel free, its last ready) + T(bytes)),
    or when waiting for it (its ready time - the open buffer's last ready time) costs less than the start-up
    alpha of an allreduce (AffineCost.alpha, else the cost of 1 byte); otherwise the open buffer closes.
    """

    name = "spd-greedy"
    exact = False
    description = "SPD-KFAC dynamic tensor fusion (greedy)"

    def solve(self, problem: FusionProblem) -> FactorBuffers:
        a_ends, a_end = _greedy_phase(problem, problem.a_ready_s, problem.a_bytes, 0.0, with_grads=False)
        g_ends, _ = _greedy_phase(problem, problem.g_ready_s, problem.g_bytes, a_end, with_grads=True)
        return a_ends, g_ends


#: The baselines each fusion plan is compared with.
FUSION_BASELINES: tuple[FusionSolver, ...] = (PerFactor(), SingleBuffer(), FixedBytes(), SpdKfacGreedy())
