"""The mixed problem (a compressor per group): its timeline against the single-compressor one, and the exact
solver against brute force over every grouping x compressor choice on small random instances."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costmodel.costs import AffineCost, PiecewiseLinearCost
from planner.costmodel.mixed_simulator import CompressorCosts, MixedProblem, simulate_mixed, timeline_mixed
from planner.costmodel.problem import groups_of
from planner.costmodel.simulator import simulate
from planner.solvers import DenseDP, TopkParetoDP
from planner.solvers.compressor_choice import MixedParetoDP, ddp_buckets, mixed_lower_bound
from planner.testing import random_problem
from planner.types import Collective, Compressor, CompressorKind, SolverError, Strategy
from tests.factories import examples


def all_groupings(num_layers: int) -> list[tuple[int, ...]]:
    out = []
    for cuts in itertools.product((False, True), repeat=num_layers - 1):
        out.append((*(i + 1 for i, cut in enumerate(cuts) if cut), num_layers))
    return out


def brute_force(problem: MixedProblem, allowed: tuple[int, ...] | None = None) -> float:
    picks = allowed if allowed is not None else tuple(range(len(problem.compressors)))
    best = math.inf
    for grouping in all_groupings(problem.num_layers):
        for choice in itertools.product(picks, repeat=len(grouping)):
            best = min(best, simulate_mixed(problem, grouping, choice).iteration_s)
    return best


def random_mixed(num_layers: int, seed: int, *, sigma: float, kinds: str = "dfpt", kappa: float = 0.0) -> MixedProblem:
    """Random costs for up to four compressors: d(ense), f(p16), p(owersgd), t(op-k); PowerSGD's per-layer costs
    random with some layers (vectors) compressing nothing; comm stretch `kappa`."""
    rng = np.random.default_rng(seed)
    numel = tuple(int(x) for x in rng.integers(1_000, 2_000_000, num_layers))

    def affine(a: float, b: float) -> AffineCost:
        return AffineCost(alpha=a * rng.uniform(0.5, 2), beta=b * rng.uniform(0.5, 2))

    allreduce = affine(5e-4, 2e-9)
    compressors = []
    if "d" in kinds:
        compressors.append(CompressorCosts(compressor=Compressor(CompressorKind.DENSE),
                                           collective=Collective.ALLREDUCE, comm=allreduce, prepare=affine(2e-5, 1e-9)))
    if "f" in kinds:
        compressors.append(CompressorCosts(compressor=Compressor(CompressorKind.FP16), collective=Collective.ALLREDUCE,
                                           comm=allreduce, prepare=affine(3e-5, 2e-9), decode=affine(1e-5, 1e-9)))
    if "p" in kinds:
        matrices = tuple(int(x) for x in rng.integers(0, 3, num_layers))
        compressors.append(CompressorCosts(
            compressor=Compressor(CompressorKind.POWERSGD, rank=2), collective=Collective.ALLREDUCE, comm=allreduce,
            prepare=affine(2e-5, 1e-9), second_comm=allreduce,
            layer_prepare=tuple(float(x) for x in rng.uniform(1e-5, 3e-3, num_layers)),
            layer_middle=tuple(float(x) * (m > 0) for x, m in zip(rng.uniform(1e-5, 3e-3, num_layers), matrices,
                                                                    strict=True)),
            layer_decode=tuple(float(x) for x in rng.uniform(1e-5, 3e-3, num_layers)),
            layer_send=tuple(int(x) for x in rng.integers(100, 20_000, num_layers)),
            layer_second=tuple(int(x) * (m > 0) for x, m in zip(rng.integers(100, 20_000, num_layers), matrices,
                                                                  strict=True)),
            layer_matrices=matrices))
    if "t" in kinds:
        compressors.append(CompressorCosts(
            compressor=Compressor(CompressorKind.TOPK, density=0.01), collective=Collective.ALLGATHER,
            comm=affine(6e-4, 3e-9),
            prepare=PiecewiseLinearCost(xs=(1e3, 1e5, 1e7), ys=(1e-4, 8e-4, 9e-2)),
            decode=affine(3e-5, 2e-8)))
    return MixedProblem(forward_s=rng.uniform(1e-3, 1e-2), update_s=rng.uniform(1e-3, 5e-3),
                        backward_s=tuple(float(x) for x in rng.uniform(1e-4, 8e-3, num_layers)), numel=numel,
                        world_size=int(rng.integers(2, 9)), compressors=tuple(compressors), interference=sigma,
                        comm_stretch=kappa)


@settings(max_examples=examples(100), deadline=None)
@given(num_layers=st.integers(1, 6), seed=st.integers(0, 10**6), sigma=st.sampled_from([0.0, 0.4, 1.3]),
       kinds=st.sampled_from(["dfpt", "dp", "ft", "pt", "p", "dfp"]), kappa=st.sampled_from([0.0, 0.6, 2.0]))
def test_mixed_dp_equals_brute_force(num_layers: int, seed: int, sigma: float, kinds: str, kappa: float) -> None:
    """With interference and comm stretch, PowerSGD's second rounds among them."""
    problem = random_mixed(num_layers, seed, sigma=sigma, kinds=kinds, kappa=kappa)
    expected = brute_force(problem)
    for solver in (MixedParetoDP(), MixedParetoDP(prune=False)):
        solution = solver.solve(problem)
        assert solution.iteration_s == pytest.approx(expected, rel=1e-9)
        # the value is the simulated time of the solution it returns
        assert simulate_mixed(problem, solution.grouping, solution.choice).iteration_s == pytest.approx(
            solution.iteration_s, rel=1e-9)
    assert mixed_lower_bound(problem) <= expected * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_restricted_to_one_compressor_equals_brute_force_over_it(seed: int) -> None:
    problem = random_mixed(6, seed, sigma=0.5)
    overall = MixedParetoDP().solve(problem).iteration_s
    for c in range(len(problem.compressors)):
        only = MixedParetoDP(allowed=(c,)).solve(problem)
        assert set(only.choice) == {c}
        assert only.iteration_s == pytest.approx(brute_force(problem, (c,)), rel=1e-9)
        assert overall <= only.iteration_s * (1 + 1e-12)  # never worse than any one compressor everywhere


@pytest.mark.parametrize("strategy", [Strategy.DENSE, Strategy.TOPK])
@pytest.mark.parametrize(("sigma", "kappa"), [(0.0, 0.0), (0.7, 0.0), (0.0, 0.9), (0.7, 1.5)])
def test_one_compressor_is_the_single_strategy_timeline(strategy: Strategy, sigma: float, kappa: float) -> None:
    """A mixed problem holding only a dense (or top-k) problem's compressor predicts what `simulate` does for every
    grouping, with interference and comm stretch, and its exact solution matches DenseDP's (TopkParetoDP's)."""
    for seed in range(3):
        plain = dataclasses.replace(random_problem(7, strategy, seed=seed), interference=sigma, comm_stretch=kappa)
        mixed = MixedProblem.of(plain)
        for grouping in all_groupings(7)[::5]:
            expected = simulate(plain, grouping)
            got = simulate_mixed(mixed, grouping, (0,) * len(grouping))
            assert got.iteration_s == pytest.approx(expected.iteration_s, rel=1e-12)
            assert got.comm_s == pytest.approx(expected.comm_s, rel=1e-12)
        exact = (DenseDP() if strategy is Strategy.DENSE else TopkParetoDP()).solve_with_value(plain)[1]
        assert MixedParetoDP().solve(mixed).iteration_s == pytest.approx(exact, rel=1e-9)


def test_a_powersgd_group_waits_for_its_first_collective_then_sends_its_qs() -> None:
    problem = random_mixed(3, 5, sigma=0.0, kinds="p")
    c = problem.compressors[0]
    layers = [i for i in range(3) if c.layer_matrices[i]]
    assert layers, "the instance needs a compressed matrix"
    events = timeline_mixed(problem, (3,), (0,))
    (e,) = events
    assert e.second_start_s == e.comm_end_s  # the middle round starts when the first collective is done
    assert e.compute_end_s == pytest.approx(e.comm_end_s + e.middle_s)
    assert e.second_end_s == pytest.approx(e.compute_end_s + e.second_s)
    assert e.decode_start_s == pytest.approx(e.second_end_s)


def test_ddp_buckets_and_bad_choices() -> None:
    problem = random_mixed(5, 1, sigma=0.0)
    assert ddp_buckets(problem, cap_bytes=10**15, first_cap_bytes=None) == (5,)
    assert ddp_buckets(problem, cap_bytes=1, first_cap_bytes=1) == (1, 2, 3, 4, 5)
    with pytest.raises(SolverError, match="len\\(choice\\)"):
        simulate_mixed(problem, (2, 5), (0,))
    with pytest.raises(SolverError, match="outside"):
        simulate_mixed(problem, (5,), (9,))
    with pytest.raises(SolverError, match="allowed compressors"):
        MixedParetoDP(allowed=(7,)).solve(problem)


def test_solution_groups_name_their_compressors() -> None:
    problem = random_mixed(5, 2, sigma=0.3)
    solution = MixedParetoDP().solve(problem)
    assert [r.stop for r in groups_of(solution.grouping)] == list(solution.grouping)
    assert len(solution.choice) == len(solution.grouping)


def test_out_of_budget_returns_the_best_known_with_its_gap() -> None:
    """When the exact search stops at its budget, the answer is a valid solution, no worse than any compressor on
    DDP's buckets, per layer or in one group, not claimed optimal, with an honest gap to the lower bound."""
    problem = random_mixed(12, 3, sigma=0.6)
    stopped = MixedParetoDP(budget=1, time_limit_s=None).solve(problem)
    assert not stopped.proven and stopped.lower_bound_s is not None
    assert stopped.iteration_s == pytest.approx(
        simulate_mixed(problem, stopped.grouping, stopped.choice).iteration_s, rel=1e-12)
    exact = MixedParetoDP(time_limit_s=None).solve(problem)
    assert exact.proven and exact.gap == 0
    assert exact.iteration_s <= stopped.iteration_s * (1 + 1e-12)
    assert stopped.gap == pytest.approx(stopped.iteration_s / stopped.lower_bound_s - 1)
    assert stopped.lower_bound_s <= exact.iteration_s * (1 + 1e-9)
    for c in range(len(problem.compressors)):
        for grouping in ((12,), tuple(range(1, 13)), ddp_buckets(problem)):
            assert stopped.iteration_s <= simulate_mixed(problem, grouping, (c,) * len(grouping)).iteration_s * (
                1 + 1e-12)


@pytest.mark.parametrize(("kinds", "sigma", "kappa"), [("dp", 0.5, 0.8), ("pt", 0.0, 1.5), ("dfpt", 1.3, 0.3)])
def test_pruning_is_exact_with_comm_stretch(kinds: str, sigma: float, kappa: float) -> None:
    """On instances too large for brute force, branch and bound with the stretched and the mutual bounds finds
    the optimum of the search without pruning, and the lower bound stays below it."""
    problem = random_mixed(12, 7, sigma=sigma, kinds=kinds, kappa=kappa)
    pruned = MixedParetoDP(time_limit_s=None).solve(problem)
    plain = MixedParetoDP(prune=False).solve(problem)
    assert pruned.proven and pruned.iteration_s == pytest.approx(plain.iteration_s, rel=1e-9)
    assert mixed_lower_bound(problem) <= plain.iteration_s * (1 + 1e-9)
