"""Re-tuning: a plan made for 2 processes, run on 3 or 4 (refused, or re-planned with auto_retune=True)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from planner.contracts.fingerprint import ClusterInfo
from planner.contracts.plan import Plan
from planner.contracts.profile import HostTiming
from planner.costmodel.curves import fit_curve
from planner.models import build_workload
from planner.platform.launch import run_distributed
from planner.platform.link import privilege_problem
from planner.runtime.exchange import GradientExchange
from planner.runtime.preconditioner import KFACPreconditioner
from planner.strategies.gradients import ALL_HIERARCHICAL, make_plan
from planner.strategies.kfac_plan import make_kfac_plan
from planner.strategies.retune_plan import compare_plans, current_profile, load_source_profile, retune_plan
from planner.types import Collective, InvalidProfileError, PlanMismatchError, Strategy
from tests.factories import synthetic_profile
from tests.pool import run_warm

MODEL = "tests.test_end_to_end:tiny_kfac_workload"


def _saved_plan(tmp_path: Path, *, kfac: bool = False, world_size: int = 2) -> tuple[Plan, Path]:
    """A plan for MODEL on `world_size` processes, and the profile file it records as its source."""
    profile = synthetic_profile(MODEL, world_size)
    path = tmp_path / "profile.json"
    profile.save(path)
    if kfac:
        plan = make_kfac_plan(profile, inv_update_steps=2, source=str(path))
    else:
        plan = make_plan(profile, Strategy.DENSE, source=str(path))
    return plan, path


def _new_cluster(world_size: int) -> ClusterInfo:
    return ClusterInfo(world_size=world_size, backend="gloo", device="cpu (synthetic)")


# -- re-solving from the stored profile (no processes) --------------------------------------------

@pytest.mark.parametrize("kfac", [False, True])
def test_retune_keeps_the_kind_of_plan_and_targets_the_new_cluster(tmp_path: Path, kfac: bool) -> None:
    plan, path = _saved_plan(tmp_path, kfac=kfac)
    profile = load_source_profile(plan)
    slow = fit_curve([(s, 5e-3 + s * 1e-8) for s in (1 << 10, 1 << 16, 1 << 22)])
    new = retune_plan(plan, profile, cluster=_new_cluster(4), collectives={Collective.ALLREDUCE: slow})
    current = current_profile(profile, cluster=_new_cluster(4), collectives={Collective.ALLREDUCE: slow})
    assert new.cluster.world_size == 4 and new.strategy is plan.strategy
    assert new.source_profile == str(path)
    assert Plan.from_dict(new.to_dict()) == new
    changes = compare_plans(plan, new, current)
    assert changes.old_cluster.world_size == 2 and changes.new_cluster.world_size == 4
    # The new plan is optimal on the new cluster, so the old decisions cannot be predicted faster.
    assert changes.old_s is not None and changes.gain is not None and changes.gain >= 1 - 1e-12
    if kfac:
        assert new.kfac is not None and plan.kfac is not None
        assert (new.kfac.method, new.kfac.inv_update_steps) == (plan.kfac.method, plan.kfac.inv_update_steps)
        assert set(new.kfac.owners.values()) <= {None, 0, 1, 2, 3}
        assert changes.owners_changed is not None and changes.buffers_changed is not None
    else:
        # A 50x dearer start-up merges groups: the plan changed and says by how much it should gain.
        assert changes.groups_changed and len(new.groups) < len(plan.groups) and changes.gain > 1


def _levels(alpha_s: float, ranks: tuple[tuple[int, ...], ...] = ((0, 1), (2, 3))) -> HostTiming:
    """Host levels whose hierarchical allreduce costs `alpha_s` + 1 ns a byte (inside and across: a tenth)."""
    curve = fit_curve([(s, alpha_s + s * 1e-9) for s in (1 << 10, 1 << 16, 1 << 22)])
    part = fit_curve([(s, alpha_s / 10 + s * 1e-10) for s in (1 << 10, 1 << 16, 1 << 22)])
    return HostTiming(ranks=ranks, intra=part, inter=part, hierarchical=curve)


def test_host_levels_probed_on_the_new_cluster_decide_how_its_groups_cross_hosts(tmp_path: Path) -> None:
    plan, _ = _saved_plan(tmp_path)
    profile = load_source_profile(plan)
    two_hosts = ClusterInfo(world_size=4, backend="gloo", device="cpu (synthetic)", host_count=2)
    slow = fit_curve([(s, 5e-3 + s * 1e-8) for s in (1 << 10, 1 << 16, 1 << 22)])
    # Hierarchical cheaper than the flat allreduce at every size: every group crosses hosts hierarchically.
    cheap = retune_plan(plan, profile, cluster=two_hosts, collectives={Collective.ALLREDUCE: slow},
                        hosts=_levels(1e-4))
    assert cheap.cluster.host_count == 2 and cheap.groups and all(g.hierarchical for g in cheap.groups)
    # Dearer at every size: flat, as without host levels at all.
    dear = retune_plan(plan, profile, cluster=two_hosts, collectives={Collective.ALLREDUCE: slow},
                       hosts=_levels(1.0))
    none = retune_plan(plan, profile, cluster=two_hosts, collectives={Collective.ALLREDUCE: slow})
    assert not any(g.hierarchical for g in dear.groups) and not any(g.hierarchical for g in none.groups)
    assert current_profile(profile, cluster=two_hosts, hosts=_levels(1e-4)).hosts == _levels(1e-4)
    with pytest.raises(ValueError, match="measured on 3 hosts of 1, but the cluster is"):
        current_profile(profile, cluster=two_hosts, hosts=_levels(1e-4, ((0,), (1,), (2,))))


def test_old_kfac_owners_beyond_the_new_world_cannot_be_predicted(tmp_path: Path) -> None:
    plan, _ = _saved_plan(tmp_path, kfac=True, world_size=4)
    assert plan.kfac is not None
    if not any(o is not None and o >= 2 for o in plan.kfac.owners.values()):
        pytest.skip("the plan happens to use ranks 0 and 1 only")
    profile = load_source_profile(plan)
    new = retune_plan(plan, profile, cluster=_new_cluster(2))
    changes = compare_plans(plan, new, current_profile(profile, cluster=_new_cluster(2)))
    assert changes.old_s is None and changes.gain is None and "absent at world size 2" in changes.why_not


def test_the_source_profile_must_exist_and_be_of_the_plans_model(tmp_path: Path) -> None:
    plan, path = _saved_plan(tmp_path)
    path.unlink()
    with pytest.raises(InvalidProfileError, match="does not exist"):
        load_source_profile(plan)
    other = tmp_path / "other.json"
    synthetic_profile("mlp").save(other)
    with pytest.raises(InvalidProfileError, match="profile is of model mlp"):
        load_source_profile(plan, other)


# -- the runtime on 3 and 4 processes -------------------------------------------------------------

def _exchange_worker(rank: int, world_size: int, plan_doc: dict, profile: str, auto: bool) -> tuple[str, float]:
    torch.manual_seed(0)
    wl = build_workload(MODEL)
    model = wl.module
    exchange = GradientExchange(model, Plan.from_dict(plan_doc), auto_retune=auto, profile=profile)
    x, y = wl.make_batch(wl.batch_size, torch.Generator().manual_seed(rank))
    with exchange.no_sync():  # local gradients, averaged by hand: the reference
        wl.loss_fn(model(x), y).backward()
    local = torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]
    dist.all_reduce(local)
    reference = local / world_size
    model.zero_grad()
    wl.loss_fn(model(x), y).backward()
    exchange.synchronize()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]
    return json.dumps(exchange.plan.to_dict(), sort_keys=True), float((got - reference).abs().max())


def _refused(rank: int, world_size: int, plan_doc: dict, profile: str, auto: bool) -> str:
    """`_exchange_worker`'s refusal on this rank, caught here: a case that raises would take the warm workers with
    it (tests/pool.py), and new ones cost seconds to start."""
    try:
        _exchange_worker(rank, world_size, plan_doc, profile, auto)
    except PlanMismatchError as exc:
        return str(exc)
    raise AssertionError(f"rank {rank} ran the plan instead of refusing it")


def test_a_two_process_plan_is_refused_on_three_processes(tmp_path: Path) -> None:
    plan, path = _saved_plan(tmp_path)
    for said in run_warm(_refused, 3, plan.to_dict(), str(path), False):
        assert re.search(r"world size 2, but the process group has world size 3.*auto_retune", said), said


def test_auto_retune_on_three_processes_gives_every_rank_the_same_valid_plan(tmp_path: Path) -> None:
    plan, path = _saved_plan(tmp_path)
    results = run_warm(_exchange_worker, 3, plan.to_dict(), str(path), True)
    docs = {doc for doc, _ in results}
    assert len(docs) == 1, "ranks run different plans"
    new = Plan.from_dict(json.loads(docs.pop()))
    assert new.cluster.world_size == 3 and new.cluster.backend == "gloo"
    assert new.model == plan.model and new.strategy is Strategy.DENSE
    assert sorted(new.param_order) == sorted(plan.param_order)
    # The re-tuned exchange averages gradients over the 3 ranks.
    assert max(err for _, err in results) <= 1e-5


def test_auto_retune_without_the_profile_fails_on_every_rank_instead_of_hanging(tmp_path: Path) -> None:
    plan, path = _saved_plan(tmp_path)
    path.unlink()
    for said in run_warm(_refused, 3, plan.to_dict(), str(path), True, timeout=60):  # every rank, none left waiting
        assert re.search(r"rank 0 could not re-tune the plan: .*does not exist", said), said


@pytest.mark.spawns
@pytest.mark.skipif(privilege_problem() is not None, reason=f"no emulated hosts here: {privilege_problem()}")
def test_auto_retune_on_two_emulated_hosts_measures_each_level_and_exchanges_correctly(tmp_path: Path) -> None:
    plan, path = _saved_plan(tmp_path)
    results = run_distributed(_exchange_worker, 4, plan.to_dict(), str(path), True, hosts=2, timeout=180)
    docs = {doc for doc, _ in results}
    assert len(docs) == 1, "ranks run different plans"
    new = Plan.from_dict(json.loads(docs.pop()))
    assert (new.cluster.world_size, new.cluster.host_count) == (4, 2)
    assert ALL_HIERARCHICAL in new.baselines  # solved with the host levels the ranks probed
    assert max(err for _, err in results) < 1e-5


def _kfac_worker(rank: int, world_size: int, plan_doc: dict, profile: str) -> tuple[str, list[Any]]:
    torch.manual_seed(0)
    wl = build_workload(MODEL)
    model = wl.module
    precond = KFACPreconditioner(model, plan=Plan.from_dict(plan_doc), auto_retune=True, profile=profile)
    assert precond.plan is not None
    x, y = wl.make_batch(wl.batch_size, torch.Generator().manual_seed(rank))
    for _ in range(2):  # an inversion step: owners invert and broadcast
        model.zero_grad()
        wl.loss_fn(model(x), y).backward()
        precond.step()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]
    return json.dumps(precond.plan.to_dict(), sort_keys=True), grads.tolist()


def test_auto_retune_of_a_kfac_plan_on_four_processes(tmp_path: Path) -> None:
    plan, path = _saved_plan(tmp_path, kfac=True)
    results = run_warm(_kfac_worker, 4, plan.to_dict(), str(path), timeout=180)
    docs = {doc for doc, _ in results}
    assert len(docs) == 1, "ranks run different plans"
    new = Plan.from_dict(json.loads(docs.pop()))
    assert new.cluster.world_size == 4 and new.kfac is not None and plan.kfac is not None
    assert new.kfac.inv_update_steps == plan.kfac.inv_update_steps
    assert {o for o in new.kfac.owners.values() if o is not None} <= {0, 1, 2, 3}
    # Every rank ends with the same preconditioned gradient.
    first = torch.tensor(results[0][1])
    for _, grads in results[1:]:
        torch.testing.assert_close(torch.tensor(grads), first, rtol=1e-5, atol=1e-6)
