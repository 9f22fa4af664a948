"""The way across hosts as a planned choice for top-k and for mixed plans: the profile's measure of how much a
host's picks overlap and of the hierarchical top-k exchange, the exact search over groupings x ways against
brute force, and the plans it makes (every group one way when one way is clearly cheaper, never worse than all
flat or all hierarchical, the way recorded per group and used by every later reading of the plan)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.commands.cli import main
from planner.contracts.plan import Plan
from planner.contracts.profile import FittedCurve, HostTiming, HostTopk, Profile
from planner.costmodel.costs import AffineCost
from planner.costmodel.curves import curve_model, fit_curve
from planner.costmodel.from_profile import mixed_problem
from planner.costmodel.mixed_simulator import CompressorCosts, MixedProblem, simulate_mixed
from planner.costmodel.problem import topk_count
from planner.kernels.hierarchical import HostGroups
from planner.kernels.topk import all_gather_flat
from planner.models import Workload
from planner.profilers.comm import host_union_ratio, measure_host_topk, measure_union_ratios, overlapping_picks
from planner.sessions.bench import plan_tag
from planner.sessions.report import gantt_lanes
from planner.solvers.compressor_choice import MixedParetoDP
from planner.strategies.gradients import ALL_FLAT, ALL_HIERARCHICAL, make_plan
from planner.strategies.mixed_plan import explain, make_mixed_plan, parse_compressors, plan_choice
from planner.types import Collective, Compressor, CompressorKind, InvalidProfileError, Strategy
from tests.factories import examples, synthetic_profile
from tests.pool import run_warm
from tests.test_hosts import _cli, _ours, needs_root
from tests.test_mixed import brute_force

SIZES = [1 << s for s in range(10, 27, 2)]


def _curve(alpha: float, beta: float) -> FittedCurve:
    return fit_curve([(s, alpha + beta * s) for s in SIZES])


#: A model whose messages and top-k picks are small (a few hundred parameters): `planner profile --only comm` times
#: the network of 4 workers on 2 emulated hosts at the sizes of the profile's model, and measures the overlap of the
#: picks on the model; what the test checks of both does not depend on those sizes.
SMALL_MODEL = "tests.test_tune:tiny_workload"


def _two_hosts(topk: tuple[HostTopk, ...] = (), model: str = "mlp") -> Profile:
    """The synthetic MLP (or `model`) on 2 hosts of 2: hierarchical allreduce dearer to start, cheaper per byte than
    flat."""
    base = synthetic_profile(model, world_size=4)
    hosts = HostTiming(ranks=((0, 1), (2, 3)), intra=_curve(5e-5, 2e-10), inter=_curve(2e-4, 1.3e-9),
                       hierarchical=_curve(2e-3, 2.7e-9), topk=topk)
    return dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, host_count=2), hosts=hosts,
                               collectives={**base.collectives, Collective.ALLREDUCE: _curve(2e-4, 4e-9),
                                            Collective.ALLGATHER: _curve(2e-4, 6e-9)})


def _topk_at(density: float, alpha: float, beta: float, ratio: float = 1.5) -> HostTopk:
    return HostTopk(density=density, union_ratio=ratio, exchange=_curve(alpha, beta))


def test_a_profile_keeps_its_hierarchical_top_k_and_refuses_impossible_overlaps(tmp_path: Path) -> None:
    profile = _two_hosts((_topk_at(0.01, 1e-3, 1e-9, ratio=1.9),))
    profile.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    assert loaded == profile and loaded.hosts is not None
    assert loaded.hosts.topk_at(0.01) is not None and loaded.hosts.topk_at(0.1) is None
    # Profiles of before read as having measured none.
    doc = profile.to_dict()
    del doc["hosts"]["topk"]
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert Profile.load(tmp_path / "old.json").hosts.topk == ()  # type: ignore[union-attr]
    for ratio, says in ((2.5, "at most 2 k"), (0.5, "must be >= 1")):
        doc = profile.to_dict()
        doc["hosts"]["topk"][0]["union_ratio"] = ratio
        (tmp_path / "bad.json").write_text(json.dumps(doc))
        with pytest.raises(InvalidProfileError, match=says):
            Profile.load(tmp_path / "bad.json")


def _random_ways(seed: int, sigma: float) -> MixedProblem:
    """One top-k compressor two ways: flat (allgather, then decode on the compute stream) and hierarchical
    (one exchange that decodes on its own), with random costs either way round."""
    rng = np.random.default_rng(seed)
    layers = int(rng.integers(2, 6))
    numel = tuple(int(x) for x in rng.integers(1_000, 3_000_000, layers))

    def affine(a: float, b: float) -> AffineCost:
        return AffineCost(alpha=a * rng.uniform(0.2, 5), beta=b * rng.uniform(0.2, 5))

    topk = Compressor(CompressorKind.TOPK, density=0.01)
    flat = CompressorCosts(compressor=topk, collective=Collective.ALLGATHER, comm=affine(5e-4, 6e-9),
                           prepare=affine(5e-5, 4e-9), decode=affine(2e-5, 2e-9))
    routed = dataclasses.replace(flat, comm=affine(2e-3, 5e-9), decode=None, hierarchical=True)
    return MixedProblem(forward_s=float(rng.uniform(1e-3, 2e-2)), update_s=float(rng.uniform(1e-4, 1e-2)),
                        backward_s=tuple(float(x) for x in rng.uniform(1e-4, 5e-3, layers)), numel=numel,
                        world_size=4, compressors=(flat, routed), interference=sigma)


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 2**31 - 1), sigma=st.sampled_from([0.0, 0.3]))
def test_the_way_across_hosts_per_top_k_group_is_exact_against_brute_force(seed: int, sigma: float) -> None:
    problem = _random_ways(seed, sigma)
    found = MixedParetoDP(time_limit_s=None).solve(problem)
    assert found.proven
    assert math.isclose(found.iteration_s, brute_force(problem), rel_tol=1e-9, abs_tol=1e-12)
    for way in (0, 1):  # never worse than every group one way
        alone = MixedParetoDP(allowed=(way,), time_limit_s=None).solve(problem)
        assert math.isclose(alone.iteration_s, brute_force(problem, (way,)), rel_tol=1e-9, abs_tol=1e-12)
        assert found.iteration_s <= alone.iteration_s * (1 + 1e-12)


@pytest.mark.parametrize(("alpha", "beta", "expected"), [(1e-5, 1e-10, {True}), (5e-2, 1e-7, {False})])
def test_a_top_k_plan_crosses_hosts_hierarchically_where_the_profile_says_it_is_cheaper(
        alpha: float, beta: float, expected: set[bool], tmp_path: Path) -> None:
    profile = _two_hosts((_topk_at(0.01, alpha, beta),))
    plan = make_plan(profile, Strategy.TOPK, 0.01)
    assert {g.hierarchical for g in plan.groups} == expected
    assert Plan.from_dict(plan.to_dict()) == plan
    assert plan.baselines.keys() >= {ALL_FLAT, ALL_HIERARCHICAL, "ddp+topk:0.01", "mgs-greedy"}
    best_one_way = min(plan.baselines[ALL_FLAT].iteration_s, plan.baselines[ALL_HIERARCHICAL].iteration_s)
    assert plan.predicted.iteration_s <= best_one_way * (1 + 1e-12)
    assert plan.lower_bound_s <= plan.predicted.iteration_s * (1 + 1e-12)
    # The flat exact plan of before is the all-flat row.
    flat = make_plan(profile, Strategy.TOPK, 0.01, route="flat")
    assert not any(g.hierarchical for g in flat.groups)
    assert math.isclose(flat.predicted.iteration_s, plan.baselines[ALL_FLAT].iteration_s, rel_tol=1e-9)
    # Every later reading of the plan predicts it the same way: its groups, each its own way.
    problem, choice = plan_choice(plan, profile)
    grouping = tuple(np.cumsum([len(g.layers) for g in plan.groups]).tolist())
    assert math.isclose(simulate_mixed(problem, grouping, choice).iteration_s, plan.predicted.iteration_s,
                        rel_tol=1e-9)
    lanes = gantt_lanes(plan, profile)  # report's timeline is the same prediction, its collectives named
    assert math.isclose(lanes.step_s, plan.predicted.iteration_s, rel_tol=1e-9)
    assert any(b.label.endswith("hierarchical") for b in lanes.bars if b.lane == "channel") == (expected == {True})
    every = make_plan(profile, Strategy.TOPK, 0.01, route="hierarchical")
    assert {g.hierarchical for g in every.groups} == {True}
    assert math.isclose(every.predicted.iteration_s, plan.baselines[ALL_HIERARCHICAL].iteration_s, rel_tol=1e-9)


def test_without_the_exchange_measured_top_k_stays_flat_and_hierarchical_is_refused_in_one_line(
        tmp_path: Path) -> None:
    from planner.commands.cli import main

    profile = _two_hosts((_topk_at(0.1, 1e-5, 1e-10),))  # measured at 0.1 only
    plan = make_plan(profile, Strategy.TOPK, 0.01)
    assert not any(g.hierarchical for g in plan.groups) and ALL_HIERARCHICAL not in plan.baselines
    with pytest.raises(InvalidProfileError, match=r"measured it at: 0\.1"):
        make_plan(profile, Strategy.TOPK, 0.01, route="hierarchical")
    profile.save(tmp_path / "p.json")
    assert main(["solve", str(tmp_path / "p.json"), "--strategy", "topk", "--density", "0.1", "--route",
                 "hierarchical", "-o", str(tmp_path / "h.json")]) == 0
    assert {g.hierarchical for g in Plan.load(tmp_path / "h.json").groups} == {True}
    assert main(["solve", str(tmp_path / "p.json"), "--strategy", "topk", "--density", "0.01", "--route",
                 "hierarchical", "-o", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()


def test_a_mixed_plan_records_the_way_it_predicted_each_group_and_ddp_hooks_stay_flat() -> None:
    profile = _two_hosts()
    compressors = parse_compressors("dense,fp16")
    plan = make_mixed_plan(profile, compressors)
    problem, choice = plan_choice(plan, profile)
    assert {c.label for c in problem.compressors} == {"dense", "dense hierarchical", "fp16", "fp16 hierarchical"}
    hier = curve_model(profile.hosts.hierarchical)  # type: ignore[union-attr]
    flat = curve_model(profile.curve(Collective.ALLREDUCE))
    for g, c in zip(plan.groups, choice, strict=True):
        assert problem.compressors[c].hierarchical == g.hierarchical
        sent = g.numel * (2 if g.compressor == Compressor(CompressorKind.FP16) else 4)
        if abs(hier.cost(sent) - flat.cost(sent)) > 1e-3 * flat.cost(sent):  # not a near tie: the cheaper way
            assert g.hierarchical == (hier.cost(sent) < flat.cost(sent)), g
    assert any(g.hierarchical for g in plan.groups)
    assert plan.predicted.iteration_s <= min(plan.baselines[ALL_FLAT].iteration_s,
                                             plan.baselines[ALL_HIERARCHICAL].iteration_s) * (1 + 1e-12)
    # DDP's fp16 hook is DDP's: one flat allreduce per bucket, whatever the hosts.
    ddp = mixed_problem(profile, [Compressor(CompressorKind.FP16)], runtime="ddp")
    assert [c.hierarchical for c in ddp.compressors] == [False]
    assert ddp.compressors[0].comm.cost(1 << 24) == flat.cost(1 << 24)
    # The bench names the way too (a plan of before, every group flat, ran at DDP's fp16 hook's speed).
    sent = ", ".join(str(c) for c in plan.compressors or () if any(plan.compressor_of(g) == c for g in plan.groups))
    assert plan_tag(plan).startswith(f"mixed ({sent}), ") and plan_tag(plan) != f"mixed ({sent}), flat"
    # Explaining a group names its way, and the other ways it could have had.
    reasons = explain(plan, profile)
    routed = next(r for r in reasons if r.hierarchical)
    assert routed.label.endswith("hierarchical") and routed.compressor.kind.value in routed.label
    assert any(not name.endswith("hierarchical") for name in routed.alternatives)


def _measure(rank: int, world_size: int, layout: list[list[int]]) -> tuple[list[float], tuple[HostTopk, ...]]:
    groups = HostGroups.build(layout)
    grads = {
        "same": torch.arange(1000, dtype=torch.float32),  # every rank the same picks
        "disjoint": torch.where(torch.arange(1000) % world_size == rank, 1.0 + torch.arange(1000.0), 0.0),
    }
    k = topk_count(1000, 0.01)
    ratios = [host_union_ratio(torch.topk(grads[name].abs(), k).indices, k, groups) for name in ("same", "disjoint")]
    # Picks made to overlap as measured: the host's union is the ratio times k.
    for ratio in (1.0, 1.5, 2.0):
        picks = overlapping_picks(10_000, 100, ratio, groups, torch.Generator().manual_seed(3))
        assert picks.numel() == 100 and picks.unique().numel() == 100
        host = picks.new_empty(groups.local_size * 100)
        all_gather_flat(host, picks, group=groups.local)
        ratios.append(host.unique().numel() / 100)
    measured = measure_host_topk(groups, [4096, 65536], {0.01: 1.5, 1.0: 2.0}, torch.device("cpu"), repeats=2,
                                 warmup=0)
    # On a model shaped like real ones (tied, frozen, unused, BatchNorm, registered out of order), each rank its
    # own batches: the parameters without a gradient are left out, and the ratio is between its bounds.
    from tests.test_mixed_runtime import ShapedConv

    torch.manual_seed(0)
    shaped = Workload(name="shaped", module=ShapedConv(), batch_size=4,
                      make_batch=lambda n, g: (torch.randn(n, 3, 6, 6, generator=g), torch.randn(n, 4, generator=g)),
                      loss_fn=torch.nn.functional.mse_loss)
    real = measure_union_ratios(shaped, groups, [0.05, 1.0], torch.device("cpu"), rounds=2, warmup=0)
    ratios += [real[0.05], real[1.0]]
    # Error feedback: the same as picking each rank's top k of gradient plus residual by hand, every rank's
    # gradients recomputed here from its batches, and the largest host's union averaged over the rounds kept.
    tiny = _tiny_workload()
    fed = measure_union_ratios(tiny, groups, [0.1], torch.device("cpu"), rounds=5, warmup=2)[0.1]
    return [*ratios, fed, _union_by_hand(layout, 0.1, rounds=5, warmup=2)], measured


def _tiny_workload() -> Workload:
    torch.manual_seed(1)
    return Workload(name="tiny", module=torch.nn.Linear(12, 8), batch_size=3,
                    make_batch=lambda n, g: (torch.randn(n, 12, generator=g), torch.randn(n, 8, generator=g)),
                    loss_fn=torch.nn.functional.mse_loss)


def _union_by_hand(layout: list[list[int]], density: float, *, rounds: int, warmup: int) -> float:
    residual: dict[int, torch.Tensor] = {}
    ratios = []
    for step in range(rounds):
        picks = {}
        for rank in (r for host in layout for r in host):
            wl = _tiny_workload()
            x, y = wl.batch(seed=7919 * (step + 1) + rank)
            wl.loss(x, y).backward()
            grad = torch.cat([p.grad.reshape(-1) for p in wl.module.parameters() if p.grad is not None])
            acc = grad + residual.get(rank, torch.zeros_like(grad))
            k = topk_count(grad.numel(), density)
            picks[rank] = set(torch.topk(acc.abs(), k).indices.tolist())
            residual[rank] = acc.index_fill(0, torch.tensor(sorted(picks[rank])), 0.0)
        ratios.append(max(len(set().union(*(picks[r] for r in host))) / k for host in layout))
    return sum(ratios[warmup:]) / (rounds - warmup)


def test_the_profile_measures_the_overlap_of_picks_and_the_exchange_at_it() -> None:
    results = run_warm(_measure, 4, [[0, 1], [2, 3]], timeout=120)
    for ratios, measured in results:
        assert ratios[:5] == pytest.approx([1.0, 2.0, 1.0, 1.5, 2.0])
        assert 1.0 <= ratios[5] <= 2.0 and ratios[6] == pytest.approx(1.0)  # at density 1 every rank picks all
        assert 1.0 <= ratios[7] <= 2.0 and ratios[7] == pytest.approx(ratios[8], rel=1e-12)  # error feedback
        assert [t.density for t in measured] == [0.01, 1.0]
        assert [t.union_ratio for t in measured] == [1.5, 2.0]
        for t in measured:  # one point per size, against one rank's message bytes (k values, k indices)
            assert [x for x, _ in t.exchange.points] == [8 * topk_count(n, t.density) for n in (4096, 65536)]
            assert all(s > 0 for _, s in t.exchange.points)


def _with_densities(profile: Profile, densities: tuple[float, ...]) -> Profile:
    """`profile` with its top-k selection measured at `densities` only (fewer exchanges to time)."""
    assert profile.topk is not None
    select = tuple(p for p in profile.topk.select if p[1] in densities)
    return dataclasses.replace(profile, topk=dataclasses.replace(profile.topk, select=select))


def test_a_profile_gives_the_overlaps_it_measured_to_hosts_of_the_same_size_only() -> None:
    from planner.profilers.probe import TopkOverlaps

    profile = _two_hosts((_topk_at(0.01, 1e-4, 1e-9, ratio=1.37), _topk_at(0.1, 1e-4, 1e-9, ratio=1.9)))
    assert profile.hosts is not None
    assert profile.hosts.union_ratios(2) == {0.01: 1.37, 0.1: 1.9}
    assert profile.hosts.union_ratios(4) == {}  # on hosts of another size the overlap is another one
    overlaps = TopkOverlaps.of(profile)
    assert overlaps == TopkOverlaps(per_host=2, ratios={0.01: 1.37, 0.1: 1.9}, numel=profile.model.numel)
    assert TopkOverlaps.of(_two_hosts()) is None


@needs_root
def test_only_comm_on_two_hosts_times_the_top_k_exchange_again_at_the_overlaps_it_has(tmp_path: Path) -> None:
    # Measured on hosts of 2 at 0.01: reused as it is. Not measured at 0.1: measured on the model given.
    # --quick: the collectives, the host levels and the exchange timed 3 times each, not 7 and 5; a small model's
    # profile: its messages, and the picks whose overlap is measured, are small.
    out = tmp_path / "p.json"
    old = _with_densities(_two_hosts((_topk_at(0.01, 1e-4, 1e-9, ratio=1.37),), SMALL_MODEL), (0.01, 0.1))
    old.save(out)
    proc = _cli("profile", "--quick", "--model", SMALL_MODEL, "--nproc", "4", "--hosts", "2", "--only", "comm", "-o",
                str(out))
    assert proc.returncode == 0, proc.stderr
    new = Profile.load(out)
    # the network measured again, the compute kept as it was
    assert new.collectives != old.collectives and all(len(c.points) >= 5 for c in new.collectives.values())
    assert (new.layers, new.topk, new.throughput, new.step_s) == (old.layers, old.topk, old.throughput, old.step_s)
    assert new.hosts is not None and [t.density for t in new.hosts.topk] == [0.01, 0.1]
    reused, measured = new.hosts.topk
    assert reused.union_ratio == 1.37 and 1.0 <= measured.union_ratio <= 2.0
    for t in new.hosts.topk:  # timed again on this network: not the made-up curve
        assert t.exchange.points != _curve(1e-4, 1e-9).points and all(s > 0 for _, s in t.exchange.points)
    assert "did not time the top-k exchange" not in proc.stderr
    # A profile measured on one host, re-measured on 2 with --model of another model: no overlap to time at.
    one_host = _with_densities(synthetic_profile(SMALL_MODEL, world_size=4), (0.01,))
    one_host.save(out)
    proc = _cli("profile", "--quick", "--model", "cnn", "--nproc", "4", "--hosts", "2", "--only", "comm", "-o",
                str(out))
    assert proc.returncode == 0, proc.stderr
    assert Profile.load(out).hosts is not None and Profile.load(out).hosts.topk == ()  # type: ignore[union-attr]
    note = [line for line in proc.stderr.splitlines() if "did not time the top-k exchange" in line]
    assert len(note) == 1 and "densities 0.01" in note[0] and "--model cnn is not the profiled model" in note[0]
    assert _ours() == []


@needs_root
def test_retune_on_two_hosts_times_the_top_k_exchange_at_the_profiles_overlap_or_says_why_not(
        tmp_path: Path) -> None:
    prof, plan, new = tmp_path / "prof.json", tmp_path / "plan.json", tmp_path / "new.json"
    _two_hosts((_topk_at(0.01, 1e-4, 1e-9, ratio=1.37),)).save(prof)
    assert main(["solve", str(prof), "--strategy", "topk", "--density", "0.01", "-o", str(plan)]) == 0
    proc = _cli("retune", str(plan), "--nproc", "4", "--hosts", "2", "-o", str(new))
    assert proc.returncode == 0, proc.stderr
    assert "top-k merged inside hosts, at the profile's overlap of picks: density 0.01 (union 1.37 k)" in proc.stdout
    retuned = Plan.load(new)
    assert ALL_HIERARCHICAL in retuned.baselines  # the way across hosts was a choice for every group
    # From a profile of one host, the overlap on hosts of 2 is unknown: top-k crosses flat, and retune says so.
    synthetic_profile("mlp", world_size=4).save(prof)
    assert main(["solve", str(prof), "--strategy", "topk", "--density", "0.01", "-o", str(plan)]) == 0
    proc = _cli("retune", str(plan), "--nproc", "4", "--hosts", "2", "-o", str(new))
    assert proc.returncode == 0, proc.stderr
    assert "note: top-k groups cross hosts flat" in proc.stderr and "hosts of 2 workers" in proc.stderr
    assert ALL_HIERARCHICAL not in Plan.load(new).baselines
    assert _ours() == []


@pytest.mark.parametrize("flat_scale", [1.0, 30.0])
def test_powersgd_groups_cross_hosts_by_both_allreduces_and_the_choice_is_exact(flat_scale: float) -> None:
    """A mixed problem of a two-host profile offers PowerSGD flat and hierarchical, both of its allreduces by the
    hierarchical curve; the solver's choice of way and grouping equals brute force, and where the flat allreduce
    costs 30 times more every group crosses hierarchically."""
    profile = _two_hosts()
    base = profile.curve(Collective.ALLREDUCE)
    scaled = fit_curve([(s, flat_scale * t) for s, t in base.points])
    profile = dataclasses.replace(profile, collectives={**profile.collectives, Collective.ALLREDUCE: scaled})
    compressors = parse_compressors("powersgd:1,powersgd:4")
    problem = mixed_problem(profile, compressors)
    assert [c.label for c in problem.compressors] == ["powersgd:1", "powersgd:1 hierarchical", "powersgd:4",
                                                      "powersgd:4 hierarchical"]
    hier = curve_model(profile.hosts.hierarchical)  # type: ignore[union-attr]
    for c in problem.compressors:
        assert (c.comm == hier and c.second_comm == hier) == c.hierarchical
    found = MixedParetoDP(time_limit_s=None).solve(problem)
    assert found.proven
    assert math.isclose(found.iteration_s, brute_force(problem), rel_tol=1e-9, abs_tol=1e-12)
    plan = make_mixed_plan(profile, compressors)
    assert Plan.from_dict(plan.to_dict()) == plan
    assert math.isclose(plan.predicted.iteration_s, found.iteration_s, rel_tol=1e-9)
    assert plan.predicted.iteration_s <= min(plan.baselines[ALL_FLAT].iteration_s,
                                             plan.baselines[ALL_HIERARCHICAL].iteration_s) * (1 + 1e-12)
    if flat_scale > 1:
        assert {g.hierarchical for g in plan.groups} == {True}


def test_a_mixed_plan_can_be_made_to_cross_hosts_one_way_and_refuses_that_on_one_host(tmp_path: Path) -> None:
    profile = _two_hosts()
    profile.save(tmp_path / "p.json")
    compressors = parse_compressors("dense,powersgd:4")
    best = make_mixed_plan(profile, compressors)
    for route, baseline in (("flat", ALL_FLAT), ("hierarchical", ALL_HIERARCHICAL)):
        assert main(["solve", str(tmp_path / "p.json"), "--strategy", "mixed", "--compressors", "dense,powersgd:4",
                     "--route", route, "-o", str(tmp_path / f"{route}.json")]) == 0
        plan = Plan.load(tmp_path / f"{route}.json")
        assert {g.hierarchical for g in plan.groups} == {route == "hierarchical"}
        assert math.isclose(plan.predicted.iteration_s, best.baselines[baseline].iteration_s, rel_tol=1e-9)
        assert best.predicted.iteration_s <= plan.predicted.iteration_s * (1 + 1e-12)
        for c in compressors:  # each compressor alone, the same way
            assert plan.baselines[f"only:{c}"].iteration_s >= plan.predicted.iteration_s * (1 - 1e-12)
    synthetic_profile("mlp").save(tmp_path / "one.json")
    assert main(["solve", str(tmp_path / "one.json"), "--strategy", "mixed", "--compressors", "dense,fp16",
                 "--route", "flat", "-o", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()


def test_the_bench_reports_the_union_training_sent_beside_the_one_the_profile_measured(
        capsys: pytest.CaptureFixture[str]) -> None:
    from types import SimpleNamespace

    from planner.commands.printing import print_bench, print_profile
    from planner.sessions.bench import BenchResult, measured_union

    groups = [SimpleNamespace(k=100), SimpleNamespace(k=None), SimpleNamespace(k=300)]
    fake = SimpleNamespace(plan=SimpleNamespace(groups=groups),
                           host_unions={0: [1.5] * 10 + [2.0] * 5, 2: [1.0] * 15})
    assert measured_union(fake, 5) == pytest.approx((100 * 2.0 + 300 * 1.0) / 400)  # the measured steps, by k
    assert measured_union(SimpleNamespace(plan=None, host_unions={}), 5) is None
    row = BenchResult(name="plan topk@0.01, hierarchical", strategy="topk", median_s=1.0, p25_s=1.0, p75_s=1.0,
                      steps=5, predicted_s=None, host_union=1.25)
    assert row.to_dict()["host_union"] == 1.25
    assert "host_union" not in dataclasses.replace(row, host_union=None).to_dict()
    print_bench([row], as_json=False)
    err = capsys.readouterr().err
    assert "plan topk@0.01, hierarchical sent 1.25 k pairs across per host" in " ".join(err.split())
    print_profile(_two_hosts((_topk_at(0.01, 1e-3, 1e-9, ratio=1.9),)), details=True)
    assert "gradient plus residual), 1.90 k at 0.01" in " ".join(capsys.readouterr().out.split())
