"""`planner.strategies.predict.predict` prices every kind of plan as the strategies priced it, and every solver's own
fast evaluator agrees with it: the gradient grouping DPs' values, the mixed solver's, the fusion DP's channel end,
the packing DP's value, a placement's makespan, ABS-SGD's rounds, and a pairing's crossover periods."""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.contracts.kfac_section import KFACSection
from planner.contracts.layers import plan_grouping
from planner.contracts.pairing import PairingJob
from planner.contracts.plan import Plan
from planner.contracts.profile import Profile, WorkerThroughput
from planner.costmodel.curves import fit_curve
from planner.costmodel.from_profile import gradient_problem, mixed_problem
from planner.costmodel.problem import groups_of
from planner.sessions.pair import make_pairing
from planner.solvers import DenseDP, TopkParetoDP
from planner.solvers.compressor_choice import MixedParetoDP
from planner.solvers.fusion import FusionDP
from planner.solvers.packing import PackingDP
from planner.solvers.placement import LargestFirst, makespan
from planner.strategies.abs_plan import make_abs_plan
from planner.strategies.gradients import make_plan
from planner.strategies.intervals import Draws, kfac_problems, with_intervals, with_kfac_intervals
from planner.strategies.kfac_plan import make_kfac_plan, packing_problem
from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors
from planner.strategies.predict import PlanKind, predict
from planner.types import Collective, SchemaError, Strategy
from tests.factories import examples, synthetic_profile, with_samples

#: Relative difference allowed between a solver's vectorised value and the scalar walk `predict` takes (the same
#: terms, summed in another order).
_RTOL = 1e-9

_MODELS = ("mlp", "digits", "cnn")
_SETTINGS = settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def _base(model: str, world_size: int) -> Profile:
    return synthetic_profile(model, world_size)


def _profile(model: str, world_size: int, seed: int, measured: bool = False) -> Profile:
    """A synthetic profile with each layer's backward, the forward and the update scaled at random (0.2x to 5x);
    `measured`: with a packing curve, interference and comm stretch, as `planner profile` writes them."""
    base = _base(model, world_size)
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.uniform(np.log(0.2), np.log(5.0), len(base.layers) + 2))
    layers = tuple(replace(lt, backward_s=lt.backward_s * float(s)) for lt, s in zip(base.layers, scale, strict=False))
    profile = replace(base, layers=layers, backward_s=sum(lt.backward_s for lt in layers),
                      forward_s=base.forward_s * float(scale[-2]), update_s=base.update_s * float(scale[-1]))
    if not measured:
        return profile
    sigma, kappa = rng.uniform(0.0, 1.5, 2), rng.uniform(0.0, 1.0, 2)
    return replace(profile, pack=fit_curve([(n, 3e-6 + 2e-10 * n) for n in (1 << 10, 1 << 14, 1 << 18, 1 << 22)]),
                   interference={Collective.ALLREDUCE: float(sigma[0]), Collective.ALLGATHER: float(sigma[1])},
                   comm_stretch={Collective.ALLREDUCE: float(kappa[0]), Collective.ALLGATHER: float(kappa[1])})


#: Profiles with and without packing and interference; `plain_profiles` without (the K-FAC identities below hold
#: where nothing stretches the factor step).
profiles = st.builds(_profile, st.sampled_from(_MODELS), st.integers(1, 4), st.integers(0, 2**16), st.booleans())
plain_profiles = st.builds(_profile, st.sampled_from(_MODELS), st.integers(1, 4), st.integers(0, 2**16))


@_SETTINGS
@given(profile=profiles, strategy=st.sampled_from([Strategy.DENSE, Strategy.TOPK]),
       density=st.sampled_from([0.001, 0.01, 0.1]))
def test_gradient_plans_are_priced_as_solved_and_as_the_dps_value_them(profile: Profile, strategy: Strategy,
                                                                       density: float) -> None:
    density_of = density if strategy is Strategy.TOPK else None
    plan = make_plan(profile, strategy, density_of, via_ddp=False)
    found = predict(plan, profile, interval=False)
    assert found.kind is PlanKind(strategy.value)
    assert found.gradient == plan.predicted and found.step_s == plan.predicted.iteration_s
    assert found.interval is None and len(found.events) == len(plan.groups)
    solver = DenseDP() if strategy is Strategy.DENSE else TopkParetoDP()
    grouping, value = solver.solve_with_value(
        gradient_problem(profile, strategy, density_of, selector=plan.selector or "exact"))
    assert grouping == plan_grouping(plan, profile)
    assert math.isclose(found.step_s, value, rel_tol=_RTOL)


@_SETTINGS
@given(profile=profiles, compressors=st.sets(st.sampled_from(["fp16", "powersgd:1", "powersgd:2", "topk:0.01"]),
                                             max_size=3))
def test_mixed_plans_are_priced_as_solved_and_as_the_mixed_solver_values_them(profile: Profile,
                                                                               compressors: set[str]) -> None:
    chosen = parse_compressors(",".join(["dense", *sorted(compressors)]))
    plan = make_mixed_plan(profile, chosen, selector="exact" if "topk:0.01" in compressors else None,
                           time_limit_s=None, rows=False)
    found = predict(plan, profile, interval=False)
    assert found.kind is PlanKind.MIXED
    assert found.gradient == plan.predicted and found.step_s == plan.predicted.iteration_s
    solution = MixedParetoDP().solve(mixed_problem(profile, chosen))
    assert solution.proven and math.isclose(found.step_s, solution.iteration_s, rel_tol=_RTOL)


def _kfac_plan(profile: Profile, inv_update_steps: int) -> Plan:
    return make_kfac_plan(profile, inv_update_steps=inv_update_steps, time_limit_s=0.5)


@_SETTINGS
@given(profile=plain_profiles, inv_update_steps=st.sampled_from([1, 5, 10]))
def test_kfac_plans_are_priced_as_solved_and_their_buffers_as_the_fusion_dp_values_them(
        profile: Profile, inv_update_steps: int) -> None:
    plan = _kfac_plan(profile, inv_update_steps)
    assert plan.kfac is not None
    found = predict(plan, profile, interval=False)
    assert found.kind is PlanKind.KFAC and found.kfac is not None
    assert found.kfac == plan.kfac.predicted and found.step_s == plan.kfac.predicted.step_s
    assert found.gradient == plan.predicted
    problem = kfac_problems(plan.kfac, plan_grouping(plan, profile))(profile, "plan")
    assert problem.interference == problem.comm_stretch == 0  # the factor step is then the fusion DP's channel end
    if plan.kfac.mixed_whole is None:  # buffers of the fusion DP (per-buffer formats: the packing DP's, below)
        buffers, channel_end = FusionDP().solve_with_value(problem.fusion)
        assert tuple(len(b) for b in plan.kfac.a_buffers) == tuple(len(r) for r in groups_of(buffers[0]))
        assert found.kfac.factor_step_s == (max(problem.compute_end_s, channel_end) + problem.fold_s
                                            + found.kfac.precondition_s + problem.tail_s)


def _with_layout(section: KFACSection, owners: dict[str, int | None],
                 preconditioners: dict[str, int | None]) -> KFACSection:
    return replace(section, owners=owners, preconditioners=preconditioners)


@_SETTINGS
@given(profile=plain_profiles)
def test_an_inversion_placement_is_priced_at_its_makespan(profile: Profile) -> None:
    plan = _kfac_plan(profile, 10)
    assert plan.kfac is not None
    problem = kfac_problems(plan.kfac, plan_grouping(plan, profile))(profile, "plan")
    result = LargestFirst().solve(problem.placement)
    owners = dict(zip(problem.factor_names, result.placement, strict=True))
    everyone = dict.fromkeys(plan.kfac.preconditioners)
    placed = replace(plan, kfac=_with_layout(plan.kfac, owners, everyone))
    found = predict(placed, profile, interval=False)
    assert found.kfac is not None
    assert found.kfac.inversion_s == result.makespan_s == makespan(problem.placement, result.placement)


@_SETTINGS
@given(profile=plain_profiles)
def test_buffers_and_formats_are_priced_as_the_packing_dp_values_them(profile: Profile) -> None:
    plan = _kfac_plan(profile, 10)
    assert plan.kfac is not None
    packing, a_names, g_names = packing_problem(profile)
    (buffers, formats), value = PackingDP().solve_with_value(packing)
    forward = [lt.name for lt in plan.kfac.layers]  # buffers hold layers (A in forward order, G backward)
    whole = frozenset(names[i] for names, ends, flags in ((a_names, buffers[0], formats[0]),
                                                           (g_names, buffers[1], formats[1]))
                      for members, w in zip(groups_of(ends), flags, strict=True) if w for i in members)
    section = replace(plan.kfac, whole_factors=False, mixed_whole=whole,
                      a_buffers=tuple(tuple(forward[i] for i in r) for r in groups_of(buffers[0])),
                      g_buffers=tuple(tuple(forward[::-1][i] for i in r) for r in groups_of(buffers[1])))
    found = predict(replace(plan, kfac=section), profile, interval=False)
    assert found.kfac is not None
    tail = profile.update_s
    assert math.isclose(found.kfac.factor_step_s - found.kfac.precondition_s - tail, value, rel_tol=_RTOL)


def _throughput(profile: Profile, slow: float) -> Profile:
    """`profile` with per-worker throughput: the last worker `slow` times slower."""
    world, sizes = profile.cluster.world_size, (16, 32, 64)
    rows = tuple(tuple((1e-3 + 2e-4 * b) * (slow if r == world - 1 else 1.0) for b in sizes) for r in range(world))
    return replace(profile, throughput=WorkerThroughput(batch_sizes=sizes, step_s=rows))


@_SETTINGS
@given(profile=profiles, slow=st.floats(1.0, 4.0), trigger=st.sampled_from(["batch", "exchange"]),
       global_batch=st.sampled_from([64, 256]))
def test_abs_plans_are_priced_as_solved(profile: Profile, slow: float, trigger: str, global_batch: int) -> None:
    profile = _throughput(profile, slow)
    plan = make_abs_plan(profile, global_batch, trigger=trigger)
    assert plan.abs is not None
    found = predict(plan, profile)
    assert found.kind is PlanKind.ABS and found.interval is None
    assert found.abs == plan.abs.predicted["abs-sgd"] and found.step_s == plan.abs.predicted["abs-sgd"].round_s
    assert found.gradient == plan.predicted


def _job(name: str, compute: float, comm: float, world_size: int) -> PairingJob:
    return PairingJob(name=name, plan=f"plans/{name}.json", plan_fingerprint="0123456789abcdef", model="mlp",
                      model_fingerprint="7e793d4f58bbedbc", world_size=world_size, samples=32, compute_s=compute,
                      comm_s=comm)


@_SETTINGS
@given(phases=st.lists(st.tuples(st.floats(0.1, 4.0), st.floats(0.0, 4.0), st.integers(1, 2)), min_size=1,
                       max_size=5))
def test_a_pairing_is_priced_at_its_crossover_round(phases: list[tuple[float, float, int]]) -> None:
    jobs = [_job(f"j{k}", c, n, w) for k, (c, n, w) in enumerate(phases)]
    pairing, _ = make_pairing(jobs, created="2026-01-01T00:00:00+00:00")
    found = predict(pairing)
    assert found.kind is PlanKind.CROSSOVER and found.interval is None and found.gradient is None
    assert found.crossover == tuple(p.crossover_s for p in pairing.predicted)
    assert found.step_s == pairing.round_s("crossover")


@pytest.mark.parametrize("kind", ["dense", "topk", "mixed", "kfac"])
def test_the_interval_is_the_one_solve_records(kind: str) -> None:
    profile = with_samples(synthetic_profile("mlp"))
    draws = Draws.of(profile, count=40)
    assert draws is not None
    if kind == "kfac":
        plan = with_kfac_intervals(_kfac_plan(profile, 10), profile, draws)
        assert plan.kfac is not None and plan.kfac.intervals is not None
        recorded = plan.kfac.intervals["plan"]
    else:
        plan = (make_mixed_plan(profile, parse_compressors("dense,fp16,powersgd:2")) if kind == "mixed"
                else make_plan(profile, Strategy(kind), 0.01 if kind == "topk" else None))
        plan = with_intervals(plan, profile, draws)
        assert plan.intervals is not None
        recorded = plan.intervals.rows["plan"]
    found = predict(plan, profile, draws=draws)
    assert found.interval == recorded and found.interval[0] < found.step_s < found.interval[1]
    assert predict(plan, profile, interval=False).interval is None


def test_what_cannot_be_priced_is_refused_in_one_line() -> None:
    plan = make_plan(synthetic_profile("mlp"), Strategy.DENSE, via_ddp=False)
    with pytest.raises(SchemaError, match="needs the profile"):
        predict(plan)
    with pytest.raises(SchemaError, match="only a plan or a pairing plan can be priced, but got dict"):
        predict({"strategy": "dense"}, synthetic_profile("mlp"))  # type: ignore[arg-type]
