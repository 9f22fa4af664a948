"""The race's rule on simulated block times: anytime-valid evidence (its error rate under the null, checked after
every round), and the three ways a race ends."""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import statistics
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

from planner.commands.cli import main
from planner.contracts.plan import Plan, Verdict
from planner.contracts.race_record import RaceRecord
from planner.models import build_workload
from planner.sequential import LESS_OFTEN, MORE_OFTEN, HalfBet, median_interval
from planner.sessions.race import finalists
from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors
from planner.strategies.race_rule import (
    MIN_ESTIMATE_ROUNDS,
    WANTED_ROUNDS,
    Race,
    RaceDecision,
    race_summary,
    replay,
    too_short,
)
from planner.strategies.race_streams import drifting_blocks
from planner.types import SchemaError
from tests.factories import synthetic_profile
from tests.shipped import shipped_plans


def _ever_settles(p: float, alpha: float, rounds: int, rng: np.random.Generator) -> bool:
    bet = HalfBet(alpha)
    for y in rng.random(rounds) < p:
        bet.observe(bool(y))
        if bet.settled(MORE_OFTEN):
            return True
    return False


@pytest.mark.parametrize("p", [0.5, 0.4])
def test_a_bet_looked_at_every_round_is_wrong_at_most_alpha_of_the_time(p: float) -> None:
    """Under the null (the event happens at most half the time), checking after each of 300 rounds and stopping at
    the first "settled" still says so in at most alpha of the runs (here 0.1; a fixed-sample test at 0.1 checked
    so would say it in most runs)."""
    rng = np.random.default_rng(0)
    runs = 2000
    wrong = sum(_ever_settles(p, 0.1, 300, rng) for _ in range(runs))
    assert wrong / runs <= 0.1 + 3 * (0.1 * 0.9 / runs) ** 0.5, wrong


def test_a_bet_settles_fast_when_the_event_always_or_never_happens() -> None:
    always, never = HalfBet(0.001), HalfBet(0.001)
    while not always.settled(MORE_OFTEN) and always.rounds < 40:
        always.observe(True)
        never.observe(False)
    assert always.settled(MORE_OFTEN) and not always.settled(LESS_OFTEN) and always.rounds <= 20, always.rounds
    assert never.settled(LESS_OFTEN) and not never.settled(MORE_OFTEN)
    assert always.share == 1.0 and never.share == 0.0
    with pytest.raises(ValueError, match="alpha"):
        HalfBet(0.0)


def test_the_median_interval_holds_the_median_and_narrows() -> None:
    """Block ratios around a median of 0.95: the interval holds it in at least 1 - alpha of 200 runs, and 80 rounds
    narrow it to a few percent."""
    rng = np.random.default_rng(3)
    grid = [1 + i / 200 for i in range(-60, 61)]  # -30% .. +30% in steps of 0.5%
    held, widths = 0, []
    for _ in range(200):
        ratios = 0.95 * np.exp(rng.standard_t(3, 80) * 0.02)  # heavy tails, as a shared machine's spells
        low, high = median_interval(list(ratios), grid, alpha=0.1)
        held += low <= 0.95 <= high
        widths.append(high - low)
    assert held >= 180 and float(np.median(widths)) < 0.05, (held, float(np.median(widths)))
    with pytest.raises(ValueError, match="grid"):
        median_interval([1.0], [], 0.1)


def _race(means: list[float], *, noise: float, margin: float = 0.02, alpha: float = 0.05, rounds: int = 300,
          seed: int = 0, drift: float = 0.0) -> tuple[Race, object]:
    """A race of arms whose block times are lognormal around `means`, sharing each round's machine drift."""
    rng = np.random.default_rng(seed)
    race = Race([f"arm{i}" for i in range(len(means))], margin=margin, alpha=alpha)
    for r in range(rounds):
        machine = np.exp(drift * np.sin(r / 7))  # slow drift, common to a round's arms
        race.observe({arm: means[int(arm[3:])] * machine * float(np.exp(rng.normal(0, noise)))
                      for arm in race.alive})
        if (decision := race.decision()) is not None:
            return race, decision
    return race, race.decision(out_of_budget=True)


def test_a_clearly_faster_arm_wins_and_the_slower_ones_leave() -> None:
    race, decision = _race([1.0, 0.97, 0.85], noise=0.02, drift=0.3)
    assert decision.kept == "arm2" and decision.rule == "won", decision
    assert set(decision.beaten) == {"arm0", "arm1"} and decision.rounds < 60
    assert race.ratio("arm2", "arm0") == pytest.approx(0.85, rel=0.03)


def test_arms_within_the_margin_keep_the_simplest() -> None:
    """A 1% gain under a 2% margin is not worth the less simple arm, though it is real."""
    _, decision = _race([1.0, 0.99], noise=0.005, margin=0.02)
    assert decision.kept == "arm0" and decision.rule == "tied", decision


def test_when_the_budget_is_spent_the_estimates_keep_the_simplest_within_the_margin_of_the_fastest() -> None:
    """Noisy blocks (5%), 30 rounds: too few to settle a gain of 1% or of 5% beyond a 2% margin. The budget rule keeps
    the simplest arm measured within the margin of the fastest: the simplest beside a 1% gain, the faster arm beside
    a 5% one (fails with the simplest not beaten kept whatever the estimates, the rule before); with fewer than
    MIN_ESTIMATE_ROUNDS rounds the simplest not beaten."""
    race, decision = _race([1.0, 0.99], noise=0.05, rounds=30)
    assert decision.rule == "budget" and decision.kept == "arm0" and decision.rounds == 30, decision
    race, decision = _race([1.0, 0.95], noise=0.05, rounds=30)
    assert decision.rule == "budget" and decision.kept == "arm1" and not race.beaten, decision
    _, decision = _race([1.0, 0.95], noise=0.05, rounds=MIN_ESTIMATE_ROUNDS - 1)
    assert decision.rule == "budget" and decision.kept == "arm0", decision


def test_the_budget_rule_keeps_no_arm_another_beats_beyond_the_margin_by_estimate() -> None:
    """Within the margin does not chain. Five rounds in which arm1 is the fastest by estimate and arm0 is within 2% of
    it (median paired ratio 1.016), but arm2 is faster than arm0 by 2.5% (median paired ratio 1.025): arm0 is passed
    over and arm1 kept, within the margin of both others (fails with the rule that compared each arm with the fastest
    alone, which kept arm0)."""
    blocks = [[0.995, 0.982, 0.971], [0.979, 0.964, 1.026], [1.019, 0.976, 0.974], [1.014, 0.983, 0.987],
              [0.988, 0.983, 0.973]]
    race = Race(["arm0", "arm1", "arm2"])
    for row in blocks:
        race.observe({f"arm{i}": seconds for i, seconds in enumerate(row)})
    assert race.decision() is None and race.fastest(race.alive) == "arm1"
    assert statistics.median(a / b for a, b, _ in blocks) <= 1.02 < statistics.median(a / c for a, _, c in blocks)
    decision = race.decision(out_of_budget=True)
    assert decision is not None and decision.rule == "budget" and decision.kept == "arm1", decision


def test_equal_arms_are_rarely_called_beaten() -> None:
    """Three equal arms, 100 races: any arm beaten in at most alpha of the races (the union of all its tests)."""
    wrong = 0
    for seed in range(100):
        race, _ = _race([1.0, 1.0, 1.0], noise=0.05, margin=0.0, rounds=60, seed=seed)
        wrong += bool(race.beaten)
    assert wrong <= 5 + 2 * (100 * 0.05) ** 0.5, wrong


def test_bad_races_are_refused() -> None:
    with pytest.raises(ValueError, match="two or more distinct arms"):
        Race(["ddp"])
    with pytest.raises(ValueError, match="margin"):
        Race(["a", "b"], margin=1.5)
    race = Race(["a", "b"])
    with pytest.raises(ValueError, match="every arm still in the race"):
        race.observe({"a": 1.0})
    with pytest.raises(ValueError, match="positive and finite"):
        race.observe({"a": 1.0, "b": float("nan")})


# -- the rule on a drifting machine: a trend, bursts and heavy tails -------------------------------------------------
def _race_on(blocks: np.ndarray, *, margin: float = 0.02, alpha: float = 0.05) -> tuple[Race, RaceDecision]:
    """The race of `blocks`' arms ("arm0", "arm1", ..., simplest first), round by round until it decides; the budget
    rule after the last round."""
    race = Race([f"arm{i}" for i in range(blocks.shape[1])], margin=margin, alpha=alpha)
    for row in blocks:
        race.observe({arm: float(row[int(arm[3:])]) for arm in race.alive})
        if (decision := race.decision()) is not None:
            return race, decision
    decision = race.decision(out_of_budget=True)
    assert decision is not None
    return race, decision


#: The races of the simulations: 200 of 4 arms, at most 300 rounds each, the race's default margin and alpha.
RACES, ARMS, ROUNDS, MARGIN, ALPHA = 200, 4, 300, 0.02, 0.05


@functools.cache
def _one_arm_faster() -> tuple[np.ndarray, tuple[RaceDecision, ...]]:
    """200 drifting streams of 4 arms, the last (the least simple) 5% faster than the other three, and the race's
    decision on each (shared by the tests that read them)."""
    rng = np.random.default_rng(68)
    streams = np.stack([drifting_blocks([1.0, 1.0, 1.0, 0.95], ROUNDS, rng) for _ in range(RACES)])
    return streams, tuple(_race_on(s)[1] for s in streams)


def _fixed_length(streams: np.ndarray, fast: int, level: float, *, power: float = 0.95) -> int | None:
    """The fewest rounds after which a one-shot sign test, on the race's paired outcome ("arm b's block is slower
    than (1 + margin) times the fast arm's"), at `level` for each other arm b, finds the fast arm faster than every
    other beyond the margin in `power` of `streams` (None: not within their rounds). Every arm runs every round."""
    others = [b for b in range(streams.shape[2]) if b != fast]
    slower = streams[:, :, others] > (1 + MARGIN) * streams[:, :, [fast]]  # streams x rounds x others
    counts = np.cumsum(slower, axis=1)
    n = np.arange(1, streams.shape[1] + 1)
    needed = scipy.stats.binom.isf(level, n, 0.5) + 1  # the fewest rounds out of n for P(X >= needed) <= level
    found = (counts >= needed[None, :, None]).all(axis=2).mean(axis=0)
    enough = np.flatnonzero(found >= power)
    return int(n[enough[0]]) if enough.size else None


def test_equal_arms_on_a_drifting_machine_keep_the_simplest() -> None:
    """Four equal arms on a drifting machine, 200 races of at most 300 rounds: the simplest arm (the first) is kept
    in at least 95% of them, whether the arms settle within the margin ("tied") or the budget runs out."""
    rng = np.random.default_rng(1)
    decisions = [_race_on(drifting_blocks([1.0] * ARMS, ROUNDS, rng))[1] for _ in range(RACES)]
    kept = sum(d.kept == "arm0" for d in decisions)
    assert kept >= 0.95 * RACES, (kept, collections.Counter((d.kept, d.rule) for d in decisions))
    assert all(d.rule in ("tied", "budget") for d in decisions if d.kept == "arm0")


def test_equal_arms_at_a_margin_of_0_are_rarely_called_beaten_on_a_drifting_machine() -> None:
    """At a margin of 0 equal arms sit on the edge of beating each other (each block is slower than another's half
    the time), where only the rule's alpha keeps them from being called beaten: in at most 5% of 200 races of at
    most 300 rounds is any arm beaten (fails with alpha not divided among the tests)."""
    rng = np.random.default_rng(1)
    races = [_race_on(drifting_blocks([1.0] * ARMS, ROUNDS, rng), margin=0.0)[0] for _ in range(RACES)]
    wrong = sum(bool(race.beaten) for race in races)
    assert wrong <= 0.05 * RACES, wrong


def test_an_arm_5pc_faster_is_picked_sooner_than_a_fixed_length_test_of_the_same_statements() -> None:
    """An arm 5% faster than three others (margin 2%) on a drifting machine: the race keeps it, as the winner, in
    at least 95% of 200 races, and its median stopping round is below the rounds a one-shot sign test on the same
    streams and the same paired outcome needs for the same 95% power, at the level each of the race's statements
    is settled at (alpha over its 24 tests: the same statements at the same family-wise error). The numbers:
    `test_the_race_is_not_shorter_than_a_sign_test_at_the_full_alpha` says what it costs against fewer
    statements."""
    streams, decisions = _one_arm_faster()
    picked = sum(d.kept == "arm3" and d.rule == "won" for d in decisions)
    assert picked >= 0.95 * RACES, (picked, collections.Counter((d.kept, d.rule) for d in decisions))
    stop = statistics.median(d.rounds for d in decisions)
    tests = 2 * ARMS * (ARMS - 1)  # the race's: two per ordered pair
    fixed = _fixed_length(streams, 3, ALPHA / tests)
    assert fixed is not None and stop < fixed, (stop, fixed)


@pytest.mark.xfail(strict=True, reason="measured: the race stops at a median of 68 rounds, a one-shot sign test at "
                                       "alpha = 0.05 on each of the 3 comparisons needs 40 for 95% power (55 at "
                                       "alpha / 3): the race pays for settling 24 statements anytime (issue 68)")
def test_the_race_is_not_shorter_than_a_sign_test_at_the_full_alpha() -> None:
    """What issue 68 asks, read strictly: the race's median stopping round below the rounds a one-shot sign test of
    the fast arm against each other arm, each at the race's alpha (0.05), needs for 95% power on the same streams.
    It is not: this records the gap (strict: the day the race is shorter, this fails and the mark goes)."""
    streams, decisions = _one_arm_faster()
    fixed = _fixed_length(streams, 3, ALPHA)
    assert fixed is not None and statistics.median(d.rounds for d in decisions) < fixed, fixed


def test_the_median_interval_holds_under_optional_stopping_on_a_drifting_machine() -> None:
    """An arm's block ratio to DDP's on a drifting machine (median 0.95), its interval recomputed after every round
    as the race computes it when it stops, on grid points 0.2% either side of the median (the hardest to keep out of
    the interval wrongly). Stopping at the first round the interval misses the median, the worst stopping time there
    is, it misses in at most alpha of 200 runs of 80 rounds: so it holds at any stopping time, the race's own
    included."""
    rng = np.random.default_rng(5)
    alpha, truth = 0.1, 0.95
    grid = [truth * 0.998, truth * 1.002]
    missed = 0
    for _ in range(RACES):
        blocks = drifting_blocks([1.0, truth], 80, rng)
        ratios = list(blocks[:, 1] / blocks[:, 0])
        for t in range(1, len(ratios) + 1):
            low, high = median_interval(ratios[:t], grid, alpha)
            if not low <= truth <= high:
                missed += 1
                break
    assert missed <= alpha * RACES, missed


# -- planner race: the finalists in real steps on two workers -------------------------------------------------------
def test_planner_race_runs_the_finalists_simplest_first_and_keeps_one(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """DDP, DDP with its fp16 hook, and an fp16 plan inside DDP and in the runtime race on the same two workers until
    the rule or the budget decides; every rank settles the same rule on the same numbers (else the workers' next
    collective would not match)."""
    make_mixed_plan(synthetic_profile("mlp"), parse_compressors("fp16")).save(tmp_path / "fp16.json")
    assert main(["race", str(tmp_path / "fp16.json"), "--race-time", "2", "--block", "2", "--warmup", "1",
                 "--peers", "fp16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    recorded = Plan.load(tmp_path / "fp16.json").race  # the plan file records the race, as printed
    assert recorded is not None and {**recorded.to_dict(), "summary": race_summary(recorded)} == result
    assert main(["show", str(tmp_path / "fp16.json")]) == 0
    assert race_summary(recorded) in capsys.readouterr().out.replace("\n", " ")
    names = [a["name"] for a in result["arms"]]
    assert names == ["ddp", "ddp+fp16", "plan mixed (fp16) via DDP", "plan mixed (fp16)"]
    assert result["kept"] in names and result["rule"] in ("won", "tied", "budget")
    if result["rule"] == "budget":  # an arm not beaten; the simplest of them before estimates count
        unbeaten = [a["name"] for a in result["arms"] if a["beaten_by"] is None]
        assert result["kept"] in unbeaten
        if result["rounds"] < MIN_ESTIMATE_ROUNDS:
            assert result["kept"] == unbeaten[0]
    arms = {a["name"]: a for a in result["arms"]}
    assert arms["ddp"]["ratio_to_ddp"] == 1.0 and arms["ddp"]["rounds"] == result["rounds"] >= 1
    for arm in result["arms"]:
        assert arm["steps"] == 2 * arm["rounds"] and arm["median_block_s"] > 0
        if arm["name"] != "ddp":
            low, high = arm["interval"]
            assert low <= high
    assert all(arm["predicted_ratio"] > 0 for arm in result["arms"])
    assert result["summary"].startswith("race: keep ")
    # The record keeps the rule's evidence: fed again, its blocks reach the same decision after the same rounds.
    assert all(len(arm.blocks_s) == arm.rounds for arm in recorded.arms)
    again = replay(recorded).decision(out_of_budget=recorded.rule == "budget")
    assert again is not None and (again.kept, again.rule, again.rounds) == (recorded.kept, recorded.rule,
                                                                           recorded.rounds), again


def test_hooks_beyond_the_plans_error_budget_do_not_race() -> None:
    """The verdict of a plan kept within an error budget left DDP's PowerSGD hook unweighed: its error is beyond the
    budget, so it is not a finalist either, though asked for as a peer; the fp16 hook, within it, races."""
    plan = make_mixed_plan(synthetic_profile("mlp"), parse_compressors("fp16"))
    verdict = Verdict(keep="plan", against="ddp+fp16", gain=(0.1, 0.05, 0.15),
                      variants={"ddp": (1.0, 0.9, 1.1), "ddp+fp16": (1.0, 0.9, 1.1), "ddp+powersgd:1": (0.5, 0.4, 0.6)},
                      beyond_budget=("ddp+powersgd:1",))
    plan = dataclasses.replace(plan, verdict=verdict)
    module = build_workload("mlp").module
    names = [v.name for v in finalists((plan,), module, peers=parse_compressors("fp16,powersgd:1"))]
    assert names == ["ddp", "ddp+fp16", "plan mixed (fp16) via DDP", "plan mixed (fp16)"]
    without = dataclasses.replace(plan, verdict=None)
    assert "ddp+powersgd:1" in [v.name for v in finalists((without,), module, peers=parse_compressors("powersgd:1"))]


def test_planner_race_refuses_what_it_does_not_race(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from planner.strategies.abs_plan import make_abs_plan
    from tests.test_abs_plan import slowed_profile

    make_abs_plan(slowed_profile(world_size=2), 128, source="p.json").save(tmp_path / "abs.json")
    assert main(["race", str(tmp_path / "abs.json")]) == 2
    assert "is an ABS-SGD plan" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # argparse's own refusal: one line, exit 2
        main(["race", str(tmp_path / "abs.json"), "--margin", "1.5"])
    assert stop.value.code == 2 and "--margin: expected a fraction in [0, 1)" in capsys.readouterr().err


def _record(**changes: object) -> dict:
    data = {"raced": "2026-12-02T10:50:00+00:00", "kept": "ddp", "rule": "tied", "rounds": 3, "block": 4,
            "margin": 0.02, "alpha": 0.05, "seconds": 1.5, "reference": "ddp", "arms": [
                {"name": "ddp", "rounds": 3, "steps": 12, "median_block_s": 0.06, "ratio_to_ddp": 1.0,
                 "interval": None, "predicted_ratio": 1.0, "beaten_by": None},
                {"name": "ddp+fp16", "rounds": 3, "steps": 12, "median_block_s": 0.061, "ratio_to_ddp": 1.01,
                 "interval": [0.98, 1.04], "predicted_ratio": 0.9, "beaten_by": None}]}
    return {**data, **changes}


def test_a_race_record_reads_back_and_refuses_what_cannot_be() -> None:
    assert RaceRecord.from_dict(_record()).to_dict() == _record()
    old = {k: v for k, v in _record().items() if k != "reference"}  # written before races had other references
    assert RaceRecord.from_dict(old).reference == "ddp"
    arms = _record()["arms"]
    with_blocks = [{**arm, "blocks_s": [0.06, 0.059, 0.062]} for arm in arms]
    assert RaceRecord.from_dict(_record(arms=with_blocks)).to_dict() == _record(arms=with_blocks)
    with pytest.raises(ValueError, match=r"holds no block times for ddp, ddp\+fp16: it cannot be replayed"):
        replay(RaceRecord.from_dict(_record()))  # written before the blocks were kept
    for changes, message in [
        ({"kept": "plan"}, "kept must be one of the arms"),
        ({"rule": "luck"}, "rule must be one of"),
        ({"margin": 1.0}, "margin must be in"),
        ({"arms": arms[:1]}, "two or more distinct arms"),
        ({"arms": [arms[0], {**arms[1], "interval": [1.04, 0.98]}]}, "low <= high"),
        ({"arms": [arms[0], {**arms[1], "beaten_by": "nobody"}]}, "not an arm"),
        ({"kept": "ddp+fp16", "arms": [arms[0], {**arms[1], "beaten_by": "ddp"}]}, "was beaten"),
        ({"arms": [arms[0], {**arms[1], "ratio_to_ddp": -1}]}, "positive ratio"),
        ({"reference": "COMM_OPT layout"}, "reference must be one of the arms"),
        ({"arms": [arms[0], {**arms[1], "blocks_s": [0.06]}]}, "holds 1 blocks, but the arm ran 3 rounds"),
        ({"arms": [arms[0], {**arms[1], "blocks_s": [0.06, -1, 0.06]}]}, r"blocks_s\[1\] must be a time"),
    ]:
        with pytest.raises(SchemaError, match=message):
            RaceRecord.from_dict(_record(**changes))


def test_plans_written_before_the_race_still_load_and_show_without_one(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The example plans in plans/ were solved before plans recorded a race: each loads with no race, `planner show`
    prints it with no race in it, and saved again it holds no "race" key, as it was written."""
    for old in shipped_plans():
        assert "race" not in json.loads(old.read_text())  # written before the record
        plan = Plan.load(old)
        assert plan.race is None and "race" not in plan.to_dict()
        plan.save(tmp_path / old.name)
        assert "race" not in json.loads((tmp_path / old.name).read_text())
        assert main(["show", str(old)]) == 0
        out = capsys.readouterr().out
        assert "race: keep" not in out and "race of " not in out, out


def test_a_race_the_budget_ended_too_soon_says_how_long_would_do() -> None:
    record = RaceRecord.from_dict(_record(rule="budget", rounds=2, seconds=30.0))
    assert too_short(record) == ("note: 2 round(s) in 30 s, too few to go by estimates: the simplest arm not beaten "
                                 "was kept; --race-time 300 gives about 20 rounds of these arms")
    thin = too_short(RaceRecord.from_dict(_record(rule="budget", rounds=8, seconds=90.0)))
    assert thin is not None and thin.startswith("note: 8 rounds in 90 s: the estimates the budget rule went by are "
                                                "thin") and thin.endswith("--race-time 225 gives about 20 rounds of "
                                                                          "these arms"), thin
    assert too_short(RaceRecord.from_dict(_record(rule="budget", rounds=WANTED_ROUNDS, seconds=90.0))) is None
    assert too_short(RaceRecord.from_dict(_record(rule="tied"))) is None
