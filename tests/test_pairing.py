"""Crossover pairing (Muri-style): the two-job fluid model, the exact pairing solver, the pairing plan and
`planner pair`."""

from __future__ import annotations

import copy
import itertools
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.commands.cli import main
from planner.contracts.pairing import (
    JobPhases,
    JobPrediction,
    PairingJob,
    PairingPlan,
    check_job_plan,
    job_phases,
    plan_fingerprint,
)
from planner.contracts.plan import Plan
from planner.costmodel.crossover import alone, muri_period, simulate_pair
from planner.sessions.pair import job_names, load_job_plan, make_pairing, parse_batch
from planner.solvers.pairing import Pairing, best_pairing, pairing_period
from planner.strategies.gradients import make_plan
from planner.types import PlanMismatchError, PlannerError, SchemaError, SolverError, Strategy
from tests.factories import abs_section, examples, synthetic_profile
from tests.test_contracts import _main, _one_clear_line


def job(compute: float, comm: float, name: str = "j", samples: int = 1) -> JobPhases:
    return JobPhases(name=name, compute_s=compute, comm_s=comm, samples=samples)


def close(got: Sequence[float], want: Sequence[float], rel: float = 1e-9) -> bool:
    return all(math.isclose(g, w, rel_tol=rel) for g, w in zip(got, want, strict=True))


# -- the two-job model ------------------------------------------------------------------------------------


def test_side_by_side_keeps_the_offset_the_jobs_start_with() -> None:
    # Equal jobs (c = n = 1 s): started together they share each resource for 2 s, a period of 4 s; started
    # interleaved each has a resource to itself all along, a period of 2 s. Unequal phases (c 96.5 ms, n 60 ms,
    # the two MLP jobs of the README): 313 ms in lockstep, 193 interleaved, 193 crossed over.
    equal = JobPhases("e", compute_s=1.0, comm_s=1.0, samples=1)
    assert close(simulate_pair(equal, equal, gated=False), [4, 4])
    assert close(simulate_pair(equal, equal, gated=False, interleaved=True), [2, 2])
    mlp = JobPhases("m", compute_s=0.0965, comm_s=0.060, samples=512)
    assert close(simulate_pair(mlp, mlp, gated=False), [0.313, 0.313])
    assert close(simulate_pair(mlp, mlp, gated=False, interleaved=True), [0.193, 0.193])
    assert close(simulate_pair(mlp, mlp, gated=True), [0.193, 0.193])
    compute_only = JobPhases("c", compute_s=1.0, comm_s=0.0, samples=1)  # nothing to interleave with
    assert close(simulate_pair(equal, compute_only, gated=False, interleaved=True),
                 simulate_pair(equal, compute_only, gated=False))


def test_equal_jobs_alternate_crossed_over_and_run_in_lockstep_side_by_side() -> None:
    a, b = job(1, 1, "a"), job(1, 1, "b")
    # Crossed over: A computes [0, 1] while B waits; then B computes [1, 2] while A communicates, and so on:
    # each job computes and communicates once every 2 s, as fast as alone.
    assert close(simulate_pair(a, b, gated=True), (2, 2))
    # Side by side: both compute at half rate for 2 s, then both communicate at half rate for 2 s.
    assert close(simulate_pair(a, b, gated=False), (4, 4))
    assert alone(a) == 2 and muri_period(a, b) == 2


def test_a_job_without_communication_shares_the_device_in_turns() -> None:
    # A (c=1, n=0) and B (c=1, n=1) crossed over: A [0, 1], B [1, 2] while A waits, A [2, 3] while B
    # communicates; at t=3 A hands over and asks again just as B asks: B goes first. Period 2 each.
    assert close(simulate_pair(job(1, 0), job(1, 1), gated=True), (2, 2))
    # A (c=1, n=0) and B (c=2, n=5): B computes 2 s, then communicates 5 s in which A computes 5 times; at the
    # end A hands over as B asks, so B computes next. Per 7 s B makes one iteration, A five: 7/5 s each.
    assert close(simulate_pair(job(1, 0), job(2, 5), gated=True), (1.4, 7))
    # Two jobs that only compute: in turns crossed over, at half rate side by side; 2 s each either way.
    assert close(simulate_pair(job(1, 0), job(1, 0), gated=True), (2, 2))
    assert close(simulate_pair(job(1, 0), job(1, 0), gated=False), (2, 2))


def test_complementary_jobs_cross_over_as_fast_as_alone() -> None:
    a, b = job(1, 3, "a"), job(3, 1, "b")
    # Crossed over: A computes [0, 1] (B waits), then B computes [1, 4] while A communicates [1, 4]; at t=4 B
    # hands over and A (asking at the same instant) computes [4, 5] while B communicates [4, 5]; from then on
    # every 4 s each job computes and communicates once: max(cA, nB) + max(nA, cB) = max(1, 1) + max(3, 3) = 4,
    # each job's alone time, against cA + nA + cB + nB = 8 one after the other.
    assert close(simulate_pair(a, b, gated=True), (4, 4))
    assert muri_period(a, b) == 4
    # Side by side: both compute at half rate until A's 1 s is done at t=2 (B did 1 of 3); B computes alone to
    # t=4 while A communicates alone (2 of 3 done); then both communicate at half rate: 1 s each left, done at
    # t=6. Then the cycle repeats: 6 s each.
    assert close(simulate_pair(a, b, gated=False), (6, 6))


def test_crossing_over_can_make_a_job_slower() -> None:
    # A (c=0.1, n=1.05) and B (c=1, n=0). Crossed over, A's communication outlasts B's compute by 0.05 s, so B
    # takes the free device again and A waits for it: A computes [2.1, 2.2], communicates to 3.25, waits until
    # B is done at 4.2, ...: A's period 2.1, B's 1.05 (two iterations per 2.1 s).
    a, b = job(0.1, 1.05), job(1, 0)
    assert close(simulate_pair(a, b, gated=True), (2.1, 1.05))
    # Side by side A computes its 0.1 s at half rate (0.2 s) and communicates 1.05 s alone: 1.25 s. B does
    # 0.1 + 1.05 = 1.15 s of work in those 1.25 s: 1.25 / 1.15 s per iteration.
    assert close(simulate_pair(a, b, gated=False), (1.25, 1.25 / 1.15))


def test_a_far_faster_partner_is_fast_forwarded() -> None:
    # A makes 100,000 iterations in each of B's 10 s of communication, and waits 1 s while B computes.
    a, b = job(1e-4, 0), job(1, 10)
    assert close(simulate_pair(a, b, gated=True), (11 / 1e5, 11), rel=1e-6)
    # Side by side, A runs at half rate while B computes (2 s) and B's iteration takes 12 s.
    assert close(simulate_pair(a, b, gated=False), (12 / (1e4 + 1e5), 12), rel=1e-6)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"compute_s": 0.0}, "compute_s > 0"),
    ({"compute_s": math.nan}, "compute_s > 0"),
    ({"comm_s": -1.0}, "comm_s >= 0"),
    ({"comm_s": math.inf}, "comm_s >= 0"),
    ({"samples": 0}, "samples >= 1"),
    ({"samples": 2.5}, "samples >= 1"),
    ({"name": ""}, "non-empty name"),
])
def test_bad_phases_are_refused(kwargs: dict[str, Any], match: str) -> None:
    fields: dict[str, Any] = {"name": "j", "compute_s": 1.0, "comm_s": 1.0, "samples": 1, **kwargs}
    with pytest.raises(SchemaError, match=match):
        JobPhases(**fields)


def test_iterations_must_be_positive() -> None:
    with pytest.raises(SolverError, match="iterations >= 1"):
        simulate_pair(job(1, 1), job(1, 1), gated=True, iterations=0)


ITERATIONS = 64
times = st.floats(min_value=1e-3, max_value=10.0)
comms = st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=10.0))


@settings(max_examples=examples(60), deadline=None)
@given(ca=times, na=comms, cb=times, nb=comms, gated=st.booleans())
def test_pair_periods_obey_the_resource_bounds(ca: float, na: float, cb: float, nb: float, gated: bool) -> None:
    a, b = job(ca, na, "a"), job(cb, nb, "b")
    ta, tb = simulate_pair(a, b, gated=gated, iterations=ITERATIONS)
    # No job runs faster than alone; each resource does at most one second of work per second, so the slower
    # job's period covers both jobs' compute and both jobs' communication (up to the window's two ends).
    assert ta >= alone(a) and tb >= alone(b)
    slack = 1 + 2 / ITERATIONS
    assert max(ta, tb) * slack >= ca + cb and max(ta, tb) * slack >= na + nb
    # Crossed over, a job waits at most one compute of its partner and communicates at half rate at worst;
    # side by side it computes and communicates at half rate at worst.
    assert max(ta, tb) <= 2 * (ca + cb + na + nb)
    # Not asserted: crossed over <= side by side. It does not hold per job or per pair under a first-come
    # first-served gate (test_crossing_over_can_make_a_job_slower).


@settings(max_examples=examples(40), deadline=None)
@given(ca=times, cb=times, fa=st.floats(0.0, 1.0), fb=st.floats(0.0, 1.0))
def test_fitting_phases_cross_over_at_the_muri_period(ca: float, cb: float, fa: float, fb: float) -> None:
    # Each job's communication fits in the other's compute: the pair's period is max(cA, nB) + max(nA, cB).
    a, b = job(ca, fa * cb, "a"), job(cb, fb * ca, "b")
    assert close(simulate_pair(a, b, gated=True), (muri_period(a, b),) * 2, rel=1e-6)
    assert math.isclose(muri_period(a, b), ca + cb)


# -- the pairing solver -----------------------------------------------------------------------------------


def brute_force(alone_s: Sequence[float], pair_s: Mapping[tuple[int, int], float]) -> float:
    """The shortest round over every matching, enumerated recursively."""

    def best(free: tuple[int, ...]) -> float:
        if not free:
            return 0.0
        first, rest = free[0], free[1:]
        options = [alone_s[first] + best(rest)]
        for j in rest:
            if (first, j) in pair_s:
                options.append(pair_s[(first, j)] + best(tuple(k for k in rest if k != j)))
        return min(options)

    return best(tuple(range(len(alone_s))))


def random_instance(n: int, rng: random.Random) -> tuple[list[float], dict[tuple[int, int], float]]:
    """Alone times, and for a random subset of pairs a period between the slower job's and the sum + 20%."""
    alone_s = [rng.uniform(0.01, 1.0) for _ in range(n)]
    pair_s = {}
    for i, j in itertools.combinations(range(n), 2):
        if rng.random() < 0.8:
            low, high = max(alone_s[i], alone_s[j]), 1.2 * (alone_s[i] + alone_s[j])
            pair_s[(i, j)] = rng.choice([low, high, rng.uniform(low, high)])
    return alone_s, pair_s


@settings(max_examples=examples(60), deadline=None)
@given(n=st.integers(0, 8), seed=st.integers(0, 2**32 - 1))
def test_best_pairing_matches_brute_force(n: int, seed: int) -> None:
    alone_s, pair_s = random_instance(n, random.Random(seed))
    result = best_pairing(alone_s, pair_s)
    assert result.optimal
    assert math.isclose(result.total_period_s, brute_force(alone_s, pair_s), rel_tol=1e-9)
    assert result.total_period_s == pairing_period(alone_s, pair_s, result.pairs)
    grouped = sorted([*result.alone, *(k for pair in result.pairs for k in pair)])
    assert grouped == list(range(n)) and list(result.pairs) == sorted(result.pairs)
    assert all(i < j and (i, j) in pair_s for i, j in result.pairs)


def test_best_pairing_on_seeded_instances_is_deterministic() -> None:
    rng = random.Random(7)
    for n in range(1, 9):
        alone_s, pair_s = random_instance(n, rng)
        first = best_pairing(alone_s, pair_s)
        assert first == best_pairing(alone_s, pair_s)
        assert math.isclose(first.total_period_s, brute_force(alone_s, pair_s), rel_tol=1e-9)
    # Every pairing of four equal jobs into two pairs ties: the same one comes back every time.
    ties = {pair: 1.0 for pair in itertools.combinations(range(4), 2)}
    answers = {best_pairing([1.0] * 4, ties) for _ in range(3)}
    assert len(answers) == 1 and next(iter(answers)).total_period_s == 2.0


def test_a_job_with_no_pair_worth_taking_stays_alone() -> None:
    # (0, 1) saves 0.5 s; (0, 2) saves nothing; (1, 2) costs 0.5 s more than one after the other.
    result = best_pairing([1.0, 1.0, 1.0], {(0, 1): 1.5, (0, 2): 2.0, (2, 1): 2.5})
    assert result == Pairing(pairs=((0, 1),), alone=(2,), total_period_s=2.5, optimal=True)
    assert result.partner(0) == 1 and result.partner(2) is None
    assert best_pairing([1.0, 2.0], {(0, 1): 3.0}).pairs == ()


def test_no_job_and_one_job() -> None:
    assert best_pairing([], {}) == Pairing(pairs=(), alone=(), total_period_s=0.0, optimal=True)
    assert best_pairing([0.5], {}) == Pairing(pairs=(), alone=(0,), total_period_s=0.5, optimal=True)


@pytest.mark.parametrize(("alone_s", "pair_s", "match"), [
    ([1.0, 1.0], {(0, 0): 1.0}, "0 <= i != j < 2"),
    ([1.0, 1.0], {(0, 2): 1.0}, "0 <= i != j < 2"),
    ([1.0, 1.0], {(0, 1): 1.5, (1, 0): 1.5}, "given twice"),
    ([1.0, math.nan], {}, "alone_s"),
    ([1.0, 1.0], {(0, 1): math.inf}, "pair_s"),
])
def test_bad_pairing_instances_are_refused(alone_s: list[float], pair_s: dict[tuple[int, int], float],
                                           match: str) -> None:
    with pytest.raises(SolverError, match=match):
        best_pairing(alone_s, pair_s)


# -- the pairing plan -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Plans of two models on 2 workers and one on 4, saved once for the module."""
    folder = tmp_path_factory.mktemp("plans")
    made = {
        "mlp": make_plan(synthetic_profile("mlp"), Strategy.DENSE, source="synthetic"),
        "digits": make_plan(synthetic_profile("digits"), Strategy.DENSE, source="synthetic"),
        "mlp4": make_plan(synthetic_profile("mlp", world_size=4), Strategy.DENSE, source="synthetic"),
    }
    paths = {}
    for name, plan in made.items():
        paths[name] = folder / f"{name}.json"
        plan.save(paths[name])
    return paths


def synthetic_job(name: str, compute: float, comm: float, world_size: int = 2) -> PairingJob:
    return PairingJob(name=name, plan=f"plans/{name}.json", plan_fingerprint="0123456789abcdef", model="mlp",
                      model_fingerprint="7e793d4f58bbedbc", world_size=world_size, samples=32, compute_s=compute,
                      comm_s=comm)


@pytest.fixture(scope="module")
def three_jobs() -> PairingPlan:
    """a and b (complementary) pair; c only communicates a little and stays alone."""
    jobs = [synthetic_job("a", 1.0, 3.0), synthetic_job("b", 3.0, 1.0), synthetic_job("c", 2.0, 0.0)]
    pairing, solved = make_pairing(jobs, created="2026-01-01T00:00:00+00:00")
    assert solved.optimal
    return pairing


def test_plan_phases_and_fingerprint(plans: dict[str, Path]) -> None:
    plan = Plan.load(plans["mlp"])
    phases = job_phases(plan, 64, "mlp")
    assert math.isclose(phases.compute_s + phases.comm_s, plan.predicted.iteration_s)
    assert phases.comm_s == plan.predicted.exposed_comm_s and phases.samples == 64
    fingerprint = plan_fingerprint(plan)
    assert len(fingerprint) == 16 and int(fingerprint, 16) >= 0
    assert plan_fingerprint(Plan.load(plans["mlp"])) == fingerprint
    assert plan_fingerprint(replace(plan, created="2030-01-01T00:00:00+00:00")) != fingerprint


def test_pairing_plan_round_trip(three_jobs: PairingPlan, tmp_path: Path) -> None:
    assert three_jobs.pairs == ((0, 1),) and three_jobs.alone == (2,)
    assert close([three_jobs.predicted[0].crossover_s, three_jobs.predicted[1].crossover_s], [4, 4])
    assert close([three_jobs.predicted[0].side_by_side_s, three_jobs.predicted[1].side_by_side_s], [6, 6])
    # started interleaved (a computes while b communicates), side by side runs as crossed over: a computes for
    # 1 s while b communicates, then a communicates for 3 s while b computes, both at full rate: 4 s each
    assert close([three_jobs.predicted[0].side_by_side_interleaved_s or 0,
                  three_jobs.predicted[1].side_by_side_interleaved_s or 0], [4, 4])
    assert three_jobs.predicted[2] == JobPrediction(2.0, 2.0, 2.0, 2.0)
    # Rounds: one after the other 4 + 4 + 2; side by side 6 + 2; crossed over 4 + 2; 96 samples each round.
    assert close([three_jobs.round_s(m) for m in ("sequential", "side_by_side", "crossover")], [10, 8, 6])
    assert math.isclose(three_jobs.crossover_samples_per_s, 96 / 6)
    assert math.isclose(three_jobs.sequential_samples_per_s, 9.6)
    assert math.isclose(three_jobs.side_by_side_samples_per_s, 12.0)
    assert three_jobs.partner(1) == 0 and three_jobs.partner(2) is None and three_jobs.pair_of(0) == 0
    assert three_jobs.index("c") == 2
    with pytest.raises(PlanMismatchError, match="no job 'd'"):
        three_jobs.index("d")
    path = tmp_path / "pairing.json"
    three_jobs.save(path)
    loaded = PairingPlan.load(path)
    assert loaded == three_jobs and loaded.to_dict() == three_jobs.to_dict()
    doc = json.loads(path.read_text())
    assert doc["kind"] == "planner.pairing" and doc["schema_version"] == 1
    assert doc["predicted"]["totals"]["crossover_samples_per_s"] == pytest.approx(16.0)


def mutated(doc: dict[str, Any], change: Any) -> dict[str, Any]:
    copied = copy.deepcopy(doc)
    change(copied)
    return copied


def _world_size_4(doc: dict[str, Any]) -> None:
    doc["jobs"][1]["world_size"] = 4


@pytest.mark.parametrize(("change", "match"), [
    (lambda d: d.update(pairs=[[0, 1], [1, 2]], alone=[]), r"job 1 \(b\) is in more than one group"),
    (lambda d: d.update(alone=[1, 2]), r"job 1 \(b\) is in more than one group \(pair \[0, 1\] and alone\)"),
    (lambda d: d.update(pairs=[[0, 5]]), "names job 5, but there are 3 jobs"),
    (lambda d: d.update(alone=[2, 3]), "alone names job 3, but there are 3 jobs"),
    (lambda d: d.update(alone=[]), r"job 2 \(c\) is neither in a pair nor alone"),
    (lambda d: d.update(pairs=[[0, 1], [2, 2]], alone=[]), r"pairs job 2 \(c\) with itself"),
    (lambda d: d.update(pairs=[[0, 1, 2]]), "must be a list of two job indices"),
    (_world_size_4, "world sizes must be equal"),
    (lambda d: d.update(extra=1), r"unknown field\(s\) \['extra'\] in pairing"),
    (lambda d: d.pop("alone"), r"missing field\(s\) \['alone'\] in pairing"),
    (lambda d: d["jobs"][0].pop("samples"), r"missing field\(s\) \['samples'\] in pairing.jobs\[0\]"),
    (lambda d: d["jobs"][0].update(gpus=2), r"unknown field\(s\) \['gpus'\] in pairing.jobs\[0\]"),
    (lambda d: d["jobs"][0].update(compute_s=0), "compute_s > 0"),
    (lambda d: d["jobs"][0].update(plan_fingerprint="xyz"), "16 hex digits"),
    (lambda d: d["jobs"][1].update(name="a"), r"job names must be unique, but \['a'\]"),
    (lambda d: d.update(schema_version=2), "unknown pairing schema_version 2"),
    (lambda d: d.update(kind="planner.plan"), "not a pairing plan"),
    (lambda d: d["predicted"]["jobs"].pop(), "one prediction per job"),
    (lambda d: d["predicted"]["jobs"][2].update(crossover_s=1.0), "runs alone"),
    (lambda d: d["predicted"]["jobs"][0].update(crossover_s=1.0), "faster with a partner than alone"),
    (lambda d: d["predicted"]["jobs"][2].update(side_by_side_interleaved_s=1.0), "interleaved_s must equal"),
    (lambda d: d["predicted"]["jobs"][0].update(side_by_side_interleaved_s=1.0), "faster with a partner"),
    (lambda d: d["predicted"]["jobs"][0].update(side_by_side_interleaved_s="soon"), "interleaved_s"),
    (lambda d: d["predicted"]["totals"].update(crossover_samples_per_s=99.0), "the totals are derived"),
])
def test_bad_pairing_plans_are_refused(three_jobs: PairingPlan, change: Any, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        PairingPlan.from_dict(mutated(three_jobs.to_dict(), change))


def test_a_bad_pairing_file_names_itself(three_jobs: PairingPlan, tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(mutated(three_jobs.to_dict(), lambda d: d.update(alone=[]))))
    with pytest.raises(SchemaError, match=f"pairing plan {path}: job 2"):
        PairingPlan.load(path)
    with pytest.raises(PlannerError, match="pairing plan file not found"):
        PairingPlan.load(tmp_path / "none.json")


def test_check_job_plan(plans: dict[str, Path], tmp_path: Path) -> None:
    plan = Plan.load(plans["mlp"])
    entry = PairingJob.from_plan(plan, str(plans["mlp"]), name="mlp", samples=8)
    assert check_job_plan(entry) == plan and check_job_plan(entry, plan) == plan
    moved = replace(entry, plan=str(tmp_path / "gone.json"))
    with pytest.raises(PlanMismatchError, match=r"job mlp: its plan .*gone.json is missing; restore"):
        check_job_plan(moved)
    changed = replace(plan, created="2030-01-01T00:00:00+00:00")
    with pytest.raises(PlanMismatchError, match=r"changed since the pairing was made.*re-run `planner pair`"):
        check_job_plan(entry, changed)
    with pytest.raises(PlanMismatchError, match="is for model digits"):
        check_job_plan(entry, plans["digits"])


# -- planner pair ----------------------------------------------------------------------------------------


def test_pair_end_to_end(plans: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pairing.json"
    argv = ["pair", str(plans["mlp"]), str(plans["digits"]), str(plans["mlp"]), "--batch", "64,32,64", "-o", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "crossover pairing of 3 jobs (world size 2)" in text
    for word in ("mlp-2", "digits", "side by side", "crossed over", "samples/s", "pairs: ", "wrote pairing plan"):
        assert word in text, word
    pairing = PairingPlan.load(out)
    assert [j.name for j in pairing.jobs] == ["mlp", "digits", "mlp-2"]
    assert [j.samples for j in pairing.jobs] == [64, 32, 64]
    assert len(pairing.pairs) == 1 and len(pairing.alone) == 1
    assert pairing.crossover_samples_per_s >= pairing.sequential_samples_per_s
    for entry in pairing.jobs:
        check_job_plan(entry)


def test_pair_inputs() -> None:
    assert parse_batch("16", 3) == [16, 16, 16] and parse_batch("1, 2,3", 3) == [1, 2, 3]
    for bad, match in (("0", "whole numbers between 1"), ("a,b", "whole numbers"), ("1,2", "2 values for 3")):
        with pytest.raises(PlannerError, match=match):
            parse_batch(bad, 3)
    assert job_names(["p/a.json", "q/a.json", "a-2.json", "b.json", "r/a.json"]) == ["a", "a-2", "a-2-2", "b", "a-3"]


def test_pair_refuses_abs_plans(plans: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "abs.json"
    replace(Plan.load(plans["mlp"]), abs=abs_section()).save(path)
    with pytest.raises(PlanMismatchError, match="is an ABS-SGD plan"):
        load_job_plan(path)


def test_pair_bad_input_gives_one_line(plans: dict[str, Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "pairing.json")
    mlp, mlp4 = str(plans["mlp"]), str(plans["mlp4"])
    profile = tmp_path / "profile.json"
    synthetic_profile("mlp").save(profile)
    # Through the real command line: no traceback, one line, exit 2.
    _one_clear_line(_main("pair", str(tmp_path / "nope.json"), "--batch", "8", "-o", out), "plan file not found")
    _one_clear_line(_main("pair", mlp, mlp4, "--batch", "8", "-o", out), "different world sizes")
    _one_clear_line(_main("pair", "--batch", "8", "-o", out), "the following arguments are required: PLAN")
    # The rest in this process (the same `main`).
    for argv, match in (
        ([mlp, str(profile), "--batch", "8", "-o", out], "not a plan: kind is 'planner.profile'"),
        ([mlp, mlp, "--batch", "8,8,8", "-o", out], "--batch gives 3 values for 2 plans"),
        ([mlp, "--batch", "x", "-o", out], "--batch must be whole numbers"),
        ([mlp, "--batch", "8", "-o", mlp], "is one of the plans"),
    ):
        assert main(["pair", *argv]) == 2
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(lines) == 1 and match in lines[0], lines
    assert not Path(out).exists()
