"""The instance the gradient solvers work on: one iteration of a model under the timeline model.

Layers are indexed 0..L-1 in the order their gradients become ready in backward (DESIGN.md numbers
them 1..L). A grouping is the tuple of exclusive end indices of contiguous groups, ascending, last = L:
(2, 5) on L=5 means groups [0, 1] and [2, 3, 4].
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from planner.contracts.layers import LayerSpec
from planner.contracts.plan import Group
from planner.costmodel.costs import CostModel
from planner.types import SolverError, Strategy

__all__ = [
    "INDEX_BYTES",
    "GradientProblem",
    "Grouping",
    "advance",
    "advance_many",
    "groups_for",
    "groups_of",
    "topk_count",
    "topk_count_many",
    "unstretched",
    "unstretched_many",
]

Grouping = tuple[int, ...]

#: top-k sends each selected index as int32 next to its value.
INDEX_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class GradientProblem:
    """Per-layer times and sizes, and the cost models of communication, selection and decoding.

    Attributes:
        strategy: dense allreduce or top-k sparsified allgather.
        forward_s: forward time F. update_s: optimizer update time U.
        backward_s: b_i, backward time of each layer in ready order.
        numel: n_i, gradient elements of each layer in ready order.
        comm: dense: allreduce seconds for a message of x bytes; top-k: allgather seconds for x bytes sent per rank.
        world_size: P, number of workers.
        density: top-k fraction rho in (0, 1].
        select: top-k: seconds to select k = ceil(rho N) of a group of N elements (with its residual update).
        decode: top-k: seconds to scatter-add x gathered values into the dense gradient.
        pack: seconds to take a group's N gradient elements into its flat buffer (dense: divided by P), on the
            compute stream as they become ready; None: free. A top-k problem has one only where the runtime
            copies gradients before selecting (DDP's buckets under the top-k hook).
        interference: sigma >= 0: compute work runs (1 + sigma) times slower while a collective is in flight
            (the collective's own work takes the CPU, memory bandwidth or GPU from it); 0: no interference.
        comm_stretch: kappa >= 0, the other direction: a collective runs (1 + kappa) times slower while the
            compute stream works through backward (its copies and reductions share the cores with compute);
            0: none. Charged on both strategies: what a collective still owes when backward (and the last
            selection) ends runs at full speed, beside top-k's decodes.
    """

    strategy: Strategy
    forward_s: float
    update_s: float
    backward_s: tuple[float, ...]
    numel: tuple[int, ...]
    comm: CostModel
    world_size: int
    element_bytes: int = 4
    density: float | None = None
    select: CostModel | None = None
    decode: CostModel | None = None
    pack: CostModel | None = None
    interference: float = 0.0
    comm_stretch: float = 0.0
    names: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.numel:
            raise SolverError("the problem has no layers with gradients")
        if len(self.backward_s) != len(self.numel):
            raise SolverError(
                f"`len(backward_s) == len(numel)` must hold, but got ({len(self.backward_s)}, {len(self.numel)})"
            )
        if self.names and len(self.names) != len(self.numel):
            raise SolverError(f"`len(names) == len(numel)` must hold, but got ({len(self.names)}, {len(self.numel)})")
        if self.world_size < 1:
            raise SolverError(f"`world_size >= 1` must hold, but got world_size={self.world_size}")
        if not (math.isfinite(self.interference) and self.interference >= 0):
            raise SolverError(f"`interference >= 0` (finite) must hold, but got interference={self.interference}")
        if not (math.isfinite(self.comm_stretch) and self.comm_stretch >= 0):
            raise SolverError(f"`comm_stretch >= 0` (finite) must hold, but got comm_stretch={self.comm_stretch}")
        if self.strategy is Strategy.TOPK:
            if self.density is None or not 0 < self.density <= 1:
                raise SolverError(f"top-k needs `0 < density <= 1`, but got density={self.density}")
            if self.select is None or self.decode is None:
                raise SolverError("top-k needs selection and decode cost models (profile the top-k costs)")

    @property
    def num_layers(self) -> int:
        return len(self.numel)

    def k(self, numel: int) -> int:
        """Values a top-k group of `numel` elements sends: ceil(rho * numel)."""
        assert self.density is not None
        return topk_count(numel, self.density)

    def prepare_s(self, numel: int) -> float:
        """Compute-stream seconds of preparing a group of `numel` elements for its collective: packing (0
        without a packing cost) and, for top-k, selection."""
        packing = 0.0 if self.pack is None else self.pack.cost(numel)
        if self.strategy is Strategy.TOPK:
            assert self.select is not None
            return packing + self.select.cost(numel)
        return packing

    def decode_s(self, numel: int) -> float:
        """Seconds of decoding a top-k group of `numel` elements: d(P * k) (0 for dense)."""
        if self.strategy is Strategy.DENSE:
            return 0.0
        assert self.decode is not None
        return self.decode.cost(self.world_size * self.k(numel))

    def message_bytes(self, numel: int) -> int:
        """Bytes one rank sends for a group of `numel` elements: the dense gradient, or k values and indices."""
        if self.strategy is Strategy.DENSE:
            return numel * self.element_bytes
        return self.k(numel) * (self.element_bytes + INDEX_BYTES)


def advance(compute: float, channel: float, work: float, interference: float) -> float:
    """When `work` seconds of compute that start at `compute` end, if they run (1 + interference) times slower
    while the channel is busy, which it is until `channel` (and not after).

    The compute stream then needs W (1 + sigma) until the channel frees up, and W after; so it ends at
    compute + W + sigma * min(W, lag / (1 + sigma)) with lag = max(0, channel - compute). Non-decreasing in
    `compute` and in `channel`, and composable: advance(advance(c, e, a), e, b) == advance(c, e, a + b).
    """
    lag = channel - compute
    if lag <= 0 or interference == 0:
        return compute + work
    return compute + work + interference * min(work, lag / (1 + interference))


def unstretched(t: float, compute_end: float, comm_stretch: float) -> float:
    """A channel clock kept as if compute never ended (every collective (1 + kappa) times slower), read in real
    time: the channel runs (1 + kappa) times slower only until the compute stream's work ends at
    `compute_end`, so what lies beyond it takes 1 / (1 + kappa) of its stretched length. Non-decreasing in
    `t` and in `compute_end`; t itself when kappa = 0 or t <= compute_end."""
    if t <= compute_end or comm_stretch == 0:
        return t
    return compute_end + (t - compute_end) / (1 + comm_stretch)


def unstretched_many(t: np.ndarray, compute_end: np.ndarray, comm_stretch: float) -> np.ndarray:
    """Vectorised `unstretched` (the solvers' final ends)."""
    if comm_stretch == 0:
        return t
    return np.minimum(t, compute_end + (t - compute_end) / (1 + comm_stretch))


def advance_many(compute: np.ndarray, channel: np.ndarray, work: np.ndarray, interference: float) -> np.ndarray:
    """Vectorised `advance` (the solvers' inner loops)."""
    if interference == 0:
        return compute + work
    lag = np.maximum(channel - compute, 0.0)
    return compute + work + interference * np.minimum(work, lag / (1 + interference))


@functools.lru_cache(maxsize=64)
def _decimal(density: float) -> Fraction:
    """The density as the decimal it is written as (0.07 is 7/100, not the binary float just above it)."""
    return Fraction(repr(float(density)))


def topk_count_many(numel: np.ndarray, density: float) -> np.ndarray:
    """k = ceil(density * numel) in exact arithmetic (density read as its decimal), at least 1 and at most
    numel, as floats."""
    n = np.rint(np.asarray(numel, dtype=float)).astype(np.int64)
    frac = _decimal(density)
    p, q = frac.numerator, frac.denominator
    # beyond int64 (a density of many digits, such as 5e-324 = 5/10^324): Python integers (never for real densities)
    if n.size and (p * int(n.max(initial=0)) >= 2**62 or q >= 2**62):
        k = np.array([-((-p * int(x)) // q) for x in n.ravel()], dtype=np.int64).reshape(n.shape)
    else:
        k = -((-p * n) // q)
    return np.maximum(1, np.minimum(n, k)).astype(float)


def topk_count(numel: int, density: float) -> int:
    """`topk_count_many` for one group: the k a top-k group of `numel` elements sends (in Python integers:
    the simulator and the greedy rules call it once per group)."""
    n = operator.index(numel)
    frac = _decimal(density)
    return max(1, min(n, -((-frac.numerator * n) // frac.denominator)))


def groups_of(grouping: Grouping) -> list[range]:
    """The layer index ranges of a grouping."""
    starts = (0, *grouping[:-1])
    return [range(s, e) for s, e in zip(starts, grouping, strict=True)]


def groups_for(
    layers: Sequence[LayerSpec], grouping: Grouping, strategy: Strategy, density: float | None
) -> tuple[Group, ...]:
    """Plan groups for `layers` (in ready order) split at `grouping`'s end indices."""
    if not grouping or grouping[-1] != len(layers):
        raise SolverError(f"grouping {grouping} does not cover the {len(layers)} layers")
    out = []
    for r in groups_of(grouping):
        members = [layers[i] for i in r]
        numel = sum(m.numel for m in members)
        k = None
        if strategy is Strategy.TOPK:
            assert density is not None
            k = topk_count(numel, density)
        out.append(
            Group(
                layers=tuple(m.name for m in members),
                params=tuple(p for m in members for p in m.params),
                numel=numel,
                k=k,
            )
        )
    return tuple(out)
