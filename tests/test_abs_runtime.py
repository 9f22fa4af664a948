"""planner.runtime.ABSSGD on 2 gloo workers against single-process references of the same one-round-delayed,
sample-weighted updates: equal counts, unequal counts (3 micro-batches against 1), every sample applied once,
resuming from state_dict, convergence with one worker twice as slow, and bad input."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from planner.contracts.layers import gradient_layers
from planner.costmodel.problem import groups_for
from planner.runtime import ABSSGD
from planner.types import PlanMismatchError, Strategy
from tests.factories import abs_section, plan_with_groups
from tests.pool import run_warm

WORLD_SIZE = 2
ATOL, RTOL = 1e-6, 1e-5


class TiedNet(nn.Module):
    """Shaped like real models: a tied weight, BatchNorm, a frozen layer and parameters registered out of use
    order."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 3)  # registered first, used last
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.body = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.tail = nn.Linear(6, 6, bias=False)
        self.tail.weight = self.body.weight  # tied

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.norm(self.body(self.frozen(x))))
        return self.head(torch.tanh(self.tail(h)))


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return TiedNet()


def micro_batch(rank: int, round_: int, k: int, size: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * round_ + k)
    return torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9,
                           weight_decay=1e-3)


def abs_plan(model: nn.Module, **trigger: Any) -> Any:
    """A plan of one group per layer with an abs section of the given trigger."""
    layers = gradient_layers(model)
    return plan_with_groups(model, groups_for(layers, tuple(range(1, len(layers) + 1)), Strategy.DENSE, None),
                            abs_section=abs_section(WORLD_SIZE, **trigger))


def reference(kind: str, rounds: int, counts: Sequence[int], sizes: Sequence[int]) -> dict[str, Tensor]:
    """One process: round r's gradient is every rank's micro-batches summed (mean loss x samples) at the
    parameters of round r, applied as their sample-weighted mean at the end of round r + 1; the last one by
    `finish`. BatchNorm sees each micro-batch alone, as on its rank."""
    model = build(kind)
    opt = optimizer_for(model)
    params = [p for p in model.parameters() if p.requires_grad]
    pending: tuple[list[Tensor], int] | None = None
    for r in range(rounds):
        sums = [torch.zeros_like(p) for p in params]
        count = 0
        for rank in range(WORLD_SIZE):
            for k in range(counts[rank]):
                x, y = micro_batch(rank, r, k, sizes[rank])
                grads = torch.autograd.grad(F.cross_entropy(model(x), y), params)
                for s, g in zip(sums, grads, strict=True):
                    s.add_(g, alpha=len(x))
                count += len(x)
        if pending is not None:
            for p, s in zip(params, pending[0], strict=True):
                p.grad = s / pending[1]
            opt.step()
        pending = (sums, count)
    assert pending is not None
    for p, s in zip(params, pending[0], strict=True):
        p.grad = s / pending[1]
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fixed_counts_worker(rank: int, world_size: int, kind: str, rounds: int, counts: list[int],
                         sizes: list[int], with_plan: bool) -> dict[str, Any]:
    model = build(kind)
    opt = optimizer_for(model)
    n = counts[rank]
    abs_sgd = (ABSSGD(model, opt, abs_plan(model), min_micro_batches=n, max_micro_batches=n) if with_plan
               else ABSSGD(model, opt, min_micro_batches=n, max_micro_batches=n))
    k = 0
    while abs_sgd.round < rounds:
        x, y = micro_batch(rank, abs_sgd.round, k, sizes[rank])
        F.cross_entropy(model(x), y).backward()
        k = 0 if abs_sgd.step(len(x)) else k + 1
    abs_sgd.finish()
    assert abs_sgd.round == rounds  # nothing left to apply after the last round: finish adds no round
    return snapshot(model)


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Parameters as numpy arrays (tensors do not come back from spawned workers; arrays pickle by value)."""
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def assert_params_close(got: dict[str, Any], want: dict[str, Tensor], what: str) -> None:
    assert got.keys() == want.keys()
    got = {n: torch.from_numpy(a) for n, a in got.items()}
    for name in want:
        assert torch.allclose(got[name], want[name], atol=ATOL, rtol=RTOL), (
            f"{what}: {name} differs by {(got[name] - want[name]).abs().max():.3g}")


@pytest.mark.parametrize("kind", ["mlp", "tied"])
def test_equal_counts_equal_single_process_reference(kind: str) -> None:
    rounds, counts, sizes = 5, [2, 2], [4, 4]
    got = run_warm(_fixed_counts_worker, WORLD_SIZE, kind, rounds, counts, sizes, True)
    want = reference(kind, rounds, counts, sizes)
    for rank in range(WORLD_SIZE):
        assert_params_close(got[rank], want, f"{kind} rank {rank}")
    # the delay is real: the same updates applied without it end elsewhere
    name = next(iter(want))
    assert not torch.allclose(torch.from_numpy(got[0][name]), build(kind).state_dict()[name])


def test_weighted_mean_is_exact_with_three_micro_batches_against_one() -> None:
    rounds, counts, sizes = 4, [3, 1], [4, 7]  # rank 0: 12 samples per round, rank 1: 7
    got = run_warm(_fixed_counts_worker, WORLD_SIZE, "mlp", rounds, counts, sizes, False)
    want = reference("mlp", rounds, counts, sizes)
    for rank in range(WORLD_SIZE):
        assert_params_close(got[rank], want, f"rank {rank}")
    # an unweighted mean of the two ranks' mean gradients would differ
    wrong = reference("mlp", rounds, [1, 1], [4, 7])
    assert not all(torch.allclose(torch.from_numpy(got[0][n]), wrong[n], atol=ATOL, rtol=RTOL) for n in wrong)


class Recorder(torch.optim.Optimizer):
    """Plain SGD that keeps every gradient it was given."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.0})
        self.seen: list[Tensor] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        self.seen.append(self.param_groups[0]["params"][0].grad.clone())


class Tags(nn.Module):
    """loss = sum of w[i] over the batch's sample ids: the gradient is how often each sample was used."""

    def __init__(self, num: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(num))

    def forward(self, ids: Tensor) -> Tensor:
        return self.w[ids].sum()


def _every_sample_once_worker(rank: int, world_size: int, resume_at: int,
                              round_samples: int | None) -> tuple[Any, int, int]:
    """Adaptive trigger (the exchange trigger, or the batch trigger of `round_samples`) with rank 1 slower, so
    counts differ from round to round; at round `resume_at` the state is saved (with an exchange in flight) and
    loaded into fresh objects. Returns the sum over applied updates of (mean gradient x samples applied), the
    samples applied and the samples drawn on this rank."""
    total, per_rank = 20_000, 10_000
    model = Tags(total)
    opt = Recorder(model.parameters())
    abs_sgd = ABSSGD(model, opt, min_micro_batches=1, round_samples=round_samples, loss_reduction="sum")
    ids = iter(range(rank * per_rank, (rank + 1) * per_rank))
    used = torch.zeros(total)
    applied: list[int] = []
    seen: list[Tensor] = []
    drawn = 0
    saved = False
    while abs_sgd.round < 12:
        batch = torch.tensor([next(ids) for _ in range(3 + rank)])
        drawn += len(batch)
        model(batch).backward()
        time.sleep(0.004 if rank == 1 else 0.001)
        abs_sgd.step(len(batch))
        if abs_sgd.round == resume_at and not saved:  # just after a round end (the same collective on each rank)
            state = copy.deepcopy(abs_sgd.state_dict())
            applied += abs_sgd.updates
            seen += opt.seen
            model = Tags(total)
            opt = Recorder(model.parameters())
            abs_sgd = ABSSGD(model, opt, min_micro_batches=1, round_samples=round_samples, loss_reduction="sum")
            abs_sgd.load_state_dict(state)
            saved = True
    abs_sgd.finish()
    applied += abs_sgd.updates
    seen += opt.seen
    assert saved and len(seen) == len(applied)
    for grad, count in zip(seen, applied, strict=True):
        used += grad * count
    return used.numpy(), sum(applied), drawn


@pytest.mark.parametrize("round_samples", [None, 24], ids=["exchange-trigger", "batch-trigger"])
def test_no_sample_is_lost_or_counted_twice_across_rounds_and_a_resume(round_samples: int | None) -> None:
    results = run_warm(_every_sample_once_worker, WORLD_SIZE, 5, round_samples)
    drawn = [d for _, _, d in results]
    for array, applied, _ in results:
        used = torch.from_numpy(array)
        assert applied == sum(drawn)
        assert torch.allclose(used.sum(), torch.tensor(float(sum(drawn))))
        ids = torch.cat([torch.arange(r * 10_000, r * 10_000 + d) for r, d in enumerate(drawn)])
        want = torch.zeros(20_000)
        want[ids] = 1.0
        assert torch.allclose(used, want, atol=1e-4), "a sample was dropped or applied twice"


def _resume_worker(rank: int, world_size: int, stop_at: tuple[int, int] | None) -> dict[str, Any]:
    """Fixed counts (3 and 2 micro-batches); with `stop_at` (round, micro-batch) everything is saved there and
    loaded into a fresh model, optimizer and ABSSGD, which finish the run."""
    counts = [3, 2]
    model = build("tied")
    opt = optimizer_for(model)
    abs_sgd = ABSSGD(model, opt, min_micro_batches=counts[rank], max_micro_batches=counts[rank])
    k = 0
    while abs_sgd.round < 6:
        if stop_at is not None and (abs_sgd.round, k) == stop_at:
            saved = copy.deepcopy((model.state_dict(), opt.state_dict(), abs_sgd.state_dict()))
            model = build("mlp")  # anything: the state overwrites it
            model = build("tied")
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            opt = optimizer_for(model)
            abs_sgd = ABSSGD(model, opt, min_micro_batches=counts[rank], max_micro_batches=counts[rank])
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            abs_sgd.load_state_dict(saved[2])
            stop_at = None
        x, y = micro_batch(rank, abs_sgd.round, k, 5)
        F.cross_entropy(model(x), y).backward()
        k = 0 if abs_sgd.step(len(x)) else k + 1
    abs_sgd.finish()
    return snapshot(model)


@pytest.mark.parametrize("stop_at", [(3, 0), (2, 1)], ids=["at-a-round-end", "mid-round"])
def test_state_dict_resumes_to_the_same_parameters(stop_at: tuple[int, int]) -> None:
    straight = run_warm(_resume_worker, WORLD_SIZE, None)
    resumed = run_warm(_resume_worker, WORLD_SIZE, stop_at)
    for rank in range(WORLD_SIZE):
        for name, want in straight[rank].items():
            assert (resumed[rank][name] == want).all(), f"rank {rank} {name} after resuming at {stop_at}"


def _batch_trigger_worker(rank: int, world_size: int, rounds: int, switch: int) -> list[tuple[int, int]]:
    """Rounds of 48 samples in micro-batches of 4. Each micro-batch takes a sleep: 1 ms on rank 0; on rank 1,
    4 ms before round `switch` and 1 ms from it on. Returns this rank's (round, samples) per round."""
    model = build("mlp")
    opt = optimizer_for(model)
    abs_sgd = ABSSGD(model, opt, round_samples=48)
    k = 0
    while abs_sgd.round < rounds:
        x, y = micro_batch(rank, abs_sgd.round, k, 4)
        F.cross_entropy(model(x), y).backward()
        time.sleep(0.004 if rank == 1 and abs_sgd.round < switch else 0.001)
        k = 0 if abs_sgd.step(len(x)) else k + 1
    abs_sgd.finish()
    return [(r.round, r.samples) for r in abs_sgd.records if r.micro_batches]


def test_the_batch_trigger_splits_rounds_by_measured_speed_and_follows_a_change() -> None:
    rounds, switch = 60, 30
    fast, slow = run_warm(_batch_trigger_worker, WORLD_SIZE, rounds, switch)
    fast, slow = dict(fast), dict(slow)
    # every round is the batch asked for, to a micro-batch per rank (round ends at the micro-batch nearest a part)
    assert all(abs(fast[r] + slow[r] - 48) <= 2 * 4 for r in range(rounds)), [fast[r] + slow[r] for r in fast]

    def share(first: int, last: int) -> float:
        return sum(slow[r] for r in range(first, last)) / sum(fast[r] + slow[r] for r in range(first, last))

    # 4x slower: about a fifth of the samples once measured; as fast again: about half, a few rounds later
    assert share(10, switch) < 0.35, f"the slow rank's share {share(10, switch):.2f}"
    assert share(switch + 15, rounds) > 0.4, f"the sped-up rank's share {share(switch + 15, rounds):.2f}"


def _digits_worker(rank: int, world_size: int, rounds: int) -> tuple[float, float, list[int]]:
    """Digits, a small MLP, adaptive trigger; rank 1 sleeps as long as it computed after each micro-batch
    (twice as slow). Returns the full-data loss before and after, and rank 0's micro-batches per round."""
    from tests.digits import digits

    x, y = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    # plain SGD: with momentum 0.9 a one-round delay oscillates (planner/commands/bench_abs.py)
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    abs_sgd = ABSSGD(model, opt, min_micro_batches=1)
    with torch.no_grad():
        before = F.cross_entropy(model(x), y).item()
    gen = torch.Generator().manual_seed(rank)
    while abs_sgd.round < rounds:
        started = time.perf_counter()
        index = torch.randint(0, len(x), (16,), generator=gen)
        F.cross_entropy(model(x[index]), y[index]).backward()
        if rank == 1:
            time.sleep(max(0.002, time.perf_counter() - started))
        abs_sgd.step(16)
    abs_sgd.finish()
    with torch.no_grad():
        after = F.cross_entropy(model(x), y).item()
    dist.barrier()
    return before, after, [r.micro_batches for r in abs_sgd.records]


def test_converges_on_digits_with_one_worker_twice_as_slow() -> None:
    results = run_warm(_digits_worker, WORLD_SIZE, 300)
    (before, after, fast), (_, after_slow, slow) = results
    assert after == pytest.approx(after_slow, abs=1e-6)  # the same parameters on both ranks
    assert after < 0.25 * before, f"loss {before:.3f} -> {after:.3f}"
    assert sum(fast) > sum(slow), f"the fast worker should compute more micro-batches: {sum(fast)} vs {sum(slow)}"


def test_bad_input_is_refused() -> None:
    model = build("mlp")
    opt = optimizer_for(model)
    plain = plan_with_groups(model, abs_plan(model).groups, world_size=1)
    with pytest.raises(PlanMismatchError, match=r"no abs section.*--strategy abs"):
        ABSSGD(model, opt, plain)
    with pytest.raises(ValueError, match="min_micro_batches <= max_micro_batches"):
        ABSSGD(model, opt, min_micro_batches=3, max_micro_batches=2)
    with pytest.raises(ValueError, match="round_samples must be a whole number >= the world size 1"):
        ABSSGD(model, opt, round_samples=0)
    with pytest.raises(ValueError, match="loss_reduction"):
        ABSSGD(model, opt, loss_reduction="none")
    with pytest.raises(ValueError, match="optimizer does not hold"):
        ABSSGD(model, torch.optim.SGD(list(model.parameters())[:1], lr=0.1))
    abs_sgd = ABSSGD(model, opt)
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        abs_sgd.step(0)
    with pytest.raises(PlanMismatchError, match="not an ABSSGD state"):
        abs_sgd.load_state_dict({"kind": "runtime.gradient_exchange"})


def test_single_process_applies_each_round_one_round_late() -> None:
    model = build("mlp")
    opt = optimizer_for(model)
    abs_sgd = ABSSGD(model, opt, min_micro_batches=2, max_micro_batches=2)
    k = 0
    while abs_sgd.round < 3:
        x, y = micro_batch(0, abs_sgd.round, k, 4)
        F.cross_entropy(model(x), y).backward()
        k = 0 if abs_sgd.step(4) else k + 1
    assert [r.applied_samples for r in abs_sgd.records] == [0, 8, 8]
    abs_sgd.finish()
    assert abs_sgd.updates == [8, 8, 8] and abs_sgd.applied_samples == abs_sgd.samples == 24
    assert abs_sgd.round == 3  # the empty partial round does not count
