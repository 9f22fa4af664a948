"""Hierarchical allreduce (inside each host, across hosts, inside again) against the flat allreduce: the same sums
up to the order of the additions, on hosts given explicitly (subgroups of this one machine) and, where root
is available, on emulated hosts found by their host names."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist

from planner.contracts.layers import gradient_layers
from planner.contracts.plan import Group, Plan
from planner.costmodel.problem import topk_count
from planner.kernels.hierarchical import HierarchicalWork, HostGroups, hierarchical_all_reduce
from planner.platform.hosts import host_names, ranks_by_host
from planner.platform.launch import run_distributed
from planner.platform.link import parse_rate, privilege_problem
from planner.types import Compressor, SchemaError, Strategy
from tests.factories import plan_with_groups

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
    results = run_distributed(_compare, 4, [list(map(list, layout)) for layout in LAYOUTS], timeout=120)
    for rank_results in results:
        for what, error in rank_results:
            assert error <= 1e-6, f"{what}: relative error {error:.2e}"
    assert len(results[0]) == len(LAYOUTS) * (len(SIZES) + 1)


@pytest.mark.skipif(privilege_problem() is not None, reason=f"no emulated hosts here: {privilege_problem()}")
def test_hierarchical_equals_flat_on_two_emulated_hosts_found_by_name() -> None:
    results = run_distributed(_compare, 4, None, hosts=2, link=parse_rate("1gbit"), timeout=120)
    assert results[0][0][0].startswith("[[0, 1], [2, 3]]")  # the hosts were read from the names
    assert all(error <= 1e-6 for rank_results in results for _, error in rank_results)


def _bad_layouts(rank: int, world_size: int) -> list[str]:
    errors = []
    for layout in ([[0, 1], [2]], [[0, 1], [1, 2]], [[0, 1]]):
        try:
            HostGroups.build(layout)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_hosts_of_unequal_size_or_missing_ranks_are_refused() -> None:
    errors = run_distributed(_bad_layouts, 3)[0]
    assert len(errors) == 3
    assert "hosts of equal size" in errors[0] and "every rank of the group of 3 once" in errors[1]


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
    """Dense groups (half of them hierarchical) against DDP, and fp16 groups hierarchical against the same groups
    flat, over three steps of SGD: the largest relative gradient differences."""
    from torch.nn.parallel import DistributedDataParallel

    from runtime import GradientExchange

    hosts = [[0, 1], [2, 3]] if explicit else None
    errors = []
    for sent_as, reference in ((["dense"], "ddp"), (["fp16"], "flat")):
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
        exchange.close()
        if reference == "flat":
            other.close()
    return errors


def test_hierarchical_groups_in_the_runtime_equal_ddp_and_flat_fp16() -> None:
    """On hosts given to the runtime (four workers of this machine as two hosts)."""
    errors = run_distributed(_runtime_worker, 4, True, timeout=120)
    assert max(max(e) for e in errors) <= 1e-3  # fp16's rounding differs with the order of its additions


@pytest.mark.skipif(privilege_problem() is not None, reason=f"no emulated hosts here: {privilege_problem()}")
def test_hierarchical_groups_on_two_emulated_hosts_found_by_name() -> None:
    errors = run_distributed(_runtime_worker, 4, False, hosts=2, timeout=120)
    assert max(max(e) for e in errors) <= 1e-3


def test_hierarchical_groups_need_a_multi_host_plan_and_a_dense_or_fp16_group() -> None:
    model = _mlp()
    plan = _hierarchical_plan(model, ["dense", "fp16"], [True])
    assert Plan.from_dict(plan.to_dict()) == plan
    with pytest.raises(SchemaError, match=r"groups\[0\] is hierarchical but sent by topk"):
        _hierarchical_plan(model, ["topk:0.1"], [True])
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
