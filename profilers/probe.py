"""A quick probe of the network on the live process group: what `planner retune` re-measures.

A full `planner profile` sweeps every collective from 1 KiB to the whole gradient with many repetitions
(tens of seconds). When only the cluster changed (another world size, another network), the per-layer
compute in the stored profile still holds and only the collectives need measuring again: the probe
times allreduce, allgather and broadcast at a few sizes, a few times each, and fits alpha + beta * bytes
as the profile does. Beyond its largest size the affine fit (or proportional growth) extrapolates.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from planner.contracts.fingerprint import ClusterInfo
from planner.contracts.profile import FittedCurve, HostTiming, Profile
from planner.kernels.hierarchical import HostGroups
from planner.platform import launch  # its launchers called through it: tests replace them there
from planner.platform.hosts import count_hosts, host_names, ranks_by_host
from planner.platform.launch import device_for, resolve_backend
from planner.platform.link import HOSTS_ENV, LinkRate, current_link
from planner.platform.slowdown import current_slowdowns
from planner.profilers.comm import (
    host_topk_sizes,
    log_sizes,
    measure_collectives,
    measure_host_topk,
    measure_hosts,
    topk_budget,
)
from planner.types import Collective

__all__ = ["PROBE_COLLECTIVES", "Probed", "TopkOverlaps", "current_cluster", "device_name", "probe_hosts",
           "probe_network", "probe_worker", "run_probe"]

PROBE_COLLECTIVES = (Collective.ALLREDUCE, Collective.ALLGATHER, Collective.BROADCAST)


def probe_network(
    device: torch.device,
    *,
    process_group: Any = None,
    largest_bytes: int = 4 << 20,
    repeats: int = 5,
) -> dict[Collective, FittedCurve]:
    """Fitted cost of each collective on `process_group`, measured at sizes 1 KiB, 16 KiB, ... up to
    `largest_bytes` (factor 16). Every rank of the group must call it; every rank gets the same curves."""
    if largest_bytes < 1 << 10:
        raise ValueError(f"`largest_bytes >= 1024` must hold, but got largest_bytes={largest_bytes}")
    sizes = log_sizes(1 << 10, largest_bytes, factor=16)
    return measure_collectives(
        PROBE_COLLECTIVES, sizes, device, repeats=repeats, warmup=1, process_group=process_group
    )


@dataclass(frozen=True)
class TopkOverlaps:
    """What the probe needs to time the hierarchical top-k exchange again: how much a host's picks overlap at
    each density (a host's union over k, `HostTiming.union_ratios`), as measured on hosts of `per_host` ranks, and
    the model's gradient size (elements), the largest the exchange is timed at. The overlap belongs to the model
    and its data, so a probe reuses it; on hosts of another size it does not hold, and the probe leaves top-k out."""

    per_host: int
    ratios: dict[float, float]
    numel: int

    @classmethod
    def of(cls, profile: Profile) -> TopkOverlaps | None:
        """The overlaps `profile` measured (None: it measured none)."""
        hosts = profile.hosts
        if hosts is None or not hosts.topk:
            return None
        return cls(per_host=hosts.per_host, ratios=hosts.union_ratios(hosts.per_host), numel=profile.model.numel)


def probe_hosts(device: torch.device, *, largest_bytes: int = 4 << 20, repeats: int = 5,
                overlaps: TopkOverlaps | None = None) -> HostTiming | None:
    """The allreduce at each level of the hosts the default group's ranks run on (inside a host, across hosts,
    hierarchical; `planner.profilers.comm.measure_hosts`) at the probe's sizes; None on one host, or on hosts of unequal
    size (which no plan crosses hierarchically). With `overlaps` measured on hosts of this size, the hierarchical
    top-k exchange too, at each of its densities (`planner.profilers.comm.measure_host_topk`), at gradients of 1 Ki
    elements up to the model's (factor 16) that fit in memory. Every rank of the default group calls it."""
    layout = ranks_by_host(host_names())
    if len(layout) < 2 or len({len(h) for h in layout}) != 1:
        return None
    groups = HostGroups.build(layout)
    sizes = log_sizes(1 << 10, largest_bytes, factor=16)
    levels = measure_hosts(groups, sizes, device, repeats=repeats, warmup=1)
    if overlaps is None or overlaps.per_host != groups.local_size or not overlaps.ratios:
        return levels
    world = dist.get_world_size()
    numels = host_topk_sizes(log_sizes(1 << 10, max(overlaps.numel, 1 << 12), factor=16), world,
                             topk_budget(world, device))
    return replace(levels, topk=measure_host_topk(groups, numels, overlaps.ratios, device, repeats=repeats,
                                                  warmup=1))


def device_name(device: torch.device) -> str:
    """The name a profile records for `device` (the GPU's name, or the CPU and threads per worker)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads/worker)"


def current_cluster(device: torch.device, process_group: Any = None, *, hosts: int | None = None) -> ClusterInfo:
    """The cluster this process runs on: the group's world size and backend, the device, the host count
    (`hosts` when the caller counted them, `planner.platform.hosts.count_hosts`; else what the launcher
    says: torchrun's node count, or the emulated hosts of `--hosts`, or 1)."""
    if dist.is_available() and dist.is_initialized():
        world_size, backend = dist.get_world_size(process_group), str(dist.get_backend(process_group))
    else:
        world_size, backend = 1, "none"
    if hosts is None:
        hosts = int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get(HOSTS_ENV, "1")))
    return ClusterInfo(world_size=world_size, backend=backend, device=device_name(device), host_count=hosts,
                       link=current_link(), slowdown=current_slowdowns())


@dataclass(frozen=True)
class Probed:
    """What the probe measured: the cluster, its collectives and, across several hosts, each level's allreduce."""

    cluster: ClusterInfo
    collectives: dict[Collective, FittedCurve]
    hosts: HostTiming | None = None


def probe_worker(rank: int, world_size: int, largest_bytes: int,
                 overlaps: TopkOverlaps | None = None) -> Probed | None:
    """Body run on every rank of an initialised default group; rank 0 returns what was measured."""
    device = device_for(str(dist.get_backend()))
    curves = probe_network(device, largest_bytes=largest_bytes)
    levels = probe_hosts(device, largest_bytes=largest_bytes, overlaps=overlaps)
    hosts = count_hosts()
    return Probed(current_cluster(device, hosts=hosts), curves, levels) if rank == 0 else None


def run_probe(
    nproc: int, backend: str = "auto", largest_bytes: int = 4 << 20, link: LinkRate | None = None,
    hosts: int | None = None, overlaps: TopkOverlaps | None = None,
) -> Probed | None:
    """Probe the network under torchrun (this process is one rank; only rank 0 gets the result, the others
    None) or on `nproc` local workers started here (spread over `hosts` emulated hosts, behind an emulated
    `link` when given); with `overlaps`, the hierarchical top-k exchange too (`probe_hosts`)."""
    return launch.run_job(probe_worker, nproc, largest_bytes, overlaps, backend=resolve_backend(backend), timeout=600,
                          link=link, hosts=hosts)
