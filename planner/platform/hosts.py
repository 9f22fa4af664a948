"""Which host each rank of a process group runs on, read from the host names the ranks report.

Real hosts have their own names; the emulated hosts of `planner.platform.link` (`--hosts`) do too, each
worker in a UTS namespace named after its host. Every function here is a collective: every rank of the
group calls it.
"""

from __future__ import annotations

import socket
from typing import Any

import torch.distributed as dist

__all__ = ["count_hosts", "host_names", "ranks_by_host"]


def host_names(process_group: Any = None) -> list[str]:
    """Each rank's host name, by rank (this process's alone without an initialised group)."""
    mine = socket.gethostname()
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    names: list[object] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(names, mine, group=process_group)
    return [str(n) for n in names]


def ranks_by_host(names: list[str]) -> list[list[int]]:
    """The ranks on each host, hosts in the order of their lowest rank: ["a", "b", "a"] -> [[0, 2], [1]]."""
    hosts: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        hosts.setdefault(name, []).append(rank)
    return list(hosts.values())


def count_hosts(process_group: Any = None) -> int:
    """How many hosts the group's ranks run on."""
    return len(set(host_names(process_group)))
