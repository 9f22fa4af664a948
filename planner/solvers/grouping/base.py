"""The interface of the grouping solvers (`GroupingSolver`, `Solved`), the vectorised pieces of the timeline
model that the solvers share, and the group-size bounds of the exact solvers.

Group-size bounds (`DenseDP` and `TopkParetoDP`, `min_group_bytes` / `max_group_bytes`): a group's size is
its dense gradient bytes, sum of numel * element_bytes over its layers (for top-k too, although fewer
bytes are sent). A group is allowed when both hold:

- size <= `max_group_bytes` (when given), unless the group is a single layer (a layer cannot be split);
- size >= `min_group_bytes`, unless the group is the last one (it holds the last layer in ready order:
  what is left at the end may be small).

A single layer below `min_group_bytes` is not exempt: it must be merged with its neighbours (or be last).
Some instances therefore have no allowed grouping (a small layer between layers above `max_group_bytes`,
or `min_group_bytes` close to `max_group_bytes`); the solvers then raise `SolverError`. Otherwise they are
exact over the groupings whose every group is allowed (`within_group_bounds` tests a grouping). Without
bounds (the defaults) every grouping is allowed and nothing changes.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from planner.costmodel.costs import ScaledCost
from planner.costmodel.problem import (
    INDEX_BYTES,
    GradientProblem,
    Grouping,
    advance,
    topk_count_many,
    unstretched,
    unstretched_many,
)
from planner.costmodel.simulator import simulate
from planner.solvers.deadline import Deadline
from planner.types import SolverError, Strategy

__all__ = ["GroupingSolver", "Solved", "within_group_bounds"]


@dataclass(frozen=True)
class Solved:
    """A grouping, its predicted iteration time, and what the solver proved about it.

    `proven`: no grouping is faster under the model; otherwise `iteration_s` is within `gap` of `lower_bound_s`
    (the solver's bound; None: the solver has none, e.g. a baseline rule).
    """

    grouping: Grouping
    iteration_s: float
    proven: bool
    lower_bound_s: float | None = None

    @property
    def gap(self) -> float | None:
        """0 when proven, else (iteration - bound) / bound (None without a bound)."""
        if self.proven:
            return 0.0
        if not self.lower_bound_s:
            return None
        return max(0.0, self.iteration_s / self.lower_bound_s - 1)


class GroupingSolver(abc.ABC):
    """A way to merge the layers of a `GradientProblem` into contiguous groups.

    Call order: construct once (stateless afterwards), then `solve(problem)`, `solve_with_value(problem)` or
    `solve_within(problem, deadline)` any number of times.

    Attributes:
        name: short identifier used in plans and reports ("wfbp", "horovod", ...; DDP's buckets, "ddp-25mb", are
            the row named by what DDP sends: "ddp" or "ddp+topk:D").
        exact: whether the grouping is optimal under the timeline model.
        description: one line for reports.
    """

    name: ClassVar[str]
    exact: ClassVar[bool]
    description: ClassVar[str]

    @abc.abstractmethod
    def solve(self, problem: GradientProblem) -> Grouping:
        """The grouping chosen for `problem` (tuple of exclusive group ends, last = L)."""

    def solve_with_value(self, problem: GradientProblem) -> tuple[Grouping, float]:
        """The grouping and its predicted iteration time (seconds); solvers that know it override this."""
        grouping = self.solve(problem)
        return grouping, simulate(problem, grouping).iteration_s

    def solve_within(self, problem: GradientProblem, deadline: Deadline | None = None) -> Solved:
        """The grouping found by `deadline` (None: no limit), and whether it is proven optimal. Exact solvers
        whose search can run long override this; the others finish (and are optimal if `exact`)."""
        grouping, value = self.solve_with_value(problem)
        return Solved(grouping, value, proven=self.exact)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# ----------------------------------------------------------------------------------------------------
# Vectorised pieces of the model (they must agree with GradientProblem's scalar methods exactly).


def _prefix_numel(problem: GradientProblem) -> np.ndarray:
    """S with S[i] = n_0 + ... + n_{i-1} (S[0] = 0), int64."""
    return np.concatenate(([0], np.cumsum(np.asarray(problem.numel, dtype=np.int64))))


def _prefix_backward(problem: GradientProblem) -> np.ndarray:
    """Q with Q[i] = b_0 + ... + b_{i-1} (Q[0] = 0)."""
    return np.concatenate(([0.0], np.cumsum(np.asarray(problem.backward_s, dtype=float))))


def _stretched(problem: GradientProblem) -> GradientProblem:
    """`problem` with its comm stretch kappa folded into its costs: every collective, and every top-k decode,
    (1 + kappa) times as long, as if compute never ended. The solvers search this problem's clocks, which are
    exact (`planner.costmodel.simulator`), and read its ends in real time with `_real_end`.

    Why the decodes too: after C_G the channel runs at full speed, and the real end of the step is
    X_G = (kappa C_G + X'_G) / (1 + kappa), X'_G being the end of this problem with the same grouping (the
    decode chain's terms that end before C_G never decide X_G, so every term may be read through the same
    affine map; `tests/test_solvers.py` checks it against the simulator's walk)."""
    if problem.comm_stretch == 0:
        return problem
    factor = 1 + problem.comm_stretch
    decode = None if problem.decode is None else ScaledCost(inner=problem.decode, factor=factor)
    return replace(problem, comm=ScaledCost(inner=problem.comm, factor=factor), decode=decode, comm_stretch=0.0)


def _real_end(comp: np.ndarray | float, end: np.ndarray | float, comm_stretch: float) -> np.ndarray:
    """X_G in real time of states of the stretched problem (`_stretched`) that end at `end` with compute clock
    C_G = `comp`: (kappa C_G + end) / (1 + kappa). Non-decreasing in both."""
    if comm_stretch == 0:
        return np.asarray(end, dtype=float)
    return (comm_stretch * np.asarray(comp, dtype=float) + end) / (1 + comm_stretch)


def _dense_end(comp: np.ndarray, chan: np.ndarray, comm_stretch: float) -> np.ndarray:
    """X_G of dense states of the stretched problem (`_stretched`) in real time: max(C, E), with what the channel
    holds beyond C run unstretched (= `_real_end` of max(C, E)). Non-decreasing in both clocks."""
    return np.maximum(comp, unstretched_many(chan, comp, comm_stretch))


def _k_many(problem: GradientProblem, numel: np.ndarray) -> np.ndarray:
    """Vectorised `problem.k` as floats."""
    assert problem.density is not None
    return topk_count_many(numel, problem.density)


def _message_bytes_many(problem: GradientProblem, numel: np.ndarray) -> np.ndarray:
    """Vectorised `problem.message_bytes` as floats."""
    numel = np.asarray(numel, dtype=float)
    if problem.strategy is Strategy.DENSE:
        return numel * problem.element_bytes
    return _k_many(problem, numel) * (problem.element_bytes + INDEX_BYTES)


def _comm_many(problem: GradientProblem, numel: np.ndarray) -> np.ndarray:
    """T(N) for an array of group sizes."""
    return problem.comm.cost_many(_message_bytes_many(problem, numel))


def _prepare_many(problem: GradientProblem, numel: np.ndarray) -> np.ndarray:
    """`problem.prepare_s` for an array of group sizes: packing p(N) (or 0), plus top-k selection s(N)."""
    sizes = np.asarray(numel, dtype=float)
    packing = np.zeros(np.shape(sizes)) if problem.pack is None else problem.pack.cost_many(sizes)
    if problem.strategy is Strategy.TOPK:
        assert problem.select is not None
        return packing + problem.select.cost_many(sizes)
    return packing


def _decode_many(problem: GradientProblem, numel: np.ndarray) -> np.ndarray:
    """d(P * k(N)) for an array of group sizes (0 for dense)."""
    if problem.strategy is Strategy.DENSE:
        return np.zeros(np.shape(numel))
    assert problem.decode is not None
    return problem.decode.cost_many(problem.world_size * _k_many(problem, numel))


def _comm_and_decode_many(problem: GradientProblem, numel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(`_comm_many`, `_decode_many`) of the same group sizes, counting k once."""
    if problem.strategy is Strategy.DENSE:
        return _comm_many(problem, numel), np.zeros(np.shape(numel))
    assert problem.decode is not None
    k = _k_many(problem, numel)
    return (problem.comm.cost_many(k * (problem.element_bytes + INDEX_BYTES)),
            problem.decode.cost_many(problem.world_size * k))


def _suffix_min_partition(prefix_numel: np.ndarray, group_cost: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """best[i] = min over groupings of layers i..L-1 of the sum of `group_cost(N_g)`; best[L] = 0.

    O(L^2) time, vectorised over the end of the first group.
    """
    num_layers = len(prefix_numel) - 1
    best = np.zeros(num_layers + 1)
    for i in range(num_layers - 1, -1, -1):
        sizes = prefix_numel[i + 1 :] - prefix_numel[i]  # group i..j for j = i..L-1
        best[i] = np.min(group_cost(sizes) + best[i + 1 :])
    return best


def _iteration_end(problem: GradientProblem, grouping: Grouping) -> float:
    """X_G of `grouping` (seconds from the start of backward), as `planner.costmodel.simulator.simulate` walks it, with
    the group costs computed at once: the solvers evaluate many candidate groupings of long models. Without
    interference the walk has a closed form (C and E are running sums and maxima); with it, a scalar walk.
    A comm stretch is walked on `_stretched`'s clocks and read in real time at the end (`_real_end`)."""
    kappa = problem.comm_stretch
    problem = _stretched(problem)
    ends = np.asarray(grouping, dtype=np.int64)
    prefix = _prefix_numel(problem)
    starts = np.concatenate(([0], ends[:-1]))
    sizes = prefix[ends] - prefix[starts]
    backward = _prefix_backward(problem)
    work = backward[ends] - backward[starts]
    prepare = _prepare_many(problem, sizes)
    comm, decode = _comm_and_decode_many(problem, sizes)
    sigma = problem.interference
    if sigma == 0:
        # C_g = sum of work; E_g = max over h <= g of (C_h + T_h + ... + T_g); X_0 = C_G and
        # X_g = max(X_{g-1}, E_g) + d_g.
        comp = np.cumsum(work + prepare)
        sent = np.cumsum(comm)
        chan = sent + np.maximum.accumulate(comp - (sent - comm))
        decoded = np.cumsum(decode)
        end = float(decoded[-1]) + max(float(comp[-1]), float(np.max(chan - (decoded - decode))))
        if problem.strategy is Strategy.TOPK:
            return float(_real_end(float(comp[-1]), end, kappa))
        return max(float(comp[-1]), unstretched(float(chan[-1]), float(comp[-1]), kappa))
    clock = queue = 0.0  # C and E
    comm_end = []
    for w, s, t in zip(work.tolist(), prepare.tolist(), comm.tolist(), strict=True):
        clock = advance(advance(clock, queue, w, sigma), queue, s, sigma)
        queue = max(clock, queue) + t
        comm_end.append(queue)
    decoded_at = clock
    for e, d in zip(comm_end, decode.tolist(), strict=True):
        decoded_at = advance(max(decoded_at, e), queue, d, sigma)
    if problem.strategy is Strategy.TOPK:
        return float(_real_end(clock, decoded_at, kappa))
    return max(clock, unstretched(queue, clock, kappa))


def _ends_from_back_pointers(starts: np.ndarray | list[int], num_layers: int) -> Grouping:
    """Walk back-pointers `starts[j]` (first layer of the last group of the best prefix 0..j) into group ends."""
    ends: list[int] = []
    end = num_layers
    while end > 0:
        ends.append(end)
        end = int(starts[end - 1])
    return tuple(reversed(ends))


def _require(problem: GradientProblem, strategy: Strategy, solver: str) -> None:
    if problem.strategy is not strategy:
        raise SolverError(
            f"{solver} solves `strategy == {strategy.value!r}` problems, but got strategy={problem.strategy.value!r}"
        )


@dataclass(frozen=True)
class _GroupBounds:
    """The group-size bounds of the exact solvers (see the module docstring for the rule)."""

    min_bytes: int = 0
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        low, high = self.min_bytes, self.max_bytes
        ints = all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in (low, high) if v is not None)
        if not ints or low < 0 or (high is not None and (high <= 0 or low > high)):
            raise SolverError(
                "integer `0 <= min_group_bytes <= max_group_bytes` with `max_group_bytes > 0` or None must hold, "
                f"but got (min_group_bytes={low!r}, max_group_bytes={high!r})"
            )

    @property
    def active(self) -> bool:
        return self.min_bytes > 0 or self.max_bytes is not None

    def allowed(self, problem: GradientProblem, numel: np.ndarray, single: np.ndarray, last: np.ndarray | bool
                ) -> np.ndarray:
        """Which groups (of `numel` elements; of one layer where `single`; holding the last layer where `last`)
        the bounds allow."""
        size = np.asarray(numel, dtype=np.int64) * problem.element_bytes
        ok = (size >= self.min_bytes) | last
        if self.max_bytes is not None:
            ok &= (size <= self.max_bytes) | single
        return np.asarray(ok, dtype=bool)

    def infeasible(self, problem: GradientProblem) -> SolverError:
        return SolverError(
            f"no grouping of the {problem.num_layers} layers keeps every group within the bounds "
            f"(min_group_bytes={self.min_bytes}, max_group_bytes={self.max_bytes}): a group below the minimum "
            "must grow past layers above the maximum; loosen the bounds"
        )

    def ending_at(self, problem: GradientProblem, prefix: np.ndarray, j: int) -> np.ndarray:
        """allowed[i] for the groups i..j, i = 0..j."""
        firsts = np.arange(j + 1)
        return self.allowed(problem, prefix[j + 1] - prefix[: j + 1], firsts == j, j == problem.num_layers - 1)

    def starting_at(self, problem: GradientProblem, prefix: np.ndarray, i: int) -> np.ndarray:
        """allowed[j - i] for the groups i..j, j = i..L-1."""
        ends = np.arange(i, problem.num_layers)
        return self.allowed(problem, prefix[i + 1 :] - prefix[i], ends == i, ends == problem.num_layers - 1)

    def admits(self, problem: GradientProblem, grouping: Grouping) -> bool:
        """Whether every group of `grouping` is allowed."""
        if not self.active:
            return True
        ends = np.asarray(grouping, dtype=np.int64)
        starts = np.concatenate(([0], ends[:-1]))
        prefix = _prefix_numel(problem)
        ok = self.allowed(problem, prefix[ends] - prefix[starts], ends - starts == 1, ends == problem.num_layers)
        return bool(np.all(ok))


def within_group_bounds(
    problem: GradientProblem, grouping: Grouping, *, min_group_bytes: int = 0, max_group_bytes: int | None = None
) -> bool:
    """Whether every group of `grouping` obeys the group-size bounds (rule in the module docstring)."""
    return _GroupBounds(min_group_bytes, max_group_bytes).admits(problem, grouping)


class _BoundedSolver(GroupingSolver):
    """A grouping solver with group-size bounds (`_GroupBounds`), exposed read-only."""

    _bounds: _GroupBounds

    @property
    def min_group_bytes(self) -> int:
        return self._bounds.min_bytes

    @property
    def max_group_bytes(self) -> int | None:
        return self._bounds.max_bytes
