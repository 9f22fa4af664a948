"""Lower bounds of the grouping problem: `lower_bound`, below every grouping, and the bounds of what is left after
a prefix that the Pareto search (`planner.solvers.grouping.pareto`) prunes with: `_lagrangian_suffixes` and
`_Volumes`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.costmodel.costs import CostModel
from planner.costmodel.problem import INDEX_BYTES, GradientProblem, Grouping, advance_many
from planner.solvers.grouping.base import (
    _comm_and_decode_many,
    _comm_many,
    _decode_many,
    _GroupBounds,
    _prefix_backward,
    _prefix_numel,
    _prepare_many,
    _stretched,
    _suffix_min_partition,
)
from planner.types import GROUPING_STRATEGIES, SolverError, Strategy

__all__ = ["lower_bound"]


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
