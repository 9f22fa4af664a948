"""The warm workers the tests share (`tests.pool.run_warm`) give what `run_distributed` gives: the results by rank,
a worker's exception with its traceback, a timeout; and each case starts from what a fresh worker has."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from planner.platform.launch import run_distributed
from planner.types import DistributedError
from tests.pool import run_warm


def _state(rank: int, world_size: int, mess: bool) -> tuple[int, float, int, int, str | None]:
    """What a case could see of an earlier one: torch's generator, subgroups, threads, the environment."""
    seen = (os.getpid(), torch.rand(1).item(), len(dist.distributed_c10d._world.pg_map), torch.get_num_threads(),
            os.environ.get("POOL_TEST_LEFT"))
    if mess:
        torch.rand(rank + 3)  # the ranks' generators move apart
        dist.new_group([0, 1])
        torch.set_num_threads(2)
        os.environ["POOL_TEST_LEFT"] = "yes"
    return seen


def _fails_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()  # rank 0 waits for a peer that will never come
    return rank


def _sleeps(rank: int, world_size: int) -> None:
    import time

    time.sleep(60)


def test_warm_workers_give_what_fresh_ones_give_and_each_case_starts_as_a_fresh_worker() -> None:
    fresh = run_distributed(_state, 2, False)
    first = run_warm(_state, 2, True)
    second = run_warm(_state, 2, False)
    assert [s[0] for s in first] == [s[0] for s in second]  # the same processes, warm
    for a, b, c in zip(fresh, first, second, strict=True):
        assert b[1] == c[1]  # torch's generator as the process started (a new process draws its own seed)
        assert a[2:] == b[2:] == c[2:]  # one group, one thread, no variable left


def test_a_failing_case_raises_its_error_and_the_next_case_gets_new_workers() -> None:
    before = [s[0] for s in run_warm(_state, 2, False)]
    with pytest.raises(ValueError, match="rank 1 refuses") as info:
        run_warm(_fails_on_rank_1, 2)
    assert "_fails_on_rank_1" in str(info.value.__cause__)  # the worker's traceback text
    after = run_warm(_state, 2, False)
    assert set(before).isdisjoint(s[0] for s in after)


def test_a_case_past_its_timeout_fails_in_one_line_and_the_workers_are_replaced() -> None:
    with pytest.raises(DistributedError, match=r"did not finish within 2 s"):
        run_warm(_sleeps, 2, timeout=2)
    assert len(run_warm(_state, 2, False)) == 2


def _patches_a_setting(rank: int, world_size: int, undo: bool) -> int:
    from planner.profilers import interference

    default, interference._MAX_CHAIN = interference._MAX_CHAIN, 1
    if undo:
        interference._MAX_CHAIN = default
    return interference._MAX_CHAIN


def _chain_cap(rank: int, world_size: int) -> int:
    from planner.profilers import interference

    return interference._MAX_CHAIN


def test_a_case_that_leaves_a_module_setting_patched_fails_naming_it_and_the_next_case_sees_the_default() -> None:
    """A warm worker outlives its case: a setting patched to force a refusal and left so broke a later test's
    profile ('could not keep allreduces in flight ... 1 of 1512 bytes'), far from the case that patched it."""
    from planner.profilers import interference

    run_warm(_chain_cap, 2)  # the module is loaded on the workers before the case patches it
    assert run_warm(_patches_a_setting, 2, True) == [interference._MAX_CHAIN] * 2
    with pytest.raises(DistributedError, match=r"planner\.profilers\.interference\._MAX_CHAIN \(2000 -> 1\)"):
        run_warm(_patches_a_setting, 2, False)
    assert run_warm(_chain_cap, 2) == [interference._MAX_CHAIN] * 2
