"""Tests of the autotuner: the search space, parameters to plans, the study (warm start, resume, recovery),
and short real tuning jobs on two gloo processes (tiny model, few steps; nothing is timed)."""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from optuna.trial import TrialState
from torch import nn

from planner.contracts.kfac_section import kfac_layers
from planner.contracts.layers import gradient_layers
from planner.contracts.plan import Plan
from planner.contracts.profile import Profile
from planner.costmodel.curves import corrected
from planner.models import Workload, build_workload
from planner.runtime import GradientExchange
from planner.sessions.tune import (
    MB,
    TuneConfig,
    TuneSpace,
    describe_params,
    open_study,
    params_to_plan,
    run_tune,
    suggest_params,
    untuned_params,
)
from planner.solvers import DenseDP
from planner.strategies.gradients import make_plan
from planner.strategies.kfac_plan import make_kfac_plan
from planner.types import Collective, InverseMethod, PlanMismatchError, SchemaError, SolverError, Strategy
from tests.factories import synthetic_profile

MODEL = "tests.test_tune:tiny_workload"


def tiny_workload() -> Workload:
    """Three Linear layers (576, 1088 and 272 gradient bytes): `--model tests.test_tune:tiny_workload`."""
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def make_batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 8, generator=gen), torch.randint(0, 4, (n,), generator=gen)

    return Workload(name="tiny-tune", module=module, batch_size=8, make_batch=make_batch,
                    loss_fn=nn.functional.cross_entropy)


@functools.cache
def profile() -> Profile:
    return synthetic_profile(MODEL, world_size=2)


#: Group bounds around the tiny model's sizes (bytes 576, 1088, 272).
SMALL_GROUPS = (600 / MB, 2000 / MB)


def config(tmp_path: Path, strategy: str = "dense", **kwargs: Any) -> TuneConfig:
    space = kwargs.pop("space", None) or (TuneSpace(max_group_mb=None) if strategy == "kfac"
                                          else TuneSpace(max_group_mb=SMALL_GROUPS))
    base: dict[str, Any] = dict(
        profile=profile(), profile_path="synthetic.json", strategy=strategy, storage=tmp_path / "study.db",
        trials=2, steps=2, rungs=2, warmup=1, compare_steps=2, space=space, show_progress=False, timeout_s=300,
        output=tmp_path / "tuned.json",
    )
    return TuneConfig(**{**base, **kwargs})


def same_plan(a: Plan, b: Plan) -> None:
    """Equal but for the creation date and the solver's running time."""

    def strip(plan: Plan) -> dict[str, Any]:
        d = plan.to_dict()
        d.pop("created")
        d["solver"].pop("seconds")
        if d["kfac"] is not None:
            d["kfac"]["solvers"].pop("seconds")
        return d

    assert strip(a) == strip(b)


# ----------------------------------------------------------------------------------------------------
# The search space and the configuration


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha_scale": (3, 1)}, r"TuneSpace.alpha_scale: `low <= high` must hold, but got \(low=3, high=1\)"),
        ({"beta_scale": (0.0, 2.0)}, r"TuneSpace.beta_scale: `low > 0` must hold, but got \(low=0.0, high=2.0\)"),
        ({"max_group_mb": (1.0,)}, r"TuneSpace.max_group_mb must be a \(low, high\) pair"),
        ({"min_group_mb": (1.0, math.inf)}, r"low and high must be finite numbers"),
        ({"density": (0.1, 2.0)}, r"TuneSpace.density: `high <= 1` must hold"),
        ({"factor_update_steps": (1.5, 2)}, r"TuneSpace.factor_update_steps: low and high must be integers"),
        ({"inv_update_steps": (8, 4)}, r"`low <= high` must hold, but got \(low=8, high=4\)"),
        ({"alpha_scale": (True, 2)}, r"finite numbers"),
    ],
)
def test_space_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        TuneSpace(**kwargs)


def test_space_defaults_and_lists() -> None:
    space = TuneSpace(alpha_scale=[1, 2])  # type: ignore[arg-type]
    assert space.alpha_scale == (1.0, 2.0) and space.max_group_mb == (0.25, 64.0) and space.min_group_mb is None
    assert TuneSpace.default_for("kfac").max_group_mb is None
    assert TuneSpace.default_for("topk") == TuneSpace()
    with pytest.raises(SchemaError, match="strategy must be one of"):
        TuneSpace.default_for("adam")


@pytest.mark.parametrize(
    ("strategy", "kwargs", "message"),
    [
        ("dense", {"space": TuneSpace(density=(0.01, 0.1))}, "TuneSpace.density applies to strategy 'topk' only"),
        ("topk", {"space": TuneSpace(inv_update_steps=(1, 4))}, "TuneSpace.inv_update_steps applies to .*'kfac'"),
        ("kfac", {"space": TuneSpace()}, "TuneSpace.max_group_mb is not tuned for strategy 'kfac'"),
        ("kfac", {"space": TuneSpace(max_group_mb=None, min_group_mb=(1, 2))}, "min_group_mb is not tuned"),
        ("kfac", {"inv_update_steps": 3, "factor_update_steps": 2}, "must be a multiple of factor_update_steps"),
        ("kfac", {"space": TuneSpace(max_group_mb=None, factor_update_steps=(1, 4), inv_update_steps=(5, 7))},
         r"every factor interval in \(1, 4\) needs a multiple in the inverse interval range \(5, 7\), but 4 has"),
        ("kfac", {"space": TuneSpace(max_group_mb=None, factor_update_steps=(1, 3))}, "but 3 has none"),
        ("dense", {"density": 0.1}, "density applies to strategy 'topk' only"),
        ("topk", {"density": 1.5}, r"`0 < density <= 1` must hold"),
        ("dense", {"steps": 2, "rungs": 3}, r"`steps >= rungs` must hold, but got \(steps=2, rungs=3\)"),
        ("dense", {"trials": 0}, r"`trials >= 1` must hold"),
        ("adam", {}, "strategy must be one of"),
    ],
)
def test_config_validation(tmp_path: Path, strategy: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        config(tmp_path, strategy, **kwargs)


# ----------------------------------------------------------------------------------------------------
# Parameters to plans (no processes)


def test_untuned_plans_are_what_solve_makes(tmp_path: Path) -> None:
    prof = profile()
    dense = config(tmp_path)
    assert untuned_params(dense) == {"alpha_scale": 1.0, "beta_scale": 1.0, "max_group_bounded": False}
    expected = make_plan(prof, Strategy.DENSE, source="synthetic.json")
    same_plan(params_to_plan(prof, dense, untuned_params(dense)), expected)
    same_plan(params_to_plan(prof, dense, {}), expected)
    assert expected.solver == "dense-exact"

    topk = config(tmp_path, "topk", space=TuneSpace(density=(0.01, 0.5)))
    assert topk.density == 0.01 and untuned_params(topk)["density"] == 0.01
    same_plan(params_to_plan(prof, topk, untuned_params(topk)), make_plan(prof, Strategy.TOPK, 0.01,
                                                                         source="synthetic.json"))

    kfac = config(tmp_path, "kfac", factor_update_steps=1, inv_update_steps=4,
                  space=TuneSpace(max_group_mb=None, factor_update_steps=(1, 2), inv_update_steps=(2, 8)))
    assert untuned_params(kfac) == {"alpha_scale": 1.0, "beta_scale": 1.0, "factor_update_steps": 1,
                                    "inv_update_steps": 4}
    same_plan(params_to_plan(prof, kfac, untuned_params(kfac)),
              make_kfac_plan(prof, method=InverseMethod.EIGEN, factor_update_steps=1, inv_update_steps=4,
                             source="synthetic.json"))
    assert describe_params(kfac, untuned_params(kfac)) == "untuned"


def test_params_to_plan_corrects_the_model_and_bounds_groups(tmp_path: Path) -> None:
    prof = profile()
    cfg = config(tmp_path)
    plan = params_to_plan(prof, cfg, {"alpha_scale": 2.0, "beta_scale": 0.5, "max_group_bounded": True,
                                      "max_group_mb": 1100 / MB})
    assert plan.solver == "dense-exact tuned: alpha x2, beta x0.5, max 0.00105 MB"
    # Its predictions are those of the corrected model.
    curves = {c: corrected(curve, 2.0, 0.5) for c, curve in prof.collectives.items()}
    fixed = dataclasses.replace(prof, collectives=curves)
    reference = make_plan(fixed, Strategy.DENSE, solver=DenseDP(max_group_bytes=1100))
    assert plan.predicted == reference.predicted and plan.groups == reference.groups
    assert plan.baselines == reference.baselines and plan.lower_bound_s == reference.lower_bound_s
    assert fixed.curve(Collective.ALLREDUCE).alpha_s == pytest.approx(2 * prof.curve(Collective.ALLREDUCE).alpha_s)
    # Every group of more than one layer holds at most 1100 bytes.
    for g in plan.groups:
        assert len(g.layers) == 1 or g.numel * 4 <= 1100
    # The 272 B layer, ready first, is below a 1000 B minimum alone and above a 1050 B maximum with the next one.
    with pytest.raises(SolverError, match="no grouping of the 3 layers"):
        params_to_plan(prof, cfg, {"min_group_bounded": True, "min_group_mb": 1000 / MB,
                                   "max_group_bounded": True, "max_group_mb": 1050 / MB})
    with pytest.raises(SolverError, match="min_group_bytes <= max_group_bytes"):
        params_to_plan(prof, cfg, {"min_group_mb": 2 / MB, "max_group_mb": 1 / MB})
    with pytest.raises(SchemaError, match=r"unknown tuning parameter\(s\) \['bucket_mb'\]"):
        params_to_plan(prof, cfg, {"bucket_mb": 25})
    with pytest.raises(SchemaError, match="'density' does not apply to strategy 'dense'"):
        params_to_plan(prof, cfg, {"density": 0.1})
    with pytest.raises(SchemaError, match="tuning parameters must be numbers"):
        params_to_plan(prof, cfg, {"alpha_scale": "fast"})
    with pytest.raises(SchemaError, match="`alpha_scale > 0 and beta_scale > 0`"):
        params_to_plan(prof, cfg, {"alpha_scale": 0.0})


def test_params_to_plan_topk_and_kfac(tmp_path: Path) -> None:
    prof = profile()
    topk = config(tmp_path, "topk", density=0.1, space=TuneSpace(density=(0.05, 0.5)))
    plan = params_to_plan(prof, topk, {"density": 0.2})
    assert plan.density == 0.2 and "density 0.2" in plan.solver
    kfac = config(tmp_path, "kfac", space=TuneSpace(max_group_mb=None, inv_update_steps=(2, 20)))
    plan = params_to_plan(prof, kfac, {"inv_update_steps": 6, "beta_scale": 3.0})
    assert plan.kfac is not None and plan.kfac.inv_update_steps == 6 and plan.kfac.factor_update_steps == 1
    assert plan.solver == "dense-exact tuned: alpha x1, beta x3, factors every 1, inverses every 6"
    with pytest.raises(SchemaError, match="'max_group_mb' does not apply to strategy 'kfac'"):
        params_to_plan(prof, kfac, {"max_group_mb": 1.0})


def test_suggested_params_stay_in_the_ranges(tmp_path: Path) -> None:
    space = TuneSpace(alpha_scale=(0.5, 2.0), max_group_mb=None, factor_update_steps=(1, 3), inv_update_steps=(6, 13))
    cfg = config(tmp_path, "kfac", factor_update_steps=2, inv_update_steps=6, space=space)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=3, n_startup_trials=5))
    for _ in range(30):
        trial = study.ask()
        params = suggest_params(trial, cfg)
        assert params == trial.params
        assert 0.5 <= params["alpha_scale"] <= 2.0 and 0.25 <= params["beta_scale"] <= 4.0
        assert 1 <= params["factor_update_steps"] <= 3 and 6 <= params["inv_update_steps"] <= 13
        assert params["inv_update_steps"] % params["factor_update_steps"] == 0
        study.tell(trial, params["alpha_scale"])
    cfg = config(tmp_path, space=TuneSpace(max_group_mb=(1.0, 8.0), min_group_mb=(0.1, 0.5)))
    seen = set()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(30):
        trial = study.ask()
        params = suggest_params(trial, cfg)
        seen.add((params["max_group_bounded"], params["min_group_bounded"]))
        assert params["max_group_bounded"] == ("max_group_mb" in params)
        assert not params["max_group_bounded"] or 1.0 <= params["max_group_mb"] <= 8.0
        assert not params["min_group_bounded"] or 0.1 <= params["min_group_mb"] <= 0.5
    assert len(seen) > 1


# ----------------------------------------------------------------------------------------------------
# The study: warm start, interruption, identity (no processes)


def test_new_study_starts_with_the_untuned_params_and_recovers_running_trials(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    study, finished = open_study(cfg)
    assert finished == 0
    (waiting,) = study.get_trials(states=(TrialState.WAITING,))
    assert waiting.user_attrs == {"warm_start": True}
    # An interrupted run: the trial is asked, its params suggested, and it is never told.
    trial = study.ask()
    assert suggest_params(trial, cfg) == untuned_params(cfg)

    study, finished = open_study(cfg)
    assert finished == 0
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.WAITING]
    assert trials[1].params == {} and trials[1].user_attrs == {"retry_of": 0}
    assert trials[1].system_attrs["fixed_params"] == untuned_params(cfg)
    assert study.user_attrs["planner.strategy"] == "dense"

    with pytest.raises(PlanMismatchError, match=r"was made for .*'planner.strategy': 'dense'"):
        open_study(config(tmp_path, "topk"))


# ----------------------------------------------------------------------------------------------------
# Real tuning jobs on two processes


def check_plan_for_model(plan: Plan) -> None:
    """The plan survives its JSON round trip, covers every parameter once, and the runtime accepts it (the job
    itself ran it on two processes; here its groups and K-FAC layers are checked against a fresh model)."""
    assert Plan.from_dict(plan.to_dict()) == plan
    module = build_workload(MODEL).module
    names = [p for spec in gradient_layers(module) for p in spec.params]
    assert sorted(plan.param_order) == sorted(names) and len(set(plan.param_order)) == len(names)
    if plan.kfac is not None:
        plan.kfac.check_layers(kfac_layers(module))
    single = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, world_size=1), kfac=None)
    GradientExchange(module, single).close()  # its groups match the model's parameters


def test_dense_tuning_runs_writes_a_plan_and_resumes(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    result = run_tune(cfg)
    assert result.resumed_from == 0
    assert [t["state"] for t in result.trials] == ["COMPLETE", "COMPLETE"]
    assert result.trials[0]["params"] == untuned_params(cfg)  # warm start
    assert all(t["value"] > 0 and t["predicted"] > 0 for t in result.trials)
    assert result.best_value_s == min(t["value"] for t in result.trials)
    written = Plan.load(tmp_path / "tuned.json")
    assert written == result.tuned_plan
    check_plan_for_model(written)
    same_plan(result.untuned_plan, make_plan(profile(), Strategy.DENSE, source="synthetic.json"))
    assert [r.name for r in result.comparison] == ["untuned", "tuned"]
    for r in result.comparison:
        assert r.reference == "untuned" and r.steps == 2 and r.median_s > 0 and r.predicted_s is not None
    assert result.comparison[0].speedup == 1.0

    # Interrupt a run: a trial asked for, its parameters suggested, never told. Then resume to 3 trials.
    study = optuna.load_study(study_name=cfg.study_name, storage=f"sqlite:///{cfg.storage}")
    interrupted = study.ask()
    params = suggest_params(interrupted, cfg)
    again = run_tune(dataclasses.replace(cfg, trials=3))
    assert again.resumed_from == 2
    assert again.trials[:2] == result.trials
    assert [t["state"] for t in again.trials[2:]] in (["FAIL", "COMPLETE"], ["FAIL", "PRUNED"])  # may be pruned
    assert again.trials[2]["note"] == "interrupted; retried as trial 3"
    assert again.trials[3]["params"] == params and again.trials[3]["note"] == "retry of trial 2"
    study = optuna.load_study(study_name=cfg.study_name, storage=f"sqlite:///{cfg.storage}")
    assert len(study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))) == 3


def test_kfac_tuning_keeps_intervals_in_range(tmp_path: Path) -> None:
    space = TuneSpace(max_group_mb=None, factor_update_steps=(1, 2), inv_update_steps=(2, 4))
    cfg = config(tmp_path, "kfac", factor_update_steps=1, inv_update_steps=2, space=space, rungs=1)
    result = run_tune(cfg)
    assert sum(t["state"] == "COMPLETE" for t in result.trials) == 2
    kf = result.tuned_plan.kfac
    assert kf is not None and 1 <= kf.factor_update_steps <= 2 and 2 <= kf.inv_update_steps <= 4
    assert kf.inv_update_steps % kf.factor_update_steps == 0
    for t in result.trials:
        assert 1 <= t["params"]["factor_update_steps"] <= 2 and 2 <= t["params"]["inv_update_steps"] <= 4
    check_plan_for_model(result.tuned_plan)
    assert [r.strategy for r in result.comparison] == ["kfac", "kfac"]


def test_topk_tuning_keeps_density_in_range_and_skips_impossible_plans(tmp_path: Path) -> None:
    space = TuneSpace(max_group_mb=SMALL_GROUPS, min_group_mb=(200 / MB, 1000 / MB), density=(0.05, 0.5))
    cfg = config(tmp_path, "topk", density=0.1, space=space, steps=1, rungs=1)
    # After the warm start, a trial whose bounds no grouping satisfies (the 272 B layer ready first must
    # reach 1000 B without passing 1000 B): it fails without running and does not count.
    study, _ = open_study(cfg)
    study.enqueue_trial({"alpha_scale": 1.0, "beta_scale": 1.0, "max_group_bounded": True, "max_group_mb": 1000 / MB,
                         "min_group_bounded": True, "min_group_mb": 1000 / MB, "density": 0.1})
    result = run_tune(cfg)
    assert [t["state"] for t in result.trials] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert result.trials[1]["note"].startswith("no plan: no grouping of the 3 layers")
    assert result.trials[0]["params"]["density"] == 0.1
    assert all(0.05 <= t["params"]["density"] <= 0.5 for t in result.trials)
    assert 0.05 <= result.tuned_plan.density <= 0.5  # type: ignore[operator]
    assert result.tuned_plan.strategy is Strategy.TOPK
    check_plan_for_model(result.tuned_plan)


def test_cli_tune_runs_resumes_and_writes_a_plan(tmp_path: Path) -> None:
    from tests.test_contracts import _main as _cli  # in this process: its workers are the warm ones

    prof = tmp_path / "prof.json"
    profile().save(prof)
    out = tmp_path / "tuned.json"
    args = ["tune", str(prof), "--model", MODEL, "--steps", "3", "--rungs", "1", "--warmup", "1",
            "--compare-steps", "3", "-o", str(out)]
    first = _cli(*args, "--trials", "1")
    assert first.returncode == 0, first.stderr
    assert "untuned (warm start)" in first.stdout and "speedup vs untuned" in first.stdout
    check_plan_for_model(Plan.load(out))
    again = _cli(*args, "--trials", "2")
    assert again.returncode == 0, again.stderr
    assert "resumed a study that held 1 finished trial(s)" in again.stdout
    assert (tmp_path / "tuned.db").exists()
    check_plan_for_model(Plan.load(out))
    bad = _cli("tune", str(prof), "--alpha-scale", "4,1", "-o", str(out))
    assert bad.returncode == 2 and "low <= high" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
