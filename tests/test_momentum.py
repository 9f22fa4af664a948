"""Tests of DGC momentum correction in the gradient exchange: differential against torch momentum SGD.

Distributed tests fork 2 gloo processes (module-level workers); each runs all its configurations in
one `run_distributed` call. Settings that need no peer (refusals, clipping, state) run on world size 1.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import planner.runtime.codecs as codecs_module
from planner.costmodel.problem import topk_count
from planner.runtime import GradientExchange
from planner.runtime.codecs import TopkCodec
from planner.types import PlanMismatchError, Strategy
from tests.digits import digits
from tests.pool import run_warm
from tests.test_runtime import make_plan

WORLD_SIZE = 2
RTOL, ATOL = 1e-5, 1e-6
MOMENTUM = 0.9


# -- models and plans ----------------------------------------------------------------------------


def tiny_mlp() -> nn.Sequential:
    """Same weights on every rank (fixed seed)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def make_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Different data on every rank and step."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def one_line(info: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(info.value)
    assert "\n" not in message, f"the error should be one line: {message!r}"
    return message


# -- distributed workers -------------------------------------------------------------------------


def _equals_momentum_sgd_worker(rank: int, world_size: int) -> int:
    """Top-k at density 1.0 and dense plans with momentum give DDP + torch momentum SGD's weights."""
    compared = 0
    configs = [
        (strategy, density, grouping, nesterov)
        for strategy, density in ((Strategy.TOPK, 1.0), (Strategy.DENSE, None))
        for grouping in ("per-layer", "single")
        for nesterov in (False, True)
    ]
    for strategy, density, grouping, nesterov in configs:
        what = f"{strategy.value} {grouping} nesterov={nesterov}"
        model = tiny_mlp()
        ref = DistributedDataParallel(copy.deepcopy(model))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=MOMENTUM, nesterov=nesterov)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        exchange = GradientExchange(model, make_plan(model, grouping, strategy, density), momentum=MOMENTUM,
                                    nesterov=nesterov, optimizer=opt)
        for step in range(6):
            x, y = make_batch(rank, step)
            for m, o in ((ref, ref_opt), (model, opt)):
                o.zero_grad(set_to_none=step % 2 == 0)
                nn.functional.mse_loss(m(x), y).backward()
            exchange.synchronize()
            ref_opt.step()
            opt.step()
            got, want = flat_params(model), flat_params(ref.module)
            assert torch.allclose(got, want, rtol=RTOL, atol=ATOL), (
                f"{what} step {step}: weights differ by {(got - want).abs().max().item():.3g}"
            )
            compared += 1
        exchange.close()
    return compared


def _warmup_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Record the k every select_topk call sends under a density warm-up; check the averaged gradients."""
    sent: list[int] = []
    select = codecs_module.select_topk

    def recording(grad: torch.Tensor, residual: torch.Tensor | None, k: int, **kwargs: Any) -> Any:
        sent.append(k)
        return select(grad, residual, k, **kwargs)

    codecs_module.select_topk = recording  # in this spawned process only
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    plan = make_plan(model, "per-layer", Strategy.TOPK, 0.05)
    exchange = GradientExchange(model, plan, momentum=MOMENTUM, optimizer=opt, density_warmup=(0.5, 4))
    densities, nonzero = [], []
    for step in range(6):
        densities.append(exchange.current_density)
        x, y = make_batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        exchange.synchronize()
        nonzero.append([int(torch.count_nonzero(p.grad)) for p in model.parameters() if p.grad is not None])
        mine = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        theirs = mine.clone()
        dist.broadcast(theirs, src=0)
        assert torch.equal(mine, theirs), f"step {step}: ranks hold different averaged gradients"
        opt.step()
    buffers = [(st.codec.k, st.codec.send.numel()) if isinstance(st.codec, TopkCodec) else (None, None)
               for st in exchange._groups]
    return {"sent": sent, "densities": densities, "nonzero": nonzero, "step": exchange.step, "buffers": buffers,
            "numels": [g.numel for g in plan.groups], "ks": [g.k for g in plan.groups]}


def _train_digits(rank: int, world_size: int, correction: bool, seed: int, steps: int) -> float:
    """A 64-128-10 MLP on digits: dense momentum SGD, or top-k 1% with momentum correction.

    Global batch 256 (each rank its half), lr 0.3 decayed linearly to 0, an L2 penalty of 1e-3 in the
    loss (so the loss levels off and "within 5%" compares converged runs); returns the full-data loss.
    """
    x, y = digits()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    lr = 0.3
    if correction:
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        plan = make_plan(model, "per-layer", Strategy.TOPK, 0.01)
        assert all(g.k is not None and 1 <= g.k < g.numel for g in plan.groups)
        exchange = GradientExchange(model, plan, momentum=MOMENTUM, optimizer=opt)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
        exchange = GradientExchange(model, make_plan(model, "per-layer"))
    batches = torch.Generator().manual_seed(seed)
    per_rank = 256 // world_size
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * (1 - step / steps)
        mine = torch.randint(0, len(x), (256,), generator=batches)[rank * per_rank : (rank + 1) * per_rank]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[mine]), y[mine])
        (loss + 0.5e-3 * sum(p.pow(2).sum() for p in model.parameters())).backward()
        exchange.synchronize()
        opt.step()
    exchange.close()
    with torch.no_grad():
        return nn.functional.cross_entropy(model(x), y).item()


def _digits_worker(rank: int, world_size: int, seeds: list[int], steps: int) -> dict[int, dict[str, float]]:
    return {
        seed: {"dense": _train_digits(rank, world_size, False, seed, steps),
               "topk": _train_digits(rank, world_size, True, seed, steps)}
        for seed in seeds
    }  # fmt: skip


# -- distributed tests ---------------------------------------------------------------------------


def test_momentum_correction_equals_momentum_sgd() -> None:
    """Top-k at density 1.0 (k == numel: no masking) and dense plans equal momentum SGD, with Nesterov too."""
    assert run_warm(_equals_momentum_sgd_worker, WORLD_SIZE) == [8 * 6] * WORLD_SIZE


def test_density_warmup_follows_the_schedule() -> None:
    r0, r1 = run_warm(_warmup_worker, WORLD_SIZE)
    assert r0 == r1
    start, target, steps = 0.5, 0.05, 4
    expected_density = [start * (target / start) ** (t / steps) for t in range(steps)] + [target, target]
    assert r0["densities"] == pytest.approx(expected_density)
    expected_k = [
        [max(k, topk_count(n, d)) for n, k in zip(r0["numels"], r0["ks"], strict=True)] for d in expected_density
    ]
    assert r0["sent"] == [k for ks in expected_k for k in ks]  # the plan's group order, every step
    assert r0["sent"][: len(r0["ks"])] != r0["ks"]  # the warm-up sent more at first, else this proves nothing
    for step, (ks, nonzero) in enumerate(zip(expected_k, r0["nonzero"], strict=True)):
        per_group = [nonzero[2 * i] + nonzero[2 * i + 1] for i in range(len(ks))][::-1]  # weight + bias, ready order
        assert all(nz <= WORLD_SIZE * k for k, nz in zip(ks, per_group, strict=True)), (step, ks, per_group)
    assert r0["step"] == 6
    assert all(size == 2 * k for k, size in r0["buffers"]), "buffers shrink to the plan's k after the warm-up"


def test_topk_with_momentum_correction_trains_digits_like_dense() -> None:
    """Top-k 1% with momentum 0.9 (correction and masking) ends within 5% of dense momentum SGD, 3 seeds."""
    pytest.importorskip("sklearn.datasets")
    results = run_warm(_digits_worker, WORLD_SIZE, [0, 1, 2], 500, timeout=300)
    assert results[0] == results[1]
    for seed, r in results[0].items():
        assert r["dense"] < 0.05, f"seed {seed}: dense momentum SGD should learn digits (2.3 at first): {r}"
        assert r["topk"] <= 1.05 * r["dense"], f"seed {seed}: top-k {r['topk']:.4g} vs dense {r['dense']:.4g}"


# -- single-process tests ------------------------------------------------------------------------


@pytest.mark.parametrize("warmup", [True, False])
def test_masking_during_a_dense_warmup_steps_as_plain_sgd(warmup: bool) -> None:
    """Why the guide does not advise a density warm-up with momentum correction: while the warm-up sends every
    entry the gradient has (here k_t >= its 8 nonzero entries), momentum factor masking clears their velocity at
    every step, so the exchange returns the gradient itself (plain SGD), not momentum SGD's buffer, which the
    same group returns at density 1.0 (k == numel: no masking)."""
    torch.manual_seed(0)
    model = nn.Linear(10, 4, bias=False)
    grad = torch.zeros(4, 10)
    grad.view(-1)[torch.randperm(40)[:8]] = torch.randn(8)
    plan = make_plan(model, "single", Strategy.TOPK, 0.05 if warmup else 1.0, world_size=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay; the gradient is the same every step
    exchange = GradientExchange(model, plan, momentum=MOMENTUM, optimizer=opt,
                                density_warmup=(0.5, 100) if warmup else None)
    buffer = torch.zeros_like(grad)
    for step in range(5):
        if warmup:
            assert exchange._groups[0].codec.k_now >= 8, step
        opt.zero_grad()
        (model.weight * grad).sum().backward()
        exchange.synchronize()
        buffer = MOMENTUM * buffer + grad  # torch.optim.SGD(momentum=m)'s buffer
        want = grad if warmup else buffer
        assert model.weight.grad is not None
        torch.testing.assert_close(model.weight.grad, want, rtol=RTOL, atol=ATOL, msg=f"step {step}")
    exchange.close()


def test_no_momentum_keeps_no_state() -> None:
    model = tiny_mlp()
    exchange = GradientExchange(model, make_plan(model, "single", Strategy.TOPK, 0.1, world_size=1))
    assert all(st.velocity is None for st in exchange._groups)  # no momentum work on the hot path
    assert exchange.state_dict()["velocities"] == {} and exchange.current_density == 0.1


def test_local_clipping_of_one_group_equals_clip_grad_norm() -> None:
    """One group on world size 1: the threshold is clip_norm itself, as torch's clip_grad_norm_."""
    model = tiny_mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=MOMENTUM)
    exchange = GradientExchange(model, make_plan(model, "single", world_size=1), momentum=MOMENTUM, optimizer=opt,
                                clip_norm=0.05)
    clipped = 0
    for step in range(4):
        x, y = make_batch(0, step)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
        exchange.synchronize()
        clipped += torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item() > 0.05
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=RTOL, atol=ATOL)
    assert clipped > 0, "the threshold should clip some steps, else this proves nothing"


def _optimizer_with_momentum(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=MOMENTUM)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"momentum": MOMENTUM}, r"momentum=0.9 needs optimizer=.*pass the optimizer"),
        ({"momentum": MOMENTUM, "optimizer": _optimizer_with_momentum},
         r"param group 0 has momentum=0.9.*twice; use momentum=0 in the optimizer; GradientExchange applies momentum"),
        ({"momentum": MOMENTUM, "optimizer": lambda m: torch.optim.Adam(m.parameters())},
         r"Adam has none .*torch.optim.SGD with momentum=0"),
        ({"momentum": MOMENTUM, "optimizer": lambda m: torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)},
         "holds none of the planned parameters"),
        ({"momentum": 1.0}, r"`0 <= momentum < 1` must hold, but got momentum=1.0"),
        ({"nesterov": True}, "nesterov=True needs momentum > 0"),
        ({"clip_norm": 0.0}, r"`0 < clip_norm < inf` must hold, but got clip_norm=0.0"),
        ({"density_warmup": (0.005, 10)},
         r"`plan density < start_density <= 1` must hold, but got \(start_density=0.005, plan density=0.01\)"),
        ({"density_warmup": (1.5, 10)}, r"start_density=1.5"),
        ({"density_warmup": (0.25, 0)}, r"integer `steps >= 1`, but got steps=0"),
        ({"density_warmup": 0.25}, r"must be \(start_density, steps\), but got 0.25"),
        ({"density_warmup": (0.25, 10), "dense": True}, "density_warmup needs a top-k plan, but the plan's strategy"),
    ],
)
def test_wrong_settings_are_refused_in_one_line(kwargs: dict[str, Any], match: str) -> None:
    model = tiny_mlp()
    kwargs = dict(kwargs)
    if kwargs.pop("dense", False):
        plan = make_plan(model, "per-layer", world_size=1)
    else:
        plan = make_plan(model, "per-layer", Strategy.TOPK, 0.01, world_size=1)
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = kwargs.pop("optimizer", None)
    if make_optimizer is not None:
        kwargs["optimizer"] = make_optimizer(model)
    with pytest.raises(ValueError, match=match) as info:
        GradientExchange(model, plan, **kwargs)
    one_line(info)


def test_optimizer_momentum_turned_on_later_is_refused_at_step() -> None:
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    exchange = GradientExchange(model, make_plan(model, "per-layer", Strategy.TOPK, 0.1, world_size=1),
                                momentum=MOMENTUM, optimizer=opt)
    x, y = make_batch(0, 0)
    nn.functional.mse_loss(model(x), y).backward()
    exchange.synchronize()
    opt.step()
    opt.param_groups[0]["momentum"] = 0.5
    with pytest.raises(ValueError, match="use momentum=0 in the optimizer; GradientExchange applies momentum") as info:
        opt.step()
    one_line(info)
    exchange.close()  # removes the step pre-hook too
    opt.step()


@pytest.mark.parametrize("nesterov", [False, True])
def test_optimizer_momentum_beside_a_topk_plan_is_refused_naming_the_fix(nesterov: bool) -> None:
    """README, "Top-k with momentum": without momentum= the optimizer's momentum would act on the sparse average."""
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=MOMENTUM, nesterov=nesterov)
    plan = make_plan(model, "per-layer", Strategy.TOPK, 0.1, world_size=1)
    fix = (rf"pass momentum=0.9{', nesterov=True' if nesterov else ''} to GradientExchange and momentum=0 to the "
           "optimizer")
    with pytest.raises(ValueError, match=rf"param group 0 has momentum=0.9, but the plan sends .* by top-k.*{fix}") \
            as info:
        GradientExchange(model, plan, optimizer=opt)
    one_line(info)
    # Following the fix runs.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    exchange = GradientExchange(model, plan, momentum=MOMENTUM, nesterov=nesterov, optimizer=opt)
    _run(model, exchange, opt, range(2))
    exchange.close()


def test_optimizer_momentum_turned_on_later_beside_a_topk_plan_is_refused_at_step() -> None:
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    exchange = GradientExchange(model, make_plan(model, "single", Strategy.TOPK, 0.1, world_size=1), optimizer=opt)
    _run(model, exchange, opt, range(1))
    opt.param_groups[0]["momentum"] = 0.5
    with pytest.raises(ValueError, match=r"pass momentum=0\.5 to GradientExchange and momentum=0 to the optimizer"):
        opt.step()
    exchange.close()


def test_optimizer_momentum_is_refused_only_on_the_top_k_groups_of_a_mixed_plan() -> None:
    """Momentum stays in the optimizer for dense, fp16 and PowerSGD groups; on top-k groups it is refused."""
    from tests.test_mixed_runtime import mixed_plan

    model = tiny_mlp()  # layers in ready order: 4, 2, 0
    plan = mixed_plan(model, ["topk:0.2", "fp16", "powersgd:1"], world_size=1)
    topk_layer = model[4]
    rest = [p for m in (model[0], model[2]) for p in m.parameters()]
    opt = torch.optim.SGD([{"params": rest, "momentum": MOMENTUM}, {"params": topk_layer.parameters()}], lr=0.1)
    exchange = GradientExchange(model, plan, optimizer=opt)  # momentum on the fp16 and PowerSGD groups: kept
    _run(model, exchange, opt, range(2))
    exchange.close()
    opt = torch.optim.SGD([{"params": rest}, {"params": topk_layer.parameters(), "momentum": MOMENTUM}], lr=0.1)
    with pytest.raises(ValueError, match=r"param group 1 has momentum=0\.9, but the plan sends .* by top-k"):
        GradientExchange(model, plan, optimizer=opt)


@pytest.mark.parametrize("strategy", ["dense", "fp16", "powersgd:1"])
def test_plans_without_top_k_keep_the_optimizers_momentum(strategy: str) -> None:
    """Dense, fp16 and PowerSGD plans with optimizer momentum give torch momentum SGD's weights on one worker."""
    from tests.test_mixed_runtime import mixed_plan

    model, ref = tiny_mlp(), tiny_mlp()
    plan = (make_plan(model, "per-layer", world_size=1) if strategy == "dense"
            else mixed_plan(model, [strategy], world_size=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=MOMENTUM)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=MOMENTUM)
    exchange = GradientExchange(model, plan, optimizer=opt)
    _run(model, exchange, opt, range(3))
    for step in range(3):
        x, y = make_batch(0, step)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    exchange.close()
    if strategy == "dense":  # fp16 and PowerSGD are lossy: only that they ran with the optimizer's momentum
        torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=RTOL, atol=ATOL)
    assert all(opt.state[p]["momentum_buffer"] is not None for p in model.parameters())


def _run(model: nn.Module, exchange: GradientExchange, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x, y = make_batch(0, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        exchange.synchronize()
        opt.step()


def _momentum_exchange(model: nn.Module, **kwargs: Any) -> tuple[GradientExchange, torch.optim.Optimizer]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    plan = make_plan(model, "per-layer", Strategy.TOPK, 0.1, world_size=1)
    return GradientExchange(model, plan, momentum=MOMENTUM, optimizer=opt, density_warmup=(0.5, 10), **kwargs), opt


def test_state_dict_round_trip_with_velocities_and_step() -> None:
    """A fresh exchange loaded with residuals, velocities and step continues exactly like the one that saved."""
    model = tiny_mlp()
    exchange, opt = _momentum_exchange(model)
    _run(model, exchange, opt, range(3))
    buf = io.BytesIO()
    torch.save(exchange.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)
    assert state["step"] == 3 and sorted(state["velocities"]) == [0, 1, 2]
    assert all(torch.count_nonzero(v) for v in state["velocities"].values())

    resumed_model, forgetful_model = copy.deepcopy(model), copy.deepcopy(model)
    resumed, resumed_opt = _momentum_exchange(resumed_model)
    resumed.load_state_dict(state)
    assert resumed.step == 3 and resumed.current_density == exchange.current_density
    forgetful, forgetful_opt = _momentum_exchange(forgetful_model)
    for m, ex, o in ((model, exchange, opt), (resumed_model, resumed, resumed_opt),
                     (forgetful_model, forgetful, forgetful_opt)):
        _run(m, ex, o, range(3, 5))
    assert torch.equal(flat_params(resumed_model), flat_params(model)), "the resumed exchange must continue identically"
    assert not torch.equal(flat_params(forgetful_model), flat_params(model)), "without the state the run should differ"


def test_old_state_without_velocities_loads_as_zeros() -> None:
    model = tiny_mlp()
    exchange, opt = _momentum_exchange(model)
    _run(model, exchange, opt, range(2))
    old = exchange.state_dict()
    del old["velocities"], old["step"]
    exchange.load_state_dict(old)
    assert exchange.step == 0 and exchange.current_density == pytest.approx(0.5)
    assert all(torch.count_nonzero(v) == 0 for v in exchange.state_dict()["velocities"].values())

    without_momentum = GradientExchange(model, make_plan(model, "per-layer", Strategy.TOPK, 0.1, world_size=1))
    with pytest.raises(PlanMismatchError, match=r"holds momentum velocities .* momentum=0") as info:
        without_momentum.load_state_dict(_momentum_exchange(copy.deepcopy(model))[0].state_dict())
    one_line(info)
    without_momentum.load_state_dict(old)  # residuals only: fine


def test_bench_runs_top_k_plans_as_the_readme_advises_and_the_rest_with_optimizer_momentum() -> None:
    """`planner bench` and the time-to-target bench time what a user following "Top-k with momentum" runs."""
    from planner.sessions.bench import sgd_as_advised

    model = tiny_mlp()
    opt, exchange = sgd_as_advised(model, make_plan(model, "single", Strategy.TOPK, 0.1, world_size=1), lr=0.1,
                                   momentum=MOMENTUM, find_unused=False)
    assert opt.param_groups[0]["momentum"] == 0 and exchange.momentum == MOMENTUM
    assert all(st.velocity is not None for st in exchange._groups)
    opt, exchange = sgd_as_advised(model, make_plan(model, "single", Strategy.DENSE, None, world_size=1), lr=0.1,
                                   momentum=MOMENTUM, find_unused=False)
    assert opt.param_groups[0]["momentum"] == MOMENTUM and exchange.momentum == 0
    opt, exchange = sgd_as_advised(model, None, lr=0.1, momentum=MOMENTUM, find_unused=False)
    assert opt.param_groups[0]["momentum"] == MOMENTUM and exchange is None
