"""Every measured number with its uncertainty: the samples a profile keeps, the paired estimator of in-situ
factors, resampled profiles, predictions with intervals, and a verdict that keeps a plan over DDP only beyond the
noise (`planner.spread`, `planner.costmodel.resample`, `planner.strategies.intervals`)."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.commands.cli import main
from planner.contracts.plan import Plan
from planner.contracts.profile import Calibration, InSitu, Profile, SlowdownSamples
from planner.costmodel.resample import resampled, resampled_many, spread_sources
from planner.profilers.layers import LayerRun, combine_ranks
from planner.runtime.calibrate import _until_usable
from planner.spread import PairedGain, calibration_use, statistic_interval
from planner.strategies.gradients import make_plan
from planner.strategies.intervals import Draws, simplest_unbeaten, weigh, with_intervals
from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors
from planner.types import Collective, InvalidProfileError, SchemaError, Strategy
from tests.factories import examples, synthetic_profile, with_samples
from tests.shipped import shipped_plans
from tests.test_interference import measured_profile


# -- the paired estimator of in-situ factors ---------------------------------------------------------------------
def _pairs(effect_s: float, *, pairs: int = 24, seed: int = 0, jitter_s: float = 0.0005) -> list[float]:
    """Paired differences of synthetic step times: each pair shares the machine's state of the moment (a drift of
    several milliseconds between pairs), and each step its own jitter; the step with the work takes `effect_s`
    more."""
    rng = np.random.default_rng(seed)
    drift = 0.010 * rng.standard_normal(pairs)  # shared by both steps of a pair
    plain = 0.050 + drift + jitter_s * rng.standard_normal(pairs)
    with_work = 0.050 + drift + effect_s + jitter_s * rng.standard_normal(pairs)
    return list(with_work - plain)


@pytest.mark.parametrize("seed", range(5))
def test_the_paired_estimator_recovers_a_known_effect(seed: int) -> None:
    """2 ms of work against a 1 ms micro-benchmark: a factor of 2, inside the interval, and used."""
    cal = Calibration.of_samples(_pairs(0.002, seed=seed), modelled_s=0.001)
    use = cal.use
    assert use.used and use.low is not None and use.high is not None
    assert use.low <= 2.0 <= use.high and use.high - use.low < 1.0
    assert cal.factor == pytest.approx(cal.measured_s / 0.001)


@pytest.mark.parametrize("seed", range(5))
def test_with_no_effect_the_interval_straddles_zero_and_the_factor_is_not_used(seed: int) -> None:
    cal = Calibration.of_samples(_pairs(0.0, seed=seed), modelled_s=0.001)
    assert cal.use.low is not None and cal.use.high is not None
    assert cal.use.low <= 0 <= cal.use.high
    assert not cal.use.used and cal.factor == 1.0 and "no effect" in cal.use.why


def test_an_implausible_factor_is_not_used_and_the_bounds_are_named() -> None:
    far = Calibration.of_samples(_pairs(0.030), modelled_s=0.001)  # 30x its micro-benchmark
    assert not far.use.used and far.factor == 1.0 and "above the plausible 0.5x-20x" in far.use.why
    near = Calibration.of_samples(_pairs(0.0002, jitter_s=1e-5), modelled_s=0.001)  # 0.2x: faster than alone
    assert not near.use.used and "below" in near.use.why
    assert calibration_use(0.01, 0.0).why == "nothing was micro-benchmarked"


def test_a_calibration_not_usable_is_measured_once_more_and_then_left_to_the_micro_benchmark() -> None:
    answers = iter([_pairs(0.0), _pairs(0.002, seed=3)])
    again: list[int] = []

    def build(samples: list[float], attempt: int) -> dict[str, Calibration]:
        return {"x": Calibration.of_samples(samples, 0.001, attempt)}

    found = _until_usable(lambda: next(answers), build, lambda: again.append(1))["x"]
    assert found.attempts == 2 and found.use.used and again == [1]
    noise = iter([_pairs(0.0, seed=1), _pairs(0.0, seed=2)])
    kept = _until_usable(lambda: next(noise), build)["x"]
    assert kept.attempts == 2 and not kept.use.used and kept.factor == 1.0
    first = iter([_pairs(0.002)])
    assert _until_usable(lambda: next(first), build)["x"].attempts == 1  # usable at once: measured once


# -- paired gains and the verdict --------------------------------------------------------------------------------
def test_a_paired_gain_cancels_what_both_share() -> None:
    rng = np.random.default_rng(0)
    shared = 0.1 * (1 + 0.2 * rng.standard_normal(500))  # the same compute under every draw, noisy
    plan, ddp = shared * 0.95, shared
    gain = PairedGain.of(plan, ddp)
    assert gain.median == pytest.approx(0.05) and gain.beyond_noise
    # Unpaired, the two intervals overlap by far: the pairing is what tells them apart.
    assert np.quantile(plan, 0.95) > np.quantile(ddp, 0.05)
    same = PairedGain.of(shared * (1 + 0.01 * rng.standard_normal(500)), shared)
    assert same.low < 0 < same.high and not same.beyond_noise


def test_the_verdict_keeps_the_plan_only_beyond_the_noise_and_else_the_simpler_ddp() -> None:
    rng = np.random.default_rng(1)
    base = 0.1 * (1 + 0.1 * rng.standard_normal(300))
    ddp = {"ddp": base, "ddp+fp16": base * 0.9}
    nominal = {"ddp": 0.1, "ddp+fp16": 0.09}
    kept = weigh(base * 0.8, ddp, nominal)
    assert kept.keep == "plan" and kept.against == "ddp+fp16" and kept.gain[1] > 0
    close = weigh(base * 0.9 * (1 + 0.02 * rng.standard_normal(300)), ddp, nominal)
    assert close.keep == "ddp+fp16"  # within the noise of the hook, which beats plain DDP beyond it
    assert close.variants["ddp"] == (0.1, *np.quantile(base, [0.05, 0.95]))
    level = weigh(base * (1 + 0.02 * rng.standard_normal(300)), {"ddp": base}, {"ddp": 0.1})
    assert level.keep == "ddp" and level.gain[1] < 0 < level.gain[2]


def test_with_samples_factors_the_verdict_weighs_time_to_the_loss_and_records_steps() -> None:
    """A plan 20% faster per step than DDP's hook, but needing 1.5x the samples where the hook needs 1.1x: slower to
    the loss, so the hook is kept; the variants still hold the hook's step, and the factors are recorded."""
    rng = np.random.default_rng(3)
    base = 0.1 * (1 + 0.05 * rng.standard_normal(300))
    ddp = {"ddp": base, "ddp+powersgd:1": base * 0.5}
    nominal = {"ddp": 0.1, "ddp+powersgd:1": 0.05}
    by_step = weigh(base * 0.4, ddp, nominal)
    assert by_step.keep == "plan" and not by_step.samples
    to_loss = weigh(base * 0.4, ddp, nominal, samples={"plan": 1.5, "ddp+powersgd:1": 1.1})
    assert to_loss.keep == "ddp+powersgd:1" and to_loss.against == "ddp+powersgd:1"
    assert to_loss.gain[0] == pytest.approx(1 - 0.4 * 1.5 / (0.5 * 1.1))  # the draws share their noise
    assert to_loss.variants["ddp+powersgd:1"] == (0.05, *np.quantile(base * 0.5, [0.05, 0.95]))  # steps
    assert to_loss.samples == {"plan": 1.5, "ddp+powersgd:1": 1.1}


def test_among_plans_the_simplest_not_beaten_beyond_the_noise_is_kept() -> None:
    rng = np.random.default_rng(2)
    base = 1 + 0.1 * rng.standard_normal(300)
    draws = {"dense": base, "mixed": base * (1 + 0.01 * rng.standard_normal(300)), "topk": base * 0.7}
    assert simplest_unbeaten(["dense", "mixed", "topk"], draws, "topk") == "topk"
    del draws["topk"]
    assert simplest_unbeaten(["dense", "mixed"], draws, "mixed") == "dense"  # within the noise: the simpler


# -- the samples a profile keeps, and resampled profiles --------------------------------------------------------
def _run(seed: int, layers: int = 3, steps: int = 9) -> LayerRun:
    rng = np.random.default_rng(seed)
    names = [f"l{i}" for i in range(layers)]
    slow = 1 + 0.3 * rng.random(steps)
    return LayerRun(order=tuple(names), params={n: (f"{n}.w",) for n in names}, numel=dict.fromkeys(names, 10),
                    forward={n: list(0.001 * slow) for n in names},
                    backward={n: list(0.002 * (i + 1) * slow) for i, n in enumerate(names)},
                    forward_total=list(0.003 * slow), backward_total=list(0.012 * slow), update=list(0.001 * slow),
                    whole=list(0.017 * slow * (1 + 0.05 * rng.random(steps))))


def test_the_kept_steps_give_back_the_profiles_numbers() -> None:
    summary = combine_ranks([_run(0), _run(1)])
    assert summary.steps is not None and summary.steps.count == 9
    fwd, upd, backward, whole = summary.steps.scaled_parts()
    assert fwd == pytest.approx(summary.forward_s) and upd == pytest.approx(summary.update_s)
    assert whole == pytest.approx(summary.step_s)
    assert backward == pytest.approx([lt.backward_s for lt in summary.layers])


def test_steps_of_uneven_layers_are_not_kept() -> None:
    run = _run(0)
    run.backward["l1"].pop()  # a layer timed one step fewer: its samples do not line up with the steps
    assert combine_ranks([run]).steps is None


def test_a_profile_keeps_its_samples_through_a_file_and_refuses_bad_ones(tmp_path: Path) -> None:
    prof = with_samples(measured_profile("mlp"))
    prof = dataclasses.replace(prof, slowdown_samples={Collective.ALLREDUCE: SlowdownSamples(
        alone_s=(1.0, 1.1), busy_s=(1.8, 1.9), pace_alone_s=(0.1, 0.1), pace_busy_s=(0.15, 0.17))},
        in_situ=InSitu(pack=Calibration.of_samples([0.002, -0.001, 0.003], 0.001)))
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof
    assert spread_sources(prof) == ("steps", "collectives", "in-situ calibrations", "sigma and kappa")
    doc = prof.to_dict()
    bad = json.loads(json.dumps(doc))
    bad["steps"]["whole_s"][0] = -1.0
    with pytest.raises(InvalidProfileError, match=r"profile\.steps\.whole_s\[0\]"):
        Profile.from_dict(bad)
    bad = json.loads(json.dumps(doc))
    bad["steps"]["backward_s"][0].append(0.1)
    with pytest.raises(InvalidProfileError, match="every layer at every step"):
        Profile.from_dict(bad)
    bad = json.loads(json.dumps(doc))
    bad["collectives"]["allreduce"]["samples"].pop()
    with pytest.raises(InvalidProfileError, match=r"collectives\.allreduce\.samples"):
        Profile.from_dict(bad)
    bad = json.loads(json.dumps(doc))
    bad["slowdown_samples"]["allreduce"]["busy_s"].pop()
    with pytest.raises(InvalidProfileError, match="in pairs"):
        Profile.from_dict(bad)
    bad = json.loads(json.dumps(doc))
    bad["in_situ"]["pack"]["samples_s"] = []
    with pytest.raises(InvalidProfileError, match=r"pack\.samples_s"):
        Profile.from_dict(bad)


def test_a_profile_without_samples_is_drawn_as_it_is() -> None:
    prof = synthetic_profile("mlp")
    assert spread_sources(prof) == () and Draws.of(prof) is None
    assert resampled(prof, np.random.default_rng(0)) == prof


@settings(max_examples=examples(20), deadline=None)
@given(seed=st.integers(0, 10**6), spread=st.floats(0.01, 0.5))
def test_every_draw_stays_within_what_was_measured(seed: int, spread: float) -> None:
    prof = with_samples(measured_profile("mlp"), spread=spread, seed=seed)
    assert prof.steps is not None
    draw = resampled(prof, np.random.default_rng(seed))
    assert min(prof.steps.whole_s) <= draw.step_s <= max(prof.steps.whole_s)  # type: ignore[operator]
    parts = draw.forward_s + sum(lt.backward_s for lt in draw.layers) + draw.update_s
    assert parts == pytest.approx(draw.step_s)  # the parts still sum to the drawn whole step
    for coll, curve in draw.collectives.items():
        measured = prof.collectives[coll]
        assert measured.samples is not None
        for (_, t), runs in zip(curve.points, measured.samples, strict=True):
            assert min(runs) - 1e-15 <= t <= max(runs) + 1e-15


def test_draws_are_the_same_for_the_same_seed() -> None:
    prof = with_samples(measured_profile("mlp"))
    assert resampled_many(prof, 3, seed=7) == resampled_many(prof, 3, seed=7)


# -- predictions with intervals ----------------------------------------------------------------------------------
def test_every_row_of_a_plan_gets_an_interval_around_its_prediction() -> None:
    """Every row is rebuilt, the exact ones solved again (without a time limit here: a row solved within a share of
    a limit may come out another way the second time, and then gets no interval rather than a wrong one)."""
    prof = with_samples(measured_profile("resnet18"))
    for plan in (make_plan(prof, Strategy.DENSE), make_plan(prof, Strategy.TOPK, 0.01),
                 make_mixed_plan(prof, parse_compressors("dense,fp16,powersgd:4"), time_limit_s=None)):
        weighed = with_intervals(plan, prof, time_limit_s=None)
        assert weighed.intervals is not None and weighed.verdict is not None
        rows = {"plan": plan.predicted, **plan.baselines}
        assert set(weighed.intervals.rows) == set(rows)
        for name, (low, high) in weighed.intervals.rows.items():
            assert low <= high and low <= rows[name].iteration_s * 1.05 and high >= rows[name].iteration_s * 0.95
        again = Plan.from_dict(json.loads(json.dumps(weighed.to_dict())))
        assert again == weighed


def test_a_noisier_profile_gives_wider_intervals() -> None:
    def width(spread: float) -> float:
        prof = with_samples(measured_profile("resnet18"), spread=spread)
        weighed = with_intervals(make_plan(prof, Strategy.DENSE), prof)
        assert weighed.intervals is not None
        low, high = weighed.intervals.rows["plan"]
        return high - low

    assert width(0.2) > 2 * width(0.02)


def _ddp_packing(spread: float, factor: float) -> Profile:
    """The ResNet-18 profile whose only difference between a dense plan and DDP is DDP's bucket copies: this runtime
    packs at its micro-benchmark (measured tightly), DDP at `factor` times it, measured with `spread`."""
    rng = np.random.default_rng(1)
    modelled = 0.01
    in_situ = InSitu(pack=Calibration.of_samples(modelled * (1 + 0.02 * rng.standard_normal(24)), modelled),
                     ddp_pack=Calibration.of_samples(modelled * factor * (1 + spread * rng.standard_normal(24)),
                                                     modelled))
    return with_samples(dataclasses.replace(measured_profile("resnet18"), in_situ=in_situ), spread=0.02)


def test_a_plan_predicted_faster_than_ddp_within_the_noise_is_not_kept(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """DDP's bucket copies measured at 1.5x their micro-benchmark in both profiles, so the plan is predicted faster
    than DDP in both; it is kept only where those copies were measured tightly enough."""
    noisy, tight = _ddp_packing(spread=0.9, factor=1.5), _ddp_packing(spread=0.02, factor=1.5)
    for prof, keep in ((noisy, "ddp"), (tight, "plan")):
        plan = make_plan(prof, Strategy.DENSE)
        assert plan.predicted.iteration_s < plan.baselines["ddp"].iteration_s
        assert with_intervals(plan, prof).verdict.keep == keep  # type: ignore[union-attr]
    noisy.save(tmp_path / "noisy.json")
    assert main(["solve", str(tmp_path / "noisy.json"), "-o", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    verdict = next(line for line in out.splitlines() if line.startswith("verdict:"))
    assert verdict.startswith("verdict: keep DDP:") and "within the noise" in verdict
    saved = Plan.load(tmp_path / "plan.json")
    assert saved.verdict is not None and saved.verdict.keep == "ddp" and saved.intervals is not None


def test_auto_weighs_its_candidates_and_ddp_under_the_same_draws(capsys: pytest.CaptureFixture[str]) -> None:
    from planner.commands.printing import print_auto
    from planner.strategies.auto import solve_auto

    prof = with_samples(measured_profile("resnet18"))
    choice = solve_auto(prof, parse_compressors("dense,fp16,topk:0.01"))
    assert all(p.intervals is not None and p.verdict is not None for p in choice.candidates.values())
    verdict = choice.plan.verdict
    assert verdict is not None and set(verdict.variants) == {"ddp", "ddp+fp16", "ddp+topk:0.01"}
    assert "kept" in choice.reason and ("within the noise" in choice.reason or "beyond the noise" in choice.reason)
    print_auto(choice)
    assert "90% interval ms" in capsys.readouterr().out


def test_plan_files_validate_intervals_and_verdicts_and_older_plans_still_load() -> None:
    prof = with_samples(measured_profile("mlp"))
    doc = with_intervals(make_plan(prof, Strategy.DENSE), prof).to_dict()
    for path, value, message in (
            (("intervals", "rows", "plan"), [2.0, 1.0], "low <= high"),
            (("intervals", "level"), 1.5, "level"),
            (("verdict", "keep"), "plain", "plan, ddp or ddp+C"),
            (("verdict", "against"), "ddp+gzip", "unknown compressor"),
            (("verdict", "gain"), [0.1, 0.2, 0.3], "low <= median <= high"),
            (("verdict", "variants", "ddp"), [0.1, 0.3, 0.2], "low <= high"),
            (("verdict", "samples"), {"ddp+fp16": 1.2}, "not among the variants"),
            (("verdict", "samples"), {"plan": -1.0}, "a factor > 0"),
            (("verdict", "samples"), [1.0], "must be")):
        bad = json.loads(json.dumps(doc))
        target = bad["predicted"]
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(SchemaError, match=re.escape(message)):
            Plan.from_dict(bad)
    for old in shipped_plans():
        plan = Plan.load(old)
        assert plan.intervals is None and plan.verdict is None
    with_samples_doc = json.loads(json.dumps(doc))
    with_samples_doc["predicted"]["verdict"]["samples"] = {"plan": 1.2, "ddp": 1.0}
    verdict = Plan.from_dict(with_samples_doc).verdict
    assert verdict is not None and verdict.samples == {"plan": 1.2, "ddp": 1.0}
    assert Plan.from_dict(with_samples_doc).to_dict()["predicted"]["verdict"]["samples"] == {"plan": 1.2, "ddp": 1.0}


def test_the_bench_marks_measurements_inside_their_predicted_interval() -> None:
    from planner.models import build_workload
    from planner.sessions.bench import BenchResult, bench_variants

    row = BenchResult.from_samples("x", "dense", [0.10, 0.11, 0.12], steps=3, predicted_s=0.1, reference="ddp")
    assert row.inside is None
    assert dataclasses.replace(row, predicted_interval=(0.1, 0.12)).inside
    assert not dataclasses.replace(row, predicted_interval=(0.08, 0.1)).inside
    prof = with_samples(measured_profile("mlp"))
    plan = with_intervals(make_plan(prof, Strategy.DENSE), prof)
    assert plan.intervals is not None
    variants = {v.name: v for v in bench_variants((plan,), build_workload("mlp").module, peers=())}
    assert variants["plan dense"].interval == plan.intervals.rows["plan"]
    assert variants["ddp"].interval == plan.intervals.rows["ddp"]
    assert variants["per-layer dense"].interval == plan.intervals.rows["wfbp"]


def test_a_what_if_cluster_keeps_no_samples() -> None:
    from planner.strategies.cluster import parse_cluster, profile_for_cluster

    prof = with_samples(measured_profile("mlp"))
    what_if = profile_for_cluster(prof, parse_cluster("eth10-8"))
    assert what_if.steps is None and what_if.slowdown_samples is None


def test_statistic_intervals_are_deterministic_and_a_single_sample_is_its_own() -> None:
    samples = list(np.random.default_rng(0).random(30))
    assert statistic_interval(samples) == statistic_interval(samples)
    assert statistic_interval([0.5]) == (0.5, 0.5)


# -- quick profiles and progress in logs -------------------------------------------------------------------------
def test_quick_sets_fewer_repeats_and_flags_override_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import planner.sessions.profile as profile_module
    from planner.sessions.profile import QUICK_EFFORT

    seen = []

    def fake(config: profile_module.ProfileConfig) -> Profile:
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(profile_module, "run_profile", fake)
    for argv in (["--quick"], ["--quick", "--repeats", "7", "--densities", "0.1"], []):
        with pytest.raises(SystemExit):
            main(["profile", "--model", "mlp", "-o", str(tmp_path / "p.json"), *argv])
    quick, overridden, default = seen
    assert quick.quick and quick.repeats == QUICK_EFFORT.repeats and quick.densities == (0.01,)
    assert quick.in_situ_repeats == QUICK_EFFORT.in_situ_repeats and quick.powersgd_ranks == (4,)
    assert overridden.repeats == 7 and overridden.densities == (0.1,) and overridden.warmup == QUICK_EFFORT.warmup
    assert not default.quick and default.repeats == 10 and default.densities == (0.001, 0.01, 0.1, 1.0)


def test_a_quick_profile_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    from planner.commands.printing import print_profile

    prof = dataclasses.replace(synthetic_profile("mlp"), quick=True)
    assert Profile.from_dict(prof.to_dict()).quick
    print_profile(prof)
    assert "a quick profile (--quick)" in capsys.readouterr().err


def test_progress_prints_lines_where_the_output_is_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    import planner.console as console_module

    def lines(every_s: float) -> list[str]:
        out = io.StringIO()
        monkeypatch.setattr(console_module, "err_console", Console(file=out, force_terminal=False, width=120))
        monkeypatch.setattr(console_module, "LOG_EVERY_S", every_s)
        with console_module.progress() as bar:
            task = bar.add_task("layers of mlp", total=3)
            for _ in range(3):
                bar.advance(task)
        return [line for line in out.getvalue().splitlines() if line.startswith("[")]

    long = lines(0.0)  # every step of this phase is "long"
    assert long[0].endswith("layers of mlp: 1/3") and long[-1].endswith("layers of mlp: 3/3 done")
    assert lines(60.0) == []  # a phase shorter than LOG_EVERY_S prints nothing more than its bar


def test_a_kfac_plan_gets_intervals_and_is_weighed_against_the_reference_layouts() -> None:
    from planner.strategies.intervals import KFAC_REFERENCES, with_kfac_intervals
    from planner.strategies.kfac_plan import make_kfac_plan

    prof = with_samples(synthetic_profile("cnn"))
    plan = make_kfac_plan(prof, inv_update_steps=5, time_limit_s=0.5)
    weighed = with_kfac_intervals(plan, prof)
    section = weighed.kfac
    assert section is not None and section.intervals is not None and section.verdict is not None
    assert {"plan", "sgd", *KFAC_REFERENCES} <= set(section.intervals)
    printed = {"plan": plan.kfac.predicted, **plan.kfac.baselines}  # type: ignore[union-attr]
    for name, (low, high) in section.intervals.items():
        assert low <= printed[name].step_s * 1.05 and high >= printed[name].step_s * 0.95  # type: ignore[union-attr]
    assert section.verdict.keep in ("plan", *KFAC_REFERENCES) and section.verdict.against in KFAC_REFERENCES
    assert Plan.from_dict(json.loads(json.dumps(weighed.to_dict()))) == weighed
    doc = weighed.to_dict()
    doc["kfac"]["predicted"]["verdict"]["keep"] = "kfac-tensorflow"
    with pytest.raises(SchemaError, match="does not predict"):
        Plan.from_dict(doc)
    assert with_kfac_intervals(plan, synthetic_profile("cnn")) == plan  # no samples: unchanged


def test_the_bench_predicts_a_hook_no_plan_prints_from_the_verdict_that_weighed_it() -> None:
    from planner.models import build_workload
    from planner.sessions.bench import bench_variants
    from planner.strategies.auto import solve_auto

    prof = with_samples(measured_profile("mlp"))
    kept = solve_auto(prof, parse_compressors("dense,fp16,powersgd:4")).candidates["dense"]
    assert kept.verdict is not None and "ddp+fp16" not in kept.baselines
    variants = {v.name: v for v in bench_variants((kept,), build_workload("mlp").module,
                                                  peers=parse_compressors("fp16,powersgd:1"))}
    step, low, high = kept.verdict.variants["ddp+fp16"]
    assert variants["ddp+fp16"].predicted_s == step and variants["ddp+fp16"].interval == (low, high)
    assert variants["ddp+powersgd:1"].predicted_s is None  # weighed by no plan


def test_the_bench_runs_the_ddp_hook_a_verdict_weighed_with_its_selector() -> None:
    from planner.models import build_workload
    from planner.sessions.bench import bench_variants
    from planner.strategies.auto import solve_auto

    prof = with_samples(measured_profile("mlp"))
    kept = solve_auto(prof, parse_compressors("dense,topk:0.01")).candidates["dense"]
    assert kept.verdict is not None and kept.verdict.topk_selector in ("exact", "sampled")
    assert Plan.from_dict(json.loads(json.dumps(kept.to_dict()))).verdict == kept.verdict
    forced = dataclasses.replace(kept, verdict=dataclasses.replace(kept.verdict, keep="ddp+topk:0.01"))
    variants = {v.name: v for v in bench_variants((forced,), build_workload("mlp").module, peers=())}
    hook = variants["ddp+topk:0.01"]
    assert hook.selector == kept.verdict.topk_selector
    assert hook.predicted_s == kept.verdict.variants["ddp+topk:0.01"][0]


def test_a_mixed_table_predicts_the_ddp_topk_hook_as_its_verdict_weighs_it_and_the_bench_runs_it() -> None:
    """The DDP top-k hook is one row: in a mixed plan's table, in its verdict and in the bench, with the selector the
    profile predicts faster for it (here sampled, made 10x cheaper), whatever the plan's own groups select with."""
    from planner.models import build_workload
    from planner.sessions.bench import bench_variants
    from planner.strategies.intervals import with_intervals
    from planner.strategies.mixed_plan import make_mixed_plan

    prof = with_samples(measured_profile("mlp"))
    assert prof.topk is not None
    cheap = tuple((n, d, s / 10) for n, d, s in prof.topk.select)
    prof = dataclasses.replace(prof, topk=dataclasses.replace(prof.topk, select_sampled=cheap))
    # The plan's own groups select exactly; DDP's hook is still predicted (and run) with the faster one.
    mixed = with_intervals(make_mixed_plan(prof, parse_compressors("dense,fp16,topk:0.01"), selector="exact"), prof)
    assert mixed.verdict is not None and mixed.verdict.topk_selector == "sampled"
    table = mixed.baselines["ddp+topk:0.01"].iteration_s
    assert math.isclose(table, mixed.verdict.variants["ddp+topk:0.01"][0], rel_tol=1e-9)
    assert mixed.intervals is not None and "ddp+topk:0.01" in mixed.intervals.rows
    hook = {v.name: v for v in bench_variants((mixed,), build_workload("mlp").module, peers=())}["ddp+topk:0.01"]
    assert hook.selector == "sampled" and hook.predicted_s == table


def test_progress_lines_keep_coming_while_a_phase_stops_advancing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung phase (no advance) still prints where it stopped, from the display's own thread."""
    import time

    from rich.console import Console

    import planner.console as console_module

    out = io.StringIO()
    monkeypatch.setattr(console_module, "err_console", Console(file=out, force_terminal=False, width=120))
    monkeypatch.setattr(console_module, "LOG_EVERY_S", 0.05)
    with console_module.progress() as bar:
        task = bar.add_task("the runtime in real steps", total=4)
        bar.advance(task)
        deadline = time.monotonic() + 30
        while out.getvalue().count("the runtime in real steps: 1/4") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert out.getvalue().count("the runtime in real steps: 1/4") >= 2  # printed again with nothing advanced
