"""The tasks whose loss means something (planner.tasks) and `planner bench --target-loss` for gradient plans."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch

from planner.commands.cli import main
from planner.sessions.bench import plan_tag
from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors
from planner.tasks import NORM_SAMPLES, TOKEN_LABELS, _teacher_data, build_task
from planner.types import PlannerError
from tests.factories import synthetic_plan, synthetic_profile


def test_digits_task_is_the_digits() -> None:
    task = build_task("digits", "digits")
    x, y = task.eval_batch
    assert x.shape == (1797, 64) and y.shape == (1797,) and set(y.tolist()) == set(range(10))
    assert task.eval_loss(task.workload.module) == pytest.approx(2.3, abs=0.2)  # untrained: about ln 10


@pytest.mark.parametrize("model", ["mlp", "cnn", "bert-tiny"])
def test_teacher_labels_spread_and_are_learnable_inputs(model: str) -> None:
    """The teacher labels held-out inputs of the model's own kind with many classes (not all one), the same way
    every time (every rank and variant trains on the same data, built anew in each process)."""
    task = build_task(model, "teacher")
    x, y = task.eval_batch
    # the held-out loss on a slice (bert-tiny's 256 sequences are 16,384 tokens of 30,522 logits each: 6 s)
    part = dataclasses.replace(task, eval_batch=(x[:32], y[:32]))
    assert len(x) == len(y) and torch.isfinite(torch.tensor(part.eval_loss(task.workload.module)))
    assert len(set(y.flatten().tolist())) >= 5
    if not x.is_floating_point():
        assert int(y.max()) < TOKEN_LABELS
    batch_x, batch_y = task.workload.make_batch(4, torch.Generator().manual_seed(0))
    _teacher_data.cache_clear()  # built again, as another process builds it
    again_x, again_y = build_task(model, "teacher").workload.make_batch(4, torch.Generator().manual_seed(0))
    assert torch.equal(batch_x, again_x) and torch.equal(batch_y, again_y)


def test_a_student_with_batchnorm_is_judged_by_its_weights_not_its_running_statistics() -> None:
    """Precise BN: a student's held-out loss does not hang on the running statistics its last batches left, and
    the statistics it is evaluated with are those of the task's slice of training inputs (by hand)."""
    task = build_task("cnn", "teacher")
    assert task.norm_inputs is not None and len(task.norm_inputs) == NORM_SAMPLES

    def stale() -> torch.nn.Module:
        module = copy.deepcopy(task.workload.module)
        with torch.no_grad():
            module(torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(5)) * 4 + 2)  # other data
        return module.train(False)

    fresh = copy.deepcopy(task.workload.module).train(False)
    assert task.eval_loss(stale()) == pytest.approx(task.eval_loss(fresh), rel=1e-5)
    running = dataclasses.replace(task, norm_inputs=None)  # the running statistics, as before
    assert running.eval_loss(stale()) != pytest.approx(running.eval_loss(fresh), rel=1e-2)
    conv = next(m for m in fresh.modules() if isinstance(m, torch.nn.Conv2d))
    norm = next(m for m in fresh.modules() if isinstance(m, torch.nn.BatchNorm2d))
    with torch.no_grad():
        out = conv(task.norm_inputs)
    assert torch.allclose(norm.running_mean, out.mean((0, 2, 3)), atol=1e-5)
    assert torch.allclose(norm.running_var, out.var((0, 2, 3)), rtol=1e-4)
    assert norm.momentum == 0.1 and not norm.training  # as it was
    assert build_task("digits", "digits").norm_inputs is None


def test_unknown_or_mismatched_tasks_are_refused() -> None:
    with pytest.raises(PlannerError, match="unknown task"):
        build_task("mlp", "imagenet")
    with pytest.raises(PlannerError, match="trains the built-in digits model"):
        build_task("mlp", "digits")


def test_bench_runs_every_variant_to_the_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dense, mixed = tmp_path / "dense.json", tmp_path / "mixed.json"
    synthetic_plan("digits").save(dense)
    lossy_plan = make_mixed_plan(synthetic_profile("digits"), parse_compressors("fp16,powersgd:1"))
    lossy_plan.save(mixed)
    assert main(["bench", "--plan", str(dense), "--plan", str(mixed), "--target-loss", "1.5", "--samples", "3000",
                 "--peers", "fp16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["task"] == "digits" and doc["target_loss"] == 1.5
    names = [v["variant"] for v in doc["variants"]]
    lossy = f"plan {plan_tag(lossy_plan)}"  # named by what it sends, e.g. "plan mixed (fp16, powersgd:1)"
    assert lossy.startswith("plan mixed (")
    assert names == ["ddp", "plan dense", lossy, "ddp+fp16"]
    runs = {r["variant"]: r for r in doc["runs"]}
    for r in runs.values():
        assert r["samples"] >= 3000 and r["steps"] > 0 and r["curve"][0][1] == 0  # from the same start
        assert r["curve"][0][2] == pytest.approx(runs["ddp"]["curve"][0][2])  # same initial weights
    # DDP and the dense plan apply the same averaged gradients: the same final loss up to rounding.
    assert runs["plan dense"]["curve"][-1][2] == pytest.approx(runs["ddp"]["curve"][-1][2], rel=1e-3)
    for v in doc["variants"]:  # the lossless ones reach it; PowerSGD at rank 1 learns, more slowly at first
        if v["variant"] != lossy:
            assert v["reached"] == 1 and v["time_to_target_s"] > 0, v
    assert runs[lossy]["curve"][-1][2] < runs[lossy]["curve"][0][2] - 0.3


def test_bench_target_runs_top_k_plans_with_the_density_warmup(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`--density-warmup START,STEPS` reaches the top-k plans' exchange; DDP and its hooks run without it."""
    from planner.sessions.bench import sgd_as_advised
    from planner.types import Strategy
    from tests.test_runtime import make_plan

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    topk = make_plan(model, "single", Strategy.TOPK, 0.1, world_size=1)
    _, exchange = sgd_as_advised(model, topk, lr=0.1, momentum=0.9, find_unused=False, density_warmup=(0.5, 10))
    assert exchange.current_density == pytest.approx(0.5)
    _, exchange = sgd_as_advised(model, make_plan(model, "single", world_size=1), lr=0.1, momentum=0.9,
                                 find_unused=False, density_warmup=(0.5, 10))
    assert exchange.current_density is None  # a dense plan: no warm-up
    path = tmp_path / "topk.json"
    synthetic_plan("digits", strategy=Strategy.TOPK, density=0.01).save(path)
    assert main(["bench", "--plan", str(path), "--target-loss", "1.5", "--samples", "1000", "--peers", "none",
                 "--density-warmup", "0.25,500", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["density_warmup"] == [0.25, 500]
    assert [v["variant"] for v in doc["variants"]] == ["ddp", "plan topk@0.01", "ddp+topk:0.01"]


def test_bench_target_runs_a_budgeted_plan_adaptive_beside_static(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`--adaptive STEPS` adds a row re-planning each plan kept within an error budget; other plans get none."""
    from tests.test_budget_plan import profile_with_errors

    profile_path, budgeted, free = tmp_path / "profile.json", tmp_path / "budgeted.json", tmp_path / "free.json"
    profile = profile_with_errors("digits")
    profile.save(profile_path)
    allowed = parse_compressors("dense,fp16,powersgd:1,powersgd:4")
    make_mixed_plan(profile, allowed, source=str(profile_path), error_budget=0.3, time_limit_s=None).save(budgeted)
    make_mixed_plan(profile, allowed, source=str(profile_path), time_limit_s=None).save(free)
    assert main(["bench", "--plan", str(budgeted), "--plan", str(free), "--target-loss", "1.5", "--samples", "2600",
                 "--peers", "none", "--adaptive", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    names = [v["variant"] for v in doc["variants"]]
    assert sum(n.endswith(" adaptive") for n in names) == 1 and names[2] == f"{names[1]} adaptive", names
    runs = {r["variant"]: r for r in doc["runs"]}
    adaptive = runs[names[2]]
    assert adaptive["steps"] >= 16 and all(r.startswith("step ") for r in adaptive["replans"])
    assert adaptive["curve"][-1][2] < adaptive["curve"][0][2]


def test_bench_target_runs_a_budgeted_plan_inside_ddp_static_and_adaptive(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`--via-ddp` adds the plan run inside DDP (PlanHook); with `--adaptive` it re-plans there too."""
    from tests.test_budget_plan import profile_with_errors

    profile_path, budgeted = tmp_path / "profile.json", tmp_path / "budgeted.json"
    profile = profile_with_errors("digits")
    profile.save(profile_path)
    allowed = parse_compressors("dense,fp16,powersgd:1,powersgd:4")
    plan = make_mixed_plan(profile, allowed, source=str(profile_path), error_budget=0.3, time_limit_s=None)
    plan.save(budgeted)
    assert main(["bench", "--plan", str(budgeted), "--target-loss", "1.5", "--samples", "2600", "--peers", "none",
                 "--adaptive", "8", "--via-ddp", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    name = f"plan {plan_tag(plan)}"
    names = [v["variant"] for v in doc["variants"]]
    assert names == ["ddp", name, f"{name} adaptive", f"{name} via DDP", f"{name} via DDP adaptive"], names
    runs = {r["variant"]: r for r in doc["runs"]}
    for variant in names[1:]:
        run = runs[variant]
        assert run["steps"] >= 16 and run["curve"][-1][2] < run["curve"][0][2], variant
        assert all(r.startswith("step ") for r in run["replans"])
    predicted = {v["variant"]: v["predicted_step_s"] for v in doc["variants"]}
    assert predicted[f"{name} via DDP"] is not None


def test_the_table_gives_each_prediction_with_its_interval(capsys: pytest.CaptureFixture[str]) -> None:
    """Each row's predicted step comes with the interval its plan gives it (the plan's own, and DDP's and the hooks'
    from the plan's verdict), in the table and in --json."""
    from planner.sessions.bench_target import TargetBenchConfig, TargetRun, print_target_bench
    from planner.strategies.intervals import with_intervals
    from planner.types import Compressor
    from tests.factories import with_samples
    from tests.test_budget_plan import profile_with_errors

    profile = with_samples(profile_with_errors("digits"))
    plan = with_intervals(make_mixed_plan(profile, parse_compressors("dense,fp16,powersgd:4"), error_budget=0.3,
                                          time_limit_s=None), profile)
    assert plan.intervals is not None and plan.verdict is not None
    config = TargetBenchConfig(plans=(plan,), model="digits", task="digits", target_loss=1.0, samples=100,
                               peers=(Compressor.parse("fp16"),))
    name = f"plan {plan_tag(plan)}"
    runs = [TargetRun(variant=v, repeat=0, wall_s=1.0, samples=100, steps=10, curve=((0.0, 0, 2.0), (1.0, 100, 0.5)))
            for v in ("ddp", name, "ddp+fp16")]
    print_target_bench(config, runs, as_json=True)
    rows = {v["variant"]: v for v in json.loads(capsys.readouterr().out)["variants"]}
    assert rows[name]["predicted_interval_s"] == pytest.approx(list(plan.intervals.rows["plan"]))
    assert rows["ddp+fp16"]["predicted_interval_s"] == pytest.approx(list(plan.verdict.variants["ddp+fp16"][1:]))
    print_target_bench(config, runs, as_json=False)
    low, high = plan.intervals.rows["plan"]
    assert f"{plan.predicted.iteration_s * 1e3:,.1f} [{low * 1e3:,.1f}, {high * 1e3:,.1f}]" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--adaptive", "50"], "--adaptive applies to the time-to-target bench"),
    (["--via-ddp"], "--via-ddp applies to the time-to-target bench"),
    (["--target-loss", "1", "--adaptive", "4"], "--adaptive must be at least 8 steps"),
    (["--density-warmup", "0.25,500"], "--density-warmup applies to the time-to-target bench"),
    (["--target-loss", "1", "--density-warmup", "0.25"], "expected START,STEPS"),
    (["--target-loss", "1", "--density-warmup", "1.5,10"], "`0 < START <= 1`"),
    (["--task", "teacher"], "--task applies to the time-to-target bench"),
    (["--samples", "100"], "with --target-loss L"),
    (["--target-loss", "1", "--task", "imagenet"], "invalid choice"),
    (["--target-loss", "1", "--speed-change", "1=2"], "--speed-change applies to --strategy abs only"),
    (["--target-loss", "1", "--task", "digits", "--model", "mlp"], "trains the built-in digits model"),
])
def test_bench_target_bad_input_gives_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                               message: str) -> None:
    dense = tmp_path / "dense.json"
    synthetic_plan("digits").save(dense)
    with pytest.raises(SystemExit) if message in ("invalid choice", "expected START,STEPS",
                                                  "`0 < START <= 1`") else _no_raise():
        code = main(["bench", "--plan", str(dense), *argv])
        assert code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and message in err[0], err


class _no_raise:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def test_density_warmup_must_start_above_the_top_k_plans_density(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from planner.types import Strategy

    path = tmp_path / "topk.json"
    synthetic_plan("digits", strategy=Strategy.TOPK, density=0.3).save(path)
    assert main(["bench", "--plan", str(path), "--target-loss", "1", "--density-warmup", "0.25,500"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "must start above the plan's density" in err[0], err


def test_snapshots_stay_within_their_cap_and_evenly_spaced() -> None:
    """A run far longer than the cap allows keeps at most `cap` snapshots, the first one and evenly spaced ones
    (the time-to-target bench once held every copy of an LSTM and the kernel killed it at 23 GB)."""
    from planner.sessions.bench_target import _Snapshots, snapshot_cap

    snaps = _Snapshots(cap=8, min_interval_s=1.0)
    state = {"w": torch.zeros(3)}
    for now in range(1000):
        if snaps.due(float(now)):
            snaps.add(float(now), now, state)
        assert len(snaps.items) < 8
    times = [t for t, _, _ in snaps.items]
    assert times[0] == 0.0 and times[-1] >= 1000 - 2 * (times[1] - times[0])
    assert len({b - a for a, b in itertools.pairwise(times)}) == 1  # one spacing
    assert 8 <= snapshot_cap(1 << 40, 0.25) <= snapshot_cap(1 << 20, 0.25)
    with pytest.raises(ValueError, match="cap >= 2"):
        _Snapshots(cap=1, min_interval_s=1.0)
