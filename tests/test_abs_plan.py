"""ABS-SGD plans: the abs section's contract, the round model against hand-worked cases, the choice of
micro-batch and trigger, and `planner solve --strategy abs` (good and bad input)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.commands.cli import main
from planner.contracts.abs_section import ABSSection, VariantPrediction
from planner.contracts.layers import plan_grouping
from planner.contracts.plan import Plan
from planner.contracts.profile import Collective, Profile, WorkerThroughput
from planner.costmodel.curves import curve_model, fit_curve
from planner.costmodel.from_profile import gradient_problem
from planner.strategies.abs_plan import (
    ON_TARGET,
    _micro_batch_sizes,
    accumulate_s,
    batch_trigger_counts,
    equal_batches,
    exchange_s,
    make_abs_plan,
    micro_batch_costs,
    progress_per_s,
    proportional_batches,
    simulate_abs,
)
from planner.strategies.gradients import make_plan
from planner.types import InvalidProfileError, SchemaError, Strategy
from tests.factories import abs_section, examples, synthetic_profile
from tests.test_contracts import _main, _one_clear_line
from tests.test_slowdown import needs_cgroups


def slowed_profile(factor: float = 2.0, world_size: int = 2) -> Profile:
    """The synthetic MLP profile with per-worker throughput: the last worker `factor` times slower."""
    prof = synthetic_profile("mlp", world_size)
    sizes = (16, 32, 64)
    rows = tuple(tuple((1e-3 + 2e-4 * b) * (factor if r == world_size - 1 else 1.0) for b in sizes)
                 for r in range(world_size))
    return replace(prof, throughput=WorkerThroughput(batch_sizes=sizes, step_s=rows))


# -- contract ---------------------------------------------------------------------------------------------
def test_an_abs_plan_round_trips_and_old_plans_read_without_one(tmp_path: Path) -> None:
    plan = make_abs_plan(slowed_profile(), 128, source="p.json")
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded.abs == plan.abs and loaded.groups == plan.groups
    doc = json.loads(path.read_text())
    assert set(doc["abs"]["predicted"]) == {"abs-sgd", "sync-equal", "sync-proportional"}
    doc["abs"]["round_samples"] = 100
    assert Plan.from_dict(doc).abs.round_samples == 100
    del doc["abs"]["round_samples"]  # plans made before the batch trigger: the exchange trigger
    assert Plan.from_dict(doc).abs.round_samples is None
    del doc["abs"]
    assert Plan.from_dict(doc).abs is None
    assert "--strategy abs --global-batch 128" in plan.replan_command()


@pytest.mark.parametrize(("change", "match"), [
    ({"min_micro_batches": 3, "max_micro_batches": 2}, "min_micro_batches <= max_micro_batches"),
    ({"min_micro_batches": 0}, "min_micro_batches"),
    ({"micro_batch": 100, "global_batch": 64}, "micro_batch <= global_batch"),
    ({"round_samples": 0}, "round_samples"),
])
def test_bad_abs_sections_are_refused(change: dict[str, int], match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        replace(abs_section(), **change)


def test_an_abs_section_must_fit_the_plan() -> None:
    plan = make_abs_plan(slowed_profile(), 128)
    with pytest.raises(SchemaError, match="predicts 3 workers, but the plan is for world size 2"):
        replace(plan, abs=abs_section(3))
    with pytest.raises(SchemaError, match="smaller than the world size"):
        replace(plan, abs=abs_section(2, micro_batch=1, global_batch=1))
    with pytest.raises(SchemaError, match="round_samples 1 is smaller than the world size"):
        replace(plan, abs=replace(abs_section(2), round_samples=1))
    doc = plan.to_dict()
    del doc["abs"]["predicted"]["sync-equal"]
    with pytest.raises(SchemaError, match=r"lacks the variant\(s\) \['sync-equal'\]"):
        Plan.from_dict(doc)
    doc = plan.to_dict()
    doc["abs"]["predicted"]["abs-sgd"]["samples"] = [-1, 2]
    with pytest.raises(SchemaError, match=r"plan\.abs\.predicted\.abs-sgd"):
        Plan.from_dict(doc)


# -- the round model -----------------------------------------------------------------------------------
def test_rounds_as_worked_by_hand() -> None:
    # Worker 0 takes 1 s per micro-batch, worker 1 takes 2 s; one micro-batch at least; the exchange (0.5 s)
    # hides behind worker 1's micro-batch. Worker 1 sets the pace: 2 s of compute + 0.1 s of update per
    # round, in which worker 0 computes 2 micro-batches on average and nobody waits.
    p = simulate_abs([1.0, 2.0], micro_batch=8, min_micro_batches=1, max_micro_batches=None, exchange_s=0.5,
                     update_s=0.1)
    assert p.round_s == pytest.approx(2.1, rel=1e-3)
    assert p.samples == pytest.approx((16.0, 8.0), rel=2e-2)
    assert p.idle_s == (0.0, 0.0)
    # With interference 1 the slow worker's micro-batch runs twice as slow for the 0.4 s the exchange still
    # has to go after the update: 0.2 s more per round.
    p = simulate_abs([1.0, 2.0], micro_batch=8, min_micro_batches=1, max_micro_batches=None, exchange_s=0.5,
                     update_s=0.1, interference=1.0)
    assert p.round_s == pytest.approx(2.3, rel=1e-3)
    # An exchange longer than a round's compute stretches the rounds: everyone keeps computing meanwhile.
    slow_net = simulate_abs([1.0, 1.0], micro_batch=8, min_micro_batches=1, max_micro_batches=None,
                            exchange_s=3.5, update_s=0.0)
    assert slow_net.round_s == pytest.approx(4.0, rel=1e-3) and slow_net.idle_s == (0.0, 0.0)
    # A cap below what the exchange needs makes the workers wait for it.
    capped = simulate_abs([1.0, 1.0], micro_batch=8, min_micro_batches=1, max_micro_batches=2, exchange_s=3.5,
                          update_s=0.0)
    assert capped.samples == pytest.approx((16.0, 16.0)) and capped.idle_s[0] == pytest.approx(1.5, rel=1e-3)


def test_batch_trigger_rounds_as_worked_by_hand() -> None:
    # Rounds of 24 samples in micro-batches of 8, worker 0 twice as fast: it computes 2, worker 1 one.
    assert batch_trigger_counts(24, 8, [1.0, 2.0]) == (2, 1)
    assert batch_trigger_counts(8, 8, [1.0, 3.0]) == (1, 1)  # at least one each
    assert batch_trigger_counts(104, 10, [1.0, 1.0, 1.0, 1.0]) == (3, 3, 3, 3)  # 26 each: 30 is nearer than 20
    assert batch_trigger_counts(100, 10, [1.0, 1.0, 1.0, 1.0]) == (2, 2, 2, 2)  # 25 each: a tie ends at 20
    # Both finish their 2 s of compute together; the exchange (0.5 s) runs behind the next round's compute.
    p = simulate_abs([1.0, 2.0], micro_batch=8, min_micro_batches=1, max_micro_batches=None, exchange_s=0.5,
                     update_s=0.1, fixed=(2, 1))
    assert p.round_s == pytest.approx(2.1, rel=1e-6) and p.samples == (16.0, 8.0) and p.idle_s == (0.0, 0.0)
    # An exchange of 3.5 s outlasts the round: rounds take the exchange's time and both wait the rest, where the
    # exchange trigger would have them compute more samples instead.
    slow_net = simulate_abs([1.0, 2.0], micro_batch=8, min_micro_batches=1, max_micro_batches=None,
                            exchange_s=3.5, update_s=0.0, fixed=(2, 1))
    assert slow_net.round_s == pytest.approx(3.5, rel=1e-6) and slow_net.samples == (16.0, 8.0)
    assert slow_net.idle_s == pytest.approx((1.5, 1.5), rel=1e-6)
    assert progress_per_s(slow_net, 24) == pytest.approx(24 / 3.5)
    uncapped = simulate_abs([1.0, 2.0], micro_batch=8, min_micro_batches=1, max_micro_batches=None,
                            exchange_s=3.5, update_s=0.0)
    assert sum(uncapped.samples) > 24 and progress_per_s(uncapped, 24) < uncapped.samples_per_s
    with pytest.raises(SchemaError, match="batch trigger"):
        simulate_abs([1.0, 2.0], micro_batch=8, min_micro_batches=1, max_micro_batches=None, exchange_s=1.0,
                     update_s=0.0, fixed=(1,))


def test_the_triggers_a_plan_chooses_from() -> None:
    prof = slowed_profile(2.0)
    # an exchange of 50 ms: the slow worker computes its part of 128 samples in about 14 ms
    sizes = [1 << s for s in range(10, 27, 2)]
    slow_link = fit_curve([(n, 0.05 + 1e-12 * n) for n in sizes])
    slow = replace(prof, collectives={**prof.collectives, Collective.ALLREDUCE: slow_link})
    a = make_abs_plan(slow, 128, trigger="best").abs
    assert a is not None and a.round_samples == 128 and a.max_micro_batches is None
    assert sum(a.predicted["abs-sgd"].samples) <= ON_TARGET * 128
    assert a.predicted["abs-sgd"].round_s == pytest.approx(0.05, rel=0.2)  # the exchange's pace
    paper = make_abs_plan(slow, 128, trigger="exchange").abs  # the paper's rule stretches rounds to hide it
    assert paper is not None and paper.round_samples is None and paper.max_micro_batches is not None
    assert sum(paper.predicted["abs-sgd"].samples) > 128
    default = make_abs_plan(prof, 128).abs  # the default: the batch trigger, whatever the exchange
    assert default is not None and default.round_samples == 128 and default.min_micro_batches == 1
    with pytest.raises(SchemaError, match="trigger must be one of"):
        make_abs_plan(prof, 128, trigger="sometimes")
    fast = make_abs_plan(prof, 128, trigger="best").abs  # the exchange hides behind a round: whichever predicts more
    assert fast is not None
    chosen = fast.predicted["abs-sgd"]
    assert progress_per_s(chosen, 128) >= 0.99 * max(progress_per_s(fast.predicted[v], 128)
                                                     for v in ("sync-equal", "sync-proportional"))


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.floats(0.01, 1.0), min_size=1, max_size=4), st.integers(1, 4), st.floats(0.0, 2.0),
       st.floats(0.0, 0.5))
def test_uncapped_rounds_never_wait_and_account_for_all_time(times: list[float], m: int, exchange: float,
                                                             update: float) -> None:
    p = simulate_abs(times, micro_batch=4, min_micro_batches=m, max_micro_batches=None, exchange_s=exchange,
                     update_s=update)
    assert p.idle_s == tuple(0.0 for _ in times)
    slowest = max(times)
    # (averages over a window of rounds: a worker's phase at its ends moves them by up to a micro-batch)
    assert p.round_s >= 0.98 * (m * slowest + update) - 1e-9 and p.round_s >= 0.98 * exchange - 1e-9
    for t, samples in zip(times, p.samples, strict=True):  # a worker that never waits computes all round
        assert samples / 4 * t + update == pytest.approx(p.round_s, rel=0.05)


@given(st.integers(1, 10_000), st.lists(st.floats(0.1, 100.0), min_size=1, max_size=8))
def test_batches_split_the_global_batch(global_batch: int, speeds: list[float]) -> None:
    if global_batch < len(speeds):
        with pytest.raises(SchemaError):
            proportional_batches(global_batch, speeds)
        return
    parts = proportional_batches(global_batch, speeds)
    assert sum(parts) == global_batch and min(parts) >= 1
    ideal = [1 + (global_batch - len(speeds)) * s / sum(speeds) for s in speeds]
    assert all(abs(p - i) < 1 + 1e-9 for p, i in zip(parts, ideal, strict=True))
    equal = equal_batches(global_batch, len(speeds))
    assert sum(equal) == global_batch and max(equal) - min(equal) <= 1


# -- the plan --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("global_batch", [8, 64, 256, 1000])
def test_the_plan_is_the_fastest_on_target_round(global_batch: int) -> None:
    prof = slowed_profile()
    plan = make_abs_plan(prof, global_batch, trigger="best")
    a = plan.abs
    assert a is not None and a.global_batch == global_batch
    assert plan.groups == make_plan(prof, Strategy.DENSE).groups  # the exchange moves the dense plan's groups
    chosen = a.predicted["abs-sgd"]
    assert chosen.shares[0] >= chosen.shares[1]  # the fast worker contributes more (or one micro-batch each)
    if global_batch >= 4 * a.micro_batch:
        assert chosen.shares[0] > chosen.shares[1]
    assert a.predicted["sync-equal"].samples == tuple(float(b) for b in equal_batches(global_batch, 2))
    proportional = a.predicted["sync-proportional"].samples
    assert sum(proportional) == global_batch and proportional[0] > proportional[1]
    # exhaustively over the candidates' grid (both triggers): the most progress per second on target, else the
    # smallest round
    step = micro_batch_costs(prof)
    problem = gradient_problem(prof, Strategy.DENSE)
    grouping = plan_grouping(plan, prof)
    exchange = exchange_s(problem, grouping)
    extra = accumulate_s(curve_model(prof.pack) if prof.pack is not None else None, problem, grouping)
    smallest = prof.throughput.batch_sizes[0] if prof.throughput else 1
    common = {"exchange_s": exchange, "update_s": problem.update_s, "interference": problem.interference}
    grid = []
    for b in _micro_batch_sizes(global_batch, 2, smallest):
        times = [c.cost(b) + extra for c in step]
        grid.append(simulate_abs(times, micro_batch=b, min_micro_batches=1, max_micro_batches=None,
                                 fixed=batch_trigger_counts(global_batch, b, times), **common))
        grid += [simulate_abs(times, micro_batch=b, min_micro_batches=m, max_micro_batches=None, **common)
                 for m in range(1, global_batch // b + 2)]
    assert a.micro_batch >= min(smallest, global_batch // 2)  # no extrapolation below the measured sizes
    on_target = [p for p in grid if sum(p.samples) <= ON_TARGET * global_batch]
    if on_target:
        assert sum(chosen.samples) <= ON_TARGET * global_batch
        assert progress_per_s(chosen, global_batch) == pytest.approx(
            max(progress_per_s(p, global_batch) for p in on_target), rel=1e-9)
    else:  # the exchange outlasts computing a global batch: rounds grow to hide it
        assert sum(chosen.samples) == pytest.approx(min(sum(p.samples) for p in grid))
        assert chosen.round_s >= exchange


def test_abs_beats_both_baselines_when_a_worker_is_slow_and_not_when_all_are_alike() -> None:
    slow = make_abs_plan(slowed_profile(2.0), 256).abs
    assert slow is not None
    rates = {name: p.samples_per_s for name, p in slow.predicted.items()}
    assert rates["abs-sgd"] > rates["sync-proportional"] > rates["sync-equal"]
    assert slow.predicted["sync-equal"].idle_s[0] > slow.predicted["sync-equal"].idle_s[1]  # the fast one waits
    alike = make_abs_plan(slowed_profile(1.0), 256).abs
    assert alike is not None
    equal = alike.predicted
    assert equal["sync-equal"].samples == equal["sync-proportional"].samples


def test_a_profile_without_throughput_is_refused_with_what_to_do() -> None:
    with pytest.raises(InvalidProfileError, match=r"no per-worker throughput.*planner profile"):
        make_abs_plan(synthetic_profile("mlp"), 64)
    with pytest.raises(SchemaError, match="smaller than the world size 2"):
        make_abs_plan(slowed_profile(), 1)


# -- the command ----------------------------------------------------------------------------------------
def test_solve_abs_writes_and_prints_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "prof.json"
    slowed_profile().save(prof)
    out = tmp_path / "plan.json"
    assert main(["solve", str(prof), "--strategy", "abs", "--global-batch", "128", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ABS-SGD, global batch 128" in text and "sync-proportional" in text
    assert Plan.load(out).abs is not None


def test_solve_abs_bad_input_gives_one_line(tmp_path: Path) -> None:
    prof = tmp_path / "prof.json"
    slowed_profile().save(prof)
    plain = tmp_path / "plain.json"
    synthetic_profile("mlp").save(plain)
    out = str(tmp_path / "plan.json")
    _one_clear_line(_main("solve", str(prof), "--strategy", "abs", "-o", out), "needs --global-batch")
    _one_clear_line(_main("solve", str(prof), "--strategy", "abs", "--global-batch", "1", "-o", out),
                    "smaller than the world size 2")
    _one_clear_line(_main("solve", str(prof), "--global-batch", "64", "-o", out), "applies to --strategy abs only")
    _one_clear_line(_main("solve", str(prof), "--trigger", "batch", "-o", out), "--trigger applies to --strategy abs")
    _one_clear_line(_main("solve", str(prof), "--strategy", "abs", "--global-batch", "64", "--trigger", "often",
                         "-o", out), "invalid choice")
    _one_clear_line(_main("solve", str(plain), "--strategy", "abs", "--global-batch", "64", "-o", out),
                    "no per-worker throughput")
    _one_clear_line(_main("solve", str(prof), "--strategy", "abs", "--global-batch", "0", "-o", out), "")
    assert not Path(out).exists()


def test_variant_predictions_derive_their_rates() -> None:
    p = VariantPrediction(round_s=0.5, samples=(30.0, 10.0), idle_s=(0.0, 0.1))
    assert p.samples_per_s == 80.0 and p.shares == (0.75, 0.25) and p.idle_fraction == (0.0, 0.2)
    assert VariantPrediction.from_dict(p.to_dict(), "x") == p
    with pytest.raises(SchemaError, match="same length"):
        VariantPrediction(round_s=1.0, samples=(1.0,), idle_s=(0.0, 0.0))
    assert isinstance(ABSSection.from_dict(abs_section().to_dict()), ABSSection)


# -- the bench --------------------------------------------------------------------------------------------
def digits_plan(tmp_path: Path, global_batch: int = 64) -> Path:
    prof = replace(slowed_profile(), model=synthetic_profile("digits").model, layers=synthetic_profile("digits").layers)
    path = tmp_path / "digits-abs.json"
    make_abs_plan(prof, global_batch).save(path)
    return path


def test_bench_abs_runs_every_variant_to_the_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = digits_plan(tmp_path)
    assert main(["bench", "--strategy", "abs", "--plan", str(plan), "--samples", "4000", "--repeats", "1",
                 "--target-loss", "1.5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    variants = {v["variant"]: v for v in doc["variants"]}
    assert set(variants) == {"abs-sgd", "sync-equal", "sync-proportional"}
    for name, v in variants.items():
        assert v["reached"] == 1 and v["time_to_target_s"] > 0, name  # 4000 digits take the loss below 1.5
        assert v["samples_per_s"] > 0 and v["predicted_samples_per_s"] > 0
        assert abs(sum(v["shares"]) - 1) < 1e-9 and len(v["idle_fraction"]) == 2
    for run in doc["runs"]:
        assert run["samples"] >= 4000
        assert sum(run["worker_samples"]) >= run["samples"]  # every applied sample was computed by a worker
        assert run["curve"][0][2] > 1.5 >= min(loss for _, _, loss in run["curve"])
    assert variants["sync-equal"]["shares"] == [0.5, 0.5]


def test_bench_abs_bad_input_gives_one_line(tmp_path: Path) -> None:
    prof = tmp_path / "prof.json"
    slowed_profile().save(prof)
    dense = tmp_path / "dense.json"
    assert main(["solve", str(prof), "-o", str(dense)]) == 0
    _one_clear_line(_main("bench", "--strategy", "abs", "--plan", str(dense)), "has no abs section")
    _one_clear_line(_main("bench", "--plan", str(dense), "--samples", "10"), "with --target-loss L")
    plan = digits_plan(tmp_path)
    _one_clear_line(_main("bench", "--strategy", "abs", "--plan", str(plan), "--nproc", "3"),
                    "made for world size 2")
    _one_clear_line(_main("bench", "--strategy", "abs", "--plan", str(plan), "--target-loss", "0"), "> 0")
    _one_clear_line(_main("bench", "--strategy", "abs", "--plan", str(plan), "--speed-change", "1=3"),
                    "--speed-change names rank(s) [1] that --slowdown does not slow")


@needs_cgroups
def test_bench_abs_changes_a_workers_speed_halfway(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = digits_plan(tmp_path)
    assert main(["bench", "--strategy", "abs", "--plan", str(plan), "--samples", "4000", "--repeats", "1",
                 "--target-loss", "1.5", "--slowdown", "1=1.5", "--speed-change", "1=3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for run in doc["runs"]:
        seconds, applied = run["changed_at"]
        assert 2000 <= applied < run["samples"] and 0 < seconds < run["wall_s"]
    assert all(v["samples_per_s_after_change"] > 0 for v in doc["variants"])
