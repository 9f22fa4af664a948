"""Re-planning as training goes (`GradientExchange(adaptive=...)`): on a task whose gradients change from rank 1 to
full rank (and grow tenfold), a plan of PowerSGD rank 1 kept within its error budget stops fitting it, and every
rank takes the same new plan; no gradient is lost on the way (the error fed back is flushed), and a resumed run
continues with the plan in use."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from planner.contracts.errors import CompressionErrors
from planner.contracts.plan import Plan
from planner.contracts.profile import Profile
from planner.costmodel.curves import fit_curve
from planner.runtime import GradientExchange, Replanning
from planner.runtime.adaptive import allowed_compressors
from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors
from planner.types import Collective, Compressor, PlanMismatchError
from tests.factories import synthetic_plan, synthetic_profile
from tests.pool import run_warm

#: Steps of rank-1 gradients, then as many of full-rank ones ten times larger.
SWITCH = 4
STEPS = 12
SCHEDULE = Replanning(every=4, steps=2, warmup=1, time_limit_s=None)
BUDGET = 0.01
ALLOWED = "dense,fp16,powersgd:1"


class TwoMatrices(nn.Module):
    """Two layers whose loss is linear in their weights: the gradient of each is exactly the matrix given."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(48, 64, bias=False)
        self.b = nn.Linear(48, 64, bias=False)

    def forward(self, ga: torch.Tensor, gb: torch.Tensor) -> torch.Tensor:
        return (self.a.weight * ga).sum() + (self.b.weight * gb).sum()


def gradients(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's gradients of both layers at `step`: rank 1 before `SWITCH`, full rank and ten times larger after."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    if step < SWITCH:
        return tuple(torch.outer(torch.randn(64, generator=g), torch.randn(48, generator=g)) for _ in "ab")
    return tuple(10 * torch.randn(64, 48, generator=g) for _ in "ab")  # type: ignore[return-value]


def slow_profile_with_errors(world_size: int = 2, module: nn.Module | None = None, per_byte: float = 1e-7) -> Profile:
    """A synthetic profile of TwoMatrices (or `module`) behind a slow network (`per_byte` seconds a byte), whose errors
    say PowerSGD rank 1 is exact (as it is on rank-1 gradients) and fp16 nearly so."""
    base = synthetic_profile("two-matrices", world_size, module=module if module is not None else TwoMatrices())
    slow = fit_curve([(s, 2e-4 + per_byte * s) for s in (1 << e for e in range(10, 27, 2))])
    layers = tuple(lt.name for lt in base.layers)
    grad = np.ones((world_size, len(layers), 2))
    errors = CompressionErrors(layers=layers, warmup=1, grad_sq=grad, input_sq={"fp16": grad, "powersgd:1": grad},
                               error_sq={"fp16": grad * 4e-8, "powersgd:1": grad * 0.0})
    return replace(base, collectives={c: slow for c in Collective}, errors=errors)


def _worker(rank: int, world_size: int, profile_path: str, plan_json: str) -> dict[str, object]:
    plan = Plan.from_dict(json.loads(plan_json))
    model = TwoMatrices()
    initial = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    exchange = GradientExchange(model, plan, adaptive=SCHEDULE, profile=profile_path, optimizer=opt)
    for step in range(STEPS):
        opt.zero_grad()
        model(*gradients(rank, step)).backward()
        exchange.synchronize()
        opt.step()
    # Resuming: a fresh exchange of the plan first given takes the plan in use from the state.
    buf = io.BytesIO()
    torch.save(exchange.state_dict(), buf)
    buf.seek(0)
    other = TwoMatrices()
    resumed = GradientExchange(other, plan, adaptive=SCHEDULE, profile=profile_path)
    resumed.load_state_dict(torch.load(buf))
    exchange.close()
    resumed.close()
    return {
        "plan": json.dumps(exchange.plan.to_dict(), sort_keys=True),
        "resumed": json.dumps(resumed.plan.to_dict(), sort_keys=True),
        "replans": [(r.step, r.changed, r.reason, r.error_before, r.error_after, r.budget) for r in exchange.replans],
        "moved": [(p0 - p.detach()).numpy() for p0, p in zip(initial, model.parameters(), strict=True)],
        "names": [n for n, _ in model.named_parameters()],
    }


def test_an_adaptive_run_replans_when_the_gradients_change_and_every_rank_holds_the_same_plan(tmp_path: Path) -> None:
    profile = slow_profile_with_errors()
    path = tmp_path / "profile.json"
    profile.save(path)
    plan = make_mixed_plan(profile, parse_compressors(ALLOWED), source=str(path), error_budget=BUDGET,
                           time_limit_s=None)
    assert {str(plan.compressor_of(g)) for g in plan.groups} == {"powersgd:1"}, "the premise: rank 1 is fastest"
    first, second = run_warm(_worker, 2, str(path), json.dumps(plan.to_dict()))
    check_replanned_once(first, second, STEPS)


def check_replanned_once(first: dict[str, Any], second: dict[str, Any], steps: int) -> Plan:
    """Both ranks' results of a run of `steps` steps of `gradients`: the same plan on every rank (and after resuming),
    PowerSGD rank 1 kept while exact, replaced once it exceeds the budget, and no gradient lost. Returns the plan."""
    assert first["plan"] == second["plan"], "every rank holds the same plan"
    assert first["resumed"] == first["plan"] and second["resumed"] == second["plan"]
    assert first["replans"] == second["replans"]
    replans = first["replans"]
    assert [(step, changed) for step, changed, *_ in replans] == [(3, False), (7, True), (11, False)]
    _, _, reason, before, after, budget = replans[1]
    assert "exceeds the budget" in reason and before > BUDGET and budget == BUDGET and after <= BUDGET
    assert replans[0][3] < 1e-6, "PowerSGD rank 1 is exact on the rank-1 gradients"
    new = Plan.from_dict(json.loads(first["plan"]))
    assert "powersgd:1" not in {str(new.compressor_of(g)) for g in new.groups}
    assert new.error is not None and new.error.predicted <= BUDGET
    # No gradient lost: SGD at lr 1 on a loss linear in the weights moves them by the sum of the averaged gradients;
    # PowerSGD's error fed back was applied when the plan changed, and fp16 rounds what is left.
    for i, name in enumerate(first["names"]):
        total = sum(gradients(r, s)["ab".index(name[0])] for r in range(2) for s in range(steps)) / 2
        np.testing.assert_allclose(first["moved"][i], total.numpy(), rtol=0, atol=2e-3 * float(total.abs().max()))
        np.testing.assert_array_equal(first["moved"][i], second["moved"][i])
    return new


def test_adaptive_needs_a_mixed_plan_under_a_budget_and_a_sound_schedule() -> None:
    model = TwoMatrices()
    dense = synthetic_plan("mlp", world_size=1)
    from planner.models import build_workload

    with pytest.raises(ValueError, match="re-solves a mixed plan"):
        GradientExchange(build_workload("mlp").module, dense, adaptive=True)
    free = make_mixed_plan(slow_profile_with_errors(1), parse_compressors(ALLOWED), time_limit_s=None)
    with pytest.raises(ValueError, match="solved without one"):
        GradientExchange(model, free, adaptive=True)
    for bad in ({"every": 2, "steps": 2, "warmup": 1}, {"steps": 0}, {"gain": 0.5}, {"every": 4.0}):
        with pytest.raises(ValueError, match="Replanning"):
            Replanning(**bad)  # type: ignore[arg-type]
    schedule = Replanning(every=10, steps=3, warmup=2)
    assert [schedule.position(s) for s in (0, 4, 5, 9, 10, 15, 19)] == [None, None, 0, 4, None, 0, 4]


def one_worker_plans(tmp_path: Path) -> tuple[Plan, Plan, Plan, Path]:
    """For TwoMatrices on one worker: the budgeted PowerSGD plan, the same groups sent as fp16 (another plan an
    adaptive run may hold), and the same groups as a dense plan; and the profile's path."""
    from planner.contracts.plan import Group
    from tests.factories import plan_with_groups

    path = tmp_path / "profile.json"
    slow_profile_with_errors(1).save(path)
    plan = make_mixed_plan(Profile.load(path), parse_compressors(ALLOWED), source=str(path), error_budget=BUDGET,
                           time_limit_s=None)
    fp16 = replace(plan, groups=tuple(replace(g, compressor=Compressor.parse("fp16")) for g in plan.groups))
    dense = plan_with_groups(TwoMatrices(), tuple(Group(layers=g.layers, params=g.params, numel=g.numel)
                                                  for g in plan.groups), world_size=1)
    return plan, fp16, dense, path


def test_a_refused_state_leaves_an_adaptive_exchange_on_its_plan(tmp_path: Path) -> None:
    """The state's plan is taken only once the whole state is checked: a state whose plan differs and whose step
    count is bad is refused, and the exchange keeps its plan and its groups."""
    plan, fp16, _, path = one_worker_plans(tmp_path)
    exchange = GradientExchange(TwoMatrices(), plan, adaptive=SCHEDULE, profile=path)
    before = exchange.state_dict()
    saved = GradientExchange(TwoMatrices(), fp16, adaptive=SCHEDULE, profile=path).state_dict()
    with pytest.raises(PlanMismatchError, match="step count") as info:
        exchange.load_state_dict({**saved, "step": -1})
    assert "\n" not in str(info.value)
    assert exchange.plan.to_dict() == plan.to_dict() and exchange.state_dict()["layout"] == before["layout"]
    exchange.load_state_dict(saved)  # the whole state: taken
    assert exchange.plan.to_dict() == fp16.to_dict()


def test_an_adaptive_exchange_refuses_a_state_whose_plan_it_cannot_run_or_replan(tmp_path: Path) -> None:
    """A dense plan (the re-planner continues a mixed plan under an error budget only) and a plan for 2 workers on
    2 hosts (this exchange runs on 1), each in one line, the exchange left on its plan."""
    plan, fp16, dense, path = one_worker_plans(tmp_path)
    exchange = GradientExchange(TwoMatrices(), plan, adaptive=SCHEDULE, profile=path)
    two_hosts = replace(fp16, cluster=replace(fp16.cluster, world_size=2, host_count=2))
    cases = [
        ({**GradientExchange(TwoMatrices(), dense).state_dict(), "plan": dense.to_dict()},
         "holds a dense plan, but re-planning"),
        ({**GradientExchange(TwoMatrices(), fp16, adaptive=SCHEDULE, profile=path).state_dict(),
          "plan": two_hosts.to_dict()}, "made for world size 2 on 2 hosts .* runs on world size 1 on 1 host"),
        ({**exchange.state_dict(), "plan": [1]}, "plan must be a dict"),
    ]
    for state, words in cases:
        with pytest.raises(PlanMismatchError, match=words) as info:
            exchange.load_state_dict(state)
        assert "\n" not in str(info.value) and "start without one" in str(info.value)
        assert exchange.plan.to_dict() == plan.to_dict()


def test_a_replan_leaves_top_k_out_where_the_optimizer_applies_momentum() -> None:
    plan = make_mixed_plan(slow_profile_with_errors(), parse_compressors(ALLOWED), time_limit_s=None,
                           error_budget=BUDGET)
    assert allowed_compressors(plan) == parse_compressors(ALLOWED)
    topk = replace(plan, compressors=(*parse_compressors(ALLOWED), Compressor.parse("topk:0.1")))
    assert Compressor.parse("topk:0.1") not in allowed_compressors(topk, topk=False)


def _shaped_worker(rank: int, world_size: int, profile_path: str, plan_json: str) -> dict[str, object]:
    from tests.test_mixed_runtime import ShapedConv

    torch.manual_seed(0)
    model = ShapedConv()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    exchange = GradientExchange(model, Plan.from_dict(json.loads(plan_json)), adaptive=SCHEDULE, profile=profile_path,
                                optimizer=opt, find_unused_parameters=True)
    for step in range(8):
        g = torch.Generator().manual_seed(10 * rank + step)
        x, y = torch.randn(6, 3, 5, 5, generator=g), torch.randint(0, 4, (6,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        exchange.synchronize()
        opt.step()
    exchange.close()
    return {"plan": json.dumps(exchange.plan.to_dict(), sort_keys=True),
            "replans": [(r.step, r.changed, r.reason) for r in exchange.replans],
            "unused_grad": model.unused.weight.grad is None,
            "params": [p.detach().clone() for p in model.parameters()]}


def test_an_adaptive_run_on_a_model_shaped_like_real_ones(tmp_path: Path) -> None:
    """Tied weights, a frozen layer, BatchNorm, an unused parameter, modules registered out of order: the errors are
    measured on them, the plan the profile's errors chose (PowerSGD rank 1, said to be exact) is replaced once rank 1
    is measured on real gradients, and the ranks end with the same weights."""
    first, second, _, _ = run_shaped_replan(tmp_path, _shaped_worker)
    assert first["unused_grad"] and second["unused_grad"]


def run_shaped_replan(tmp_path: Path, worker: Any) -> tuple[dict[str, Any], dict[str, Any], Plan, Plan]:
    """Run `worker` on 2 ranks with the PowerSGD rank-1 plan the profile's errors chose for `ShapedConv`, and check
    that the first re-plan replaced it on every rank alike and that the ranks end with the same weights. Returns
    both ranks' results, the plan given and the plan in use."""
    from tests.test_mixed_runtime import ShapedConv

    profile = slow_profile_with_errors(module=ShapedConv(), per_byte=1e-5)
    path = tmp_path / "profile.json"
    profile.save(path)
    plan = make_mixed_plan(profile, parse_compressors(ALLOWED), source=str(path), error_budget=BUDGET,
                           time_limit_s=None)
    assert "powersgd:1" in {str(plan.compressor_of(g)) for g in plan.groups}, "the premise: rank 1 is chosen"
    first, second = run_warm(worker, 2, str(path), json.dumps(plan.to_dict()))
    assert first["plan"] == second["plan"] and first["replans"] == second["replans"]
    assert first["replans"][0][:2] == (3, True) and "exceeds the budget" in first["replans"][0][2]
    new = Plan.from_dict(json.loads(first["plan"]))
    assert "powersgd:1" not in {str(new.compressor_of(g)) for g in new.groups}
    for p, q in zip(first["params"], second["params"], strict=True):
        assert torch.equal(p, q), "every rank holds the same weights"
    return first, second, plan, new
