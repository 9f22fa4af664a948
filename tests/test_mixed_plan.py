"""Mixed plans from a profile: `planner solve --strategy mixed|auto`, their baselines, the explanation table, and
bad input (one clear line, exit 2)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from planner.commands.cli import main
from planner.contracts.plan import Plan
from planner.contracts.profile import CompressTiming, Profile
from planner.costmodel.curves import curve_model, fit_curve
from planner.costmodel.from_profile import mixed_problem
from planner.costmodel.mixed_simulator import simulate_mixed
from planner.models import build_workload
from planner.strategies.auto import solve_auto
from planner.strategies.cluster import PRESETS as PRESETS_CLUSTER
from planner.strategies.cluster import profile_for_cluster
from planner.strategies.mixed_plan import PRESETS, explain, make_mixed_plan, parse_compressors, preset_compressors
from planner.types import Collective, Compressor, CompressorError, Strategy
from tests.factories import synthetic_compress_timing, synthetic_profile


def _profile(tmp_path: Path, model: str = "mlp", sigma: float = 0.4) -> Path:
    prof = replace(synthetic_profile(model), interference={Collective.ALLREDUCE: sigma, Collective.ALLGATHER: sigma})
    path = tmp_path / f"{model}.json"
    prof.save(path)
    return path


def test_mixed_plan_is_no_worse_than_any_compressor_alone_and_explains_itself(tmp_path: Path) -> None:
    profile = synthetic_profile("resnet18")
    compressors = parse_compressors("all")
    plan = make_mixed_plan(profile, compressors, source="synthetic")
    assert plan.strategy is Strategy.MIXED and plan.compressors == compressors
    assert {plan.compressor_of(g) for g in plan.groups} <= set(compressors)
    for c in compressors:
        only = plan.baselines[f"only:{c}"]
        assert plan.predicted.iteration_s <= only.iteration_s * (1 + 1e-9)
    assert {"ddp", "ddp+fp16", "ddp+powersgd:1", "ddp+powersgd:4", "ddp+topk:0.01"} <= set(plan.baselines)
    assert plan.lower_bound_s <= plan.predicted.iteration_s
    # The plan's prediction is the simulated time of its own groups under the mixed model.
    problem = mixed_problem(profile, compressors, selector=plan.selector or "exact")
    reasons = explain(plan, profile)
    assert len(reasons) == len(plan.groups)
    for r in reasons:
        assert set(r.alternatives) == {str(c) for c in compressors} - {str(r.compressor)}
        # switching one group alone never beats the exact plan
        assert min(r.alternatives.values()) >= plan.predicted.iteration_s * (1 - 1e-9)
    choice = tuple(problem.index_of(plan.compressor_of(g)) for g in plan.groups)
    from planner.contracts.layers import plan_grouping

    assert simulate_mixed(problem, plan_grouping(plan, profile), choice).iteration_s == pytest.approx(
        plan.predicted.iteration_s, rel=1e-12)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan


def test_auto_keeps_the_fastest_candidate() -> None:
    profile = synthetic_profile("vgg16")
    choice = solve_auto(profile, parse_compressors("dense,fp16,topk:0.01"))
    assert set(choice.candidates) == {"dense", "topk at 0.01", "mixed over dense, fp16, topk:0.01"}
    assert choice.plan.predicted.iteration_s == min(p.predicted.iteration_s for p in choice.candidates.values())
    assert "kept" in choice.reason
    # dense alone: one candidate, the dense plan
    assert list(solve_auto(profile, parse_compressors("exact")).candidates) == ["dense"]


def test_presets_and_lists_parse() -> None:
    assert [str(c) for c in parse_compressors("light")] == list(PRESETS["light"])
    assert parse_compressors("dense, fp16 ,powersgd:2") == (Compressor.parse("dense"), Compressor.parse("fp16"),
                                                             Compressor.parse("powersgd:2"))
    with pytest.raises(CompressorError, match="unknown compressor"):
        parse_compressors("dense,zip")


def test_cli_solve_mixed_and_auto_write_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = _profile(tmp_path)
    out = tmp_path / "mixed.json"
    assert main(["solve", str(prof), "--strategy", "mixed", "--compressors", "dense,fp16,powersgd:1,topk:0.01", "-o",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "next best" in text and "only:powersgd:1" in text and "ddp+fp16" in text
    plan = Plan.load(out)
    assert plan.strategy is Strategy.MIXED and all(g.compressor is not None for g in plan.groups)
    assert main(["show", str(out), "--groups"]) == 0
    assert "mixed" in capsys.readouterr().out
    auto = tmp_path / "auto.json"
    assert main(["solve", str(prof), "--strategy", "auto", "--compressors", "light", "-o", str(auto)]) == 0
    assert "--strategy auto" in capsys.readouterr().out
    assert Plan.load(auto).predicted.iteration_s <= plan.baselines["ddp"].iteration_s * 10


@pytest.mark.parametrize(("argv", "message"), [
    (["--strategy", "mixed", "--compressors", "zip"], "unknown compressor 'zip'"),
    (["--strategy", "mixed", "--compressors", "powersgd:0"], "rank must be a whole number"),
    (["--strategy", "mixed", "--compressors", "topk:2"], "`0 < density <= 1`"),
    (["--strategy", "mixed", "--compressors", "powersgd:8"], "did not measure powersgd:8"),
    (["--strategy", "mixed", "--compressors", "dense,topk:0.00001"], "densities 0.001 to 1"),
    (["--strategy", "mixed", "--compressors", "dense,dense"], "twice"),
    (["--strategy", "mixed", "--density", "0.1"], "--density applies to --strategy topk only"),
    (["--strategy", "dense", "--compressors", "fp16"], "applies to --strategy mixed and auto only"),
    (["--strategy", "mixed", "--compressors", "fp16", "--selector", "sampled"], "--selector applies"),
    (["--strategy", "auto", "--time-limit", "0"], "--time-limit > 0"),
    (["--strategy", "mixed", "--compressors", ""], "--compressors needs a preset"),  # not the default, silently
    (["--strategy", "auto", "--compressors", ""], "--compressors needs a preset"),
])
def test_cli_bad_compressors_give_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                           message: str) -> None:
    prof = _profile(tmp_path)
    out = tmp_path / "plan.json"
    assert main(["solve", str(prof), *argv, "-o", str(out)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_a_profile_without_compressor_timings_plans_dense_and_topk_only(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    old = replace(synthetic_profile("mlp"), compress=None)
    path = tmp_path / "old.json"
    old.save(path)
    assert main(["solve", str(path), "--strategy", "mixed", "--compressors", "dense,fp16", "-o",
                 str(tmp_path / "p.json")]) == 2
    assert "no fp16 or PowerSGD measurements" in capsys.readouterr().err
    assert main(["solve", str(path), "--strategy", "mixed", "--compressors", "dense,topk:0.01", "-o",
                 str(tmp_path / "p.json")]) == 0
    # a preset is narrowed to what the profile measured, and says what it left out; a list is not
    capsys.readouterr()
    assert main(["solve", str(path), "--strategy", "mixed", "--compressors", "all", "-o",
                 str(tmp_path / "all.json")]) == 0
    assert ("--compressors all: left out fp16, powersgd:1, powersgd:2, powersgd:4, which this profile did not "
            "measure") in capsys.readouterr().out
    assert {str(c) for c in Plan.load(tmp_path / "all.json").compressors} == {"dense", "topk:0.01"}
    assert main(["solve", str(path), "--strategy", "mixed", "--compressors", "lowrank", "-o",
                 str(tmp_path / "none.json")]) == 0  # dense alone is still measured
    assert main(["solve", str(path), "--strategy", "mixed", "--compressors", "dense,fp16,topk:0.01", "-o",
                 str(tmp_path / "p.json")]) == 2


def test_a_preset_takes_the_powersgd_ranks_the_profile_measured(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    base = synthetic_profile("mlp")
    assert base.compress is not None
    names = [row.layer for row in base.compress.powersgd if row.rank == 1]
    ranks_4_16 = replace(base, compress=synthetic_compress_timing(build_workload("mlp").module, names, (4, 16)))
    assert [str(c) for c in preset_compressors("lowrank", ranks_4_16)] == ["dense", "fp16", "powersgd:4",
                                                                          "powersgd:16"]
    assert [str(c) for c in preset_compressors("all", ranks_4_16)] == ["dense", "fp16", "powersgd:4", "powersgd:16",
                                                                      "topk:0.01"]
    assert preset_compressors("light", ranks_4_16) == parse_compressors("light")
    assert preset_compressors("lowrank", replace(base, compress=None)) == parse_compressors("lowrank")
    path = tmp_path / "r.json"
    ranks_4_16.save(path)
    assert main(["solve", str(path), "--strategy", "mixed", "--compressors", "lowrank", "-o",
                 str(tmp_path / "p.json")]) == 0
    assert "left out" not in capsys.readouterr().out
    assert [str(c) for c in Plan.load(tmp_path / "p.json").compressors] == ["dense", "fp16", "powersgd:4",
                                                                          "powersgd:16"]


def test_a_plan_naming_a_bad_compressor_is_refused_in_one_line(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    plan = make_mixed_plan(synthetic_profile("mlp"), parse_compressors("light"))
    doc = plan.to_dict()
    for bad, message in (("powersgd:-1", "plan.groups[0].compressor"), ("gzip", "unknown compressor"),
                         (7, "named by text")):
        doc["groups"][0]["compressor"] = bad
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(doc))
        assert main(["show", str(path)]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and message in err[0], err
    doc["groups"][0]["compressor"] = "fp16"
    doc["groups"][0]["k"] = 3
    path.write_text(json.dumps(doc))
    assert main(["show", str(path)]) == 2
    assert "only top-k groups have k" in capsys.readouterr().err


def test_retune_and_report_take_mixed_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = _profile(tmp_path)
    plan = tmp_path / "mixed.json"
    assert main(["solve", str(prof), "--strategy", "mixed", "--compressors", "dense,fp16,powersgd:1", "-o",
                 str(plan)]) == 0
    retuned = tmp_path / "retuned.json"
    assert main(["retune", str(plan), "--no-probe", "-o", str(retuned)]) == 0
    again = Plan.load(retuned)
    assert again.strategy is Strategy.MIXED and again.compressors == Plan.load(plan).compressors
    assert "predicted gain of re-tuning: 1.000x" in capsys.readouterr().out  # same cluster: nothing to gain
    report = tmp_path / "report"
    assert main(["report", str(plan), "-o", str(report)]) == 0
    assert (report / "timeline.png").stat().st_size > 0 and (report / "report.html").exists()
    assert "not mixed ones" in capsys.readouterr().err


def test_auto_says_when_ddp_is_predicted_faster_than_every_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """Over a fast network with this runtime's packing 10x DDP's, no plan beats DDP: `--strategy auto` says to keep
    it, in the plan's one verdict line; behind a slow link the plan wins and it says to keep the plan."""
    from planner.commands.printing import print_plan
    from planner.contracts.profile import Calibration, InSitu
    from planner.strategies.auto import ddp_predictions
    from tests.test_interference import measured_profile

    def verdicts(choice: object) -> list[str]:
        print_plan(choice.plan, ddp=ddp_predictions(choice.candidates))  # type: ignore[attr-defined]
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("verdict:")]

    fast = fit_curve([(1 << s, 1e-6 + 1e-12 * (1 << s)) for s in range(10, 27, 2)])
    prof = replace(measured_profile("mlp"), in_situ=InSitu(pack=Calibration(measured_s=0.1, modelled_s=0.01),
                                                           ddp_pack=Calibration(measured_s=0.01, modelled_s=0.01)))
    prof = replace(prof, collectives={**prof.collectives, Collective.ALLREDUCE: fast, Collective.ALLGATHER: fast})
    choice = solve_auto(prof, parse_compressors("light"))
    assert choice.ddp_faster is not None and choice.ddp_faster[0] in ("ddp", "ddp+fp16")
    assert choice.ddp_faster[1] < choice.plan.predicted.iteration_s
    (line,) = verdicts(choice)
    assert line.startswith(("verdict: keep DDP: the plan's", "verdict: keep DDP with its fp16 hook (ddp+fp16)"))
    assert f"is slower than {choice.ddp_faster[0]} " in line and "its noise not weighed" in line
    slow = solve_auto(synthetic_profile("vgg16"), parse_compressors("all"))
    assert slow.ddp_faster is None and "keep" not in slow.reason
    (line,) = verdicts(slow)
    assert line.startswith("verdict: keep the plan: the plan's") and "faster, as predicted" in line


def test_the_bench_of_a_mixed_plan_alone_has_a_local_row_predicted_as_a_dense_plans() -> None:
    """The local steps (no communication) tell how far the machine moved since the profile; a mixed plan's DDP
    row holds the same forward + backward + update as a dense plan of the profile."""
    from planner.models import build_workload
    from planner.sessions.bench import LOCAL, bench_variants, local_prediction
    from planner.strategies.gradients import make_plan

    profile = synthetic_profile("mlp")
    mixed = make_mixed_plan(profile, parse_compressors("dense,fp16,powersgd:4"))
    local = {v.name: v for v in bench_variants((mixed,), build_workload("mlp").module, peers=())}[LOCAL]
    assert local.local and local.plan is None
    assert local.predicted_s == pytest.approx(local_prediction(make_plan(profile, Strategy.DENSE)), rel=1e-9)
    assert local.predicted_s == pytest.approx(profile.forward_s + profile.backward_s + profile.update_s,
                                              rel=1e-6)


def test_one_model_for_every_strategy_the_same_dense_grouping_is_predicted_the_same() -> None:
    """Item 4 of issue #47: sigma and kappa are charged alike in dense, top-k and mixed problems and in their DDP
    rows. The same grouping sent dense is predicted the same by the dense problem and by every mixed problem that
    may send it dense (whose collectives are allreduces, or whose allgather is no more interfering); a mixed plan
    allowed only dense is the dense optimum, one allowed only top-k the top-k optimum, and the DDP rows agree."""
    from planner.contracts.layers import plan_grouping
    from planner.costmodel.from_profile import gradient_problem
    from planner.costmodel.simulator import simulate
    from planner.strategies.gradients import make_plan

    base = synthetic_profile("resnet18")
    profile = replace(base, interference={Collective.ALLREDUCE: 1.5, Collective.ALLGATHER: 0.7},
                      comm_stretch={Collective.ALLREDUCE: 1.5, Collective.ALLGATHER: 0.4})
    dense = gradient_problem(profile, Strategy.DENSE)
    assert dense.comm_stretch == 1.5 and gradient_problem(profile, Strategy.TOPK, 0.01).comm_stretch == 0.4
    layers = dense.num_layers
    groupings = [(layers,), tuple(range(1, layers + 1)), (layers // 3, layers // 2, layers)]
    for named in ("dense", "dense,fp16", "dense,powersgd:2", "dense,fp16,powersgd:1,topk:0.01"):
        mixed = mixed_problem(profile, parse_compressors(named))
        assert mixed.comm_stretch == 1.5 and mixed.interference == 1.5
        way = mixed.index_of(Compressor.parse("dense"))
        for grouping in groupings:
            expected = simulate(dense, grouping)
            got = simulate_mixed(mixed, grouping, (way,) * len(grouping))
            assert got.iteration_s == pytest.approx(expected.iteration_s, rel=1e-12)
            assert got.exposed_comm_s == pytest.approx(expected.exposed_comm_s, rel=1e-9, abs=1e-15)

    dense_plan = make_plan(profile, Strategy.DENSE)
    only_dense = make_mixed_plan(profile, parse_compressors("dense"))
    assert only_dense.predicted.iteration_s == pytest.approx(dense_plan.predicted.iteration_s, rel=1e-9)
    light = make_mixed_plan(profile, parse_compressors("light"))
    assert light.baselines["ddp"].iteration_s == pytest.approx(
        dense_plan.baselines["ddp"].iteration_s, rel=1e-12)
    assert light.predicted.iteration_s <= dense_plan.predicted.iteration_s * (1 + 1e-9)
    topk_plan = make_plan(profile, Strategy.TOPK, 0.01, selector="exact")
    only_topk = make_mixed_plan(profile, parse_compressors("topk:0.01"), selector="exact")
    assert only_topk.predicted.iteration_s == pytest.approx(topk_plan.predicted.iteration_s, rel=1e-9)
    topk_grouping = plan_grouping(topk_plan, profile)
    assert simulate(gradient_problem(profile, Strategy.TOPK, 0.01), topk_grouping).iteration_s == pytest.approx(
        topk_plan.predicted.iteration_s, rel=1e-12)


def test_an_fp16_groups_allreduce_is_the_fp32_curve_at_its_bytes_plus_the_measured_summing() -> None:
    """fp16 halves the bytes sent, but summing half-precision values costs work of its own (over gloo on a CPU more
    than the bytes it saves): an fp16 group's allreduce is priced as an fp32 one of its bytes plus what the profile
    measured beyond that (`CompressTiming.fp16_sum`), in the planner's runtime and in DDP's hook alike; a profile
    from before it was measured prices the fp32 curve alone. The profile reads back with and without it."""
    fp16 = Compressor.parse("fp16")
    profile = synthetic_profile("mlp")
    assert profile.compress is not None and profile.compress.fp16_sum is None
    summing = fit_curve([(1 << 10, 2e-4), (1 << 20, 9e-3), (1 << 24, 0.12)])
    measured = replace(profile, compress=replace(profile.compress, fp16_sum=summing))
    sizes = np.array([4096.0, 3e6, 2e7])  # message bytes
    for runtime in ("planner", "ddp"):
        before = mixed_problem(profile, [fp16], runtime=runtime).compressors[0].comm.cost_many(sizes)
        after = mixed_problem(measured, [fp16], runtime=runtime).compressors[0].comm.cost_many(sizes)
        dense = mixed_problem(profile, [Compressor.parse("dense")], runtime=runtime).compressors[0].comm
        assert before == pytest.approx(dense.cost_many(sizes), rel=1e-12)
        assert after == pytest.approx(before + curve_model(summing).cost_many(sizes), rel=1e-12)
    timing = measured.compress
    assert timing is not None and CompressTiming.from_dict(timing.to_dict(), "compress") == timing
    assert "fp16_sum" not in profile.compress.to_dict()
    assert Profile.from_dict(json.loads(json.dumps(measured.to_dict()))).compress == timing
    # The profiled backend's summing (gloo's, in software) is not another cluster's: a what-if leaves it out.
    what_if = profile_for_cluster(measured, PRESETS_CLUSTER["ib100-64"]).compress
    assert what_if is not None and what_if.fp16_sum is None and what_if.fp16_cast == timing.fp16_cast
