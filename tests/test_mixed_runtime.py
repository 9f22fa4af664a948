"""The runtime executing mixed plans: each compressor against PyTorch's own DDP hook on the same model (fp16,
PowerSGD), every compressor in one plan against a single-process reference of the same arithmetic on a model
shaped like real ones, dense groups against DDP, and the exchange's state resuming bit for bit."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from planner.contracts.layers import gradient_layers
from planner.contracts.plan import Group, Plan
from planner.costmodel.problem import topk_count
from planner.kernels.compress import PowerSGDGroup, PowerSGDLayout
from planner.kernels.topk import decode, pack, select_topk
from planner.runtime import GradientExchange, PlanHook
from planner.types import Compressor, CompressorKind, PlanMismatchError, Strategy
from tests.factories import plan_with_groups
from tests.pool import run_warm
from tests.test_runtime import assert_grads_close, build_model, loss_of, make_batch


def mixed_plan(model: nn.Module, sent_as: list[str], *, per_layer: bool = True, world_size: int = 2) -> Plan:
    """A mixed plan for `model`: one group per layer in ready order (reversed registration), or one group for all,
    group i sent as `sent_as[i % len(sent_as)]`."""
    layers = gradient_layers(model)[::-1]
    chunks = [[spec] for spec in layers] if per_layer else [layers]
    groups = []
    for i, chunk in enumerate(chunks):
        compressor = Compressor.parse(sent_as[i % len(sent_as)])
        numel = sum(s.numel for s in chunk)
        k = topk_count(numel, compressor.density) if compressor.density is not None else None
        groups.append(Group(layers=tuple(s.name for s in chunk), params=tuple(p for s in chunk for p in s.params),
                            numel=numel, k=k, compressor=compressor))
    return plan_with_groups(model, tuple(groups), Strategy.MIXED, world_size=world_size)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 20, generator=g), torch.randn(8, 5, generator=g)


def _hook_worker(rank: int, world_size: int, sent_as: str, driver: str) -> int:
    """One group sent as `sent_as` by a driver (GradientExchange, or PlanHook inside DDP) against DDP with PyTorch's
    hook on one bucket, on fixed weights (no step): the averaged gradients must be the same to the bit, step after
    step (PowerSGD's error and Qs carry over)."""
    model = mlp()
    ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=100)
    if sent_as == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        warmup = 0
    else:
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=int(sent_as.split(":")[1]),
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        warmup = 2  # the hook allreduces plainly for its first two iterations (DDP rebuilds its buckets)
    for step in range(warmup):
        ddp.zero_grad()
        x, y = _batch(rank, 100 + step)
        nn.functional.mse_loss(ddp(x), y).backward()
    plan = mixed_plan(model, [sent_as], per_layer=False)
    exchange = hook = None
    if driver == "exchange":
        exchange = GradientExchange(model, plan)
        ours: nn.Module = model
    else:  # DDP's first iteration lays out its buckets and is sent as a plain mean: taken here, as the hook's warm-up
        hook = PlanHook(model, plan)
        ours = DistributedDataParallel(model, **hook.ddp_kwargs())
        hook.register(ours)
        x, y = _batch(rank, 100)
        nn.functional.mse_loss(ours(x), y).backward()
    compared = 0
    for step in range(4):
        x, y = _batch(rank, step)
        ddp.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        model.zero_grad()
        nn.functional.mse_loss(ours(x), y).backward()
        if exchange is not None:
            exchange.synchronize()
        for (name, p), q in zip(model.named_parameters(), ddp.module.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            assert torch.equal(p.grad, q.grad), f"{driver}, {sent_as} step {step}: {name} differs by " \
                f"{(p.grad - q.grad).abs().max().item():.3g}"
            compared += 1
    if exchange is not None:
        exchange.close()
    return compared


@pytest.mark.parametrize("driver", ["exchange", "hook"])
@pytest.mark.parametrize("sent_as", ["fp16", "powersgd:1", "powersgd:4"])
def test_each_compressor_equals_pytorchs_hook_on_ddp(sent_as: str, driver: str) -> None:
    """Both drivers of the engine, GradientExchange and PlanHook, against PyTorch's own hooks."""
    assert all(n == 24 for n in run_warm(_hook_worker, 2, sent_as, driver))


class ShapedConv(nn.Module):
    """Shaped like real models: a 4-D conv weight beside its 1-D bias, BatchNorm, a tied weight, a frozen layer, an
    unused parameter, and modules registered in another order than used."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(24, 4)  # registered first, used last
        self.frozen = nn.Conv2d(3, 3, 1)
        self.frozen.requires_grad_(False)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.body = nn.Linear(8, 24)
        self.unused = nn.Linear(3, 3)
        self.tail = nn.Linear(8, 24, bias=False)
        self.tail.weight = self.body.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv(self.frozen(x)))).mean(dim=(2, 3))
        return self.head(torch.tanh(self.body(h)) + torch.tanh(self.tail(h)))


SENT_AS = ["powersgd:2", "fp16", "topk:0.3", "dense"]


def _reference(plan: Plan, shapes: list[list[torch.Size]], locals_: list[list[torch.Tensor]], world_size: int,
               states: dict[int, list[object]]) -> list[torch.Tensor]:
    """Each group's averaged gradient from every rank's local gradients (flat, in plan order), computed in one
    process with the kernels the compressors are made of (`shapes`: each group's parameter shapes); `states`
    keeps PowerSGD groups and top-k residuals per rank from step to step."""
    seeds = np.random.RandomState(0)  # PowerSGD's first Qs: one seed per PowerSGD group, in plan order
    seed_of = {j: int(seeds.randint(1_000_000_000)) for j, h in enumerate(plan.groups)
               if plan.compressor_of(h).kind is CompressorKind.POWERSGD}
    out = []
    for i, g in enumerate(plan.groups):
        grads = [locals_[r][i] for r in range(world_size)]
        c = plan.compressor_of(g)
        if c.kind is CompressorKind.DENSE:
            out.append(sum(grads) / world_size)
        elif c.kind is CompressorKind.FP16:
            halves = [(x.to(torch.float16) / world_size) for x in grads]
            total = halves[0]
            for h in halves[1:]:
                total = total + h
            out.append(total.float())
        elif c.kind is CompressorKind.TOPK:
            residuals = states.setdefault(i, [torch.zeros(g.numel) for _ in range(world_size)])
            assert g.k is not None
            sent = torch.cat([pack(*select_topk(grads[r], residuals[r], g.k)) for r in range(world_size)])
            out.append(decode(sent, g.k, g.numel, world_size))
        else:
            groups = states.get(i)
            if groups is None:
                assert c.rank is not None
                groups = states[i] = [PowerSGDGroup(PowerSGDLayout.of(shapes[i], c.rank), torch.device("cpu"),
                                                    seed_of[i]) for _ in range(world_size)]
            sends = [grp.compress(grads[r]) for r, grp in enumerate(groups)]  # type: ignore[attr-defined]
            total = sends[0].clone()
            for s in sends[1:]:
                total += s
            qs = []
            for grp in groups:
                grp.send.copy_(total)  # type: ignore[attr-defined]
                qs.append(grp.middle(world_size).clone())  # type: ignore[attr-defined]
            qsum = qs[0]
            for q in qs[1:]:
                qsum = qsum + q
            results = []
            for grp in groups:
                grp.q.copy_(qsum)  # type: ignore[attr-defined]
                res = torch.empty(g.numel)
                grp.decompress(res, world_size)  # type: ignore[attr-defined]
                results.append(res)
            out.append(results[0])
    return out


def _flat_grad(params: list[nn.Parameter]) -> torch.Tensor:
    """The parameters' gradients, one after the other (zeros for a missing one)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def _shaped_worker(rank: int, world_size: int) -> list[str]:
    """Every compressor in one plan on ShapedConv, against `_reference` on every rank's gathered local gradients,
    over a few steps (no optimizer step, so the local gradients stay comparable; residuals, errors and Qs carry
    over)."""
    torch.manual_seed(0)
    model = ShapedConv()
    plan = mixed_plan(model, SENT_AS)
    params = dict(model.named_parameters())
    shapes = [[params[n].shape for n in g.params] for g in plan.groups]
    twin = copy.deepcopy(model)  # computes the local gradients the exchange starts from
    exchange = GradientExchange(model, plan, find_unused_parameters=True, forward_sync_buffers=False)
    states: dict[int, list[object]] = {}
    used = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * rank + step)
        x, y = torch.randn(6, 3, 5, 5, generator=g), torch.randint(0, 4, (6,), generator=g)
        model.zero_grad()
        twin.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        nn.functional.cross_entropy(twin(x), y).backward()
        exchange.synchronize()
        twins = dict(twin.named_parameters())
        local = [_flat_grad([twins[n] for n in grp.params]) for grp in plan.groups]
        everyone: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        dist.all_gather_object(everyone, local)
        expected = _reference(plan, shapes, everyone, world_size, states)
        for i, grp in enumerate(plan.groups):
            got = _flat_grad([params[n] for n in grp.params])
            torch.testing.assert_close(got, expected[i], rtol=1e-6, atol=1e-7,
                                       msg=f"step {step} group {i} ({plan.compressor_of(grp)})")
            used.append(str(plan.compressor_of(grp)))
    assert params["unused.weight"].grad is None  # find_unused_parameters: no rank used it
    exchange.close()
    return sorted(set(used))


def test_every_compressor_in_one_plan_equals_the_reference_on_a_real_shaped_model() -> None:
    for used in run_warm(_shaped_worker, 2):
        assert used == sorted(SENT_AS)


def _dense_like_ddp_worker(rank: int, world_size: int) -> int:
    """A mixed plan whose groups are all dense averages as DDP does (tied weights, frozen BatchNorm model too)."""
    compared = 0
    for kind in ("mlp", "tied", "frozen-bn"):
        model = build_model(kind)
        ref = DistributedDataParallel(copy.deepcopy(model))
        exchange = GradientExchange(model, mixed_plan(model, ["dense"]))
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, model)]
        for step in range(3):
            x, y = make_batch(kind, rank, step)
            for opt in opts:
                opt.zero_grad()
            loss_of(kind, ref(x), y).backward()
            loss_of(kind, model(x), y).backward()
            exchange.synchronize()
            assert_grads_close(model, ref.module, f"{kind} mixed-dense step {step}")
            compared += 1
            for opt in opts:
                opt.step()
        exchange.close()
    return compared


def test_a_mixed_plan_of_dense_groups_equals_ddp() -> None:
    assert run_warm(_dense_like_ddp_worker, 2) == [9, 9]


def _resume_worker(rank: int, world_size: int) -> None:
    """With momentum correction, a fresh exchange loaded with the state continues exactly like the one that saved
    it (PowerSGD's errors and Qs, top-k residuals, velocities); without the state it does not."""

    def run(model: nn.Module, exchange: GradientExchange, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            x, y = _batch(rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            exchange.synchronize()
            opt.step()

    sent_as = ["powersgd:1", "topk:0.2", "fp16"]
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    exchange = GradientExchange(model, mixed_plan(model, sent_as), momentum=0.9, optimizer=opt)
    run(model, exchange, opt, range(3))
    buf = io.BytesIO()
    torch.save({"exchange": exchange.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}, buf)
    run(model, exchange, opt, range(3, 6))
    buf.seek(0)
    saved = torch.load(buf)
    assert saved["exchange"]["powersgd"] and any(torch.count_nonzero(e["error"]) for e in
                                                 saved["exchange"]["powersgd"].values())

    def fresh(load: bool) -> nn.Module:
        other = mlp()
        other.load_state_dict(saved["model"])
        other_opt = torch.optim.SGD(other.parameters(), lr=0.05)
        other_opt.load_state_dict(saved["opt"])
        other_exchange = GradientExchange(other, mixed_plan(other, sent_as), momentum=0.9, optimizer=other_opt)
        if load:
            other_exchange.load_state_dict(saved["exchange"])
        run(other, other_exchange, other_opt, range(3, 6))
        return other

    resumed, forgetful = fresh(True), fresh(False)
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), "the resumed exchange must train to the same parameters, bit for bit"
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), forgetful.parameters(), strict=True))
    with pytest.raises(PlanMismatchError, match="other plan groups"):
        other = mlp()
        GradientExchange(other, mixed_plan(other, ["fp16"])).load_state_dict(saved["exchange"])


def test_state_dict_resumes_a_mixed_plan_bit_for_bit() -> None:
    run_warm(_resume_worker, 2)


def test_mixed_plans_round_trip_through_json() -> None:
    model = ShapedConv()
    plan = mixed_plan(model, SENT_AS)
    again = Plan.from_dict(plan.to_dict())
    assert again == plan
    assert [str(again.compressor_of(g)) for g in again.groups] == [SENT_AS[i % 4] for i in range(len(plan.groups))]
    assert again.selector == "exact" and again.sends_topk


def _bf16_worker(rank: int, world_size: int) -> str:
    """A bf16 model's dense groups travel as bf16 and average exactly as DDP's bf16 buckets do."""
    ours, theirs = mlp().to(torch.bfloat16), mlp().to(torch.bfloat16)
    ddp = DistributedDataParallel(theirs)
    exchange = GradientExchange(ours, mixed_plan(ours, ["dense"], per_layer=False))
    dtypes = {str(st.flat.dtype) for st in exchange._groups if st.flat is not None}
    for step in range(2):
        x, y = _batch(rank, step)
        for model in (ours, ddp):
            model.zero_grad()
            nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y).backward()
        exchange.synchronize()
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None and p.grad.dtype == torch.bfloat16
            assert torch.equal(p.grad, q.grad), (p.grad - q.grad).abs().max()
    exchange.close()
    return ",".join(sorted(dtypes))


def test_bf16_gradients_travel_as_bf16_like_ddp() -> None:
    assert run_warm(_bf16_worker, 2) == ["torch.bfloat16"] * 2
