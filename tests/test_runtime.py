"""Tests of the gradient exchange and the DDP top-k hook: differential against DDP, in real gloo processes.

Worker functions are module-level (the spawned processes import this module); each distributed test
runs several configurations in one `run_distributed` call to keep process start-up cheap.
"""

from __future__ import annotations

import copy
import datetime
import io
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from planner.contracts.layers import gradient_layers
from planner.contracts.plan import Group, Plan
from planner.costmodel.problem import groups_for
from planner.platform.launch import run_distributed
from planner.runtime import GradientExchange, TopkHookState, topk_hook
from planner.types import DistributedError, PlanMismatchError, Strategy
from tests.factories import plan_with_groups
from tests.pool import run_warm

WORLD_SIZE = 2
RTOL, ATOL = 1e-5, 1e-6


# -- models, data and plans ----------------------------------------------------------------------


class TinyCNN(nn.Module):
    """Two convolutions and a classifier on 3x8x8 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 6, 3, stride=2)
        self.fc = nn.Linear(6 * 3 * 3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc(x.flatten(1))


class FrozenNormReordered(nn.Module):
    """Parameters registered in another order than used (the head first), a frozen stem, and BatchNorm
    (its running statistics are buffers) on 3x8x8 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6 * 3 * 3, 5)
        self.bn = nn.BatchNorm2d(4)
        self.conv = nn.Conv2d(4, 6, 3, stride=2)
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.stem.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.stem(x)))
        return self.head(torch.relu(self.conv(x)).flatten(1))


class Branchy(nn.Module):
    """`b` is used only when asked, `unused` never: gradients missing on some or all ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.a(x)
        return y + self.b(x) if use_b else y


def tiny_mlp(din: int = 8, hidden: int = 16, dout: int = 4) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(din, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
        nn.ReLU(), nn.Linear(hidden, dout),
    )  # fmt: skip


class TiedLM(nn.Module):
    """A GRU language model whose output layer reuses the embedding's weight (tied weights)."""

    def __init__(self, vocab: int = 30, width: int = 12) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.out = nn.Linear(width, vocab)
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.emb(tokens))[0])


class AuxHead(nn.Module):
    """A trunk and a head the loss uses, and an auxiliary head it never touches."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.trunk(x)))


def aux_workload() -> Any:
    """`--model tests.test_runtime:aux_workload`: the AuxHead model with a synthetic regression batch."""
    from planner.models import Workload

    torch.manual_seed(0)
    return Workload(name="aux", module=AuxHead(), batch_size=4,
                    make_batch=lambda n, g: (torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)),
                    loss_fn=nn.functional.mse_loss)


def build_model(kind: str) -> nn.Module:
    """Same weights on every rank (fixed seed)."""
    torch.manual_seed(0)
    return {"mlp": tiny_mlp, "cnn": TinyCNN, "tied": TiedLM, "frozen-bn": FrozenNormReordered}[kind]()


def make_batch(kind: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Different data on every rank and step."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    if kind == "mlp":
        return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    if kind == "tied":
        return torch.randint(0, 30, (4, 5), generator=g), torch.randint(0, 30, (4, 5), generator=g)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)


def loss_of(kind: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "mlp":
        return nn.functional.mse_loss(out, target)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def grouping_for(name: str, num_layers: int) -> tuple[int, ...]:
    """Exclusive end indices: one group per layer, one group, or a mix of sizes."""
    if name == "per-layer":
        return tuple(range(1, num_layers + 1))
    if name == "single":
        return (num_layers,)
    assert name == "mixed" and num_layers >= 3
    return (1, num_layers) if num_layers == 3 else (1, num_layers - 1, num_layers)


def make_plan(
    model: nn.Module,
    grouping: str,
    strategy: Strategy = Strategy.DENSE,
    density: float | None = None,
    *,
    world_size: int = WORLD_SIZE,
    ready_order: bool = True,
    name: str = "tiny",
) -> Plan:
    """A plan for `model` with dummy predictions; layers in ready order (reversed registration) by default."""
    layers = gradient_layers(model)
    if ready_order:
        layers = layers[::-1]
    groups = groups_for(layers, grouping_for(grouping, len(layers)), strategy, density)
    return plan_with_groups(model, groups, strategy, density, world_size=world_size, name=name)


def grad_of(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def assert_grads_close(got: nn.Module, want: nn.Module, what: str) -> None:
    for (name, p), q in zip(got.named_parameters(), want.parameters(), strict=True):
        if not q.requires_grad:  # frozen: no gradient on either side
            assert p.grad is None and q.grad is None, f"{what}: frozen {name} got a gradient"
            continue
        assert p.grad is not None and q.grad is not None, f"{what}: {name} has no gradient"
        assert torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL), (
            f"{what}: gradient of {name} differs by {(p.grad - q.grad).abs().max().item():.3g}"
        )


# -- distributed workers -------------------------------------------------------------------------


def _matches_ddp_worker(rank: int, world_size: int, strategy: str, density: float | None) -> int:
    """Exchange (dense, or top-k) vs DDP on the same weights and per-rank batches, over a few SGD steps."""
    compared = 0
    for kind in ("mlp", "cnn", "tied", "frozen-bn"):
        for grouping in ("per-layer", "single", "mixed"):
            model = build_model(kind)
            ref = DistributedDataParallel(copy.deepcopy(model))
            plan = make_plan(model, grouping, Strategy(strategy), density)
            exchange = GradientExchange(model, plan)
            models = [model]
            exchanges = [exchange]
            if plan.strategy is Strategy.TOPK:  # density 1.0 must also equal a dense exchange directly
                dense_model = copy.deepcopy(model)
                exchanges.append(GradientExchange(dense_model, make_plan(dense_model, grouping)))
                models.append(dense_model)
            opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in [ref, *models]]
            for step in range(3):
                x, y = make_batch(kind, rank, step)
                for opt in opts:  # alternate: fresh .grad tensors, and grads kept (views accumulated into)
                    opt.zero_grad(set_to_none=step % 2 == 0)
                loss_of(kind, ref(x), y).backward()
                for m, ex in zip(models, exchanges, strict=True):
                    loss_of(kind, m(x), y).backward()
                    ex.synchronize()
                    assert_grads_close(m, ref.module, f"{kind} {grouping} {strategy} step {step}")
                    compared += 1
                if len(models) > 1:
                    assert_grads_close(models[0], models[1], f"{kind} {grouping} top-k vs dense step {step}")
                for opt in opts:
                    opt.step()
            for ex in exchanges:
                ex.close()
    return compared


def _missing_grads_worker(rank: int, world_size: int, strategy: str, density: float | None) -> None:
    """A parameter unused on one rank gets the average with zeros; one unused everywhere gets zeros."""
    torch.manual_seed(0)
    model = Branchy()
    ref = copy.deepcopy(model)
    exchange = GradientExchange(model, make_plan(model, "per-layer", Strategy(strategy), density))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    use_b = rank == 0
    for step in range(2):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        model(x, use_b).pow(2).sum().backward()
        exchange.synchronize()
        ref(x, use_b).pow(2).sum().backward()
        for name, p in ref.named_parameters():
            expected = torch.zeros_like(p) if p.grad is None else p.grad.clone()
            dist.all_reduce(expected)
            expected /= world_size
            got = dict(model.named_parameters())[name].grad
            assert got is not None, f"step {step}: {name} has no gradient after synchronize"
            assert torch.allclose(got, expected, rtol=RTOL, atol=ATOL), f"step {step}: {name} differs"
        assert torch.count_nonzero(grad_of(model.unused.weight)) == 0
        exchange.synchronize()  # a second call without backward: no collectives, nothing changes
    exchange.close()


class NormNet(nn.Module):
    """Conv + BatchNorm (running statistics as buffers) + a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def _buffers_like_ddp_worker(rank: int, world_size: int, sync: bool) -> int:
    """BatchNorm buffers and parameters follow DDP's: ranks start from rank 0's model (they were built with
    different seeds), and rank 0's running statistics are copied before each forward that follows a synchronised
    one; micro-batches under no_sync() and an evaluation forward in between keep DDP's rule."""
    torch.manual_seed(rank)  # different initial weights on every rank
    model = NormNet()
    torch.manual_seed(100)
    ref = DistributedDataParallel(copy.deepcopy(model), forward_sync_buffers=sync)
    exchange = GradientExchange(model, make_plan(model, "mixed"), forward_sync_buffers=sync)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    compared = 0
    for step in range(4):
        x, y = make_batch("cnn", rank, step)
        for opt in opts:
            opt.zero_grad()
        if step == 2:  # one accumulated micro-batch, then an evaluation pass
            x0, y0 = make_batch("cnn", rank, 100 + step)
            with ref.no_sync():
                nn.functional.cross_entropy(ref(x0), y0).backward()
            with exchange.no_sync():
                nn.functional.cross_entropy(model(x0), y0).backward()
        nn.functional.cross_entropy(ref(x), y).backward()
        nn.functional.cross_entropy(model(x), y).backward()
        exchange.synchronize()
        for opt in opts:
            opt.step()
        if step == 1:
            with torch.no_grad():
                ref.eval(), model.eval()
                assert torch.allclose(ref(x), model(x), rtol=RTOL, atol=ATOL)
                ref.train(), model.train()
        for (name, t), u in zip([*model.named_parameters(), *model.named_buffers()],
                                [*ref.module.parameters(), *ref.module.buffers()], strict=True):
            assert torch.allclose(t.float(), u.float(), rtol=RTOL, atol=ATOL), f"step {step}: {name} differs from DDP"
            compared += 1
    clone = copy.deepcopy(model)  # a copy can be made, and its forward is its own (no collective)
    if rank == 0:
        clone(x)
    model.eval()
    with torch.no_grad():
        model(x)  # syncs first (the last forward was a synchronised one), and leaves the statistics as they are
    gathered = [torch.empty_like(model.bn.running_mean) for _ in range(world_size)]
    dist.all_gather(gathered, model.bn.running_mean)
    assert torch.equal(gathered[0], gathered[1]) == sync  # rank 0's everywhere, or drifted apart
    exchange.close()
    return compared


def _unused_like_ddp_worker(rank: int, world_size: int, strategy: str, density: float | None) -> int:
    """With find_unused_parameters=True the exchange trains exactly like DDP with that option: `b` used on
    one rank is averaged with zeros, `unused` keeps no gradient, so weight decay leaves it alone."""
    torch.manual_seed(0)
    model = Branchy()
    ref = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    exchange = GradientExchange(model, make_plan(model, "mixed", Strategy(strategy), density),
                                find_unused_parameters=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.1) for m in (ref, model)]
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    before = model.unused.weight.detach().clone()
    checked = 0
    for step in range(3):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        ref(x, rank == 0).pow(2).sum().backward()
        model(x, rank == 0).pow(2).sum().backward()
        exchange.synchronize()
        for (name, p), q in zip(model.named_parameters(), ref.module.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), f"step {step}: {name} has a gradient in one only"
            if p.grad is not None:
                assert q.grad is not None and torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL), name
                checked += 1
        for opt in opts:
            opt.step()
    assert model.unused.weight.grad is None and torch.equal(model.unused.weight, before)
    for p, q in zip(model.parameters(), ref.module.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=RTOL, atol=ATOL)
    exchange.close()
    return checked


def _ddp_hook_worker(rank: int, world_size: int) -> dict[str, int]:
    """The DDP top-k hook at density 1.0 equals plain DDP, before and after top-k starts (start_iter)."""
    model = build_model("mlp")
    plain = DistributedDataParallel(copy.deepcopy(model))
    hooked = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.001)  # several buckets
    state = TopkHookState(density=1.0)
    hooked.register_comm_hook(state, topk_hook)
    sparse = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.001)
    sparse_state = TopkHookState(density=0.05)
    sparse.register_comm_hook(sparse_state, topk_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, hooked, sparse)]
    for step in range(5):
        x, y = make_batch("mlp", rank, step)
        for m, opt in zip((plain, hooked, sparse), opts, strict=True):
            opt.zero_grad()
            loss_of("mlp", m(x), y).backward()
        assert_grads_close(hooked.module, plain.module, f"DDP top-k hook density 1.0 step {step}")
        for opt in opts:
            opt.step()
    saved = sparse_state.state_dict()
    restored = TopkHookState(density=0.5)
    restored.load_state_dict(saved)
    assert restored.density == 0.05 and restored.iteration == 0  # a new DDP module warms up again
    assert all(torch.equal(restored.residuals[i], r) for i, r in sparse_state.residuals.items())
    return {
        "iterations": state.iteration,
        "buckets": len(state.residuals),
        "sparse_buckets": len(sparse_state.residuals),
        "sparse_nonzero": sum(int(torch.count_nonzero(r)) for r in sparse_state.residuals.values()),
        "dense_nonzero": sum(int(torch.count_nonzero(r)) for r in state.residuals.values()),
    }


def _regression_task(rank: int, world_size: int, n_per_rank: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-student regression: a fixed random tanh network plus label noise; a shard per rank."""
    g = torch.Generator().manual_seed(0)
    teacher = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        x = torch.randn(world_size * n_per_rank, 16, generator=g)
        y = teacher(x) + 0.1 * torch.randn(x.shape[0], 1, generator=g)
    shard = slice(rank * n_per_rank, (rank + 1) * n_per_rank)
    return x[shard], y[shard]


def _train(rank: int, world_size: int, strategy: Strategy, density: float | None, grouping: str, steps: int) -> float:
    """Full-batch SGD on this rank's shard; returns the loss over all shards after `steps` steps."""
    x, y = _regression_task(rank, world_size)
    torch.manual_seed(100)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    exchange = GradientExchange(model, make_plan(model, grouping, strategy, density))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        exchange.synchronize()
        opt.step()
    exchange.close()
    with torch.no_grad():
        loss = nn.functional.mse_loss(model(x), y).reshape(1)
    dist.all_reduce(loss)
    return loss.item() / world_size


def _training_worker(rank: int, world_size: int, steps: int) -> dict[str, float]:
    _, y = _regression_task(rank, world_size)
    initial = torch.tensor([y.pow(2).mean().item()])  # the loss of predicting zero, for scale
    dist.all_reduce(initial)
    return {
        "initial": initial.item() / world_size,
        "dense": _train(rank, world_size, Strategy.DENSE, None, "per-layer", steps),
        "topk per-layer": _train(rank, world_size, Strategy.TOPK, 0.01, "per-layer", steps),
        "topk single": _train(rank, world_size, Strategy.TOPK, 0.01, "single", steps),
    }


def _state_round_trip_worker(rank: int, world_size: int) -> None:
    """A fresh exchange loaded with the residuals continues exactly like the one that saved them."""
    model = build_model("mlp")
    plan = make_plan(model, "mixed", Strategy.TOPK, 0.05)
    exchange = GradientExchange(model, plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        x, y = make_batch("mlp", rank, step)
        opt.zero_grad()
        loss_of("mlp", model(x), y).backward()
        exchange.synchronize()
        opt.step()
    buf = io.BytesIO()
    torch.save(exchange.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)
    assert any(torch.count_nonzero(r) for r in state["residuals"].values()), "residuals should hold something"

    resumed_model = copy.deepcopy(model)
    resumed = GradientExchange(resumed_model, make_plan(resumed_model, "mixed", Strategy.TOPK, 0.05))
    resumed.load_state_dict(state)
    forgetful_model = copy.deepcopy(model)
    forgetful = GradientExchange(forgetful_model, make_plan(forgetful_model, "mixed", Strategy.TOPK, 0.05))

    x, y = make_batch("mlp", rank, 3)
    for m, ex in ((model, exchange), (resumed_model, resumed), (forgetful_model, forgetful)):
        m.zero_grad()
        loss_of("mlp", m(x), y).backward()
        ex.synchronize()
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(grad_of(p), grad_of(q)), "the resumed exchange must give the same gradients"
    assert any(
        not torch.equal(grad_of(p), grad_of(q))
        for p, q in zip(model.parameters(), forgetful_model.parameters(), strict=True)
    ), "without the residuals the gradients should differ (else the test proves nothing)"

    other = make_plan(resumed_model, "per-layer", Strategy.TOPK, 0.05)
    with pytest.raises(PlanMismatchError, match="other plan groups"):
        GradientExchange(copy.deepcopy(resumed_model), other).load_state_dict(state)


def _failing_worker(rank: int, world_size: int) -> None:
    if rank == 1:
        raise PlanMismatchError("rank 1 refuses")
    dist.barrier()  # rank 0 waits for a peer that is gone: it must not keep the call waiting


def _hanging_worker(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)


def _drain_worker(rank: int, world_size: int) -> int:
    """Collectives in flight when the interpreter would exit are waited for by the exit drain, which leaves
    the step open: `synchronize` afterwards still gives the averaged gradients."""
    from planner.runtime import exchange as exchange_module

    torch.manual_seed(0)
    model = tiny_mlp()
    reference = copy.deepcopy(model)
    exchange = GradientExchange(model, make_plan(model, "per-layer"))
    assert exchange in exchange_module._LIVE
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    waits: list[tuple[Any, ...]] = []

    class Recorded:  # the work handle, with its waits recorded
        def __init__(self, work: Any) -> None:
            self.work = work

        def wait(self, *args: Any) -> Any:
            waits.append(args)
            return self.work.wait(*args)

    in_flight = [st.work for st in exchange._groups if st.work is not None]
    assert len(in_flight) == len(exchange._groups)  # every group was launched from its hooks
    for st in exchange._groups:
        st.work = Recorded(st.work)
    exchange_module._drain_at_exit()
    assert waits == [(datetime.timedelta(seconds=exchange_module.EXIT_DRAIN_S),)] * len(in_flight)
    assert all(work.is_completed() for work in in_flight)
    exchange.synchronize()
    reference(x).pow(2).mean().backward()
    for p in reference.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= world_size
    assert_grads_close(model, reference, "after the exit drain")
    return len(in_flight)


# -- distributed tests ---------------------------------------------------------------------------


def test_the_exit_drain_waits_for_collectives_in_flight() -> None:
    layers = len(gradient_layers(tiny_mlp()))  # one group per layer, each in flight
    assert run_warm(_drain_worker, WORLD_SIZE) == [layers] * WORLD_SIZE


def test_tied_weights_are_one_parameter_of_the_first_module_that_holds_them() -> None:
    model = TiedLM()
    layers = gradient_layers(model)
    names = [p for layer in layers for p in layer.params]
    assert names == [n for n, _ in model.named_parameters()]  # each tensor once, under its own name
    assert sum(layer.numel for layer in layers) == sum(p.numel() for p in model.parameters())
    assert [layer.name for layer in layers] == ["emb", "rnn", "out"] and layers[-1].params == ("out.bias",)


def test_profiling_a_tied_model_sees_the_shared_gradient_ready_last() -> None:
    """The shared weight's gradient is complete only after the embedding's backward: its layer is last."""
    from planner.models import Workload
    from planner.profilers.layers import measure_layers

    workload = Workload(name="tied", module=TiedLM(), batch_size=4,
                        make_batch=lambda n, g: (torch.randint(0, 30, (n, 5), generator=g),
                                                 torch.randint(0, 30, (n, 5), generator=g)),
                        loss_fn=lambda out, y: loss_of("tied", out, y))
    run = measure_layers(workload, torch.device("cpu"), repeats=1, warmup=0)
    assert run.order == ("out", "rnn", "emb")
    assert run.params["emb"] == ("emb.weight",) and sum(run.numel.values()) == 30 * 12 + 936 + 30


@pytest.mark.spawns
def test_run_distributed_reraises_a_worker_error_and_kills_hung_workers() -> None:
    with pytest.raises(PlanMismatchError, match="rank 1 refuses") as info:
        run_distributed(_failing_worker, WORLD_SIZE)
    assert "_failing_worker" in str(info.value.__cause__)  # the worker's traceback text
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank\(s\) \[0(, 1)?\] of 2 did not finish within 3 s"):
        run_distributed(_hanging_worker, WORLD_SIZE, timeout=3)
    assert time.monotonic() - start < 60


def _slow_worker(rank: int, world_size: int) -> int:
    time.sleep(4)
    dist.barrier()
    return rank


def _one_rank_hangs(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)
    dist.barrier()  # rank 1 waits for rank 0 in a collective that never completes


@pytest.mark.spawns
def test_a_job_without_a_deadline_waits_for_its_workers_and_a_hang_still_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A command's job has no deadline (a trial takes hours): the call waits for workers however long they work,
    and a worker left waiting in a collective fails after the collective timeout, which ends the job."""
    from planner.platform import launch

    assert run_distributed(_slow_worker, WORLD_SIZE, timeout=None) == [0, 1]
    monkeypatch.setattr(launch, "COLLECTIVE_TIMEOUT_S", 3.0)
    # rank 0 sleeps on and never reports: the launcher's grace for it after rank 1 failed is seconds the outcome does
    # not depend on (rank 1's error is raised either way, and rank 0 killed)
    monkeypatch.setattr(launch, "FAILURE_GRACE_S", 0.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Timed out waiting 3000ms") as info:
        run_distributed(_one_rank_hangs, WORLD_SIZE, timeout=None)
    assert time.monotonic() - start < 60
    assert "did not finish within" not in str(info.value)


def _tensor_result(rank: int, world_size: int) -> torch.Tensor:
    return torch.arange(1000, dtype=torch.float32)


def test_a_workers_tensor_result_is_read_after_the_worker_has_exited() -> None:
    """A busy parent may read a result only after its worker is gone: the result must travel whole in the pipe
    (not as a shared-memory handle the parent would fetch from the exited worker)."""
    import torch.multiprocessing as mp

    from planner.platform.launch import _receive, _worker, free_port

    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker, args=(_tensor_result, 0, 1, free_port(), "gloo", 60.0, (), writer))
    proc.start()
    writer.close()
    proc.join(timeout=60)
    assert proc.exitcode == 0
    message = _receive(reader, proc, died=True)
    reader.close()
    assert message is not None and message[0] == "ok", message
    assert torch.equal(message[1], torch.arange(1000, dtype=torch.float32))


@pytest.mark.parametrize(("strategy", "density"), [("dense", None), ("topk", 1.0)])
def test_exchange_matches_ddp(strategy: str, density: float | None) -> None:
    """Dense plans (and top-k at density 1.0) give DDP's gradients for every grouping: MLP, CNN, a language
    model with tied input and output weights, and a CNN with a frozen stem, BatchNorm and parameters
    registered in another order than used."""
    compared = run_warm(_matches_ddp_worker, WORLD_SIZE, strategy, density)
    assert compared[0] == (2 if strategy == "topk" else 1) * 4 * 3 * 3


@pytest.mark.parametrize(("strategy", "density"), [("dense", None), ("topk", 1.0)])
def test_missing_gradients_count_as_zeros(strategy: str, density: float | None) -> None:
    run_warm(_missing_grads_worker, WORLD_SIZE, strategy, density)


@pytest.mark.parametrize(("strategy", "density"), [("dense", None), ("topk", 1.0)])
def test_find_unused_parameters_trains_like_ddp(strategy: str, density: float | None) -> None:
    assert run_warm(_unused_like_ddp_worker, WORLD_SIZE, strategy, density) == [3 * 4] * WORLD_SIZE


@pytest.mark.parametrize("sync", [True, False])
def test_buffers_and_initial_state_follow_ddp(sync: bool) -> None:
    assert run_warm(_buffers_like_ddp_worker, WORLD_SIZE, sync) == [4 * 9] * WORLD_SIZE


def test_bench_runs_a_model_with_an_unused_head(tmp_path: Path) -> None:
    """`planner bench` on a model whose loss leaves a head unused: DDP (its baseline) and the exchange are
    told to find unused parameters, instead of DDP failing on its second step."""
    from planner.contracts.fingerprint import model_info
    from planner.runtime.ddp_hooks import has_unused_parameters
    from tests.test_contracts import _main

    workload = aux_workload()
    assert has_unused_parameters(workload.module, lambda m: workload.loss(*workload.batch()))
    assert not has_unused_parameters(tiny_mlp(), lambda m: m(torch.randn(2, 8)).sum())
    plan = make_plan(workload.module, "mixed", name="tests.test_runtime:aux_workload")
    assert plan.model.fingerprint == model_info(workload.module, "aux").fingerprint
    path = tmp_path / "plan.json"
    plan.save(path)
    proc = _main("bench", "--plan", str(path), "--model", "tests.test_runtime:aux_workload", "--steps", "2",
                 "--warmup", "1", "--nproc", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_kfac_profiling_skips_an_unused_head_when_told() -> None:
    from planner.profilers.kfac_costs import measure_kfac_layers
    from planner.types import InvalidProfileError
    from tests.test_contracts import _main, _one_clear_line

    with pytest.raises(InvalidProfileError, match=r"profile with --kfac-skip '\^aux\$' and pass skip_layers="):
        measure_kfac_layers(aux_workload(), torch.device("cpu"), repeats=1, warmup=0)
    layers = measure_kfac_layers(aux_workload(), torch.device("cpu"), repeats=1, warmup=0, skip="^aux$")
    assert [lt.name for lt in layers] == ["trunk", "head"]
    _one_clear_line(_main("profile", "--model", "mlp", "--kfac-skip", "aux", "-o", "p.json"), "--kfac only")
    _one_clear_line(_main("profile", "--model", "mlp", "--kfac", "--kfac-skip", "(", "-o", "p.json"),
                    "--kfac-skip is not a valid regular expression")


def test_ddp_topk_hook() -> None:
    """The DDP hook at density 1.0 equals plain DDP; at 0.05 it keeps a residual per bucket."""
    results = run_warm(_ddp_hook_worker, WORLD_SIZE)
    for r in results:
        assert r["iterations"] == 5
        assert r["buckets"] >= 2 and r["dense_nonzero"] == 0
        assert r["sparse_buckets"] == r["buckets"] and r["sparse_nonzero"] > 0


def test_topk_with_error_feedback_trains_like_dense() -> None:
    """Top-k at density 0.01 with error feedback ends within 5% of the dense loss after the same steps."""
    results = run_warm(_training_worker, WORLD_SIZE, 200)
    r = results[0]
    assert results[1] == r
    assert r["dense"] < 0.2 * r["initial"], f"dense training should learn the task: {r}"
    for name in ("topk per-layer", "topk single"):
        assert r[name] <= 1.05 * r["dense"], f"{name} loss {r[name]:.4g} vs dense {r['dense']:.4g}: {r}"


def test_state_dict_round_trip() -> None:
    run_warm(_state_round_trip_worker, WORLD_SIZE)


# -- single-process tests ------------------------------------------------------------------------


def _record_events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Record ("prepare", group) and ("launch", group) as the exchange does them."""
    events: list[tuple[str, int]] = []
    prepare = GradientExchange._prepare

    def recording_prepare(self: GradientExchange, st: object) -> None:
        events.append(("prepare", st.index))  # type: ignore[attr-defined]
        prepare(self, st)  # type: ignore[arg-type]

    def recording_start(self: GradientExchange, st: object) -> None:
        events.append(("launch", st.index))  # type: ignore[attr-defined]

    monkeypatch.setattr(GradientExchange, "_prepare", recording_prepare)
    monkeypatch.setattr(GradientExchange, "_start", recording_start)
    return events


def _linear_chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3))


def _groups_in_order(model: nn.Module, order: list[int]) -> tuple[Group, ...]:
    """One group per layer, listed in the given layer order."""
    layers = gradient_layers(model)
    return tuple(Group(layers=(layers[i].name,), params=layers[i].params, numel=layers[i].numel) for i in order)


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        # plan order = ready order (last layer first): each group launches as soon as it is complete
        ([2, 1, 0], [("prepare", 0), ("launch", 0), ("prepare", 1), ("launch", 1), ("prepare", 2), ("launch", 2)]),
        # plan order = registration order: groups 2 and 1 complete first and wait for group 0
        ([0, 1, 2], [("prepare", 2), ("prepare", 1), ("prepare", 0), ("launch", 0), ("launch", 1), ("launch", 2)]),
        # mixed: group 0 (layer 2) goes at once; group 2 (layer 1) waits for group 1 (layer 0)
        ([2, 0, 1], [("prepare", 0), ("launch", 0), ("prepare", 2), ("prepare", 1), ("launch", 1), ("launch", 2)]),
    ],
)
def test_groups_launch_in_plan_order(
    monkeypatch: pytest.MonkeyPatch, order: list[int], expected: list[tuple[str, int]]
) -> None:
    events = _record_events(monkeypatch)
    model = _linear_chain()
    exchange = GradientExchange(model, plan_with_groups(model, _groups_in_order(model, order), world_size=1))
    model(torch.randn(2, 3)).sum().backward()
    assert events == expected  # all launched during backward, in plan order
    exchange.synchronize()
    exchange.synchronize()
    assert events == expected  # nothing left for synchronize, and a second call does nothing


def test_synchronize_launches_groups_without_gradients_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group whose parameters got no gradient is prepared by synchronize(), and launched in its turn."""
    events = _record_events(monkeypatch)
    torch.manual_seed(0)
    model = Branchy()
    # plan order a, unused, b: `unused` never completes, so b (complete during backward) must wait for it
    layers = {spec.name: spec for spec in gradient_layers(model)}
    groups = tuple(Group(layers=(n,), params=layers[n].params, numel=layers[n].numel) for n in ("a", "unused", "b"))
    exchange = GradientExchange(model, plan_with_groups(model, groups, world_size=1))
    model(torch.randn(2, 4), use_b=True).sum().backward()
    assert sorted(events[:3]) == [("launch", 0), ("prepare", 0), ("prepare", 2)]
    assert [e for e in events if e[0] == "launch"] == [("launch", 0)]
    exchange.synchronize()
    assert events[3:] == [("prepare", 1), ("launch", 1), ("launch", 2)]
    assert model.unused.weight.grad is None  # dense on world size 1 leaves gradients as they are


def test_world_size_one_dense_keeps_gradients_and_topk_applies_selection() -> None:
    model = build_model("mlp")
    dense_model, topk_model = copy.deepcopy(model), copy.deepcopy(model)
    dense = GradientExchange(dense_model, make_plan(dense_model, "mixed", world_size=1))
    topk = GradientExchange(topk_model, make_plan(topk_model, "single", Strategy.TOPK, 0.1, world_size=1))
    x, y = make_batch("mlp", 0, 0)
    for m in (model, dense_model, topk_model):
        loss_of("mlp", m(x), y).backward()
    dense.synchronize()
    topk.synchronize()
    local = torch.cat([grad_of(p).flatten() for p in model.parameters()])
    assert torch.equal(torch.cat([grad_of(p).flatten() for p in dense_model.parameters()]), local)
    sent = torch.cat([grad_of(p).flatten() for p in topk_model.parameters()])
    k = topk.plan.groups[0].k
    assert k is not None and torch.count_nonzero(sent) == k
    residual = topk.state_dict()["residuals"][0]  # the flat group buffer follows the plan's parameter order
    local_grads, sent_grads = dict(model.named_parameters()), dict(topk_model.named_parameters())
    local_flat = torch.cat([grad_of(local_grads[n]).flatten() for n in topk.plan.param_order])
    sent_flat = torch.cat([grad_of(sent_grads[n]).flatten() for n in topk.plan.param_order])
    torch.testing.assert_close(sent_flat + residual, local_flat, rtol=0, atol=0)


def test_no_sync_accumulates_and_double_backward_is_refused() -> None:
    model = _linear_chain()
    ref = copy.deepcopy(model)
    exchange = GradientExchange(model, make_plan(model, "single", Strategy.TOPK, 1.0, world_size=1))
    xs = [torch.randn(2, 3) for _ in range(3)]
    with exchange.no_sync():
        for x in xs[:2]:
            model(x).sum().backward()
    model(xs[2]).sum().backward()
    exchange.synchronize()
    for x in xs:
        ref(x).sum().backward()
    assert_grads_close(model, ref, "accumulated with no_sync")
    model(xs[0]).sum().backward()
    with pytest.raises(DistributedError, match="synchronize"):
        model(xs[1]).sum().backward()


def test_a_step_before_synchronize_is_refused_when_the_optimizer_is_known() -> None:
    model = _linear_chain()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    exchange = GradientExchange(model, make_plan(model, "mixed", world_size=1), optimizer=optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(DistributedError, match=r"before exchange.synchronize\(\)"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))  # nothing applied
    exchange.synchronize()
    optimizer.step()  # in order: accepted
    with exchange.no_sync():  # accumulating locally is not a pending exchange
        model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    exchange.close()
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()  # the hook left with the exchange


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda m: make_plan(tiny_mlp(din=9), "single", world_size=1, name="other"), "model other .* re-plan"),
        (lambda m: make_plan(m, "single", world_size=2), "world size 2, but .* world size 1"),
    ],
)
def test_plan_for_another_model_or_world_size_is_refused(make: Callable[[nn.Module], Plan], match: str) -> None:
    model = tiny_mlp()
    with pytest.raises(PlanMismatchError, match=match) as info:
        GradientExchange(model, make(model))
    message = str(info.value)
    assert ("planner solve" in message or "planner retune" in message) and "\n" not in message


def test_another_model_is_named_as_itself_and_told_to_profile_itself() -> None:
    plan = make_plan(tiny_mlp(), "single", world_size=1, name="mlp")
    with pytest.raises(PlanMismatchError) as info:
        GradientExchange(TiedLM(), plan)
    message = str(info.value)
    assert "made for model mlp (" in message and "the model given is TiedLM (" in message
    assert "planner profile --model <package.module:factory>" in message  # not the plan's model again


def test_a_wrapped_model_is_refused_for_its_module_prefix() -> None:
    model = tiny_mlp()
    plan = make_plan(model, "single", world_size=1)
    with pytest.raises(PlanMismatchError, match=r"named module\.\* \(as DataParallel names them\); pass the inner"):
        GradientExchange(nn.DataParallel(model), plan)
    GradientExchange(nn.DataParallel(model).module, plan).close()  # the inner module is the planned one


def test_plan_parameters_must_match_the_model() -> None:
    model = tiny_mlp()
    layers = gradient_layers(model)
    missing = tuple(Group(layers=(s.name,), params=s.params, numel=s.numel) for s in layers[1:])
    with pytest.raises(PlanMismatchError, match=r"missing from the plan: 0\.weight, 0\.bias; .*planner solve"):
        GradientExchange(model, plan_with_groups(model, missing, world_size=1, counts_from_groups=True))
    extra = (Group(layers=("ghost",), params=("ghost.weight",), numel=3), *missing)
    with pytest.raises(PlanMismatchError, match=r"does not have: ghost\.weight"):
        GradientExchange(model, plan_with_groups(model, extra, world_size=1, counts_from_groups=True))
    all_layers = tuple(Group(layers=(s.name,), params=s.params, numel=s.numel) for s in layers)
    model[0].bias.requires_grad_(False)  # frozen, but a plan with this fingerprint still names it
    with pytest.raises(PlanMismatchError, match=r"frozen parameter\(s\) \(requires_grad=False\): 0\.bias"):
        GradientExchange(model, plan_with_groups(model, all_layers, world_size=1, counts_from_groups=True))


def test_state_dict_refuses_another_plan() -> None:
    model = tiny_mlp()
    exchange = GradientExchange(model, make_plan(model, "mixed", Strategy.TOPK, 0.1, world_size=1))
    state = exchange.state_dict()
    assert sorted(state["residuals"]) == [0, 1, 2]
    other_model = tiny_mlp(hidden=12)
    other = GradientExchange(other_model, make_plan(other_model, "mixed", Strategy.TOPK, 0.1, world_size=1))
    with pytest.raises(PlanMismatchError, match="fingerprint"):
        other.load_state_dict(state)
    with pytest.raises(PlanMismatchError, match="not a GradientExchange state"):
        exchange.load_state_dict({"residuals": {}})
    exchange.load_state_dict(state)


def test_state_dict_entries_of_another_type_or_shape_are_refused_in_one_line() -> None:
    """Every entry is checked before anything changes: a wrong type or shape is one PlanMismatchError line naming
    the entry (not an AttributeError, nor a state taken that fails later), and the exchange keeps its state."""
    from tests.test_mixed_runtime import mixed_plan

    model = tiny_mlp()
    exchange = GradientExchange(model, mixed_plan(model, ["powersgd:1", "topk:0.3"], world_size=1))
    model(torch.randn(4, 8)).sum().backward()
    exchange.synchronize()  # residuals, errors and Qs that are not zeros
    state = exchange.state_dict()
    residual, psgd = state["residuals"][1], state["powersgd"][0]
    bad = [
        ({"residuals": []}, "residuals must be a dict by index, but got list"),
        ({"residuals": {**state["residuals"], 1: residual.tolist()}}, "residual of group 1 must be a tensor"),
        ({"residuals": {**state["residuals"], 1: residual.long()}}, "1-D floating tensor of 272 elements"),
        ({"residuals": {**state["residuals"], "one": residual}}, "keyed by index, but holds the key 'one'"),
        ({"velocities": "none"}, "velocities must be a dict"),
        ({"powersgd": {**state["powersgd"], 0: [psgd["error"]]}}, "PowerSGD state of group 0 must be a dict"),
        ({"powersgd": {**state["powersgd"], 0: {**psgd, "q": psgd["q"][:-1]}}}, "PowerSGD q of group 0 must be"),
        ({"powersgd": {**state["powersgd"], 0: {**psgd, "fresh": 0}}}, "fresh of group 0 must be True or False"),
        ({"step": "3"}, "step count must be an integer"),
    ]
    for change, words in bad:
        with pytest.raises(PlanMismatchError, match=words) as info:
            exchange.load_state_dict({**state, **change})
        assert "\n" not in str(info.value), words
    after = exchange.state_dict()
    assert torch.equal(after["residuals"][1], residual) and torch.equal(after["powersgd"][0]["q"], psgd["q"])
    exchange.load_state_dict(state)
    exchange.close()


def test_from_file_and_close(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    model = _linear_chain()
    make_plan(model, "per-layer", world_size=1).save(path)
    with GradientExchange.from_file(model, path) as exchange:
        assert len(exchange.plan.groups) == 3
    # hooks are gone: a second backward without synchronize is no longer an error
    model(torch.randn(2, 3)).sum().backward()
    model(torch.randn(2, 3)).sum().backward()


def frozen_norm_workload() -> Any:
    """`--model tests.test_runtime:frozen_norm_workload`: `FrozenNormReordered` with a synthetic batch."""
    from planner.models import Workload

    torch.manual_seed(0)

    def batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)

    return Workload(name="frozen-norm", module=FrozenNormReordered(), batch_size=8, make_batch=batch,
                    loss_fn=nn.functional.cross_entropy)


def test_the_layer_phase_times_a_fast_model_over_about_min_seconds() -> None:
    """A fast model gets more repeats, as many as the warm-up's whole steps say fill `min_seconds` (capped), on
    the estimate every rank agrees on; without `min_seconds` or without a warm-up it runs exactly `repeats`."""
    from planner.models import build_workload
    from planner.profilers.layers import measure_layers

    workload = build_workload("mlp", batch_size=4)
    cpu = torch.device("cpu")
    estimates: list[float] = []
    totals: list[int] = []

    def agree(seconds: float) -> float:
        estimates.append(seconds)
        return 1.0 / 5  # as if the slowest rank took 0.2 s a step: 2 s is 10 steps

    run = measure_layers(workload, cpu, repeats=3, warmup=2, min_seconds=2.0, agree=agree, on_total=totals.append)
    assert len(estimates) == 1 and estimates[0] > 0  # once, after the warm-up, on this rank's own steps
    assert totals == [2 + 10] and len(run.whole) == len(run.update) == 10
    capped = measure_layers(workload, cpu, repeats=3, warmup=1, min_seconds=1e6, max_repeats=6)
    assert len(capped.whole) == 6
    for plain in (measure_layers(workload, cpu, repeats=3, warmup=2),  # no min_seconds
                  measure_layers(workload, cpu, repeats=3, warmup=0, min_seconds=1e6)):  # no warm-up to go by
        assert len(plain.whole) == len(plain.update) == len(plain.forward_total) == 3
    # The cap never cuts the repeats asked for.
    assert len(measure_layers(workload, cpu, repeats=8, warmup=1, min_seconds=1e6, max_repeats=6).whole) == 8
