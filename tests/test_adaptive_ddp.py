"""Re-planning inside DDP (`PlanHook(adaptive=...)`): DDP's buckets are fixed, so a re-plan keeps the plan's groups
and chooses each one's compressor again. On the task of tests/test_adaptive.py (gradients rank 1, then full rank and
ten times larger) the PowerSGD rank-1 plan stops fitting its budget, every rank takes the same new plan with the same
groups, no gradient is lost (the error fed back is flushed into the next average), and a resumed hook continues with
the plan in use."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from planner.contracts.plan import Plan
from planner.runtime import PlanHook
from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors
from planner.types import PlanMismatchError
from tests.pool import run_warm
from tests.test_adaptive import (
    ALLOWED,
    BUDGET,
    SCHEDULE,
    TwoMatrices,
    check_replanned_once,
    gradients,
    one_worker_plans,
    run_shaped_replan,
    slow_profile_with_errors,
)

#: DDP's iteration 0 (its first bucket layout) is sent dense; the decision after the period that ends at iteration
#: `every - 1` is taken at the first bucket of the next one, so the last period's needs one iteration more.
ITERATIONS = 13


def _worker(rank: int, world_size: int, profile_path: str, plan_json: str) -> dict[str, object]:
    plan = Plan.from_dict(json.loads(plan_json))
    model = TwoMatrices()
    initial = [p.detach().clone() for p in model.parameters()]
    hook = PlanHook(model, plan, adaptive=SCHEDULE, profile=profile_path)
    ddp = DistributedDataParallel(model, **hook.ddp_kwargs())
    hook.register(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
    for step in range(ITERATIONS):
        opt.zero_grad()
        ddp(*gradients(rank, step)).backward()
        opt.step()
    buf = io.BytesIO()
    torch.save(hook.state_dict(), buf)
    buf.seek(0)
    resumed = PlanHook(TwoMatrices(), plan, adaptive=SCHEDULE, profile=profile_path)
    resumed.load_state_dict(torch.load(buf))
    moved = [(p0 - p.detach()).numpy() for p0, p in zip(initial, model.parameters(), strict=True)]
    del ddp
    return {
        "plan": json.dumps(hook.plan.to_dict(), sort_keys=True),
        "resumed": json.dumps(resumed.plan.to_dict(), sort_keys=True),
        "replans": [(r.step, r.changed, r.reason, r.error_before, r.error_after, r.budget) for r in hook.replans],
        "moved": moved,
        "names": [n for n, _ in model.named_parameters()],
    }


def test_a_plan_inside_ddp_replans_its_compressors_and_keeps_its_buckets(tmp_path: Path) -> None:
    profile = slow_profile_with_errors()
    path = tmp_path / "profile.json"
    profile.save(path)
    plan = make_mixed_plan(profile, parse_compressors(ALLOWED), source=str(path), error_budget=BUDGET,
                           time_limit_s=None)
    assert {str(plan.compressor_of(g)) for g in plan.groups} == {"powersgd:1"}, "the premise: rank 1 is fastest"
    first, second = run_warm(_worker, 2, str(path), json.dumps(plan.to_dict()))
    new = check_replanned_once(first, second, ITERATIONS)
    assert [g.params for g in new.groups] == [g.params for g in plan.groups], "DDP's buckets are kept"


def test_planhook_adaptive_needs_a_mixed_plan_under_a_budget() -> None:
    from planner.models import build_workload
    from tests.factories import synthetic_plan

    with pytest.raises(ValueError, match="re-solves a mixed plan"):
        PlanHook(build_workload("mlp").module, synthetic_plan("mlp", world_size=1), adaptive=True)
    free = make_mixed_plan(slow_profile_with_errors(1), parse_compressors(ALLOWED), time_limit_s=None)
    with pytest.raises(ValueError, match="solved without one"):
        PlanHook(TwoMatrices(), free, adaptive=True)


def test_a_hook_refuses_a_state_before_taking_its_plan(tmp_path: Path) -> None:
    """As the exchange (one checker): the state's plan is taken only once every bucket's entry is checked, and a plan
    the hook cannot run or re-plan (dense; 2 workers on 2 hosts in a world of 1) is refused in one line, the hook left
    on its plan."""
    plan, fp16, dense, path = one_worker_plans(tmp_path)
    hook = PlanHook(TwoMatrices(), plan, adaptive=SCHEDULE, profile=path)
    state = hook.state_dict()
    names = list(plan.groups[0].params)
    two_hosts = replace(fp16, cluster=replace(fp16.cluster, world_size=2, host_count=2))
    cases = [
        ({**state, "plan": fp16.to_dict(), "buckets": {0: {"params": names, "residual": []}}}, "must be a tensor"),
        ({**state, "plan": dense.to_dict()}, "holds a dense plan, but re-planning"),
        ({**state, "plan": two_hosts.to_dict()}, "made for world size 2 on 2 hosts"),
    ]
    for saved, words in cases:
        with pytest.raises(PlanMismatchError, match=words) as info:
            hook.load_state_dict(saved)
        assert "\n" not in str(info.value)
        assert hook.plan.to_dict() == plan.to_dict()
    hook.load_state_dict({**state, "plan": fp16.to_dict()})
    assert hook.plan.to_dict() == fp16.to_dict()


def _shaped_worker(rank: int, world_size: int, profile_path: str, plan_json: str) -> dict[str, object]:
    from torch import nn

    from tests.test_mixed_runtime import ShapedConv

    torch.manual_seed(0)
    model = ShapedConv()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    hook = PlanHook(model, Plan.from_dict(json.loads(plan_json)), adaptive=SCHEDULE, profile=profile_path,
                    momentum=0.9, optimizer=opt, find_unused_parameters=True)
    ddp = DistributedDataParallel(model, **hook.ddp_kwargs())
    hook.register(ddp)
    for step in range(9):
        g = torch.Generator().manual_seed(10 * rank + step)
        x, y = torch.randn(6, 3, 5, 5, generator=g), torch.randint(0, 4, (6,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    del ddp
    return {"plan": json.dumps(hook.plan.to_dict(), sort_keys=True),
            "replans": [(r.step, r.changed, r.reason) for r in hook.replans],
            "params": [p.detach().clone() for p in model.parameters()]}


def test_an_adaptive_plan_inside_ddp_on_a_model_shaped_like_real_ones(tmp_path: Path) -> None:
    """Tied weights, a frozen layer, BatchNorm, an unused parameter, modules registered out of order, DGC momentum in
    the hook: the PowerSGD rank-1 plan the profile's errors chose is replaced once rank 1 is measured on real
    gradients, its groups kept, and the ranks end with the same weights."""
    _, _, plan, new = run_shaped_replan(tmp_path, _shaped_worker)
    assert [g.params for g in new.groups] == [g.params for g in plan.groups]
