"""K-FAC plans: the kfac section and profile measurements as data, the timeline model, and the CLI."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from planner.commands.cli import main
from planner.contracts.kfac_section import KFACSection, factor_name, kfac_layers
from planner.contracts.plan import Plan
from planner.contracts.profile import DimCurve, Profile
from planner.costmodel.curves import curve_model, fit_dim_curve, worst_error
from planner.models import build_workload
from planner.solvers.fusion import FUSION_BASELINES, CommEvent, FusionTimeline, simulate_fusion
from planner.solvers.layout import KaisaCommOpt, KaisaMemOpt, layout_timelines
from planner.solvers.placement import makespan
from planner.strategies.kfac_plan import (
    LOCAL_KFAC,
    calibrated_kfac,
    kfac_lower_bound,
    kfac_problem,
    make_kfac_plan,
    predict_kfac,
    reference_sections,
    section_layout,
    stretched_channel_end,
)
from planner.types import Collective, FactorKind, InvalidProfileError, InverseMethod, PlanMismatchError, SchemaError
from tests.factories import synthetic_kfac_plan, synthetic_plan, synthetic_profile
from tests.test_contracts import _cli, _main, _one_clear_line

TOL = 1e-12


def test_profile_with_kfac_round_trips(tmp_path: Path) -> None:
    prof = synthetic_profile("cnn")
    assert prof.kfac is not None
    path = tmp_path / "p.json"
    prof.save(path)
    assert Profile.load(path) == prof
    doc = json.loads(path.read_text())
    del doc["kfac"]
    assert Profile.from_dict(doc).kfac is None  # profiles written before K-FAC still load


def test_dim_curve_fits_cubes_and_interpolates_otherwise() -> None:
    cubic = fit_dim_curve([(d, 1e-3 + 2e-10 * d**3) for d in (16, 128, 1024, 2048)])
    assert curve_model(cubic).cost(512) == pytest.approx(1e-3 + 2e-10 * 512**3, rel=1e-6)
    assert curve_model(cubic).cost(4096) == pytest.approx(1e-3 + 2e-10 * 4096**3, rel=1e-6)  # cubic beyond the points
    bumpy = fit_dim_curve([(16, 1e-3), (128, 5e-3), (1024, 0.01), (2048, 0.5)])
    assert worst_error(bumpy) > 0.25
    assert curve_model(bumpy).cost(1024) == pytest.approx(0.01)  # measured points are reproduced
    with pytest.raises(InvalidProfileError, match="two or more dimensions"):
        DimCurve.from_dict({"points": [[8, 1e-3]], "alpha_s": 0, "beta_s_per_dim3": 0, "fit_error": 0}, "x")


def test_kfac_plan_round_trips_and_old_plans_load(tmp_path: Path) -> None:
    plan = synthetic_kfac_plan("cnn")
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    doc = synthetic_plan("mlp").to_dict()
    del doc["kfac"]
    assert Plan.from_dict(doc).kfac is None
    old = plan.to_dict()  # made before predictions carried the factors' compute
    del old["kfac"]["predicted"]["plan"]["factor_compute_s"]
    assert Plan.from_dict(old).kfac.predicted.factor_compute_s is None


def test_kfac_section_validation() -> None:
    layers = kfac_layers(build_workload("cnn").module)
    names = [lt.name for lt in layers]
    with pytest.raises(SchemaError, match="forward order"):
        KFACSection.simple(layers, a_buffers=((names[1], names[0]), tuple(names[2:])))
    with pytest.raises(SchemaError, match="backward order"):
        KFACSection.simple(layers, g_buffers=(tuple(names),))
    with pytest.raises(SchemaError, match="multiple of factor_update_steps"):
        KFACSection.simple(layers, factor_update_steps=3, inv_update_steps=10)
    with pytest.raises(SchemaError, match="factor_update_steps >= 1"):
        KFACSection.simple(layers, factor_update_steps=0)
    owners: dict[str, int | None] = {factor_name(n, k): None for n in names for k in FactorKind}
    del owners[factor_name(names[0], FactorKind.G)]
    with pytest.raises(SchemaError, match=r"missing \['0.G'\]"):
        KFACSection.simple(layers, owners=owners)
    plan = synthetic_kfac_plan("cnn")
    assert plan.kfac is not None
    bad = dict(plan.kfac.owners)
    bad[factor_name(names[0], FactorKind.A)] = 5
    with pytest.raises(SchemaError, match=r"names ranks \[5\] \(inversion owners or preconditioners\) but the world"):
        replace(plan, kfac=replace(plan.kfac, owners=bad, preconditioners={}))
    doc = plan.to_dict()
    doc["kfac"]["owners"][factor_name(names[0], FactorKind.A)] = "some"
    with pytest.raises(SchemaError, match="must be a rank >= 0 or 'all', got 'some'"):
        Plan.from_dict(doc)


def test_check_layers_names_the_difference() -> None:
    plan = synthetic_kfac_plan("cnn")
    assert plan.kfac is not None
    plan.kfac.check_layers(kfac_layers(build_workload("cnn").module))
    with pytest.raises(PlanMismatchError, match=r"K-FAC layers differ.*planner solve --strategy kfac"):
        plan.kfac.check_layers(kfac_layers(build_workload("mlp").module))
    with pytest.raises(PlanMismatchError, match=r"\['16'\]"):
        plan.kfac.check_layers(kfac_layers(build_workload("cnn").module, skip="^16$"))


@pytest.mark.parametrize("model", ["cnn", "mlp", "resnet18"])
@pytest.mark.parametrize("world_size", [2, 8])
def test_plan_is_never_worse_than_its_baselines(model: str, world_size: int) -> None:
    plan = synthetic_kfac_plan(model, world_size, factor_update_steps=2, inv_update_steps=10)
    k = plan.kfac
    assert k is not None and k.predicted is not None and k.baselines is not None and k.lower_bound_s is not None
    assert {"kfac-pytorch", "everywhere", "sgd", "fusion:25mb", "fusion:spd-greedy", "placement:largest-first",
            "placement:spd-kfac", "placement:everywhere"} <= set(k.baselines)
    for name, pred in k.baselines.items():
        if name != "sgd":
            assert k.predicted.step_s <= pred.step_s * (1 + TOL), name
    assert k.lower_bound_s <= k.predicted.step_s * (1 + TOL)
    assert k.baselines["sgd"].step_s <= k.predicted.step_s  # preconditioning is not free


@pytest.mark.parametrize("mode", ["everyone", "owners"])
def test_prediction_follows_the_timeline_model(mode: str) -> None:
    """The average step is plain + (factor - plain)/T_f + inversion/T_i, from the fusion and layout models; with
    every worker preconditioning every layer, the preconditioning phase is the sum of the layers' times."""
    profile = replace(synthetic_profile("cnn", world_size=2), interference={Collective.ALLREDUCE: 0.5})
    problem = kfac_problem(profile, InverseMethod.EIGEN)
    buffers = FUSION_BASELINES[0].solve(problem.fusion)
    layout = (KaisaCommOpt() if mode == "everyone" else KaisaMemOpt()).solve(problem.layout).layout
    pred = predict_kfac(problem, buffers, layout, factor_update_steps=2, inv_update_steps=4)
    inversion, preconditioning = layout_timelines(problem.layout, layout)
    timeline = simulate_fusion(problem.fusion, buffers)
    # Collectives in flight during forward and backward slow them by sigma per busy second of the channel.
    sigma = profile.interference_for(Collective.ALLREDUCE)
    busy = sum(max(0.0, min(e.end_s, problem.compute_end_s) - e.start_s) for e in timeline.events)
    assert problem.interference == sigma > 0 and busy > 0
    assert pred.interference_s == pytest.approx(sigma * busy / (1 + sigma), rel=TOL)
    stretched = problem.compute_end_s + pred.interference_s
    factor = max(stretched, timeline.end_s) + problem.fold_s + preconditioning.makespan_s + problem.tail_s
    assert pred.factor_step_s == pytest.approx(factor, rel=TOL)
    quiet = predict_kfac(replace(problem, interference=0.0), buffers, layout, factor_update_steps=2,
                         inv_update_steps=4)
    assert quiet.interference_s == 0 and quiet.factor_step_s <= pred.factor_step_s
    assert pred.inversion_s == pytest.approx(inversion.makespan_s, rel=TOL)
    assert pred.precondition_s == pytest.approx(preconditioning.makespan_s, rel=TOL)
    assert pred.step_s == pytest.approx(pred.plain_step_s + (factor - pred.plain_step_s) / 2
                                        + inversion.makespan_s / 4, rel=TOL)
    kf = calibrated_kfac(profile)
    assert pred.factor_compute_s == pytest.approx(sum(lt.a_compute_s + lt.g_compute_s for lt in kf.layers), rel=TOL)
    assert pred.plain_step_s == pytest.approx(problem.sgd_step_s + preconditioning.makespan_s, rel=TOL)
    if mode == "everyone":
        assert preconditioning.makespan_s == pytest.approx(sum(lt.precondition_eigen_s for lt in kf.layers), rel=TOL)
        assert inversion.makespan_s == pytest.approx(makespan(problem.placement, layout.owners), rel=TOL)
    else:  # each layer on its owner: its factors are not broadcast, its preconditioned gradient is
        assert not inversion.broadcasts and len(preconditioning.broadcasts) == len(kf.layers)
    # A factors ready in forward order, G in backward order, after the forward pass.
    assert list(problem.fusion.a_names) == [lt.name for lt in kf.layers]
    assert list(problem.fusion.g_names) == [lt.name for lt in reversed(kf.layers)]
    assert min(problem.fusion.g_ready_s) >= max(problem.fusion.a_ready_s)
    assert kfac_lower_bound(problem, factor_update_steps=2, inv_update_steps=4) <= pred.step_s


def _channel(*events: tuple[float, float]) -> FusionTimeline:
    """A channel of collectives (ready, seconds alone), each started when ready and the channel is free."""
    out, free = [], 0.0
    for i, (ready, seconds) in enumerate(events):
        start = max(ready, free)
        free = start + seconds
        out.append(CommEvent(kind="grad", index=i, members=range(i, i + 1), ready_s=ready, start_s=start,
                             end_s=free, bytes=1))
    return FusionTimeline(a_end_s=0.0, end_s=free, factor_comm_s=0.0, grad_comm_s=free, num_buffers=0,
                          events=tuple(out))


def test_collectives_run_slower_while_the_workers_compute() -> None:
    """kappa stretches the part of each collective before compute ends, and only that part: by hand."""
    one = _channel((0.0, 1.0))
    assert stretched_channel_end(one, 1.0, 0.0) == 1.0
    # Half its work fits in the first second at half speed; the other half then runs at full speed.
    assert stretched_channel_end(one, 1.0, 1.0) == pytest.approx(1.5, rel=TOL)
    assert stretched_channel_end(one, 4.0, 1.0) == pytest.approx(2.0, rel=TOL)  # wholly beside compute
    assert stretched_channel_end(one, 0.0, 3.0) == pytest.approx(1.0, rel=TOL)  # compute had ended
    # A collective ready after compute ends is not slowed; one delayed behind a slowed one starts later.
    two = _channel((0.0, 1.0), (0.5, 1.0))
    assert stretched_channel_end(two, 1.0, 1.0) == pytest.approx(2.5, rel=TOL)
    late = _channel((0.0, 0.2), (3.0, 1.0))
    assert stretched_channel_end(late, 2.0, 1.0) == pytest.approx(4.0, rel=TOL)


def test_plain_steps_charge_kappa_on_the_gradient_allreduces() -> None:
    """The sgd row and every K-FAC step's part without factors are the dense gradient step with the profile's
    kappa (the simulator's, worked by hand in `test_simulator`), on the grouping DenseDP chose with it."""
    from planner.costmodel.from_profile import gradient_problem
    from planner.costmodel.simulator import simulate
    from planner.solvers import DenseDP
    from planner.types import Strategy

    base = synthetic_profile("mlp", world_size=2)
    plain = kfac_problem(base, InverseMethod.EIGEN)
    slowed = kfac_problem(replace(base, comm_stretch={Collective.ALLREDUCE: 1.0}), InverseMethod.EIGEN)
    assert slowed.sgd_step_s == slowed.plain_step_s > plain.sgd_step_s == plain.plain_step_s
    plan = make_kfac_plan(replace(base, comm_stretch={Collective.ALLREDUCE: 1.0}), source="test", time_limit_s=0.5)
    assert plan.kfac is not None and plan.kfac.baselines is not None
    assert plan.kfac.baselines["sgd"].step_s == pytest.approx(slowed.sgd_step_s, rel=TOL)
    grad = gradient_problem(replace(base, comm_stretch={Collective.ALLREDUCE: 1.0}), Strategy.DENSE)
    assert grad.comm_stretch == 1.0
    assert slowed.sgd_step_s == pytest.approx(DenseDP().solve_with_value(grad)[1], rel=TOL)
    assert slowed.sgd_step_s == pytest.approx(simulate(grad, DenseDP().solve(grad)).iteration_s, rel=TOL)


def test_slower_collectives_can_only_lengthen_the_factor_step() -> None:
    """The prediction with kappa is never shorter than without, never longer than with every collective
    slowed whole, and `factor_step_timeline` predicts the same factor step as `predict_kfac`."""
    base = replace(synthetic_profile("cnn", world_size=2), interference={Collective.ALLREDUCE: 0.5})
    problem = kfac_problem(base, InverseMethod.EIGEN)
    buffers = FUSION_BASELINES[0].solve(problem.fusion)
    layout = KaisaMemOpt().solve(problem.layout).layout
    timeline = simulate_fusion(problem.fusion, buffers)
    steps = []
    for kappa in (0.0, 0.5, 2.0):
        stretched = replace(problem, comm_stretch=kappa)
        pred = predict_kfac(stretched, buffers, layout, factor_update_steps=1, inv_update_steps=4)
        compute = problem.compute_end_s + pred.interference_s
        slowest = compute + timeline.end_s * (1 + kappa)  # an upper bound: every collective slowed, after compute
        assert pred.factor_step_s <= slowest + problem.fold_s + pred.precondition_s + problem.tail_s
        steps.append(pred.factor_step_s)
    assert steps[0] <= steps[1] <= steps[2] and steps[0] < steps[2]
    profile = replace(base, comm_stretch={Collective.ALLREDUCE: 2.0})
    assert kfac_problem(profile, InverseMethod.EIGEN).comm_stretch == 2.0
    plan = make_kfac_plan(profile, source="test", time_limit_s=0.5)
    assert plan.kfac is not None and plan.kfac.predicted is not None
    from planner.contracts.layers import plan_grouping
    from planner.strategies.kfac_plan import factor_step_timeline

    step = factor_step_timeline(profile, plan.kfac, plan_grouping(plan, profile))
    assert step.comm_stretch == 2.0 and step.channel_end_s >= step.channel.end_s
    assert step.step_s == pytest.approx(plan.kfac.predicted.factor_step_s, rel=TOL)


def test_reference_sections_are_kfac_pytorch_defaults() -> None:
    plan = synthetic_kfac_plan("mlp", 2)
    refs = reference_sections(plan)
    assert {"kfac-pytorch", "kaisa-mem-opt", "everywhere"} <= set(refs)
    mem = refs["kaisa-mem-opt"]
    assert mem.owners == refs["kfac-pytorch"].owners and mem.whole_factors
    assert all(mem.owners[factor_name(n, FactorKind.A)] == r for n, r in mem.preconditioners.items())
    assert all(r is None for r in refs["kfac-pytorch"].preconditioners.values())
    assert all(o is None for o in refs["everywhere"].owners.values()) and not refs["everywhere"].whole_factors
    ref = refs["kfac-pytorch"]
    owners = ref.owners
    assert all(o in (0, 1) for o in owners.values()) and set(owners.values()) == {0, 1}
    # kfac-pytorch's defaults: a layer's A and G on one worker, whole factors in 25 MB buckets.
    for lt in ref.layers:
        assert owners[factor_name(lt.name, FactorKind.A)] == owners[factor_name(lt.name, FactorKind.G)], lt.name
    assert ref.whole_factors
    # The mlp's whole factors (785^2 and 1025^2 values, 2.5-4.2 MB) share 25 MB buckets: fewer buffers than factors.
    assert len(ref.a_buffers) < len(plan.kfac.layers)  # type: ignore[union-attr]
    assert ref.predicted == plan.kfac.baselines["kfac-pytorch"]  # type: ignore[union-attr,index]


def test_kfac_pytorch_row_sends_whole_factors() -> None:
    """The kfac-pytorch row is its layout predicted with d^2 values per factor: dearer than the same layout
    sending upper triangles, and the whole-factor problem's messages are d^2 (inverses too)."""
    profile = synthetic_profile("mlp", world_size=2)
    plan = synthetic_kfac_plan("mlp", 2, inv_update_steps=5)
    assert plan.kfac is not None and plan.kfac.baselines is not None
    ref = reference_sections(plan)["kfac-pytorch"]
    buffers = tuple(tuple(itertools.accumulate(len(b) for b in bufs)) for bufs in (ref.a_buffers, ref.g_buffers))
    layout = section_layout(ref)
    for method in InverseMethod:
        triangles = kfac_problem(profile, method)
        whole = kfac_problem(profile, method, whole_factors=True)
        a_dims = [lt.a_dim for lt in triangles.layers]
        assert whole.fusion.a_bytes == tuple(d * d * 4 for d in a_dims)
        assert triangles.fusion.a_bytes == tuple(d * (d + 1) // 2 * 4 for d in a_dims)
        if method is InverseMethod.INVERSE:
            assert all(w > t for w, t in zip(whole.placement.bcast_s, triangles.placement.bcast_s, strict=True))
        else:  # eigenvectors and eigenvalues either way
            assert whole.placement.bcast_s == triangles.placement.bcast_s
    intervals = {"factor_update_steps": 1, "inv_update_steps": 5}
    sent_whole = predict_kfac(kfac_problem(profile, whole_factors=True), buffers, layout, **intervals)  # type: ignore[arg-type]
    sent_triangles = predict_kfac(kfac_problem(profile), buffers, layout, **intervals)  # type: ignore[arg-type]
    assert plan.kfac.baselines["kfac-pytorch"].step_s == pytest.approx(sent_whole.step_s, rel=TOL)
    assert sent_whole.factor_comm_s > sent_triangles.factor_comm_s


def test_factor_messages_round_trip_and_are_validated() -> None:
    plan = synthetic_kfac_plan("cnn")
    assert plan.kfac is not None
    whole = replace(plan, kfac=replace(plan.kfac, whole_factors=True, mixed_whole=None))
    doc = whole.to_dict()
    assert doc["kfac"]["factor_messages"] == "whole"
    assert Plan.from_dict(doc) == whole
    del doc["kfac"]["factor_messages"]  # plans made before: upper triangles
    assert Plan.from_dict(doc).kfac.whole_factors is False  # type: ignore[union-attr]
    doc["kfac"]["factor_messages"] = "half"
    with pytest.raises(SchemaError, match=r"factor_messages must be 'upper-triangle', 'whole' or .* got 'half'"):
        Plan.from_dict(doc)


def test_cli_solve_kfac_show_and_bad_inputs(tmp_path: Path) -> None:
    prof_path = tmp_path / "prof.json"
    synthetic_profile("cnn").save(prof_path)
    plan_path = tmp_path / "plan.json"
    args = ["solve", str(prof_path), "--strategy", "kfac", "--inv-update-steps", "20", "-o", str(plan_path)]
    assert main(args) == 0
    plan = Plan.load(plan_path)
    assert plan.kfac is not None and plan.kfac.inv_update_steps == 20
    proc = _cli("show", str(plan_path), "--groups")
    assert proc.returncode == 0, proc.stderr
    for text in ("kfac-pytorch", "everywhere", "placement:largest-first", "lower bound", "A factor buffers"):
        assert text in proc.stdout, text

    no_kfac = tmp_path / "nokfac.json"
    doc = synthetic_profile("cnn").to_dict()
    doc["kfac"] = None
    no_kfac.write_text(json.dumps(doc))
    out = str(tmp_path / "out.json")
    _one_clear_line(_main("solve", str(no_kfac), "--strategy", "kfac", "-o", out), "no K-FAC measurements")
    _one_clear_line(_main("solve", str(prof_path), "--strategy", "kfac", "--factor-update-steps", "3",
                         "--inv-update-steps", "10", "-o", out), "multiple of factor_update_steps")
    _one_clear_line(_main("solve", str(prof_path), "--inv-update-steps", "10", "-o", out), "--strategy kfac only")
    assert not Path(out).exists()

    dense_path = tmp_path / "dense.json"
    synthetic_plan("cnn").save(dense_path)
    _one_clear_line(_main("bench", "--strategy", "kfac", "--plan", str(dense_path)), "has no kfac section")
    _one_clear_line(_main("bench", "--strategy", "kfac", "--plan", str(plan_path), "--model", "mlp"),
                    "this plan was made for model cnn")
    _one_clear_line(_main("bench", "--strategy", "kfac", "--plan", str(plan_path), "--peers", "fp16"),
                    "--strategy kfac takes --peers kfac-pytorch")


def test_layers_with_shared_weights_keep_plain_gradients() -> None:
    """A Linear whose weight another module shares (tied weights) is not a K-FAC layer; the others are."""
    from torch import nn

    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    assert [s.name for s in kfac_layers(model)] == ["0", "2", "4"]
    model[2].weight = model[0].weight
    assert [s.name for s in kfac_layers(model)] == ["4"]


def _with_packing_costs(profile: Profile, triangles: float, whole: float) -> Profile:
    """`profile` with its factor packing and unpacking times scaled by `triangles`, and whole-matrix ones equal to
    the original triangle times scaled by `whole`."""
    assert profile.kfac is not None
    layers = tuple(replace(lt, a_compute_s=lt.a_compute_s * triangles, g_compute_s=lt.g_compute_s * triangles,
                           fold_s=lt.fold_s * triangles, a_compute_whole_s=lt.a_compute_s * whole,
                           g_compute_whole_s=lt.g_compute_s * whole, fold_whole_s=lt.fold_s * whole)
                   for lt in profile.kfac.layers)
    return replace(profile, kfac=replace(profile.kfac, layers=layers))


@pytest.mark.parametrize(("triangles", "whole", "sends_whole"), [(100.0, 1.0, True), (1.0, 100.0, False)])
def test_the_plan_sends_factors_the_faster_way(triangles: float, whole: float, sends_whole: bool) -> None:
    """Whole factors cost more traffic and less packing: the plan solves both and keeps the faster, and the
    other appears among the baselines; the whole-factor problem uses the whole-matrix times and sizes."""
    base = synthetic_profile("mlp", world_size=2)
    profile = _with_packing_costs(base, triangles, whole)
    plan = make_kfac_plan(profile, inv_update_steps=5)
    k = plan.kfac
    assert k is not None and k.predicted is not None and k.baselines is not None
    assert k.whole_factors is sends_whole
    other = k.baselines["plan, upper triangles" if sends_whole else "plan, whole factors"]
    assert k.predicted.step_s <= other.step_s
    problem = kfac_problem(profile, whole_factors=True)
    assert base.kfac is not None
    assert problem.fold_s == pytest.approx(sum(lt.fold_s * whole for lt in base.kfac.layers))
    assert problem.fusion.a_bytes == tuple(lt.a_dim**2 * 4 for lt in problem.layers)


def test_profiles_without_whole_factor_times_fall_back_to_triangles() -> None:
    profile = synthetic_profile("mlp", world_size=2)
    doc = profile.to_dict()
    for lt in doc["kfac"]["layers"]:
        for key in ("a_compute_whole_s", "g_compute_whole_s", "fold_whole_s"):
            del lt[key]
    old = Profile.from_dict(doc)
    assert old.kfac is not None
    assert all(lt.fold(True) == lt.fold_s and lt.a_compute(True) == lt.a_compute_s for lt in old.kfac.layers)
    assert Profile.from_dict(profile.to_dict()) == profile


def test_bad_preconditioners_in_a_plan_file_give_one_line(tmp_path: Path) -> None:
    """A plan whose preconditioners name a rank that does not exist, a layer the model lacks, or a rank that does
    not invert its layer's factors is refused on load, in one line, by every command."""
    plan = synthetic_kfac_plan("cnn", inv_update_steps=5)
    assert plan.kfac is not None
    layer = plan.kfac.layers[0].name
    doc = plan.to_dict()
    cases = []
    far = json.loads(json.dumps(doc))
    far["kfac"]["preconditioners"][layer] = 5
    far["kfac"]["owners"].update({factor_name(layer, k): 5 for k in FactorKind})
    cases.append((far, "names ranks [5] (inversion owners or preconditioners) but the world size is 2"))
    unknown = json.loads(json.dumps(doc))
    unknown["kfac"]["preconditioners"]["no-such-layer"] = 0
    cases.append((unknown, "kfac.preconditioners must name every layer once: missing [], unknown ['no-such-layer']"))
    foreign = json.loads(json.dumps(doc))
    foreign["kfac"]["owners"].update({factor_name(layer, FactorKind.A): 0, factor_name(layer, FactorKind.G): "all"})
    foreign["kfac"]["preconditioners"][layer] = 0
    cases.append((foreign, f"kfac.preconditioners.{layer} is rank 0, which must invert both"))
    for i, (bad, message) in enumerate(cases):
        path = tmp_path / f"bad{i}.json"
        path.write_text(json.dumps(bad))
        _one_clear_line(_main("show", str(path)), message)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_formats_chosen_per_buffer_are_predicted_as_the_runtime_reads_them(model: str) -> None:
    """The plan keeps the fastest of upper triangles, whole factors and formats chosen per buffer; what it
    predicts is what `kfac_problem` gives for the section's own formats and buffers (as show and retune read
    it), and a per-buffer choice gives every buffer one format."""
    from planner.strategies.kfac_plan import PLAN_MIXED, per_buffer_formats, section_layout

    profile = synthetic_profile(model, world_size=2)
    plan = make_kfac_plan(profile, inv_update_steps=5)
    k = plan.kfac
    assert k is not None and k.predicted is not None and k.baselines is not None
    for name in ("plan, upper triangles", "plan, whole factors", PLAN_MIXED):
        if name in k.baselines:
            assert k.predicted.step_s <= k.baselines[name].step_s
    problem = kfac_problem(profile, whole_factors=k.factor_formats(), inv_update_steps=5)
    buffers = (tuple(itertools.accumulate(len(b) for b in k.a_buffers)),
               tuple(itertools.accumulate(len(b) for b in k.g_buffers)))
    again = predict_kfac(problem, buffers, section_layout(k), factor_update_steps=1, inv_update_steps=5)
    assert again.step_s == pytest.approx(k.predicted.step_s, rel=1e-12)
    per_buffer = per_buffer_formats(profile)
    assert per_buffer is not None
    for kind, groups in ((FactorKind.A, k.a_buffers), (FactorKind.G, k.g_buffers)):
        for names in groups:
            if k.mixed_whole is not None:
                assert len({k.sends_whole(factor_name(n, kind)) for n in names}) == 1
    if k.mixed_whole is not None:
        assert k.factor_formats() == per_buffer[0] and k.fusion_solver == "packing-dp"
        assert k.lower_bound_s is not None and k.lower_bound_s <= k.predicted.step_s


def test_the_plan_carries_what_kfac_leaves_out_and_show_lists_it(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    profile = synthetic_profile("mlp")
    assert profile.kfac is not None
    left = (("norm", "LayerNorm: K-FAC here preconditions Linear and Conv2d layers only"),)
    profile = replace(profile, kfac=replace(profile.kfac, left_out=left, skip="^norm$"))
    again = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again.kfac is not None and again.kfac.left_out == left and again.kfac.skip == "^norm$"
    plan = make_kfac_plan(profile)
    assert plan.kfac is not None and plan.kfac.left_out == left and plan.kfac.skip == "^norm$"
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path).kfac == plan.kfac
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "K-FAC preconditions 4 layers (--kfac-skip '^norm$'); 1 left to plain SGD: norm: LayerNorm" in out
    # A plan (or profile) made before the layers left out were recorded says so, not "none left out".
    doc = json.loads(path.read_text())
    del doc["kfac"]["left_out"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    assert Plan.load(old).kfac.left_out is None  # type: ignore[union-attr]
    assert main(["show", str(old)]) == 0
    out = capsys.readouterr().out
    assert "K-FAC preconditions 4 layers (--kfac-skip '^norm$'); which modules it leaves to plain SGD was not " \
           "recorded" in " ".join(out.split())
    prof_doc = profile.to_dict()
    del prof_doc["kfac"]["left_out"]
    assert Profile.from_dict(prof_doc).kfac.left_out is None  # type: ignore[union-attr]
    assert make_kfac_plan(Profile.from_dict(prof_doc)).kfac.left_out is None  # type: ignore[union-attr]


@pytest.mark.parametrize("steps", [(1, 1), (1, 5), (2, 4)])
def test_the_local_kfac_row_adds_every_kernel_to_the_local_step(steps: tuple[int, int]) -> None:
    """One worker alone: every factor computed and folded on a factor-update step, every factor inverted on an
    inversion step, every layer preconditioned each step, nothing sent and nothing overlapped."""
    factor_steps, inv_steps = steps
    profile = synthetic_profile("cnn")
    plan = make_kfac_plan(profile, factor_update_steps=factor_steps, inv_update_steps=inv_steps)
    assert plan.kfac is not None and plan.kfac.baselines is not None
    local = plan.kfac.baselines[LOCAL_KFAC]
    kf = calibrated_kfac(profile)
    method = plan.kfac.method
    compute = profile.forward_s + profile.backward_s + profile.update_s
    pre = sum(lt.precondition_s(method) for lt in kf.layers)
    factors = sum(lt.a_compute_s + lt.g_compute_s + lt.fold_s for lt in kf.layers)  # upper triangles
    curve = curve_model(kf.inverse if method is InverseMethod.INVERSE else kf.eigen)
    inversion = sum(curve.cost(d) for lt in kf.layers for d in (lt.a_dim, lt.g_dim))
    assert local.step_s == pytest.approx(compute + pre + factors / factor_steps + inversion / inv_steps, rel=1e-9)
    assert local.factor_comm_s == local.broadcast_s == local.interference_s == 0.0
    assert local.inversion_s == pytest.approx(inversion, rel=1e-12)
