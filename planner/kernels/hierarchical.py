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

Top-k messages (`hierarchical_topk_sum`) cross the slow hop once per host, merged: each rank's k (value, index)
pairs are gathered inside the host, summed where indices coincide (the host's union, u <= L k pairs), and the
hosts exchange their unions, sharded over the L ranks of each host as the dense shards are, then gather the
shards inside the host and sum every pair into the dense average. A flat ring allgather carries (N - 1) k pairs
over the slow link into each host; the hierarchical one brings (H - 1) U pairs into each host, with U the
largest union (rounded up to a multiple of L): between (H - 1) k, when the workers of a host pick the same
entries, and (H - 1) L k, when they pick disjoint ones. The selected values are the ranks' own, as in the flat
exchange; the average is the same up to the order of the additions.

`HostGroups.build` makes the subgroups once (a collective: every rank of the group calls it, in the same order);
`hierarchical_all_reduce` runs the three steps, blocking; `HierarchicalWork` runs them (or the top-k exchange)
on a thread of its own so that the caller can go on computing (the runtime launches groups from backward
hooks), and is waited on as an async collective's work handle is. Tested on gloo (CPU); on NCCL the thread
issues the collectives on its device's default stream, which is not yet checked on a GPU.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["HierarchicalWork", "HostGroups", "hierarchical_all_reduce", "hierarchical_topk_sum"]

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


def hierarchical_topk_sum(send: Tensor, k: int, out: Tensor, groups: HostGroups, world_size: int) -> int:
    """Average every rank's top-k message into `out` as `planner.kernels.topk.decode` does after a flat allgather:
    gathered and merged inside each host, exchanged across hosts once per host (the module docstring).

    Args:
        send: this rank's message, k fp32 values then k int32 indices bit-cast to fp32 (`topk.pack`), 2k long.
        k: values per rank (the same on every rank).
        out: dense fp32 vector, overwritten with the sum of every rank's values at their indices / world_size.
        world_size: ranks in the parent group (the divisor of the average).

    Returns:
        U, the pairs each host sent across (its union padded to the largest union, a multiple of the host size);
        0 on one host.
    """
    if send.dim() != 1 or send.numel() != 2 * k or send.dtype != torch.float32:
        raise ValueError(f"hierarchical_topk_sum takes a packed fp32 message of 2k = {2 * k}, got {send.dtype} "
                         f"{tuple(send.shape)}")
    size = groups.local_size
    if groups.local is not None:
        host_msgs = send.new_empty(size * 2 * k)
        _all_gather_flat(host_msgs, send, group=groups.local)
    else:
        host_msgs = send
    msgs = host_msgs.view(size, 2 * k)
    values = msgs[:, :k].reshape(-1)
    indices = msgs[:, k:].contiguous().view(torch.int32).reshape(-1)
    # The host's union: every rank of the host computes the same one from the same gathered pairs.
    union, where = torch.unique(indices, return_inverse=True)
    sums = values.new_zeros(union.numel()).index_add_(0, where, values)
    out.zero_()
    if groups.cross is None:  # one host: nothing crosses
        out.index_add_(0, union.long(), sums, alpha=1.0 / world_size)
        return 0
    largest = torch.tensor([union.numel()], dtype=torch.int64, device=send.device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=groups.cross)
    shard = math.ceil(int(largest.item()) / size)
    padded = send.new_zeros(2 * shard * size)  # (value 0 at index 0) pairs pad each host to the largest union
    padded[: union.numel()] = sums
    padded[shard * size:].view(torch.int32)[: union.numel()] = union
    mine = padded.view(2, size, shard)[:, groups.local_rank].reshape(-1)  # this rank's shard: values, indices
    across = send.new_empty(groups.host_count * 2 * shard)
    _all_gather_flat(across, mine, group=groups.cross)
    if groups.local is not None:
        everything = send.new_empty(size * groups.host_count * 2 * shard)
        _all_gather_flat(everything, across, group=groups.local)
    else:
        everything = across
    pairs = everything.view(-1, 2 * shard)
    out.index_add_(0, pairs[:, shard:].contiguous().view(torch.int32).reshape(-1).long(), pairs[:, :shard].reshape(-1),
                   alpha=1.0 / world_size)
    return shard * size


class HierarchicalWork:
    """`hierarchical_all_reduce(flat, groups)` (or another exchange over the host groups, `run`) on a thread of
    its own; `wait()` as an async collective's handle.

    The three steps use three process groups and each must be issued in the same order on every rank, so
    each step waits for the one before it: on a thread, the caller is not held up. Groups started one after
    the other run one after the other (each waits for the previous one's thread before its first step), so
    every rank issues them in the same order.
    """

    def __init__(self, flat: Tensor, groups: HostGroups, after: HierarchicalWork | None = None, *,
                 run: Callable[[], object] | None = None) -> None:
        self._error: BaseException | None = None
        self._future: torch.futures.Future[Any] = torch.futures.Future()  # completed by the thread
        work = run if run is not None else lambda: hierarchical_all_reduce(flat, groups)
        self._thread = threading.Thread(target=self._run, args=(flat, work, after), daemon=True,
                                        name="planner-hierarchical-exchange")
        self._thread.start()

    def _run(self, flat: Tensor, work: Callable[[], object], after: HierarchicalWork | None) -> None:
        try:
            if flat.is_cuda:  # a new thread starts on device 0: the buffer's device, for NCCL's streams
                torch.cuda.set_device(flat.device)
            if after is not None:
                after._thread.join()
            work()
        except BaseException as exc:  # re-raised in wait(), on the caller's thread
            self._error = exc
            self._future.set_exception(exc)
            return
        self._future.set_result(None)

    def wait(self, timeout: Any = None) -> bool:
        """Block until done (a `timedelta` timeout: at most that long); re-raise what the steps raised."""
        self._thread.join(None if timeout is None else timeout.total_seconds())
        if self._thread.is_alive():
            raise RuntimeError("hierarchical allreduce did not finish within the timeout")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """A future completed when the steps are done (with what they raised, if anything), as a collective's."""
        return self._future

    def is_completed(self) -> bool:
        return not self._thread.is_alive()
