"""Brute-force references of the exact solvers: every choice of a small instance, each priced by the model the
solver optimises, the best kept. The tests hold each exact solver to its reference; each refuses an instance too
large to enumerate (`SolverError`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from planner.costmodel.problem import Grouping
from planner.solvers.fusion import FactorBuffers, FusionProblem, simulate_fusion
from planner.solvers.layout import Layout, LayoutProblem, layout_value
from planner.solvers.packing import BufferFormats, PackingProblem, simulate_packing
from planner.solvers.placement import Placement, PlacementProblem, makespan
from planner.types import SolverError

__all__ = ["brute_force_fusion", "brute_force_layout", "brute_force_packing", "brute_force_placement"]

#: `brute_force_placement` refuses instances with more placements than this.
MAX_PLACEMENTS = 200_000
#: `brute_force_layout` refuses instances with more layouts than this.
MAX_LAYOUTS = 60_000_000
#: Layouts evaluated at once by `brute_force_layout`.
_LAYOUT_CHUNK = 1 << 17
#: `brute_force_fusion` refuses instances with more factors than this (2^(n - 2) buffer choices).
MAX_FUSION_FACTORS = 16
#: `brute_force_packing` refuses instances with more factors than this.
MAX_PACKING_FACTORS = 10


def _groupings(count: int) -> list[Grouping]:
    """Every grouping of `count` items: 2^(count - 1) of them."""
    cuts = range(1, count)
    return [(*chosen, count) for r in range(count) for chosen in itertools.combinations(cuts, r)]


def brute_force_placement(problem: PlacementProblem) -> tuple[Placement, float]:
    """The best of all (P + 1)^n placements and its makespan (small instances only: tests)."""
    n, world = problem.num_factors, problem.world_size
    count = (world + 1) ** n
    if count > MAX_PLACEMENTS:
        raise SolverError(
            f"`(world_size + 1) ** num_factors <= {MAX_PLACEMENTS}` must hold for brute force, but got "
            f"(world_size={world}, num_factors={n}, placements={count})"
        )
    best: Placement = (None,) * n
    best_value = makespan(problem, best)
    for candidate in itertools.product([None, *range(world)], repeat=n):
        value = makespan(problem, candidate)
        if value < best_value:
            best, best_value = candidate, value
    return best, best_value


def _layer_choices(world_size: int) -> list[tuple[int, int, int]]:
    """Every (owner of A, owner of G, preconditioner) of one layer, -1 standing for everywhere."""
    ranks = [-1, *range(world_size)]
    return [(a, g, -1) for a in ranks for g in ranks] + [(w, w, w) for w in range(world_size)]


def _choice_chunks(problem: LayoutProblem) -> Iterator[np.ndarray]:
    """All layouts as rows of per-layer choice indices, in chunks of at most about _LAYOUT_CHUNK rows."""
    options = len(_layer_choices(problem.world_size))
    n = problem.num_layers
    head = 0
    while head < n and options ** (n - head) > _LAYOUT_CHUNK:
        head += 1
    tail = np.array(list(itertools.product(range(options), repeat=n - head)), dtype=np.int16).reshape(-1, n - head)
    for prefix in itertools.product(range(options), repeat=head):
        rows = np.empty((len(tail), n), dtype=np.int16)
        rows[:, :head] = prefix
        rows[:, head:] = tail
        yield rows


def _phase_values(work: np.ndarray, send: np.ndarray, owners: np.ndarray, sent: np.ndarray,
                  world_size: int) -> np.ndarray:
    """Vectorised `planner.solvers.layout._phase` makespans: owners[:, k] in -1..P-1 (-1 everywhere), sent[:, k]
    whether broadcast."""
    rows = len(owners)
    loads = np.zeros((rows, world_size))
    everywhere = np.zeros(rows)
    channel = np.zeros(rows)
    index = np.arange(rows)
    for k in range(owners.shape[1]):
        owner = owners[:, k]
        is_everywhere = owner < 0
        everywhere += np.where(is_everywhere, work[k], 0.0)
        column = np.where(is_everywhere, 0, owner)
        loads[index, column] += np.where(is_everywhere, 0.0, work[k])
        start = np.maximum(channel, loads[index, column])
        channel = np.where(sent[:, k], start + send[k], channel)
    return np.maximum(loads.max(axis=1) + everywhere, channel)


def brute_force_layout(problem: LayoutProblem) -> tuple[Layout, float]:
    """The best of all ((P + 1)² + P)^n layouts and its value (small instances only: tests)."""
    world, n = problem.world_size, problem.num_layers
    choices = np.array(_layer_choices(world), dtype=np.int64)
    count = len(choices) ** n
    if count > MAX_LAYOUTS:
        raise SolverError(
            f"`((P + 1)^2 + P)^layers <= {MAX_LAYOUTS}` must hold for brute force, but got "
            f"(world_size={world}, layers={n}, layouts={count})"
        )
    pl = problem.placement
    inv_s, bcast_s = np.asarray(pl.inv_s), np.asarray(pl.bcast_s)
    pre_s, grad_s = np.asarray(problem.precondition_s), np.asarray(problem.grad_bcast_s)
    best_value, best_row = np.inf, None
    for rows in _choice_chunks(problem):
        picked = choices[rows]  # (layouts, layers, 3)
        owners = picked[:, :, :2].reshape(len(rows), 2 * n)
        pre = picked[:, :, 2]
        factor_sent = (owners >= 0) & np.repeat(pre < 0, 2, axis=1)
        values = (_phase_values(inv_s, bcast_s, owners, factor_sent, world) / problem.inv_update_steps
                  + _phase_values(pre_s, grad_s, pre, pre >= 0, world))
        i = int(np.argmin(values))
        if values[i] < best_value:
            best_value, best_row = float(values[i]), picked[i]
    assert best_row is not None
    layout = Layout(owners=tuple(None if o < 0 else int(o) for o in best_row[:, :2].reshape(-1)),
                    preconditioners=tuple(None if r < 0 else int(r) for r in best_row[:, 2]))
    return layout, layout_value(problem, layout)


def brute_force_fusion(problem: FusionProblem) -> tuple[FactorBuffers, float]:
    """The best of all 2^(n_a-1) * 2^(n_g-1) buffer choices by `simulate_fusion`, and its `end_s` (for tests).

    Raises:
        SolverError: more than 16 factors in all.
    """
    total = problem.num_a + problem.num_g
    if total > MAX_FUSION_FACTORS:
        raise SolverError(f"`n_a + n_g <= {MAX_FUSION_FACTORS}` must hold for brute force, but got {total}")

    best: tuple[FactorBuffers, float] | None = None
    for buffers in itertools.product(_groupings(problem.num_a), _groupings(problem.num_g)):
        end = simulate_fusion(problem, buffers).end_s
        if best is None or end < best[1]:
            best = (buffers, end)
    assert best is not None
    return best


def brute_force_packing(problem: PackingProblem) -> tuple[tuple[FactorBuffers, BufferFormats], float]:
    """The best of every buffer choice with every format per buffer, by `simulate_packing` (for tests)."""
    if problem.num_a + problem.num_g > MAX_PACKING_FACTORS:
        raise SolverError(f"`n_a + n_g <= {MAX_PACKING_FACTORS}` must hold for brute force")
    best: tuple[tuple[FactorBuffers, BufferFormats], float] | None = None
    for a_ends, g_ends in itertools.product(_groupings(problem.num_a), _groupings(problem.num_g)):
        for a_fmt in itertools.product((False, True), repeat=len(a_ends)):
            for g_fmt in itertools.product((False, True), repeat=len(g_ends)):
                choice = ((a_ends, g_ends), (a_fmt, g_fmt))
                value = simulate_packing(problem, *choice).value_s
                if best is None or value < best[1]:
                    best = (choice, value)
    assert best is not None
    return best
