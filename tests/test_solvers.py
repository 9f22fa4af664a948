"""Tests of the grouping solvers: exact solvers against brute force, baselines, lower bound, benchmark helpers."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from fractions import Fraction
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costmodel.costs import AffineCost, CostModel, PiecewiseLinearCost, ScaledCost
from planner.costmodel.problem import GradientProblem, Grouping, topk_count, topk_count_many
from planner.costmodel.simulator import simulate, validate_grouping
from planner.sessions.solver_bench import time_solvers
from planner.solvers import (
    BASELINES,
    DenseDP,
    FixedBuckets,
    GroupingSolver,
    HorovodCycle,
    MGSGreedy,
    MGWFBPGreedy,
    PerLayer,
    SingleBucket,
    TopkParetoDP,
    lower_bound,
    solve_exact,
)
from planner.solvers.grouping import base, bounds, pareto
from planner.testing import random_problem
from planner.types import GROUPING_STRATEGIES, SolverError, Strategy
from tests.factories import examples

RTOL = 1e-9


# ----------------------------------------------------------------------------------------------------
# Instances and brute force


def all_groupings(num_layers: int) -> list[Grouping]:
    """Every grouping of `num_layers` layers: 2^(L-1) of them."""
    cuts = range(1, num_layers)
    return [(*chosen, num_layers) for r in range(num_layers) for chosen in itertools.combinations(cuts, r)]


def brute_force(problem: GradientProblem) -> float:
    """The least simulated iteration over all groupings."""
    return min(simulate(problem, g).iteration_s for g in all_groupings(problem.num_layers))


def exact_solver(problem: GradientProblem) -> DenseDP | TopkParetoDP:
    return DenseDP() if problem.strategy is Strategy.DENSE else TopkParetoDP()


def _seconds(max_s: float) -> st.SearchStrategy[float]:
    """0 or a time of at least 1e-12 s: relative comparisons are meaningless near the smallest floats."""
    return st.one_of(st.just(0.0), st.floats(min(1e-12, max_s), max_s))


def _piecewise(draw: st.DrawFn, max_x: float, max_y: float) -> PiecewiseLinearCost:
    """Random measured points; the envelope makes them non-decreasing (concave, convex or neither)."""
    xs = sorted(draw(st.lists(st.floats(1.0, max_x), min_size=1, max_size=5, unique=True)))
    ys = draw(st.lists(_seconds(max_y), min_size=len(xs), max_size=len(xs)))
    return PiecewiseLinearCost(xs=tuple(xs), ys=tuple(ys))


def _cost(draw: st.DrawFn, kind: str, max_x: float, max_y: float) -> CostModel:
    if kind == "affine":
        return AffineCost(alpha=draw(_seconds(max_y / 4)), beta=draw(_seconds(max_y / max_x)))
    return _piecewise(draw, max_x, max_y)


@st.composite
def problems(
    draw: st.DrawFn, strategy: Strategy | None = None, max_layers: int = 9, comm_kind: str | None = None
) -> GradientProblem:
    """Small random instances in every regime (compute-bound, communication-bound, in between)."""
    num_layers = draw(st.integers(1, max_layers))
    strategy = strategy or draw(st.sampled_from(list(GROUPING_STRATEGIES)))
    topk = strategy is Strategy.TOPK
    comm_kind = comm_kind or draw(st.sampled_from(["affine", "piecewise"]))
    times = _seconds(1.0)
    density = draw(st.sampled_from([0.001, 0.01, 0.3, 1.0])) if topk else None
    # Half the instances have interference (compute slowed while a collective is in flight) and, if dense,
    # a packing cost: the two-clock dense problem.
    interference = draw(st.one_of(st.just(0.0), st.floats(0.0, 3.0)))
    pack = _cost(draw, "affine", 1e6, 0.5) if interference > 0 and draw(st.booleans()) else None
    # Half the instances have a comm stretch (collectives slowed while backward runs).
    stretch = draw(st.one_of(st.just(0.0), st.floats(0.0, 3.0)))
    return GradientProblem(
        strategy=strategy,
        forward_s=draw(times),
        update_s=draw(times),
        backward_s=tuple(draw(st.lists(times, min_size=num_layers, max_size=num_layers))),
        numel=tuple(draw(st.lists(st.integers(1, 10**6), min_size=num_layers, max_size=num_layers))),
        comm=_cost(draw, comm_kind, 1e7, draw(st.sampled_from([0.1, 1.0, 5.0]))),
        world_size=draw(st.integers(1, 8)),
        density=density,
        select=_cost(draw, draw(st.sampled_from(["affine", "piecewise"])), 1e7, 2.0) if topk else None,
        decode=_cost(draw, "affine", 1e8, 0.5) if topk else None,
        pack=pack,
        interference=interference,
        comm_stretch=stretch,
    )


def _with_piecewise_comm(problem: GradientProblem) -> GradientProblem:
    """The same instance with a measured-looking (interpolated, slightly concave) collective."""
    assert isinstance(problem.comm, AffineCost)
    xs = tuple(float(4**e) for e in range(3, 14))
    ys = tuple(problem.comm.alpha * (1 + 0.1 * i) + problem.comm.beta * x * 0.9 for i, x in enumerate(xs))
    return dataclasses.replace(problem, comm=PiecewiseLinearCost(xs=xs, ys=ys))


# ----------------------------------------------------------------------------------------------------
# Exact solvers


def _check_exact(problem: GradientProblem) -> None:
    grouping, value = exact_solver(problem).solve_with_value(problem)
    validate_grouping(problem, grouping)
    simulated = simulate(problem, grouping).iteration_s
    assert math.isclose(value, simulated, rel_tol=RTOL), "the DP's own value differs from the simulator's"
    assert math.isclose(simulated, brute_force(problem), rel_tol=RTOL)
    assert solve_exact(problem) == grouping


@pytest.mark.parametrize("comm_kind", ["affine", "piecewise"])
@settings(deadline=None, max_examples=examples(100))
@given(data=st.data())
def test_dense_dp_matches_brute_force(comm_kind: str, data: st.DataObject) -> None:
    """DenseDP's grouping is optimal over all 2^(L-1) groupings, and it reports its simulated time."""
    _check_exact(data.draw(problems(strategy=Strategy.DENSE, max_layers=10, comm_kind=comm_kind)))


@pytest.mark.parametrize("comm_kind", ["affine", "piecewise"])
@settings(deadline=None, max_examples=examples(150))
@given(data=st.data())
def test_topk_dp_matches_brute_force(comm_kind: str, data: st.DataObject) -> None:
    """TopkParetoDP's grouping is optimal over all 2^(L-1) groupings (densities up to 1.0), with its own value."""
    _check_exact(data.draw(problems(strategy=Strategy.TOPK, max_layers=10, comm_kind=comm_kind)))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("strategy", "density"), [(Strategy.DENSE, 0.01), (Strategy.TOPK, 0.01), (Strategy.TOPK, 1.0)])
@pytest.mark.parametrize("piecewise", [False, True])
@pytest.mark.parametrize("interference", [0.0, 0.4, 1.5])
def test_exact_matches_brute_force_on_realistic_instances(
    seed: int, strategy: Strategy, density: float, piecewise: bool, interference: float
) -> None:
    """Twelve realistic layers (`planner.testing.random_problem` instances), with affine and interpolated
    collectives, with and without interference (dense ones then also pay packing)."""
    problem = random_problem(12, strategy, seed=seed, density=density, interference=interference)
    _check_exact(_with_piecewise_comm(problem) if piecewise else problem)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kappa", [0.0, 0.8])
@pytest.mark.parametrize("strategy", [Strategy.DENSE, Strategy.TOPK])
def test_comm_stretch_matches_brute_force_on_realistic_instances(seed: int, kappa: float, strategy: Strategy) -> None:
    """Twelve realistic layers whose collectives run 1 + kappa times slower while backward runs, with and
    without interference (dense: and packing; the closed program and the two-clock search; top-k: the
    four-clock search, its decodes after backward)."""
    for sigma in (0.0, 0.5):
        _check_exact(random_problem(12, strategy, seed=seed, interference=sigma, comm_stretch=kappa))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("strategy", "kappa"), [(Strategy.DENSE, 0.0), (Strategy.DENSE, 0.7), (Strategy.TOPK, 0.0),
                                                  (Strategy.TOPK, 0.7)])
@pytest.mark.parametrize("interference", [0.3, 1.0])
def test_two_clock_pruning_is_exact_with_interference(
    seed: int, strategy: Strategy, kappa: float, interference: float
) -> None:
    """With interference (and a comm stretch), branch and bound (and, for dense, the canonical states
    and valley of the two-clock search) find the same optimum as the search without pruning, on instances
    too large for brute force."""
    problem = random_problem(30 + 10 * seed, strategy, seed=300 + seed, interference=interference,
                             comm_stretch=kappa)
    pruned, value = exact_solver(problem).solve_with_value(problem)
    plain, plain_value = pareto._pareto_solve(problem, base._GroupBounds(), prune=False)
    assert math.isclose(simulate(problem, plain).iteration_s, plain_value, rel_tol=RTOL)
    assert math.isclose(value, plain_value, rel_tol=RTOL)
    assert math.isclose(simulate(problem, pruned).iteration_s, value, rel_tol=RTOL)
    assert math.isclose(reference_topk_optimum(problem), value, rel_tol=RTOL)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("density", [0.01, 1.0])
def test_topk_pruning_is_exact(seed: int, density: float) -> None:
    """Branch and bound finds the same optimum as the plain Pareto DP on instances too large for brute force."""
    problem = random_problem(40 + 5 * seed, Strategy.TOPK, seed=100 + seed, density=density)
    if seed % 2:
        problem = _with_piecewise_comm(problem)
    pruned, value = TopkParetoDP().solve_with_value(problem)
    plain, plain_value = TopkParetoDP(prune=False).solve_with_value(problem)
    assert math.isclose(value, plain_value, rel_tol=RTOL)
    assert math.isclose(simulate(problem, pruned).iteration_s, simulate(problem, plain).iteration_s, rel_tol=RTOL)


def reference_topk_optimum(
    problem: GradientProblem, allowed: Callable[[int, int], bool] = lambda start, end: True
) -> float:
    """A plain Pareto-front DP over prefixes with scalar costs: no pruning, no shortcuts (the reference).
    Only groups [start, end) that `allowed` accepts are formed. Dense problems have no selection but may
    have packing; with interference sigma, work W started at C with the channel busy until E ends at
    C + W (1 + sigma) if that is before E, else at E + (W - (E - C) / (1 + sigma)) (written out here, not
    taken from `planner.costmodel.problem.advance`). A state is (C, E, V, D): compute and channel clocks, the decode
    chain V (each group decoded after its allgather, at 1 + sigma times its cost) and the decode sum D; at
    the end the decode chain starts at C and runs 1 + sigma times slower until E (the simulator's model).
    With comm stretch kappa, collectives take 1 + kappa times their cost; dense, the part of the channel after
    the last C is shrunk back by 1 + kappa at the end; top-k, decodes take 1 + kappa times their cost too, and
    the end X' so found is read as (kappa C + X') / (1 + kappa) (`planner.solvers.grouping.base._stretched`)."""
    topk = problem.strategy is Strategy.TOPK
    sigma, kappa = problem.interference, problem.comm_stretch

    def work_end(comp: float, chan: float, work: float) -> float:
        if chan <= comp or comp + work * (1 + sigma) <= chan:
            return comp + work * (1 + sigma if chan > comp else 1)
        return chan + work - (chan - comp) / (1 + sigma)

    fronts: list[list[tuple[float, float, float, float]]] = [[(0.0, 0.0, 0.0, 0.0)]]  # per prefix length
    for end in range(1, problem.num_layers + 1):
        states = []
        for start in range(end):
            if not allowed(start, end):
                continue
            numel = sum(problem.numel[start:end])
            backward = sum(problem.backward_s[start:end])
            prepare, decode = (0.0 if problem.pack is None else problem.pack.cost(numel)), 0.0
            if topk:
                assert problem.select is not None and problem.decode is not None
                prepare += problem.select.cost(numel)
                decode = (1 + kappa) * problem.decode.cost(problem.world_size * problem.k(numel))
            comm = (1 + kappa) * problem.comm.cost(problem.message_bytes(numel))
            for comp, chan, chain, total in fronts[start]:
                new_comp = work_end(comp, chan, backward + prepare)
                new_chan = max(new_comp, chan) + comm
                states.append((new_comp, new_chan, max(chain, new_chan) + (1 + sigma) * decode, total + decode))
        # A state is kept unless a kept one is <= in every component (the states are distinct, and a state's
        # dominators sort before it); the kept ones are compared with it at once, as rows of an array.
        candidates = sorted(set(states))
        kept = np.empty((len(candidates), 4))
        front: list[tuple[float, float, float, float]] = []
        for a in candidates:
            if not (kept[: len(front)] <= a).all(axis=1).any():
                kept[len(front)] = a
                front.append(a)
        fronts.append(front)

    def finish(comp: float, chan: float, chain: float, total: float) -> float:
        if comp >= chan:
            return comp + total / (1 + kappa)  # the decodes, stretched above, run at full speed
        if not topk:
            return comp + (chan - comp) / (1 + kappa)
        stretched = chan + (max(comp + (1 + sigma) * total, chain) - chan) / (1 + sigma)
        return (kappa * comp + stretched) / (1 + kappa)

    return problem.forward_s + min(finish(*state) for state in fronts[-1]) + problem.update_s


@pytest.mark.parametrize("chunk", [1, 64])
@pytest.mark.parametrize("seed", range(4))
def test_topk_dp_matches_a_plain_pareto_dp(seed: int, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Canonical states, expiry, the chunked front sweep, pruning and the banded Lagrangian bounds change
    nothing on 60-layer instances."""
    monkeypatch.setattr(pareto, "_FRONT_CHUNK", chunk)
    monkeypatch.setattr(pareto, "_CLOSED_RTOL", -1.0)  # search even where a heuristic reaches the root's bound
    lengths: list[np.ndarray] = []
    expiry = pareto._expiry
    monkeypatch.setattr(pareto, "_expiry", lambda *args: lengths.append(expiry(*args)) or lengths[-1])
    problem = random_problem(60, Strategy.TOPK, seed=200 + seed, density=(0.01, 0.1, 1.0, 1.0)[seed])
    expected = reference_topk_optimum(problem)
    for solver in (TopkParetoDP(), TopkParetoDP(prune=False)):
        grouping, value = solver.solve_with_value(problem)
        assert math.isclose(value, expected, rel_tol=RTOL)
        assert math.isclose(simulate(problem, grouping).iteration_s, expected, rel_tol=RTOL)
    assert lengths and np.concatenate(lengths).min() < 60  # states did expire: the test covers it


def reference_lagrangian(problem: GradientProblem, weights: np.ndarray) -> np.ndarray:
    """rest[w, m]: the least w-mix of the compute and channel path costs over the groupings of layers m..L-1
    (`planner.solvers.grouping.bounds._lagrangian_suffixes`), by the plain O(L^2) program with costs from the scalar
    model."""
    sigma, num_layers = problem.interference, problem.num_layers
    topk = problem.strategy is Strategy.TOPK
    rest = np.zeros((weights.size, num_layers + 1))
    for m in range(num_layers - 1, -1, -1):
        best = np.full(weights.size, np.inf)
        for j in range(m, num_layers):
            numel = sum(problem.numel[m : j + 1])
            comm = problem.comm.cost(problem.message_bytes(numel))
            decode = problem.decode_s(numel)
            last = j == num_layers - 1
            if topk:
                compute = problem.prepare_s(numel) + (decode + sigma * comm) / (1 + sigma)
                compute += sigma * decode / (1 + sigma) if last else 0.0
            else:
                compute = problem.prepare_s(numel) + comm * sigma / (1 + sigma) + (comm / (1 + sigma) if last else 0.0)
            channel = comm + (decode if last else 0.0)
            best = np.minimum(best, weights * compute + (1 - weights) * channel + rest[:, j + 1])
        rest[:, m] = best
    return rest


@pytest.mark.parametrize("strategy", list(GROUPING_STRATEGIES))
@pytest.mark.parametrize(("seed", "interference", "piecewise"), [(0, 0.0, False), (1, 0.0, True), (2, 0.7, True)])
def test_banded_lagrangian_bounds_lie_below_the_exact_program(
    strategy: Strategy, seed: int, interference: float, piecewise: bool
) -> None:
    """Costing first groups of up to `band` layers one by one and longer ones by lines under their costs
    gives bounds no larger than the plain program's (equal to it when the band covers every group), with
    expiry tables that never grow as the first group lengthens and groupings that are groupings."""
    problem = random_problem(70, strategy, seed=400 + seed, interference=interference)
    if piecewise:
        problem = _with_piecewise_comm(problem)
    prefix = base._prefix_numel(problem)
    reference = reference_lagrangian(problem, bounds._BOUND_WEIGHTS)
    full = bounds._lagrangian_suffixes(problem, prefix, band=problem.num_layers)
    assert np.allclose(full.rest, reference, rtol=1e-12, atol=0)
    for band in (1, 3, 8, 30):
        banded = bounds._lagrangian_suffixes(problem, prefix, band=band)
        assert np.all(banded.rest <= reference * (1 + 1e-12))
        assert np.all(banded.opened <= full.opened * (1 + 1e-12) + 1e-300)
        assert np.all(banded.opened[..., 1:] >= banded.opened[..., :-1])
        for grouping in banded.groupings:
            validate_grouping(problem, grouping)
    # The lines are not the zero line: a band of 1 still bounds the channel path by most of its cost.
    assert np.all(bounds._lagrangian_suffixes(problem, prefix, band=1).rest[0, :-1] >= 0.5 * reference[0, :-1])


@settings(deadline=None, max_examples=examples(100))
@given(problem=problems(strategy=Strategy.TOPK), band=st.integers(1, 3))
def test_topk_dp_with_a_narrow_band_matches_brute_force(problem: GradientProblem, band: int) -> None:
    """Exactness does not depend on the band of the Lagrangian bounds, nor on the root's bound ending the
    search early."""
    with mock.patch.object(bounds, "_LAGRANGIAN_BAND", band):
        _check_exact(problem)


def test_a_heuristic_that_reaches_the_root_bound_ends_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a heuristic's time equals the root's bound, nothing is searched, and the answer is what the
    search finds (on these instances the greedy rules and Lagrangian groupings are optimal)."""
    searches: list[int] = []
    search = pareto._pareto_search
    monkeypatch.setattr(pareto, "_pareto_search", lambda *a, **k: searches.append(1) or search(*a, **k))
    for seed in range(3):
        problem = random_problem(300, Strategy.TOPK, seed=500 + seed)
        searches.clear()
        grouping, value = TopkParetoDP().solve_with_value(problem)
        assert not searches
        with monkeypatch.context() as patch:
            patch.setattr(pareto, "_CLOSED_RTOL", -1.0)
            _, searched_value = TopkParetoDP().solve_with_value(problem)
        assert searches
        assert math.isclose(value, searched_value, rel_tol=1e-12)
        assert math.isclose(simulate(problem, grouping).iteration_s, value, rel_tol=RTOL)


@pytest.mark.parametrize("prefilter", [True, False])
def test_dense_two_clock_prefilter_is_exact(prefilter: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense with interference: pre-filtering the (C, E) candidates against a sample changes nothing."""
    monkeypatch.setattr(pareto, "_PREFILTER_MIN_STATES", 0 if prefilter else 10**9)
    problem = random_problem(40, Strategy.DENSE, seed=77, interference=0.5)
    grouping, value = DenseDP().solve_with_value(problem)
    assert math.isclose(value, reference_topk_optimum(problem), rel_tol=RTOL)
    assert math.isclose(simulate(problem, grouping).iteration_s, value, rel_tol=RTOL)


@settings(deadline=None, max_examples=examples(200))
@given(st.lists(st.tuples(*[st.integers(0, 3)] * 4), min_size=1, max_size=40), st.sampled_from([1, 3, 64]))
def test_four_clock_front_keeps_exactly_the_undominated(points: list[tuple[int, ...]], chunk: int) -> None:
    """The (C, E, V, D) front: every undominated state once (one of equal ones), no dominated one."""
    c, e, v, d = (np.asarray(x, dtype=float) for x in zip(*points, strict=True))
    previous, pareto._FRONT_CHUNK = pareto._FRONT_CHUNK, chunk
    try:
        kept = pareto._pareto_front(c, e, v, d)
    finally:
        pareto._FRONT_CHUNK = previous
    undominated = {p for p in points if not any(q != p and all(a <= b for a, b in zip(q, p, strict=True))
                                                 for q in points)}
    assert sorted(points[i] for i in kept) == sorted(undominated)
    assert list(c[kept]) == sorted(c[kept])


@settings(deadline=None, max_examples=examples(60))
@given(problems(max_layers=30))
def test_exact_never_worse_than_baselines(problem: GradientProblem) -> None:
    """No baseline beats the exact solver, and none beats the lower bound."""
    _, best = exact_solver(problem).solve_with_value(problem)
    bound = lower_bound(problem)
    assert bound <= best * (1 + RTOL)
    for baseline in (*BASELINES[problem.strategy], MGWFBPGreedy(), MGSGreedy()):
        value = simulate(problem, baseline.solve(problem)).iteration_s
        assert best <= value * (1 + RTOL), baseline.name


@pytest.mark.parametrize("strategy", list(GROUPING_STRATEGIES))
def test_exact_never_worse_than_baselines_at_scale(strategy: Strategy) -> None:
    """The same on a 300-layer realistic instance."""
    problem = random_problem(300, strategy, seed=7)
    _, best = exact_solver(problem).solve_with_value(problem)
    assert lower_bound(problem) <= best * (1 + RTOL)
    for baseline in BASELINES[strategy]:
        grouping, value = baseline.solve_with_value(problem)
        assert math.isclose(value, simulate(problem, grouping).iteration_s, rel_tol=RTOL)
        assert best <= value * (1 + RTOL), baseline.name


def test_exact_solvers_reject_the_other_strategy() -> None:
    dense = random_problem(5, Strategy.DENSE, seed=0)
    topk = random_problem(5, Strategy.TOPK, seed=0)
    with pytest.raises(SolverError, match="strategy == 'dense'"):
        DenseDP().solve(topk)
    with pytest.raises(SolverError, match="strategy == 'topk'"):
        TopkParetoDP().solve(dense)


def test_single_layer() -> None:
    for strategy in GROUPING_STRATEGIES:
        problem = random_problem(1, strategy, seed=3)
        assert solve_exact(problem) == (1,)
        assert all(b.solve(problem) == (1,) for b in BASELINES[strategy])


# ----------------------------------------------------------------------------------------------------
# Lower bound


@settings(deadline=None, max_examples=examples(200))
@given(problems(max_layers=10))
def test_lower_bound_is_below_the_optimum(problem: GradientProblem) -> None:
    """No grouping beats the lower bound (checked against brute force)."""
    assert lower_bound(problem) <= brute_force(problem) * (1 + RTOL)


def _tight_problem(strategy: Strategy, backward: tuple[float, ...], comm: AffineCost) -> GradientProblem:
    topk = strategy is Strategy.TOPK
    return GradientProblem(
        strategy=strategy,
        forward_s=0.7,
        update_s=0.2,
        backward_s=backward,
        numel=(1000, 30, 5000, 200),
        comm=comm,
        world_size=4,
        density=0.01 if topk else None,
        select=AffineCost(alpha=0.0, beta=1e-4) if topk else None,  # linear: merging changes nothing
        decode=AffineCost(alpha=0.0, beta=0.0) if topk else None,
    )


@pytest.mark.parametrize("strategy", list(GROUPING_STRATEGIES))
def test_lower_bound_is_tight_when_communication_is_free(strategy: Strategy) -> None:
    """Free collectives: the compute path is the optimum."""
    problem = _tight_problem(strategy, (0.1, 0.2, 0.3, 0.4), AffineCost(alpha=0.0, beta=0.0))
    optimum = brute_force(problem)
    # Dense: F + sum b + U = 0.7 + 1.0 + 0.2; top-k adds selection 1e-4 * 6230 = 0.623.
    expected = 1.9 if strategy is Strategy.DENSE else 1.9 + 0.623
    assert optimum == pytest.approx(expected)
    assert lower_bound(problem) == pytest.approx(optimum, rel=1e-12)


def test_lower_bound_is_tight_when_dense_is_communication_bound() -> None:
    """All gradients ready at once: one collective after the first gradient is the optimum and the bound."""
    problem = _tight_problem(Strategy.DENSE, (0.5, 0.0, 0.0, 0.0), AffineCost(alpha=1.0, beta=1e-4))
    # 0.7 + 0.5 + (1 + 1e-4 * 4 * 6230) + 0.2 = 0.7 + 0.5 + 3.492 + 0.2 = 4.892.
    assert brute_force(problem) == pytest.approx(4.892)
    assert lower_bound(problem) == pytest.approx(4.892, rel=1e-12)


# ----------------------------------------------------------------------------------------------------
# Baselines


def _problem_of(numel: tuple[int, ...], alpha: float = 0.5) -> GradientProblem:
    """Dense, every layer's backward 1 s, free bandwidth: T = alpha."""
    return GradientProblem(
        strategy=Strategy.DENSE,
        forward_s=0.0,
        update_s=0.0,
        backward_s=tuple(1.0 for _ in numel),
        numel=numel,
        comm=AffineCost(alpha=alpha, beta=0.0),
        world_size=2,
    )


def test_fixed_buckets_close_at_the_cap() -> None:
    """A bucket closes as soon as it holds >= cap bytes (PyTorch DDP's rule); the rest forms the last bucket."""
    problem = _problem_of((100, 200, 300, 50, 400, 10))  # bytes 400, 800, 1200, 200, 1600, 40
    # 400 + 800 = 1200 >= 1200: close after layer 1; 1200 >= 1200: close after 2; 200 + 1600 >= 1200: after 4.
    assert FixedBuckets(1200).solve(problem) == (2, 3, 5, 6)
    # First cap 400: 400 >= 400 closes at once; then 800 + 1200 >= 1200; 200 + 1600 >= 1200; 40 remains.
    assert FixedBuckets(1200, 400).solve(problem) == (1, 3, 5, 6)
    assert FixedBuckets(1201).solve(problem) == (3, 5, 6)  # 2400 >= 1201 after layer 2, 1800 after 4
    assert FixedBuckets(10**9).solve(problem) == (6,)
    assert FixedBuckets(1).solve(problem) == (1, 2, 3, 4, 5, 6)


def test_fixed_buckets_use_dense_bytes_for_topk() -> None:
    problem = random_problem(50, Strategy.TOPK, seed=1)
    dense = dataclasses.replace(problem, strategy=Strategy.DENSE, density=None, select=None, decode=None)
    solver = FixedBuckets(25 * 2**20, 2**20)
    assert solver.solve(problem) == solver.solve(dense)


def test_default_bucket_configurations() -> None:
    by_name = {b.name: b for b in BASELINES[Strategy.DENSE]}
    ddp, fixed, horovod = by_name["ddp-25mb"], by_name["fixed-64mb"], by_name["horovod"]
    assert isinstance(ddp, FixedBuckets) and isinstance(fixed, FixedBuckets) and isinstance(horovod, HorovodCycle)
    assert (ddp.cap_bytes, ddp.first_cap_bytes) == (25 * 1024 * 1024, 1024 * 1024)
    assert (fixed.cap_bytes, fixed.first_cap_bytes) == (64 * 1024 * 1024, None)
    assert (horovod.cycle_s, horovod.threshold_bytes) == (1e-3, 128 * 1024 * 1024)
    with pytest.raises(SolverError, match="cap_bytes > 0"):
        FixedBuckets(0)
    with pytest.raises(SolverError, match="cycle_s > 0"):
        HorovodCycle(cycle_s=0.0)


def test_baseline_registry() -> None:
    common = ["wfbp", "single", "ddp-25mb", "horovod", "fixed-64mb"]
    assert [b.name for b in BASELINES[Strategy.DENSE]] == [*common, "mg-wfbp"]
    assert [b.name for b in BASELINES[Strategy.TOPK]] == [*common, "mgs-greedy"]
    solvers: list[GroupingSolver] = [*BASELINES[Strategy.DENSE], *BASELINES[Strategy.TOPK], DenseDP(), TopkParetoDP()]
    for solver in solvers:
        assert isinstance(solver, GroupingSolver)
        assert solver.name and solver.description
        assert solver.exact is isinstance(solver, DenseDP | TopkParetoDP)
    with pytest.raises(TypeError):
        GroupingSolver()  # type: ignore[abstract]


@settings(deadline=None, max_examples=examples(80))
@given(problems(max_layers=20))
def test_baselines_give_valid_groupings(problem: GradientProblem) -> None:
    for solver in (*BASELINES[Strategy.DENSE], *BASELINES[Strategy.TOPK], FixedBuckets(10**5, 10**3)):
        grouping = solver.solve(problem)
        assert validate_grouping(problem, grouping) == grouping
    assert PerLayer().solve(problem) == tuple(range(1, problem.num_layers + 1))
    assert SingleBucket().solve(problem) == (problem.num_layers,)


def test_mgwfbp_rule_by_hand() -> None:
    """Two layers ready at 1 and 2 (dense, T = alpha): merge iff the wait 2 - 1 is below alpha."""
    # alpha = 0.5: the first collective runs 1 -> 1.5, before the next gradient (2): no merge.
    assert MGWFBPGreedy().solve(_problem_of((10, 10), alpha=0.5)) == (1, 2)
    # alpha = 2: the collective would run 1 -> 3, past 2, and waiting 1 < alpha saves a start-up: merge.
    assert MGWFBPGreedy().solve(_problem_of((10, 10), alpha=2.0)) == (2,)
    # Channel still busy with layer 0's collective when layer 1 is ready: layer 1 waits for it anyway, so
    # layer 2 joins it. Ready at 1, 2, 3; alpha = 1.5: 1 -> 2.5 (2 < 2.5 and 2 - 1 = 1 < 1.5: merge 0, 1);
    # group (0, 1) at 2 -> 3.5; 3 - 2 = 1 < 1.5: merge all.
    assert MGWFBPGreedy().solve(_problem_of((10, 10, 10), alpha=1.5)) == (3,)


def test_mgs_rule_by_hand() -> None:
    """Merge iff the delay (next backward + extra selection - idle wait) is below the start-up saved."""
    # Dense (s = 0), T = alpha: delay = b = 1, saving = alpha.
    assert MGSGreedy().solve(_problem_of((10, 10), alpha=0.5)) == (1, 2)
    assert MGSGreedy().solve(_problem_of((10, 10), alpha=2.0)) == (2,)
    # Top-k with selection s(N) = N^2 / 100 (superlinear): merging two layers of 10 adds s(20) - 2 s(10) = 2.
    select = PiecewiseLinearCost(xs=(10.0, 20.0, 30.0), ys=(1.0, 4.0, 9.0))
    problem = GradientProblem(
        strategy=Strategy.TOPK,
        forward_s=0.0,
        update_s=0.0,
        backward_s=(1.0, 1.0),
        numel=(10, 10),
        comm=AffineCost(alpha=2.5, beta=0.0),
        world_size=2,
        density=1.0,
        select=select,
        decode=AffineCost(alpha=0.0, beta=0.0),
    )
    assert MGSGreedy().solve(problem) == (1, 2)  # delay 1 + 2 = 3 >= saving 2.5
    assert MGSGreedy().solve(dataclasses.replace(problem, comm=AffineCost(alpha=3.5, beta=0.0))) == (2,)


# ----------------------------------------------------------------------------------------------------
# Vectorised model pieces and the benchmark helpers


@settings(deadline=None, max_examples=examples(60))
@given(problems(strategy=Strategy.TOPK), st.lists(st.integers(0, 10**9), min_size=1, max_size=20))
def test_vectorised_costs_match_the_scalar_model(problem: GradientProblem, sizes: list[int]) -> None:
    """The DPs' vectorised k, bytes and costs agree with GradientProblem and CostModel.cost."""
    array = np.asarray(sizes, dtype=np.int64)
    for strategy_problem in (problem, dataclasses.replace(problem, strategy=Strategy.DENSE)):
        got = base._message_bytes_many(strategy_problem, array)
        assert got.tolist() == [float(strategy_problem.message_bytes(n)) for n in sizes]
        comm = base._comm_many(strategy_problem, array)
        expected = [strategy_problem.comm.cost(strategy_problem.message_bytes(n)) for n in sizes]
        assert np.allclose(comm, expected, rtol=1e-12, atol=0)
    assert problem.decode is not None
    decode = base._decode_many(problem, array)
    assert np.allclose(decode, [problem.decode.cost(problem.world_size * problem.k(n)) for n in sizes], rtol=1e-12)


@settings(deadline=None, max_examples=examples(200))
@given(data=st.data(), kind=st.sampled_from(["affine", "piecewise"]), factor=st.floats(1e-3, 1e3))
def test_cost_model_lines_lie_under_the_cost(data: st.DataObject, kind: str, factor: float) -> None:
    """cost(x) >= a + b x for every line of every cost model, at any size > 0 (below, between and beyond the
    measured points), scaled or not."""
    model = _cost(data.draw, kind, 1e7, 1.0)
    xs = data.draw(st.lists(st.floats(1e-3, 1e12), min_size=1, max_size=30))
    for cost_model in (model, ScaledCost(inner=model, factor=factor)):
        lines = cost_model.lines()
        assert lines
        for x in xs:
            cost = cost_model.cost(x)
            assert all(a + b * x <= cost + 1e-12 * max(1.0, abs(cost)) for a, b in lines)


def test_random_problem_is_reproducible_and_valid() -> None:
    a = random_problem(30, Strategy.TOPK, seed=5, density=0.05, world_size=4)
    assert a == random_problem(30, Strategy.TOPK, seed=5, density=0.05, world_size=4)
    assert a != random_problem(30, Strategy.TOPK, seed=6, density=0.05, world_size=4)
    assert (a.num_layers, a.density, a.world_size) == (30, 0.05, 4)
    assert all(100 <= n <= 3_000_000 for n in a.numel)
    assert a.select is not None and a.select.cost(2e6) > 2 * a.select.cost(1e6)  # superlinear
    with pytest.raises(SolverError, match="num_layers >= 1"):
        random_problem(0, Strategy.DENSE, seed=0)


def test_time_solvers_rows() -> None:
    rows = time_solvers(num_layers=40, repeats=1, seed=2)
    assert {r["strategy"] for r in rows} == {"dense", "topk"}
    for strategy in GROUPING_STRATEGIES:
        mine = [r for r in rows if r["strategy"] == strategy.value]
        assert [r["solver"] for r in mine[1:]] == [b.name for b in BASELINES[strategy]]
        exact = mine[0]
        assert exact["exact"] is True
        assert all(exact["iteration_s"] <= r["iteration_s"] * (1 + RTOL) for r in mine)
        assert all(r["lower_bound_s"] <= exact["iteration_s"] * (1 + RTOL) for r in mine)
        assert all(r["median_s"] >= 0 and r["num_groups"] >= 1 for r in mine)


# ----------------------------------------------------------------------------------------------------
# k of a top-k group


def test_topk_count_is_exact_where_a_float_tolerance_was_not() -> None:
    """ceil(0.07 * 279,620,300) = ceil(19,573,421.0) = 19,573,421: the density is read as the decimal 7/100."""
    assert topk_count(279_620_300, 0.07) == 19_573_421
    assert topk_count(7, 0.3) == 3 and topk_count(10, 0.3) == 3 and topk_count(1, 0.001) == 1


@settings(deadline=None, max_examples=examples(300))
@given(numel=st.integers(1, 2**31 - 1), digits=st.integers(1, 7), mantissa=st.integers(1, 10**7))
def test_topk_count_matches_rational_arithmetic(numel: int, digits: int, mantissa: int) -> None:
    density = min(1.0, mantissa / 10**digits)
    exact = Fraction(repr(density)) * numel
    expected = min(numel, max(1, math.ceil(exact)))
    assert topk_count(numel, density) == expected
    assert topk_count_many(np.array([numel, numel]), density).tolist() == [expected, expected]


def _four_layers(comm_s: float) -> GradientProblem:
    """Dense, ready at 0.4, 0.8, 2.8 and 3.2 ms, 10 elements (40 bytes) each; every collective takes comm_s."""
    return GradientProblem(strategy=Strategy.DENSE, forward_s=0.0, update_s=0.0, backward_s=(4e-4, 4e-4, 2e-3, 4e-4),
                           numel=(10, 10, 10, 10), comm=AffineCost(alpha=comm_s, beta=0.0), world_size=2)


def test_horovod_fuses_what_is_ready_at_each_cycle() -> None:
    """1 ms cycles: the tick at 1 ms finds layers 0 and 1; the one at 3 ms finds layer 2 (layer 3 comes at 3.2)."""
    assert HorovodCycle().solve(_four_layers(1e-4)) == (2, 3, 4)
    # A slow channel: the first collective runs until 5.8 ms, so the tick at 6 ms fuses layers 2 and 3.
    assert HorovodCycle().solve(_four_layers(5e-3)) == (2, 4)
    # A 50-byte threshold keeps every fused buffer to one 40-byte layer.
    assert HorovodCycle(threshold_bytes=50).solve(_four_layers(5e-3)) == (1, 2, 3, 4)
    # No waiting for a threshold's worth: the 64 MiB fixed buckets make one bucket of the same layers.
    assert FixedBuckets(64 * 2**20).solve(_four_layers(1e-4)) == (4,)


@pytest.mark.parametrize("strategy", list(GROUPING_STRATEGIES))
def test_lower_bound_counts_the_tail_sent_after_the_last_gradient(strategy: Strategy) -> None:
    """A big last layer, ready late: whatever the grouping its gradient is sent after it is ready, so the bound
    is R_1 + T(n_1) (+ its selection and decode), the optimum; counting the channel from the first gradient
    on gave 1 s less."""
    topk = strategy is Strategy.TOPK
    problem = GradientProblem(
        strategy=strategy, forward_s=0.0, update_s=0.0, backward_s=(0.1, 1.0), numel=(10, 10**6),
        comm=AffineCost(alpha=0.1, beta=1e-6 if not topk else 1e-4), world_size=2, density=0.01 if topk else None,
        select=AffineCost(alpha=0.0, beta=1e-8) if topk else None,
        decode=AffineCost(alpha=0.0, beta=0.0) if topk else None,
    )
    optimum = brute_force(problem)
    # Top-k: the bound leaves out layer 0's 1e-7 s of selection, which delays layer 1 in every grouping.
    assert optimum * (1 - 1e-7) <= lower_bound(problem) <= optimum * (1 + 1e-12)


@pytest.mark.parametrize("strategy", list(GROUPING_STRATEGIES))
@pytest.mark.parametrize("sigma", [0.0, 0.4])
def test_candidate_evaluation_matches_the_simulator(strategy: Strategy, sigma: float) -> None:
    """The solvers' vectorised walk of a grouping (closed form without interference) is the simulator's."""
    rng = np.random.default_rng(7)
    problem = random_problem(60, strategy, seed=11, interference=sigma)
    fixed = problem.forward_s + problem.update_s
    for _ in range(30):
        cuts = rng.choice(np.arange(1, 60), size=int(rng.integers(0, 25)), replace=False)
        grouping = (*sorted(int(c) for c in cuts), 60)
        assert math.isclose(fixed + base._iteration_end(problem, grouping),
                            simulate(problem, grouping).iteration_s, rel_tol=1e-12)
