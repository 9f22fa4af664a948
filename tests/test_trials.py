"""Trials (`planner trial`): the verdict of each compressor against DDP, the file, `planner solve --strategy auto
--trials` keeping its plan among the compressors that trained like dense, and a real trial on the digits."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from planner.commands.cli import main
from planner.contracts.trials import Trials
from planner.strategies.auto import solve_auto
from planner.types import Compressor, PlanMismatchError, PlannerError, SchemaError
from tests.test_budget_plan import CONTRACTION, profile_with_errors

FP16, R1, R4, TOPK = (Compressor.parse(c) for c in ("fp16", "powersgd:1", "powersgd:4", "topk:0.01"))


def trials_of(profile, compressors: dict[Compressor, tuple[float | None, ...]],
              reference: tuple[float, ...] = (2.0, 1.8, 2.2), **kw) -> Trials:
    return Trials(model=profile.model, task="teacher", world_size=profile.cluster.world_size, samples=2400, lr=0.02,
                  momentum=0.9, reference=reference, compressors=compressors, **kw)


def test_a_trial_verdict_is_the_t_interval_of_the_paired_log_ratios() -> None:
    profile = profile_with_errors()
    ratios = (1.00, 1.02, 1.04)
    trials = trials_of(profile, {R4: tuple(r * d for r, d in zip(ratios, (2.0, 1.8, 2.2), strict=True)),
                                 TOPK: (1.6, 1.44, 1.76), R1: (2.0, None, 2.2)})
    # by hand: log ratios, their mean and sample deviation, Student's t at 95% one-sided with 2 degrees of freedom
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    half = 2.919986 * sd / math.sqrt(3)
    r4 = trials.result(R4)
    assert r4.ratio == pytest.approx(1.02) and r4.low == pytest.approx(math.exp(mean - half), rel=1e-6)
    assert r4.high == pytest.approx(math.exp(mean + half), rel=1e-6)
    assert r4.high > 1.02 and not r4.passed  # within 2% at the median, not beyond the noise of three repeats
    assert replace(trials, tolerance=0.10).result(R4).passed
    topk = trials.result(TOPK)  # 0.8x in every repeat: no spread, passes
    assert topk.ratio == pytest.approx(0.8) and topk.high == pytest.approx(0.8) and topk.passed
    assert not trials.result(R1).passed and trials.result(R1).ratio is None  # a repeat diverged
    assert "diverged" in trials.result(R1).describe()
    assert "not beyond the noise" in trials_of(profile, {TOPK: (1.0, 1.9, 2.6)}).result(TOPK).describe()
    assert trials.passed() == (TOPK,)
    one = trials_of(profile, {TOPK: (1.0,)}, reference=(2.0,))
    assert one.result(TOPK).ratio == pytest.approx(0.5) and not one.result(TOPK).passed  # one repeat: no interval


def test_the_trials_file_round_trips_and_refuses_bad_data(tmp_path: Path) -> None:
    profile = profile_with_errors()
    trials = trials_of(profile, {TOPK: (1.6, 1.44, 1.76), R1: (2.0, None, 2.2)})
    path = trials.save(tmp_path / "trials.json")
    loaded = Trials.load(path)
    assert loaded == trials and loaded.passed() == trials.passed()
    good = json.loads(path.read_text())
    for change, message in (({"kind": "profile"}, "trials.kind"), ({"version": 2}, "version"),
                            ({"reference": [2.0, 1.8]}, "one final loss per repeat"),
                            ({"reference": [2.0, -1.0, 2.2]}, "DDP's final losses"),
                            ({"reference": [2.0, None, 2.2]}, "trials.reference[1]"),
                            ({"compressors": {"dense": [1, 1, 1]}}, "must not hold dense"),
                            ({"compressors": {"zip": [1, 1, 1]}}, "trials.compressors"),
                            ({"compressors": {"fp16": [1, 0, 1]}}, "final losses > 0"),
                            ({"tolerance": 1.5}, "tolerance"), ({"extra": 1}, "unknown field")):
        (tmp_path / "bad.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(SchemaError, match=re.escape(message)):
            Trials.load(tmp_path / "bad.json")


def test_auto_keeps_its_plan_among_the_compressors_that_trained_like_dense() -> None:
    profile = profile_with_errors()  # a slow network: a lossy plan pays where it is allowed
    allowed = (Compressor.parse("dense"), FP16, R1, R4, TOPK)
    trials = trials_of(profile, {FP16: (2.0, 1.8, 2.2), R1: (None, 1.8, 2.2), R4: (2.6, 2.3, 2.9),
                                 TOPK: (1.6, 1.44, 1.76)})
    choice = solve_auto(profile, allowed, time_limit_s=None, trials=trials)
    sent = {str(choice.plan.compressor_of(g)) for g in choice.plan.groups}
    assert sent <= {"dense", "fp16", "topk:0.01"} and "topk:0.01" in sent
    assert choice.plan.error is not None and choice.plan.error.budget == pytest.approx(CONTRACTION["topk:0.01"])
    for candidate in choice.candidates.values():  # no candidate sends what did not train like dense
        assert not {str(candidate.compressor_of(g)) for g in candidate.groups} & {"powersgd:1", "powersgd:4"}
    assert "topk:0.01 on every layer, the loosest that trained like dense" in choice.rule
    assert "powersgd:1 (diverged" in choice.rule and "powersgd:4 (1.3x" in choice.rule

    # nothing lossy trained like dense: the plan the default budget keeps, among dense and fp16
    none = trials_of(profile, {R4: (2.6, 2.3, 2.9), TOPK: (4.0, 3.6, 4.4)})
    kept = solve_auto(profile, allowed, time_limit_s=None, trials=none)
    default = solve_auto(profile, allowed[:2], time_limit_s=None)
    assert kept.plan.groups == default.plan.groups
    assert [kept.plan.compressor_of(g) for g in kept.plan.groups] == [
        default.plan.compressor_of(g) for g in default.plan.groups]
    assert "default error budget" in kept.rule and "no lossier compressor allowed trained like dense" in kept.rule
    untried = solve_auto(profile, (*allowed[:2], R4), time_limit_s=None, trials=trials_of(profile, {TOPK: (1, 1, 1)}))
    assert "left out, not tried: powersgd:4" in untried.rule


def test_trials_of_another_model_or_world_refuse(tmp_path: Path) -> None:
    profile = profile_with_errors()
    allowed = (Compressor.parse("dense"), FP16, TOPK)
    other = trials_of(profile, {TOPK: (1.0, 1.0, 1.0)})
    with pytest.raises(PlanMismatchError, match="another model"):
        solve_auto(profile, allowed, trials=replace(other, model=replace(profile.model, fingerprint="0" * 16)))
    with pytest.raises(PlanMismatchError, match="3 workers"):
        solve_auto(profile, allowed, trials=replace(other, world_size=3))
    with pytest.raises(PlannerError, match="not both"):
        solve_auto(profile, allowed, trials=other, error_budget=0.5)


@pytest.mark.parametrize("argv, message", [
    (["--strategy", "mixed", "--trials", "T"], "--trials applies to --strategy auto only"),
    (["--strategy", "auto", "--trials", "T", "--error-budget", "fp16"], "not both"),
    (["--strategy", "auto", "--trials", "missing.json"], "trials file not found"),
])
def test_cli_bad_trials_give_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                      message: str) -> None:
    prof = tmp_path / "profile.json"
    profile = profile_with_errors()
    profile.save(prof)
    trials_of(profile, {TOPK: (1.0, 1.0, 1.0)}).save(tmp_path / "T")
    argv = [str(tmp_path / a) if a in ("T", "missing.json") else a for a in argv]
    assert main(["solve", str(prof), *argv, "-o", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "plan.json").exists()


def test_a_real_trial_on_the_digits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`planner trial` end to end: 2 gloo workers train the digits with DDP, fp16 and top-k 1% on every group; fp16
    (the same values to rounding) ends where DDP does, and the file it writes is what solve reads."""
    prof = tmp_path / "profile.json"
    profile_with_errors("digits").save(prof)  # the digits' own layers, made-up times: a trial measures no time
    out = tmp_path / "trials.json"
    assert main(["trial", str(prof), "--compressors", "fp16,topk:0.01", "--samples", "3000", "--repeats", "2",
                 "-o", str(out)]) == 0
    trials = Trials.load(out)
    assert trials.repeats == 2 and set(trials.compressors) == {FP16, TOPK} and trials.task == "digits"
    fp16 = np.array(trials.compressors[FP16], dtype=float)
    np.testing.assert_allclose(fp16, trials.reference, rtol=0.01)  # fp16 sends the gradient to rounding
    assert trials.result(FP16).passed
    assert "trained like dense" in capsys.readouterr().out
    plan = tmp_path / "plan.json"
    assert main(["solve", str(prof), "--strategy", "auto", "--trials", str(out), "-o", str(plan)]) == 0
    assert "in the trials" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--compressors", "dense"], "nothing to try"),
    (["--tolerance", "1.5"], "--tolerance is a fraction"),
    (["--momentum", "1"], "--momentum < 1"),
    (["--compressors", "powersgd:8"], "powersgd:8"),
    (["--task", "text"], "text"),
])
def test_cli_bad_trial_input_gives_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                            message: str) -> None:
    prof = tmp_path / "profile.json"
    profile_with_errors("digits").save(prof)
    assert main(["trial", str(prof), *argv, "-o", str(tmp_path / "trials.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "trials.json").exists()
