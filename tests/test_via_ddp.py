"""A gradient plan run both ways: predicted inside DDP (`planner.strategies.via_ddp`, the row "plan via ddp" at DDP's
costs), benched both ways (`planner bench`: "plan X" in GradientExchange, "plan X via DDP" with PlanHook), and
`--strategy auto` saying which way to run the plan it keeps."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from planner.commands.cli import main
from planner.contracts.plan import VIA_DDP_ROW, Plan
from planner.contracts.profile import Calibration, InSitu, Profile
from planner.models import build_workload
from planner.sessions.bench import bench_variants, via_ddp_notes
from planner.strategies.abs_plan import make_abs_plan
from planner.strategies.gradients import make_plan
from planner.strategies.intervals import with_intervals
from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors
from planner.strategies.via_ddp import DDP_WAY, EXCHANGE_WAY, choose_way, with_via_ddp
from planner.types import Strategy
from tests.factories import synthetic_kfac_plan, synthetic_profile, with_samples
from tests.test_abs_plan import slowed_profile
from tests.test_interference import measured_profile


def _packing(ddp_factor: float, *, spread: float = 0.02, model: str = "mlp") -> Profile:
    """`measured_profile` (with samples) where this runtime packs at its micro-benchmark and DDP at `ddp_factor` times
    it, each measured within `spread`."""
    rng = np.random.default_rng(1)
    modelled = 0.01
    in_situ = InSitu(pack=Calibration.of_samples(modelled * (1 + 0.02 * rng.standard_normal(24)), modelled),
                     ddp_pack=Calibration.of_samples(modelled * ddp_factor * (1 + spread * rng.standard_normal(24)),
                                                     modelled))
    return with_samples(dataclasses.replace(measured_profile(model), in_situ=in_situ), spread=0.02)


# -- solve: the plan's row inside DDP -----------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda p: make_plan(p, Strategy.DENSE),
    lambda p: make_plan(p, Strategy.TOPK, 0.01),
    lambda p: make_mixed_plan(p, parse_compressors("dense,fp16,powersgd:1")),
], ids=["dense", "topk", "mixed"])
def test_the_row_inside_ddp_is_priced_at_ddps_packing(make: object) -> None:
    """The same plan's row inside DDP grows with DDP's measured packing (`InSitu.ddp_pack`); its own prediction (in
    GradientExchange) does not move, and the row gets its interval like the plan's other rows."""
    slow, fast = _packing(3.0), _packing(1.0)
    plans = {name: make(p) for name, p in (("slow", slow), ("fast", fast))}  # type: ignore[operator]
    assert plans["slow"].groups == plans["fast"].groups  # the plan itself is priced at this runtime's packing
    assert plans["slow"].predicted.iteration_s == pytest.approx(plans["fast"].predicted.iteration_s, rel=1e-9)
    assert plans["slow"].baselines[VIA_DDP_ROW].iteration_s > plans["fast"].baselines[VIA_DDP_ROW].iteration_s
    weighed = with_intervals(plans["slow"], slow)
    assert weighed.intervals is not None
    low, high = weighed.intervals.rows[VIA_DDP_ROW]
    assert low <= plans["slow"].baselines[VIA_DDP_ROW].iteration_s <= high


def test_powersgd_inside_ddp_is_the_projects_kernels_not_pytorchs_hook() -> None:
    """PlanHook sends PowerSGD with the project's kernels: a slow calibration of PyTorch's own PowerSGD hook
    ("ddp+powersgd:1", which prices DDP's hook row) does not move the plan's row inside DDP."""
    base = _packing(1.0)
    rng = np.random.default_rng(2)
    assert base.in_situ is not None
    slow_hook = {"ddp+powersgd:1": {"prepare": Calibration.of_samples(0.05 * (1 + 0.02 * rng.standard_normal(24)),
                                                                      0.01)}}
    slowed = dataclasses.replace(base, in_situ=dataclasses.replace(base.in_situ, compress=slow_hook))
    compressors = parse_compressors("dense,powersgd:1")
    plain, with_slow_hook = make_mixed_plan(base, compressors), make_mixed_plan(slowed, compressors)
    assert any(plain.compressor_of(g).rank == 1 for g in plain.groups)  # the plan sends PowerSGD
    assert with_slow_hook.groups == plain.groups
    assert with_slow_hook.baselines[VIA_DDP_ROW].iteration_s == pytest.approx(
        plain.baselines[VIA_DDP_ROW].iteration_s, rel=1e-9)
    hook_rows = [name for name in plain.baselines if name.startswith("ddp+powersgd")]
    assert hook_rows, sorted(plain.baselines)  # and DDP's own hook row is priced at its calibration
    assert all(with_slow_hook.baselines[n].iteration_s > plain.baselines[n].iteration_s for n in hook_rows)


def test_plans_that_do_not_run_inside_ddp_have_no_row() -> None:
    """K-FAC and ABS-SGD plans (PlanHook refuses them) carry no row inside DDP, and are told to run elsewhere."""
    for plan in (synthetic_kfac_plan("mlp"), make_abs_plan(slowed_profile(), global_batch=64)):
        assert VIA_DDP_ROW not in plan.baselines
        way = choose_way(plan)
        assert way.way == EXCHANGE_WAY and "not inside DDP" in way.line and "\n" not in way.line


def test_solve_prints_both_predictions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    _packing(3.0).save(path)
    assert main(["solve", str(path), "-o", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    plan = Plan.load(tmp_path / "plan.json")
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 3}
    via = rows["plan via DDP (PlanHook)"]
    assert f"{plan.baselines[VIA_DDP_ROW].iteration_s * 1e3:,.2f}" in via
    assert f"{plan.predicted.iteration_s * 1e3:,.2f}" in rows[f"plan ({plan.solver})"]
    assert plan.intervals is not None and VIA_DDP_ROW in plan.intervals.rows


# -- auto: which way to run the plan it keeps ---------------------------------------------------------------------
@pytest.mark.parametrize(("ddp_factor", "way"), [(1.0, None), (8.0, "run it in GradientExchange")])
def test_auto_says_which_way_to_run_the_plan_it_keeps(ddp_factor: float, way: str | None, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Where DDP packs far slower (beyond the noise) the dense plan is kept, and run in GradientExchange: one line,
    with both predictions. With packing alike the dense plan is DDP's buckets at DDP's cost: DDP is kept, and nothing
    is said of running the plan (the way within the noise, inside DDP, is `choose_way`'s test below)."""
    path = tmp_path / "p.json"
    _packing(ddp_factor).save(path)
    assert main(["solve", str(path), "--strategy", "auto", "--compressors", "dense", "-o",
                 str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if line.startswith("run it ")]
    if way is None:
        assert lines == [] and [line for line in out if line.startswith("kept DDP: ")], out
        return
    assert len(lines) == 1 and lines[0].startswith(way), lines
    plan = Plan.load(tmp_path / "plan.json")
    assert f"{plan.baselines[VIA_DDP_ROW].iteration_s * 1e3:,.2f} ms" in lines[0]
    assert f"{plan.predicted.iteration_s * 1e3:,.2f} ms" in lines[0]


def test_choose_way_keeps_ddp_within_the_noise_and_exchange_beyond_it() -> None:
    plan = make_plan(_packing(1.0), Strategy.DENSE)
    rng = np.random.default_rng(0)
    base = 0.03 * (1 + 0.05 * rng.standard_normal(200))
    noisy = base * (1 + 0.05 * rng.standard_normal(200))
    assert choose_way(plan, {"plan": base * 0.99, VIA_DDP_ROW: noisy}).way == DDP_WAY  # 1% faster, in the noise
    assert choose_way(plan, {"plan": base * 0.8, VIA_DDP_ROW: base}).way == EXCHANGE_WAY
    assert choose_way(plan, {"plan": base, VIA_DDP_ROW: base * 0.8}).way == DDP_WAY


# -- bench: every plan both ways ----------------------------------------------------------------------------------
def test_bench_runs_each_plan_both_ways(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Dense, fp16, PowerSGD and top-k plans each get their row in GradientExchange and their row inside DDP, the
    latter predicted by the plan's row inside DDP and measured against DDP in the same run; a K-FAC plan gets no row
    inside DDP, and one line says why."""
    profile = synthetic_profile("mlp")
    plans = {"dense": make_plan(profile, Strategy.DENSE), "fp16": make_mixed_plan(profile, parse_compressors("fp16")),
             "powersgd": make_mixed_plan(profile, parse_compressors("powersgd:1")),
             "topk": make_plan(profile, Strategy.TOPK, 0.01), "kfac": synthetic_kfac_plan("mlp")}
    paths = []
    for name, plan in plans.items():
        paths += ["--plan", str(tmp_path / f"{name}.json")]
        plan.save(tmp_path / f"{name}.json")
    assert main(["bench", *paths, "--steps", "2", "--warmup", "1", "--peers", "none", "--json"]) == 0
    captured = capsys.readouterr()
    rows = {r["name"]: r for r in json.loads(captured.out)}
    labels = {"dense": "plan dense (dense)", "fp16": "plan mixed (fp16)", "powersgd": "plan mixed (powersgd:1)",
              "topk": "plan topk@0.01"}
    for name, label in labels.items():
        assert label in rows, sorted(rows)
        via = rows[f"{label} via DDP"]
        assert via["steps"] == 2 and via["median_s"] > 0
        assert via["predicted_s"] == pytest.approx(plans[name].baselines[VIA_DDP_ROW].iteration_s)
        assert via["speedup"] == pytest.approx(rows["ddp"]["median_s"] / via["median_s"])
    assert "plan dense (kfac)" in rows and "plan dense (kfac) via DDP" not in rows
    notes = [line for line in captured.err.splitlines() if "via DDP" in line]
    assert len(notes) == 1 and "plan dense (kfac) via DDP" in notes[0] and "K-FAC" in notes[0]


def test_bench_variants_run_inside_ddp_only_what_planhook_runs() -> None:
    kfac, dense = synthetic_kfac_plan("mlp"), make_plan(synthetic_profile("mlp"), Strategy.DENSE)
    module = build_workload("mlp").module
    names = [v.name for v in bench_variants((dense,), module, peers=())]
    assert names.index("plan dense via DDP") == names.index("plan dense") + 1
    assert not any(v.via_ddp for v in bench_variants((kfac,), module, peers=()))
    assert via_ddp_notes((dense,)) == []
    [note] = via_ddp_notes((kfac,))
    assert "K-FAC" in note and "\n" not in note


def test_demo_line_says_which_way_and_measures_the_plan_run_that_way() -> None:
    """The demo's last line: the plan kept, the way to run it, and the bench's row of the plan run that way."""
    from planner.commands.demo import verdict_against_bench
    from planner.sessions.bench import BenchResult

    profile = _packing(1.0)
    plan = with_intervals(make_plan(profile, Strategy.DENSE), profile)
    assert plan.verdict is not None
    plan = dataclasses.replace(plan, verdict=dataclasses.replace(plan.verdict, keep="plan"))

    def row(name: str, median_s: float) -> BenchResult:
        return BenchResult(name=name, strategy="dense", median_s=median_s, p25_s=median_s, p75_s=median_s, steps=3,
                           predicted_s=None)

    results = [row("ddp", 0.050), row("plan dense", 0.040), row("plan dense via DDP", 0.030)]
    inside = verdict_against_bench(plan, results, "plan dense", way=DDP_WAY)
    assert inside.startswith("kept the plan, run via DDP (PlanHook). Measured: the plan via DDP 30.00 ms")
    assert f"(predicted {plan.baselines[VIA_DDP_ROW].iteration_s * 1e3:,.2f})" in inside
    exchange = verdict_against_bench(plan, results, "plan dense", way=EXCHANGE_WAY)
    assert exchange.startswith("kept the plan, run in GradientExchange. Measured: the plan 40.00 ms")
    assert "\n" not in inside + exchange


def test_a_plan_with_hierarchical_groups_runs_inside_ddp_unpredicted() -> None:
    """PlanHook runs groups sent hierarchically, so the bench runs such a plan inside DDP too; the cost model of DDP
    is flat, so that row has no prediction, and the plan is told to run in GradientExchange, which it was
    predicted for."""
    flat = make_plan(synthetic_profile("mlp", world_size=4), Strategy.DENSE)
    cluster = dataclasses.replace(flat.cluster, host_count=2)
    routed = dataclasses.replace(flat, cluster=cluster, baselines={k: v for k, v in flat.baselines.items()
                                                                   if k != VIA_DDP_ROW},
                                 groups=tuple(dataclasses.replace(g, hierarchical=True) for g in flat.groups))
    assert with_via_ddp(routed, synthetic_profile("mlp", world_size=4)) == routed  # not predicted inside DDP
    via = [v for v in bench_variants((routed,), build_workload("mlp").module, peers=()) if v.via_ddp]
    assert len(via) == 1 and via[0].predicted_s is None
    assert via_ddp_notes((routed,)) == []
    way = choose_way(routed)
    assert way.way == EXCHANGE_WAY and "hierarchically" in way.line
