"""The model's error on predicted ratios to DDP, calibrated by split conformal prediction on the races logged: its
coverage on new arms drawn like the logged ones, the log it reads, and where it is printed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from planner.commands.cli import main
from planner.contracts.race_log import MAX_RACES, LoggedRace, RaceLog
from planner.contracts.race_record import RacedArm, RaceRecord
from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors
from planner.strategies.model_error import ModelError, residuals
from planner.types import SchemaError
from tests.factories import synthetic_profile


def _race(pairs: list[tuple[float, float]]) -> LoggedRace:
    """A logged race of DDP and one arm per (predicted, measured) ratio."""
    arms = [RacedArm(name="ddp", rounds=5, steps=10, median_block_s=0.1, ratio_to_ddp=1.0, interval=None,
                     predicted_ratio=1.0)]
    arms += [RacedArm(name=f"arm {i}", rounds=5, steps=10, median_block_s=0.1 * m, ratio_to_ddp=m, interval=None,
                      predicted_ratio=p) for i, (p, m) in enumerate(pairs)]
    record = RaceRecord(raced="2026-12-02T12:00:00+00:00", kept="ddp", rule="budget", rounds=5, block=2,
                        margin=0.02, alpha=0.05, seconds=1.0, arms=tuple(arms))
    return LoggedRace(model="mlp", world_size=2, link="1gbit", race=record)


def test_the_conformal_bound_covers_new_arms_at_its_level() -> None:
    """Log-ratio errors drawn alike (a bias and heavy tails, as the model's are): the interval from n = 19 logged arms
    holds a new arm's measured ratio in at least 90% of 4,000 draws, and not much more (the split conformal
    guarantee is tight: at most level + 1/(n + 1)). It fails with the rank floor(n level) in place of
    ceil((n + 1) level) (85%)."""
    rng = np.random.default_rng(0)
    held = 0
    trials = 4000
    for _ in range(trials):
        errors = 0.03 + 0.04 * rng.standard_t(4, 20)
        predicted = rng.uniform(0.4, 1.1, 20)
        logged = [_race([(p, p * math.exp(e)) for p, e in zip(predicted[:19], errors[:19], strict=True)])]
        error = ModelError.of(logged, level=0.9)
        assert error is not None and error.arms == 19
        low, high = error.interval(predicted[19])
        held += low <= predicted[19] * math.exp(errors[19]) <= high
    assert 0.9 - 3 * (0.09 / trials) ** 0.5 <= held / trials <= 0.95 + 3 * (0.05 / trials) ** 0.5, held / trials


def test_too_few_arms_give_no_bound_and_ddp_is_not_an_arm() -> None:
    assert ModelError.of([_race([(0.5, 0.55)] * 8)], level=0.9) is None  # ceil(9 * 0.9) = 9 > 8
    error = ModelError.of([_race([(0.5, 0.5 * math.exp(0.01 * i)) for i in range(1, 10)])], level=0.9)
    assert error is not None and error.bound == pytest.approx(0.09) and error.races == 1
    assert residuals([_race([(0.5, 0.6)])]) == [pytest.approx(math.log(1.2))]  # DDP, the reference, is not an arm
    low, high = error.interval(0.6)
    assert low == pytest.approx(0.6 * math.exp(-0.09)) and high == pytest.approx(0.6 * math.exp(0.09))
    with pytest.raises(ValueError, match="level"):
        ModelError.of([], level=1.0)


def test_the_race_log_reads_back_keeps_the_newest_and_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    path = tmp_path / "races.json"
    assert RaceLog.load(path).races == ()  # no log yet: empty
    log = RaceLog()
    for i in range(MAX_RACES + 3):
        log = log.with_race(_race([(0.5, 0.5 + i * 1e-4)]))
    log.save(path)
    again = RaceLog.load(path)
    assert again == log and len(again.races) == MAX_RACES
    assert again.races[0].race.arms[1].ratio_to_ddp == pytest.approx(0.5 + 3e-4)  # the oldest three dropped
    data = json.loads(path.read_text())
    data["races"][0]["race"]["kept"] = "nobody"
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match=r"race log .*races.json: race_log.races\[0\].race.kept .*move it aside"):
        RaceLog.load(path)


def test_planner_race_logs_its_race_and_prints_the_error_of_the_races_before(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A log of earlier races (ten arms predicted 5% low): the race's table carries each prediction's conformal
    interval and says how many measured ratios fell inside; the race is added to the log; solve prints the plan's
    predicted ratio with the same error."""
    log = tmp_path / "races.json"
    RaceLog((_race([(0.5 + 0.01 * i, (0.5 + 0.01 * i) * 1.05) for i in range(10)]),)).save(log)
    profile = synthetic_profile("mlp")
    profile.save(tmp_path / "profile.json")
    make_mixed_plan(profile, parse_compressors("fp16")).save(tmp_path / "plan.json")
    assert main(["race", str(tmp_path / "plan.json"), "--race-time", "0", "--warmup", "1", "--peers", "fp16",
                 "--race-log", str(log)]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert "split conformal on 10 arms of 1 earlier races" in out and "measured ratios here fall inside" in out
    assert "[90%, model error]" in out
    assert len(RaceLog.load(log).races) == 2
    assert main(["solve", str(tmp_path / "profile.json"), "--strategy", "mixed", "--compressors", "fp16",
                 "--race-log", str(log), "-o", str(tmp_path / "solved.json")]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert "predicted ratio to DDP, with the model's error" in out and "plan 0." in out
