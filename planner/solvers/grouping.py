"""Solvers that choose how to merge per-layer gradients into groups (one collective per group).

Exact solvers (dynamic programs over prefixes of the ready order):

- `DenseDP`: MG-WFBP's problem, E*(j) = min over i of max(E*(i-1), R_j) + T(n_i..n_j), O(L^2).
- `TopkParetoDP`: MGS's problem, a Pareto front of two clocks per prefix (exact, see its docstring).

Baselines (`exact = False`, evaluated with the same model so that comparisons are fair): one collective
per layer (WFBP), one bucket for everything, PyTorch DDP's buckets, Horovod's fusion cycle, fixed 64 MiB
buckets, and the greedy merge rules published with MG-WFBP and MGS. Every row groups whole layers in
ready order; DDP and Horovod bucket parameter tensors, so a layer's weight and bias can land in
different buckets there.

`lower_bound` is a bound no grouping can beat under the timeline model. Every solver answers with a
`Grouping` (tuple of exclusive group ends); `planner.costmodel.simulator.simulate` evaluates it.

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
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from planner.costmodel.costs import AffineCost, CostModel, ScaledCost
from planner.costmodel.problem import (
    INDEX_BYTES,
    GradientProblem,
    Grouping,
    advance,
    advance_many,
    topk_count_many,
    unstretched,
    unstretched_many,
)
from planner.costmodel.simulator import simulate
from planner.solvers.deadline import Deadline
from planner.types import GROUPING_STRATEGIES, SolverError, Strategy

__all__ = [
    "BASELINES",
    "DDP_BASELINE",
    "DenseDP",
    "FixedBuckets",
    "GroupingSolver",
    "HorovodCycle",
    "MGSGreedy",
    "MGWFBPGreedy",
    "PerLayer",
    "SingleBucket",
    "Solved",
    "TopkParetoDP",
    "lower_bound",
    "solve_exact",
    "within_group_bounds",
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

# Relative slack of the exact pruning in TopkParetoDP: rounding must never prune an optimal state.
_PRUNE_RTOL = 1e-9
# TopkParetoDP pre-filters the states of a prefix against a sample's Pareto front above this many states.
_PREFILTER_MIN_STATES = 256


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


#: Lengths of the next group at which the search's expiry table (`_Lagrangian.opened`) has a column:
#: about 30% apart.
_OPEN_LENGTHS = np.unique(np.round(1.3 ** np.arange(40)).astype(np.int64))


#: Weights w of the Lagrangian bounds of TopkParetoDP (w = 1: compute path, w = 0: channel path).
_BOUND_WEIGHTS = np.linspace(0.0, 1.0, 11)


#: First groups of up to this many layers are costed one by one by the Lagrangian bounds
#: (`_lagrangian_suffixes`); longer ones are bounded below by lines under their costs.
_LAGRANGIAN_BAND = 64
#: Group sizes (log-spaced over the sizes of the longer groups) at which those lines touch the costs.
_LINE_ANCHORS = 12


@dataclass(frozen=True)
class _Lagrangian:
    """Lower bounds of what is left after a prefix (see `_lagrangian_suffixes`).

    weights: the weights w. rest[w, m]: no grouping of layers m..L-1 costs less than this in the w-mix of
    the two paths. opened[w, m, c]: nor does any whose first group holds at least `open_lengths[c]` layers
    (non-decreasing in c; inf where no group is that long). groupings: a grouping found for each weight
    (good groupings in their own right: heuristics).
    """

    weights: np.ndarray
    rest: np.ndarray
    opened: np.ndarray
    open_lengths: np.ndarray
    groupings: list[Grouping]


def _path_costs(problem: GradientProblem, sizes: np.ndarray, last: np.ndarray | bool) -> tuple[np.ndarray, np.ndarray]:
    """The costs of groups of `sizes` elements on the compute and channel paths of `_lagrangian_suffixes`
    (`last`: where the group is the last one, which ends both paths)."""
    sigma = problem.interference
    comm, decode = _comm_and_decode_many(problem, sizes)
    if problem.strategy is Strategy.TOPK:
        compute = _prepare_many(problem, sizes) + (decode + sigma * comm) / (1 + sigma)
        compute += np.where(last, sigma * decode / (1 + sigma), 0.0)
    else:
        compute = _prepare_many(problem, sizes) + comm * (sigma / (1 + sigma))
        compute += np.where(last, comm / (1 + sigma), 0.0)  # the last group's collective follows the compute path
    return compute, comm + np.where(last, decode, 0.0)


def _group_cost_lines(problem: GradientProblem, weights: np.ndarray, anchors: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Lines under the w-mix of the path costs of a group that is not the last one: A[w, l] + B[w, l] * N <=
    w * compute(N) + (1 - w) * channel(N) for every size N > 0 (`_path_costs`), one per anchor size, each the
    sum of its cost models' lines (`CostModel.lines`) that are highest at the anchor. Top-k's k(N) is at
    least rho N (rho <= 1), and every cost model is non-decreasing, so the lines of cost(c * rho * N) are
    under cost(c * k(N))."""
    sigma = problem.interference
    # (cost model, its argument per element, weight on the compute path, weight on the channel path)
    parts: list[tuple[CostModel, float, float, float]] = []
    if problem.pack is not None:
        parts.append((problem.pack, 1.0, 1.0, 0.0))
    if problem.strategy is Strategy.TOPK:
        assert problem.select is not None and problem.decode is not None and problem.density is not None
        rho = problem.density * (1 - 1e-12)  # below the decimal density k(N) is computed from
        parts.append((problem.select, 1.0, 1.0, 0.0))
        parts.append((problem.decode, problem.world_size * rho, 1 / (1 + sigma), 0.0))
        parts.append((problem.comm, rho * (problem.element_bytes + INDEX_BYTES), sigma / (1 + sigma), 1.0))
    else:
        parts.append((problem.comm, float(problem.element_bytes), sigma / (1 + sigma), 1.0))
    intercept = np.zeros((weights.size, anchors.size))
    slope = np.zeros((weights.size, anchors.size))
    for model, scale, on_compute, on_channel in parts:
        lines = np.asarray(model.lines(), dtype=float).reshape(-1, 2)
        highest = lines[np.argmax(lines[:, :1] + lines[:, 1:] * (scale * anchors), axis=0)]  # (anchors, 2)
        mix = weights * on_compute + (1 - weights) * on_channel
        intercept += mix[:, None] * highest[None, :, 0]
        slope += mix[:, None] * (scale * highest[None, :, 1])
    return intercept, slope


def _lagrangian_suffixes(
    problem: GradientProblem, prefix_numel: np.ndarray, bounds: _GroupBounds | None = None, band: int | None = None
) -> _Lagrangian:
    """Suffix bounds of the search's clocks: for each weight w and prefix length m, a lower bound of the
    minimum over groupings of layers m..L-1 of w * X + (1 - w) * Y (s: selection or packing, d: decode,
    0 for dense; sigma: interference; "last": the group that ends at layer L-1):

    - Y = sum of T + d_last (channel path): the first collective left starts no earlier than
      max(E, C + b_m + s(n_m)), every later one follows on the channel, and the last group's decode after
      the last collective;
    - dense: X = sum of (s + sigma T / (1 + sigma)) + T_last / (1 + sigma), from kappa = (C + sigma E) /
      (1 + sigma) plus the rest of backward. If w_o of the remaining work W runs while the channel is busy,
      the compute stream ends no earlier than C + W + sigma w_o, then the last collective; and both clocks
      end no earlier than C + W + ((E - C)+ + sum of T) - w_o (after C the channel is busy that long, and
      the time both are busy, (1 + sigma) w_o, counts once). 1 / (1 + sigma) times the first plus
      sigma / (1 + sigma) times the second no longer depends on w_o;
    - top-k: X = sum of (s + (d + sigma T) / (1 + sigma)) + sigma d_last / (1 + sigma), from
      kappa + D / (1 + sigma) plus the rest of backward (D: the decode pending in the state): the same
      argument with every decode after the compute stream's end (X_G >= C_G + all decode) in place of the
      last collective, and the last decode after both clocks' end.

    (Without interference kappa = C.) Any completion ends after both, hence after every convex
    combination: w * (start of X + rest of backward) + (1 - w) * max(E, C + b_m + s(n_m)) + rest[w, m].

    The minimum is the dynamic program r(m) = min over j of c(m, j) + r(j + 1), c the w-mix of the costs of
    the group m..j; `opened` comes with it, the least over j >= m + length - 1 for each open length. Groups
    of up to `band` layers (and the last group) are costed one by one; a longer group m..j that is not the
    last is bounded below by lines under its cost, c(m, j) >= A + B (S[j + 1] - S[m]), so that
    c(m, j) + r(j + 1) >= A - B S[m] + min over y > m + band of (r(y) + B S[y]), a suffix minimum kept as
    the program runs: O(L * band) in place of O(L^2), and still a lower bound (only weaker where a long
    first group is the cheapest). With band >= L - 1 (the default on models of up to `_LAGRANGIAN_BAND`
    layers and wherever group-size bounds apply) it is the exact minimum.

    With `bounds`, the minimum is over the groupings the bounds allow (a tighter bound, still valid for
    every allowed completion), and the groupings returned are allowed.
    """
    num_layers = len(prefix_numel) - 1
    prefix = prefix_numel
    weights = _BOUND_WEIGHTS
    bounded = bounds is not None and bounds.active
    band = num_layers if bounded else min(num_layers, band or _LAGRANGIAN_BAND)
    lengths = _OPEN_LENGTHS[: np.searchsorted(_OPEN_LENGTHS, num_layers, side="right")]
    # Weights last inside (the program's reductions then run along contiguous rows); transposed at the end.
    rest = np.zeros((num_layers + 1, weights.size))
    opened = np.full((num_layers + 1, lengths.size, weights.size), np.inf)
    nexts = np.zeros((num_layers, weights.size), dtype=np.int64)
    offsets = np.arange(band)

    # Beyond the band: the last group exactly, longer groups by lines (sizes > 0: some layer of them has
    # elements; a run of empty layers would cost nothing and the lines would not hold, so no lines then).
    tail = band <= num_layers - 2
    if tail:
        shortest = int(np.min(prefix[band + 1 : num_layers] - prefix[: num_layers - band - 1]))
        tail = shortest > 0
    last_cost = np.zeros((num_layers, weights.size))
    if band < num_layers:
        compute, channel = _path_costs(problem, prefix[num_layers] - prefix[:num_layers], True)
        last_cost = channel[:, None] + (compute - channel)[:, None] * weights
    if tail:
        anchors = np.geomspace(shortest, prefix[num_layers], _LINE_ANCHORS)
        line_a, line_b = (line.T for line in _group_cost_lines(problem, weights, anchors))  # (anchors, weights)
        # least[y, l, w] = min over y' in [y, L - 1] of rest[y', w] + B[w, l] S[y'] (inf at y = L), and
        # below[i, l, w] = A[w, l] - B[w, l] S[i]: the group i..j costs at least below[i] + least[j + 1]
        least = np.full((num_layers + 1, anchors.size, weights.size), np.inf)
        lifted = line_b * prefix[:num_layers, None, None]
        below = line_a - lifted

    def beyond(rows: np.ndarray, firsts: np.ndarray) -> np.ndarray:
        """rows (R,), firsts (R, C): bound of the groups rows[r]..j over j >= firsts[r, c] (>= rows[r] + band)
        that exist: (R, C, weights)."""
        out = np.where((firsts <= num_layers - 1)[..., None], last_cost[rows, None, :], np.inf)
        if tail:
            lines = below[rows, None] + least[np.minimum(firsts + 1, num_layers)]  # (R, C, anchors, weights)
            out = np.minimum(out, lines.max(axis=2))
        return out

    rows_per_chunk = max(1, min(256, 2**17 // band))
    for hi in range(num_layers, 0, -rows_per_chunk):
        lo = max(0, hi - rows_per_chunk)
        rows = np.arange(lo, hi)
        ends = rows[:, None] + offsets  # the group i..j for j = i..i + band - 1
        inside = ends < num_layers
        ends = np.minimum(ends, num_layers - 1)
        compute, channel = _path_costs(problem, prefix[ends + 1] - prefix[rows, None], ends == num_layers - 1)
        excess = np.where(inside, compute - channel, 0.0)  # w * compute + (1 - w) * channel = channel + w * excess
        channel = np.where(inside, channel, np.inf)
        if bounds is not None and bounded:
            for r, first in enumerate(rows.tolist()):  # rest is inf without a completion
                channel[r, : num_layers - first][~bounds.starting_at(problem, prefix, first)] = np.inf
        own = channel[..., None] + excess[..., None] * weights  # (rows, band, weights): the w-mix of the group
        for i in range(hi - 1, lo - 1, -1):
            r, n = i - lo, min(band, num_layers - i)
            value = (rest[i + 1 : i + 1 + n] + own[r, :n]).min(axis=0)
            if i + band < num_layers:
                value = np.minimum(value, last_cost[i])
                if tail and i + band + 1 < num_layers:
                    value = np.minimum(value, (below[i] + least[i + band + 1]).max(axis=0))
            rest[i] = value
            if tail:
                least[i] = np.minimum(value + lifted[i], least[i + 1])
        # The chunk's rows at once, now that what follows them is known: the groupings and the open lengths.
        costs = rest[np.minimum(ends + 1, num_layers)] + own  # (rows, band, weights)
        best = np.argmin(costs, axis=1)  # (rows, weights)
        nexts[lo:hi] = rows[:, None] + 1 + best
        if band < num_layers:
            least_own = np.take_along_axis(costs, best[:, None, :], 1)[:, 0, :]
            past = (rows + band < num_layers)[:, None] & (last_cost[rows] < least_own)
            nexts[lo:hi] = np.where(past, num_layers, nexts[lo:hi])
        within = np.minimum.accumulate(costs[:, ::-1], axis=1)[:, ::-1]
        # First groups of at least `length` layers: those in the band and all beyond it, or those beyond
        # the band from that length on.
        in_band = lengths <= band
        least_open = np.empty((rows.size, lengths.size, weights.size))
        least_open[:, in_band] = np.minimum(within[:, lengths[in_band] - 1], beyond(rows, rows[:, None] + band))
        least_open[:, ~in_band] = beyond(rows, rows[:, None] + lengths[~in_band] - 1)
        least_open[rows[:, None] + lengths > num_layers] = np.inf  # no group that long
        opened[lo:hi] = np.minimum.accumulate(least_open[:, ::-1], axis=1)[:, ::-1]
    rest = np.ascontiguousarray(rest.T)
    opened = np.ascontiguousarray(opened.transpose(2, 0, 1))
    nexts = nexts.T
    groupings: list[Grouping] = []
    for row in nexts:
        ends_of, end = [], 0
        while end < num_layers:
            end = int(row[end])
            ends_of.append(end)
        groupings.append(tuple(ends_of))
    return _Lagrangian(weights, rest, opened, lengths, groupings)


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


# ----------------------------------------------------------------------------------------------------
# Exact solvers


class _BoundedSolver(GroupingSolver):
    """A grouping solver with group-size bounds (`_GroupBounds`), exposed read-only."""

    _bounds: _GroupBounds

    @property
    def min_group_bytes(self) -> int:
        return self._bounds.min_bytes

    @property
    def max_group_bytes(self) -> int | None:
        return self._bounds.max_bytes


class DenseDP(_BoundedSolver):
    """Exact grouping for dense allreduce (the MG-WFBP problem).

    Without packing cost and interference (`problem.pack` None, `problem.interference` 0) the ready times
    R_j do not depend on the grouping, and a prefix whose last collective ends earlier never hurts what
    follows (E_g is non-decreasing in E_{g-1}), so the optimal end of the channel for each prefix obeys
    E*(j) = min over i <= j of max(E*(i-1), R_j) + T(n_i + ... + n_j), E*(-1) = 0,
    and iteration = F + max(R_{L-1}, E*(L-1)) + U. O(L^2) time, vectorised over i for each j.

    With a packing cost or interference the compute stream depends on the grouping too (each group's
    packing delays later layers; collectives in flight slow them down), and the problem has the two clocks
    of the top-k problem: it is solved exactly by the same Pareto-front search (`TopkParetoDP`, with
    packing in place of selection and no decode).

    With group-size bounds the minimum runs over the allowed groups i..j only (rule in the module
    docstring; E* is infinite for a prefix no allowed grouping covers); the argument is unchanged, because
    whether a group is allowed depends on that group alone.

    With comm stretch kappa both programs run on `_stretched`'s clocks (T scaled by 1 + kappa, the same
    recurrences) and the end is read as max(C_G, C_G + (E_G - C_G) / (1 + kappa)): still non-decreasing in
    E_G (and, for the search, in C_G), so the same prefixes are the best ones.
    """

    name = "dense-dp"
    exact = True
    description = "exact dynamic program over prefixes (dense allreduce)"

    def __init__(self, *, min_group_bytes: int = 0, max_group_bytes: int | None = None) -> None:
        """Args: min_group_bytes, max_group_bytes: group-size bounds in dense gradient bytes (None: no upper
        bound); see the module docstring for the exact rule."""
        self._bounds = _GroupBounds(min_group_bytes, max_group_bytes)

    def solve(self, problem: GradientProblem) -> Grouping:
        return self.solve_with_value(problem)[0]

    def solve_within(self, problem: GradientProblem, deadline: Deadline | None = None) -> Solved:
        """As `solve_with_value`; the two-clock search (packing or interference) stops at `deadline` with the
        best grouping found, its gap to the root's bound."""
        _require(problem, Strategy.DENSE, type(self).__name__)
        if problem.pack is not None or problem.interference > 0:
            return _pareto_solve_within(problem, self._bounds, prune=True, deadline=deadline)
        return Solved(*self.solve_with_value(problem), proven=True)

    def solve_with_value(self, problem: GradientProblem) -> tuple[Grouping, float]:
        _require(problem, Strategy.DENSE, type(self).__name__)
        if problem.pack is not None or problem.interference > 0:
            return _pareto_solve(problem, self._bounds, prune=True)
        kappa = problem.comm_stretch
        fixed = problem.forward_s + problem.update_s
        problem = _stretched(problem)
        num_layers = problem.num_layers
        prefix = _prefix_numel(problem)
        ready = np.cumsum(np.asarray(problem.backward_s, dtype=float))  # R_j
        channel = np.zeros(num_layers + 1)  # channel[m] = E* of the prefix of m layers
        starts = np.zeros(num_layers, dtype=np.int64)
        bounded = self._bounds.active
        for j in range(num_layers):
            sizes = prefix[j + 1] - prefix[: j + 1]  # group i..j for i = 0..j
            candidates = np.maximum(channel[: j + 1], ready[j]) + _comm_many(problem, sizes)
            if bounded:
                candidates[~self._bounds.ending_at(problem, prefix, j)] = np.inf
            best = int(np.argmin(candidates))
            starts[j] = best
            channel[j + 1] = candidates[best]
        if not np.isfinite(channel[-1]):
            raise self._bounds.infeasible(problem)
        value = fixed + max(float(ready[-1]), unstretched(float(channel[-1]), float(ready[-1]), kappa))
        return _ends_from_back_pointers(starts, num_layers), value

    def __repr__(self) -> str:
        return f"DenseDP(min_group_bytes={self.min_group_bytes}, max_group_bytes={self.max_group_bytes})"


@dataclass(frozen=True)
class _ParetoTables:
    """Per-problem arrays of the Pareto search (see TopkParetoDP): prefix sums, lead times and suffix bounds."""

    prefix: np.ndarray  # S[m] = n_0 + ... + n_{m-1}
    backward: np.ndarray  # Q[m] = b_0 + ... + b_{m-1}
    lead: np.ndarray  # lead[m] = b_m + s(n_m), lead[L] = 0
    weights: np.ndarray  # Lagrangian weights w
    rest: np.ndarray  # rest[w, m]: see _lagrangian_suffixes
    opened: np.ndarray  # opened[w, m, c]: the same for a first group of at least open_lengths[c] layers
    open_lengths: np.ndarray
    volume: _Volumes | None  # least remaining work per clock after each prefix, with sigma or kappa
    bounds: _GroupBounds | None = None  # group-size bounds, None when there are none
    stretch: float = 0.0  # the problem's comm stretch kappa (the search runs on `_stretched`'s clocks)


@dataclass(frozen=True)
class _Volumes:
    """For each prefix length m, the least work left after it, each minimised over the groupings of layers
    m..L-1 on its own: compute (backward + selection or packing), channel (collectives) and decode."""

    compute: np.ndarray
    channel: np.ndarray
    decode: np.ndarray

    @classmethod
    def of(cls, problem: GradientProblem, prefix: np.ndarray, bounds: _GroupBounds | None = None) -> _Volumes:
        """Suffix minima over all groupings (a bound for the groupings `bounds` allow as well)."""
        backward = _prefix_backward(problem)
        return cls(
            compute=backward[-1] - backward + _suffix_min_partition(prefix, lambda n: _prepare_many(problem, n)),
            channel=_suffix_min_partition(prefix, lambda n: _comm_many(problem, n)),
            decode=_suffix_min_partition(prefix, lambda n: _decode_many(problem, n)),
        )

    def bound(self, m: int, comp: np.ndarray, chan: np.ndarray, pending: np.ndarray | float,
              interference: float) -> np.ndarray:
        """No completion of the states (C, E) of prefix m, with `pending` seconds of decode not yet run,
        ends before this (`_interference_bound`: every decode runs on the compute stream too)."""
        return _interference_bound(comp, chan, self.compute[m] + self.decode[m] + pending, self.channel[m],
                                   interference)


def _interference_bound(comp: np.ndarray, chan: np.ndarray, work: np.ndarray | float, busy: float,
                        sigma: float) -> np.ndarray:
    """The least end of `work` seconds of compute from `comp` and `busy` seconds of collectives after a
    channel busy until `chan`, when compute runs (1 + sigma) times slower while the channel is busy.

    After C the channel is busy for at least V = (E - C)+ + busy; if w_o of the work runs while it is,
    the compute stream takes work + sigma w_o, and both end no earlier than C + work + V - w_o (the time
    both are busy, (1 + sigma) w_o, counts once). The least of the larger of the two over w_o in
    [0, min(work, V / (1 + sigma))] is max(C + V, advance(C, C + V, work)).
    """
    lag = np.maximum(chan - comp, 0.0) + busy
    return np.maximum(comp + lag, advance_many(comp, comp + lag, np.broadcast_to(work, comp.shape), sigma))


class TopkParetoDP(_BoundedSolver):
    """Exact grouping for top-k sparsified allgather (the MGS problem).

    The state of a prefix is four clocks (`planner.costmodel.simulator` gives the model): compute C, channel E,
    the decode chain V (each group decoded after its own allgather, its decode stretched by 1 + sigma, from
    V_0 = 0) and the decode sum D. A group of work W = B + s(N), collective T and decode d leads to
    C' = advance(C, E, W), E' = max(C', E) + T, V' = max(V, E') + (1 + sigma) d, D' = D + d, and the
    iteration is F + X_G + U with X_G = C + D when the channel is idle by the end of backward, else
    (sigma E + max(C + (1 + sigma) D, V)) / (1 + sigma) (`_final_end`). Every transition and X_G are
    non-decreasing in every clock, so a state dominated in all four never leads to a better iteration:
    keeping, for every prefix, the Pareto front of (C, E, V, D) (with back-pointers) is exact. Exact
    reductions keep it fast:

    - compute-bound states: after a prefix of m < L layers, a state whose lag E - C is at most
      (b_m + s(n_m)) (1 + sigma) ends the work of any next group after the channel frees up: its next
      (C', E') is (W + kappa, W + kappa + T), with kappa = (C + sigma E) / (1 + sigma) (kappa = C without
      interference), exactly as from (kappa, kappa). So (C, E) is replaced by (kappa, kappa), which
      dominates every state with both clocks at least kappa (V and D stay).
    - expiry: the Lagrangian bound below, taken over the completions whose next group holds at least
      l layers (`_Lagrangian.opened`), is non-decreasing in l. When a state is made, the least l at which
      it exceeds the iteration of a good grouping is found, and the state is extended by shorter groups
      only. On long models this is what keeps the search small: a few dozen states are extended per layer
      where thousands were (every state used to stay extendable until the end).
    - dense valley: extending the states of one front by the same group of work W, a state whose lag
      E - C >= W (1 + sigma) is "wide": the channel is still busy when the work is done. Every other state
      ends its work after the channel frees up and lands on (kappa + W, kappa + W + T): the one with the
      least kappa dominates the others for this group and every longer one (W + T only grows with the
      group), so they are not extended again. W only grows as the group grows, so a state that stops being
      wide never becomes wide again. (With decodes the same holds only in all four clocks; testing it cost
      more than it saved once states expire, so top-k does not.)
    - branch and bound: a state cannot finish before a Lagrangian bound (`_lagrangian_suffixes`), which is
      non-decreasing in every clock; states whose bound exceeds the iteration of a good grouping are dropped
      before the front is sorted (a dominated state survives the bound only if its dominator does). That
      grouping is the best of the baselines, the Lagrangian groupings and, unless one of them is within
      1% of the root's bound, a first pass of this search that keeps only the few states with the lowest
      bounds per prefix (a beam, usually optimal already). A heuristic whose time equals the root's bound
      (to `_CLOSED_RTOL`) is optimal: then nothing is searched (on long compute-bound models, the rule).

    With group-size bounds (rule in the module docstring) a state is extended only by allowed groups. Every
    reduction above compares states of the same prefix, or extensions by the same group, so it stays exact:
    which groups may follow a prefix depends on the prefix's length alone, and the next group always holds
    the layer after the prefix. A state not extended by a disallowed group stays available for the longer
    groups that follow. The Lagrangian bounds run over allowed groupings (infinite after a prefix that no
    allowed grouping completes), and only allowed groupings serve as upper bounds.

    With comm stretch kappa (collectives 1 + kappa times slower until the compute stream's work ends at C_G) the
    search runs on `_stretched`'s problem, collectives and decodes (1 + kappa) times as long, whose transitions
    are those above, and reads its end in real time, X_G = (kappa C_G + X'_G) / (1 + kappa): non-decreasing in
    C_G and in X'_G, so the same Pareto fronts hold the optimum; the bounds are read the same way
    (`_state_bounds`).

    The dense problem with a packing cost or interference has the two clocks C and E (s = packing, d = 0),
    and `DenseDP` solves it with this search.
    """

    name = "topk-pareto-dp"
    exact = True
    description = "exact Pareto-front dynamic program over prefixes (top-k allgather)"

    def __init__(self, *, prune: bool = True, min_group_bytes: int = 0, max_group_bytes: int | None = None) -> None:
        """Args: prune: branch and bound (exact; off only to test that it is). min_group_bytes, max_group_bytes:
        group-size bounds in dense gradient bytes (None: no upper bound); see the module docstring."""
        self.prune = prune
        self._bounds = _GroupBounds(min_group_bytes, max_group_bytes)

    def __repr__(self) -> str:
        return (f"TopkParetoDP(prune={self.prune}, min_group_bytes={self.min_group_bytes}, "
                f"max_group_bytes={self.max_group_bytes})")

    def solve(self, problem: GradientProblem) -> Grouping:
        return self.solve_with_value(problem)[0]

    def solve_with_value(self, problem: GradientProblem) -> tuple[Grouping, float]:
        _require(problem, Strategy.TOPK, type(self).__name__)
        return _pareto_solve(problem, self._bounds, prune=self.prune)

    def solve_within(self, problem: GradientProblem, deadline: Deadline | None = None) -> Solved:
        """As `solve_with_value`; the search stops at `deadline` with the best grouping found, its gap to the
        root's bound."""
        _require(problem, Strategy.TOPK, type(self).__name__)
        return _pareto_solve_within(problem, self._bounds, prune=self.prune, deadline=deadline)


#: States kept per prefix by the beam search that finds the first upper bound of the Pareto search.
_BEAM = 8
#: The beam runs only when the best heuristic is further than this (relative) from the root's bound.
_BEAM_GAP = 0.01
#: A heuristic within this (relative) of the root's bound is optimal up to rounding: the search is skipped.
_CLOSED_RTOL = 1e-12


def _pareto_solve(problem: GradientProblem, bounds: _GroupBounds, *, prune: bool) -> tuple[Grouping, float]:
    """The exact two-clock search of `TopkParetoDP` (either strategy): best grouping and its iteration time."""
    solved = _pareto_solve_within(problem, bounds, prune=prune)
    return solved.grouping, solved.iteration_s


class _OutOfTime(Exception):
    """The search's deadline passed."""


def _pareto_solve_within(problem: GradientProblem, bounds: _GroupBounds, *, prune: bool,
                         deadline: Deadline | None = None) -> Solved:
    """`_pareto_solve`, stopped at `deadline` (checked once per layer of the beam and of the search): then the best
    grouping known (baselines, Lagrangian groupings, the beam if it finished), not proven, with the root's bound.

    With comm stretch kappa the search runs on `_stretched`'s clocks and reads its ends in real time: final ends
    with `_dense_end` (top-k: `_real_end`), bounds with `_state_bounds`' stretch term, expiry with its limit moved
    to match; groupings found elsewhere are walked on the problem as given."""
    given = problem
    kappa = problem.comm_stretch
    problem = _stretched(problem)
    fixed = problem.forward_s + problem.update_s
    prefix = _prefix_numel(problem)
    lead = np.asarray(problem.backward_s, dtype=float) + _prepare_many(problem, np.asarray(problem.numel))
    lagrangian = _lagrangian_suffixes(problem, prefix, bounds)
    weights, rest, relaxed = lagrangian.weights, lagrangian.rest, lagrangian.groupings
    tables = _ParetoTables(
        prefix=prefix,
        backward=_prefix_backward(problem),
        lead=np.append(lead, 0.0),
        weights=weights,
        rest=rest,
        opened=lagrangian.opened,
        open_lengths=lagrangian.open_lengths,
        volume=_Volumes.of(problem, prefix) if problem.interference or kappa else None,
        bounds=bounds if bounds.active else None,
        stretch=kappa,
    )
    if not prune:
        found = _pareto_search(problem, tables, np.inf)
        if found is None:
            raise bounds.infeasible(problem)
        return Solved(found[0], fixed + found[1], proven=True)

    # Upper bound: the best of the baselines, the Lagrangian groupings and a narrow beam of this search
    # (only groupings the bounds allow).
    groupings = [h.solve(problem) for h in (*BASELINES[problem.strategy], MGWFBPGreedy())] + relaxed
    candidates = [(g, fixed + _iteration_end(given, g)) for g in dict.fromkeys(groupings)
                  if bounds.admits(problem, g)]
    if not candidates:  # no allowed grouping is known: search them all (no answer to stop with)
        found = _pareto_search(problem, tables, np.inf)
        if found is None:
            raise bounds.infeasible(problem)
        return Solved(found[0], fixed + found[1], proven=True)
    # The root's bound (the empty prefix's): a heuristic that reaches it is optimal, and nothing is searched.
    zero = np.zeros(1)
    root = float(_state_bounds(tables, 0, zero, zero, zero, zero, problem.strategy is Strategy.TOPK,
                               problem.interference, problem.num_layers)[0])
    heuristic, upper = min(candidates, key=lambda gv: gv[1])
    # The bounds' sums may round a few ulps above an optimum they equal: a bound is never above a found step.
    if upper - fixed <= root * (1 + _CLOSED_RTOL):
        return Solved(heuristic, upper, proven=True, lower_bound_s=min(fixed + root, upper))
    try:
        # A narrow beam of this search, within the best heuristic's time, when none is within _BEAM_GAP of the
        # root's bound (the search then prunes almost everything anyway).
        best = upper
        if best - fixed > root * (1 + _BEAM_GAP):
            beamed = _pareto_search(problem, tables, (best - fixed) * (1 + _PRUNE_RTOL), beam=_BEAM, deadline=deadline)
            if beamed is not None:
                candidates.append((beamed[0], fixed + beamed[1]))
        heuristic, upper = min(candidates, key=lambda gv: gv[1])
        found = _pareto_search(problem, tables, (upper - fixed) * (1 + _PRUNE_RTOL), deadline=deadline)
    except _OutOfTime:
        heuristic, upper = min(candidates, key=lambda gv: gv[1])
        return Solved(heuristic, upper, proven=False, lower_bound_s=min(fixed + root, upper))
    if found is not None:  # (None: only rounding can prune every grouping within the best heuristic's time)
        heuristic, upper = found[0], fixed + found[1]
    return Solved(heuristic, upper, proven=True, lower_bound_s=min(fixed + root, upper))


def _best_other_per_block(blocks: np.ndarray, key: np.ndarray, wide: np.ndarray) -> np.ndarray:
    """Mask of the state with the least `key` among the states that are not `wide`, in each block of equal
    `blocks` values (contiguous); the first such state on ties."""
    others = np.flatnonzero(~wide)
    best = np.zeros(wide.size, dtype=bool)
    if others.size == 0:
        return best
    block_of = blocks[others]
    starts = np.flatnonzero(np.concatenate(([True], block_of[1:] != block_of[:-1])))
    least = np.minimum.reduceat(key[others], starts)
    per = np.repeat(np.arange(starts.size), np.diff(np.append(starts, others.size)))
    hits = others[key[others] == least[per]]
    first = np.concatenate(([True], blocks[hits][1:] != blocks[hits][:-1]))
    best[hits[first]] = True
    return best


def _final_end(comp: np.ndarray, chan: np.ndarray, dec: np.ndarray, dsum: np.ndarray, sigma: float) -> np.ndarray:
    """X_G of complete states (seconds from the start of backward; `planner.costmodel.simulator`): C + D when the
    channel is idle by the end of backward, else (sigma E + max(C + (1 + sigma) D, V)) / (1 + sigma), V being
    the decode chain with decodes stretched by 1 + sigma (decoding runs that much slower until E_G, and
    every decode is released by E_G). Non-decreasing in every clock; max(C, E) for dense (D = 0, V = E)."""
    late = (sigma * chan + np.maximum(comp + (1 + sigma) * dsum, dec)) / (1 + sigma)
    return np.where(comp >= chan, comp + dsum, late)


def _pareto_search(
    problem: GradientProblem, tables: _ParetoTables, limit: float, beam: int | None = None,
    deadline: Deadline | None = None,
) -> tuple[Grouping, float] | None:
    """The best grouping whose states all have bounds <= `limit`, and its X_G (`_final_end`); None if none.

    With `beam`, only that many states with the lowest bounds are kept per prefix: a heuristic.

    Raises:
        _OutOfTime: `deadline` passed (checked once per layer).
    """
    num_layers = problem.num_layers
    sigma = problem.interference
    decodes = problem.strategy is Strategy.TOPK  # dense: no decode, V = E and D = 0 are not kept
    prefix, backward, lead = tables.prefix, tables.backward, tables.lead
    bounded = bool(np.isfinite(limit)) or beam is not None

    # All states kept so far, flat, in blocks of equal prefix length, each block sorted by C ascending:
    # clocks C, E and (top-k) V, D, prefix length (= first layer of the next group), parent state, and
    # the first layer at which the state is no longer extended (see the expiry in the class docstring).
    capacity = 4 * num_layers + 16
    comp = np.zeros(capacity)
    chan = np.zeros(capacity)
    dec = np.zeros(capacity)
    dsum = np.zeros(capacity)
    length = np.zeros(capacity, dtype=np.int64)
    parent = np.full(capacity, -1, dtype=np.int64)
    expire = np.full(capacity, num_layers + 1, dtype=np.int64)
    count = 1  # state 0: the empty prefix, clocks (0, 0, 0, 0)
    # States still worth extending: not expired, and for dense, per block, the wide ones for the group to
    # extend them by and the others no other state of the block dominates for every group (the valley).
    active = np.zeros(1, dtype=np.int64)
    for j in range(num_layers):
        if deadline is not None and deadline.passed():
            raise _OutOfTime
        active = active[expire[active] > j]
        # The group extending a state starts at its prefix length: the costs of the groups first..j, per
        # active state (far fewer than j + 1 on real instances).
        first = length[active]
        # Costs once per block (the states of a block share the group), then per state.
        opening = np.concatenate(([True], first[1:] != first[:-1]))
        block_of = np.cumsum(opening) - 1
        starts = first[opening]
        sizes = prefix[j + 1] - prefix[starts]
        prepare = _prepare_many(problem, sizes)
        comm, decode = _comm_and_decode_many(problem, sizes)
        prepare, comm, decode = prepare[block_of], comm[block_of], decode[block_of]
        work = (backward[j + 1] - backward[first]) + prepare  # B + s
        a_comp, a_chan = comp[active], chan[active]
        wide = a_chan - a_comp >= work * (1 + sigma)
        if not decodes and sigma == 0:  # the best other state of a block is the first after its wide ones
            extend = wide | opening  # (an expired first state leaves the next one first)
            extend[1:] |= wide[:-1]
        elif not decodes:
            extend = wide | _best_other_per_block(first, a_comp + sigma * a_chan, wide)
        else:
            extend = np.ones(active.size, dtype=bool)
        active = cand = active[extend]
        work, comm, decode = work[extend], comm[extend], decode[extend]
        if tables.bounds is not None:
            # Only allowed groups extend a state; the others stay active for longer groups.
            allowed = tables.bounds.ending_at(problem, prefix, j)[first[extend]]
            cand, work, comm, decode = cand[allowed], work[allowed], comm[allowed], decode[allowed]
            if cand.size == 0:
                continue
        new_comp = advance_many(comp[cand], chan[cand], work, sigma)
        new_chan = np.maximum(new_comp, chan[cand]) + comm
        new_dec = new_dsum = new_chan  # dense: not kept
        if decodes:
            new_dec = np.maximum(dec[cand], new_chan) + (1 + sigma) * decode
            new_dsum = dsum[cand] + decode

        m = j + 1
        if m < num_layers:  # compute-bound states: canonical (kappa, kappa), see the class docstring
            bound_by_compute = new_chan - new_comp <= lead[m] * (1 + sigma)
            kappa = (new_comp + sigma * new_chan) / (1 + sigma) if sigma else new_comp
            new_comp = np.where(bound_by_compute, kappa, new_comp)
            new_chan = np.where(bound_by_compute, kappa, new_chan)
        kept = np.arange(cand.size)
        if bounded:
            # Pruned first (cheap per state), so that only the survivors are sorted: the bound is
            # non-decreasing in every clock, so a dominated state survives only if its dominator does.
            if beam is None:
                # A few weights first (a weaker bound, cheap), all of them on the survivors.
                kept = np.flatnonzero(_state_bounds(tables, m, new_comp, new_chan, new_dec, new_dsum, decodes,
                                                    sigma, num_layers, _FEW_WEIGHTS) <= limit)
                if kept.size == 0:
                    continue
                kept = kept[_state_bounds(tables, m, new_comp[kept], new_chan[kept], new_dec[kept], new_dsum[kept],
                                          decodes, sigma, num_layers) <= limit]
                if kept.size == 0:
                    continue
            else:
                bound = _state_bounds(tables, m, new_comp, new_chan, new_dec, new_dsum, decodes, sigma, num_layers)
        if decodes:
            front = kept[_pareto_front(new_comp[kept], new_chan[kept], new_dec[kept], new_dsum[kept])]
        else:
            front = kept[_pareto_front_2d(new_comp[kept], new_chan[kept])]
        if beam is not None and front.size > beam:
            chosen = np.zeros(front.size, dtype=bool)
            chosen[np.argpartition(bound[front], beam)[:beam]] = True
            front = front[chosen]  # still by C ascending
        size = front.size
        if size == 0:
            continue
        if count + size > capacity:
            capacity = 2 * (count + size)
            comp, chan = np.resize(comp, capacity), np.resize(chan, capacity)
            dec, dsum = np.resize(dec, capacity), np.resize(dsum, capacity)
            length, parent = np.resize(length, capacity), np.resize(parent, capacity)
            expire = np.resize(expire, capacity)
        block = slice(count, count + size)
        if np.isfinite(limit) and m < num_layers:
            # Retired once the next group would hold that many layers (ends at layer m + length - 1).
            expire[block] = m - 1 + _expiry(tables, m, new_comp[front], new_chan[front],
                                            new_dsum[front] if decodes else 0.0, sigma, limit)
        else:
            expire[block] = num_layers + 1
        comp[block], chan[block] = new_comp[front], new_chan[front]
        if decodes:
            dec[block], dsum[block] = new_dec[front], new_dsum[front]
        length[block], parent[block] = m, cand[front]
        active = np.concatenate((active, np.arange(count, count + size)))
        count += size

    finals = np.flatnonzero(length[:count] == num_layers)
    if finals.size == 0:
        return None
    if decodes:
        ends_at = _real_end(comp[finals], _final_end(comp[finals], chan[finals], dec[finals], dsum[finals], sigma),
                            tables.stretch)
    else:
        ends_at = _dense_end(comp[finals], chan[finals], tables.stretch)
    best = int(np.argmin(ends_at))
    state = int(finals[best])
    ends: list[int] = []
    while state > 0:
        ends.append(int(length[state]))
        state = int(parent[state])
    return tuple(reversed(ends)), float(ends_at[best])


def _least_compute_end(tables: _ParetoTables, m: int, comp: np.ndarray) -> np.ndarray:
    """A bound on C_G below every completion of states of prefix m: C plus the least compute left after it (the
    comm stretch's bounds read the stretched channel against it)."""
    assert tables.volume is not None  # built whenever the problem has a comm stretch
    return comp + tables.volume.compute[m]


def _expiry(tables: _ParetoTables, m: int, comp: np.ndarray, chan: np.ndarray, pending: np.ndarray | float,
            sigma: float, limit: float) -> np.ndarray:
    """For new states of prefix m < L: the least length of the next group from which on no extension can
    end within `limit` (the Lagrangian bound of `_state_bounds` with the first group at least that long,
    `_Lagrangian.opened`; non-decreasing in the length, so the state can be retired for good). A huge
    number where no such length is known. With comm stretch kappa, `_state_bounds`' stretch term exceeds
    the limit exactly where the Lagrangian bound exceeds (1 + kappa) limit - kappa (least C_G)."""
    bound: np.ndarray | float = limit
    if tables.stretch:
        bound = (1 + tables.stretch) * limit - tables.stretch * _least_compute_end(tables, m, comp)
    late = np.maximum(chan, comp + tables.lead[m])
    start_x = (comp + sigma * chan + pending) / (1 + sigma)
    slope = start_x + tables.backward[-1] - tables.backward[m] - late
    # bound(length) = late + max over w of (w * slope + opened[w, m, length]) > limit, for some w
    room = bound - late - tables.weights[:, None] * slope  # (weights, states)
    within = np.sum(tables.opened[:, m, :, None] <= room[:, None, :], axis=1)  # open lengths still within, per w
    lengths = np.append(tables.open_lengths, np.iinfo(np.int64).max // 2)
    return lengths[np.min(within, axis=0)]


#: Rows of the Lagrangian weights that `_pareto_search` tries first (w = 0, 0.5, 1).
_FEW_WEIGHTS = np.array([0, len(_BOUND_WEIGHTS) // 2, len(_BOUND_WEIGHTS) - 1])


def _state_bounds(tables: _ParetoTables, m: int, comp: np.ndarray, chan: np.ndarray, dec: np.ndarray,
                  dsum: np.ndarray, decodes: bool, sigma: float, num_layers: int, rows: np.ndarray | None = None
                  ) -> np.ndarray:
    """No completion of these states of prefix m ends before this (X_G, from the start of backward):
    non-decreasing in every clock. dec and dsum are ignored unless `decodes` (dense: V = E, D = 0). With
    `rows`, only those weights count (a weaker bound).

    With comm stretch kappa, B below bounds X'_G of the stretched problem (dense: max(C_G, E_G)), and
    X_G = (kappa C_G + X'_G) / (1 + kappa) >= max(Q, (kappa Q + B) / (1 + kappa)) for any Q <= C_G (here C
    plus the least compute left; X_G >= C_G as well); exact at m = L."""
    if m == num_layers:
        if decodes:
            return _real_end(comp, _final_end(comp, chan, dec, dsum, sigma), tables.stretch)
        return _dense_end(comp, chan, tables.stretch)
    pending = dsum if decodes else 0.0
    # max over w of w * (start of X + rest of backward) + (1 - w) * max(E, C + lead) + rest[w, m]
    late = np.maximum(chan, comp + tables.lead[m])
    start_x = (comp + sigma * chan + pending) / (1 + sigma)
    rest_backward = tables.backward[-1] - tables.backward[m]
    chosen = slice(None) if rows is None else rows
    weights, rest = tables.weights[chosen], tables.rest[chosen, m]
    bound = late + np.max(weights[:, None] * (start_x + rest_backward - late) + rest[:, None], axis=0)
    if tables.volume is not None:
        bound = np.maximum(bound, tables.volume.bound(m, comp, chan, pending, sigma))
    if decodes:  # X_G >= (sigma E_G + V_G) / (1 + sigma) (`_final_end`)
        bound = np.maximum(bound, (sigma * chan + dec) / (1 + sigma))
    if tables.stretch:
        least = _least_compute_end(tables, m, comp)
        bound = np.maximum(least, (tables.stretch * least + bound) / (1 + tables.stretch))
    return bound


def beaten_by_a_sample(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Which of the pairs (x, y) the Pareto front of every 16th pair dominates (a cheap first cut: the survivors
    hold the whole front of all the pairs, and usually few others)."""
    pivots = np.argsort(x[::16], kind="stable") * 16
    pivot_y = y[pivots]
    pivots = pivots[np.concatenate(([True], pivot_y[1:] < np.minimum.accumulate(pivot_y)[:-1]))]
    px, py = x[pivots], y[pivots]
    at = np.searchsorted(px, x, side="right") - 1
    near = np.maximum(at, 0)
    return np.asarray((at >= 0) & (py[near] <= y) & ((px[near] < x) | (py[near] < y)))


def _pareto_front_2d(comp: np.ndarray, chan: np.ndarray) -> np.ndarray:
    """Indices of the states no other one dominates in (C, E), by C ascending (large sets are first tested
    against the front of a sample of them, so that only the survivors are sorted)."""
    kept = np.arange(comp.size)
    if comp.size > _PREFILTER_MIN_STATES:
        kept = np.flatnonzero(~beaten_by_a_sample(comp, chan))
    # By C ascending, keep the states whose E is below every earlier one. (Ties in C in the wrong order
    # only keep a dominated state, which costs time, not exactness.)
    order = kept[np.argsort(comp[kept], kind="stable")]
    sorted_chan = chan[order]
    return order[np.concatenate(([True], sorted_chan[1:] < np.minimum.accumulate(sorted_chan)[:-1]))]


#: States compared at once by `_pareto_front` (each against every state kept before it).
_FRONT_CHUNK = 64


def _pareto_front(comp: np.ndarray, chan: np.ndarray, dec: np.ndarray, dsum: np.ndarray, *more: np.ndarray
                  ) -> np.ndarray:
    """Indices of the states no other one dominates in (C, E, V, D) and any `more` coordinates (the mixed solver's
    error under a budget), one of equal states, by C ascending.

    In (C, E, V, D, ...) lexicographic order a state's dominators come before it, so a sweep keeps each state
    that no state kept before it dominates (a dominated dominator has a kept one of its own). The states
    on the (C, E) front are kept outright (nothing beats those in both); the others are swept a chunk at a
    time: each against the kept states before the chunk and the earlier states of the chunk."""
    order = np.lexsort((*more[::-1], dsum, dec, chan, comp))
    e, v, d = chan[order], dec[order], dsum[order]
    rest = [x[order] for x in more]
    keep = np.concatenate(([True], e[1:] < np.minimum.accumulate(e)[:-1]))
    doubtful = np.flatnonzero(~keep)

    def no_worse(at: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """(rows, at): whether the state at each of `at` is nowhere above each of `rows` in E, V, D and `more`."""
        out = (e[at] <= e[rows, None]) & (v[at] <= v[rows, None]) & (d[at] <= d[rows, None])
        for x in rest:
            out &= x[at] <= x[rows, None]
        return out

    for lo in range(0, doubtful.size, _FRONT_CHUNK):
        rows = doubtful[lo : lo + _FRONT_CHUNK]
        kept = np.flatnonzero(keep[: rows[0]])
        beaten = np.any(no_worse(kept, rows), axis=1)
        # Within the chunk: every state between the chunk's first and each row (on the (C, E) front or not).
        span = np.arange(rows[0], rows[-1])
        if span.size:
            beaten |= np.any(no_worse(span, rows) & (span < rows[:, None]), axis=1)
        keep[rows] = ~beaten
    return order[keep]


def solve_exact(problem: GradientProblem) -> Grouping:
    """The optimal grouping of `problem` under the timeline model, by the exact solver of its strategy."""
    match problem.strategy:
        case Strategy.DENSE:
            return DenseDP().solve(problem)
        case Strategy.TOPK:
            return TopkParetoDP().solve(problem)
        case other:
            known = [s.value for s in GROUPING_STRATEGIES]
            raise SolverError(f"no exact solver for strategy={other!r}; known: {known}")


# ----------------------------------------------------------------------------------------------------
# Baselines


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


# ----------------------------------------------------------------------------------------------------
# Lower bound


def lower_bound(problem: GradientProblem) -> float:
    """A time no grouping can beat: the larger of the compute path and the communication path.

    Valid for any grouping and any non-decreasing cost models (k(N) and message bytes are non-decreasing
    in N, so every group's costs are at least those of any of its layers), with s the per-group work on the
    compute stream (top-k selection, dense packing, 0 without one) and d the decode (0 for dense); every
    decode runs on the compute stream after backward, the last one after the last collective:

    - compute path: X_G >= C_G + D >= sum b + sum (s(N_g) + d(P k_g)), minimised over groupings; with
      interference sigma the collectives that run while the compute stream works slow it down, and those
      that do not lengthen the end instead: X_G >= sum b + sum (s + (d + sigma T) / (1 + sigma)) as well
      (`_lagrangian_suffixes` derives the weight);
    - communication path, for every layer j: the group holding layer j cannot start its collective before
      layer j is ready and prepared, R_j + s(n_j) (its last layer is ready later, and s grows with size);
      from then on the channel still carries that group and every later one, each at least the cost of
      its part of layers j..L-1, and the last group's decode (at least that of layer L-1) follows:
      X_G >= R_j + s(n_j) + min over groupings of layers j..L-1 of sum T + d(P k(n_{L-1})). The bound
      takes the largest j (j = 0 alone was the bound before: on real instances the later layers, whose
      cheapest tail is sent after the whole backward pass, are the binding ones).

    Each "min over groupings of a sum of per-group costs" is an O(L^2) dynamic program (all tails at once).

    With comm stretch kappa: the bound B above of `_stretched`'s problem bounds its end X'_G, and
    X_G = (kappa C_G + X'_G) / (1 + kappa) >= max(Q, (kappa Q + B) / (1 + kappa)) with Q = sum b + least
    packing or selection, a bound on C_G.
    """
    if problem.strategy not in GROUPING_STRATEGIES:
        known = [s.value for s in GROUPING_STRATEGIES]
        raise SolverError(f"no lower bound for strategy={problem.strategy!r}; known: {known}")
    if problem.comm_stretch:
        kappa, fixed = problem.comm_stretch, problem.forward_s + problem.update_s
        least = float(np.sum(np.asarray(problem.backward_s, dtype=float))) + float(
            _suffix_min_partition(_prefix_numel(problem), lambda n: _prepare_many(problem, n))[0])
        stretched = lower_bound(_stretched(problem)) - fixed
        return fixed + max(least, (kappa * least + stretched) / (1 + kappa))
    prefix = _prefix_numel(problem)
    fixed = problem.forward_s + problem.update_s
    total_backward = float(np.sum(np.asarray(problem.backward_s, dtype=float)))
    sigma = problem.interference
    compute = _suffix_min_partition(prefix, lambda n: _prepare_many(problem, n) + _decode_many(problem, n))[0]
    if sigma > 0:
        compute = max(compute, _suffix_min_partition(
            prefix, lambda n: _prepare_many(problem, n) + (_decode_many(problem, n) + sigma * _comm_many(problem, n))
            / (1 + sigma))[0])
    tails = _suffix_min_partition(prefix, lambda n: _comm_many(problem, n))
    ready = np.cumsum(np.asarray(problem.backward_s, dtype=float))  # R_j
    starts = ready + _prepare_many(problem, np.asarray(problem.numel))
    last_decode = float(_decode_many(problem, np.asarray(problem.numel[-1:]))[0])
    comm = float(np.max(starts + tails[:-1])) + last_decode
    return fixed + max(total_backward + float(compute), comm)
