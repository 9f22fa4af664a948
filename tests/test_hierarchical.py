"""Hierarchical allreduce (inside each host, across hosts, inside again) against the flat allreduce: the same sums
up to the order of the additions, on hosts given explicitly (subgroups of this one machine) and, where root
is available, on emulated hosts found by their host names."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.contracts.layers import gradient_layers
from planner.contracts.plan import Group, Plan
from planner.contracts.profile import FittedCurve, HostTiming, Profile
from planner.costmodel.costs import AffineCost, CheaperOf, CostModel
from planner.costmodel.curves import curve_model, fit_curve
from planner.costmodel.from_profile import hierarchical_groups
from planner.costmodel.problem import GradientProblem, topk_count
from planner.costmodel.simulator import simulate
from planner.kernels.hierarchical import HierarchicalWork, HostGroups, hierarchical_all_reduce, hierarchical_topk_sum
from planner.kernels.topk import decode, pack
from planner.platform.hosts import host_names, ranks_by_host
from planner.platform.launch import run_distributed
from planner.platform.link import parse_rate, privilege_problem
from planner.solvers import PerLayer, solve_exact
from planner.strategies.gradients import ALL_FLAT, ALL_HIERARCHICAL, make_plan
from planner.types import Collective, Compressor, CompressorKind, InvalidProfileError, SchemaError, Strategy
from tests.factories import examples, plan_with_groups, synthetic_profile
from tests.pool import run_warm
from tests.test_contracts import _main
from tests.test_solvers import all_groupings, problems

LAYOUTS = ([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0], [1], [2], [3]], [[0, 1, 2, 3]])
SIZES = (1, 7, 1000, 1 << 16)


def _compare(rank: int, world_size: int, layouts: list[list[list[int]]] | None) -> list[tuple[str, float]]:
    """Max |hierarchical - flat| / max |flat| per (layout, size), and the chained async version's."""
    if layouts is None:  # the hosts the ranks are on
        layouts = [ranks_by_host(host_names())]
    out = []
    for layout in layouts:
        groups = HostGroups.build(layout)
        for n in SIZES:
            gen = torch.Generator().manual_seed(100 * rank + n)
            x = torch.randn(n, generator=gen)
            flat = x.clone()
            dist.all_reduce(flat)
            mine = x.clone()
            hierarchical_all_reduce(mine, groups)
            out.append((f"{layout} n={n}", float((mine - flat).abs().max() / flat.abs().max())))
        # Two launched back to back run in order on their thread; wait() as a work handle.
        a, b = torch.full((1001,), float(rank)), torch.full((33,), float(rank + 1))
        first = HierarchicalWork(a, groups)
        second = HierarchicalWork(b, groups, after=first)
        assert second.wait(datetime.timedelta(seconds=60)) and first.wait()
        total = sum(range(world_size))
        out.append((f"{layout} async", float(max((a - total).abs().max(), (b - total - world_size).abs().max()))))
    return out


def test_hierarchical_equals_flat_on_hosts_given_explicitly() -> None:
    results = run_warm(_compare, 4, [list(map(list, layout)) for layout in LAYOUTS], timeout=120)
    for rank_results in results:
        for what, error in rank_results:
            assert error <= 1e-6, f"{what}: relative error {error:.2e}"
    assert len(results[0]) == len(LAYOUTS) * (len(SIZES) + 1)


def _found_by_name(rank: int, world_size: int) -> tuple[list[tuple[str, float]], list[float], list[tuple[str, bool]]]:
    """On emulated hosts, no hosts given: the collectives (`_compare`), the runtime's groups (`_runtime_worker`) and
    DDP's hook (tests/test_ddp_plan.py's `_hierarchical_worker`) each read the hosts from the ranks' host names.
    One launch for the three: emulated hosts cost seconds to make."""
    from tests.test_ddp_plan import _hierarchical_worker

    return _compare(rank, world_size, None), _runtime_worker(rank, world_size, False), _hierarchical_worker(
        rank, world_size, False)


@pytest.mark.spawns
@pytest.mark.skipif(privilege_problem() is not None, reason=f"no emulated hosts here: {privilege_problem()}")
def test_the_collectives_the_runtime_and_ddps_hook_find_two_emulated_hosts_by_name() -> None:
    results = run_distributed(_found_by_name, 4, hosts=2, link=parse_rate("1gbit"), timeout=240)
    collectives = [r[0] for r in results]
    assert collectives[0][0][0].startswith("[[0, 1], [2, 3]]")  # the hosts were read from the names
    assert all(error <= 1e-6 for rank_results in collectives for _, error in rank_results)
    assert max(max(r[1]) for r in results) <= 1e-3  # as with the hosts given (below)
    sent = results[0][2]  # DDP's hook equal to GradientExchange bit for bit (asserted in the worker)
    assert any(hierarchical for _, hierarchical in sent) and not all(hierarchical for _, hierarchical in sent)


def _bad_layouts(rank: int, world_size: int) -> list[str]:
    errors = []
    for layout in ([[0, 1], [2]], [[0, 1], [1, 2]], [[0, 1]]):
        try:
            HostGroups.build(layout)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_hosts_of_unequal_size_or_missing_ranks_are_refused() -> None:
    errors = run_warm(_bad_layouts, 3)[0]
    assert len(errors) == 3
    assert "hosts of equal size" in errors[0] and "every rank of the group of 3 once" in errors[1]


def _compare_topk(rank: int, world_size: int) -> list[tuple[str, float, int, int, int]]:
    """(case, max |hierarchical - flat| / max |flat|, U, the largest union, ranks per host) of top-k messages
    whose indices overlap fully, partly or not at all across ranks, on hosts given explicitly."""
    out = []
    numel = 1000
    for layout in ([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0], [1], [2], [3]], [[0, 1, 2, 3]]):
        groups = HostGroups.build(layout)
        for overlap, k in (("same", 50), ("partial", 50), ("disjoint", 50), ("partial", 1), ("disjoint", 250)):
            gen = torch.Generator().manual_seed(7 * rank + k)
            if overlap == "same":
                indices = torch.arange(0, 2 * k, 2, dtype=torch.int32)
            elif overlap == "disjoint":
                indices = torch.arange(rank * k, (rank + 1) * k, dtype=torch.int32)
            else:  # half shared by every rank, half the rank's own
                shared, own = torch.arange(k // 2), torch.arange(500 + rank * k, 500 + rank * k + k - k // 2)
                indices = torch.cat([shared, own]).to(torch.int32)
            send = pack(torch.randn(k, generator=gen), indices)
            gathered = send.new_empty(world_size * 2 * k)
            dist.all_gather_into_tensor(gathered, send)
            flat = decode(gathered, k, numel, world_size)
            everyone = gathered.view(world_size, 2 * k)[:, k:].contiguous().view(torch.int32)
            largest = max(torch.unique(everyone[host].reshape(-1)).numel() for host in layout)
            mine = torch.full((numel,), float("nan"))
            sent = hierarchical_topk_sum(send, k, mine, groups, world_size)
            error = float((mine - flat).abs().max() / flat.abs().max())
            out.append((f"{layout} {overlap} k={k}", error, sent, largest, len(layout[0])))
    return out


def test_hierarchical_topk_equals_the_flat_allgather_and_sends_each_hosts_union_once() -> None:
    """The same average as the flat exchange; each host sends its union of indices (padded to the largest
    union, rounded up to a multiple of the host size): k when its ranks pick the same entries, L k when
    they pick disjoint ones."""
    results = run_warm(_compare_topk, 4, timeout=120)
    for case, error, sent, largest, per_host in results[0]:
        assert error <= 1e-6, f"{case}: relative error {error:.2e}"
        assert sent == (0 if per_host == 4 else math.ceil(largest / per_host) * per_host), case
    by_case = {case: sent for case, _, sent, _, _ in results[0]}
    assert by_case["[[0, 1], [2, 3]] same k=50"] == 50 and by_case["[[0, 1], [2, 3]] disjoint k=50"] == 100
    assert all(r == results[0] for r in results)  # every rank reports the same


# -- the runtime ----------------------------------------------------------------------------------------------------

def _hierarchical_plan(model: torch.nn.Module, sent_as: list[str], hierarchical: list[bool]) -> Plan:
    """A mixed plan of one group per layer for 4 workers on 2 hosts, group i sent as sent_as[i % len] and
    hierarchically where hierarchical[i % len]."""
    layers = gradient_layers(model)[::-1]
    compressors = [Compressor.parse(sent_as[i % len(sent_as)]) for i in range(len(layers))]
    groups = tuple(Group(layers=(s.name,), params=s.params, numel=s.numel, compressor=c,
                         k=None if c.density is None else topk_count(s.numel, c.density),
                         hierarchical=hierarchical[i % len(hierarchical)])
                   for i, (s, c) in enumerate(zip(layers, compressors, strict=True)))
    return plan_with_groups(model, groups, Strategy.MIXED, world_size=4, host_count=2)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 5))


def _runtime_worker(rank: int, world_size: int, explicit: bool) -> list[float]:
    """Dense groups (half of them hierarchical) against DDP, and fp16, PowerSGD and top-k groups hierarchical
    against the same groups flat, over three steps of SGD: the largest relative gradient differences."""
    from torch.nn.parallel import DistributedDataParallel

    from planner.runtime import GradientExchange

    hosts = [[0, 1], [2, 3]] if explicit else None
    errors = []
    for sent_as, reference in ((["dense"], "ddp"), (["fp16"], "flat"), (["powersgd:2"], "flat"),
                               (["topk:0.3"], "flat")):
        ours, theirs = _mlp(), _mlp()
        exchange = GradientExchange(ours, _hierarchical_plan(ours, sent_as, [True, False]), hosts=hosts)
        if reference == "ddp":
            other: Any = DistributedDataParallel(theirs)
        else:
            other = GradientExchange(theirs, _hierarchical_plan(theirs, sent_as, [False]), hosts=hosts)
        assert [st.hierarchical for st in exchange._groups] == [True, False, True]
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
        for step in range(3):
            g = torch.Generator().manual_seed(100 * rank + step)
            x, y = torch.randn(8, 20, generator=g), torch.randn(8, 5, generator=g)
            for m, model in enumerate((ours, other if reference == "ddp" else theirs)):
                opts[m].zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
            exchange.synchronize()
            if reference == "flat":
                other.synchronize()
            for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None
                errors.append(float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)))
            for opt in opts:
                opt.step()
        # The host unions the top-k exchanges sent across, one per step, between k and two hosts' worth of picks.
        unions = exchange.host_unions
        if sent_as == ["topk:0.3"]:
            assert sorted(unions) == [0, 2] and all(len(u) == 3 for u in unions.values())
            for i, u in unions.items():
                k = exchange._groups[i].codec.k
                assert k is not None and all(1 <= r <= (2 * k + 2) / k for r in u), (i, u)
        else:
            assert unions == {}
        exchange.close()
        if reference == "flat":
            other.close()
    return errors


def test_hierarchical_groups_in_the_runtime_equal_ddp_and_their_flat_twins() -> None:
    """On hosts given to the runtime (four workers of this machine as two hosts)."""
    errors = run_warm(_runtime_worker, 4, True, timeout=120)
    assert max(max(e) for e in errors) <= 1e-3  # fp16's rounding differs with the order of its additions



def test_hierarchical_groups_need_a_multi_host_plan() -> None:
    model = _mlp()
    plan = _hierarchical_plan(model, ["dense", "fp16", "topk:0.1"], [True])
    assert Plan.from_dict(plan.to_dict()) == plan
    lowrank = _hierarchical_plan(model, ["powersgd:1"], [True])
    assert Plan.from_dict(lowrank.to_dict()) == lowrank
    one_host = plan.to_dict()
    one_host["cluster"]["host_count"] = 1
    with pytest.raises(SchemaError, match="is hierarchical, but the plan is for 1 host of 4 workers"):
        Plan.from_dict(one_host)
    flat = _hierarchical_plan(model, ["dense"], [False]).to_dict()
    assert all("hierarchical" not in g for g in flat["groups"])  # plans without it are written as before
    bad = plan.to_dict()
    bad["groups"][0]["hierarchical"] = "yes"
    with pytest.raises(SchemaError, match=r"groups\[0\].hierarchical must be bool"):
        Plan.from_dict(bad)


# -- the solver: flat or hierarchical per group ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class _Chosen(CostModel):
    """A brute-force choice: the second cost at the sizes listed, the first elsewhere."""

    first: CostModel
    second: CostModel
    sizes: frozenset[float]

    def cost(self, x: float) -> float:
        return (self.second if x in self.sizes else self.first).cost(x)


def _brute_force_routes(problem: GradientProblem, flat: CostModel, hierarchical: CostModel) -> float:
    """The least simulated step over every grouping and every flat/hierarchical choice per group."""
    best = math.inf
    for grouping in all_groupings(problem.num_layers):
        sizes = [float(problem.message_bytes(sum(problem.numel[a:b]))) for a, b in
                 zip((0, *grouping[:-1]), grouping, strict=True)]
        for choice in itertools.product((False, True), repeat=len(sizes)):
            chosen = {s for s, c in zip(sizes, choice, strict=True) if c}
            if any(s in chosen for s, c in zip(sizes, choice, strict=True) if not c):
                continue  # two groups of one size routed apart: not expressible by size (and never better)
            routed = dataclasses.replace(problem, comm=_Chosen(first=flat, second=hierarchical,
                                                               sizes=frozenset(chosen)))
            best = min(best, simulate(routed, grouping).iteration_s)
    return best


@settings(deadline=None, max_examples=examples(60))
@given(data=st.data())
def test_the_route_per_group_is_exact_against_brute_force_and_never_worse_than_all_flat_or_all_hierarchical(
    data: st.DataObject,
) -> None:
    """Groupings x flat-or-hierarchical per group, with interference and packing in half the instances."""
    problem = data.draw(problems(strategy=Strategy.DENSE, max_layers=7))
    flat = problem.comm
    hierarchical = AffineCost(alpha=data.draw(st.floats(0.0, 0.05)), beta=data.draw(st.floats(0.0, 2e-7)))
    best = dataclasses.replace(problem, comm=CheaperOf(first=flat, second=hierarchical))
    grouping = solve_exact(best)
    value = simulate(best, grouping).iteration_s
    assert math.isclose(value, _brute_force_routes(problem, flat, hierarchical), rel_tol=1e-9, abs_tol=1e-12)
    for only in (flat, hierarchical):
        alone = dataclasses.replace(problem, comm=only)
        assert value <= simulate(alone, solve_exact(alone)).iteration_s * (1 + 1e-9) + 1e-12
    routes = hierarchical_groups(best, grouping)
    assert len(routes) == len(grouping)


def _two_host_profile() -> Profile:
    """The synthetic MLP profile on 2 hosts of 2, where crossing hosts hierarchically costs more to start (three
    steps) and less per byte (fewer bytes over the slow hop) than one flat allreduce."""
    base = synthetic_profile("mlp", world_size=4)
    sizes = [1 << s for s in range(10, 27, 2)]

    def curve(alpha: float, beta: float) -> FittedCurve:
        return fit_curve([(s, alpha + beta * s) for s in sizes])

    flat = curve(2e-4, 4e-9)
    hosts = HostTiming(ranks=((0, 1), (2, 3)), intra=curve(5e-5, 2e-10), inter=curve(2e-4, 1.3e-9),
                       hierarchical=curve(2e-3, 2.7e-9))
    return dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, host_count=2), hosts=hosts,
                               collectives={**base.collectives, Collective.ALLREDUCE: flat})


def test_a_two_host_profile_plans_large_groups_hierarchically_and_small_ones_flat(tmp_path: Path) -> None:
    profile = _two_host_profile()
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile
    plan = make_plan(profile, Strategy.DENSE)
    assert Plan.from_dict(plan.to_dict()) == plan
    flat, hier = curve_model(profile.curve(Collective.ALLREDUCE)), curve_model(profile.hosts.hierarchical)  # type: ignore[union-attr]
    for g in plan.groups:  # each group the cheaper way for its size
        assert g.hierarchical == (hier.cost(4 * g.numel) < flat.cost(4 * g.numel)), g
    assert plan.baselines.keys() >= {ALL_FLAT, ALL_HIERARCHICAL}
    assert plan.predicted.iteration_s <= min(plan.baselines[ALL_FLAT].iteration_s,
                                             plan.baselines[ALL_HIERARCHICAL].iteration_s) * (1 + 1e-12)
    # Small groups go flat, large ones hierarchically: one group per layer shows both.
    per_layer = make_plan(profile, Strategy.DENSE, solver=PerLayer())
    assert {g.hierarchical for g in per_layer.groups} == {True, False}
    # The profile's hosts must be its cluster's.
    with pytest.raises(InvalidProfileError, match="lists 2 hosts of 2 ranks, but the cluster is 1 hosts"):
        dataclasses.replace(profile, cluster=dataclasses.replace(profile.cluster, host_count=1))
    doc = profile.to_dict()
    doc["hosts"]["ranks"] = [[0, 1], [2]]
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(InvalidProfileError, match="two or more hosts of equal size"):
        Profile.load(tmp_path / "bad.json")


def test_solve_routes_every_group_one_way_when_asked_and_refuses_it_without_hosts(tmp_path: Path) -> None:
    from planner.commands.cli import main

    _two_host_profile().save(tmp_path / "p.json")
    for route, expected in (("flat", {False}), ("hierarchical", {True})):
        assert main(["solve", str(tmp_path / "p.json"), "--strategy", "dense", "--route", route,
                     "-o", str(tmp_path / f"{route}.json")]) == 0
        assert {g.hierarchical for g in Plan.load(tmp_path / f"{route}.json").groups} == expected
    synthetic_profile("mlp").save(tmp_path / "one.json")
    proc = _main("solve", str(tmp_path / "one.json"), "--strategy", "dense", "--route", "hierarchical",
                 "-o", str(tmp_path / "x.json"))
    assert proc.returncode == 2 and "needs a profile of several hosts" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.json").exists()


def test_tune_runs_a_multi_host_profile_on_as_many_hosts_and_refuses_otherwise_in_one_line(tmp_path: Path) -> None:
    _two_host_profile().save(tmp_path / "p.json")
    for extra, message in (([], "measured on 2 host(s), but the tuning runs on 1: tune on as many, --hosts 2"),
                           (["--hosts", "3"], "--hosts 3 does not divide --nproc 4")):
        proc = _main("tune", str(tmp_path / "p.json"), *extra, "-o", str(tmp_path / "t.json"))
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "t.json").exists() and not (tmp_path / "t.db").exists()


def test_a_two_host_profile_gives_the_what_if_model_its_links_per_level(tmp_path: Path) -> None:
    """Inside a node from the allreduce inside a host, the network from the allreduce across hosts (ring model);
    the what-if table at 8, 64 and 512 workers on nodes of 8 then runs from it."""
    from planner.commands.cli import main
    from planner.strategies.cluster import parse_cluster, spec_from_profile

    profile = _two_host_profile()
    assert profile.hosts is not None and profile.hosts.intra is not None
    spec = spec_from_profile(profile, "p.json")
    intra, inter = profile.hosts.intra, profile.hosts.inter
    assert (spec.nodes, spec.gpus_per_node, spec.algorithm) == (2, 2, "ring")
    assert spec.intra_latency_us == pytest.approx(intra.alpha_s / 2 * 1e6)  # 2(G-1) latencies, G = 2
    assert spec.intra_gbps == pytest.approx(8 / (intra.beta_s_per_byte / 1.0) / 1e9)  # 2(G-1)/G = 1
    assert spec.inter_latency_us == pytest.approx(inter.alpha_s / 2 * 1e6)
    assert spec.inter_gbps == pytest.approx(8 / inter.beta_s_per_byte / 1e9)
    assert spec.inter_gbps < spec.intra_gbps and "per level" in spec.source
    one_level = spec_from_profile(dataclasses.replace(profile, hosts=None, cluster=profile.cluster))
    assert one_level.inter_gbps == one_level.intra_gbps  # one curve: one link for both
    profile.save(tmp_path / "p.json")
    eight = parse_cluster(f"profile={tmp_path / 'p.json'},gpus_per_node=8")
    assert eight.gpus_per_node == 8 and eight.inter_gbps == pytest.approx(spec.inter_gbps)
    assert main(["simulate", str(tmp_path / "p.json"), "--cluster", f"profile={tmp_path / 'p.json'},gpus_per_node=8",
                 "--world-sizes", "8,64,512", "--json"]) == 0


def test_the_bench_names_a_multi_host_plan_by_how_its_groups_cross_hosts() -> None:
    from planner.sessions.bench import bench_variants, plan_tag

    profile = _two_host_profile()
    best = make_plan(profile, Strategy.DENSE, solver=PerLayer())
    flat = make_plan(profile, Strategy.DENSE, route="flat")
    assert plan_tag(best) == f"dense, {sum(g.hierarchical for g in best.groups)} of {len(best.groups)} groups " \
                             "hierarchical"
    assert plan_tag(flat) == "dense, flat" and plan_tag(synthetic_profile_plan()) == "dense"
    names = [v.name for v in bench_variants((best, flat), _mlp_module(), peers=())]
    assert names.count("per-layer dense, flat") == 1  # one per-layer row per strategy
    assert "plan dense, flat" in names and f"plan {plan_tag(best)}" in names
    # A top-k plan (flat: the solver models top-k flat) also runs with its groups hierarchical, unpredicted.
    topk = make_plan(profile, Strategy.TOPK, 0.01)
    variants = {v.name: v for v in bench_variants((topk,), _mlp_module(), peers=())}
    twin = variants["plan topk@0.01, hierarchical (not modelled)"]
    assert "plan topk@0.01, flat" in variants and twin.predicted_s is None and twin.plan is not None
    assert all(g.hierarchical for g in twin.plan.groups) and twin.plan.groups != topk.groups
    # DDP's row is plain DDP: a top-k plan's DDP row is DDP with the top-k hook, and named so.
    assert variants["ddp"].predicted_s is None and topk.ddp_row == "ddp+topk:0.01"
    assert variants["ddp+topk:0.01"].predicted_s == topk.baselines["ddp+topk:0.01"].iteration_s
    both = {v.name: v for v in bench_variants((topk, flat), _mlp_module(), peers=())}
    assert both["ddp"].predicted_s == flat.baselines["ddp"].iteration_s


def synthetic_profile_plan() -> Plan:
    return make_plan(synthetic_profile("mlp"), Strategy.DENSE)


def _mlp_module() -> torch.nn.Module:
    from planner.models import build_workload

    return build_workload("mlp").module


def _shaped_worker(rank: int, world_size: int, sent_as: str) -> float:
    """A model shaped like real ones (tied weight, unused parameter, frozen layer, BatchNorm, a 1-D bias beside 4-D
    conv weights), every group hierarchical, against DDP over two steps: the largest relative gradient difference.
    Top-k at density 1 picks every entry, so its merged exchange must give DDP's average too; PowerSGD (lossy)
    is held against the same plan sent flat."""
    from torch.nn.parallel import DistributedDataParallel

    from planner.runtime import GradientExchange
    from tests.test_mixed_runtime import ShapedConv

    torch.manual_seed(0)
    ours = ShapedConv()
    theirs = copy.deepcopy(ours)
    exchange = GradientExchange(ours, _hierarchical_plan(ours, [sent_as], [True]), hosts=[[0, 1], [2, 3]],
                                find_unused_parameters=True)
    lossy = sent_as.startswith("powersgd")
    ddp: Any = (GradientExchange(theirs, _hierarchical_plan(theirs, [sent_as], [False]), hosts=[[0, 1], [2, 3]],
                                 find_unused_parameters=True) if lossy
                else DistributedDataParallel(theirs, find_unused_parameters=True))
    assert all(st.hierarchical and (st.codec.kind is CompressorKind.TOPK) == sent_as.startswith("topk")
               for st in exchange._groups)
    worst = 0.0
    for step in range(2):
        g = torch.Generator().manual_seed(10 * rank + step)
        x, y = torch.randn(4, 3, 6, 6, generator=g), torch.randn(4, 4, generator=g)
        for model in (ours, theirs if lossy else ddp):
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
        exchange.synchronize()
        if lossy:
            ddp.synchronize()
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None and q.grad is not None:
                worst = max(worst, float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)))
    if sent_as == "topk:1":  # every entry picked on every rank: a host's union is k (padded to a multiple of 2)
        for i, u in exchange.host_unions.items():
            k = exchange._groups[i].codec.k
            assert k is not None and list(u) == [2 * math.ceil(k / 2) / k] * 2, (i, u)
    exchange.close()
    if lossy:
        ddp.close()
    return worst


@pytest.mark.parametrize("sent_as", ["dense", "topk:1", "powersgd:2"])
def test_hierarchical_groups_on_a_model_shaped_like_real_ones_equal_ddp_or_their_flat_twin(sent_as: str) -> None:
    assert max(run_warm(_shaped_worker, 4, sent_as, timeout=120)) <= 1e-5
