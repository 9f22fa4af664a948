"""The race in the first steps of training (`GradientExchange(race=...)`): the plan and its runners-up take turns on
the user's own steps on a schedule every rank draws alike, every rank commits to the same arm, no gradient is lost
on the way, and training after the commit is the training of an exchange started on the arm kept."""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

import numpy as np
import pytest
import torch

from planner.contracts.plan import Plan
from planner.runtime import GradientExchange, OnlineRace, Replanning
from planner.runtime.online_race import RaceSchedule
from planner.strategies.auto import solve_auto
from planner.strategies.mixed_plan import parse_compressors
from planner.types import PlanMismatchError
from tests.pool import run_warm
from tests.test_adaptive import TwoMatrices, gradients, slow_profile_with_errors


@pytest.fixture(scope="module")
def raced_plan() -> Plan:
    """Auto on a slow network: PowerSGD rank 1 kept; its runners-up the dense plan and PowerSGD on the next
    grouping."""
    plan = solve_auto(slow_profile_with_errors(), parse_compressors("dense,fp16,powersgd:1"), error_budget=None).plan
    assert list(plan.runners_up) == ["dense", "next grouping"]
    assert {str(plan.compressor_of(g)) for g in plan.groups} == {"powersgd:1"}
    return plan


# -- the schedule, on its own ---------------------------------------------------------------------------------------
def _drive(schedule: RaceSchedule, step_s: dict[str, float], most: int = 2000) -> list[str]:
    """Feed `schedule` steps of the given times (as every rank would, after the all-reduce) until it decides; the arm
    each step ran."""
    ran = []
    for _ in range(most):
        ran.append(schedule.current)
        if schedule.after_step(step_s[schedule.current]) and \
                schedule.observe(schedule.block_times(), seconds=0.0) is not None:
            return ran
    raise AssertionError("the race did not decide")


def test_a_clearly_faster_arm_wins_and_every_rank_runs_the_same_arms_in_the_same_order() -> None:
    config = OnlineRace(block=3, max_rounds=100)
    times = {"runner-up dense": 0.10, "plan": 0.07, "runner-up topk": 0.09}
    first, second = (RaceSchedule(list(times), config, start="plan") for _ in range(2))
    ran = _drive(first, times)
    assert _drive(second, times) == ran  # the same seed: every rank switches alike
    assert first.decision is not None and first.decision.kept == "plan" and first.decision.rule == "won"
    assert ran[:3] == ["plan"] * 3  # the warm-up round starts on the arm in use: one switch fewer
    rounds = first.decision.rounds + 1  # and the warm-up round, not observed
    assert first.steps == len(ran) and len(ran) <= rounds * len(times) * config.block
    assert first.result().ratios["runner-up dense"] == pytest.approx(0.10 / 0.07)


def test_the_budget_keeps_the_simplest_arm_and_a_blocks_first_step_is_not_timed() -> None:
    config = OnlineRace(block=2, max_rounds=3)
    schedule = RaceSchedule(["runner-up dense", "plan"], config, start="plan")
    # A switch's step (the first of each block) takes 10 s: were it timed, the arms' times would be its.
    for _ in range(2 * 2 * 4):
        first_of_block = schedule._in_block == 0
        if schedule.after_step(10.0 if first_of_block else 0.05):
            assert all(t == pytest.approx(0.05) for t in schedule.block_times())
            if schedule.observe(schedule.block_times(), seconds=0.0) is not None:
                break
    decision = schedule.decision
    assert decision is not None and decision.rule == "budget" and decision.kept == "runner-up dense"
    assert decision.rounds == 3  # observed rounds: the warm-up round is not among them


@pytest.fixture(scope="module")
def single_plan() -> Plan:
    """The same on one worker (an exchange without a process group)."""
    return solve_auto(slow_profile_with_errors(world_size=1), parse_compressors("dense,fp16,powersgd:1"),
                      error_budget=None).plan


def test_bad_races_are_refused(single_plan: Plan) -> None:
    model = TwoMatrices()
    with pytest.raises(ValueError, match="block must be an integer >= 2"):
        OnlineRace(block=1)
    with pytest.raises(ValueError, match="max_seconds"):
        OnlineRace(max_seconds=-1)
    with pytest.raises(ValueError, match="this plan has none: solve with `planner solve --strategy auto`"):
        GradientExchange(model, dataclasses.replace(single_plan, runners_up={}), race=True)
    with pytest.raises(ValueError, match="race must be True, False or an OnlineRace"):
        GradientExchange(model, single_plan, race="yes")
    with pytest.raises(ValueError, match="without adaptive re-planning"):
        GradientExchange(model, single_plan, race=True, adaptive=Replanning(every=4, steps=2, warmup=1))


# -- on two gloo workers --------------------------------------------------------------------------------------------
def _train(exchange: GradientExchange, model: TwoMatrices, opt: torch.optim.Optimizer, rank: int, steps: range
           ) -> None:
    for step in steps:
        opt.zero_grad()
        model(*gradients(rank, step)).backward()
        exchange.synchronize()
        opt.step()


def _racing_worker(rank: int, world_size: int, plan_json: str) -> dict[str, Any]:
    plan = Plan.from_dict(json.loads(plan_json))
    model = TwoMatrices()
    initial = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    exchange = GradientExchange(model, plan, optimizer=opt, race=OnlineRace(block=2, max_rounds=2))
    step, arms = 0, []
    while exchange.race is None:
        arms.append(exchange.plan.strategy.value)
        _train(exchange, model, opt, rank, range(step, step + 1))
        step += 1
    committed = step
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "exchange": exchange.state_dict()}, buf)
    _train(exchange, model, opt, rank, range(committed, committed + 4))
    # The same steps on an exchange started on the arm kept, from the state at the commit.
    buf.seek(0)
    saved = torch.load(buf)
    twin = TwoMatrices()
    twin.load_state_dict(saved["model"])
    twin_opt = torch.optim.SGD(twin.parameters(), lr=1.0)
    kept = GradientExchange(twin, exchange.plan, optimizer=twin_opt)
    kept.load_state_dict(saved["exchange"])
    _train(kept, twin, twin_opt, rank, range(committed, committed + 4))
    # Resumed with race=True, a state saved after the commit keeps the arm kept and races no more.
    resumed = GradientExchange(TwoMatrices(), plan, race=OnlineRace(block=2, max_rounds=2))
    resumed.load_state_dict(saved["exchange"])
    out = {"race": exchange.race.to_dict(), "committed": committed, "arms": arms,
           "plan": json.dumps(exchange.plan.to_dict(), sort_keys=True),
           "moved": [(p0 - p.detach()).numpy() for p0, p in zip(initial, model.parameters(), strict=True)],
           "after": [p.detach().numpy() for p in model.parameters()],
           "twin": [p.detach().numpy() for p in twin.parameters()],
           "resumed": (resumed.race.to_dict() if resumed.race else None, resumed._racing is None,
                       json.dumps(resumed.plan.to_dict(), sort_keys=True)),
           "names": [n for n, _ in model.named_parameters()]}
    for x in (exchange, kept, resumed):
        x.close()
    return out


def test_the_race_in_the_first_steps_commits_every_rank_alike_and_loses_no_step(raced_plan: Plan) -> None:
    """Two rounds (a budget of two, after the warm-up round) of blocks of two steps: the budget keeps the simplest
    arm not beaten, the dense runner-up. Every rank holds it; every step of the race trained (SGD at lr 1 on a loss
    linear in the weights moves them by the sum of the averaged gradients: PowerSGD's error fed back is flushed into
    the step it leaves); the four steps after the commit equal an exchange started on the dense plan from the state at
    the commit; a racing exchange resumed from that state keeps it and races no more."""
    first, second = run_warm(_racing_worker, 2, json.dumps(raced_plan.to_dict()))
    assert first["race"] == {**second["race"], "seconds": first["race"]["seconds"]}  # rank 0's clock, and rank 1's
    assert first["plan"] == second["plan"] and first["arms"] == second["arms"]
    race = first["race"]
    assert race["kept"] == "runner-up dense" and race["rule"] == "budget" and race["rounds"] == 2
    assert Plan.from_dict(json.loads(first["plan"])).strategy.value == "dense"
    assert first["committed"] == race["steps"] == 3 * 3 * 2  # three rounds (the warm-up one too) of three arms' blocks
    assert set(first["arms"]) == {"mixed", "dense"} and first["arms"][:2] == ["mixed", "mixed"]
    steps = first["committed"] + 4
    for i, name in enumerate(first["names"]):
        total = sum(gradients(r, s)["ab".index(name[0])] for r in range(2) for s in range(steps)) / 2
        np.testing.assert_allclose(first["moved"][i], total.numpy(), rtol=0, atol=1e-4 * float(total.abs().max()))
        np.testing.assert_allclose(first["after"][i], first["twin"][i], rtol=0, atol=1e-6)
    raced, stopped, plan = first["resumed"]
    assert raced == race and stopped and plan == first["plan"]


def test_a_state_of_an_arm_this_exchange_does_not_have_is_refused(single_plan: Plan) -> None:
    exchange = GradientExchange(TwoMatrices(), single_plan, race=True)
    state = exchange.state_dict()
    assert state["race_arm"] == "plan" and "race" not in state
    with pytest.raises(PlanMismatchError, match="race arm 'runner-up topk' is not among the arms here"):
        exchange.load_state_dict({**state, "race_arm": "runner-up topk"})
    exchange.close()


# -- inside DDP: the buckets are fixed, the arms are what each bucket sends ------------------------------------------
def _ddp_racing_worker(rank: int, world_size: int, plan_json: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from planner.runtime import PlanHook

    plan = Plan.from_dict(json.loads(plan_json))
    model = TwoMatrices()
    initial = [p.detach().clone() for p in model.parameters()]
    hook = PlanHook(model, plan, race=OnlineRace(block=2, max_rounds=2))
    ddp = DistributedDataParallel(model, **hook.ddp_kwargs())
    hook.register(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
    step, sent = 0, []
    while hook.race is None and step < 60:
        sent.append(sorted({str(hook.plan.compressor_of(g)) for g in hook.plan.groups}))
        opt.zero_grad()
        ddp(*gradients(rank, step)).backward()
        opt.step()
        step += 1
    for extra in range(step, step + 3):  # after the commit
        opt.zero_grad()
        ddp(*gradients(rank, extra)).backward()
        opt.step()
    state = hook.state_dict()
    resumed = PlanHook(TwoMatrices(), plan, race=OnlineRace(block=2, max_rounds=2))
    resumed.load_state_dict(state)
    out = {"race": None if hook.race is None else hook.race.to_dict(), "steps": step + 3, "sent": sent,
           "plan": json.dumps(hook.plan.to_dict(), sort_keys=True),
           "moved": [(p0 - p.detach()).numpy() for p0, p in zip(initial, model.parameters(), strict=True)],
           "names": [n for n, _ in model.named_parameters()],
           "resumed": (resumed.race.to_dict() if resumed.race else None,
                       json.dumps(resumed.plan.to_dict(), sort_keys=True))}
    del ddp
    return out


def test_the_race_inside_ddp_races_what_the_buckets_send_and_commits_every_rank_alike(raced_plan: Plan) -> None:
    """The PowerSGD plan inside DDP against its buckets each sent dense and each sent fp16: two rounds (after DDP's
    first iteration, its own layout, and the warm-up round) of blocks of two iterations; the budget keeps the simplest
    arm not beaten, every bucket dense. Every rank holds it, and every iteration trained (no gradient lost: the
    PowerSGD error fed back is flushed into the next average when the arm changes; fp16 rounds what it sends)."""
    plan = dataclasses.replace(raced_plan, runners_up={})
    first, second = run_warm(_ddp_racing_worker, 2, json.dumps(plan.to_dict()))
    race = first["race"]
    assert race is not None and race == {**second["race"], "seconds": race["seconds"]}
    assert race["kept"] == "every bucket dense" and race["rule"] == "budget" and race["rounds"] == 2
    assert first["plan"] == second["plan"] and first["sent"] == second["sent"]
    assert Plan.from_dict(json.loads(first["plan"])).strategy.value == "dense"
    assert {tuple(s) for s in first["sent"]} == {("powersgd:1",), ("dense",), ("fp16",)}
    for i, name in enumerate(first["names"]):
        total = sum(gradients(r, s)["ab".index(name[0])] for r in range(2) for s in range(first["steps"])) / 2
        np.testing.assert_allclose(first["moved"][i], total.numpy(), rtol=0, atol=2e-3 * float(total.abs().max()))
    raced, plan_json = first["resumed"]
    assert raced == race and plan_json == first["plan"]


def _shaped_racing_worker(rank: int, world_size: int, plan_json: str) -> dict[str, Any]:
    """The race in the first steps of `ShapedConv` (tied weights, a frozen layer, BatchNorm, an unused parameter,
    modules registered out of order) with momentum SGD; then 3 steps, and the same 3 steps on an exchange started on
    the arm kept from the state at the commit."""
    from torch import nn

    from tests.test_mixed_runtime import ShapedConv

    def train(exchange: GradientExchange, model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(10 * rank + step)
            x, y = torch.randn(6, 3, 5, 5, generator=g), torch.randint(0, 4, (6,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            exchange.synchronize()
            opt.step()

    def trainable(model: nn.Module) -> list[torch.nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    plan = Plan.from_dict(json.loads(plan_json))
    torch.manual_seed(0)
    model = ShapedConv()
    frozen = model.frozen.weight.detach().clone()
    opt = torch.optim.SGD(trainable(model), lr=0.1, momentum=0.9)
    exchange = GradientExchange(model, plan, optimizer=opt, find_unused_parameters=True,
                                race=OnlineRace(block=2, max_rounds=2))
    step = 0
    while exchange.race is None:
        train(exchange, model, opt, range(step, step + 1))
        step += 1
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "exchange": exchange.state_dict()}, buf)
    train(exchange, model, opt, range(step, step + 3))
    buf.seek(0)
    saved = torch.load(buf)
    twin = ShapedConv()
    twin.load_state_dict(saved["model"])
    twin_opt = torch.optim.SGD(trainable(twin), lr=0.1, momentum=0.9)
    twin_opt.load_state_dict(saved["opt"])
    kept = GradientExchange(twin, exchange.plan, optimizer=twin_opt, find_unused_parameters=True)
    kept.load_state_dict(saved["exchange"])
    train(kept, twin, twin_opt, range(step, step + 3))
    out = {"race": exchange.race.to_dict(), "plan": json.dumps(exchange.plan.to_dict(), sort_keys=True),
           "after": [p.detach().numpy() for p in model.parameters()],
           "twin": [p.detach().numpy() for p in twin.parameters()],
           "frozen_kept": torch.equal(model.frozen.weight, frozen), "unused_grad": model.unused.weight.grad is None,
           "tied": model.tail.weight is model.body.weight}
    for x in (exchange, kept):
        x.close()
    return out


def test_the_race_in_the_first_steps_on_a_model_shaped_like_real_ones() -> None:
    """On tied weights, a frozen layer, BatchNorm, an unused parameter and modules registered out of order, with
    momentum: every rank commits to the same arm and ends with the same weights, the frozen layer is untouched and the
    unused parameter gets no gradient, and the 3 steps after the commit equal an exchange started on the arm kept
    from the state at the commit (1e-6)."""
    from tests.test_mixed_runtime import ShapedConv

    plan = solve_auto(slow_profile_with_errors(module=ShapedConv(), per_byte=1e-5),
                      parse_compressors("dense,fp16,powersgd:1"), error_budget=None).plan
    assert plan.runners_up, "the premise: the plan has a runner-up to race"
    first, second = run_warm(_shaped_racing_worker, 2, json.dumps(plan.to_dict()))
    assert first["race"] == {**second["race"], "seconds": first["race"]["seconds"]} and first["plan"] == second["plan"]
    for a, b, twin in zip(first["after"], second["after"], first["twin"], strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, twin, rtol=0, atol=1e-6)
    assert first["frozen_kept"] and first["unused_grad"] and first["tied"]
