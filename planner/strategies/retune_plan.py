"""Re-tune a plan for the cluster it now runs on: new network measurements, the same per-layer profile.

A plan records the profile it was solved from. When the world size, backend, device or network changes,
the per-layer compute of that profile still holds; only the collectives need measuring again (a quick
probe, `planner.profilers.probe`). `retune_plan` re-solves the same kind of plan (dense, top-k at the same
density, or K-FAC with the same method and intervals) from the stored profile with the new collectives,
and `compare_plans` says what changed and what it is predicted to gain: the old plan's decisions
evaluated under the new conditions against the new plan's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from planner.contracts.fingerprint import ClusterInfo
from planner.contracts.kfac_section import KFACSection
from planner.contracts.layers import plan_grouping
from planner.contracts.plan import Plan
from planner.contracts.profile import FittedCurve, HostTiming, Profile
from planner.costmodel.from_profile import gradient_problem, mixed_problem
from planner.costmodel.mixed_simulator import simulate_mixed
from planner.costmodel.simulator import simulate
from planner.strategies.gradients import make_plan
from planner.strategies.kfac_plan import kfac_problem, make_kfac_plan, predict_kfac, section_layout
from planner.strategies.mixed_plan import make_mixed_plan
from planner.types import Collective, InvalidProfileError, PlanMismatchError, PlannerError, SolverError, Strategy

__all__ = ["PlanChanges", "compare_plans", "current_profile", "load_source_profile", "retune_plan"]


def load_source_profile(plan: Plan, profile: Profile | str | os.PathLike[str] | None = None) -> Profile:
    """The per-layer profile to re-solve from: `profile` (a Profile or a path), else the plan's source file.

    Raises:
        InvalidProfileError: no profile is given and the plan's source file is missing, or the profile
            is of another model than the plan.
    """
    if isinstance(profile, Profile):
        loaded = profile
    else:
        path = profile if profile is not None else plan.source_profile
        if not path or not os.path.exists(path):
            raise InvalidProfileError(
                f"re-tuning needs the plan's per-layer profile, but {str(path) or 'no source profile'!r} does not "
                "exist; pass the profile the plan was solved from (--profile PATH, or profile= in the runtime)"
            )
        loaded = Profile.load(path)
    if loaded.model.fingerprint != plan.model.fingerprint:
        raise InvalidProfileError(
            f"the profile is of model {loaded.model.describe()}, but the plan is for {plan.model.describe()}; "
            "pass the profile the plan was solved from"
        )
    return loaded


def retune_plan(
    plan: Plan,
    profile: Profile,
    *,
    cluster: ClusterInfo,
    collectives: dict[Collective, FittedCurve] | None = None,
    hosts: HostTiming | None = None,
    time_limit_s: float = 2.0,
) -> Plan:
    """The plan of the same kind as `plan`, solved from `profile` for `cluster` with `collectives`.

    Args:
        plan: the plan to re-tune (its strategy, density, top-k selector, error budget, K-FAC method and intervals
            are kept).
        profile: its per-layer profile (see `load_source_profile`).
        cluster: where the new plan will run.
        collectives: measured on that cluster (e.g. `planner.profilers.probe.probe_network`); those not given
            keep the profile's. Without any, the profile's own network is used as it is.
        hosts: each host level's allreduce measured on that cluster (`planner.profilers.probe.probe_hosts`), so dense
            groups may cross hosts hierarchically; see `current_profile`.
        time_limit_s: limit of the K-FAC placement solver.
    """
    current = current_profile(profile, cluster=cluster, collectives=collectives, hosts=hosts)
    if plan.strategy is Strategy.MIXED:
        allowed = plan.compressors or tuple(dict.fromkeys(plan.compressor_of(g) for g in plan.groups))
        budget = None  # the plan's error budget, as it was given (a compressor's error is measured again)
        if plan.error is not None and plan.error.budget is not None:
            budget = plan.error.budget_of if plan.error.budget_of is not None else plan.error.budget
        return make_mixed_plan(current, allowed, source=plan.source_profile, selector=plan.selector,
                               error_budget=budget)
    if plan.kfac is None:
        return make_plan(current, plan.strategy, plan.density, source=plan.source_profile, selector=plan.selector)
    solver = plan.kfac.placement_solver if plan.kfac.placement_solver in ("ilp-cbc", "cp-sat") else "cp-sat"
    return make_kfac_plan(
        current,
        method=plan.kfac.method,
        factor_update_steps=plan.kfac.factor_update_steps,
        inv_update_steps=plan.kfac.inv_update_steps,
        placement_solver=solver,
        time_limit_s=time_limit_s,
        source=plan.source_profile,
    )


def current_profile(
    profile: Profile,
    *,
    cluster: ClusterInfo,
    collectives: dict[Collective, FittedCurve] | None = None,
    hosts: HostTiming | None = None,
) -> Profile:
    """The stored per-layer profile with the cluster it now runs on and the collectives measured there: each
    host level's allreduce as measured there (`hosts`), else the profile's own if the hosts are the same, else
    none (every group then crosses hosts flat)."""
    if hosts is not None and (len(hosts.ranks), len(hosts.ranks) * hosts.per_host) != (cluster.host_count,
                                                                                       cluster.world_size):
        raise ValueError(f"the host levels were measured on {len(hosts.ranks)} hosts of {hosts.per_host}, but the "
                         f"cluster is {cluster.describe()}")
    same_hosts = (cluster.host_count, cluster.world_size) == (profile.cluster.host_count, profile.cluster.world_size)
    return replace(profile, collectives={**profile.collectives, **(collectives or {})}, cluster=cluster,
                   hosts=hosts if hosts is not None else profile.hosts if same_hosts else None)


@dataclass(frozen=True, kw_only=True)
class PlanChanges:
    """What re-tuning changed, and the predicted gain.

    Attributes:
        old_cluster, new_cluster: where the old plan was made for, and where the new one runs.
        old_groups, new_groups: gradient groups, each as its layers' names (ready order).
        old_s: the old plan's decisions predicted on the new cluster, or None when they cannot run there
            (K-FAC owners on ranks the new world does not have). For K-FAC: the average step with the old
            factor buffers and owners (gradient groups as the model's optimum on the new cluster).
        new_s: the new plan's prediction there.
        owners_changed: K-FAC factors whose inversion owner differs (None for gradient plans).
        buffers_changed: whether the K-FAC factor buffers differ (None for gradient plans).
        why_not: why `old_s` is None.
    """

    old_cluster: ClusterInfo
    new_cluster: ClusterInfo
    old_groups: tuple[tuple[str, ...], ...]
    new_groups: tuple[tuple[str, ...], ...]
    old_s: float | None
    new_s: float
    owners_changed: int | None = None
    buffers_changed: bool | None = None
    why_not: str = ""

    @property
    def groups_changed(self) -> bool:
        return self.old_groups != self.new_groups

    @property
    def gain(self) -> float | None:
        """Old predicted time over new: how much faster the new plan is predicted to be on the new cluster."""
        return None if self.old_s is None or self.new_s <= 0 else self.old_s / self.new_s


def _kfac_prediction(section: KFACSection, profile: Profile) -> tuple[float | None, str]:
    """The average step of `section`'s buffers and owners on `profile`'s cluster, or None and why not."""
    problem = kfac_problem(profile, section.method, whole_factors=section.factor_formats())
    world = profile.cluster.world_size
    ranks = [*section.owners.values(), *section.preconditioners.values()]
    foreign = sorted({o for o in ranks if o is not None and o >= world})
    if foreign:
        return None, (f"the old plan's inversion owners or preconditioners include rank(s) {foreign[:3]}, absent "
                      f"at world size {world}")

    def ends(buffers: tuple[tuple[str, ...], ...], order: tuple[str, ...]) -> tuple[int, ...]:
        if [n for b in buffers for n in b] != list(order):
            raise SolverError("the plan's factor buffers do not follow the profile's K-FAC layers")
        out, end = [], 0
        for b in buffers:
            end += len(b)
            out.append(end)
        return tuple(out)

    buffers = (ends(section.a_buffers, problem.fusion.a_names), ends(section.g_buffers, problem.fusion.g_names))
    if [lt.name for lt in section.layers] != [lt.name for lt in problem.layers]:
        raise SolverError("the plan's K-FAC layers do not follow the profile's")
    predicted = predict_kfac(problem, buffers, section_layout(section), factor_update_steps=section.factor_update_steps,
                             inv_update_steps=section.inv_update_steps)
    return predicted.step_s, ""


def _gradient_prediction(old: Plan, new: Plan, current: Profile) -> float:
    """The old gradient plan's groups (and compressors) predicted under the new plan's model on `current`."""
    grouping = plan_grouping(old, current)
    if new.strategy is Strategy.MIXED or any(g.hierarchical for g in (*old.groups, *new.groups)):
        allowed = new.compressors or tuple(dict.fromkeys(new.compressor_of(g) for g in new.groups))
        compressors = tuple(dict.fromkeys((*allowed, *(old.compressor_of(g) for g in old.groups))))
        mixed = mixed_problem(current, compressors, selector=new.selector or "exact")
        choice = [mixed.index_of(old.compressor_of(g), g.hierarchical) for g in old.groups]
        return simulate_mixed(mixed, grouping, choice).iteration_s
    problem = gradient_problem(current, new.strategy, new.density, selector=new.selector or "exact")
    return simulate(problem, grouping).iteration_s


def compare_plans(old: Plan, new: Plan, current: Profile) -> PlanChanges:
    """What changed from `old` to `new`, both predicted with `current`, the profile `new` was solved from
    (`current_profile`: the stored profile with the new cluster's collectives)."""
    old_groups = tuple(g.layers for g in old.groups)
    new_groups = tuple(g.layers for g in new.groups)
    if new.kfac is None:
        try:
            old_s: float | None = _gradient_prediction(old, new, current)
            why = ""
        except PlannerError as exc:
            old_s, why = None, str(exc)
        return PlanChanges(old_cluster=old.cluster, new_cluster=new.cluster, old_groups=old_groups,
                           new_groups=new_groups, old_s=old_s, new_s=new.predicted.iteration_s, why_not=why)
    assert new.kfac is not None and new.kfac.predicted is not None
    if old.kfac is None:
        raise PlanMismatchError("cannot compare a gradient plan with a K-FAC plan")
    try:
        old_s, why = _kfac_prediction(old.kfac, current)
    except PlannerError as exc:
        old_s, why = None, str(exc)
    return PlanChanges(
        old_cluster=old.cluster,
        new_cluster=new.cluster,
        old_groups=old_groups,
        new_groups=new_groups,
        old_s=old_s,
        new_s=new.kfac.predicted.step_s,
        owners_changed=sum(old.kfac.owners.get(n) != o for n, o in new.kfac.owners.items()),
        buffers_changed=(old.kfac.a_buffers, old.kfac.g_buffers) != (new.kfac.a_buffers, new.kfac.g_buffers),
        why_not=why,
    )
