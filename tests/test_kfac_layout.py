"""The K-FAC layout solver (planner/solvers/layout.py): who inverts each factor and who preconditions each layer.

The layout's two phases are timed by hand on a small case, the CP-SAT model's objective equals the evaluator on
random layouts (so the model prices what the runtime does), and the exact solver equals brute force on random
instances of up to 6 layers and 3 workers (all ((P + 1)² + P)^n layouts; 6 layers on 3 workers, 47 million
layouts, take a minute and are left out) and is never worse than kfac-pytorch's COMM_OPT and MEM_OPT layouts."""

from __future__ import annotations

import itertools
import math

import pytest
from ortools.sat.python import cp_model

from planner.solvers.layout import (
    LAYOUT_BASELINES,
    CpSatLayout,
    KaisaCommOpt,
    KaisaMemOpt,
    Layout,
    LayoutProblem,
    canonical_layout,
    check_layout,
    layout_lower_bound,
    layout_timelines,
    layout_value,
)
from planner.solvers.layout import _LayoutModel as LayoutModel
from planner.solvers.placement import PlacementProblem
from planner.testing import brute_force_layout, random_layout_problem
from planner.types import SolverError


def small_problem(inv_update_steps: int = 2) -> LayoutProblem:
    """Two layers on two workers: factors A0, G0, A1, G1."""
    placement = PlacementProblem(inv_s=(4.0, 2.0, 3.0, 1.0), bcast_s=(1.0, 0.5, 1.0, 0.5), dims=(8, 4, 6, 2),
                                 world_size=2)
    return LayoutProblem(placement=placement, precondition_s=(6.0, 2.0), grad_bcast_s=(1.5, 0.5),
                         inv_update_steps=inv_update_steps, layers=("first", "second"))


def test_phases_by_hand() -> None:
    problem = small_problem()
    # Layer 0 preconditioned by rank 0 (which owns A0 and G0: no factor broadcast); layer 1 everywhere, its
    # A on rank 1 (broadcast), its G everywhere.
    layout = Layout(owners=(0, 0, 1, None), preconditioners=(0, None))
    inversion, preconditioning = layout_timelines(problem, layout)
    # Inversion: rank 0 inverts A0 (4) and G0 (2) = 6, sends nothing; rank 1 inverts A1 (3), broadcasts it
    # 3..4; everyone inverts G1 (1) after: max(6 + 1, 3 + 1, channel 4) = 7.
    assert inversion.owned_load_s == (6.0, 3.0) and inversion.everywhere_s == 1.0
    assert inversion.broadcasts == ((2, 3.0, 4.0),) and inversion.makespan_s == 7.0
    # Preconditioning: rank 0 preconditions layer 0 (6), broadcasts 6..7.5; everyone does layer 1 (2) after
    # its own: max(6 + 2, 0 + 2, 7.5) = 8.
    assert preconditioning.broadcasts == ((0, 6.0, 7.5),) and preconditioning.makespan_s == 8.0
    assert layout_value(problem, layout) == 7.0 / 2 + 8.0


def test_a_preconditioner_must_own_its_layers_factors() -> None:
    problem = small_problem()
    with pytest.raises(SolverError, match="first is preconditioned by rank 1, which must invert both"):
        check_layout(problem, Layout(owners=(1, 0, None, None), preconditioners=(1, None)))
    with pytest.raises(SolverError, match="0 <= rank < world_size"):
        check_layout(problem, Layout(owners=(2, 2, None, None), preconditioners=(None, None)))
    with pytest.raises(SolverError, match="4 owners and 2 preconditioners"):
        check_layout(problem, Layout(owners=(None,) * 3, preconditioners=(None, None)))


def _all_layouts(problem: LayoutProblem) -> list[Layout]:
    ranks = [None, *range(problem.world_size)]
    per_layer = [(a, g, None) for a in ranks for g in ranks] + [(w, w, w) for w in range(problem.world_size)]
    return [Layout(owners=tuple(o for c in combo for o in c[:2]), preconditioners=tuple(c[2] for c in combo))
            for combo in itertools.product(per_layer, repeat=problem.num_layers)]


@pytest.mark.parametrize("seed", range(4))
def test_the_model_prices_every_layout_as_the_evaluator(seed: int) -> None:
    """Fix the CP-SAT model to a layout and read its objective: it equals layout_value within the rounding."""
    problem = random_layout_problem(2, 2, 300 + seed, inv_update_steps=3)
    for layout in _all_layouts(problem):
        layout = canonical_layout(problem, layout)
        model = LayoutModel(problem, 2**24)
        model.fix(layout)
        solver = cp_model.CpSolver()
        assert solver.solve(model.model) == cp_model.OPTIMAL
        priced = model.seconds(solver.objective_value) / problem.inv_update_steps
        assert math.isclose(priced, layout_value(problem, layout), rel_tol=0,
                            abs_tol=CpSatLayout().tolerance_s(problem)), layout


CASES = [(n, p, seed) for n, p in ((1, 1), (3, 1), (6, 1), (2, 2), (4, 2), (5, 2), (6, 2), (2, 3), (4, 3), (5, 3))
         for seed in range(2)]


@pytest.mark.parametrize(("layers", "world_size", "seed"), CASES)
def test_the_exact_layout_equals_brute_force(layers: int, world_size: int, seed: int) -> None:
    problem = random_layout_problem(layers, world_size, 1000 * layers + 10 * world_size + seed,
                                    inv_update_steps=(1, 5, 10)[seed % 3])
    best, value = brute_force_layout(problem)
    solver = CpSatLayout(time_limit_s=10.0)
    result = solver.solve(problem)
    check_layout(problem, result.layout)
    assert result.optimal
    assert abs(result.value_s - value) <= solver.tolerance_s(problem), (result.layout, best)
    assert layout_lower_bound(problem) <= value * (1 + 1e-12)
    for baseline in LAYOUT_BASELINES:
        assert result.value_s <= baseline().solve(problem).value_s * (1 + 1e-12), baseline.name


def test_kaisa_layouts() -> None:
    """COMM_OPT and MEM_OPT share kfac-pytorch's owners (layers by summed d³ to the least-loaded worker, A and G
    together); MEM_OPT preconditions each layer on that owner."""
    problem = small_problem()  # summed d³: first 512 + 64 = 576, second 216 + 8 = 224
    comm, mem = KaisaCommOpt().solve(problem).layout, KaisaMemOpt().solve(problem).layout
    assert comm.owners == mem.owners == (0, 0, 1, 1)
    assert comm.preconditioners == (None, None) and mem.preconditioners == (0, 1)
