"""Hierarchical allreduce (inside each host, across hosts, inside again) against the flat allreduce: the same sums
up to the order of the additions, on hosts given explicitly (subgroups of this one machine) and, where root
is available, on emulated hosts found by their host names."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from planner.kernels.hierarchical import HierarchicalWork, HostGroups, hierarchical_all_reduce
from planner.platform.hosts import host_names, ranks_by_host
from planner.platform.launch import run_distributed
from planner.platform.link import parse_rate, privilege_problem

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
