"""K-FAC inversion placement: which worker inverts each Kronecker factor (SPD-KFAC's load-balanced placement).

Every factor f is either inverted by ALL workers (no communication, every worker pays c_f) or by ONE owner
rank, which then broadcasts the result on the single shared channel (b_f; broadcasts are serialised). The
step runs as the runtime (`planner.runtime.preconditioner`) runs it, factors in their order f = 0, 1, ...:

- each worker first inverts the factors it owns, in order, and posts each one's broadcast as soon as it is
  inverted; then it inverts the "all" factors (Y = the sum of their c);
- broadcast f starts when its owner has inverted it and the channel is free:
  E_f = max(E_{f'}, S_{w}(f)) + b_f, with f' the previous owned factor and S_w(f) the owner's c summed over
  its factors up to f;
- the step ends when every worker has inverted everything and the last broadcast has arrived:

    makespan = max(max over workers w of (owned load of w) + Y, E_last).

Broadcasts thus overlap later inversions. A `Placement` holds each factor's owner rank, or None for "every
worker". Workers are identical, so a placement is only defined up to a permutation of ranks; solvers answer
in the canonical labelling of `canonical_placement` (ranks used from 0 upward, rank 0 owning the costliest
owned factor).

Exact solvers (`IlpPlacement` with CBC, `CpSatPlacement` with CP-SAT) share one model: binaries x[f, w]
(f on owner w) and y[f] (f everywhere), sum_w x[f, w] + y[f] = 1; T >= Y + sum_f c_f x[f, w] for every w and
T >= Y + c_f (1 - y[f]) (a valid cut); the channel E_f >= E_{f-1} + b_f (1 - y[f]) and, when x[f, w],
E_f >= sum_{g <= f} c_g x[g, w] + b_f (a big-M constraint in CBC, an enforced one in CP-SAT); T >= E_last;
minimise T. Only min(P, n) worker columns exist, and with factors sorted by c descending the i-th may only use
workers 0..i (relabel workers in the order of the first factor they own: any placement has such a twin, with
the same loads and the same broadcast times). Before the model, a start (`_start`): the best of the baselines
and of largest-first packings of promising owned sets, improved by a local search on the sequential bound
max load + Y + broadcasts (which is never below the makespan). The model is warm-started from it, and the
answer is the better of the model's incumbent and the start, so it is never worse than any baseline; when the
start meets `placement_lower_bound` the model is skipped.

Factors are not aggregated into classes of equal (c, b): measured times are rarely equal, and the broadcast
order tells equal factors apart anyway. Above `max_binaries` binaries (default 60k) the model is not built and
the start is returned with its gap to the lower bound.
"""

from __future__ import annotations

import abc
import heapq
import math
import os
import re
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from planner.types import SolverError

# pulp and ortools are imported by the methods that solve, not here: `planner` starting, a command's workers and a
# training job never load them (tests/test_packaging.py).

__all__ = [
    "PLACEMENT_BASELINES",
    "PLACEMENT_SOLVERS",
    "CpSatPlacement",
    "Everywhere",
    "IlpPlacement",
    "InversionTimeline",
    "KfacPytorchRule",
    "LargestFirst",
    "Placement",
    "PlacementProblem",
    "PlacementResult",
    "PlacementSolver",
    "SpdKfacRule",
    "canonical_placement",
    "inversion_timeline",
    "largest_first",
    "makespan",
    "placement_lower_bound",
]

#: Owner rank of each factor; None = every worker inverts it.
Placement = tuple[int | None, ...]

#: A makespan within this relative distance of a lower bound is reported as proven optimal.
_OPTIMAL_RTOL = 1e-9
#: The ILP's times are scaled so that the lower bound (the least objective CBC can meet) is this many units.
_CBC_UNITS = 1000.0
#: Half a unit of the last of the 8 decimals of CBC's "Objective value:" (in model units).
_CBC_OBJECTIVE_ROUNDING = 5e-9
#: Weights (lam and mu) of the lower bound's relaxations max(a, b) >= lam a + (1 - lam) b.
_BOUND_WEIGHTS = np.linspace(0.0, 1.0, 17)
#: Seconds the start's search on the makespan itself may take, and how many least-loaded workers it tries a
#: factor on.
_OVERLAP_SEARCH_S = 0.25
_OVERLAP_WORKERS = 4
#: Local search runs from this many of the best start candidates.
_LOCAL_SEARCH_STARTS = 3


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


@dataclass(frozen=True, kw_only=True)
class PlacementProblem:
    """The factors of one K-FAC inversion step and the number of workers.

    Attributes:
        inv_s: c_f, seconds to invert (or eigendecompose) factor f on one worker.
        bcast_s: b_f, seconds to broadcast factor f's result from its owner on the shared channel.
        dims: d_f, the factor's dimension (kfac-pytorch's largest-first rule balances d^3).
        world_size: P, number of workers.
        names: optional factor names ("<layer>.A"), empty or one per factor.
    """

    inv_s: tuple[float, ...]
    bcast_s: tuple[float, ...]
    dims: tuple[int, ...]
    world_size: int
    names: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "inv_s", tuple(float(v) for v in self.inv_s))
        object.__setattr__(self, "bcast_s", tuple(float(v) for v in self.bcast_s))
        if not all(_is_int(d) for d in self.dims):
            raise SolverError(f"`dims` must hold integers, but got dims={self.dims!r}")
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))
        object.__setattr__(self, "names", tuple(self.names))
        n = len(self.inv_s)
        if n == 0:
            raise SolverError("the placement problem has no factors")
        if len(self.bcast_s) != n or len(self.dims) != n:
            raise SolverError(
                f"`len(inv_s) == len(bcast_s) == len(dims)` must hold, but got "
                f"({n}, {len(self.bcast_s)}, {len(self.dims)})"
            )
        if self.names and len(self.names) != n:
            raise SolverError(f"`len(names) in (0, len(inv_s))` must hold, but got ({len(self.names)}, {n})")
        if not _is_int(self.world_size) or self.world_size < 1:
            raise SolverError(f"`world_size >= 1` must hold, but got world_size={self.world_size!r}")
        for label, values in (("inv_s", self.inv_s), ("bcast_s", self.bcast_s)):
            for f, v in enumerate(values):
                if not (math.isfinite(v) and v >= 0):
                    raise SolverError(f"`0 <= {label}[{f}] < inf` must hold, but got {label}[{f}]={v}")
        for f, d in enumerate(self.dims):
            if d < 1:
                raise SolverError(f"`dims[{f}] >= 1` must hold, but got dims[{f}]={d}")

    @property
    def num_factors(self) -> int:
        return len(self.inv_s)

    def name(self, factor: int) -> str:
        """The factor's name, or "factor <f>" when the problem has none."""
        return self.names[factor] if self.names else f"factor {factor}"


def _check_placement(problem: PlacementProblem, placement: Sequence[int | None]) -> None:
    if len(placement) != problem.num_factors:
        raise SolverError(
            f"`len(placement) == num_factors` must hold, but got ({len(placement)}, {problem.num_factors})"
        )
    for f, owner in enumerate(placement):
        if owner is None:
            continue
        if not _is_int(owner) or not 0 <= owner < problem.world_size:
            raise SolverError(
                f"`placement[{f}] is None or 0 <= placement[{f}] < world_size` must hold, but got "
                f"(placement[{f}]={owner!r}, world_size={problem.world_size}) for {problem.name(f)}"
            )


@dataclass(frozen=True)
class InversionTimeline:
    """When each part of an inversion step ends under the model of the module docstring.

    Attributes:
        owned_load_s: per worker, the seconds of the factors it owns.
        everywhere_s: Y, the seconds of the factors every worker inverts (after its own).
        broadcasts: (factor, start, end) of each owned factor's broadcast, in factor order.
    """

    owned_load_s: tuple[float, ...]
    everywhere_s: float
    broadcasts: tuple[tuple[int, float, float], ...]

    @property
    def compute_end_s(self) -> float:
        """When the busiest worker has inverted its own factors and the "all" ones."""
        return max(self.owned_load_s, default=0.0) + self.everywhere_s

    @property
    def channel_end_s(self) -> float:
        """When the last broadcast has arrived (0 when nothing is broadcast)."""
        return self.broadcasts[-1][2] if self.broadcasts else 0.0

    @property
    def makespan_s(self) -> float:
        return max(self.compute_end_s, self.channel_end_s)


def inversion_timeline(problem: PlacementProblem, placement: Sequence[int | None]) -> InversionTimeline:
    """The inversion step of `placement` as the runtime runs it (see the module docstring)."""
    _check_placement(problem, placement)
    loads = [0.0] * problem.world_size
    everywhere = channel = 0.0
    broadcasts: list[tuple[int, float, float]] = []
    for f, owner in enumerate(placement):
        if owner is None:
            everywhere += problem.inv_s[f]
            continue
        loads[owner] += problem.inv_s[f]
        start = max(channel, loads[owner])
        channel = start + problem.bcast_s[f]
        broadcasts.append((f, start, channel))
    return InversionTimeline(owned_load_s=tuple(loads), everywhere_s=everywhere, broadcasts=tuple(broadcasts))


def makespan(problem: PlacementProblem, placement: Sequence[int | None]) -> float:
    """Seconds of the inversion step: every worker's inversions and every broadcast done, overlapped as they run."""
    return inversion_timeline(problem, placement).makespan_s


def _sequential_bound(problem: PlacementProblem, placement: Sequence[int | None]) -> float:
    """Max owned load + everywhere + every broadcast, as if no broadcast overlapped anything: >= the makespan."""
    timeline = inversion_timeline(problem, placement)
    return timeline.compute_end_s + sum(problem.bcast_s[f] for f, _, _ in timeline.broadcasts)


def _sorted_order(problem: PlacementProblem) -> np.ndarray:
    """Factor indices by c descending (ties: lower index first): the order of canonical labels and of the model."""
    return np.argsort(-np.asarray(problem.inv_s), kind="stable")


def canonical_placement(problem: PlacementProblem, placement: Sequence[int | None]) -> Placement:
    """The same placement with ranks relabelled 0, 1, ... in order of first use, visiting factors by c descending.

    Rank 0 thus owns the costliest owned factor, and the i-th costliest factor uses a rank <= i.
    """
    _check_placement(problem, placement)
    relabel: dict[int, int] = {}
    for f in _sorted_order(problem):
        owner = placement[int(f)]
        if owner is not None and owner not in relabel:
            relabel[owner] = len(relabel)
    return tuple(None if owner is None else relabel[owner] for owner in placement)


def _unbounded_owned(problem: PlacementProblem) -> list[int]:
    """The factors owned by the best placement with unlimited workers under the sequential bound.

    That placement enumerates the costliest owned factor k in c-descending order: costlier factors go
    everywhere, k is owned, every cheaper factor takes min(c_f, b_f) (owned only when b_f < c_f); option "none
    owned" costs sum c. Its owned set, packed on P workers, is one of the start's candidates.
    """
    order = _sorted_order(problem)
    c = np.asarray(problem.inv_s)[order]
    b = np.asarray(problem.bcast_s)[order]
    n = len(c)
    before = np.concatenate(([0.0], np.cumsum(c)))[:n]  # sum of c over the costlier factors
    cheap = np.minimum(c, b)
    after = np.concatenate((np.cumsum(cheap[::-1])[::-1][1:], [0.0]))  # sum of min(c, b) over the cheaper ones
    values = before + c + b + after
    if float(np.sum(c)) <= float(np.min(values)):
        return []
    k = int(np.argmin(values))
    return [int(order[i]) for i in range(k, n) if i == k or b[i] < c[i]]


def placement_lower_bound(problem: PlacementProblem) -> float:
    """A time no placement of `problem` can beat.

    Let O be the owned factors, Y the sum of c over the others, B the sum of b over O, and k the costliest owned
    factor (factors sorted by c descending). The busiest worker ends at least at Y + max(c_k, (owned c) / P),
    and the channel at least at B. So for any lam and mu in [0, 1] the makespan is at least
    lam (Y + mu c_k + (1 - mu) (owned c) / P) + (1 - lam) B, which splits over factors: every costlier factor
    pays lam c_f (everywhere), k pays lam (mu + (1 - mu) / P) c_k + (1 - lam) b_k, and every cheaper one the
    less of lam c_f (everywhere) and lam (1 - mu) c_f / P + (1 - lam) b_f (owned). The bound is the minimum
    over k (and over "none owned": sum c) of the maximum over a grid of (lam, mu). With one worker it is sum c.
    """
    order = _sorted_order(problem)
    c = np.asarray(problem.inv_s)[order]
    b = np.asarray(problem.bcast_s)[order]
    world = problem.world_size
    lam = np.repeat(_BOUND_WEIGHTS, len(_BOUND_WEIGHTS))[:, None]
    mu = np.tile(_BOUND_WEIGHTS, len(_BOUND_WEIGHTS))[:, None]
    before = lam * np.concatenate(([0.0], np.cumsum(c)))[:-1]  # (weights, n)
    own_k = lam * (mu + (1 - mu) / world) * c + (1 - lam) * b
    cheap = np.minimum(lam * c, lam * (1 - mu) * c / world + (1 - lam) * b)
    after = np.cumsum(cheap[:, ::-1], axis=1)[:, ::-1]
    after = np.concatenate((after[:, 1:], np.zeros((len(lam), 1))), axis=1)
    per_k = before + own_k + after  # (weights, k)
    return float(min(np.sum(c), np.min(np.max(per_k, axis=0))))


@dataclass(frozen=True, kw_only=True)
class PlacementResult:
    """A solver's placement, its makespan and how far from optimal it is proven to be.

    Attributes:
        placement: owner rank of each factor (None = everywhere), canonically labelled.
        makespan_s: `makespan(problem, placement)`.
        lower_bound_s: best proven lower bound on the optimum (== makespan_s when optimal).
        gap: (makespan_s - lower_bound_s) / makespan_s; 0.0 when proven optimal.
        optimal: whether the placement is proven optimal (within the solver's tolerance).
        solver: the solver's name. seconds: wall time of the solve.
    """

    placement: Placement
    makespan_s: float
    lower_bound_s: float
    gap: float
    optimal: bool
    solver: str
    seconds: float

    def __post_init__(self) -> None:
        if not 0 <= self.lower_bound_s <= self.makespan_s:
            raise SolverError(
                f"`0 <= lower_bound_s <= makespan_s` must hold, but got "
                f"(lower_bound_s={self.lower_bound_s}, makespan_s={self.makespan_s})"
            )
        if not 0 <= self.gap <= 1 or (self.optimal and self.gap != 0):
            raise SolverError(f"`0 <= gap <= 1`, and gap == 0 when optimal, must hold, but got "
                              f"(gap={self.gap}, optimal={self.optimal})")

    @property
    def num_everywhere(self) -> int:
        return sum(owner is None for owner in self.placement)


def _result(
    problem: PlacementProblem,
    placement: Sequence[int | None],
    *,
    solver: str,
    started: float,
    bound: float,
    optimal: bool = False,
) -> PlacementResult:
    """Canonicalise, evaluate and bound a placement; a makespan that meets the bound is proven optimal."""
    canonical = canonical_placement(problem, placement)
    value = makespan(problem, canonical)
    bound = min(max(bound, 0.0), value)
    if optimal or value - bound <= _OPTIMAL_RTOL * value:
        optimal, bound = True, value
    gap = 0.0 if optimal or value <= 0 else (value - bound) / value
    return PlacementResult(
        placement=canonical,
        makespan_s=value,
        lower_bound_s=bound,
        gap=gap,
        optimal=optimal,
        solver=solver,
        seconds=time.perf_counter() - started,
    )


class PlacementSolver(abc.ABC):
    """A way to place the inversions of a `PlacementProblem`; construct once, then `solve` any number of times.

    Attributes:
        name: short identifier used in plans and reports.
        description: one line for reports.
    """

    name: ClassVar[str]
    description: ClassVar[str]

    @abc.abstractmethod
    def solve(self, problem: PlacementProblem) -> PlacementResult:
        """The placement chosen for `problem`, with its makespan, lower bound and gap."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# ----------------------------------------------------------------------------------------------------
# Baselines


def largest_first(weights: Sequence[float] | Sequence[int], factors: Sequence[int], world_size: int) -> dict[int, int]:
    """Assign `factors` by weight descending (stable) to the least-loaded worker (ties: lowest rank)."""
    chosen = sorted(factors, key=lambda f: -weights[f])
    heap: list[tuple[float, int]] = [(0, rank) for rank in range(min(world_size, len(chosen)))]
    owners: dict[int, int] = {}
    for f in chosen:
        load, rank = heapq.heappop(heap)
        owners[f] = rank
        heapq.heappush(heap, (load + weights[f], rank))
    return owners


def _placement_of(num_factors: int, owners: dict[int, int]) -> Placement:
    return tuple(owners.get(f) for f in range(num_factors))


class Everywhere(PlacementSolver):
    """Every worker inverts every factor: no broadcasts, the sum of all inversions on each worker."""

    name = "everywhere"
    description = "every factor inverted on every worker"

    def solve(self, problem: PlacementProblem) -> PlacementResult:
        started = time.perf_counter()
        return _result(problem, (None,) * problem.num_factors, solver=self.name, started=started,
                       bound=placement_lower_bound(problem))


class LargestFirst(PlacementSolver):
    """Factors one by one by d^3 descending, each to the worker with the least d^3 so far; no "all"."""

    name = "largest-first"
    description = "factor by factor, largest d^3 first to the least-loaded worker"

    def solve(self, problem: PlacementProblem) -> PlacementResult:
        started = time.perf_counter()
        cubes = [d**3 for d in problem.dims]
        owners = largest_first(cubes, range(problem.num_factors), problem.world_size)
        return _result(problem, _placement_of(problem.num_factors, owners), solver=self.name, started=started,
                       bound=placement_lower_bound(problem))


def _layer_of(problem: PlacementProblem) -> list[str]:
    """The layer of each factor: its name without the ".A" / ".G" suffix, or the factor itself when unnamed."""
    if not problem.names:
        return [f"factor {f}" for f in range(problem.num_factors)]
    return [re.sub(r"\.[AG]$", "", name) for name in problem.names]


class KfacPytorchRule(PlacementSolver):
    """kfac-pytorch's default assignment (KAISA's greedy, `colocate_factors=True`, `AssignmentStrategy.COMPUTE`):
    layers by the sum of their factors' d^3, descending, each layer's factors all to the worker with the least
    such work so far (the lowest rank on ties); no "all". Layers are read from the factor names ("<layer>.A")."""

    name = "kfac-pytorch"
    description = "layer by layer, A and G together, largest summed d^3 first to the least-loaded worker (kfac-pytorch)"

    def solve(self, problem: PlacementProblem) -> PlacementResult:
        started = time.perf_counter()
        layer_of = _layer_of(problem)
        index = {layer: i for i, layer in enumerate(dict.fromkeys(layer_of))}  # first-seen order
        work = [0] * len(index)
        for layer, d in zip(layer_of, problem.dims, strict=True):
            work[index[layer]] += d**3
        rank_of = largest_first(work, range(len(work)), problem.world_size)
        owners = {f: rank_of[index[layer]] for f, layer in enumerate(layer_of)}
        return _result(problem, _placement_of(problem.num_factors, owners), solver=self.name, started=started,
                       bound=placement_lower_bound(problem))


class SpdKfacRule(PlacementSolver):
    """SPD-KFAC's rule: factors with c_f <= b_f everywhere, the rest largest c first to the least-loaded worker."""

    name = "spd-kfac"
    description = "replicate when inverting is no slower than broadcasting, else largest-first by time (SPD-KFAC)"

    def solve(self, problem: PlacementProblem) -> PlacementResult:
        started = time.perf_counter()
        owned = [f for f in range(problem.num_factors) if problem.inv_s[f] > problem.bcast_s[f]]
        owners = largest_first(problem.inv_s, owned, problem.world_size)
        return _result(problem, _placement_of(problem.num_factors, owners), solver=self.name, started=started,
                       bound=placement_lower_bound(problem))


#: The baselines each placement is compared with.
PLACEMENT_BASELINES: tuple[type[PlacementSolver], ...] = (KfacPytorchRule, LargestFirst, SpdKfacRule, Everywhere)


# ----------------------------------------------------------------------------------------------------
# Local search (the start of the exact solvers)


def _local_search(problem: PlacementProblem, placement: Placement, max_moves: int) -> Placement:
    """Best-improvement local search from a canonical placement; every accepted move lowers the sequential bound
    (max owned load + everywhere + broadcasts, see `_sequential_bound`), which is quick to update per move and
    never below the makespan; the caller keeps the result only if its makespan is better.

    Moves: an owned factor goes everywhere; a factor done everywhere gets owned by the least-loaded worker;
    a factor of the busiest worker moves to the least-loaded one, swaps with a factor of another worker,
    or swaps with a factor done everywhere (which the busiest worker then owns).
    """
    c = np.asarray(problem.inv_s)
    b = np.asarray(problem.bcast_s)
    n = len(c)
    workers = min(problem.world_size, n)
    owner = np.array([-1 if w is None else w for w in placement], dtype=np.int64)
    for _ in range(max_moves):
        owned = owner >= 0
        loads = np.bincount(owner[owned], weights=c[owned], minlength=workers)
        value = float(loads.max()) + float(c[~owned].sum()) + float(b[owned].sum())
        by_load = np.argsort(-loads, kind="stable")
        top = int(by_load[0])
        padded = np.concatenate((loads[by_load], [0.0, 0.0]))
        l1, l2, l3 = float(padded[0]), float(padded[1]), float(padded[2])
        low = int(by_load[-1])
        lmin = float(loads[low])
        moves: list[tuple[float, str, int, int]] = []  # (change of makespan, kind, factor, other)

        mine = np.flatnonzero(owned)
        if mine.size:  # owned -> everywhere
            rest = np.where(owner[mine] == top, l2, l1)
            delta = c[mine] - b[mine] + np.maximum(rest, loads[owner[mine]] - c[mine]) - l1
            i = int(np.argmin(delta))
            moves.append((float(delta[i]), "all", int(mine[i]), -1))
        shared = np.flatnonzero(~owned)
        if shared.size:  # everywhere -> least-loaded worker
            delta = b[shared] - c[shared] + np.maximum(l1, lmin + c[shared]) - l1
            i = int(np.argmin(delta))
            moves.append((float(delta[i]), "own", int(shared[i]), low))
        busy = np.flatnonzero(owner == top)
        if workers > 1 and busy.size and low != top:  # busiest -> least loaded
            delta = np.maximum(np.maximum(l2, l1 - c[busy]), lmin + c[busy]) - l1
            i = int(np.argmin(delta))
            moves.append((float(delta[i]), "move", int(busy[i]), low))
        others = np.flatnonzero(owned & (owner != top))
        if busy.size and others.size:  # swap with a factor of another worker
            v = owner[others]
            rest = np.where(v == by_load[1], l3, l2)
            swing = c[busy][:, None] - c[others][None, :]
            delta = np.maximum(rest, np.maximum(l1 - swing, loads[v] + swing)) - l1
            i, j = (int(k) for k in np.unravel_index(int(np.argmin(delta)), delta.shape))
            moves.append((float(delta[i, j]), "swap", int(busy[i]), int(others[j])))
        if busy.size and shared.size:  # the busiest worker's factor goes everywhere, a shared one comes instead
            swing = c[busy][:, None] - c[shared][None, :]
            delta = (c[busy] - b[busy])[:, None] + (b[shared] - c[shared])[None, :] + np.maximum(l2, l1 - swing) - l1
            i, j = (int(k) for k in np.unravel_index(int(np.argmin(delta)), delta.shape))
            moves.append((float(delta[i, j]), "trade", int(busy[i]), int(shared[j])))

        if not moves:
            break
        step, kind, f, g = min(moves, key=lambda m: m[0])
        if step >= -1e-12 * max(value, 1e-300):
            break
        if kind == "all":
            owner[f] = -1
        elif kind in ("own", "move"):
            owner[f] = g
        elif kind == "swap":
            owner[f], owner[g] = owner[g], owner[f]
        else:  # trade
            owner[f], owner[g] = -1, owner[f]
    return canonical_placement(problem, [None if w < 0 else int(w) for w in owner])


def _start(problem: PlacementProblem) -> Placement:
    """A good placement to start the models from, never worse than any baseline.

    Candidates: the baselines; and largest-first packings of owned sets: the unbounded optimum's of the sequential
    bound, those the lower bound's relaxation picks for each lam (b_f + (1 - lam) c_f / P < c_f), and those with
    b_f < t c_f for a few t (everything owned included: broadcasts overlap later inversions). The best few by
    makespan are improved by local search.
    """
    c, b = np.asarray(problem.inv_s), np.asarray(problem.bcast_s)
    n, world = problem.num_factors, problem.world_size
    candidates = [solver().solve(problem).placement for solver in PLACEMENT_BASELINES]
    owned_sets: list[list[int]] = [_unbounded_owned(problem), list(range(n))]
    owned_sets += [[int(f) for f in np.flatnonzero(b + (1 - lam) * c / world < c)] for lam in _BOUND_WEIGHTS[::2]]
    owned_sets += [[int(f) for f in np.flatnonzero(b < t * c)] for t in (0.5, 2.0, 4.0)]
    for owned in owned_sets:
        packed = _placement_of(n, largest_first(problem.inv_s, [int(f) for f in owned], world))
        candidates.append(canonical_placement(problem, packed))
    ranked = sorted(dict.fromkeys(candidates), key=lambda p: makespan(problem, p))
    improved = [_local_search(problem, p, 20 * n + 100) for p in ranked[:_LOCAL_SEARCH_STARTS]]
    best = min([ranked[0], *improved], key=lambda p: makespan(problem, p))
    return _overlap_search(problem, best, time.perf_counter() + _OVERLAP_SEARCH_S)


def _overlap_search(problem: PlacementProblem, placement: Placement, deadline: float) -> Placement:
    """First-improvement local search on the makespan itself (broadcasts overlapping), until no move helps or
    `deadline` (a `time.perf_counter()` value) passes.

    `_local_search` cannot see that a broadcast hides behind later inversions; this pass can. Moves: a factor
    goes everywhere, or to one of the few least-loaded workers (or an empty one). Each move is evaluated by
    walking the whole step (O(n)), so the pass is quadratic and bounded by the deadline.
    """
    c, b = problem.inv_s, problem.bcast_s
    n, world = problem.num_factors, problem.world_size
    owner = [-1 if w is None else w for w in placement]

    def value(owners: list[int]) -> float:
        loads = [0.0] * world
        everywhere = channel = 0.0
        for f, w in enumerate(owners):
            if w < 0:
                everywhere += c[f]
            else:
                loads[w] += c[f]
                channel = max(channel, loads[w]) + b[f]
        return max(max(loads) + everywhere, channel)

    current = value(owner)
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for f in range(n):
            loads = [0.0] * world
            for g, w in enumerate(owner):
                if w >= 0 and g != f:
                    loads[w] += c[g]
            options = [-1, *heapq.nsmallest(_OVERLAP_WORKERS, range(world), key=loads.__getitem__)]
            keep = owner[f]
            for w in options:
                if w == keep:
                    continue
                owner[f] = w
                v = value(owner)
                if v < current * (1 - 1e-12):
                    current, keep, improved = v, w, True
            owner[f] = keep
            if time.perf_counter() >= deadline:
                break
    return canonical_placement(problem, [None if w < 0 else w for w in owner])


# ----------------------------------------------------------------------------------------------------
# Exact solvers


@dataclass(frozen=True)
class _Columns:
    """The model's variables: factor `order[i]` may be owned by workers 0..width[i] - 1."""

    order: np.ndarray
    width: np.ndarray

    @classmethod
    def of(cls, problem: PlacementProblem) -> _Columns:
        workers = min(problem.world_size, problem.num_factors)
        order = _sorted_order(problem)
        width = np.minimum(np.arange(1, problem.num_factors + 1), workers)
        return cls(order=order, width=width)

    @property
    def workers(self) -> int:
        return int(self.width[-1])

    @property
    def binaries(self) -> int:
        return int(np.sum(self.width)) + len(self.order)


@dataclass(frozen=True)
class _Outcome:
    """What a model returned: its incumbent (None if none), a lower bound (seconds) and whether it is proven."""

    placement: Placement | None
    bound: float
    optimal: bool


class _ModelPlacement(PlacementSolver):
    """Shared flow of the exact solvers: start, shortcut, model, and the better of model and start."""

    def __init__(self, *, time_limit_s: float = 1.5, max_binaries: int = 60_000, shortcuts: bool = True) -> None:
        """Args: time_limit_s: wall budget of a solve (approximate); max_binaries: larger models are not built;
        shortcuts: skip the model when the start meets the lower bound (off for tests).
        """
        if not time_limit_s > 0 or max_binaries < 1:
            raise SolverError(
                f"`time_limit_s > 0 and max_binaries >= 1` must hold, but got "
                f"(time_limit_s={time_limit_s}, max_binaries={max_binaries})"
            )
        self.time_limit_s = time_limit_s
        self.max_binaries = max_binaries
        self.shortcuts = shortcuts

    def solve(self, problem: PlacementProblem) -> PlacementResult:
        started = time.perf_counter()
        bound = placement_lower_bound(problem)
        start = _start(problem)
        start_value = makespan(problem, start)
        columns = _Columns.of(problem)
        if (self.shortcuts and start_value - bound <= _OPTIMAL_RTOL * start_value) or (
            columns.binaries > self.max_binaries
        ):
            return _result(problem, start, solver=self.name, started=started, bound=bound)
        outcome = self._solve_model(problem, columns, start, started + self.time_limit_s)
        best = start
        if outcome.placement is not None and makespan(problem, outcome.placement) < start_value:
            best = outcome.placement
        return _result(problem, best, solver=self.name, started=started, bound=max(bound, outcome.bound),
                       optimal=outcome.optimal)

    @abc.abstractmethod
    def _solve_model(self, problem: PlacementProblem, columns: _Columns, start: Placement, deadline: float) -> _Outcome:
        """Solve the model warm-started from `start` (canonical, so it satisfies the symmetry breaking) and stop
        at `deadline` (a `time.perf_counter()` value)."""


#: CP-SAT solvers budget deterministic time (reproducible); their wall limit is this many times the budget.
WALL_BACKSTOP = 10.0


def _remaining(deadline: float) -> float:
    """Seconds left before `deadline`, at least 0.05 (a solver always gets a moment to read its start)."""
    return max(0.05, deadline - time.perf_counter())


def _decode(problem: PlacementProblem, columns: _Columns, everywhere: Sequence[float],
            owned: Sequence[Sequence[float]]) -> Placement:
    """A placement from (rounded) variable values, indexed by position in `columns.order`."""
    placement: list[int | None] = [None] * problem.num_factors
    for i, f in enumerate(columns.order):
        if everywhere[i] < 0.5:
            placement[int(f)] = int(np.argmax(owned[i]))
    return tuple(placement)


class IlpPlacement(_ModelPlacement):
    """Exact placement by an integer program solved with CBC through pulp (see the module docstring).

    CBC is warm-started from the start; its best bound is read from its log when it stops at the time limit.
    If CBC fails or finds nothing, the start is returned with its gap to the best known bound. Times are scaled
    so that the lower bound is `_CBC_UNITS` units (CBC's tolerances are absolute), and when CBC says optimal its
    objective is the bound: the answer is optimal only if its makespan is within `_OPTIMAL_RTOL` of it.
    """

    name = "ilp-cbc"
    description = "integer program (pulp + CBC), warm-started from the best baseline improved by local search"

    def __init__(self, *, time_limit_s: float = 1.5, max_binaries: int = 8_000, shortcuts: bool = True) -> None:
        """Args: as `_ModelPlacement`, with a smaller `max_binaries`: the channel adds as many continuous variables
        and rows again, and CBC's preprocessing does not watch the clock (400 factors on 64 workers, 24k
        binaries, took 11.8 s under a 2 s limit).
        """
        super().__init__(time_limit_s=time_limit_s, max_binaries=max_binaries, shortcuts=shortcuts)

    def _solve_model(self, problem: PlacementProblem, columns: _Columns, start: Placement, deadline: float) -> _Outcome:
        import pulp  # deferred: a command's workers load no pulp

        # CBC's tolerances are absolute (a row may be violated by 1e-7): in seconds, against makespans of hundredths
        # of a second, an incumbent whose end undercut its last broadcast by 7e-9 s passed as feasible, and its
        # value pruned the true optimum. In units where the lower bound is _CBC_UNITS, every objective is at least
        # that, and those tolerances are at most 1e-10 of it.
        start_value = makespan(problem, start)
        reference = placement_lower_bound(problem) or start_value
        scale = _CBC_UNITS / reference if reference > 0 else 1.0
        inv = [scale * v for v in problem.inv_s]  # in factor order
        send = [scale * v for v in problem.bcast_s]
        c = [inv[int(f)] for f in columns.order]
        width = [int(w) for w in columns.width]
        n, workers = len(c), columns.workers
        model = pulp.LpProblem("placement", pulp.LpMinimize)
        # PuLP >= 3.3 creates variables through the model (LpVariable(...) is deprecated there).
        variable = getattr(model, "add_variable", pulp.LpVariable)
        y = [variable(f"y{i}", 0, 1, pulp.LpBinary) for i in range(n)]
        x = [[variable(f"x{i}_{w}", 0, 1, pulp.LpBinary) for w in range(width[i])] for i in range(n)]
        end = variable("end", 0, None, pulp.LpContinuous)
        channel = [variable(f"e{f}", 0, None, pulp.LpContinuous) for f in range(n)]  # in factor (broadcast) order
        model += pulp.LpAffineExpression([(end, 1.0)])
        everywhere = [(y[i], c[i]) for i in range(n) if c[i] > 0]
        for i in range(n):
            model += pulp.LpAffineExpression([*((v, 1.0) for v in x[i]), (y[i], 1.0)]) == 1, f"one{i}"
            if c[i] > 0:  # end >= Y + c_i (1 - y_i) = c_i + sum over j != i of c_j y_j
                others = [(y[j], -c[j]) for j in range(n) if j != i and c[j] > 0]
                model += pulp.LpAffineExpression([(end, 1.0), *others]) >= c[i], f"cut{i}"
        for w in range(workers):
            terms = [(x[i][w], c[i]) for i in range(n) if w < width[i] and c[i] > 0]
            model += pulp.LpAffineExpression([*terms, *everywhere, (end, -1.0)]) <= 0, f"load{w}"
        position = np.argsort(columns.order)  # column of each factor
        # loads[w]: worker w's owned load over the factors so far (in factor order), one variable per step
        loads: list[Any] = [None] * workers
        load_vars: list[tuple[Any, int, int]] = []
        prefix = 0.0
        for f in range(n):
            i, bf = int(position[f]), send[f]
            prefix += inv[f]
            after = [(channel[f], 1.0), (y[i], bf)] + ([(channel[f - 1], -1.0)] if f else [])
            model += pulp.LpAffineExpression(after) >= bf, f"after{f}"  # e_f >= e_{f-1} + b_f (1 - y_f)
            big = prefix + bf  # when f is not on w the owner constraint must not bind: M >= any load + b_f
            for w in range(width[i]):
                if inv[f] > 0:  # the load grows by c_f x[f, w]
                    grown = variable(f"s{f}_{w}", 0, None, pulp.LpContinuous)
                    terms = [(grown, 1.0), (x[i][w], -inv[f])]
                    model += pulp.LpAffineExpression(terms + ([(loads[w], -1.0)] if loads[w] is not None else [])) \
                        == 0, f"load{f}_{w}"
                    loads[w] = grown
                    load_vars.append((grown, f, w))
                # e_f >= load_w + b_f - M (1 - x[f, w])
                owner = [(channel[f], 1.0), (x[i][w], -big)] + ([(loads[w], -1.0)] if loads[w] is not None else [])
                model += pulp.LpAffineExpression(owner) >= bf - big, f"owner{f}_{w}"
        model += pulp.LpAffineExpression([(end, 1.0), (channel[n - 1], -1.0)]) >= 0, "channel"

        sorted_start = [start[int(f)] for f in columns.order]
        for i, first in enumerate(sorted_start):
            y[i].setInitialValue(1 if first is None else 0)
            for w, v in enumerate(x[i]):
                v.setInitialValue(1 if first == w else 0)
        timeline = inversion_timeline(problem, start)
        sent = {f: stop for f, _, stop in timeline.broadcasts}
        last = 0.0
        for f in range(n):
            last = sent.get(f, last)
            channel[f].setInitialValue(scale * last)
        for v, f, w in load_vars:
            v.setInitialValue(math.fsum(inv[g] for g in range(f + 1) if start[g] == w))
        end.setInitialValue(scale * start_value)

        with tempfile.TemporaryDirectory(prefix="placement-cbc-") as tmp:
            log_path = os.path.join(tmp, "cbc.log")
            with warnings.catch_warnings():  # PuLP 3.3 deprecates the bundled CBC for PuLP 4
                warnings.filterwarnings("ignore", message="PULP_CBC_CMD is deprecated", category=DeprecationWarning)
                # CBC's clock starts after pulp wrote the model, and pulp reads the solution after it stops.
                overhead = 0.05 + 8e-6 * columns.binaries
                # CBC prunes nodes that cannot beat the incumbent by its cutoff increment, by default an absolute
                # amount chosen from the coefficients: with objectives of hundredths of a second it stopped at
                # the root on near ties and called a warm start 1.6e-6 above the optimum optimal. Require
                # improvements of 1e-10 of the lower bound instead (below _OPTIMAL_RTOL).
                increment = max(1e-15, 1e-10 * scale * reference)
                cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=_remaining(deadline - overhead), warmStart=True,
                                        logPath=log_path, options=[f"increment {increment:.3e}"])
            # pulp writes the model and the warm start beside the log, and removes them only after a clean run:
            # in this directory they go with it whatever CBC does.
            cmd.tmpDir = tmp
            try:
                model.solve(cmd)
                with open(log_path) as handle:
                    log = handle.read()
            except (pulp.PulpSolverError, OSError):
                return _Outcome(placement=None, bound=0.0, optimal=False)
        if model.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            return _Outcome(placement=None, bound=0.0, optimal=False)
        values = [[v.value() or 0.0 for v in row] for row in x]
        placement = _decode(problem, columns, [v.value() or 0.0 for v in y], values)
        if model.sol_status == pulp.LpSolutionOptimal:
            # CBC proved that nothing beats its incumbent's objective by the increment; within its tolerances that
            # objective may lie below the makespan of the placement decoded from it. So "optimal" is not taken on
            # trust: the objective is the bound, and `_result` calls the answer optimal only if it meets it.
            proven = _cbc_objective(log)
            bound = 0.0 if proven is None else (proven - increment - _CBC_OBJECTIVE_ROUNDING) / scale
            return _Outcome(placement=placement, bound=bound, optimal=False)
        return _Outcome(placement=placement, bound=_cbc_bound(log, pulp.value(model.objective), 0.0) / scale,
                        optimal=False)


def _cbc_objective(log: str) -> float | None:
    """The objective of CBC's final incumbent (model units), from its summary's "Objective value:" (None if absent)."""
    found = re.findall(r"Objective value:\s+([-+0-9.eE]+)", log)
    try:
        return float(found[-1]) if found else None
    except ValueError:
        return None


def _cbc_bound(log: str, objective: float | None, constant: float) -> float:
    """CBC's best bound (model units), from the last "best possible" of its log (0.0 when there is none).

    The summary's "Lower bound:" has three decimals and may round up, so it is not used; the 8 significant
    digits of "best possible" are lowered by 1e-7 (relative). CBC may leave the objective's constant out:
    whether it did is read off its "Objective value:" against pulp's.
    """
    found_bound = re.findall(r"best possible\s+([-+0-9.eE]+)", log)
    found_value = re.search(r"Objective value:\s+([-+0-9.eE]+)", log)
    if objective is None or not found_bound or found_value is None:
        return 0.0
    try:
        bound, value = float(found_bound[-1]), float(found_value.group(1))
    except ValueError:
        return 0.0
    if abs(value + constant - objective) < abs(value - objective):
        bound += constant
    return bound - 1e-7 * abs(bound)


def _largest_time(problem: PlacementProblem) -> float:
    return max(max(problem.inv_s), max(problem.bcast_s))


class CpSatPlacement(_ModelPlacement):
    """Exact placement by the same model in OR-Tools CP-SAT, with times scaled to integers.

    Times are rounded to units of max(c, b) / `max_units` seconds (`time_unit_s`). Each placement's makespan is
    then off by at most n units (<= 2n rounded terms of half a unit), so the bound CP-SAT proves is lowered by
    n units before use, and CP-SAT stops as soon as its own gap is at most n units: "optimal" means within
    3n units of the optimum (n for the gap, 2n for the rounding of the optimum and of the answer).
    """

    name = "cp-sat"
    description = "the integer program in CP-SAT (times scaled to integers), hinted like the ILP"

    def __init__(self, *, time_limit_s: float = 1.5, max_binaries: int = 60_000, shortcuts: bool = True,
                 num_workers: int | None = None, max_units: int = 2**24) -> None:
        """Args: as `IlpPlacement`, except that `time_limit_s` is CP-SAT's deterministic time (about seconds
        on an unloaded core; a wall limit of `WALL_BACKSTOP` times it stops a badly overloaded machine), so one
        problem gets one answer however busy the machine is; num_workers: CP-SAT search threads (default 1,
        seeded: optimal placements often tie, and parallel workers pick among them by timing); max_units: the
        integer the largest time maps to.
        """
        super().__init__(time_limit_s=time_limit_s, max_binaries=max_binaries, shortcuts=shortcuts)
        if max_units < 1 or (num_workers is not None and num_workers < 1):
            raise SolverError(
                f"`max_units >= 1 and num_workers >= 1` must hold, but got "
                f"(max_units={max_units}, num_workers={num_workers})"
            )
        self.num_workers = num_workers or 1
        self.max_units = max_units

    def time_unit_s(self, problem: PlacementProblem) -> float:
        """Seconds per integer unit of the scaled model."""
        return _largest_time(problem) / self.max_units

    def _units(self, seconds: float, largest: float) -> int:
        return round(seconds / largest * self.max_units) if largest > 0 else 0

    def _solve_model(self, problem: PlacementProblem, columns: _Columns, start: Placement, deadline: float) -> _Outcome:
        from ortools.sat.python import cp_model  # deferred: a command's workers load no ortools

        unit, largest = self.time_unit_s(problem), _largest_time(problem)
        c = [self._units(problem.inv_s[int(f)], largest) for f in columns.order]
        width = [int(w) for w in columns.width]
        n, workers = len(c), columns.workers
        position = [int(i) for i in np.argsort(columns.order)]  # column of each factor
        cost = [c[position[f]] for f in range(n)]  # in factor order
        send = [self._units(problem.bcast_s[f], largest) for f in range(n)]
        horizon = sum(c) + sum(send)
        model = cp_model.CpModel()
        y = [model.new_bool_var(f"y{i}") for i in range(n)]
        x = [[model.new_bool_var(f"x{i}_{w}") for w in range(width[i])] for i in range(n)]
        end = model.new_int_var(0, horizon, "end")
        everywhere = cp_model.LinearExpr.weighted_sum(y, c)
        for i in range(n):
            model.add_exactly_one([*x[i], y[i]])
            if c[i] > 0:
                model.add(end >= everywhere + c[i] - c[i] * y[i])
        for w in range(workers):
            members = [i for i in range(n) if w < width[i] and c[i] > 0]
            if members:
                model.add(end >= everywhere + cp_model.LinearExpr.weighted_sum([x[i][w] for i in members],
                                                                              [c[i] for i in members]))
        channel = [model.new_int_var(0, horizon, f"e{f}") for f in range(n)]  # in factor (broadcast) order
        loads: list[Any] = [0] * workers  # w's owned load over the factors so far (in factor order)
        for f in range(n):
            i = position[f]
            model.add(channel[f] >= (channel[f - 1] if f else 0) + send[f] - send[f] * y[i])
            for w in range(width[i]):
                if cost[f] > 0:
                    grown = model.new_int_var(0, sum(c), f"s{f}_{w}")
                    model.add(grown == loads[w] + cost[f] * x[i][w])
                    loads[w] = grown
                model.add(channel[f] >= loads[w] + send[f]).only_enforce_if(x[i][w])  # f on w: after w's load
        model.add(end >= channel[n - 1])
        model.minimize(end)

        sorted_start = [start[int(f)] for f in columns.order]
        for i, owner in enumerate(sorted_start):
            model.add_hint(y[i], owner is None)
            for w, v in enumerate(x[i]):
                model.add_hint(v, owner == w)

        solver = cp_model.CpSolver()
        solver.parameters.max_deterministic_time = self.time_limit_s
        solver.parameters.max_time_in_seconds = max(_remaining(deadline), WALL_BACKSTOP * self.time_limit_s)
        solver.parameters.num_workers = self.num_workers
        solver.parameters.random_seed = 0
        solver.parameters.absolute_gap_limit = n  # below the rounding error: stop and report OPTIMAL
        status = solver.solve(model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return _Outcome(placement=None, bound=0.0, optimal=False)
        placement = _decode(problem, columns, [float(solver.boolean_value(v)) for v in y],
                            [[float(solver.boolean_value(v)) for v in row] for row in x])
        if status == cp_model.OPTIMAL:
            return _Outcome(placement=placement, bound=makespan(problem, placement), optimal=True)
        bound = (solver.best_objective_bound - n) * unit
        return _Outcome(placement=placement, bound=bound, optimal=False)


#: The exact solvers by name.
PLACEMENT_SOLVERS: dict[str, type[_ModelPlacement]] = {"ilp-cbc": IlpPlacement, "cp-sat": CpSatPlacement}
