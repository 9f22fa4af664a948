"""Packing and interference: what communication costs the compute stream, from measurement to plan."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from planner.contracts.plan import Plan
from planner.contracts.profile import Calibration, InSitu, Profile
from planner.costmodel.costs import AffineCost, ScaledCost
from planner.costmodel.curves import curve_model, fit_curve
from planner.costmodel.from_profile import gradient_problem
from planner.costmodel.simulator import simulate
from planner.models import build_workload
from planner.runtime.codecs import write_scaled
from planner.solvers import BASELINES, DDP_BASELINE
from planner.strategies.cluster import parse_cluster, profile_for_cluster
from planner.strategies.gradients import make_plan
from planner.types import Collective, DistributedError, InvalidProfileError, SchemaError, Strategy
from tests.factories import synthetic_profile
from tests.pool import run_warm

SIGMAS = {Collective.ALLREDUCE: 0.8, Collective.ALLGATHER: 1.3}
KAPPAS = {Collective.ALLREDUCE: 0.7, Collective.ALLGATHER: 0.4}


def measured_profile(model: str = "mlp") -> Profile:
    """A synthetic profile with a packing curve and interference, as `planner profile` now writes them."""
    pack = fit_curve([(n, 3e-6 + 2e-10 * n) for n in (1 << 10, 1 << 14, 1 << 18, 1 << 22)])
    prof = synthetic_profile(model)
    assert prof.topk is not None
    topk = dataclasses.replace(prof.topk, select_sampled=tuple((n, d, 0.3 * t) for n, d, t in prof.topk.select))
    return dataclasses.replace(prof, pack=pack, interference=dict(SIGMAS), comm_stretch=dict(KAPPAS), topk=topk)


def test_profile_round_trip_with_packing_and_interference(tmp_path: Path) -> None:
    prof = measured_profile()
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof


def test_each_strategy_gets_the_interference_of_its_collective() -> None:
    prof = measured_profile()
    dense = gradient_problem(prof, Strategy.DENSE)
    topk = gradient_problem(prof, Strategy.TOPK, 0.01)
    assert dense.interference == 0.8 and topk.interference == 1.3
    assert dense.pack is not None and topk.pack is None  # top-k's selection already adds into its residual
    assert dense.prepare_s(1 << 14) == pytest.approx(3e-6 + 2e-10 * (1 << 14))


def test_a_profile_without_them_models_neither(tmp_path: Path) -> None:
    doc = measured_profile().to_dict()
    del doc["pack"], doc["interference"], doc["comm_stretch"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    prof = Profile.load(path)
    assert prof.pack is None and prof.interference is None and prof.comm_stretch is None
    assert prof.comm_stretch_for(Collective.ALLREDUCE) == 0.0
    problem = gradient_problem(prof, Strategy.DENSE)
    assert problem.pack is None and problem.interference == 0.0


@pytest.mark.parametrize("field", ["interference", "comm_stretch"])
@pytest.mark.parametrize(
    ("interference", "error", "match"),
    [
        ({"allreduce": -0.5}, InvalidProfileError, r"`0 <= profile\.{field}\.allreduce <= 100` must hold"),
        ({"allreduce": 1e308}, InvalidProfileError, r"`0 <= profile\.{field}\.allreduce <= 100` must hold"),
        ({"allreduce": 101}, InvalidProfileError, r"`0 <= profile\.{field}\.allreduce <= 100` must hold"),
        ({"allreduce": "fast"}, SchemaError, r"profile\.{field}\.allreduce must be int/float"),
        ({"telepathy": 0.5}, SchemaError, r"unknown collective 'telepathy' in profile\.{field}"),
        ([0.5], SchemaError, r"profile\.{field} must be dict"),
    ],
)
def test_bad_interference_is_refused_naming_the_field(tmp_path: Path, field: str, interference: Any,
                                                      error: type[Exception], match: str) -> None:
    """Either direction (sigma: compute slowed; kappa: collectives slowed)."""
    match = match.replace("{field}", field)
    doc = {**measured_profile().to_dict(), field: interference}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(error, match=match):
        Profile.load(path)


def test_plans_predict_packing_and_interference_and_round_trip(tmp_path: Path) -> None:
    prof = measured_profile("resnet18")
    plan = make_plan(prof, Strategy.DENSE, source="test")
    plain = make_plan(dataclasses.replace(prof, pack=None, interference=None), Strategy.DENSE, source="test")
    assert plan.predicted.pack_s > 0 and plan.predicted.interference_s > 0
    assert plan.predicted.iteration_s > plain.predicted.iteration_s
    assert plan.lower_bound_s <= plan.predicted.iteration_s * (1 + 1e-9)
    for pred in plan.baselines.values():
        assert plan.predicted.iteration_s <= pred.iteration_s * (1 + 1e-9)
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


def test_a_plan_without_the_new_predictions_loads_with_zeros(tmp_path: Path) -> None:
    doc = make_plan(measured_profile(), Strategy.DENSE, source="test").to_dict()
    for pred in (doc["predicted"]["plan"], *doc["predicted"]["baselines"].values()):
        del pred["pack_s"], pred["interference_s"]
    path = tmp_path / "old-plan.json"
    path.write_text(json.dumps(doc))
    plan = Plan.load(path)
    assert plan.predicted.pack_s == 0.0 and plan.predicted.interference_s == 0.0


def test_a_what_if_cluster_scales_packing_and_drops_interference() -> None:
    prof = measured_profile()
    what_if = profile_for_cluster(prof, parse_cluster("eth10-8,compute_factor=0.5"))
    assert what_if.interference is None
    assert prof.pack is not None and what_if.pack is not None
    assert curve_model(what_if.pack).cost(1 << 20) == pytest.approx(0.5 * curve_model(prof.pack).cost(1 << 20))


def test_write_scaled_writes_a_gradient_once_scaled() -> None:
    flat = torch.full((10,), 7.0)
    views = [flat[:4].view(2, 2), flat[4:7], flat[7:]]
    same = views[1]
    same.copy_(torch.tensor([2.0, 4.0, 6.0]))  # a gradient that already is its view: scaled in place
    for grad, view in zip([torch.arange(4.0).view(2, 2), same, None], views, strict=True):
        write_scaled(grad, view, 0.5)
    assert flat.tolist() == [0.0, 0.5, 1.0, 1.5, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0]
    half = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)  # another dtype: converted, then scaled in fp32
    out = torch.empty(2)
    write_scaled(half, out, 0.25)
    assert out.tolist() == [0.25, 0.75]


def test_measure_packing_times_every_size() -> None:
    from planner.runtime.calibrate import measure_packing

    curve = measure_packing([1 << 10, 1 << 14, 1 << 16], 2, torch.device("cpu"), repeats=2, warmup=1)
    assert [n for n, _ in curve.points] == [1 << 10, 1 << 14, 1 << 16]
    assert all(t > 0 for _, t in curve.points)


def _interference_worker(rank: int, world_size: int, chain_cap: int | None) -> Any:
    from planner.profilers import interference

    torch.manual_seed(0)
    workload = build_workload("mlp")
    if chain_cap is not None:  # a chain of one tiny collective ends long before the backward pass does
        # The worker is a warm one that runs later cases too: the cap is put back however this one ends.
        default_cap, interference._MAX_CHAIN = interference._MAX_CHAIN, chain_cap
        try:
            interference.measure_interference(workload, torch.device("cpu"), [Collective.ALLREDUCE], repeats=2,
                                              message_bytes=4)
        except DistributedError as exc:
            return str(exc)
        finally:
            interference._MAX_CHAIN = default_cap
        return "no error"
    return interference.measure_interference(workload, torch.device("cpu"),
                                             [Collective.ALLREDUCE, Collective.ALLGATHER], repeats=3)


def test_interference_is_measured_on_two_processes_and_refuses_a_chain_too_short() -> None:
    """sigma and kappa for both collectives, the same on every rank; and neither when the collectives could
    not be kept in flight for a whole backward pass."""
    measured = run_warm(_interference_worker, 2, None)
    assert measured[0] == measured[1]
    for slowdown in (measured[0].sigma, measured[0].comm_stretch):
        assert set(slowdown) == {Collective.ALLREDUCE, Collective.ALLGATHER}
        assert all(math.isfinite(s) and s >= 0 for s in slowdown.values())
    refused = run_warm(_interference_worker, 2, 1)
    assert all("could not keep allreduces in flight for a whole backward pass" in r for r in refused), refused


def _layer_run(order: tuple[str, ...], scale: float, whole: list[float] | None = None) -> object:
    from planner.profilers.layers import LayerRun

    return LayerRun(
        order=order, params={"a": ("a.w",), "b": ("b.w",)}, numel={"a": 10, "b": 20},
        forward={"a": [1.0 * scale, 3.0 * scale], "b": [2.0 * scale]},
        backward={"a": [4.0 * scale], "b": [5.0 * scale, 7.0 * scale]},
        forward_total=[3.0 * scale], backward_total=[10.0 * scale], update=[1.0 * scale],
        whole=whole or [],
    )


def test_the_profile_plans_with_the_slowest_worker() -> None:
    """combine_ranks takes every per-layer and phase time from the worker with the largest median step,
    in rank 0's ready order; without whole steps nothing is scaled."""
    from planner.profilers.layers import combine_ranks

    summary = combine_ranks([_layer_run(("b", "a"), 1.0), _layer_run(("a", "b"), 2.0)])  # type: ignore[list-item]
    assert [lt.name for lt in summary.layers] == ["b", "a"]  # rank 0's ready order
    assert [(lt.forward_s, lt.backward_s) for lt in summary.layers] == [(4.0, 12.0), (4.0, 8.0)]  # rank 1's medians
    assert (summary.forward_s, summary.backward_s, summary.update_s) == (6.0, 20.0, 2.0)
    assert summary.step_s is None and summary.scale is None


def test_the_parts_are_scaled_to_the_whole_steps_of_the_slowest_worker() -> None:
    """With whole steps timed between the hooked ones, the slowest worker is the one with the slowest whole
    steps, and its F, every b_i and U are scaled by one factor so that they sum to the median over the whole
    steps of each step's slowest rank (as the bench times a step)."""
    from planner.profilers.layers import combine_ranks

    # Rank 0's hooked parts are slower (sum 14 x 2 = 28) but rank 1's whole steps are (median 21 > 20).
    fast_parts = _layer_run(("b", "a"), 2.0, whole=[20.0, 19.0, 22.0])
    slow_whole = _layer_run(("a", "b"), 1.0, whole=[21.0, 30.0, 12.0])
    summary = combine_ranks([fast_parts, slow_whole])  # type: ignore[list-item]
    parts = 3.0 + (4.0 + 6.0) + 1.0  # rank 1: F + sum of the median b_i + U
    # Each step's slowest rank: 21, 30, 22; their median 22 (the slowest rank's own median is 21).
    assert summary.step_s == 22.0 and summary.scale == pytest.approx(22.0 / parts)
    k = 22.0 / parts
    assert [(lt.name, lt.forward_s, lt.backward_s) for lt in summary.layers] == [
        ("b", pytest.approx(2.0 * k), pytest.approx(6.0 * k)), ("a", pytest.approx(2.0 * k), pytest.approx(4.0 * k))]
    total = summary.forward_s + sum(lt.backward_s for lt in summary.layers) + summary.update_s
    assert total == pytest.approx(22.0)


def test_whole_steps_are_timed_between_the_hooked_ones_and_leave_no_hooks_behind() -> None:
    from planner.profilers.layers import measure_layers

    workload = build_workload("mlp")
    model = workload.module
    run = measure_layers(workload, torch.device("cpu"), repeats=3, warmup=1)
    assert len(run.whole) == 3 and all(t > 0 for t in run.whole)
    assert len(run.forward_total) == 3 and len(run.update) == 3
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


def calibrated_profile(model: str = "mlp") -> Profile:
    """`measured_profile` with in-situ calibrations: this runtime packs at 4x, DDP at 2x, the sampled selector
    runs at 1.5x and decoding at 3x the micro-benchmarks."""
    in_situ = InSitu(
        pack=Calibration(measured_s=0.04, modelled_s=0.01),
        select={"sampled": Calibration(measured_s=0.03, modelled_s=0.02)},
        decode=Calibration(measured_s=0.003, modelled_s=0.001),
        ddp_pack=Calibration(measured_s=0.02, modelled_s=0.01),
    )
    return dataclasses.replace(measured_profile(model), in_situ=in_situ)


def test_in_situ_calibrations_round_trip_and_scale_the_curves(tmp_path: Path) -> None:
    prof = calibrated_profile()
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof
    base = measured_profile()
    n = 1 << 16
    ours, ddp = gradient_problem(prof, Strategy.DENSE), gradient_problem(prof, Strategy.DENSE, runtime="ddp")
    assert ours.prepare_s(n) == pytest.approx(4 * gradient_problem(base, Strategy.DENSE).prepare_s(n))
    assert ddp.prepare_s(n) == pytest.approx(2 * gradient_problem(base, Strategy.DENSE).prepare_s(n))
    plain_topk = gradient_problem(base, Strategy.TOPK, 0.01, selector="sampled")
    topk = gradient_problem(prof, Strategy.TOPK, 0.01, selector="sampled")
    exact = gradient_problem(prof, Strategy.TOPK, 0.01, selector="exact")  # not calibrated: as micro-benchmarked
    assert plain_topk.select is not None and plain_topk.decode is not None
    assert topk.prepare_s(n) == pytest.approx(1.5 * plain_topk.select.cost(n))
    assert exact.prepare_s(n) == pytest.approx(gradient_problem(base, Strategy.TOPK, 0.01).prepare_s(n))
    assert topk.decode is not None and topk.decode.cost(n) == pytest.approx(3 * plain_topk.decode.cost(n))
    # Under DDP's top-k hook DDP copies into its buckets first, then the hook selects.
    ddp_topk = gradient_problem(prof, Strategy.TOPK, 0.01, selector="sampled", runtime="ddp")
    assert ddp_topk.prepare_s(n) == pytest.approx(ddp.prepare_s(n) + topk.prepare_s(n))


def test_a_calibration_never_makes_the_work_free() -> None:
    """A measurement of no effect (or none told apart from noise) is not used: the micro-benchmark stands (factor 1),
    never a clamped floor."""
    assert Calibration(measured_s=0.0, modelled_s=0.01).factor == 1.0
    assert Calibration(measured_s=-0.002, modelled_s=0.01).use.why == "no effect was measured"
    noisy = Calibration.of_samples([-0.004, 0.011, 0.002, -0.001, 0.009, 0.004], modelled_s=0.01)
    assert not noisy.use.used and noisy.factor == 1.0 and "no effect" in noisy.use.why
    assert Calibration(measured_s=0.5, modelled_s=0.0).factor == 1.0
    with pytest.raises(SchemaError, match="factor"):
        ScaledCost(inner=AffineCost(alpha=0.0, beta=1.0), factor=0.0)


def test_the_ddp_row_is_predicted_with_ddps_own_cost_and_stays_above_the_bound() -> None:
    prof = calibrated_profile("resnet18")
    for strategy, density in ((Strategy.DENSE, None), (Strategy.TOPK, 0.01)):
        plan = make_plan(prof, strategy, density, source="test", selector="sampled" if density else None)
        ddp_problem = gradient_problem(prof, strategy, density, selector="sampled", runtime="ddp")
        ddp = next(b for b in BASELINES[strategy] if b.name == DDP_BASELINE)
        grouping = ddp.solve(ddp_problem)
        assert plan.baselines[plan.ddp_row] == simulate(ddp_problem, grouping)  # "ddp", or "ddp+topk:0.01"
        assert plan.baselines[plan.ddp_row].pack_s > 0
        rows = [plan.predicted, *plan.baselines.values()]
        assert all(plan.lower_bound_s <= r.iteration_s * (1 + 1e-9) for r in rows)


def _in_situ_worker(rank: int, world_size: int) -> InSitu:
    from planner.contracts.profile import TopkTiming
    from planner.profilers.layers import combine_ranks, measure_layers
    from planner.profilers.topk import measure_topk
    from planner.runtime.calibrate import measure_in_situ, measure_packing

    torch.manual_seed(0)
    workload = build_workload("mlp")
    cpu = torch.device("cpu")
    run = measure_layers(workload, cpu, repeats=2, warmup=1)
    layers = combine_ranks([run]).layers
    sizes = [1 << 10, 1 << 14, 1 << 18, 1 << 20]
    topk: TopkTiming = measure_topk(sizes, [0.01], world_size, cpu, repeats=2, warmup=1)
    pack = measure_packing(sizes, world_size, cpu, repeats=2, warmup=1)
    return measure_in_situ(workload, cpu, layers, world_size, pack=curve_model(pack), topk=topk, density=0.01,
                           repeats=2)


def test_the_runtime_and_ddp_are_calibrated_in_real_steps_on_two_processes() -> None:
    """Every calibration is measured (medians over both ranks: the same on each) with the micro-benchmarks'
    prediction for the same groups beside it (each rank's own curves)."""
    first, second = run_warm(_in_situ_worker, 2)
    assert first.pack is not None and second.pack is not None
    assert first.pack.measured_s == second.pack.measured_s
    assert first.pack is not None and first.decode is not None and first.ddp_pack is not None
    assert set(first.select) == {"exact", "sampled"}
    for c in (first.pack, first.decode, first.ddp_pack, *first.select.values()):
        # every rank's pairs kept (2 ranks x 2 pairs, twice where the first measurement was not usable)
        assert c.modelled_s > 0 and c.samples_s is not None and len(c.samples_s) == 4
        assert c.measured_s == pytest.approx(statistics.median(c.samples_s))
        assert c.factor > 0 and (c.factor == 1.0 or c.use.used)


def test_machine_drift_compares_the_local_steps_with_the_profile() -> None:
    from planner.sessions.bench import LOCAL, BenchResult, machine_drift

    def row(name: str, median: float, predicted: float | None) -> BenchResult:
        return BenchResult.from_samples(name, "x", [median], steps=1, predicted_s=predicted, reference="ddp")

    assert machine_drift([row("ddp", 1.0, 0.9)]) is None
    assert machine_drift([row("ddp", 1.0, 0.9), row(LOCAL, 0.6, 0.5)]) == pytest.approx(0.2)
    assert machine_drift([row(LOCAL, 0.45, 0.5)]) == pytest.approx(-0.1)


def test_the_bench_notes_factor_hooks_that_ran_apart_from_the_profile(capsys: pytest.CaptureFixture[str]) -> None:
    from planner.commands.printing import print_bench
    from planner.sessions.bench import BenchResult
    from planner.sessions.bench_kfac import FACTOR_HOOKS, FACTOR_HOOKS_STRATEGY

    def rows(hooks_s: float) -> list[BenchResult]:
        plan = BenchResult.from_samples("plan", "kfac", [0.7], steps=3, predicted_s=0.6, reference="plan")
        hooks = BenchResult.from_samples(FACTOR_HOOKS, FACTOR_HOOKS_STRATEGY, [hooks_s], steps=3, predicted_s=0.3,
                                         reference="plan")
        return [plan, hooks]

    print_bench(rows(0.4), as_json=False)
    err = capsys.readouterr().err
    assert "factor hooks took 400.00 ms per factor-update step, 100.00 ms more than the profile's 300.00 ms" in \
        " ".join(err.split())
    print_bench(rows(0.31), as_json=False)  # within 5%: nothing to say
    assert "factor hooks" not in capsys.readouterr().err


def test_a_chains_pace_counts_the_collectives_completed() -> None:
    """Seconds per collective from the chain's start to its last completion; None when none had."""
    from planner.profilers.interference import _pace

    assert _pace([1.0, 2.0, 3.5], 0.5) == pytest.approx(1.0)
    assert _pace([1.0, 2.0, None], 0.0) == pytest.approx(1.0)
    assert _pace([None, None], 0.0) is None
    assert _pace([], 0.0) is None


def test_the_powersgd_hooks_allreduces_take_what_sending_took_in_real_steps() -> None:
    """The "send" calibration of PyTorch's PowerSGD hook scales its two allreduces (the Ps with the tensors sent
    whole, then the Qs) in DDP's row and nowhere else: on one bucket nothing overlaps them, so the row grows by
    exactly (factor - 1) times the curve's prediction for both."""
    from planner.costmodel.mixed_simulator import FP32_BYTES
    from planner.kernels.compress import PowerSGDLayout
    from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors

    profile = synthetic_profile("cnn")
    assert profile.compress is not None
    allowed = parse_compressors("dense,powersgd:1")
    before = make_mixed_plan(profile, allowed, time_limit_s=None)
    comm = curve_model(profile.curve(Collective.ALLREDUCE))
    layouts = [PowerSGDLayout.of(row.shapes, 1) for row in profile.compress.powersgd_at(1).values()]
    modelled = sum(comm.cost(FP32_BYTES * n) for n in (sum(x.send_numel for x in layouts),
                                                      sum(x.q_numel for x in layouts)))
    sent = Calibration.of_samples([3.0 * modelled * (1 + d) for d in (-0.02, -0.01, 0.0, 0.01, 0.02)], modelled)
    assert sent.use.used and sent.factor == pytest.approx(3.0)
    with_send = dataclasses.replace(profile, in_situ=InSitu(compress={"ddp+powersgd:1": {"send": sent}}))
    after = make_mixed_plan(with_send, allowed, time_limit_s=None)
    grown = after.baselines["ddp+powersgd:1"].iteration_s - before.baselines["ddp+powersgd:1"].iteration_s
    assert grown == pytest.approx(2.0 * modelled, rel=1e-9)
    assert after.predicted == before.predicted  # the plan's own PowerSGD groups are the runtime's, not the hook
    assert {name: p for name, p in after.baselines.items() if name != "ddp+powersgd:1"} == {
        name: p for name, p in before.baselines.items() if name != "ddp+powersgd:1"}
    # a profile file keeps it, and refuses it where nothing is measured (fp16 is sent as dense is)
    assert Profile.from_dict(json.loads(json.dumps(with_send.to_dict()))).in_situ == with_send.in_situ
    data = with_send.to_dict()
    data["in_situ"]["compress"]["fp16"] = {"send": sent.to_dict()}
    with pytest.raises(SchemaError, match=r"unknown field\(s\) \['send'\] in profile.in_situ.compress.fp16"):
        Profile.from_dict(data)


def test_the_runtimes_powersgd_allreduces_take_what_sending_took_in_real_steps() -> None:
    """The runtime's own "send" calibration scales the allreduces of the plan's PowerSGD groups, and of the plan
    run inside DDP, not the hook's: on one group of every layer nothing overlaps them, so the step grows by
    exactly (factor - 1) times the curve's prediction for both."""
    from planner.costmodel.from_profile import mixed_problem
    from planner.costmodel.mixed_simulator import FP32_BYTES, simulate_mixed
    from planner.kernels.compress import PowerSGDLayout
    from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors

    profile = synthetic_profile("cnn")
    assert profile.compress is not None
    comm = curve_model(profile.curve(Collective.ALLREDUCE))
    layouts = [PowerSGDLayout.of(row.shapes, 1) for row in profile.compress.powersgd_at(1).values()]
    modelled = sum(comm.cost(FP32_BYTES * n) for n in (sum(x.send_numel for x in layouts),
                                                      sum(x.q_numel for x in layouts)))
    sent = Calibration.of_samples([3.0 * modelled * (1 + d) for d in (-0.02, -0.01, 0.0, 0.01, 0.02)], modelled)
    with_send = dataclasses.replace(profile, in_situ=InSitu(compress={"powersgd:1": {"send": sent}}))

    def one_group(p: Profile, runtime: str) -> float:
        problem = mixed_problem(p, [parse_compressors("powersgd:1")[0]], runtime=runtime)
        return simulate_mixed(problem, (problem.num_layers,), [0]).iteration_s

    for runtime in ("planner", "planhook"):
        grown = one_group(with_send, runtime) - one_group(profile, runtime)
        assert grown == pytest.approx(2.0 * modelled, rel=1e-9), runtime
    assert one_group(with_send, "ddp") == one_group(profile, "ddp")
    before, after = (make_mixed_plan(p, parse_compressors("powersgd:1"), time_limit_s=None)
                     for p in (profile, with_send))
    assert after.baselines["ddp+powersgd:1"] == before.baselines["ddp+powersgd:1"]
    assert after.predicted.iteration_s > before.predicted.iteration_s
    assert Profile.from_dict(json.loads(json.dumps(with_send.to_dict()))).in_situ == with_send.in_situ
