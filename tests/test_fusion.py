"""Tests of K-FAC factor fusion: the channel simulator, the exact DP against brute force, and the baselines."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costmodel.costs import AffineCost, CostModel, PiecewiseLinearCost
from planner.solvers.fusion import (
    FUSION_BASELINES,
    CommEvent,
    FixedBytes,
    FusionDP,
    FusionProblem,
    FusionSolver,
    PerFactor,
    SingleBuffer,
    SpdKfacGreedy,
    simulate_fusion,
    validate_buffers,
)
from planner.testing import brute_force_fusion, random_fusion_problem
from planner.types import SolverError
from tests.factories import examples

RTOL = 1e-12
MIB = 2**20


# ----------------------------------------------------------------------------------------------------
# Instances


def _piecewise(draw: st.DrawFn) -> PiecewiseLinearCost:
    """Random measured points up to 4 MB (the envelope makes them non-decreasing; concave, convex or neither)."""
    xs = sorted(draw(st.lists(st.floats(1.0, 4e6), min_size=1, max_size=5, unique=True)))
    ys = draw(st.lists(st.floats(0.0, 2.0), min_size=len(xs), max_size=len(xs)))
    return PiecewiseLinearCost(xs=tuple(xs), ys=tuple(ys))


def _measured_like(problem: FusionProblem) -> FusionProblem:
    """The same instance with an interpolated, slightly concave allreduce instead of alpha + beta * x."""
    assert isinstance(problem.allreduce, AffineCost)
    alpha, beta = problem.allreduce.alpha, problem.allreduce.beta
    xs = tuple(float(4**e) for e in range(3, 14))
    ys = tuple(alpha * (1 + 0.1 * i) + beta * x * 0.9 for i, x in enumerate(xs))
    return dataclasses.replace(problem, allreduce=PiecewiseLinearCost(xs=xs, ys=ys))


@st.composite
def fusion_problems(draw: st.DrawFn, cost_kind: str, max_factors: int = 10, grads: bool = True) -> FusionProblem:
    """Small instances; on a coarse time grid, ready times often tie (gradients with G factors too)."""
    n_a = draw(st.integers(1, max_factors - 1))
    n_g = draw(st.integers(1, max_factors - n_a))
    n_grads = draw(st.integers(0, 4)) if grads else 0
    grid = st.integers(0, 6).map(lambda t: 0.5 * t)  # a coarse grid: many ties
    times = grid if draw(st.booleans()) else st.floats(0.0, 3.0)
    a_ready = sorted(draw(st.lists(times, min_size=n_a, max_size=n_a)))
    start = a_ready[-1]
    g_ready = sorted(start + t for t in draw(st.lists(times, min_size=n_g, max_size=n_g)))
    # Gradients ready with some G factor (a tie) or anywhere in backward.
    grad_ready = sorted(
        draw(st.one_of(st.sampled_from(g_ready), times.map(lambda t: start + t))) for _ in range(n_grads)
    )
    sizes = st.integers(1, 10**6)
    cost: CostModel
    if cost_kind == "affine":
        cost = AffineCost(alpha=draw(st.floats(0.0, 1.0)), beta=draw(st.floats(0.0, 2e-6)))
    else:
        cost = _piecewise(draw)
    return FusionProblem(
        a_ready_s=tuple(a_ready),
        a_bytes=tuple(draw(st.lists(sizes, min_size=n_a, max_size=n_a))),
        g_ready_s=tuple(g_ready),
        g_bytes=tuple(draw(st.lists(sizes, min_size=n_g, max_size=n_g))),
        grad_ready_s=tuple(grad_ready),
        grad_bytes=tuple(draw(st.lists(sizes, min_size=n_grads, max_size=n_grads))),
        allreduce=cost,
    )


def _check_optimal(problem: FusionProblem) -> None:
    buffers, value = FusionDP().solve_with_value(problem)
    assert validate_buffers(problem, buffers) == buffers
    assert value == simulate_fusion(problem, buffers).end_s
    _, best = brute_force_fusion(problem)
    assert math.isclose(value, best, rel_tol=RTOL), (value, best)


# ----------------------------------------------------------------------------------------------------
# The exact DP


@pytest.mark.parametrize("cost_kind", ["affine", "piecewise"])
@settings(deadline=None, max_examples=examples(150))
@given(data=st.data())
def test_dp_matches_brute_force(cost_kind: str, data: st.DataObject) -> None:
    """FusionDP's buffers are optimal over all 2^(n_a-1) * 2^(n_g-1) choices, ties and gradients included."""
    _check_optimal(data.draw(fusion_problems(cost_kind)))


@pytest.mark.parametrize("cost_kind", ["affine", "piecewise"])
@settings(deadline=None, max_examples=examples(40))
@given(data=st.data())
def test_dp_matches_brute_force_without_gradients(cost_kind: str, data: st.DataObject) -> None:
    _check_optimal(data.draw(fusion_problems(cost_kind, grads=False)))


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("measured", [False, True])
def test_dp_matches_brute_force_on_random_instances(seed: int, measured: bool) -> None:
    """Plausible instances of 2-6 layers (4-12 factors), 0 to n_layers gradient groups."""
    n_layers = 2 + seed % 5
    problem = random_fusion_problem(n_layers, seed, n_grads=seed % (n_layers + 1))
    _check_optimal(_measured_like(problem) if measured else problem)


def test_dp_matches_brute_force_when_gradients_tie_with_every_g_factor() -> None:
    """Every G factor ties with a gradient collective: each goes after its gradient."""
    for seed in range(8):
        base = random_fusion_problem(5, seed, n_grads=0)
        problem = dataclasses.replace(base, grad_ready_s=base.g_ready_s, grad_bytes=tuple(reversed(base.g_bytes)))
        _check_optimal(problem)
        _check_optimal(_measured_like(problem))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("measured", [False, True])
def test_dp_never_worse_than_baselines_at_scale(seed: int, measured: bool) -> None:
    """120-300 layers (240-600 factors) with 0 to 100 gradient groups."""
    n_layers = (120, 200, 250, 300)[seed]
    problem = random_fusion_problem(n_layers, 50 + seed, n_grads=(0, 10, 40, 100)[seed])
    problem = _measured_like(problem) if measured else problem
    _, best = FusionDP().solve_with_value(problem)
    for baseline in FUSION_BASELINES:
        buffers, value = baseline.solve_with_value(problem)
        assert validate_buffers(problem, buffers) == buffers
        assert best <= value * (1 + RTOL), baseline.name


@settings(deadline=None, max_examples=examples(60))
@given(fusion_problems("affine", max_factors=40) | fusion_problems("piecewise", max_factors=40))
def test_dp_never_worse_than_baselines(problem: FusionProblem) -> None:
    _, best = FusionDP().solve_with_value(problem)
    for baseline in (*FUSION_BASELINES, FixedBytes(10**6)):
        assert best <= baseline.solve_with_value(problem)[1] * (1 + RTOL), baseline.name


def test_dp_handles_a_thousand_factors() -> None:
    """1000 factors and 100 gradient collectives: a valid layout no worse than the baselines (speed is benched)."""
    problem = random_fusion_problem(500, 3, n_grads=100)
    buffers, best = FusionDP().solve_with_value(problem)
    assert buffers[0][-1] == problem.num_a and buffers[1][-1] == problem.num_g
    for baseline in FUSION_BASELINES:
        assert best <= baseline.solve_with_value(problem)[1] * (1 + RTOL), baseline.name


def test_dp_merges_a_factors_that_are_ready_together() -> None:
    """All A factors ready at once: one A buffer saves start-ups; an idle channel between G factors splits G.

    T(x) = 1 + 0.1 x: A (30 B) 1 -> 5; G0 (10 B) 10 -> 12, G1 20 -> 22 (one G buffer would run 20 -> 23).
    """
    problem = FusionProblem(
        a_ready_s=(1.0, 1.0, 1.0),
        a_bytes=(10, 10, 10),
        g_ready_s=(10.0, 20.0),
        g_bytes=(10, 10),
        grad_ready_s=(),
        grad_bytes=(),
        allreduce=AffineCost(alpha=1.0, beta=0.1),
    )
    assert FusionDP().solve_with_value(problem) == (((3,), (1, 2)), 22.0)
    assert simulate_fusion(problem, ((3,), (1, 2))).a_end_s == 5.0


# ----------------------------------------------------------------------------------------------------
# The simulator


def _hand_problem() -> FusionProblem:
    """2 A, 2 G and 2 gradient collectives; T(x) = 1 + 0.001 x, so T(1000) = 2, T(2000) = 3, T(500) = 1.5."""
    return FusionProblem(
        a_ready_s=(1.0, 2.0),
        a_bytes=(1000, 1000),
        g_ready_s=(5.0, 6.0),
        g_bytes=(1000, 1000),
        grad_ready_s=(5.0, 7.0),  # the first ties with G0
        grad_bytes=(500, 500),
        allreduce=AffineCost(alpha=1.0, beta=0.001),
        a_names=("l0.A", "l1.A"),
        g_names=("l1.G", "l0.G"),
    )


def test_simulate_per_factor_by_hand() -> None:
    """A0 1->3, A1 3->5; grad0 (ready 5, ties with G0 and goes first) 5->6.5; G0 6.5->8.5; G1 8.5->10.5;
    grad1 (ready 7) 10.5->12."""
    timeline = simulate_fusion(_hand_problem(), ((1, 2), (1, 2)))
    assert [(e.kind, e.index, e.members, e.ready_s, e.start_s, e.end_s, e.bytes) for e in timeline.events] == [
        ("A", 0, range(0, 1), 1.0, 1.0, 3.0, 1000),
        ("A", 1, range(1, 2), 2.0, 3.0, 5.0, 1000),
        ("grad", 0, range(0, 1), 5.0, 5.0, 6.5, 500),
        ("G", 0, range(0, 1), 5.0, 6.5, 8.5, 1000),
        ("G", 1, range(1, 2), 6.0, 8.5, 10.5, 1000),
        ("grad", 1, range(1, 2), 7.0, 10.5, 12.0, 500),
    ]
    assert (timeline.a_end_s, timeline.end_s) == (5.0, 12.0)
    assert (timeline.factor_comm_s, timeline.grad_comm_s, timeline.num_buffers) == (8.0, 3.0, 4)


def test_simulate_single_buffers_by_hand() -> None:
    """A (ready 2) 2->5; grad0 5->6.5; G (ready 6, 2000 B) 6.5->9.5; grad1 (ready 7) 9.5->11."""
    timeline = simulate_fusion(_hand_problem(), ((2,), (2,)))
    assert [(e.kind, e.start_s, e.end_s) for e in timeline.events] == [
        ("A", 2.0, 5.0),
        ("grad", 5.0, 6.5),
        ("G", 6.5, 9.5),
        ("grad", 9.5, 11.0),
    ]
    assert (timeline.a_end_s, timeline.end_s, timeline.factor_comm_s, timeline.grad_comm_s) == (5.0, 11.0, 6.0, 3.0)
    assert timeline.num_buffers == 2
    assert brute_force_fusion(_hand_problem()) == (((2,), (2,)), 11.0)
    assert FusionDP().solve(_hand_problem()) == ((2,), (2,))


def test_simulate_tie_puts_the_gradient_first_on_an_idle_channel() -> None:
    """With an idle channel at the tie, the gradient (ready 5) starts at 5 and G0 (ready 5) waits for it."""
    problem = dataclasses.replace(_hand_problem(), a_ready_s=(0.0, 0.0))  # one A buffer: 0 -> 3
    events = simulate_fusion(problem, ((2,), (1, 2))).events
    assert [(e.kind, e.index, e.start_s, e.end_s) for e in events[1:3]] == [("grad", 0, 5.0, 6.5), ("G", 0, 6.5, 8.5)]


def test_simulate_all_gradients_before_or_after() -> None:
    """Gradients ready before every G factor go first; with none, the channel holds factors only."""
    problem = dataclasses.replace(_hand_problem(), grad_ready_s=(2.0, 2.0))  # ready at the end of forward
    kinds = [e.kind for e in simulate_fusion(problem, ((1, 2), (2,))).events]
    assert kinds == ["A", "A", "grad", "grad", "G"]
    bare = dataclasses.replace(_hand_problem(), grad_ready_s=(), grad_bytes=())
    timeline = simulate_fusion(bare, ((1, 2), (1, 2)))
    assert [e.kind for e in timeline.events] == ["A", "A", "G", "G"]
    assert (timeline.end_s, timeline.grad_comm_s) == (9.0, 0.0)  # G0 5->7, G1 7->9


@pytest.mark.parametrize(
    ("buffers", "match"),
    [
        (((1, 2),), "a pair"),
        ("ab", "A buffers: ends must be ints"),
        (((), (2,)), "A buffers: need at least one buffer"),
        (((0, 2), (2,)), r"A buffers: `ends\[0\] > 0`"),
        (((2, 1), (2,)), "A buffers: ends must be strictly ascending"),
        (((2,), (1,)), r"G buffers: `ends\[-1\] == 2`"),
        (((2,), (1.0, 2)), "G buffers: ends must be ints"),
        (((True, 2), (2,)), "A buffers: ends must be ints"),
    ],
)
def test_simulate_rejects_invalid_buffers(buffers: object, match: str) -> None:
    with pytest.raises(SolverError, match=match):
        simulate_fusion(_hand_problem(), buffers)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------
# Baselines


def test_per_factor_and_single() -> None:
    problem = random_fusion_problem(7, 0)
    assert PerFactor().solve(problem) == ((1, 2, 3, 4, 5, 6, 7), (1, 2, 3, 4, 5, 6, 7))
    assert simulate_fusion(problem, PerFactor().solve(problem)).num_buffers == 14
    assert SingleBuffer().solve(problem) == ((7,), (7,))
    assert simulate_fusion(problem, SingleBuffer().solve(problem)).num_buffers == 2


def test_fixed_bytes_close_at_the_cap() -> None:
    """A buffer closes as soon as it holds >= 25 MiB; A and G are filled apart; the rest is the last buffer."""
    problem = dataclasses.replace(
        _hand_problem(),
        a_ready_s=(1.0, 1.0, 1.0, 1.0, 1.0),
        a_bytes=(10 * MIB, 15 * MIB, 5 * MIB, 30 * MIB, MIB),  # 25 >= 25: close; 5 + 30 >= 25: close; 1 remains
        g_ready_s=(5.0, 6.0, 7.0),
        g_bytes=(25 * MIB - 1, 1, 25 * MIB),  # 25 MiB - 1 < cap; + 1 reaches it; then 25 MiB alone
        a_names=(),
        g_names=(),
    )
    solver = FixedBytes()
    assert (solver.name, solver.cap_bytes) == ("25mb", 25 * MIB)
    assert solver.solve(problem) == ((2, 4, 5), (2, 3))
    assert FixedBytes(10**9).solve(problem) == ((5,), (3,))
    assert FixedBytes(1).solve(problem) == ((1, 2, 3, 4, 5), (1, 2, 3))
    assert FixedBytes(1).name == "fixed-1b"
    with pytest.raises(SolverError, match="cap_bytes > 0"):
        FixedBytes(0)


def _greedy_problem(grad_ready_s: tuple[float, ...]) -> FusionProblem:
    """Every allreduce takes 1 s; A (ready 0) runs 0->1; G factors ready at 2 and 3.5."""
    return FusionProblem(
        a_ready_s=(0.0,),
        a_bytes=(10,),
        g_ready_s=(2.0, 3.5),
        g_bytes=(10, 10),
        grad_ready_s=grad_ready_s,
        grad_bytes=(10,) * len(grad_ready_s),
        allreduce=AffineCost(alpha=1.0, beta=0.0),
    )


def test_spd_greedy_rule_by_hand() -> None:
    """The next factor joins the open buffer iff it is ready before the buffer's allreduce would end if sent now."""
    greedy = SpdKfacGreedy()
    # G0 alone would run 2 -> 3; G1 is ready at 3.5 and waiting 1.5 is not below alpha = 1: split.
    assert greedy.solve(_greedy_problem(())) == ((1,), (1, 2))
    # A gradient ready at 2 (a tie: it goes first) runs 2 -> 3, so G0 would run 3 -> 4, past 3.5: merge.
    assert greedy.solve(_greedy_problem((2.0,))) == ((1,), (2,))
    # A gradient ready at 2.5 goes after G0 (2 -> 3), so it does not delay it: split.
    assert greedy.solve(_greedy_problem((2.5,))) == ((1,), (1, 2))
    # A phase: A1 is ready at 0.5 while A0's allreduce (0 -> 1) would still run: merge.
    problem = dataclasses.replace(_greedy_problem(()), a_ready_s=(0.0, 0.5, 1.9), a_bytes=(10, 10, 10))
    assert greedy.solve(problem)[0] == (2, 3)  # (A0, A1) would run 0.5 -> 1.5; A2 at 1.9 waits 1.4 >= 1: split
    assert greedy.solve(dataclasses.replace(problem, a_ready_s=(0.0, 0.5, 1.4)))[0] == (3,)


def test_spd_greedy_merges_short_waits() -> None:
    """Waiting less than the start-up cost for the next factor merges it (with T >= alpha this is implied)."""
    problem = dataclasses.replace(_greedy_problem(()), g_ready_s=(2.0, 2.9))
    assert SpdKfacGreedy().solve(problem) == ((1,), (2,))


def test_baseline_registry() -> None:
    assert [b.name for b in FUSION_BASELINES] == ["per-factor", "single", "25mb", "spd-greedy"]
    for solver in (*FUSION_BASELINES, FusionDP()):
        assert isinstance(solver, FusionSolver)
        assert solver.name and solver.description and repr(solver)
        assert solver.exact is isinstance(solver, FusionDP)
    assert FusionDP().name == "fusion-dp"
    with pytest.raises(TypeError):
        FusionSolver()  # type: ignore[abstract]


@settings(deadline=None, max_examples=examples(60))
@given(fusion_problems("affine", max_factors=30) | fusion_problems("piecewise", max_factors=30))
def test_every_solver_gives_valid_buffers(problem: FusionProblem) -> None:
    for solver in (*FUSION_BASELINES, FusionDP(), FixedBytes(10**5)):
        buffers = solver.solve(problem)
        assert validate_buffers(problem, buffers) == buffers
    assert PerFactor().solve(problem) == (tuple(range(1, problem.num_a + 1)), tuple(range(1, problem.num_g + 1)))
    assert SingleBuffer().solve(problem) == ((problem.num_a,), (problem.num_g,))


def test_single_factor_each() -> None:
    problem = random_fusion_problem(1, 4)
    assert (problem.num_a, problem.num_g, problem.num_grads) == (1, 1, 1)
    for solver in (*FUSION_BASELINES, FusionDP()):
        assert solver.solve(problem) == ((1,), (1,))


# ----------------------------------------------------------------------------------------------------
# Validation and random instances


def _valid() -> dict[str, object]:
    return {
        "a_ready_s": (1.0, 2.0),
        "a_bytes": (10, 20),
        "g_ready_s": (3.0, 4.0),
        "g_bytes": (30, 40),
        "grad_ready_s": (3.5,),
        "grad_bytes": (50,),
        "allreduce": AffineCost(alpha=1.0, beta=0.0),
    }


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"a_ready_s": (), "a_bytes": ()}, "no A factors"),
        ({"g_ready_s": (), "g_bytes": ()}, "no G factors"),
        ({"a_bytes": (10,)}, r"`len\(a_ready_s\) == len\(a_bytes\)` must hold, but got \(2, 1\)"),
        ({"grad_bytes": ()}, r"`len\(grad_ready_s\) == len\(grad_bytes\)`"),
        ({"a_ready_s": (2.0, 1.0)}, r"`a_ready_s` must be non-decreasing.*a_ready_s\[1\]=1.0"),
        ({"g_ready_s": (4.0, 3.0)}, "`g_ready_s` must be non-decreasing"),
        ({"grad_ready_s": (3.5, 3.0), "grad_bytes": (1, 1)}, "`grad_ready_s` must be non-decreasing"),
        ({"a_ready_s": (-1.0, 2.0)}, r"`a_ready_s\[0\] >= 0`"),
        ({"g_ready_s": (3.0, math.nan)}, r"`g_ready_s\[1\] >= 0` must hold \(finite\)"),
        ({"g_ready_s": (1.5, 4.0)}, r"`g_ready_s\[0\] >= a_ready_s\[-1\]`.*g_ready_s\[0\]=1.5, a_ready_s\[-1\]=2.0"),
        ({"grad_ready_s": (1.0,)}, r"`grad_ready_s\[0\] >= a_ready_s\[-1\]`"),
        ({"a_bytes": (10, 0)}, r"`a_bytes\[1\] > 0` must hold, but got a_bytes\[1\]=0"),
        ({"grad_bytes": (-5,)}, r"`grad_bytes\[0\] > 0`"),
        ({"g_names": ("x",)}, r"`len\(g_names\) == len\(g_ready_s\)` must hold, but got \(1, 2\)"),
    ],
)
def test_problem_validation(changes: dict[str, object], match: str) -> None:
    with pytest.raises(SolverError, match=match):
        FusionProblem(**{**_valid(), **changes})  # type: ignore[arg-type]


def test_problem_accepts_sequences_and_stores_tuples() -> None:
    problem = FusionProblem(**{**_valid(), "a_ready_s": [1, 2], "a_bytes": [10, 20]})  # type: ignore[arg-type]
    assert problem.a_ready_s == (1.0, 2.0) and problem.a_bytes == (10, 20)
    assert problem == FusionProblem(**_valid())  # type: ignore[arg-type]
    assert (problem.num_a, problem.num_g, problem.num_grads) == (2, 2, 1)


def test_brute_force_refuses_large_instances() -> None:
    with pytest.raises(SolverError, match=r"`n_a \+ n_g <= 16` must hold for brute force, but got 18"):
        brute_force_fusion(random_fusion_problem(9, 0))


def test_random_fusion_problem() -> None:
    a = random_fusion_problem(30, 5, n_grads=6)
    assert a == random_fusion_problem(30, 5, n_grads=6)
    assert a != random_fusion_problem(30, 6, n_grads=6)
    assert (a.num_a, a.num_g, a.num_grads) == (30, 30, 6)
    assert a.a_names[0] == "layer0.A" and a.g_names[0] == "layer29.G"
    assert all(2 * 16 * 17 <= b <= 2 * 4608 * 4609 for b in a.a_bytes)
    assert a.grad_ready_s[-1] <= a.g_ready_s[-1]
    assert random_fusion_problem(30, 5).num_grads == 6  # n_layers // 5
    assert random_fusion_problem(30, 5, n_grads=0).grad_ready_s == ()
    with pytest.raises(SolverError, match="n_layers >= 1"):
        random_fusion_problem(0, 0)
    with pytest.raises(SolverError, match="0 <= n_grads <= n_layers"):
        random_fusion_problem(3, 0, n_grads=4)


def test_comm_event_is_frozen() -> None:
    event = simulate_fusion(_hand_problem(), ((2,), (2,))).events[0]
    assert isinstance(event, CommEvent)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.start_s = 0.0  # type: ignore[misc]
