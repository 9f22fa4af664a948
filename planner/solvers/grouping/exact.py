"""The exact grouping solvers, dynamic programs over prefixes of the ready order: `DenseDP` (dense allreduce) and
`TopkParetoDP` (top-k allgather), and `solve_exact`, the exact solver of a problem's strategy. Where a problem has
more than one clock (top-k; dense with packing or interference) both run the Pareto-front search of
`planner.solvers.grouping.pareto`."""

from __future__ import annotations

import numpy as np

from planner.costmodel.problem import GradientProblem, Grouping, unstretched
from planner.solvers.deadline import Deadline
from planner.solvers.grouping.base import (
    Solved,
    _BoundedSolver,
    _comm_many,
    _ends_from_back_pointers,
    _GroupBounds,
    _prefix_numel,
    _require,
    _stretched,
)
from planner.solvers.grouping.pareto import _pareto_solve, _pareto_solve_within
from planner.types import GROUPING_STRATEGIES, SolverError, Strategy

__all__ = ["DenseDP", "TopkParetoDP", "solve_exact"]


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
        bound); see `planner.solvers.grouping.base` for the exact rule."""
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

    With group-size bounds (rule in `planner.solvers.grouping.base`) a state is extended only by allowed groups. Every
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
        group-size bounds in dense gradient bytes (None: no upper bound); see `planner.solvers.grouping.base`."""
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
