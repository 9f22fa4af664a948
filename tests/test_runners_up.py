"""A plan's runners-up: the best plans of other structures its solve found, recorded in the plan file, raced beside
it, and promoted to the file's plan when the race keeps one."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from torch import nn

from planner.commands.cli import main
from planner.contracts.layers import plan_grouping
from planner.contracts.plan import Plan
from planner.contracts.profile import Profile
from planner.contracts.race_record import RacedArm, RaceRecord
from planner.costmodel.curves import fit_curve
from planner.costmodel.from_profile import mixed_problem
from planner.costmodel.mixed_simulator import simulate_mixed
from planner.models import build_workload
from planner.sessions.race import RUNNER_UP, finalists, with_race
from planner.strategies.auto import neighbouring_groupings, next_grouping, runners_up, solve_auto
from planner.strategies.budget import resolve_budget, solver_budget
from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors
from planner.types import Collective, Compressor, SchemaError
from tests.factories import examples, synthetic_kfac_plan, synthetic_profile
from tests.test_budget_plan import random_errors


@pytest.fixture(scope="module")
def auto_plan() -> Plan:
    """Auto over dense, fp16 and top-k at 1% on a synthetic MLP profile: three candidates, the mixed plan kept."""
    choice = solve_auto(synthetic_profile("mlp"), parse_compressors("dense,fp16,topk:0.01"), error_budget=None)
    return choice.plan


def test_auto_names_the_next_best_plans_of_other_structures_as_runners_up(auto_plan: Plan) -> None:
    choice = solve_auto(synthetic_profile("mlp"), parse_compressors("dense,fp16,topk:0.01"), error_budget=None)
    kept = next(name for name, plan in choice.candidates.items() if plan.groups == choice.plan.groups)
    assert list(auto_plan.runners_up) == ["topk at 0.01", "dense", "next grouping"] and kept not in auto_plan.runners_up
    # the other ways of sending in the order predicted, fastest first, each as its candidate was weighed
    steps = [p.predicted.iteration_s for p in list(auto_plan.runners_up.values())[:2]]
    assert steps == sorted(steps) and all(p.runners_up == {} and p.race is None for p in auto_plan.runners_up.values())
    # the next grouping: the kept plan's compressors on a grouping next to its own
    nearest = auto_plan.runners_up["next grouping"]
    assert nearest.compressors == choice.plan.compressors and nearest.groups != choice.plan.groups
    assert runners_up(choice.plan, choice.candidates, most=1).keys() == {"topk at 0.01"}
    # a candidate that makes the kept plan's decisions is not a runner-up of it
    twin = dataclasses.replace(choice.plan, solver="another")
    assert "twin" not in runners_up(choice.plan, {**choice.candidates, "twin": twin}, most=5)


def test_runners_up_read_back_and_old_plans_without_them_still_load(auto_plan: Plan, tmp_path: Path) -> None:
    auto_plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == auto_plan
    data = json.loads((tmp_path / "plan.json").read_text())
    del data["runners_up"]  # a plan written before runners-up
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Plan.load(tmp_path / "old.json").runners_up == {}


def test_bad_runners_up_are_refused_naming_where(auto_plan: Plan, tmp_path: Path) -> None:
    data = auto_plan.to_dict()
    dense = data["runners_up"]["dense"]
    for changed, message in [
        ({**dense, "runners_up": {"x": dense}}, "plan.runners_up.dense has runners-up or a race of its own"),
        ({**dense, "groups": []}, "plan.runners_up.dense: .*at least one group"),
        ({**dense, "model": {**dense["model"], "fingerprint": "0" * 16}}, "another model or cluster"),
        ("not a plan", "plan.runners_up.dense must be"),
    ]:
        (tmp_path / "bad.json").write_text(json.dumps({**data, "runners_up": {"dense": changed}}))
        with pytest.raises(SchemaError, match=message):
            Plan.load(tmp_path / "bad.json")
    with pytest.raises(SchemaError, match="runners-up are gradient plans, a K-FAC plan"):
        dataclasses.replace(synthetic_kfac_plan("mlp"), runners_up={"dense": auto_plan.runners_up["dense"]})


def test_runners_up_race_after_the_plan_less_compressed_first_up_to_the_most_arms(auto_plan: Plan) -> None:
    module = build_workload("mlp").module
    names = [v.name for v in finalists((auto_plan,), module, parse_compressors("fp16"), most=8)]
    plan = "plan mixed (dense, fp16, topk:0.01)"
    nearest = "runner-up next grouping"
    assert names == ["ddp", "ddp+fp16", "ddp+topk:0.01", f"{plan} via DDP", "runner-up dense", plan,
                     "runner-up topk at 0.01", nearest], names
    # DDP, its hooks and the plan both ways always race; the runners-up fill what is left: the other ways of
    # sending, fastest predicted first, then the next grouping
    fewer = [v.name for v in finalists((auto_plan,), module, parse_compressors("fp16"), most=6)]
    assert fewer == [n for n in names if n not in ("runner-up dense", nearest)]
    assert [v.name for v in finalists((auto_plan,), module, parse_compressors("fp16"), most=2)] == [
        n for n in names if not n.startswith(RUNNER_UP)]


def _record(arms: list[str], kept: str) -> RaceRecord:
    return RaceRecord(raced="2026-12-02T12:00:00+00:00", kept=kept, rule="won", rounds=3, block=4, margin=0.02,
                      alpha=0.05, seconds=1.0, arms=tuple(
                          RacedArm(name=a, rounds=3, steps=12, median_block_s=0.01, ratio_to_ddp=1.0,
                                   interval=None, predicted_ratio=None, beaten_by=None if a == kept else kept)
                          for a in arms))


def test_a_runner_up_the_race_keeps_becomes_the_files_plan(auto_plan: Plan, tmp_path: Path) -> None:
    record = _record(["ddp", "plan mixed (dense, fp16, topk:0.01)", "runner-up dense"], "runner-up dense")
    promoted = with_race(auto_plan, record)
    assert promoted.groups == auto_plan.runners_up["dense"].groups and promoted.race == record
    assert list(promoted.runners_up) == ["mixed (dense, fp16, topk:0.01)", "topk at 0.01",
                                         "next grouping of mixed (dense, fp16, topk:0.01)"]
    assert promoted.runners_up["mixed (dense, fp16, topk:0.01)"].groups == auto_plan.groups
    promoted.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == promoted
    kept_ddp = with_race(auto_plan, _record(["ddp", "runner-up dense"], "ddp"))
    assert kept_ddp.groups == auto_plan.groups and kept_ddp.runners_up == auto_plan.runners_up
    # raced again: the plan's earlier race goes with it into the runners-up no more than its runners-up do
    again = with_race(kept_ddp, record)
    assert again.race == record and again.runners_up["mixed (dense, fp16, topk:0.01)"].race is None


def test_solve_race_refuses_what_it_cannot_race(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    synthetic_profile("mlp").save(tmp_path / "profile.json")
    out = str(tmp_path / "plan.json")
    assert main(["solve", str(tmp_path / "profile.json"), "--strategy", "abs", "--global-batch", "128", "--race",
                 "-o", out]) == 2
    assert "--race races gradient and K-FAC plans" in capsys.readouterr().err
    assert main(["solve", str(tmp_path / "profile.json"), "--race", "--cluster", "4x1", "-o", out]) == 2
    assert "a --cluster what-if plan is for another cluster" in capsys.readouterr().err
    assert not (tmp_path / "plan.json").exists()


def test_solve_race_races_the_plan_and_its_runners_up_and_records_the_race(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`solve --strategy auto --race` on two real workers (loopback, as the profile measured): the runner-up races
    beside the plan, and the file holds the race (and, where the race kept the runner-up, the runner-up as its
    plan)."""
    synthetic_profile("mlp").save(tmp_path / "profile.json")
    out = tmp_path / "plan.json"
    assert main(["solve", str(tmp_path / "profile.json"), "--strategy", "auto", "--compressors", "dense,fp16",
                 "--error-budget", "none", "--race", "--race-time", "2", "--block", "2", "--warmup", "1",
                 "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = Plan.load(out)
    assert plan.race is not None and plan.race.rounds >= 1
    names = [a.name for a in plan.race.arms]
    assert names[0] == "ddp" and "runner-up dense" in names and any(n.startswith("plan mixed") for n in names)
    assert "race: keep" in printed and f"recorded the race in {out}" in printed
    if plan.race.kept == "runner-up dense":
        assert plan.strategy.value == "dense" and "its plan is now runner-up dense" in printed
    else:
        assert plan.strategy.value == "mixed"
        assert list(plan.runners_up) == ["dense", "next grouping"]


def test_retune_race_races_the_retuned_plan_and_refuses_what_it_cannot(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`planner retune --race`: the re-tuned plan's finalists race on this machine's workers (a budget of 0: one
    round) and the plan written holds the race; a what-if cluster or a K-FAC plan is refused in one line."""
    profile = synthetic_profile("mlp")
    profile.save(tmp_path / "profile.json")
    plan = solve_auto(profile, parse_compressors("dense,fp16"), source=str(tmp_path / "profile.json"),
                      error_budget=None).plan
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "retuned.json"
    assert main(["retune", str(tmp_path / "plan.json"), "--no-probe", "--race", "--race-time", "0", "--warmup", "1",
                 "-o", str(out)]) == 0
    assert Plan.load(out).race is not None and "race: keep" in capsys.readouterr().out
    assert main(["retune", str(tmp_path / "plan.json"), "--cluster", "4x1", "--race", "-o", str(out)]) == 2
    assert "a --cluster what-if plan is for another cluster" in capsys.readouterr().err
    from planner.strategies.abs_plan import make_abs_plan
    from tests.test_abs_plan import slowed_profile

    make_abs_plan(slowed_profile(world_size=2), 128, source="p.json").save(tmp_path / "abs.json")
    assert main(["retune", str(tmp_path / "abs.json"), "--no-probe", "--race", "-o", str(out)]) == 2
    assert "--race races gradient and K-FAC plans" in capsys.readouterr().err


def test_on_several_hosts_the_kept_way_of_sending_runs_up_once_per_route(tmp_path: Path) -> None:
    """On two hosts, auto's runners-up include the kept plan's way of sending with every group crossing hosts flat,
    and with every group crossing them hierarchically: the best plan per route, each whole (it loads back)."""
    from tests.test_hierarchical import _two_host_profile

    choice = solve_auto(_two_host_profile(), parse_compressors("dense"), error_budget=None)
    runners = choice.plan.runners_up
    assert set(runners) == {"dense, all flat", "dense, all hierarchical", "next grouping"}, list(runners)
    assert {g.hierarchical for g in runners["dense, all flat"].groups} == {False}
    assert {g.hierarchical for g in runners["dense, all hierarchical"].groups} == {True}
    choice.plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").runners_up.keys() == runners.keys()
    one_host = solve_auto(synthetic_profile("mlp"), parse_compressors("dense"), error_budget=None)
    assert not any("all flat" in name for name in one_host.plan.runners_up)


@pytest.mark.parametrize("layers", [1, 2, 5, 7])
def test_neighbouring_groupings_are_every_grouping_one_cut_away(layers: int) -> None:
    """Against every grouping of the layers enumerated: those whose cuts differ from the grouping's by one cut (one
    removed: two groups merged; one added: a group split), each once."""
    rng = np.random.default_rng(layers)
    cuts = {c for c in range(1, layers) if rng.random() < 0.5}
    grouping = (*sorted(cuts), layers)
    every = [(*(c for c, on in zip(range(1, layers), mask, strict=True) if on), layers)
             for mask in itertools.product((False, True), repeat=layers - 1)]
    one_away = {g for g in every if len(set(g[:-1]) ^ cuts) == 1}
    found = neighbouring_groupings(grouping)
    assert len(found) == len(set(found)) == layers - 1 and set(found) == one_away


def _random_profile(rng: np.random.Generator, lossy: list[str]) -> Profile:
    """A synthetic profile of a stack of 3 to 5 linear layers of random widths behind a link of random speed, with
    random compression errors (`tests.test_budget_plan.random_errors`)."""
    widths = [int(w) for w in rng.integers(8, 600, int(rng.integers(4, 7)))]
    module = nn.Sequential(*(nn.Linear(a, b, bias=False) for a, b in itertools.pairwise(widths)))
    base = synthetic_profile("stack", module=module)
    beta = 10 ** rng.uniform(-9.5, -7)
    link = fit_curve([(s, 2e-4 + beta * s) for s in (1 << e for e in range(10, 27, 2))])
    errors = random_errors(rng, len(base.layers), lossy)
    return replace(base, collectives={c: link for c in Collective},
                   errors=replace(errors, layers=tuple(lt.name for lt in base.layers)))


@pytest.mark.parametrize("seed", range(examples(10)))
def test_the_next_grouping_is_the_best_plan_one_grouping_away_against_brute_force(seed: int) -> None:
    """The next grouping's prediction is the least of every plan one grouping from the kept plan's (every grouping
    one cut away, every compressor of the kept plan's on every group, those within the error budget), simulated one
    by one; and it keeps to the budget."""
    rng = np.random.default_rng(seed)
    lossy = ["fp16", "powersgd:1", "powersgd:4"]
    profile = _random_profile(rng, lossy)
    allowed = parse_compressors("dense," + ",".join(lossy[: int(rng.integers(1, 4))]))
    budget = None if rng.random() < 0.3 else Compressor.parse(str(rng.choice([str(c) for c in allowed[1:]])))
    kept = make_mixed_plan(profile, allowed, error_budget=budget, time_limit_s=None, rows=False)
    nearest = next_grouping(profile, kept, time_limit_s=None, error_budget=budget)
    grouping = plan_grouping(kept, profile)
    if len(profile.layers) == 1:
        assert nearest is None
        return
    assert nearest is not None
    problem = mixed_problem(profile, allowed)
    units = None if budget is None else solver_budget(profile, problem, *resolve_budget(profile, budget))
    best = math.inf
    n = len(profile.layers)
    every = [(*(c for c, on in zip(range(1, n), mask, strict=True) if on), n)
             for mask in itertools.product((False, True), repeat=n - 1)]
    for other in (g for g in every if len(set(g[:-1]) ^ set(grouping[:-1])) == 1):
        for choice in itertools.product(range(len(problem.compressors)), repeat=len(other)):
            if units is None or units.of_solution(other, choice) <= units.budget:
                best = min(best, simulate_mixed(problem, other, choice).iteration_s)
    assert nearest.predicted.iteration_s == pytest.approx(best, rel=1e-9)
    assert plan_grouping(nearest, profile) in neighbouring_groupings(grouping)
    if budget is not None:
        assert nearest.error is not None and nearest.error.predicted <= nearest.error.budget * (1 + 1e-9)
