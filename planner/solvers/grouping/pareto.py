"""The Pareto-front search over prefixes of the ready order that `TopkParetoDP` runs, and `DenseDP` where the
dense problem has two clocks (packing or interference): its state, transitions and exact reductions are in
`TopkParetoDP`'s docstring (`planner.solvers.grouping.exact`). `planner.solvers.compressor_choice` extends its
fronts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.costmodel.problem import GradientProblem, Grouping, advance_many
from planner.solvers.deadline import Deadline
from planner.solvers.grouping.base import (
    Solved,
    _comm_and_decode_many,
    _dense_end,
    _GroupBounds,
    _iteration_end,
    _prefix_backward,
    _prefix_numel,
    _prepare_many,
    _real_end,
    _stretched,
)
from planner.solvers.grouping.baselines import BASELINES, MGWFBPGreedy
from planner.solvers.grouping.bounds import _BOUND_WEIGHTS, _lagrangian_suffixes, _Volumes
from planner.types import Strategy

__all__ = ["beaten_by_a_sample"]


# Relative slack of the exact pruning in TopkParetoDP: rounding must never prune an optimal state.
_PRUNE_RTOL = 1e-9
# TopkParetoDP pre-filters the states of a prefix against a sample's Pareto front above this many states.
_PREFILTER_MIN_STATES = 256


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
    # the first layer at which the state is no longer extended (see the expiry in `TopkParetoDP`'s docstring).
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
        if m < num_layers:  # compute-bound states: canonical (kappa, kappa), see `TopkParetoDP`'s docstring
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
