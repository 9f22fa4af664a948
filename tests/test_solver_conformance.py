"""One conformance test over every solver behind the project's four solver interfaces: gradient grouping
(`GroupingSolver`), K-FAC factor fusion (`FusionSolver`), inversion placement (`PlacementSolver`) and the K-FAC
layout of inversions and preconditioning (`LayoutSolver`). Whatever
its method, a solver names itself, answers deterministically with a valid decision, reports the value its
family's evaluator gives that decision, never beats the lower bound, and, if it says it is exact (or proven
optimal), matches brute force. The per-family test files go deeper; a new solver must pass this first."""

from __future__ import annotations

import math
from typing import Any

import pytest

from planner.costmodel.simulator import simulate, validate_grouping
from planner.solvers import BASELINES, DenseDP, GroupingSolver, TopkParetoDP, lower_bound
from planner.solvers.fusion import FUSION_BASELINES, FusionDP, FusionSolver, simulate_fusion, validate_buffers
from planner.solvers.layout import (
    LAYOUT_BASELINES,
    LAYOUT_SOLVERS,
    LayoutSolver,
    check_layout,
    layout_lower_bound,
    layout_value,
)
from planner.solvers.placement import (
    PLACEMENT_BASELINES,
    PLACEMENT_SOLVERS,
    PlacementSolver,
    makespan,
    placement_lower_bound,
)
from planner.testing import (
    brute_force_fusion,
    brute_force_layout,
    brute_force_placement,
    random_fusion_problem,
    random_layout_problem,
    random_placement_problem,
    random_problem,
)
from planner.types import GROUPING_STRATEGIES, SolverError, Strategy
from tests.test_solvers import brute_force

RTOL = 1e-9


def _grouping_cases() -> list[tuple[GroupingSolver, Strategy]]:
    cases: list[tuple[GroupingSolver, Strategy]] = [(DenseDP(), Strategy.DENSE), (TopkParetoDP(), Strategy.TOPK)]
    cases += [(solver, strategy) for strategy in GROUPING_STRATEGIES for solver in BASELINES[strategy]]
    return cases


def _named(solver: Any, exact: bool | None = None) -> None:
    assert isinstance(solver.name, str) and solver.name and solver.name == solver.name.strip()
    assert isinstance(solver.description, str) and solver.description
    if exact is not None:
        assert solver.exact is exact


@pytest.mark.parametrize(("solver", "strategy"), _grouping_cases(), ids=lambda v: getattr(v, "name", str(v)))
def test_grouping_solvers_conform(solver: GroupingSolver, strategy: Strategy) -> None:
    _named(solver, exact=solver.exact)
    for seed, sigma in ((0, 0.0), (1, 0.0), (2, 0.6)):
        problem = random_problem(9, strategy, seed=700 + seed, interference=sigma)
        grouping, value = solver.solve_with_value(problem)
        validate_grouping(problem, grouping)
        assert solver.solve(problem) == grouping  # deterministic
        assert math.isclose(value, simulate(problem, grouping).iteration_s, rel_tol=RTOL)
        assert lower_bound(problem) <= value * (1 + RTOL)
        if solver.exact:
            assert math.isclose(value, brute_force(problem), rel_tol=RTOL)


def test_exact_grouping_solvers_refuse_the_other_strategy() -> None:
    for solver, strategy in _grouping_cases()[:2]:
        other = Strategy.TOPK if strategy is Strategy.DENSE else Strategy.DENSE
        with pytest.raises(SolverError):
            solver.solve(random_problem(4, other, seed=0))


@pytest.mark.parametrize("solver", [FusionDP(), *FUSION_BASELINES], ids=lambda s: s.name)
def test_fusion_solvers_conform(solver: FusionSolver) -> None:
    _named(solver, exact=solver.exact)
    for seed in range(3):
        problem = random_fusion_problem(4, 800 + seed)
        buffers, value = solver.solve_with_value(problem)
        assert validate_buffers(problem, buffers) == buffers
        assert solver.solve(problem) == buffers
        assert math.isclose(value, simulate_fusion(problem, buffers).end_s, rel_tol=RTOL)
        best = brute_force_fusion(problem)[1]
        assert best <= value * (1 + RTOL)
        if solver.exact:
            assert math.isclose(value, best, rel_tol=RTOL)


def _placement_solvers() -> list[PlacementSolver]:
    return [*(cls() for cls in PLACEMENT_BASELINES),
            *(cls(time_limit_s=5.0, shortcuts=False) for cls in PLACEMENT_SOLVERS.values())]


@pytest.mark.parametrize("solver", _placement_solvers(), ids=lambda s: s.name)
def test_placement_solvers_conform(solver: PlacementSolver) -> None:
    _named(solver)
    for seed in range(3):
        problem = random_placement_problem(5, 2, 900 + seed)
        result = solver.solve(problem)
        assert result.solver == solver.name and len(result.placement) == problem.num_factors
        assert solver.solve(problem).placement == result.placement
        assert math.isclose(result.makespan_s, makespan(problem, result.placement), rel_tol=RTOL)
        assert placement_lower_bound(problem) <= result.makespan_s * (1 + RTOL)
        assert result.lower_bound_s <= result.makespan_s
        best = brute_force_placement(problem)[1]
        assert best <= result.makespan_s * (1 + RTOL)
        if result.optimal:
            assert math.isclose(result.makespan_s, best, rel_tol=1e-6)


def _layout_solvers() -> list[LayoutSolver]:
    return [*(cls() for cls in LAYOUT_BASELINES), *(cls(time_limit_s=5.0) for cls in LAYOUT_SOLVERS.values())]


@pytest.mark.parametrize("solver", _layout_solvers(), ids=lambda s: s.name)
def test_layout_solvers_conform(solver: LayoutSolver) -> None:
    _named(solver)
    for seed in range(3):
        problem = random_layout_problem(3, 2, 950 + seed)
        result = solver.solve(problem)
        check_layout(problem, result.layout)
        assert result.solver == solver.name
        assert solver.solve(problem).layout == result.layout
        assert math.isclose(result.value_s, layout_value(problem, result.layout), rel_tol=RTOL)
        assert layout_lower_bound(problem) <= result.value_s * (1 + RTOL)
        assert result.lower_bound_s <= result.value_s
        best = brute_force_layout(problem)[1]
        assert best <= result.value_s * (1 + RTOL)
        if result.optimal:
            assert result.value_s - best <= 1e-6 * result.value_s
