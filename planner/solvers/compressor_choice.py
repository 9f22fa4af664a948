"""The exact solver of groupings x a compressor per group (`planner.costmodel.mixed_simulator.MixedProblem`).

`MixedParetoDP` extends the Pareto-front search of `TopkParetoDP` (planner/solvers/grouping/pareto.py) from one way
of sending to several: the state of a prefix is the same four clocks (compute C, channel E, the decode chain
V with decodes stretched by 1 + sigma, the decode sum D), and a state is extended by every group that can
follow it with every compressor. A group (layers m..j, compressor c) of work W = B + prepare, first
collective T1, and, for a PowerSGD group with a compressed matrix, a middle round M and a second collective
T2, leads to

    C1 = advance(C, E, W)   E1 = max(C1, E) + T1
    C2 = E1 + M             E2 = C2 + T2            (C2, E2 = C1, E1 without a second round)
    V' = max(V, E2) + (1 + sigma) d                 D' = D + d

and the iteration is F + `_final_end`(C, E, V, D) + U, as for top-k (`_end` with comm stretch). Every step is
non-decreasing in every clock, so a state that another state of the same prefix dominates in all four never leads
to a better iteration: keeping the Pareto front per prefix (with back-pointers to the group and its compressor) is
exact.

Two exact reductions keep it small:

- compute-bound states: after a prefix of m < L layers, a state whose lag E - C is at most
  lead_m (1 + sigma), lead_m = b_m + the least preparation of layer m alone under any compressor, ends the
  work of any next group after the channel frees up, so (C, E) may be replaced by (kappa, kappa),
  kappa = (C + sigma E) / (1 + sigma) (the argument of `TopkParetoDP`; a second round starts from E1, which
  is the same from either);
- branch and bound: a state cannot finish before max(C + D + the least compute left, max(E, C + lead_m) +
  the least communication left, (sigma E + V) / (1 + sigma)), the "least left" being minima over every
  grouping and compressor of the remaining layers (dynamic programs over suffixes); states above the
  iteration of a good solution are dropped. That solution is the best of the single-compressor groupings
  (per layer, one group, DDP's buckets), of the incumbents the caller gives (the rows printed beside the plan)
  and of a beam of this search (the few states with the lowest bounds per prefix).

A solve stops at its `Deadline` (checked per row of the tables and per layer of the beams and the search): the
best solution found is returned, not proven, with the root's bound (the compute path alone if the tables did not
finish); the exact search gets `_SEARCH_SHARE` of what is left, a wider beam the rest.

With comm stretch kappa (`MixedProblem.comm_stretch`) the channel clock E is kept as if compute never stopped,
E1 = max(C1, E) + (1 + kappa) T1; a group with a second round waits with the channel read in real time,
E1 = max(C1, unstretched(E, C1)) + T1, and restarts it, E2 = C2 + (1 + kappa) T2; the decode chain holds its
decodes (1 + kappa)(1 + sigma) times as long and drops its terms at such a wait (they never decide the end); the
end is `_end`. Every step stays non-decreasing in every clock, so the fronts stay exact. The bounds are those of
the stretched problem, read in real time (`_real_bounds`), and, with interference, those of how compute and
collectives slow each other down (`_mutual_bounds`).

Solutions are checked against brute force over groupings x compressors (tests/test_mixed.py), with and without
interference and comm stretch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from planner.costmodel.costs import CostModel, ScaledCost
from planner.costmodel.mixed_simulator import Choice, GroupCosts, MixedProblem, simulate_mixed, validate_choice
from planner.costmodel.problem import Grouping, advance_many, groups_of, unstretched_many
from planner.solvers.deadline import Deadline
from planner.solvers.grouping import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES
from planner.solvers.grouping.pareto import _final_end, _pareto_front, beaten_by_a_sample
from planner.types import SolverError

__all__ = ["DEFAULT_ERROR_RESOLUTION", "ErrorBudget", "MixedParetoDP", "MixedSolution", "ddp_buckets",
           "mixed_lower_bound"]

#: States kept per prefix by the beam that finds the first upper bound, and by the wider one that stands in
#: when the exact search runs out of budget.
_BEAM, _WIDE_BEAM = 8, 32
#: Seconds a solve may take (`MixedParetoDP`) before it returns the best solution found, with its gap to the
#: lower bound.
DEFAULT_TIME_LIMIT_S = 1.0
#: Relative slack of the pruning: rounding must never prune an optimal state.
_PRUNE_RTOL = 1e-9
#: Solutions this close (relative) are a tie: the search's is kept over the heuristics' (rounding, not speed).
_TIE_RTOL = 1e-12


#: Units per layer an error budget is cut into (`ErrorBudget.of`): a unit is budget / (resolution x layers), and each
#: layer's error is rounded up to whole units, so a plan the solver keeps within the budget holds at most the
#: budget, and the rounding moves no plan's error by more than budget / resolution.
DEFAULT_ERROR_RESOLUTION = 1024


@dataclass(frozen=True, eq=False)
class ErrorBudget:
    """What each compressor's error on each layer adds to a plan's, in whole units, and the most a plan may hold.

    A plan's error is the sum over its layers of the error of the compressor that sends each
    (`planner.contracts.errors`: additive over layers, so a group's is the sum of its layers'). The solver keeps the
    fastest plan whose units sum to at most `budget` (`MixedParetoDP(error=...)`).

    Attributes:
        units: (compressors of the problem, layers): whole units >= 0, in the problem's compressor order.
        budget: the most units a plan may hold.
    """

    units: np.ndarray
    budget: int

    def __post_init__(self) -> None:
        units = np.asarray(self.units)
        if units.ndim != 2 or not np.issubdtype(units.dtype, np.integer) or np.any(units < 0):
            raise SolverError("an error budget's units must be whole numbers >= 0, one row per compressor and one "
                              "column per layer")
        if self.budget < 0:
            raise SolverError(f"an error budget must be >= 0, but got {self.budget}")
        object.__setattr__(self, "units", units.astype(np.int64))
        object.__setattr__(self, "_prefix", np.concatenate((np.zeros((units.shape[0], 1), dtype=np.int64),
                                                            np.cumsum(units, axis=1, dtype=np.int64)), axis=1))

    @classmethod
    def of(cls, errors: np.ndarray, budget: float, resolution: int = DEFAULT_ERROR_RESOLUTION,
           reference: int | None = None) -> ErrorBudget:
        """From errors in the budget's own measure ((compressors, layers), >= 0): a unit is budget / (resolution x
        layers) and every layer's error is rounded up to whole units; the budget is as many units as it holds.
        `reference`: the compressor (row) whose error on every layer is the budget: the budget is then at least
        its units, so that it fits its own budget (a plan may then exceed the budget by the rounding, less than
        budget / resolution). A budget of 0 admits only the compressors with no error."""
        errors = np.asarray(errors, dtype=float)
        if not (np.all(np.isfinite(errors)) and np.all(errors >= 0)):
            raise SolverError("errors must be finite and >= 0")
        if not (math.isfinite(budget) and budget >= 0):
            raise SolverError(f"an error budget must be a finite number >= 0, but got {budget!r}")
        if budget == 0:
            return cls(units=(errors > 0).astype(np.int64), budget=0)
        cut = resolution * max(1, errors.shape[1])
        most = cut
        if reference is not None:  # its errors sum to the budget: each is at most all of it (min: rounding only)
            most = max(most, int(np.ceil(np.minimum(errors[reference], budget) / budget * cut).sum()))
        # An error beyond the whole budget fits no plan, whatever its units: it gets most + 1, and only the others
        # are divided. A tiny budget (1e-17) against large errors would otherwise ask for more units than int64
        # holds, or a quotient beyond float64's (errors / budget is never formed for those).
        fits = errors <= budget * ((most + 1) / cut)
        units = np.full(errors.shape, float(most + 1))
        np.multiply(np.divide(errors, budget, out=np.zeros_like(errors), where=fits), cut, out=units, where=fits)
        return cls(units=np.ceil(units).astype(np.int64), budget=most)

    def group(self, which: int, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Units of the groups of layers starts..ends-1 sent by compressor `which`."""
        prefix: np.ndarray = object.__getattribute__(self, "_prefix")
        return prefix[which, ends] - prefix[which, starts]

    def of_solution(self, grouping: Sequence[int], choice: Sequence[int]) -> int:
        """Units of a solution."""
        return int(sum(self.units[c, r].sum() for r, c in zip(groups_of(tuple(grouping)), choice, strict=True)))

    def least(self, allowed: Sequence[int]) -> np.ndarray:
        """(layers + 1,): the least units layers m..L-1 can hold, each sent by its least-error allowed compressor."""
        per_layer = self.units[list(allowed)].min(axis=0)
        return np.append(np.cumsum(per_layer[::-1])[::-1], 0)

    def forbidden(self, allowed: Sequence[int]) -> np.ndarray:
        """(compressors, layers) bools: sending layer l by compressor c alone exceeds the budget, since the other
        layers hold at least the least units of their least-error allowed compressors; no plan within the budget
        sends l by c (`MixedProblem.forbidden`). Compressors not allowed are not marked."""
        rows = list(allowed)
        least = self.units[rows].min(axis=0)
        out = np.zeros(self.units.shape, dtype=bool)
        out[rows] = self.units[rows] - least + int(least.sum()) > self.budget
        return out

    def cheapest(self, allowed: Sequence[int], grouping: Grouping | None = None) -> tuple[Grouping, Choice]:
        """A solution with the least units: every layer alone (or the groups of `grouping`), each sent by its
        least-error allowed compressor (the first of equal ones)."""
        if grouping is None:
            grouping = tuple(range(1, self.units.shape[1] + 1))
        ends = np.asarray(grouping, dtype=np.int64)
        starts = np.concatenate(([0], ends[:-1]))
        per_group = np.stack([self.group(c, starts, ends) for c in allowed])
        return tuple(grouping), tuple(allowed[int(i)] for i in per_group.argmin(axis=0))


@dataclass(frozen=True)
class MixedSolution:
    """A grouping, the compressor (index into the problem's) of each group, and the predicted iteration.

    `proven`: the search finished, so no solution is faster under the model; otherwise it stopped at its
    deadline (or budget) and `iteration_s` is within `gap` of the lower bound `lower_bound_s` (the solver's
    bound over its allowed compressors; None where a solution was made without a solve).
    """

    grouping: Grouping
    choice: Choice
    iteration_s: float
    proven: bool = True
    lower_bound_s: float | None = None

    @property
    def gap(self) -> float:
        """How far the solution may be from the optimum: 0 when proven, else (iteration - bound) / bound."""
        if self.proven or not self.lower_bound_s:
            return 0.0
        return max(0.0, self.iteration_s / self.lower_bound_s - 1)


def ddp_buckets(problem: MixedProblem, cap_bytes: int = DDP_BUCKET_BYTES,
                first_cap_bytes: int | None = DDP_FIRST_BUCKET_BYTES) -> Grouping:
    """DDP's buckets over the problem's layers in ready order (as `FixedBuckets`: closed at >= the cap, the first
    bucket at its own cap); `cap_bytes` at least the model's bytes gives one bucket."""
    ends: list[int] = []
    cap = cap_bytes if first_cap_bytes is None else first_cap_bytes
    size = 0
    for i, numel in enumerate(problem.numel):
        size += numel * problem.element_bytes
        if size >= cap:
            ends.append(i + 1)
            size, cap = 0, cap_bytes
    if not ends or ends[-1] != problem.num_layers:
        ends.append(problem.num_layers)
    return tuple(ends)


#: Weights w of the Lagrangian bounds (w = 1: the compute path, w = 0: the channel path).
_WEIGHTS = np.linspace(0.0, 1.0, 11)
#: Lengths of the next group at which `_Tables.opened` bounds the completions (about 30% apart).
_OPEN_LENGTHS = np.unique(np.round(1.3 ** np.arange(40)).astype(np.int64))


@dataclass(frozen=True)
class _Tables:
    """Per problem: prefix sums, lead times and the Lagrangian suffix bounds (see `_bounds`)."""

    backward: np.ndarray  # Q[m]
    lead: np.ndarray  # lead[m], lead[L] = 0
    rest: np.ndarray  # rest[w, m]: least sum over groupings of layers m..L-1 of w * compute + (1 - w) * channel
    opened: np.ndarray  # opened[w, m, l]: the same over the groupings whose first group has >= open_lengths[l]
    open_lengths: np.ndarray
    late: np.ndarray  # late[m]: max over j >= m of Q[j + 1] + least preparation of layer j + rest[0, j]
    rest_last: np.ndarray  # as rest, with the last group's collectives, middle round and decode on the compute path
    queued: np.ndarray  # queued[0, m]: the channel path with the decodes to come after a last second round;
                        # queued[1, m]: with the last group's decode after its collectives (see `_bounds`)
    front_compute: np.ndarray  # (L + 1, F): the Pareto front of (compute, channel) sums over the groupings of
    front_channel: np.ndarray  # layers m..L-1 (by compute ascending, inf padding; see `_suffix_fronts`)
    front_key: np.ndarray  # compute - channel along each front (ascending)
    least: np.ndarray  # least[m]: least compute-stream work after prefix m (backward, preparation, middle rounds)
    mutual: np.ndarray  # mutual[t, m]: see `_mutual_bounds`
    stretch: float = 0.0  # the problem's comm stretch kappa: the tables are `_stretched`'s (see `_real_bounds`)


def _stretched(problem: MixedProblem) -> MixedProblem:
    """`problem` with its comm stretch kappa folded into its costs: every collective and every decode (1 + kappa)
    times as long, as if compute never stopped, and no stretch. The real step is this problem's with every stretch
    of time in which the compute stream is idle (a second round's wait, and what follows C_G) shrunk by
    1 + kappa: a wait ends on an idle channel, so what follows it is the same, moved (see `_real_bounds`)."""
    if not problem.comm_stretch:
        return problem
    factor = 1 + problem.comm_stretch

    def scaled(model: CostModel | None) -> CostModel | None:
        return None if model is None else ScaledCost(inner=model, factor=factor)

    compressors = tuple(replace(c, comm=ScaledCost(inner=c.comm, factor=factor), decode=scaled(c.decode),
                                second_comm=scaled(c.second_comm),
                                layer_decode=tuple(factor * t for t in c.layer_decode))
                        for c in problem.compressors)
    return replace(problem, compressors=compressors, comm_stretch=0.0)


#: Weights t of the channel in `_mutual_bounds` (t = 1: the channel path; the compute's weights follow from t).
_CHANNEL_WEIGHTS = np.linspace(0.0, 1.0, 11)


def _mutual_weights(sigma: float, kappa: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The weights (on backward work, on decodes, on the channel) of `_mutual_bounds`, one triple per t: the
    grid, and the two t at which a compute weight stops being 1 (where one completion's bound is highest)."""
    kinks = np.array([sigma / (1 + sigma), (1 + kappa) * sigma / (1 + sigma)])
    t = np.unique(np.concatenate((_CHANNEL_WEIGHTS, kinks[kinks <= 1])))
    return np.minimum(1.0, (1 + sigma) * (1 - t / (1 + kappa))), np.minimum(1.0, (1 + sigma) * (1 - t)), t


def _mutual_rest(problem: MixedProblem, allowed: Sequence[int], deadline: Deadline | None = None) -> np.ndarray:
    """mutual[t, m]: the least over groupings x compressors of layers m..L-1 of the sum over groups of
    y1 (preparation + middle round) + y2 decode + t (collectives), at their costs alone (`_mutual_bounds`)."""
    num_layers = problem.num_layers
    y1, y2, y3 = (y[:, None] for y in _mutual_weights(problem.interference, problem.comm_stretch))
    mutual = np.zeros((y3.size, num_layers + 1))
    if not (problem.interference and problem.comm_stretch):  # not used (`_real_bounds`)
        return mutual
    for i in range(num_layers - 1, -1, -1):
        _check(deadline)
        ends = np.arange(i + 1, num_layers + 1)
        starts = np.full(ends.shape, i)
        best = np.full((y3.size, ends.size), np.inf)
        for c in allowed:
            costs = problem.costs(c, starts, ends)
            best = np.minimum(best, y1 * (costs.prepare + costs.middle) + y2 * costs.decode
                              + y3 * (costs.first + costs.second) + mutual[:, ends])
        mutual[:, i] = best.min(axis=1)
    return mutual


def _mutual_bounds(tables: _Tables, m: int, sigma: float, comp: np.ndarray, chan: np.ndarray, dsum: np.ndarray
                   ) -> np.ndarray:
    """A bound of the states of prefix m < L from how compute and collectives slow each other down.

    After C, let the compute stream work a seconds alone and o beside a busy channel, and the channel c seconds
    alone, until X: X >= C + a + o + c. Before C_G the compute stream gets through the backward work W (backward,
    preparation, middle rounds) at rate 1 alone and 1 / (1 + sigma) beside the channel, and the channel through
    its work at 1 / (1 + kappa) beside it; after C_G the decodes (D pending, and those to come) at 1 / (1 + sigma)
    beside the channel, which then runs at full speed. The channel's work is what it owes,
    (E - C)+ / (1 + kappa) (E is kept stretched), and the collectives left, T. For weights (y1, y2, t) with
    y1, y2, t <= 1, y1 / (1 + sigma) + t / (1 + kappa) <= 1 and y2 / (1 + sigma) + t <= 1, every second of the
    step is worth at least y1 times the backward work, y2 times the decode work and t times the channel work it
    gets done, so X >= C + y1 W + y2 (D + decodes) + t ((E - C)+ / (1 + kappa) + T) (linear programming
    duality; `_mutual_weights` takes the largest y1, y2 for each t). Where sigma kappa is large, a second of
    overlap gets less done than a second of either alone, which the paths of `_bounds` do not see."""
    kappa = tables.stretch
    y1, y2, y3 = (y[:, None] for y in _mutual_weights(sigma, kappa))
    owed = np.maximum(chan - comp, 0.0) / (1 + kappa)
    rest_backward = tables.backward[-1] - tables.backward[m]
    return comp + np.max(y1 * rest_backward + y2 * dsum + y3 * owed + tables.mutual[:, m : m + 1], axis=0)


def _check(deadline: Deadline | None) -> None:
    """Raise `_OutOfBudget` once `deadline` has passed (None: never)."""
    if deadline is not None and deadline.passed():
        raise _OutOfBudget


def _tables(problem: MixedProblem, allowed: Sequence[int], deadline: Deadline | None = None) -> _Tables:
    """The suffix minima of `_bounds` (dynamic programs over the groupings and compressors of every suffix), of
    `_stretched`'s problem, and those of `_mutual_bounds`.

    Raises:
        _OutOfBudget: `deadline` passed (checked once per row of each table).
    """
    kappa = problem.comm_stretch
    mutual = _mutual_rest(problem, allowed, deadline)
    problem = _stretched(problem)
    num_layers = problem.num_layers
    sigma = problem.interference
    weights = _WEIGHTS[:, None]
    rest = np.zeros((_WEIGHTS.size, num_layers + 1))
    rest_last = np.zeros((_WEIGHTS.size, num_layers + 1))
    lengths = _OPEN_LENGTHS[: np.searchsorted(_OPEN_LENGTHS, num_layers, side="right")]
    opened = np.full((_WEIGHTS.size, num_layers + 1, lengths.size), np.inf)
    lead = np.full(num_layers + 1, np.inf)
    own = np.full(num_layers, np.inf)  # least preparation of each layer alone
    queued = np.zeros((2, num_layers + 1))
    work = np.zeros(num_layers + 1)  # least preparation and middle rounds of layers m..L-1
    lead[num_layers] = 0.0
    for i in range(num_layers - 1, -1, -1):
        _check(deadline)
        ends = np.arange(i + 1, num_layers + 1)
        starts = np.full(ends.shape, i)
        best = np.full((_WEIGHTS.size, ends.size), np.inf)  # (weights, groups i..j): first group and the rest
        best_last = np.full((_WEIGHTS.size, ends.size), np.inf)
        last = ends == num_layers
        best_queued = np.full((2, ends.size), np.inf)
        best_work = np.full(ends.size, np.inf)
        for c in allowed:
            costs = problem.costs(c, starts, ends)
            best_work = np.minimum(best_work, costs.prepare + costs.middle + work[ends])
            channel = costs.first + costs.second
            compute = costs.prepare + costs.middle + costs.decode + sigma / (1 + sigma) * channel
            best = np.minimum(best, weights * compute + (1 - weights) * channel + rest[:, ends])
            compute = costs.prepare + costs.middle + np.where(last, channel + costs.decode,
                                                              sigma / (1 + sigma) * channel)
            best_last = np.minimum(best_last, weights * compute + (1 - weights) * channel + rest_last[:, ends])
            own[i] = min(own[i], float(costs.prepare[0]))
            busy = costs.first + costs.middle + costs.second  # the channel is idle during a middle round
            after_second = np.where(costs.second_round, costs.first + costs.middle + costs.decode, np.inf)
            best_queued[0] = np.minimum(best_queued[0], np.where(last, after_second, busy + costs.decode
                                                                  + queued[0, ends]))
            best_queued[1] = np.minimum(best_queued[1], np.where(last, busy + costs.decode, busy + queued[1, ends]))
        queued[:, i] = best_queued.min(axis=1)
        work[i] = best_work.min()
        rest_last[:, i] = best_last.min(axis=1)
        longer = np.minimum.accumulate(best[:, ::-1], axis=1)[:, ::-1]  # first group at least this long
        rest[:, i] = longer[:, 0]
        fits = lengths <= ends.size
        opened[:, i, fits] = longer[:, lengths[fits] - 1]
        lead[i] = problem.backward_s[i] + own[i]
    backward = problem.prefix_backward
    late = np.append(np.maximum.accumulate((backward[1:] + own + rest[0, :-1])[::-1])[::-1], 0.0)
    front_compute, front_channel = _suffix_fronts(problem, allowed, deadline)
    with np.errstate(invalid="ignore"):
        key = np.where(np.isfinite(front_compute), front_compute - front_channel, np.inf)
    return _Tables(backward=backward, lead=lead, rest=rest, opened=opened, open_lengths=lengths, late=late,
                   rest_last=rest_last, queued=queued, front_compute=front_compute, front_channel=front_channel,
                   front_key=key, least=backward[-1] - backward + work, mutual=mutual, stretch=kappa)


#: Points kept per suffix front (`_suffix_fronts`); runs of neighbours beyond that are merged into their corner.
_FRONT_POINTS = 48
#: Above this many pairs, `_suffix_fronts` first drops those that a sample's front beats (the front is the same).
_PREFILTER_POINTS = 1024


def _suffix_fronts(problem: MixedProblem, allowed: Sequence[int], deadline: Deadline | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """For every suffix m..L-1, the pairs (compute path, channel path) of its groupings x compressors that no
    other pair beats in both: compute = sum of preparation + middle + decode + sigma / (1 + sigma) * the
    group's collectives, channel = sum of first collective + middle round + second collective (the channel
    is idle during a middle round), plus the last group's decode. Both hold for the same completion, so a
    state's bound is the least over the front of max(its compute part + compute, its channel part + channel).

    A front longer than `_FRONT_POINTS` is thinned: a run of neighbours is replaced by its corner (the least
    compute and the least channel of the run), which beats each of them, so the bound stays a bound."""
    num_layers = problem.num_layers
    sigma = problem.interference
    comp = np.full((num_layers + 1, _FRONT_POINTS), np.inf)
    chan = np.full((num_layers + 1, _FRONT_POINTS), np.inf)
    for i in range(num_layers - 1, -1, -1):
        _check(deadline)
        ends = np.arange(i + 1, num_layers + 1)
        starts = np.full(ends.shape, i)
        last = ends == num_layers
        xs, ys = [], []
        for c in allowed:
            costs = problem.costs(c, starts, ends)
            busy = costs.first + costs.second
            group_comp = costs.prepare + costs.middle + costs.decode + sigma / (1 + sigma) * busy
            group_chan = busy + costs.middle + np.where(last, costs.decode, 0.0)
            rest = np.where(last[:, None], 0.0, comp[np.minimum(ends, num_layers)])  # (groups, F)
            rest_chan = np.where(last[:, None], 0.0, chan[np.minimum(ends, num_layers)])
            rest[last, 1:] = np.inf  # the last group has one completion: itself
            rest_chan[last, 1:] = np.inf
            xs.append((group_comp[:, None] + rest).ravel())
            ys.append((group_chan[:, None] + rest_chan).ravel())
        x, y = np.concatenate(xs), np.concatenate(ys)
        ok = np.isfinite(x) & np.isfinite(y)
        x, y = x[ok], y[ok]
        if x.size > _PREFILTER_POINTS:  # drop most dominated pairs cheaply: against the front of every 16th
            beaten = beaten_by_a_sample(x, y)
            x, y = x[~beaten], y[~beaten]
        order = np.lexsort((y, x))
        x, y = x[order], y[order]
        keep = np.concatenate(([True], y[1:] < np.minimum.accumulate(y)[:-1]))
        x, y = x[keep], y[keep]
        if x.size > _FRONT_POINTS:  # corners of runs: the first's compute, the last's channel
            cuts = np.linspace(0, x.size, _FRONT_POINTS + 1).astype(np.int64)
            x, y = x[cuts[:-1]], y[cuts[1:] - 1]
        comp[i, : x.size], chan[i, : y.size] = x, y
    return comp, chan


def _front_bound(tables: _Tables, m: int, compute: np.ndarray, channel: np.ndarray) -> np.ndarray:
    """min over the front of suffix m of max(compute + a, channel + b): at the crossing of the two (a rises and
    b falls along the front, so compute + a - channel - b rises)."""
    key = tables.front_key[m]
    a, b = tables.front_compute[m], tables.front_channel[m]
    size = int(np.sum(np.isfinite(a)))
    k = np.searchsorted(key[:size], channel - compute)
    lo, hi = np.clip(k - 1, 0, size - 1), np.clip(k, 0, size - 1)
    return np.minimum(np.maximum(compute + a[lo], channel + b[lo]), np.maximum(compute + a[hi], channel + b[hi]))


def _bounds(tables: _Tables, m: int, num_layers: int, sigma: float, comp: np.ndarray, chan: np.ndarray,
            dec: np.ndarray, dsum: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """No completion of these states of prefix m ends before this (seconds from the start of backward).

    For any completion, with W the compute work left (backward, preparation, middle rounds, the decodes D
    pending and those to come) and T its collectives: the compute stream and the channel are both busy
    after C, the channel for at least (E - C)+ + T, and the work overlapped w_o runs 1 + sigma times
    slower, so X >= C + W + sigma ((E - C)+ + T) / (1 + sigma) (the compute path); and every collective
    left follows max(E, C + lead_m) on the channel: X >= max(E, C + lead_m) + T (the channel path). Both
    hold for the same completion, so X >= every mix w * compute path + (1 - w) * channel path, and the least
    mix over completions is the state's part plus rest[w, m]. A second compute path: the last group's first
    collective starts after every group's preparation and the middle rounds before it, and its middle round,
    second collective and decode follow it (`_Tables.rest_last`). On the channel, a group's middle round is
    idle time between its two collectives, so the channel path grows by the middle rounds, and the decodes
    follow it (`_Tables.queued`). Also X >= `_final_end` of the state (C, D and the chain's terms only grow),
    and for every layer j >= m, the group holding j sends no earlier than C + b_m + ... + b_j + its preparation,
    and the channel then carries at least the least communication of layers j..L-1 (`_Tables.late`).

    Without comm stretch; `_real_bounds` reads these bounds of `_stretched`'s problem for a problem with one.
    """
    if m == num_layers:
        return _final_end(comp, chan, dec, dsum, sigma)
    last = _final_end(comp, chan, dec, dsum, sigma)
    compute, channel = _paths(tables, m, sigma, comp, chan, dsum)
    chosen = slice(None) if rows is None else rows
    weights = _WEIGHTS[chosen, None]
    bound = np.max(weights * compute + (1 - weights) * channel + tables.rest[chosen, m : m + 1], axis=0)
    bound = np.maximum(bound, _front_bound(tables, m, compute, channel))
    # The last group's collectives, middle round and decode follow everything else's preparation (stretched by
    # the collectives before it, as on the compute path).
    ahead = comp + (tables.backward[-1] - tables.backward[m]) + sigma / (1 + sigma) * np.maximum(chan - comp, 0.0)
    bound = np.maximum(bound, np.max(weights * ahead + (1 - weights) * channel + tables.rest_last[chosen, m : m + 1],
                                     axis=0))
    bound = np.maximum(bound, comp + (tables.late[m] - tables.backward[m]))
    # The channel path with its idle middle rounds, then the decodes: after a last second round every decode
    # (pending and to come) runs after its middle round; otherwise the last decode follows its collective.
    bound = np.maximum(bound, channel + np.minimum(dsum + tables.queued[0, m], tables.queued[1, m]))
    return np.maximum(bound, last)


def _real_bounds(tables: _Tables, m: int, num_layers: int, sigma: float, comp: np.ndarray, chan: np.ndarray,
                 dec: np.ndarray, dsum: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """`_bounds` of a problem with comm stretch kappa (its tables are `_stretched`'s): no completion of these states
    of prefix m ends before this.

    The search's states are states of the stretched problem (their channel is kept as if compute never stopped;
    a wait moves what follows it), so `_bounds` of the stretched problem, B, bounds the end X' of its completions.
    The real end shrinks by kappa / (1 + kappa) every stretch of time after C in which the compute stream is idle
    (waits, and after C_G): X = (X' + kappa (C + busy)) / (1 + kappa), busy being the compute stream's busy time
    after C, at least `_Tables.least`. So X >= (B + kappa q) / (1 + kappa), q = C + least[m], and X >= q + D; at
    m = L this is X itself (`_end`)."""
    kappa = tables.stretch
    if not kappa:
        return _bounds(tables, m, num_layers, sigma, comp, chan, dec, dsum, rows)
    least = comp + tables.least[m]
    stretched = _bounds(tables, m, num_layers, sigma, comp, chan, dec, (1 + kappa) * dsum, rows)
    bound = np.maximum(least + dsum, (stretched + kappa * least) / (1 + kappa))
    if m == num_layers or not sigma:  # (without interference the stretched paths hold this bound already)
        return bound
    return np.maximum(bound, _mutual_bounds(tables, m, sigma, comp, chan, dsum))


#: The weights `_search` tries first (w = 0, 0.5, 1: a weaker bound, cheap), before all of them.
_FEW_WEIGHTS = np.array([0, _WEIGHTS.size // 2, _WEIGHTS.size - 1])


def _paths(tables: _Tables, m: int, sigma: float, comp: np.ndarray, chan: np.ndarray, dsum: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """The states' own parts of the compute and channel paths of `_bounds`."""
    compute = comp + dsum + (tables.backward[-1] - tables.backward[m]) + sigma / (1 + sigma) * np.maximum(
        chan - comp, 0.0)
    return compute, np.maximum(chan, comp + tables.lead[m])


def _expiry(tables: _Tables, m: int, sigma: float, comp: np.ndarray, chan: np.ndarray, dsum: np.ndarray,
            limit: float | np.ndarray) -> np.ndarray:
    """For new states of prefix m < L: the first layer at which extending them is pointless, m - 1 plus the
    least length of the next group from which on every completion is bounded above `limit` (`_bounds` over the
    completions whose first group is at least that long: non-decreasing in the length). A huge number where
    no such length is known. With comm stretch kappa the bound is `_stretched`'s, read as `_real_bounds` reads it:
    it exceeds `limit` where the stretched one exceeds (1 + kappa) limit - kappa q."""
    kappa = tables.stretch
    if kappa:
        least = comp + tables.least[m]
        limit = (1 + kappa) * limit - kappa * least
        dsum = (1 + kappa) * dsum
    compute, channel = _paths(tables, m, sigma, comp, chan, dsum)
    weights = _WEIGHTS[:, None, None]
    mixed = weights * compute[None, None, :] + (1 - weights) * channel[None, None, :]  # (w, 1, states)
    bound = np.max(mixed + tables.opened[:, m, :, None], axis=0)  # (lengths, states)
    beyond = bound > limit
    first = np.where(beyond.any(axis=0), np.argmax(beyond, axis=0), tables.open_lengths.size)
    lengths = np.append(tables.open_lengths, np.iinfo(np.int64).max // 4)
    return m - 1 + lengths[first]


def mixed_lower_bound(problem: MixedProblem, allowed: Sequence[int] | None = None, *,
                      deadline: Deadline | None = None) -> float:
    """An iteration time no grouping and choice of compressors (among `allowed`, default all) can beat. Where
    `deadline` passes before its tables are built, the compute path alone (`_compute_bound`)."""
    picks = list(range(len(problem.compressors))) if allowed is None else list(allowed)
    try:
        tables = _tables(problem, picks, deadline)
    except _OutOfBudget:
        return _compute_bound(problem)
    return _root_bound(problem, tables)


def _root_bound(problem: MixedProblem, tables: _Tables) -> float:
    """The empty prefix's bound: no solution of the tables' compressors ends sooner."""
    zero = np.zeros(1)
    root = float(_real_bounds(tables, 0, problem.num_layers, problem.interference, zero, zero, zero, zero)[0])
    return problem.forward_s + root + problem.update_s


def _compute_bound(problem: MixedProblem) -> float:
    """F + the whole backward pass + U: a bound that costs nothing, for a solve with no time left for tables."""
    return problem.forward_s + float(problem.prefix_backward[-1]) + problem.update_s


#: The share of what is left of its deadline that the exact search may take; the wide beam that stands in
#: for it when it runs out has the rest.
_SEARCH_SHARE = 0.75


class MixedParetoDP:
    """Exact grouping x compressor per group for a `MixedProblem` (see the module docstring).

    Call order: construct, then `solve(problem)` any number of times (with a `deadline` shared with other
    solves of the same plan, and the solutions it must not be worse than, `incumbents`).

    Args:
        prune: branch and bound (exact; off only to test that it is).
        allowed: indices of the compressors it may choose (default: all of the problem's); a single one
            gives the best plan with that compressor everywhere.
        time_limit_s: seconds the whole solve may take (tables, beams, search, fallback) where `solve` is given
            no deadline; past them the best solution found (the incumbents, the single-compressor groupings,
            a beam of the search) is returned, not proven optimal, with its gap to the lower bound
            (`MixedSolution.gap`). None: no limit.
        budget: a limit in candidate states made by the exact search (deterministic, for tests); None: none.
        error: an error budget (`ErrorBudget`): the fastest plan whose error is within it, exactly (the states
            gain their error as a fifth clock, never decreasing, so the fronts stay exact; a state whose error
            plus the least its remaining layers can add exceeds the budget is dropped). None: no budget.
        grouping: keep these groups (exclusive end indices) and choose only each one's compressor, exactly (the
            search makes states at the grouping's ends only, each from the previous end). None: choose the grouping
            too. A plan run inside DDP keeps its buckets, so its re-plans keep its grouping.
    """

    name = "mixed-pareto-dp"
    exact = True
    description = "exact Pareto-front dynamic program over groupings and a compressor per group"

    def __init__(self, *, prune: bool = True, allowed: Sequence[int] | None = None,
                 time_limit_s: float | None = DEFAULT_TIME_LIMIT_S, budget: int | None = None,
                 error: ErrorBudget | None = None, grouping: Sequence[int] | None = None) -> None:
        self.prune = prune
        self.grouping: Grouping | None = None if grouping is None else tuple(int(e) for e in grouping)
        self.allowed = None if allowed is None else tuple(allowed)
        self.time_limit_s = time_limit_s
        self.budget = budget
        self.error = error

    def __repr__(self) -> str:
        within = "" if self.error is None else f", error budget {self.error.budget} units"
        fixed = "" if self.grouping is None else f", grouping={self.grouping}"
        return (f"MixedParetoDP(prune={self.prune}, allowed={self.allowed}, time_limit_s={self.time_limit_s}, "
                f"budget={self.budget}{within}{fixed})")

    def solve(self, problem: MixedProblem, *, deadline: Deadline | None = None,
              incumbents: Sequence[MixedSolution] = ()) -> MixedSolution:
        """The best solution found by `deadline` (default: `time_limit_s` from now), proven optimal when the
        search finished, and never worse than any of `incumbents` (solutions of `problem` among the allowed
        compressors: the plans printed beside this one).

        Incumbents whose error exceeds the error budget, or (with a fixed `grouping`) of another grouping, are left
        out.

        Raises:
            SolverError: `allowed` names a compressor the problem has not got, or an incumbent uses one it does
                not allow; the error budget does not fit the problem, or no plan of the allowed compressors fits it;
                the fixed grouping is not one of the problem's layers.
        """
        allowed = tuple(range(len(problem.compressors))) if self.allowed is None else self.allowed
        if not allowed or any(not 0 <= c < len(problem.compressors) for c in allowed):
            raise SolverError(f"allowed compressors must be indices in 0..{len(problem.compressors) - 1}, but got "
                              f"{list(allowed)}")
        outside = [s.choice for s in incumbents if not set(s.choice) <= set(allowed)]
        if outside:
            raise SolverError(f"an incumbent solution uses compressors {sorted(set(outside[0]) - set(allowed))} "
                              f"outside the allowed {list(allowed)}")
        error = self.error
        grouping = self.grouping
        if grouping is not None:
            ends = np.asarray(grouping)
            if ends.size == 0 or grouping[-1] != problem.num_layers or np.any(np.diff(np.concatenate(([0], ends))) < 1):
                raise SolverError(f"a fixed grouping must be increasing group ends ending at the problem's "
                                  f"{problem.num_layers} layers, but got {list(grouping)}")
        if error is not None:
            _check_error_budget(problem, error, allowed, grouping)
            forbidden = error.forbidden(allowed)
            if forbidden.any():  # the same plans within the budget, and bounds over the ways it allows
                problem = replace(problem, forbidden=forbidden)
        deadline = deadline if deadline is not None else Deadline(self.time_limit_s)
        fixed = problem.forward_s + problem.update_s
        if not self.prune:
            found = _search(problem, _tables(problem, allowed), allowed, np.inf, error=error, grouping=grouping)
            assert found is not None
            return MixedSolution(found[0], found[1], fixed + found[2])
        groupings = (tuple(range(1, problem.num_layers + 1)), (problem.num_layers,), ddp_buckets(problem))
        tried = [(g, (c,) * len(g)) for c in allowed for g in dict.fromkeys(groupings if grouping is None
                                                                          else (grouping,))]
        tried += [(s.grouping, s.choice) for s in incumbents if grouping is None or s.grouping == grouping]
        if error is not None:  # within the budget only, and the plan of least error always
            tried = [(g, c) for g, c in tried if error.of_solution(g, c) <= error.budget]
            tried.append(error.cheapest(allowed, grouping))
        best = min((_evaluated(problem, g, c) for g, c in tried), key=lambda s: s.iteration_s)
        try:
            tables = _tables(problem, allowed, deadline)
        except _OutOfBudget:  # no time for a bound better than the compute path
            return replace(best, proven=False, lower_bound_s=min(_compute_bound(problem), best.iteration_s))
        # The bounds' sums may round a few ulps above an optimum they equal: a bound is never above a found step.
        bound = _root_bound(problem, tables)

        def improved(found: tuple[Grouping, Choice, float] | None) -> None:
            """Keep what the search found unless it is slower (on a tie, the search's own choice: an incumbent
            may send a group a dearer way that the end does not see)."""
            nonlocal best
            if found is not None and fixed + found[2] <= best.iteration_s * (1 + _TIE_RTOL):
                best = MixedSolution(found[0], found[1], fixed + found[2])

        def limit() -> float:
            return (best.iteration_s - fixed) * (1 + _PRUNE_RTOL)

        try:
            improved(_search(problem, tables, allowed, limit(), beam=_BEAM, deadline=deadline, error=error,
                             grouping=grouping))
            improved(_search(problem, tables, allowed, limit(), budget=self.budget,
                             deadline=deadline.share(_SEARCH_SHARE), error=error, grouping=grouping))
        except _OutOfBudget:
            with contextlib.suppress(_OutOfBudget):  # what is left of the deadline, for a wider beam
                improved(_search(problem, tables, allowed, limit(), beam=_WIDE_BEAM, deadline=deadline,
                                 error=error, grouping=grouping))
            return replace(best, proven=False, lower_bound_s=min(bound, best.iteration_s))
        # Finished: `best` is optimal (a search that prunes everything within it leaves the incumbent, optimal
        # up to rounding).
        return replace(best, proven=True, lower_bound_s=min(bound, best.iteration_s))


def _check_error_budget(problem: MixedProblem, error: ErrorBudget, allowed: Sequence[int],
                        grouping: Grouping | None = None) -> None:
    """An error budget of this problem's compressors and layers, that some plan of the allowed ones (of `grouping`,
    where fixed) fits."""
    if error.units.shape != (len(problem.compressors), problem.num_layers):
        raise SolverError(f"the error budget has units for {error.units.shape[0]} compressors x {error.units.shape[1]} "
                          f"layers, but the problem has {len(problem.compressors)} x {problem.num_layers}")
    least = error.of_solution(*error.cheapest(allowed, grouping))
    if least > error.budget:
        raise SolverError(f"no plan fits the error budget: the least error of the allowed compressors is {least} units "
                          f"against a budget of {error.budget}; allow a compressor of less error (dense has none) or "
                          "raise the budget")


def _evaluated(problem: MixedProblem, grouping: Grouping, choice: Choice) -> MixedSolution:
    return MixedSolution(grouping, choice, simulate_mixed(problem, grouping, choice).iteration_s)


def _dominated(every: list[GroupCosts], kappa: float = 0.0, units: Sequence[np.ndarray] | None = None) -> np.ndarray:
    """(compressors, groups): whether another compressor's transition is never later in any clock for that group
    (its preparation, collectives, middle round and decode no larger, and no second round where this one has
    none), the first of equal ones kept. Exact: a dominated compressor's states are dominated. With comm stretch
    kappa a group without a second round never beats one with it: the wait reads the channel in real time, and
    the stretched clock of the group without one may stay later. With `units` (each compressor's error units for
    the groups) the other compressor's must be no larger too."""
    count = len(every)
    beaten = np.zeros((count, every[0].prepare.size), dtype=bool)
    for i, a in enumerate(every):
        for j, b in enumerate(every):
            if i == j:
                continue
            rounds = (b.second_round == a.second_round) if kappa else (~b.second_round | a.second_round)
            no_later = ((b.prepare <= a.prepare) & (b.first <= a.first) & (b.decode <= a.decode) & rounds
                        & (~b.second_round | ((b.middle <= a.middle) & (b.second <= a.second))))
            equal = ((b.prepare == a.prepare) & (b.first == a.first) & (b.decode == a.decode)
                     & (b.second_round == a.second_round) & (b.middle == a.middle) & (b.second == a.second))
            if units is not None:
                no_later &= units[j] <= units[i]
                equal &= units[j] == units[i]
            beaten[i] |= no_later & ~(equal & (j > i))
    return beaten


def _extend(comp: np.ndarray, chan: np.ndarray, dec: np.ndarray, dsum: np.ndarray, origin: np.ndarray, which: int,
            costs: GroupCosts, where: np.ndarray, backward: np.ndarray, sigma: float, kappa: float
            ) -> tuple[np.ndarray, ...]:
    """The states that states (comp, chan, dec, dsum) lead to through the groups `where` (indices into `costs`)
    sent by compressor `which` (see the module docstring), with their parents and compressor."""
    stretch = 1 + kappa
    c1 = advance_many(comp, chan, backward + costs.prepare[where], sigma)
    second = costs.second_round[where]
    e1 = np.maximum(c1, chan) + stretch * costs.first[where]
    if kappa:  # a second round waits for its first collective: the channel runs at full speed meanwhile
        waited = np.maximum(c1, unstretched_many(chan, c1, kappa)) + costs.first[where]
        e1 = np.where(second, waited, e1)
    c2 = np.where(second, e1 + costs.middle[where], c1)
    e2 = np.where(second, c2 + stretch * costs.second[where], e1)
    decode = costs.decode[where]
    chain = np.maximum(dec, e2)
    if kappa:  # the chain's terms before a second round's wait never decide the end (`_end`): dropped
        chain = np.where(second, e2, chain)
    return c2, e2, chain + stretch * (1 + sigma) * decode, dsum + decode, origin, np.full(origin.shape, which)


def _end(comp: np.ndarray, chan: np.ndarray, dec: np.ndarray, dsum: np.ndarray, sigma: float, kappa: float
         ) -> np.ndarray:
    """X_G of complete states (seconds from the start of backward), a bound on it for incomplete ones.

    The decodes start at C_G and run 1 + sigma times slower until the channel's real end e_G =
    max(C_G, unstretched(E_G, C_G)); each starts after its own collectives. With the chain
    Y = max(C + (1 + sigma) D, max over groups of (e_g + (1 + sigma) * the decodes from g on)) of decodes all
    slowed, X_G = e_G + (Y - e_G) / (1 + sigma). A chain term whose collective ends before C_G is below the first
    one, so every term may be read through the same map (kappa C_G + E_g) / (1 + kappa) (`TopkParetoDP`'s), and
    V, the chain of the stretched E_g with decodes (1 + kappa)(1 + sigma) times as long, holds them all:
    X_G = (sigma e_G + max(C + (1 + sigma) D, (kappa C + V) / (1 + kappa))) / (1 + sigma); C + D where the
    channel is idle by C_G (`_final_end` for kappa = 0). Non-decreasing in every clock, and for the states of a
    prefix a bound on every completion (C, D and the terms of V only grow)."""
    if not kappa:
        return _final_end(comp, chan, dec, dsum, sigma)
    real = np.maximum(comp, (kappa * comp + chan) / (1 + kappa))  # e = max(C, unstretched(E, C))
    chain = np.maximum(comp + (1 + sigma) * dsum, (kappa * comp + dec) / (1 + kappa))
    return (sigma * real + chain) / (1 + sigma)


class _OutOfBudget(Exception):
    """The search made more candidate states than its budget allows, or its deadline passed."""


def _search(problem: MixedProblem, tables: _Tables, allowed: Sequence[int], limit: float,
            beam: int | None = None, budget: int | None = None, deadline: Deadline | None = None,
            error: ErrorBudget | None = None, grouping: Grouping | None = None
            ) -> tuple[Grouping, Choice, float] | None:
    """The best solution whose states all have bounds <= `limit` and its X_G; None if none. With `beam`, only
    that many states with the lowest bounds are kept per prefix (a heuristic). With `error`, only solutions within
    its budget: each state carries its units, a fifth coordinate of its front. With `grouping`, only solutions of
    those groups: states are made at its ends only, each from the states of the previous end (the bounds and the
    reductions hold over every grouping, so over these too).

    Raises:
        _OutOfBudget: more than `budget` candidate states were made, or `deadline` passed (checked once per
            layer; None: no limit).
    """
    num_layers = problem.num_layers
    sigma, kappa = problem.interference, problem.comm_stretch
    backward = tables.backward
    bounded = bool(np.isfinite(limit))
    capacity = 64
    comp, chan, dec, dsum = (np.zeros(capacity) for _ in range(4))
    err = np.zeros(capacity, dtype=np.int64)  # error units (0 without a budget)
    least_err = None if error is None else error.least(allowed)
    length = np.zeros(capacity, dtype=np.int64)
    parent = np.full(capacity, -1, dtype=np.int64)
    pick = np.full(capacity, -1, dtype=np.int64)
    expire = np.full(capacity, num_layers + 1, dtype=np.int64)
    count = 1  # state 0: the empty prefix
    active = np.zeros(1, dtype=np.int64)
    made = 0  # candidate states so far
    previous_end = {e: s for s, e in zip((0, *grouping[:-1]), grouping, strict=True)} if grouping is not None else None
    for j in range(num_layers):
        m = j + 1
        active = active[expire[active] > j]
        if active.size == 0:
            break
        if previous_end is not None:  # a fixed grouping: a group ends here only at its ends, from the previous one
            if m not in previous_end:
                continue
            active = active[length[active] == previous_end[m]]
            if active.size == 0:
                break
        first = length[active]
        starts, block = np.unique(first, return_inverse=True)
        ends = np.full(starts.shape, m)
        parts, errs = [], []
        every = [problem.costs(c, starts, ends) for c in allowed]
        units = None if error is None else [error.group(c, starts, ends) for c in allowed]
        beaten = _dominated(every, kappa, units)  # (compressors, blocks): another compressor sends them no later
        for i, (c, costs) in enumerate(zip(allowed, every, strict=True)):
            if beaten[i].all():
                continue
            rows = np.flatnonzero(~beaten[i][block])
            sub, where = active[rows], block[rows]
            parts.append(_extend(comp[sub], chan[sub], dec[sub], dsum[sub], sub, c, costs, where,
                                 backward[m] - backward[starts[where]], sigma, kappa))
            errs.append(err[sub] if units is None else err[sub] + units[i][where])
        new_comp, new_chan, new_dec, new_dsum, origin, chosen = (np.concatenate(x) for x in zip(*parts, strict=True))
        new_err = np.concatenate(errs)

        made += new_comp.size
        if (budget is not None and made > budget) or (deadline is not None and deadline.passed()):
            raise _OutOfBudget
        if m < num_layers:
            # A decode chain that the compute path will overtake anyway: V_m + (1 + kappa)(1 + sigma) * (decodes to
            # come) <= C_G + (1 + kappa)(1 + sigma) D_G, so V_m never decides the end (`_end`); E stands in for it.
            overtaken = new_dec <= new_comp + (1 + kappa) * (1 + sigma) * new_dsum + (backward[-1] - backward[m])
            new_dec = np.where(overtaken, new_chan, new_dec)
            # compute-bound states: canonical (k, k), k = (C + sigma E) / (1 + sigma) (`TopkParetoDP`'s kappa)
            bound_by_compute = new_chan - new_comp <= tables.lead[m] * (1 + sigma)
            settled = (new_comp + sigma * new_chan) / (1 + sigma) if sigma else new_comp
            new_comp = np.where(bound_by_compute, settled, new_comp)
            new_chan = np.where(bound_by_compute, settled, new_chan)
        kept = np.arange(new_comp.size)
        if error is not None:  # within the budget, with the least the layers after m can add
            assert least_err is not None
            kept = np.flatnonzero(new_err + least_err[m] <= error.budget)
            if kept.size == 0:
                continue
        if bounded:
            kept = kept[_real_bounds(tables, m, num_layers, sigma, new_comp[kept], new_chan[kept], new_dec[kept],
                                     new_dsum[kept], _FEW_WEIGHTS) <= limit]
            if kept.size == 0:
                continue
            kept = kept[_real_bounds(tables, m, num_layers, sigma, new_comp[kept], new_chan[kept], new_dec[kept],
                                     new_dsum[kept]) <= limit]
            if kept.size == 0:
                continue
        more = () if error is None else (new_err[kept],)
        front = kept[_pareto_front(new_comp[kept], new_chan[kept], new_dec[kept], new_dsum[kept], *more)]
        if beam is not None and front.size > beam:
            bound = _real_bounds(tables, m, num_layers, sigma, new_comp[front], new_chan[front], new_dec[front],
                                 new_dsum[front])
            front = front[np.sort(np.argpartition(bound, beam)[:beam])]
        size = front.size
        if count + size > capacity:
            capacity = 2 * (count + size)
            comp, chan, dec, dsum = (np.resize(x, capacity) for x in (comp, chan, dec, dsum))
            err = np.resize(err, capacity)
            length, parent, pick, expire = (np.resize(x, capacity) for x in (length, parent, pick, expire))
        block_slice = slice(count, count + size)
        if bounded and m < num_layers:
            expire[block_slice] = _expiry(tables, m, sigma, new_comp[front], new_chan[front], new_dsum[front], limit)
        else:
            expire[block_slice] = num_layers + 1
        comp[block_slice], chan[block_slice] = new_comp[front], new_chan[front]
        dec[block_slice], dsum[block_slice] = new_dec[front], new_dsum[front]
        err[block_slice] = new_err[front]
        length[block_slice], parent[block_slice], pick[block_slice] = m, origin[front], chosen[front]
        if m < num_layers:
            active = np.concatenate((active, np.arange(count, count + size)))
        count += size
    finals = np.flatnonzero(length[:count] == num_layers)
    if finals.size == 0:
        return None
    ends_at = _end(comp[finals], chan[finals], dec[finals], dsum[finals], sigma, kappa)
    best = int(np.argmin(ends_at))
    state = int(finals[best])
    ends_of: list[int] = []
    picks: list[int] = []
    while state > 0:
        ends_of.append(int(length[state]))
        picks.append(int(pick[state]))
        state = int(parent[state])
    return tuple(reversed(ends_of)), tuple(reversed(picks)), float(ends_at[best])


def check_solution(problem: MixedProblem, grouping: Sequence[int], choice: Sequence[int]) -> MixedSolution:
    """A grouping and choice of `problem`, checked, with its simulated iteration time."""
    ends, picks = validate_choice(problem, grouping, choice)
    return _evaluated(problem, ends, picks)


def describe(problem: MixedProblem, solution: MixedSolution) -> list[tuple[range, str]]:
    """Each group's layer range and compressor name."""
    return [(r, str(problem.compressors[c].compressor)) for r, c in zip(groups_of(solution.grouping),
                                                                      solution.choice, strict=True)]
