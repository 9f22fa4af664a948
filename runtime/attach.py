"""Attach a plan to the process group it runs on: use it, refuse it, or re-plan it (`auto_retune=True`).

A plan is made for one model, world size, backend and kind of device. Under elastic `torchrun` the world
size changes between restarts; a plan from another cluster may be handed to this one. With
`auto_retune=True` every rank probes the network of its process group (`planner.profilers.probe`), rank 0
re-solves from the plan's stored per-layer profile (`planner.strategies.retune_plan.retune_plan`) and broadcasts the
new plan as JSON (`planner.platform.launch.broadcast_json`: data, never a pickle), so every rank runs the same
plan. If rank 0 cannot re-plan (no profile, say), it broadcasts the reason and every rank raises the
same error instead of hanging.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.contracts.fingerprint import model_info
from planner.contracts.plan import Plan
from planner.contracts.profile import Profile
from planner.platform.hosts import count_hosts
from planner.platform.launch import broadcast_json
from planner.types import PlanMismatchError, PlannerError

__all__ = ["resolve_plan"]


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def resolve_plan(
    plan: Plan,
    model: nn.Module,
    *,
    process_group: Any = None,
    model_name: str | None = None,
    auto_retune: bool = False,
    profile: Profile | str | os.PathLike[str] | None = None,
    probe: bool = True,
    time_limit_s: float = 2.0,
    host_count: int | None = None,
) -> Plan:
    """`plan` if it was made for this model, world size, backend and kind of device; else a re-tuned plan
    (with `auto_retune`), identical on every rank of `process_group`.

    Args:
        plan: the plan given to the runtime.
        model: the module it will run on.
        process_group: the group the runtime communicates on (default: the default group).
        model_name: name used for the model in messages (default: its class name).
        auto_retune: re-plan when the plan does not fit; otherwise refuse.
        profile: the per-layer profile to re-plan from (a Profile or a path on rank 0); default the
            plan's source profile.
        probe: measure the group's network first (every rank takes part); without it the profile's
            network measurements are used as they are.
        time_limit_s: limit of the K-FAC placement solver.
        host_count: the hosts the group runs on, when the caller knows better than the ranks' host names.

    Raises:
        PlanMismatchError: the plan was made for another model (re-tuning cannot fix that), or for
            another cluster and `auto_retune` is False, or rank 0 could not re-plan.
    """
    # Every job resolves its plan; the profilers and strategies load only where it must be re-tuned or checked.
    from planner.profilers.probe import current_cluster  # deferred: importing the runtime loads no profilers

    info = model_info(model, model_name or type(model).__name__)
    inner = getattr(model, "module", None)
    if (info.fingerprint != plan.model.fingerprint and isinstance(inner, nn.Module)
            and model_info(inner, info.name).fingerprint == plan.model.fingerprint):
        raise PlanMismatchError(
            f"the model given wraps the planned one: its parameters are named module.* (as "
            f"{type(model).__name__} names them); pass the inner module (`model.module`), the runtime "
            "averages the gradients itself"
        )
    device = _device_of(model)
    cluster = current_cluster(device, process_group,
                              hosts=count_hosts(process_group) if host_count is None else host_count)
    distributed = dist.is_available() and dist.is_initialized()
    backend = cluster.backend if distributed else None
    try:
        plan.check_compatible(info, cluster.world_size, backend=backend, device_kind=cluster.device_kind,
                              hosts=cluster.host_count if distributed else None)
        return plan
    except PlanMismatchError:
        if not auto_retune or info.fingerprint != plan.model.fingerprint:
            raise
    if not distributed:
        return _retune(plan, profile, cluster, None, time_limit_s)

    from planner.profilers.probe import (  # deferred: importing the runtime loads no profilers
        TopkOverlaps,
        probe_hosts,
        probe_network,
    )
    from planner.strategies.retune_plan import (  # deferred: importing the runtime loads no strategies
        load_source_profile,
    )

    curves = probe_network(device, process_group=process_group) if probe else None
    # Each host level too, so groups may cross hosts hierarchically (measured on the default group only); the
    # top-k exchange merged inside hosts at the overlaps the source profile measured.
    levels = None
    if probe and process_group is None and host_count is None:
        with contextlib.suppress(PlannerError, OSError):  # rank 0 reports it below
            profile = load_source_profile(plan, profile)  # read once: rank 0 re-solves from it below
        levels = probe_hosts(device, overlaps=TopkOverlaps.of(profile) if isinstance(profile, Profile) else None)
    payload: dict[str, Any] = {}
    if dist.get_rank(process_group) == 0:
        try:
            payload = _retune(plan, profile, cluster, curves, time_limit_s, levels).to_dict()
        except PlannerError as exc:
            payload = {"error": f"rank 0 could not re-tune the plan: {exc}"}
    data = broadcast_json(payload, group=process_group, device=device if device.type == "cuda" else None)
    if not isinstance(data, dict) or "error" in data:
        raise PlanMismatchError(str(data.get("error") if isinstance(data, dict) else "no plan was broadcast"))
    return Plan.from_dict(data)


def _retune(plan: Plan, profile: Any, cluster: Any, curves: Any, time_limit_s: float, levels: Any = None) -> Plan:
    from planner.strategies.retune_plan import (  # deferred: importing the runtime loads no strategies
        load_source_profile,
        retune_plan,
    )

    stored = load_source_profile(plan, profile)
    return retune_plan(plan, stored, cluster=cluster, collectives=curves, hosts=levels, time_limit_s=time_limit_s)
