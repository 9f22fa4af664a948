"""The race of a K-FAC plan: its layout against kfac-pytorch's reference layouts, window by window, on gloo workers;
the layout the race keeps becomes the file's, and the solved one a runner-up that races next time."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from planner.commands.cli import main
from planner.commands.printing import print_runners_up
from planner.contracts.plan import Plan
from planner.contracts.race_record import RacedArm, RaceRecord
from planner.runtime import KFACPreconditioner
from planner.sessions import race_kfac
from planner.sessions.race import RaceConfig
from planner.sessions.race_kfac import COMM_OPT, SOLVED, kfac_finalists, kfac_race_worker, with_kfac_race
from planner.strategies.kfac_plan import make_kfac_plan, reference_sections
from tests.factories import synthetic_profile
from tests.pool import run_warm
from tests.test_torchrun import KFAC_MODEL

#: The arm planted slower, and how much of its own step it sleeps.
#: Twice its own step: its windows take three times as long, well beyond a loaded machine's noise on windows of
#: two steps of a few milliseconds each (at half its step it was once left unbeaten after 24 rounds).
SLEEPER, SLEEP_SHARE = "every worker inverts", 2.0


@pytest.fixture(scope="module")
def kfac_plan() -> Plan:
    """A K-FAC plan of three small Linear layers on two workers, inverses every 2 steps (factors every step)."""
    return make_kfac_plan(synthetic_profile(KFAC_MODEL, 2), inv_update_steps=2, source="synthetic")


def _record(plan: Plan, kept: str) -> RaceRecord:
    arms = tuple(RacedArm(name=a.name, rounds=3, steps=6, median_block_s=0.01, ratio_to_ddp=1.0, interval=None,
                          predicted_ratio=None) for a in kfac_finalists(plan))
    return RaceRecord(raced="2026-12-02T00:00:00+00:00", kept=kept, rule="budget", rounds=3, block=2, margin=0.02,
                      alpha=0.05, seconds=1.0, arms=arms, reference=COMM_OPT)


def test_the_finalists_are_kfac_pytorchs_layouts_then_the_plan_each_once(kfac_plan: Plan) -> None:
    """kfac-pytorch's default layout first (the reference), the plan last, each with the solve's prediction; an arm
    whose decisions equal a simpler one's does not race twice."""
    arms = kfac_finalists(kfac_plan)
    names = [a.name for a in arms]
    assert names[0] == COMM_OPT and names[-1] == "plan" and len(set(names)) == len(names), names
    assert {"MEM_OPT layout", "every worker inverts"} <= set(names)
    assert kfac_plan.kfac is not None and kfac_plan.kfac.baselines is not None
    assert arms[0].predicted_s == kfac_plan.kfac.baselines["kfac-pytorch"].step_s
    assert kfac_plan.kfac.predicted is not None and arms[-1].predicted_s == kfac_plan.kfac.predicted.step_s
    same = dataclasses.replace(kfac_plan, kfac=reference_sections(kfac_plan)["kfac-pytorch"])
    assert "plan" not in [a.name for a in kfac_finalists(same)]  # the plan is the COMM_OPT layout: raced once


def test_a_layout_the_race_keeps_becomes_the_files_and_the_solved_one_races_next(
        kfac_plan: Plan, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert with_kfac_race(kfac_plan, _record(kfac_plan, "plan")).kfac == kfac_plan.kfac
    kept = with_kfac_race(kfac_plan, _record(kfac_plan, "MEM_OPT layout"))
    kept.save(tmp_path / "kept.json")
    loaded = Plan.load(tmp_path / "kept.json")
    assert loaded.kfac is not None and kfac_plan.kfac is not None
    mem_opt = reference_sections(kfac_plan)["kaisa-mem-opt"]
    assert (loaded.kfac.owners, loaded.kfac.preconditioners, loaded.kfac.a_buffers) == (
        mem_opt.owners, mem_opt.preconditioners, mem_opt.a_buffers)
    assert loaded.kfac.baselines == kfac_plan.kfac.baselines  # the solve's predictions of every layout stay
    assert loaded.runners_up[SOLVED].kfac == kfac_plan.kfac and loaded.race is not None
    print_runners_up(loaded)  # the solved layout's average K-FAC step, not its gradient exchange's
    assert f"solved layout {kfac_plan.kfac.predicted.step_s * 1e3:,.2f} ms" in capsys.readouterr().out
    names = [a.name for a in kfac_finalists(loaded)]
    assert f"runner-up {SOLVED}" in names and names.count("MEM_OPT layout") == 1, names
    # The race keeps the solved layout back: it is the file's again.
    back = with_kfac_race(loaded, _record(loaded, f"runner-up {SOLVED}"))
    assert back.kfac is not None and back.kfac.owners == kfac_plan.kfac.owners


def _sleeping_step(step: Any) -> Any:
    """`timed_step`, but the steps of the runtime whose layout is `SLEEPER`'s sleep, before the step, `SLEEP_SHARE`
    of their last step measured without the sleep."""
    slept: dict[int, float] = {}

    def step_maybe_slower(model: Any, loss_fn: Any, batch: Any, opt: Any, finish: Any) -> float:
        runtime = finish.__self__
        if not getattr(runtime, "sleeper", False):
            return float(step(model, loss_fn, batch, opt, finish))
        time.sleep(slept.get(id(runtime), 0.0))
        seconds = float(step(model, loss_fn, batch, opt, finish))
        slept[id(runtime)] = SLEEP_SHARE * seconds
        return seconds + slept[id(runtime)]

    return step_maybe_slower


def race_with_a_sleeper(rank: int, world_size: int, config: RaceConfig) -> RaceRecord:
    """`kfac_race_worker` on this rank with `SLEEPER`'s layout planted slower; every rank returns its record."""
    sleeper = next(a.section for a in kfac_finalists(config.plans[0]) if a.name == SLEEPER)
    build = KFACPreconditioner.__init__

    def marked(self: KFACPreconditioner, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **kwargs)
        self.sleeper = kwargs.get("kfac") == sleeper

    with mock.patch.object(race_kfac, "timed_step", _sleeping_step(race_kfac.timed_step)), \
            mock.patch.object(KFACPreconditioner, "__init__", marked):
        record = kfac_race_worker(rank, world_size, config, every_rank=True)
    assert record is not None
    return record


def test_a_planted_slower_layout_is_beaten_and_every_rank_holds_the_same_race(kfac_plan: Plan) -> None:
    """Each round times one window (2 steps) of every arm left; the layout planted three times slower is beaten
    within 24 rounds and not kept; every rank's record is rank 0's but for its clock time; ratios are to COMM_OPT's
    layout."""
    config = RaceConfig(plans=(kfac_plan,), model=KFAC_MODEL, warmup=2, race_time_s=120.0, max_rounds=24,
                        show_progress=False)
    records = run_warm(race_with_a_sleeper, 2, config, timeout=180)
    record = records[0]
    assert record.reference == COMM_OPT and record.block == 2
    assert [a.name for a in record.arms] == [a.name for a in kfac_finalists(kfac_plan)]
    slow = record.arm(SLEEPER)
    assert slow.beaten_by is not None and record.kept != SLEEPER, record.to_dict()
    assert all(a.steps == a.rounds * 2 for a in record.arms)
    first, second = ({**r.to_dict(), "raced": None} for r in records)
    assert first == second


def test_solve_kfac_race_with_no_budget_keeps_kfac_pytorchs_layout(kfac_plan: Plan, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`planner solve --strategy kfac --race --race-time 0`: one round settles nothing, so the simplest arm,
    kfac-pytorch's default layout, is kept; the file runs it, `planner show` prints the race."""
    synthetic_profile(KFAC_MODEL, 2).save(tmp_path / "p.json")
    assert main(["solve", str(tmp_path / "p.json"), "--strategy", "kfac", "--inv-update-steps", "2", "--race",
                 "--race-time", "0", "--warmup", "0", "--race-log", str(tmp_path / "races.json"),
                 "-o", str(tmp_path / "k.json")]) == 0
    out = capsys.readouterr().out
    assert "race: keep COMM_OPT layout" in out and "measured / COMM_OPT layout" in out, out
    plan = Plan.load(tmp_path / "k.json")
    assert plan.race is not None and (plan.race.kept, plan.race.rule, plan.race.rounds) == (COMM_OPT, "budget", 1)
    comm_opt = reference_sections(plan)["kfac-pytorch"]
    assert plan.kfac is not None and plan.kfac.owners == comm_opt.owners
    logged = json.loads((tmp_path / "races.json").read_text())
    assert logged["races"][0]["race"]["reference"] == COMM_OPT
    assert main(["show", str(tmp_path / "k.json")]) == 0
    assert "race: keep COMM_OPT layout" in capsys.readouterr().out


def test_an_abs_plan_is_refused_by_race_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from planner.strategies.abs_plan import make_abs_plan
    from tests.test_abs_plan import slowed_profile

    make_abs_plan(slowed_profile(world_size=2), 128, source="p.json").save(tmp_path / "abs.json")
    assert main(["race", str(tmp_path / "abs.json")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ABS-SGD plan" in err[0] and "bench --strategy abs" in err[0], err
