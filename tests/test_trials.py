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
import torch

from planner.commands.cli import main
from planner.commands.printing import print_plan
from planner.contracts.trials import Ratio, Trials, samples_to
from planner.models import Workload
from planner.strategies.auto import ddp_predictions, solve_auto
from planner.types import Compressor, PlanMismatchError, PlannerError, SchemaError
from tests.factories import with_samples
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


def falling(reach: int, final: float | None, samples: int = 4000) -> tuple[tuple[int, float | None], ...]:
    """A curve that falls linearly from 8 to 3 at `reach` samples, then to `final` at `samples` (evaluated every 500
    samples: DDP's half-way point, 2000, is one of them); a final None: diverged there."""
    end = 0.5 if final is None else final
    points = [(n, 8.0 - 5.0 * n / reach if n <= reach else 3.0 + (end - 3.0) * (n - reach) / (samples - reach))
              for n in range(0, samples + 1, 500)]
    return (*points[:-1], (samples, final))


def with_curves(trials: Trials, reach: dict[Compressor, tuple[int, ...]]) -> Trials:
    """`trials` with curves: DDP's reach 3 at 2000 samples, each compressor's at `reach` (per repeat), all ending at
    the final losses the trials hold."""
    curves = {"ddp": tuple(falling(2000, f) for f in trials.reference)}
    for c, finals in trials.compressors.items():
        curves[str(c)] = tuple(falling(r, f) for r, f in zip(reach[c], finals, strict=True))
    return replace(trials, curves=curves)


def test_samples_to_a_loss_are_read_off_the_curve_between_evaluations() -> None:
    curve = ((0, 4.0), (1000, 2.0), (2000, 1.0))
    assert samples_to(curve, 1.5) == pytest.approx(1500)  # halfway between 2.0 at 1000 and 1.0 at 2000
    assert samples_to(curve, 2.0) == 1000 and samples_to(curve, 5.0) == 0
    assert samples_to(curve, 0.5) is None and samples_to(((0, 4.0), (1000, None), (2000, 0.1)), 1.0) is None
    logs = [math.log(r) for r in (1.5, 1.6, 1.7)]
    mean, sd = sum(logs) / 3, math.sqrt(sum((x - sum(logs) / 3) ** 2 for x in logs) / 2)
    ratio = Ratio.of([1.5, 1.6, 1.7])
    assert ratio.median == pytest.approx(1.6)
    assert ratio.high == pytest.approx(math.exp(mean + 2.919986 * sd / math.sqrt(3)), rel=1e-6)


def test_a_trial_measures_the_samples_to_ddps_half_way_loss() -> None:
    profile = profile_with_errors()
    base = trials_of(profile, {R4: (2.0, 1.8, 2.2), TOPK: (2.0, 1.8, 2.2), R1: (2.0, 3.5, 2.0)})
    trials = with_curves(base, {R4: (2000, 2000, 2000), TOPK: (3000, 3000, 3500), R1: (2000, 4500, 2000)})
    r4, topk, r1 = (trials.result(c) for c in (R4, TOPK, R1))
    # DDP reaches its half-way loss (3, at 2000 of 4000 samples) at 2000; top-k at 3000, 3000, 3500; r1 at 2000, never
    assert r4.samples is not None and r4.samples.median == pytest.approx(1.0) and trials.samples_factor(R4) == 1.0
    assert topk.samples is not None and topk.samples.median == pytest.approx(1.5)
    assert trials.samples_factor(TOPK) == pytest.approx(topk.samples.high) and topk.samples.high > 1.75
    assert "1.5x DDP's samples to its half-way loss [" in topk.describe_samples()
    assert r1.samples is None and "did not reach DDP's half-way loss within 4,000 samples" in r1.describe_samples()
    # r1 never reached it in one repeat: it costs at least the samples it ran over DDP's, 4000 / 2000
    assert trials.samples_factor(R1) == pytest.approx(2.0) and trials.samples_factor(FP16) is None  # not tried
    faster = with_curves(base, {R4: (1000, 1000, 1000), TOPK: (2000,) * 3, R1: (2000,) * 3})
    assert faster.result(R4).samples.median == pytest.approx(0.5)  # type: ignore[union-attr]
    assert faster.samples_factor(R4) == 1.0  # never credited with training faster than DDP
    assert base.samples_factor(TOPK) is None and base.result(TOPK).describe_samples() == ""  # no curves


def test_the_trials_file_round_trips_and_refuses_bad_data(tmp_path: Path) -> None:
    profile = profile_with_errors()
    trials = with_curves(trials_of(profile, {TOPK: (1.6, 1.44, 1.76), R1: (2.0, None, 2.2)}),
                         {TOPK: (2000,) * 3, R1: (3000,) * 3})
    path = trials.save(tmp_path / "trials.json")
    loaded = Trials.load(path)
    assert loaded == trials and loaded.passed() == trials.passed()
    good = json.loads(path.read_text())
    v1 = {k: v for k, v in good.items() if k != "curves"} | {"version": 1}  # a file of the first version
    (tmp_path / "v1.json").write_text(json.dumps(v1))
    assert Trials.load(tmp_path / "v1.json") == replace(trials, curves=None)
    curves = good["curves"]
    for change, message in (({"kind": "profile"}, "trials.kind"), ({"version": 3}, "version"),
                            ({"curves": {"ddp": curves["ddp"]}}, "a curve per repeat for"),
                            ({"curves": {**curves, "ddp": curves["ddp"][:2]}}, "one curve per repeat"),
                            ({"curves": {**curves, "ddp": [curves["ddp"][0][::-1], *curves["ddp"][1:]]}},
                             "increasing samples"),
                            ({"curves": {**curves, "ddp": [[[0, 4.0], [10, 1.0]], *curves["ddp"][1:]]}},
                             "must end at the final loss"),
                            ({"curves": {**curves, "ddp": [[[0, 4.0, 1]], *curves["ddp"][1:]]}}, "[samples, loss]"),
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


def test_auto_with_curves_keeps_the_plan_predicted_to_reach_the_loss_first() -> None:
    """Top-k and PowerSGD r4 both end like dense; top-k's plan has the shortest step, but needs 1.5x (upper end 2.1x)
    DDP's samples to DDP's half-way loss, r4 as many as DDP: the plan kept is the one with the least step times
    samples, among plans solved without the compressors that need more samples."""
    profile = profile_with_errors()
    allowed = (Compressor.parse("dense"), FP16, R4, TOPK)
    finals = trials_of(profile, {FP16: (2.0, 1.8, 2.2), R4: (2.0, 1.8, 2.2), TOPK: (2.0, 1.8, 2.2)})
    by_step = solve_auto(profile, allowed, time_limit_s=None, trials=finals)
    assert TOPK in {by_step.plan.compressor_of(g) for g in by_step.plan.groups}  # steps alone: top-k pays
    slow = with_curves(finals, {FP16: (2000,) * 3, R4: (2000,) * 3, TOPK: (3000, 3000, 3500)})
    choice = solve_auto(profile, allowed, time_limit_s=None, trials=slow)
    sent = {choice.plan.compressor_of(g) for g in choice.plan.groups}
    assert TOPK not in sent and R4 in sent
    assert "least predicted step x samples to DDP's half-way loss" in choice.rule
    factor = slow.samples_factor(TOPK)
    assert factor is not None and f"topk at 0.01 {factor:.3g}x" in choice.reason
    # what it compared: each candidate's predicted step times the samples it needs; the kept one is the least
    time_to = {name: plan.predicted.iteration_s * (factor if TOPK in {plan.compressor_of(g) for g in plan.groups}
                                                   else 1.0) for name, plan in choice.candidates.items()}
    assert time_to[min(time_to, key=time_to.__getitem__)] == pytest.approx(choice.plan.predicted.iteration_s)
    assert choice.ddp_faster is None  # DDP's top-k hook has a shorter step, but needs top-k's samples too
    assert choice.factors == {"plan": 1.0, **{row: factor if row == "ddp+topk:0.01" else 1.0
                                              for row in ddp_predictions(choice.candidates)}}
    assert "powersgd:4 needed 1x DDP's samples to its half-way loss" in choice.samples  # said in the verdict line
    # with the profile's noise weighed, the verdict weighs each side's step times its samples, and records them
    noisy = solve_auto(with_samples(profile), allowed, time_limit_s=None, trials=slow)
    assert TOPK not in {noisy.plan.compressor_of(g) for g in noisy.plan.groups}
    verdict = noisy.plan.verdict
    assert verdict is not None and verdict.samples["plan"] == 1.0 and verdict.samples["ddp+topk:0.01"] == factor
    assert "faster to the loss (step x samples) than mixed over dense, fp16, powersgd:4, topk:0.01" in noisy.reason
    # DDP's top-k hook has the shorter step, but not to the loss: the plan is kept
    assert verdict.keep == "plan" and verdict.variants["ddp+topk:0.01"][0] < noisy.plan.predicted.iteration_s
    # as fast to the loss as top-k is per step: top-k's plan is kept again
    quick = with_curves(finals, {FP16: (2000,) * 3, R4: (2000,) * 3, TOPK: (2000, 2000, 2000)})
    again = solve_auto(profile, allowed, time_limit_s=None, trials=quick)
    assert TOPK in {again.plan.compressor_of(g) for g in again.plan.groups}


def test_a_verdict_without_noise_weighs_the_samples_too(capsys: pytest.CaptureFixture[str]) -> None:
    """A profile without samples: the printed verdict compares each step times the samples it needs, as auto chose,
    not the steps alone (by which DDP's top-k hook, the shortest step, would be kept)."""
    profile = profile_with_errors()
    allowed = (Compressor.parse("dense"), FP16, R4, TOPK)
    finals = trials_of(profile, {FP16: (2.0, 1.8, 2.2), R4: (2.0, 1.8, 2.2), TOPK: (2.0, 1.8, 2.2)})
    slow = with_curves(finals, {FP16: (2000,) * 3, R4: (2000,) * 3, TOPK: (3000, 3000, 3500)})
    choice = solve_auto(profile, allowed, time_limit_s=None, trials=slow)
    ddp = ddp_predictions(choice.candidates, choice.beyond_budget)
    assert ddp["ddp+topk:0.01"] < choice.plan.predicted.iteration_s and choice.plan.verdict is None

    def verdict() -> str:
        out = " ".join(capsys.readouterr().out.split())
        return out[out.index("verdict:"):out.index(" solver ")]

    mine, r4 = (f"{seconds * 1e3:.2f} ms" for seconds in (choice.plan.predicted.iteration_s, ddp["ddp+powersgd:4"]))
    print_plan(choice.plan, ddp=ddp)
    assert verdict().startswith(f"verdict: keep DDP with its topk:0.01 hook (ddp+topk:0.01): the plan's {mine} is "
                                "slower")
    print_plan(choice.plan, ddp=ddp, samples=choice.samples, factors=choice.factors)
    line = verdict()
    assert line.startswith(f"verdict: keep the plan: the plan's {mine} against ddp+powersgd:4 {r4}"), line
    assert ("weighed to the loss: each step times the samples it needs over DDP's, as trials measured (plan 1x, "
            "ddp+powersgd:4 1x)") in line
    assert "which changes the gradients: powersgd:4 needed 1x DDP's samples" in line


def test_show_prints_a_trials_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = profile_with_errors()
    path = with_curves(trials_of(profile, {TOPK: (2.0, 1.8, 2.2)}), {TOPK: (3000, 3000, 3500)}).save(tmp_path / "t")
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "samples to DDP's half-way loss" in out and "1.5 [" in out and "trained like dense: topk:0.01" in out
    assert main(["show", str(path), "--groups"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--groups applies to a plan" in err[0]


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
    assert trials.curves is not None and all(len(c) > 2 for c in trials.curves["ddp"])  # every snapshot evaluated
    samples = trials.result(FP16).samples  # fp16 reaches DDP's half-way loss on as many samples, to rounding
    assert samples is not None and samples.median == pytest.approx(1.0, rel=0.1)
    assert "trained like dense" in capsys.readouterr().out
    plan = tmp_path / "plan.json"
    assert main(["solve", str(prof), "--strategy", "auto", "--trials", str(out), "-o", str(plan)]) == 0
    assert "in the trials" in capsys.readouterr().out


def shaped_workload() -> Workload:
    """`ShapedConv` (a tied weight, a frozen layer, BatchNorm, an unused layer, registered in another order than
    used) on 3x6x6 inputs, 4 classes: what `planner trial` builds by name."""
    from tests.test_mixed_runtime import ShapedConv

    def batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 6, 6, generator=generator), torch.randint(0, 4, (n,), generator=generator)

    return Workload(name="shaped", module=ShapedConv(), batch_size=8, make_batch=batch,
                    loss_fn=torch.nn.functional.cross_entropy)


def test_a_real_trial_on_a_model_shaped_like_real_ones(tmp_path: Path) -> None:
    """Every compressor on every group of a model with a tied weight, a frozen layer, BatchNorm and an unused layer,
    on the teacher task: every run trains (finite losses, falling), fp16 ends where DDP does."""
    prof = tmp_path / "profile.json"
    profile_with_errors("tests.test_trials:shaped_workload").save(prof)
    out = tmp_path / "trials.json"
    assert main(["trial", str(prof), "--compressors", "fp16,powersgd:1,topk:0.3", "--samples", "1600", "--repeats",
                 "2", "-o", str(out)]) == 0
    trials = Trials.load(out)
    assert trials.task == "teacher" and set(trials.compressors) == {FP16, R1, Compressor.parse("topk:0.3")}
    np.testing.assert_allclose(np.array(trials.compressors[FP16], dtype=float), trials.reference, rtol=0.01)
    assert trials.curves is not None
    for name, runs in trials.curves.items():
        for curve in runs:
            losses = [loss for _, loss in curve]
            assert all(loss is not None and math.isfinite(loss) for loss in losses), (name, curve)
            assert losses[-1] < losses[0], (name, curve)


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
