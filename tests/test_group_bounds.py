"""Group-size bounds of the exact solvers (DenseDP, TopkParetoDP) against brute force, and a curve's correction
(`planner.costmodel.curves.corrected`).

The rule (planner/solvers/grouping/base.py): a group's size is its dense gradient bytes; every group is at most
max_group_bytes unless it is a single layer, and at least min_group_bytes unless it is the last group.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.contracts.profile import FittedCurve
from planner.costmodel.costs import AffineCost, PiecewiseLinearCost
from planner.costmodel.curves import corrected, curve_model, fit_curve, worst_error
from planner.costmodel.measured import MAX_FIT_ERROR
from planner.costmodel.problem import GradientProblem, Grouping, groups_of
from planner.costmodel.simulator import simulate, validate_grouping
from planner.solvers import DenseDP, TopkParetoDP, within_group_bounds
from planner.testing import random_problem
from planner.types import GROUPING_STRATEGIES, SchemaError, SolverError, Strategy
from tests.factories import examples
from tests.test_solvers import all_groupings, problems, reference_topk_optimum

RTOL = 1e-9


# ----------------------------------------------------------------------------------------------------
# The rule, written out once more (scalar, independent of the solvers' vectorised version)


def group_allowed(problem: GradientProblem, start: int, end: int, low: int, high: int | None) -> bool:
    """Whether the group of layers start..end-1 obeys the bounds."""
    size = sum(problem.numel[start:end]) * problem.element_bytes
    if high is not None and size > high and end - start > 1:
        return False
    return not (size < low and end != problem.num_layers)


def allowed(problem: GradientProblem, grouping: Grouping, low: int, high: int | None) -> bool:
    return all(group_allowed(problem, r.start, r.stop, low, high) for r in groups_of(grouping))


def brute_force(problem: GradientProblem, low: int, high: int | None) -> float | None:
    """The least simulated iteration over every grouping the bounds allow; None when they allow none."""
    values = [simulate(problem, g).iteration_s for g in all_groupings(problem.num_layers)
              if allowed(problem, g, low, high)]
    return min(values, default=None)


def solver_for(problem: GradientProblem, low: int, high: int | None, prune: bool = True) -> DenseDP | TopkParetoDP:
    if problem.strategy is Strategy.DENSE:
        return DenseDP(min_group_bytes=low, max_group_bytes=high)
    return TopkParetoDP(prune=prune, min_group_bytes=low, max_group_bytes=high)


def check_bounded(problem: GradientProblem, low: int, high: int | None) -> None:
    expected = brute_force(problem, low, high)
    for prune in (True, False):
        solver = solver_for(problem, low, high, prune)
        if expected is None:
            with pytest.raises(SolverError, match="no grouping of the"):
                solver.solve_with_value(problem)
            continue
        grouping, value = solver.solve_with_value(problem)
        validate_grouping(problem, grouping)
        assert allowed(problem, grouping, low, high), f"{grouping} breaks the bounds ({low}, {high})"
        assert within_group_bounds(problem, grouping, min_group_bytes=low, max_group_bytes=high)
        simulated = simulate(problem, grouping).iteration_s
        assert math.isclose(value, simulated, rel_tol=RTOL), "the DP's own value differs from the simulator's"
        assert math.isclose(simulated, expected, rel_tol=RTOL)


@settings(deadline=None, max_examples=examples(200))
@given(data=st.data())
def test_within_group_bounds_is_the_rule(data: st.DataObject) -> None:
    problem = data.draw(problems(strategy=Strategy.DENSE, max_layers=8))
    low, high = data.draw(bounds(problem))
    grouping = data.draw(st.sampled_from(all_groupings(problem.num_layers)))
    got = within_group_bounds(problem, grouping, min_group_bytes=low, max_group_bytes=high)
    assert got == allowed(problem, grouping, low, high)


@st.composite
def bounds(draw: st.DrawFn, problem: GradientProblem) -> tuple[int, int | None]:
    """Bounds at interesting places: sizes of contiguous runs (ties), in between, or absent."""
    eb = problem.element_bytes
    runs = sorted({sum(problem.numel[i:j]) * eb for i in range(problem.num_layers)
                   for j in range(i + 1, problem.num_layers + 1)})
    total = runs[-1]
    value = st.one_of(st.sampled_from(runs), st.integers(1, total + 1))
    low = draw(st.one_of(st.just(0), value))
    high = draw(st.one_of(st.none(), value))
    if high is not None and high < low:
        low, high = high, low
    return low, high


# ----------------------------------------------------------------------------------------------------
# Exactness under the bounds


@pytest.mark.parametrize("strategy", list(GROUPING_STRATEGIES))
@settings(deadline=None, max_examples=examples(120))
@given(data=st.data())
def test_bounded_solvers_match_brute_force(strategy: Strategy, data: st.DataObject) -> None:
    """Both exact solvers find the best grouping among the allowed ones (up to 10 layers, every regime)."""
    problem = data.draw(problems(strategy=strategy, max_layers=10))
    low, high = data.draw(bounds(problem))
    check_bounded(problem, low, high)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("strategy", "density"), [(Strategy.DENSE, 0.01), (Strategy.TOPK, 0.01), (Strategy.TOPK, 1.0)])
def test_bounded_solvers_match_brute_force_on_realistic_instances(
    seed: int, strategy: Strategy, density: float
) -> None:
    """Eleven realistic layers (`planner.testing.random_problem` instances), bounds around the median layer size."""
    problem = random_problem(11, strategy, seed=300 + seed, density=density)
    sizes = np.sort(np.asarray(problem.numel) * problem.element_bytes)
    rng = np.random.default_rng(seed)
    low = int(sizes[len(sizes) // 2] * rng.uniform(0.5, 3.0)) if seed % 3 else 0
    high = None if seed % 3 == 1 else int(low + sizes[-1] * rng.uniform(0.5, 2.0))
    check_bounded(problem, low, high)


def reference_bounded_topk(problem: GradientProblem, low: int, high: int | None) -> float:
    """The plain Pareto-front reference DP of test_solvers, forming only groups the bounds allow."""
    return reference_topk_optimum(problem, lambda start, end: group_allowed(problem, start, end, low, high))


@pytest.mark.parametrize("seed", range(4))
def test_bounded_topk_pruning_is_exact_on_larger_instances(seed: int) -> None:
    """On 40 layers, branch and bound under the bounds agrees with a plain scalar Pareto DP under the bounds."""
    problem = random_problem(40, Strategy.TOPK, seed=400 + seed, density=(0.01, 0.1, 1.0, 0.01)[seed])
    sizes = np.sort(np.asarray(problem.numel) * problem.element_bytes)
    low, high = int(sizes[-3]), int(sizes[-1] * 2) if seed % 2 else None
    expected = reference_bounded_topk(problem, low, high)
    for prune in (True, False):
        grouping, value = TopkParetoDP(prune=prune, min_group_bytes=low, max_group_bytes=high).solve_with_value(problem)
        assert allowed(problem, grouping, low, high)
        assert math.isclose(value, expected, rel_tol=RTOL)
        assert math.isclose(simulate(problem, grouping).iteration_s, expected, rel_tol=RTOL)


# ----------------------------------------------------------------------------------------------------
# Without bounds nothing changes; the rule's corner cases


@pytest.mark.parametrize("strategy", list(GROUPING_STRATEGIES))
@settings(deadline=None, max_examples=examples(40))
@given(data=st.data())
def test_no_bounds_changes_nothing(strategy: Strategy, data: st.DataObject) -> None:
    """Default arguments, and bounds no group can reach, give the unbounded solver's grouping and value."""
    problem = data.draw(problems(strategy=strategy, max_layers=12))
    plain = DenseDP() if strategy is Strategy.DENSE else TopkParetoDP()
    total = sum(problem.numel) * problem.element_bytes
    reference = plain.solve_with_value(problem)
    for low, high in ((0, None), (0, total), (1, total)):
        grouping, value = solver_for(problem, low, high).solve_with_value(problem)
        assert grouping == reference[0] and value == reference[1]


def _tiny(strategy: Strategy, numel: tuple[int, ...]) -> GradientProblem:
    """Collectives so costly that one group for everything is best without bounds."""
    free = AffineCost(alpha=0.0, beta=0.0) if strategy is Strategy.TOPK else None
    return GradientProblem(
        strategy=strategy, forward_s=0.0, update_s=0.0, backward_s=(1e-3,) * len(numel), numel=numel,
        comm=AffineCost(alpha=1.0, beta=0.0), world_size=2, density=0.5 if free else None, select=free, decode=free,
    )


@pytest.mark.parametrize("strategy", list(GROUPING_STRATEGIES))
def test_rule_corner_cases(strategy: Strategy) -> None:
    """Single layers may exceed max; the last group may be below min; other groups, single or not, may not."""
    problem = _tiny(strategy, (100, 100, 100, 1000, 10))  # bytes: 400, 400, 400, 4000, 40
    assert solver_for(problem, 0, None).solve(problem) == (5,)  # fewest collectives win
    # max 1200 B: the 4000 B layer alone (a layer cannot be split), [0..2] fits, [3, 4] does not.
    assert solver_for(problem, 0, 1200).solve(problem) == (3, 4, 5)
    # min 800 B, max 4000 B: layer 0 (400 B) must merge; [2, 3] is too big, so [0..2], [3], and [4] (last).
    assert solver_for(problem, 800, 4000).solve(problem) == (3, 4, 5)
    # min = max = 1000 B: layer 0 is too small alone and every group holding it and more is too big.
    with pytest.raises(SolverError, match=r"no grouping of the 5 layers .*min_group_bytes=1000"):
        solver_for(problem, 1000, 1000).solve(problem)
    rule = {"min_group_bytes": 4000, "max_group_bytes": None}
    assert within_group_bounds(problem, (4, 5), **rule)  # [4] is 40 B but last
    assert not within_group_bounds(problem, (1, 5), **rule)  # [0] is 400 B and not last: no exemption
    assert within_group_bounds(problem, (3, 4, 5), min_group_bytes=0, max_group_bytes=1200)
    assert not within_group_bounds(problem, (3, 5), min_group_bytes=0, max_group_bytes=1200)  # [3, 4]: 4040 B


@pytest.mark.parametrize(("low", "high"), [(-1, None), (5, 4), (0, 0), (1.5, None), (0, 2.0), (True, None)])
def test_bad_bounds_are_refused(low: object, high: object) -> None:
    for cls in (DenseDP, TopkParetoDP):
        with pytest.raises(SolverError, match="must hold, but got"):
            cls(min_group_bytes=low, max_group_bytes=high)  # type: ignore[arg-type]


def test_solver_repr_names_the_bounds() -> None:
    assert repr(DenseDP(max_group_bytes=10)) == "DenseDP(min_group_bytes=0, max_group_bytes=10)"
    assert "min_group_bytes=3" in repr(TopkParetoDP(min_group_bytes=3))


# ----------------------------------------------------------------------------------------------------
# planner.costmodel.curves.corrected


def _curve(alpha: float, beta: float, noise: tuple[float, ...]) -> FittedCurve:
    sizes = [1 << s for s in range(10, 10 + 2 * len(noise), 2)]
    return fit_curve([(s, (alpha + beta * s) * (1 + e)) for s, e in zip(sizes, noise, strict=True)])


@pytest.mark.parametrize(("a", "b"), [(0.5, 2.0), (3.0, 0.25), (1.0, 1.7), (0.9, 1.0)])
def test_corrected_fit_is_the_scaled_affine_cost(a: float, b: float) -> None:
    curve = _curve(2e-4, 2e-9, (0.01, -0.02, 0.015, 0.0, -0.01))
    assert worst_error(curve) <= MAX_FIT_ERROR
    fixed = corrected(curve, a, b)
    assert fixed.alpha_s == pytest.approx(curve.alpha_s * a) and fixed.beta_s_per_byte == pytest.approx(
        curve.beta_s_per_byte * b)
    for (x, t), (x2, t2) in zip(curve.points, fixed.points, strict=True):
        assert x2 == x
        assert t2 == pytest.approx(max(0.0, t + (a - 1) * curve.alpha_s + (b - 1) * curve.beta_s_per_byte * x))
    model = curve_model(fixed)
    assert isinstance(model, AffineCost)
    for x in (1.0, 1e3, 1e6, 3e7):
        assert model.cost(x) == pytest.approx(curve.alpha_s * a + curve.beta_s_per_byte * b * x)
    assert fixed.fit_error >= 0 and fixed.fit_error == pytest.approx(curve.fit_error, abs=0.05)


def test_corrected_interpolation_moves_with_the_points() -> None:
    """Where the data is interpolated, the corrected model is the interpolation of the moved points."""
    curve = fit_curve([(1024, 1e-4), (4096, 1e-4), (16384, 9e-4), (65536, 1e-3), (262144, 5e-3)])
    assert worst_error(curve) > MAX_FIT_ERROR
    fixed = corrected(curve, 1.5, 1.2)
    model = curve_model(fixed)
    assert isinstance(model, PiecewiseLinearCost)
    da, db = 0.5 * curve.alpha_s, 0.2 * curve.beta_s_per_byte
    for x, t in curve.points:
        assert model.cost(float(x)) >= t + da + db * x - 1e-15  # the envelope only raises dips
    assert fixed.points[0][1] == pytest.approx(1e-4 + da + db * 1024)


def test_corrected_clamps_at_zero_and_identity() -> None:
    curve = FittedCurve(points=((100, 1e-6), (1000, 5e-4)), alpha_s=1e-4, beta_s_per_byte=4e-7, fit_error=0.5)
    fixed = corrected(curve, 0.25, 1.0)
    assert fixed.points[0] == (100, 0.0)  # 1e-6 - 0.75e-4 < 0
    assert corrected(curve, 1.0, 1.0) is curve
    assert FittedCurve.from_dict(fixed.to_dict(), "curve") == fixed


@pytest.mark.parametrize(("a", "b"), [(0.0, 1.0), (1.0, -2.0), (math.inf, 1.0), (1.0, math.nan), ("2", 1.0)])
def test_corrected_refuses_bad_scales(a: object, b: object) -> None:
    curve = _curve(2e-4, 2e-9, (0.0, 0.0, 0.0))
    with pytest.raises(SchemaError, match=r"`alpha_scale > 0 and beta_scale > 0` \(finite\) must hold, but got"):
        corrected(curve, a, b)  # type: ignore[arg-type]
