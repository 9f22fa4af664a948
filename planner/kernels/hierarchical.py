"""Hierarchical allreduce: inside each host first, then across hosts, as Horovod's
`HOROVOD_HIERARCHICAL_ALLREDUCE` and NCCL's trees do, built from `torch.distributed` subgroups.

On hosts of L workers joined by a network much slower than the links inside a host, a flat ring allreduce
of M bytes over N = H * L workers sends 2 (N - 1) / N * M out of each host over the slow hop (the ring
crosses each host boundary once). The hierarchical one sends 2 (H - 1) / H * M:

1. reduce-scatter inside the host: local rank i ends with the host's sum of shard i (M / L bytes);
2. allreduce of shard i across the hosts, among the ranks of local index i (one per host, L such
   groups in parallel, each M / L bytes);
3. allgather inside the host: every rank gets every shard.

At 2 hosts of 2 that is M instead of 1.5 M over the slow hop; in exchange it adds a reduce-scatter and an
allgather inside each host, at memory speed. The sums are the same as the flat allreduce's up to the order
of the additions (fp32 rounding), which the tests check against a flat allreduce.

`HostGroups.build` makes the subgroups once (a collective: every rank of the group calls it, in the same order);
`hierarchical_all_reduce` runs the three steps, blocking; `HierarchicalWork` runs them on a thread of their own
so that the caller can go on computing (the runtime launches groups from backward hooks), and is waited on as
an async collective's work handle is. Tested on gloo (CPU); on NCCL the thread issues the collectives on its
device's default stream, which is not yet checked on a GPU.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["HierarchicalWork", "HostGroups", "hierarchical_all_reduce"]

_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, eq=False)
class HostGroups:
    """The subgroups of a process group spread over hosts of equal size, seen from one rank.

    `hosts[h]` lists the ranks (of the parent group) on host h; `local` is the subgroup of this rank's host,
    `cross` that of the ranks with this rank's local index on every host. A one-rank subgroup is None (nothing
    to send: a step on it is skipped).
    """

    hosts: tuple[tuple[int, ...], ...]
    host: int
    local_rank: int
    local: Any
    cross: Any

    @property
    def host_count(self) -> int:
        return len(self.hosts)

    @property
    def local_size(self) -> int:
        return len(self.hosts[0])

    @classmethod
    def build(cls, hosts: Sequence[Sequence[int]], process_group: Any = None) -> HostGroups:
        """The subgroups for `hosts` (ranks of `process_group` per host, e.g. `ranks_by_host(host_names())`).
        Every rank of the job calls it with the same `hosts` (`dist.new_group` is collective over the default
        group, even for ranks outside `process_group`).

        Raises:
            ValueError: the hosts are not all the same size, or do not list every rank of the group once.
        """
        layout = tuple(tuple(int(r) for r in h) for h in hosts)
        world = dist.get_world_size(process_group)
        if sorted(r for h in layout for r in h) != list(range(world)):
            raise ValueError(f"the hosts must list every rank of the group of {world} once, got {layout}")
        if len({len(h) for h in layout}) != 1:
            raise ValueError(f"hierarchical collectives need hosts of equal size, got {[len(h) for h in layout]} "
                             "ranks per host")
        me = dist.get_rank(process_group)
        members = dist.get_process_group_ranks(process_group) if process_group is not None else list(range(world))
        host = next(h for h, ranks in enumerate(layout) if me in ranks)
        local_rank = layout[host].index(me)
        local = cross = None
        # Every rank creates every subgroup, in the same order (new_group is collective over the parent).
        for h, ranks in enumerate(layout):
            g = dist.new_group([members[r] for r in ranks]) if len(ranks) > 1 else None
            if h == host:
                local = g
        for i in range(len(layout[0])):
            peers = [h_ranks[i] for h_ranks in layout]
            g = dist.new_group([members[r] for r in peers]) if len(peers) > 1 else None
            if i == local_rank:
                cross = g
        return cls(hosts=layout, host=host, local_rank=local_rank, local=local, cross=cross)


def hierarchical_all_reduce(flat: Tensor, groups: HostGroups) -> None:
    """Sum `flat` (1-D, contiguous) over every rank of the parent group in place: reduce-scatter inside the
    host, allreduce of this rank's shard across hosts, allgather inside the host (the module docstring)."""
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"hierarchical_all_reduce takes a flat contiguous tensor, got shape {tuple(flat.shape)}")
    n, size = flat.numel(), groups.local_size
    if groups.local is None:  # one rank per host: the cross-host allreduce is all of it
        if groups.cross is not None:
            dist.all_reduce(flat, group=groups.cross)
        return
    shard = math.ceil(n / size)
    padded = flat if shard * size == n else torch.cat([flat, flat.new_zeros(shard * size - n)])
    mine = flat.new_empty(shard)
    _reduce_scatter_flat(mine, padded, group=groups.local)
    if groups.cross is not None:
        dist.all_reduce(mine, group=groups.cross)
    if padded is flat:
        _all_gather_flat(flat, mine, group=groups.local)
    else:
        _all_gather_flat(padded, mine, group=groups.local)
        flat.copy_(padded[:n])


class HierarchicalWork:
    """`hierarchical_all_reduce(flat, groups)` on a thread of its own; `wait()` as an async collective's handle.

    The three steps use three process groups and each must be issued in the same order on every rank, so
    each step waits for the one before it: on a thread, the caller is not held up. Groups started one after
    the other run one after the other (each waits for the previous one's thread before its first step), so
    every rank issues them in the same order.
    """

    def __init__(self, flat: Tensor, groups: HostGroups, after: HierarchicalWork | None = None) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(flat, groups, after), daemon=True,
                                        name="planner-hierarchical-allreduce")
        self._thread.start()

    def _run(self, flat: Tensor, groups: HostGroups, after: HierarchicalWork | None) -> None:
        try:
            if flat.is_cuda:  # a new thread starts on device 0: the buffer's device, for NCCL's streams
                torch.cuda.set_device(flat.device)
            if after is not None:
                after._thread.join()
            hierarchical_all_reduce(flat, groups)
        except BaseException as exc:  # re-raised in wait(), on the caller's thread
            self._error = exc

    def wait(self, timeout: Any = None) -> bool:
        """Block until done (a `timedelta` timeout: at most that long); re-raise what the steps raised."""
        self._thread.join(None if timeout is None else timeout.total_seconds())
        if self._thread.is_alive():
            raise RuntimeError("hierarchical allreduce did not finish within the timeout")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return not self._thread.is_alive()
