"""Per-buffer factor formats (planner.solvers.packing): exact against brute force, and what the plan makes of it."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from planner.contracts.kfac_section import KFACLayerSpec, KFACSection
from planner.solvers.fusion import FusionDP, simulate_fusion
from planner.solvers.packing import PackingDP, PackingProblem, simulate_packing
from planner.testing import brute_force_packing, random_packing_problem
from planner.types import SchemaError, SolverError

UNBOUNDED = 10**9

INSTANCES = [(1 + seed % 4, 1 + (seed // 4) % 4, seed, seed % 3) for seed in range(48)]


@pytest.mark.parametrize(("n_a", "n_g", "seed", "n_grads"), INSTANCES)
def test_packing_dp_equals_brute_force(n_a: int, n_g: int, seed: int, n_grads: int) -> None:
    problem = random_packing_problem(n_a, n_g, seed, n_grads=n_grads)
    choice, value = PackingDP(max_states=UNBOUNDED).solve_with_value(problem)
    _, best = brute_force_packing(problem)
    assert value == pytest.approx(best, rel=1e-12)
    assert simulate_packing(problem, *choice).value_s == pytest.approx(value, rel=1e-12)


def _best_uniform(problem: PackingProblem) -> float:
    """The best value when every buffer has one format (the plan-level choice), by brute force."""
    best = float("inf")
    for whole in (False, True):
        a = (whole,) * problem.num_a
        g = (whole,) * problem.num_g
        fusion = problem.fusion(a, g)
        buffers = FusionDP().solve(fusion)
        value = simulate_packing(
            problem, buffers, ((whole,) * len(buffers[0]), (whole,) * len(buffers[1]))
        ).value_s
        packing = sum(p[whole] for p in problem.a_pack_s + problem.g_pack_s)
        folding = sum(f[whole] for f in problem.a_fold_s + problem.g_fold_s)
        channel = simulate_fusion(fusion, buffers).end_s
        assert value == pytest.approx(max(problem.compute_end_s + packing, channel) + folding, rel=1e-12)
        best = min(best, value)
    return best


def test_per_buffer_formats_beat_one_format_for_all_on_some_instances() -> None:
    """Choosing per buffer is never worse than the best single format, and strictly better on some instances
    (where early buffers hide behind compute and late ones are exposed)."""
    strictly_better = 0
    for n_a, n_g, seed, n_grads in INSTANCES:
        problem = random_packing_problem(n_a, n_g, seed, n_grads=n_grads)
        (_, (a_fmt, g_fmt)), value = PackingDP(max_states=UNBOUNDED).solve_with_value(problem)
        uniform = _best_uniform(problem)
        assert value <= uniform * (1 + 1e-12)
        if value < uniform * (1 - 1e-9):
            strictly_better += 1
            assert len(set(a_fmt + g_fmt)) == 2  # a strict gain needs both formats
    assert strictly_better >= 3


def test_same_cost_both_ways_reduces_to_the_fusion_dp() -> None:
    """With formats that cost the same, the value is the fusion DP's channel end (or compute end) + folding."""
    base = random_packing_problem(3, 3, 7, n_grads=2)
    same = replace(
        base,
        a_bytes=tuple((b[0], b[0]) for b in base.a_bytes), g_bytes=tuple((b[0], b[0]) for b in base.g_bytes),
        a_pack_s=tuple((0.0, 0.0) for _ in base.a_pack_s), g_pack_s=tuple((0.0, 0.0) for _ in base.g_pack_s),
        a_fold_s=tuple((1e-3, 1e-3) for _ in base.a_fold_s), g_fold_s=tuple((1e-3, 1e-3) for _ in base.g_fold_s),
    )
    _, value = PackingDP().solve_with_value(same)
    fusion = same.fusion((False,) * 3, (False,) * 3)
    channel = simulate_fusion(fusion, FusionDP().solve(fusion)).end_s
    assert value == pytest.approx(max(channel, same.compute_end_s) + 6e-3, rel=1e-12)


def test_too_many_prefixes_is_refused_in_one_line() -> None:
    problem = random_packing_problem(4, 4, 3, n_grads=2)
    with pytest.raises(SolverError, match="more than 1 undominated buffer prefixes"):
        PackingDP(max_states=1).solve(problem)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"a_bytes": ((1, 2),)}, "one pair per factor"),
        ({"a_pack_s": ((1.0,), (1.0, 2.0))}, r"must be a pair"),
        ({"a_fold_s": ((-1.0, 0.0), (0.0, 0.0))}, "times >= 0"),
        ({"grad_after_g": (3, 1)}, "non-decreasing"),
        ({"compute_end_s": 0.0}, "compute_end_s"),
    ],
)
def test_bad_packing_problems_are_refused(change: dict, match: str) -> None:
    base = random_packing_problem(2, 2, 1, n_grads=2)
    with pytest.raises(SolverError, match=match):
        replace(base, **change)


def test_a_section_with_mixed_formats_round_trips_and_is_validated() -> None:
    layers = [KFACLayerSpec(name=n, a_dim=3, g_dim=2) for n in ("a", "b")]
    section = replace(KFACSection.simple(layers), mixed_whole=frozenset({"a.A", "b.G"}))
    assert [section.sends_whole(f) for f in section.factor_names()] == [True, False, False, True]
    data = json.loads(json.dumps(section.to_dict()))
    assert data["factor_messages"] == {"whole": ["a.A", "b.G"]}
    assert KFACSection.from_dict(data).factor_formats() == section.factor_formats()
    # one format for every factor is said plainly
    everything = replace(KFACSection.simple(layers), mixed_whole=frozenset(section.factor_names()))
    assert everything.whole_factors and everything.mixed_whole is None
    assert everything.to_dict()["factor_messages"] == "whole"
    for bad, match in (({"whole": ["c.A"]}, "factors the section does not have"),
                       ({"whole": ["a.A", "a.A"]}, "names a factor twice"),
                       ({"whole": "a.A"}, "must be list"),
                       ({"triangle": []}, "factor_messages"),
                       ("halves", "must be 'upper-triangle', 'whole' or")):
        with pytest.raises(SchemaError, match=match):
            KFACSection.from_dict({**data, "factor_messages": bad})


def test_choices_are_all_enumerated_by_brute_force() -> None:
    """The brute force really covers every buffer choice with every format per buffer: 2^(n-1) groupings
    per kind, 2 formats per buffer."""
    problem = random_packing_problem(2, 3, 5, n_grads=1)
    seen = set()
    for a_ends, g_ends in itertools.product([(1, 2), (2,)], [(1, 2, 3), (1, 3), (2, 3), (3,)]):
        for a_fmt in itertools.product((False, True), repeat=len(a_ends)):
            for g_fmt in itertools.product((False, True), repeat=len(g_ends)):
                seen.add(simulate_packing(problem, (a_ends, g_ends), (a_fmt, g_fmt)).value_s)
    assert brute_force_packing(problem)[1] == min(seen)
