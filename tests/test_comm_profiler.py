"""The collective profiler: its interleaved order of runs, and the curves it measures on live gloo groups."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st

from planner.kernels.hierarchical import HostGroups
from planner.profilers.comm import (
    FP16_SUM_REPEATS,
    collective_runs,
    fp16_sum_runs,
    host_runs,
    interleaved_visits,
    measure_collectives,
    measure_fp16_sum,
    measure_hosts,
)
from planner.types import Collective
from tests.pool import run_warm

SIZES = [1 << 10, 16 << 10, 256 << 10]


def test_interleaved_visits_warm_every_point_then_spread_the_timed_runs_over_rounds() -> None:
    # Point 0 has 4 timed runs, point 1 has 2: point 1 is timed in rounds 1 and 3, not twice in a row at the end.
    assert interleaved_visits([4, 2], warmup=1) == [
        (0, False), (1, False),
        (0, True), (0, True), (1, True), (0, True), (0, True), (1, True),
    ]
    assert interleaved_visits([], warmup=2) == []


@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.integers(0, 3))
def test_interleaved_visits_time_each_point_its_count_evenly_across_rounds(counts: list[int], warmup: int) -> None:
    order = interleaved_visits(counts, warmup)
    untimed = [i for i, timed in order if not timed]
    assert untimed == list(range(len(counts))) * warmup
    assert all(not timed for _, timed in order[:len(untimed)])  # every warm-up run comes first
    timed = [i for i, is_timed in order[len(untimed):]]
    for i, c in enumerate(counts):
        assert timed.count(i) == c
    # Cut the timed runs into rounds (a new round starts when a point comes again, or an earlier one):
    # after r rounds, point i has had floor(r * c_i / R) of its runs, R the largest count.
    rounds: list[list[int]] = [[]]
    for i in timed:
        if rounds[-1] and i <= rounds[-1][-1]:
            rounds.append([])
        rounds[-1].append(i)
    longest = max(counts)
    assert len(rounds) == longest  # the busiest point runs in every round
    done = [0] * len(counts)
    busiest = counts.index(longest)
    for r, visited in enumerate(rounds):
        for i in visited:
            done[i] += 1
        if busiest in visited:  # the busiest point runs in every round, so this round is round number r
            assert all(done[i] == (r + 1) * c // longest for i, c in enumerate(counts))


def _measure(rank: int, world_size: int, layout: list[list[int]] | None) -> dict[str, Any]:
    colls = [Collective.ALLREDUCE, Collective.ALLGATHER, Collective.BROADCAST]
    runs = [0]
    curves = measure_collectives(colls, SIZES, torch.device("cpu"), repeats=3, warmup=1,
                                 on_run=lambda: runs.__setitem__(0, runs[0] + 1))
    out: dict[str, Any] = {"runs": runs[0], "curves": {c.value: c_.points for c, c_ in curves.items()}}
    fp16_runs = [0]
    out["fp16_sum"] = measure_fp16_sum(SIZES, torch.device("cpu"), repeats=3, warmup=1,
                                       on_run=lambda: fp16_runs.__setitem__(0, fp16_runs[0] + 1)).points
    out["fp16_runs"] = fp16_runs[0]
    if layout is not None:
        host_calls = [0]
        timing = measure_hosts(HostGroups.build(layout), SIZES, torch.device("cpu"), repeats=3, warmup=1,
                               on_run=lambda: host_calls.__setitem__(0, host_calls[0] + 1))
        out["host_runs"] = host_calls[0]
        out["levels"] = {name: None if curve is None else curve.points
                         for name, curve in (("intra", timing.intra), ("inter", timing.inter),
                                             ("hierarchical", timing.hierarchical))}
    return out


def test_collectives_are_timed_at_every_size_the_same_on_every_rank() -> None:
    results = run_warm(_measure, 2, [[0], [1]], timeout=120)
    assert results[0] == results[1]  # each point is the slowest rank's median, so every rank holds the same
    first = results[0]
    assert first["runs"] == collective_runs(3, SIZES, repeats=3, warmup=1) == 3 * 3 * (1 + 3)
    for points in first["curves"].values():
        assert [b for b, _ in points] == SIZES
        assert all(t > 0 for _, t in points)
    # fp16's summing beyond an fp32 allreduce of the same bytes: every size, the two timed alike, none below 0.
    assert first["fp16_runs"] == fp16_sum_runs(SIZES, repeats=3, warmup=1) == 2 * 3 * (1 + FP16_SUM_REPEATS)
    assert [b for b, _ in first["fp16_sum"]] == SIZES and all(t >= 0 for _, t in first["fp16_sum"])
    # One rank per host: no level inside a host; across hosts and end to end at every size.
    assert first["host_runs"] == host_runs(SIZES, [[0], [1]], repeats=3, warmup=1) == 2 * 3 * 4
    assert first["levels"]["intra"] is None
    assert [b for b, _ in first["levels"]["inter"]] == SIZES == [b for b, _ in first["levels"]["hierarchical"]]


def test_every_host_level_is_timed_on_hosts_of_two() -> None:
    results = run_warm(_measure, 4, [[0, 1], [2, 3]], timeout=180)
    assert all(r["levels"] == results[0]["levels"] for r in results)
    levels = results[0]["levels"]
    assert results[0]["host_runs"] == host_runs(SIZES, [[0, 1], [2, 3]], repeats=3, warmup=1) == 3 * 3 * 4
    for name in ("intra", "inter", "hierarchical"):
        assert [b for b, _ in levels[name]] == SIZES
        assert all(t > 0 for _, t in levels[name])
