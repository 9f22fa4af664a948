"""Per-buffer factor packing: each fusion buffer's factors travel as upper triangles or whole.

Packing a factor into its upper triangle halves what its allreduce sends, but gathering the triangle when the
factor is computed sits on the compute path (forward for A, backward for G) and scattering it back when the
averaged factor is folded costs again; sent whole, a factor costs a copy and twice the bytes. Which pays depends
on where its buffer falls: a buffer whose allreduce hides behind compute should go whole, one left exposed at
the end of the step on a slow link as triangles. So the choice is made per buffer, with the buffers.

The model is `planner.solvers.fusion`'s channel (A buffers first, then G buffers and the fixed gradient
collectives in ready order) on a compute clock that packing delays. Each factor has, for each format
(0: upper triangle, 1: whole), its packing seconds, its message bytes and its folding seconds. With the
formats chosen:

- A factor i is ready at a_ready_s[i] + the packing of A factors 0..i (base times exclude packing);
- G factor j at g_ready_s[j] + all A packing + the packing of G factors 0..j;
- gradient collective k at grad_ready_s[k] + all A packing + the packing of the G factors computed before
  it (its first `grad_after_g[k]`);
- compute ends at compute_end_s + all packing; the factor step's part this decides is
  max(compute end, channel end) + the folding of every factor (`PackingTimeline.value_s`).

Solvers: `PackingDP` (exact); `planner.testing.brute_force_packing` tries every buffer choice times every format
choice (tests).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.costmodel.costs import CostModel
from planner.costmodel.problem import Grouping, groups_of
from planner.solvers.fusion import FactorBuffers, FusionProblem, FusionTimeline, simulate_fusion, validate_buffers
from planner.types import SolverError

__all__ = [
    "BufferFormats",
    "PackingDP",
    "PackingProblem",
    "PackingTimeline",
    "simulate_packing",
]

#: Whether each buffer travels whole: (per A buffer, per G buffer), in the buffers' order.
BufferFormats = tuple[tuple[bool, ...], tuple[bool, ...]]

Pair = tuple[float, float]


def _pairs(values: Sequence[Sequence[Any]], name: str, count: int, *, integer: bool = False) -> tuple:
    if len(values) != count:
        raise SolverError(f"`len({name}) == {count}` must hold (one pair per factor), but got {len(values)}")
    out = []
    for i, pair in enumerate(values):
        if len(pair) != 2:
            raise SolverError(f"{name}[{i}] must be a pair (upper triangle, whole), but got {pair!r}")
        conv = tuple(operator.index(x) if integer else float(x) for x in pair)
        if any(not math.isfinite(x) or x < 0 or (integer and x <= 0) for x in conv):
            raise SolverError(f"{name}[{i}] must hold two {'sizes > 0' if integer else 'times >= 0'}, got {pair!r}")
        out.append(conv)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class PackingProblem:
    """The factor allreduces of a factor-update step with a format to choose per buffer.

    Attributes:
        a_ready_s, g_ready_s: when each factor is computed, without any packing (A forward order, G backward).
        a_bytes, g_bytes: (upper triangle, whole) bytes of each factor's message.
        a_pack_s, g_pack_s: (upper triangle, whole) seconds to put each factor into its buffer.
        a_fold_s, g_fold_s: (upper triangle, whole) seconds to fold each averaged factor from its buffer.
        grad_ready_s, grad_bytes: the fixed gradient collectives, ready order, without packing.
        grad_after_g: how many G factors (backward order) are computed before gradient collective k is ready.
        compute_end_s: when backward ends, without packing.
        allreduce: seconds for an allreduce of x bytes.
    """

    a_ready_s: tuple[float, ...]
    g_ready_s: tuple[float, ...]
    a_bytes: tuple[tuple[int, int], ...]
    g_bytes: tuple[tuple[int, int], ...]
    a_pack_s: tuple[Pair, ...]
    g_pack_s: tuple[Pair, ...]
    a_fold_s: tuple[Pair, ...]
    g_fold_s: tuple[Pair, ...]
    grad_ready_s: tuple[float, ...]
    grad_bytes: tuple[int, ...]
    grad_after_g: tuple[int, ...]
    compute_end_s: float
    allreduce: CostModel

    def __post_init__(self) -> None:
        n_a, n_g = len(self.a_ready_s), len(self.g_ready_s)
        if not n_a or not n_g:
            raise SolverError("a packing problem needs at least one A and one G factor")
        for name, count, integer in (("a_bytes", n_a, True), ("g_bytes", n_g, True), ("a_pack_s", n_a, False),
                                     ("g_pack_s", n_g, False), ("a_fold_s", n_a, False), ("g_fold_s", n_g, False)):
            object.__setattr__(self, name, _pairs(getattr(self, name), name, count, integer=integer))
        for name in ("a_ready_s", "g_ready_s", "grad_ready_s"):
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))
        object.__setattr__(self, "grad_bytes", tuple(operator.index(x) for x in self.grad_bytes))
        object.__setattr__(self, "grad_after_g", tuple(operator.index(x) for x in self.grad_after_g))
        if not len(self.grad_ready_s) == len(self.grad_bytes) == len(self.grad_after_g):
            raise SolverError("grad_ready_s, grad_bytes and grad_after_g must have one entry per gradient collective")
        after = self.grad_after_g
        if any(not 0 <= x <= n_g for x in after) or any(b < a for a, b in itertools.pairwise(after)):
            raise SolverError(f"grad_after_g must be non-decreasing counts in [0, {n_g}], got {list(after)}")
        # Base times must keep the compute order: a gradient after the G factors computed before it, and so on.
        for k, (t, m) in enumerate(zip(self.grad_ready_s, after, strict=True)):
            if (m and t < self.g_ready_s[m - 1]) or (m < n_g and t > self.g_ready_s[m]):
                raise SolverError(f"grad_ready_s[{k}] is not between the G factors grad_after_g[{k}]={m} places it")
        if self.compute_end_s < max(self.g_ready_s[-1], *self.grad_ready_s, 0.0):
            raise SolverError("compute_end_s must not be before the last factor or gradient is ready")
        # The packed problems must be valid fusion problems (ready order, every G after every A).
        self.fusion((False,) * n_a, (False,) * n_g)

    @property
    def num_a(self) -> int:
        return len(self.a_ready_s)

    @property
    def num_g(self) -> int:
        return len(self.g_ready_s)

    def fusion(self, a_whole: Sequence[bool], g_whole: Sequence[bool]) -> FusionProblem:
        """The fusion problem with each factor in its format (`a_whole[i]`: A factor i travels whole)."""
        a_pack = np.cumsum([p[w] for p, w in zip(self.a_pack_s, a_whole, strict=True)])
        g_pack = np.concatenate(([0.0], np.cumsum([p[w] for p, w in zip(self.g_pack_s, g_whole, strict=True)])))
        d_a = float(a_pack[-1])
        return FusionProblem(
            a_ready_s=tuple(t + s for t, s in zip(self.a_ready_s, a_pack, strict=True)),
            a_bytes=tuple(b[w] for b, w in zip(self.a_bytes, a_whole, strict=True)),
            g_ready_s=tuple(t + d_a + s for t, s in zip(self.g_ready_s, g_pack[1:], strict=True)),
            g_bytes=tuple(b[w] for b, w in zip(self.g_bytes, g_whole, strict=True)),
            grad_ready_s=tuple(t + d_a + g_pack[m] for t, m in zip(self.grad_ready_s, self.grad_after_g, strict=True)),
            grad_bytes=self.grad_bytes,
            allreduce=self.allreduce,
        )


@dataclass(frozen=True, kw_only=True)
class PackingTimeline:
    """A choice of buffers and formats, walked: the channel, when compute ends, the folding, and the value."""

    channel: FusionTimeline
    compute_end_s: float
    fold_s: float

    @property
    def value_s(self) -> float:
        """max(compute end, channel end) + folding: the part of the factor step the choice decides."""
        return max(self.compute_end_s, self.channel.end_s) + self.fold_s


def _factor_formats(ends: Grouping, whole: Sequence[bool]) -> list[bool]:
    groups = groups_of(ends)
    if len(whole) != len(groups):
        raise SolverError(f"one format per buffer: {len(groups)} buffers, {len(whole)} formats")
    return [bool(w) for r, w in zip(groups, whole, strict=True) for _ in r]


def simulate_packing(problem: PackingProblem, buffers: FactorBuffers, formats: BufferFormats) -> PackingTimeline:
    """Walk one choice with scalar costs and `simulate_fusion` (the reference the solver is checked on)."""
    a_ends, g_ends = validate_buffers(problem.fusion((False,) * problem.num_a, (False,) * problem.num_g), buffers)
    a_whole, g_whole = _factor_formats(a_ends, formats[0]), _factor_formats(g_ends, formats[1])
    packing = sum(p[w] for p, w in zip(problem.a_pack_s + problem.g_pack_s, a_whole + g_whole, strict=True))
    fold = sum(f[w] for f, w in zip(problem.a_fold_s + problem.g_fold_s, a_whole + g_whole, strict=True))
    return PackingTimeline(
        channel=simulate_fusion(problem.fusion(a_whole, g_whole), (a_ends, g_ends)),
        compute_end_s=problem.compute_end_s + packing,
        fold_s=fold,
    )


@dataclass(frozen=True)
class _State:
    """A prefix of buffers: channel free time, packing so far, folding so far, and how it was reached."""

    channel: float
    packing: float
    fold: float
    prev: _State | None = None
    end: int = 0
    whole: bool = False

    def dominates(self, other: _State) -> bool:
        """Whether every completion of `other` is at least as slow as the same completion of `self`.

        What follows a prefix is non-decreasing in its channel time and packing and moves by at most d when
        both move by d (every later time is a max of sums of them); folding adds at the end. So a prefix ahead
        by x in channel or packing and behind by more than x in folding can be dropped too.
        """
        lead = max(0.0, self.channel - other.channel, self.packing - other.packing)
        return self.fold + lead <= other.fold


def _prune(states: list[_State], max_states: int) -> list[_State]:
    """The states no other state dominates (of states dominating each other, the first in folding order).

    Raises:
        SolverError: more than `max_states` of them.
    """
    states.sort(key=lambda s: (s.fold, s.channel, s.packing))
    kept: list[_State] = []
    for s in states:
        if not any(k.dominates(s) for k in kept):
            kept = [k for k in kept if not s.dominates(k)]
            kept.append(s)
            if len(kept) > max_states:
                raise SolverError(
                    f"more than {max_states} undominated buffer prefixes: too many to choose formats per buffer"
                )
    return kept


class PackingDP:
    """Exact buffers and per-buffer formats: the least max(compute end, channel end) + folding.

    A dynamic program over prefixes of the A factors, then of the G factors, whose state is the Pareto front
    of (channel free time, packing so far, folding so far): every later ready time is a base time plus the
    packing so far, and every later step (max(channel, ready) + T) is non-decreasing in the channel time and
    in the packing, and the value is non-decreasing in all three, so a dominated prefix never helps. A G
    buffer [i..j] first runs the gradient collectives computed between G factors i - 1 and j, each delayed by
    the packing of the buffer's factors computed before it, as `simulate_fusion` orders them.
    """

    name = "packing-dp"

    def __init__(self, max_states: int = 256) -> None:
        self.max_states = max_states

    def solve(self, problem: PackingProblem) -> tuple[FactorBuffers, BufferFormats]:
        return self.solve_with_value(problem)[0]

    def solve_with_value(self, problem: PackingProblem) -> tuple[tuple[FactorBuffers, BufferFormats], float]:
        """The best buffers and formats and their value.

        Raises:
            SolverError: some phase boundary has more than `max_states` undominated prefixes (the fronts can
                grow exponentially where formats trade bytes against packing evenly; the caller then keeps
                one format for every buffer).
        """
        cost = problem.allreduce.cost
        # The earliest base time anything after each phase boundary can be ready: a channel free before it
        # (plus the packing so far) is as good as free then, so states are compared from there.
        after = problem.grad_after_g
        tail = [k for k, m in enumerate(after) if m == problem.num_g]
        first_grad = problem.grad_ready_s[0] if problem.grad_ready_s else math.inf
        a_next = [*problem.a_ready_s[1:], min(problem.g_ready_s[0], first_grad)]
        g_next = [
            min(problem.g_ready_s[m] if m < problem.num_g else problem.compute_end_s,
                next((t for t, n in zip(problem.grad_ready_s, after, strict=True) if n >= m), math.inf))
            for m in range(1, problem.num_g + 1)
        ]
        a_front = self._phase([_State(0.0, 0.0, 0.0)], problem.a_ready_s, problem.a_bytes, problem.a_pack_s,
                              problem.a_fold_s, a_next, grads=False, problem=problem)
        g_front = self._phase([replace_prev(s) for s in a_front], problem.g_ready_s, problem.g_bytes,
                              problem.g_pack_s, problem.g_fold_s, g_next, grads=True, problem=problem)
        best: tuple[float, _State] | None = None
        for s in g_front:
            channel = s.channel
            for k in tail:  # gradient collectives after the last G factor
                channel = max(channel, problem.grad_ready_s[k] + s.packing) + cost(problem.grad_bytes[k])
            value = max(problem.compute_end_s + s.packing, channel) + s.fold
            if best is None or value < best[0]:
                best = (value, s)
        assert best is not None
        return _decode(best[1], problem.num_a, problem.num_g), best[0]

    def _phase(
        self,
        start: list[_State],
        ready: tuple[float, ...],
        nbytes: tuple[tuple[int, int], ...],
        pack: tuple[Pair, ...],
        fold: tuple[Pair, ...],
        next_ready: list[float],
        *,
        grads: bool,
        problem: PackingProblem,
    ) -> list[_State]:
        cost = problem.allreduce.cost
        count = len(ready)
        # Prefix sums per format, so a buffer's bytes, packing and folding are differences.
        sums = {name: [np.concatenate(([0.0], np.cumsum([p[w] for p in pairs]))) for w in (0, 1)]
                for name, pairs in (("bytes", nbytes), ("pack", pack), ("fold", fold))}
        after = problem.grad_after_g if grads else ()
        fronts: list[list[_State]] = [start]
        for j in range(count):
            candidates: list[_State] = []
            for i in range(j + 1):
                # gradient collectives issued before buffer [i..j]: computed after G factor i - 1, before G j
                issued = [k for k, m in enumerate(after) if i <= m <= j]
                for w in (0, 1):
                    pk, bt, fd = sums["pack"][w], sums["bytes"][w], sums["fold"][w]
                    allreduce = cost(float(bt[j + 1] - bt[i]))
                    for s in fronts[i]:
                        channel = s.channel
                        for k in issued:
                            shift = s.packing + (pk[after[k]] - pk[i])
                            channel = max(channel, problem.grad_ready_s[k] + shift) + cost(problem.grad_bytes[k])
                        packing = s.packing + (pk[j + 1] - pk[i])
                        channel = max(channel, ready[j] + packing) + allreduce
                        channel = max(channel, next_ready[j] + packing)
                        candidates.append(_State(channel, packing, s.fold + (fd[j + 1] - fd[i]), s, j + 1, bool(w)))
            fronts.append(_prune(candidates, self.max_states))
        return fronts[-1]


def replace_prev(state: _State) -> _State:
    """`state` as the start of the next phase (its chain kept, its end marking the phase boundary)."""
    return _State(state.channel, state.packing, state.fold, state, 0, state.whole)


def _decode(state: _State, num_a: int, num_g: int) -> tuple[FactorBuffers, BufferFormats]:
    chain: list[_State] = []
    node: _State | None = state
    while node is not None and node.prev is not None:
        chain.append(node)
        node = node.prev
    chain.reverse()
    # The phase boundary is the state with end 0 (made by replace_prev); A buffers before it, G after.
    cut = next(i for i, s in enumerate(chain) if s.end == 0)
    a, g = chain[:cut], chain[cut + 1:]
    buffers = (tuple(s.end for s in a), tuple(s.end for s in g))
    assert buffers[0][-1] == num_a and buffers[1][-1] == num_g
    return buffers, (tuple(s.whole for s in a), tuple(s.whole for s in g))
