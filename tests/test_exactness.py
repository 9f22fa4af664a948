"""Honest exactness (issue #47, item 5): a solve honours its time limit (proven with an injected clock, never
timed), a plan stopped early is never slower than a baseline row it could have used, and every plan records
whether it is proven optimal or its gap to the bound, validated like every field of the plan file."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.commands.cli import main
from planner.commands.printing import optimality_line
from planner.contracts.plan import VIA_DDP_ROW, Plan
from planner.costmodel.from_profile import gradient_problem
from planner.costmodel.mixed_simulator import MixedProblem, simulate_mixed
from planner.costmodel.simulator import simulate
from planner.solvers import BASELINES, DenseDP, PerLayer, TopkParetoDP, lower_bound
from planner.solvers.compressor_choice import MixedParetoDP, MixedSolution, ddp_buckets, mixed_lower_bound
from planner.solvers.deadline import Deadline
from planner.strategies.gradients import make_plan
from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors
from planner.testing import random_problem
from planner.types import Collective, SchemaError, SolverError, Strategy
from tests.factories import examples, synthetic_profile
from tests.shipped import shipped_plans
from tests.test_hierarchical_topk import _topk_at, _two_hosts
from tests.test_mixed import random_mixed

REPO = Path(__file__).resolve().parent.parent


class FakeClock:
    """A clock that moves on by `step` seconds each time it is read, and counts the readings."""

    def __init__(self, step: float = 1.0) -> None:
        self.now = 0.0
        self.step = step
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        self.now += self.step
        return self.now


# ----------------------------------------------------------------------------------------------------
# The deadline


def test_a_deadline_passes_on_its_clock_and_shares_what_is_left() -> None:
    clock = FakeClock()
    deadline = Deadline(4.0, clock=clock)  # read once: ends at 5
    assert [deadline.passed() for _ in range(5)] == [False, False, False, True, True]
    assert deadline.late_checks == 2
    fresh = Deadline(10.0, clock=FakeClock())  # ends at 11
    half = fresh.share(0.5)  # read at 2: ends at 2 + 4.5
    assert not half.passed() and half.left() == pytest.approx(6.5 - 4)
    assert fresh.within(1.0).left() < 1.0 and fresh.within(None) is fresh
    assert Deadline(None).share(0.5).unlimited and not Deadline(None).passed()
    for bad in (-1.0, math.inf, math.nan, "1"):
        with pytest.raises(SolverError, match="time limit"):
            Deadline(bad)  # type: ignore[arg-type]
    with pytest.raises(SolverError, match="fraction"):
        fresh.share(0.0)


# ----------------------------------------------------------------------------------------------------
# The solvers stop at their deadline with a valid answer


def _single_compressor_rows(problem: object) -> list[MixedSolution]:
    """What the mixed solver must never be slower than: each compressor per layer, in one group, on DDP's buckets."""
    assert isinstance(problem, MixedProblem)
    rows = []
    for c in range(len(problem.compressors)):
        for g in ((problem.num_layers,), tuple(range(1, problem.num_layers + 1)), ddp_buckets(problem)):
            choice = (c,) * len(g)
            rows.append(MixedSolution(g, choice, simulate_mixed(problem, g, choice).iteration_s))
    return rows


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), reads=st.integers(0, 120), sigma=st.floats(0.05, 2.0),
       kappa=st.floats(0.05, 2.0), kinds=st.sampled_from(["dfpt", "dp", "pt", "ft"]))
def test_the_mixed_search_stops_at_its_deadline_never_worse_than_its_rows(seed: int, reads: int, sigma: float,
                                                                         kappa: float, kinds: str) -> None:
    """A deadline that passes after `reads` readings of the clock, anywhere in the tables, the beams, the search or
    the fallback: the answer is a valid solution, simulated at its value, no slower than any incumbent or
    single-compressor row, with a bound below the optimum, and the clock is not read again once it has said the
    deadline passed (no loop goes on past it)."""
    problem = random_mixed(10, seed, sigma=sigma, kinds=kinds, kappa=kappa)
    clock = FakeClock()
    deadline = Deadline(float(reads), clock=clock)
    incumbent = MixedParetoDP(allowed=(0,), time_limit_s=None).solve(problem)
    found = MixedParetoDP().solve(problem, deadline=deadline, incumbents=[incumbent])
    assert found.iteration_s == pytest.approx(simulate_mixed(problem, found.grouping, found.choice).iteration_s,
                                              rel=1e-12)
    for row in (*_single_compressor_rows(problem), incumbent):
        assert found.iteration_s <= row.iteration_s * (1 + 1e-12)
    exact = MixedParetoDP(time_limit_s=None).solve(problem)
    assert exact.proven and exact.iteration_s <= found.iteration_s * (1 + 1e-9)
    assert found.lower_bound_s is not None and found.lower_bound_s <= exact.iteration_s * (1 + 1e-9)
    if found.proven:
        assert found.iteration_s == pytest.approx(exact.iteration_s, rel=1e-9)
    else:
        assert found.gap == pytest.approx(found.iteration_s / found.lower_bound_s - 1)
    assert deadline.late_checks <= 3  # the tables, the search and the wide beam each stop at the first "passed"


def test_a_deadline_that_has_passed_leaves_only_the_rows_and_the_compute_bound() -> None:
    problem = random_mixed(12, 3, sigma=0.6, kappa=0.8)
    clock = FakeClock()
    deadline = Deadline(0.0, clock=clock)
    found = MixedParetoDP().solve(problem, deadline=deadline)
    assert not found.proven and deadline.late_checks == 1 and clock.reads == 2  # made, then one check: no tables
    assert found.iteration_s == min(r.iteration_s for r in _single_compressor_rows(problem))
    assert found.lower_bound_s == pytest.approx(problem.forward_s + sum(problem.backward_s) + problem.update_s)
    assert mixed_lower_bound(problem, deadline=Deadline(0.0, clock=FakeClock())) == found.lower_bound_s


def test_an_incumbent_must_be_among_the_allowed_compressors() -> None:
    problem = random_mixed(4, 1, sigma=0.0)
    outside = MixedSolution((4,), (1,), 1.0)
    with pytest.raises(SolverError, match="outside the allowed"):
        MixedParetoDP(allowed=(0,)).solve(problem, incumbents=[outside])


@pytest.mark.parametrize("strategy", [Strategy.DENSE, Strategy.TOPK])
@pytest.mark.parametrize("reads", [0, 10, 70, 100, 1000])
def test_the_grouping_search_stops_at_its_deadline_never_worse_than_the_baselines(strategy: Strategy,
                                                                                 reads: int) -> None:
    """The two-clock (dense with interference) and four-clock (top-k) searches, stopped after `reads` readings:
    the best grouping known, no slower than any baseline rule, not claimed optimal unless the search finished,
    with a bound below the optimum."""
    problem = random_problem(60, strategy, seed=11, interference=0.8, comm_stretch=0.6)
    solver = DenseDP() if strategy is Strategy.DENSE else TopkParetoDP()
    deadline = Deadline(float(reads), clock=FakeClock())
    solved = solver.solve_within(problem, deadline)
    assert solved.iteration_s == pytest.approx(simulate(problem, solved.grouping).iteration_s, rel=1e-9)
    for baseline in BASELINES[strategy]:
        assert solved.iteration_s <= simulate(problem, baseline.solve(problem)).iteration_s * (1 + 1e-9)
    exact = solver.solve_within(problem)
    assert exact.proven and exact.gap == 0
    assert solved.lower_bound_s is not None and solved.lower_bound_s <= exact.iteration_s * (1 + 1e-9)
    if solved.proven:
        assert solved.iteration_s == pytest.approx(exact.iteration_s, rel=1e-9)
    else:
        assert solved.gap is not None and solved.gap > 0
    assert deadline.late_checks <= 1
    if reads == 0:
        assert not solved.proven  # (this instance needs a search: no heuristic reaches its bound)


# ----------------------------------------------------------------------------------------------------
# Plans under a tiny time limit: never slower than a row they could have used


def _usable_rows(plan: Plan) -> dict[str, float]:
    """The printed rows the plan could have used: every one but DDP's and the plan's own inside DDP (another
    runtime's costs)."""
    return {name: p.iteration_s for name, p in plan.baselines.items()
            if not name.startswith("ddp") and name != VIA_DDP_ROW}


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sigma=st.floats(0.05, 2.0), kappa=st.floats(0.05, 2.0), model=st.sampled_from(["mlp", "resnet18"]),
       preset=st.sampled_from(["light", "lowrank", "all"]), limit=st.sampled_from([1e-9, 1e-3]))
def test_a_mixed_plan_under_a_tiny_time_limit_is_never_slower_than_its_rows(sigma: float, kappa: float, model: str,
                                                                            preset: str, limit: float) -> None:
    """Whatever part of the solve the limit cuts (nothing is timed: only what is returned is checked)."""
    profile = dataclasses.replace(
        synthetic_profile(model), interference={Collective.ALLREDUCE: sigma, Collective.ALLGATHER: sigma / 2},
        comm_stretch={Collective.ALLREDUCE: kappa, Collective.ALLGATHER: kappa / 2})
    plan = make_mixed_plan(profile, parse_compressors(preset), time_limit_s=limit)
    for name, seconds in _usable_rows(plan).items():
        assert plan.predicted.iteration_s <= seconds * (1 + 1e-9), name
    assert plan.optimal is not None and plan.gap is not None and plan.gap >= 0
    assert plan.lower_bound_s <= plan.predicted.iteration_s


@pytest.mark.parametrize("limit", [1e-9, 1e-3, None])
def test_plans_across_hosts_under_a_tiny_time_limit_are_never_slower_than_their_rows(limit: float | None) -> None:
    """Dense (its ways per group, with the plans all flat and all hierarchical beside it) and top-k choosing its
    way across hosts, with interference and comm stretch."""
    base = _two_hosts((_topk_at(0.01, 1e-3, 1e-9, ratio=1.9),))
    profile = dataclasses.replace(base, interference={Collective.ALLREDUCE: 0.7, Collective.ALLGATHER: 0.7},
                                  comm_stretch={Collective.ALLREDUCE: 0.9, Collective.ALLGATHER: 0.9})
    plans = [make_plan(profile, Strategy.DENSE, time_limit_s=limit),
             make_plan(profile, Strategy.TOPK, 0.01, selector="exact", time_limit_s=limit),
             make_mixed_plan(profile, parse_compressors("light"), time_limit_s=limit)]
    for plan in plans:
        assert "plan, all flat" in plan.baselines and "plan, all hierarchical" in plan.baselines
        for name, seconds in _usable_rows(plan).items():
            assert plan.predicted.iteration_s <= seconds * (1 + 1e-9), (plan.strategy, name)
        assert plan.optimal is not None
        if limit is None:
            assert plan.optimal and plan.gap == 0


# ----------------------------------------------------------------------------------------------------
# The plan file records it


def test_every_plan_records_whether_it_is_optimal_and_reads_it_back(tmp_path: Path) -> None:
    profile = synthetic_profile("resnet18")
    dense = make_plan(profile, Strategy.DENSE)
    assert dense.optimal is True and dense.gap == 0.0
    rule = make_plan(profile, Strategy.DENSE, solver=PerLayer())
    bound = lower_bound(gradient_problem(profile, Strategy.DENSE))
    assert rule.optimal is False and rule.gap == pytest.approx(rule.predicted.iteration_s / bound - 1, rel=1e-9)
    stopped = make_mixed_plan(profile, parse_compressors("lowrank"), time_limit_s=1e-9)
    assert stopped.optimal is False and stopped.gap is not None and stopped.gap > 0
    for plan in (dense, rule, stopped):
        doc = plan.to_dict()
        assert set(doc["solver"]) == {"name", "seconds", "optimal", "gap"}
        assert Plan.from_dict(json.loads(json.dumps(doc))) == plan
    assert optimality_line(dense) == "plan: optimal"
    assert optimality_line(stopped).startswith("plan: best found in ") and "% of the bound" in optimality_line(stopped)


@pytest.mark.parametrize(("solver", "message"), [
    ({"optimal": "yes", "gap": 0.0}, "plan.solver.optimal must be bool"),
    ({"optimal": False, "gap": -0.1}, "plan.solver.gap must be a finite number >= 0"),
    ({"optimal": False, "gap": "small"}, "plan.solver.gap must be int/float"),
    ({"optimal": False, "gap": True}, "plan.solver.gap must be int/float"),
    ({"optimal": False}, "needs plan.solver.gap"),
    ({"optimal": True, "gap": 0.25}, "plan.solver.gap must be 0"),
    ({"gap": 0.1}, "plan.solver.gap needs plan.solver.optimal"),
    ({"optimal": True, "gap": 0.0, "bound": 1.0}, r"unknown field\(s\) \['bound'\] in plan.solver"),
])
def test_a_bad_optimality_record_is_refused_naming_the_field(tmp_path: Path, solver: dict[str, object],
                                                              message: str, capsys: pytest.CaptureFixture[str]) -> None:
    doc = make_plan(synthetic_profile(), Strategy.DENSE).to_dict()
    doc["solver"] = {"name": "dense-exact", "seconds": 0.01, **solver}
    with pytest.raises(SchemaError, match=message):
        Plan.from_dict(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    assert main(["show", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "plan.solver" in err[0]


@pytest.mark.parametrize("name", [p.name for p in shipped_plans()])
def test_plans_written_before_the_record_still_load_and_say_so(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    plan = Plan.load(REPO / "plans" / name)
    assert plan.optimal is None and plan.gap is None
    assert "optimality not recorded" in optimality_line(plan)
    assert "optimal" not in plan.to_dict()["solver"]  # and written back as it was
    assert main(["show", str(REPO / "plans" / name)]) == 0
    assert "optimality not recorded" in capsys.readouterr().out


def test_solve_prints_optimal_or_the_gap_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "p.json"
    dataclasses.replace(synthetic_profile("resnet18"), interference={Collective.ALLREDUCE: 0.5},
                        comm_stretch={Collective.ALLREDUCE: 0.8}).save(profile)
    assert main(["solve", str(profile), "--strategy", "dense", "-o", str(tmp_path / "d.json")]) == 0
    assert "plan: optimal" in capsys.readouterr().out.splitlines()
    assert main(["solve", str(profile), "--strategy", "mixed", "--compressors", "lowrank", "--time-limit", "1e-9",
                 "-o", str(tmp_path / "m.json")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("plan: ")]
    assert len(lines) == 1 and lines[0].startswith("plan: best found in ") and lines[0].endswith("of the bound")
    assert main(["show", str(tmp_path / "m.json")]) == 0
    assert lines[0] in capsys.readouterr().out
    assert main(["solve", str(profile), "--strategy", "abs", "--global-batch", "8", "--time-limit", "1",
                 "-o", str(tmp_path / "a.json")]) == 2
    assert "--time-limit does not apply to --strategy abs" in capsys.readouterr().err
