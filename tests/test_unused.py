"""Parameters without a gradient in some batches: the profile finds them over several batches, records them and says
so in one line; plans carry them; the exchange from such a plan turns `find_unused_parameters` on (or refuses an
explicit False) and then trains as DDP(find_unused_parameters=True) does, on 2 gloo workers.

The model is shaped like the one that hit it: a router sends each batch to 2 of 4 experts, the experts chosen
depending on the batch, beside a head the loss never touches.
"""

from __future__ import annotations

import copy
import gc
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from planner.contracts.plan import Plan
from planner.contracts.profile import Profile
from planner.contracts.unused import UnusedParams
from planner.models import Workload
from planner.platform import launch
from planner.profilers.layers import gradient_counts, unused_params
from planner.runtime import GradientExchange
from planner.types import SchemaError, Strategy
from tests.conftest import _warm_when_plain
from tests.factories import synthetic_profile
from tests.pool import run_warm
from tests.test_contracts import _main

WORLD_SIZE = 2
#: Exchange against DDP(find_unused_parameters=True), fp32 on CPU: both average the same gradients, in other orders.
RTOL, ATOL = 1e-5, 1e-6
SPEC = "tests.test_unused:routed_workload"
EXPERTS = [f"experts.{i}.{p}" for i in range(4) for p in ("weight", "bias")]
NEVER = ["aux.weight", "aux.bias"]


class Routed(nn.Module):
    """A router picks 2 of 4 experts per batch from the batch's mean input; `aux` is a head the loss never touches."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 4)
        self.aux = nn.Linear(8, 2)
        nn.init.zeros_(self.gate.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.gate(x.mean(0)).softmax(-1)
        chosen = scores.topk(2).indices.tolist()
        mixed = sum(scores[i] * self.experts[i](x) for i in chosen)
        assert isinstance(mixed, torch.Tensor)
        return self.head(torch.relu(mixed))


def _routed_batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs around a per-batch centre (which the router sees), regression targets."""
    centre = 3 * torch.randn(8, generator=g)
    return centre + torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def routed_workload() -> Workload:
    """`--model tests.test_unused:routed_workload`."""
    torch.manual_seed(0)
    return Workload(name="routed", module=Routed(), batch_size=8, make_batch=_routed_batch,
                    loss_fn=nn.functional.mse_loss)


def test_the_router_leaves_each_expert_out_of_some_batches_and_in_others() -> None:
    """The model's premise, and the profiler's count: one batch alone would call experts never used."""
    wl = routed_workload()
    counts = gradient_counts(wl, torch.device("cpu"), range(16))
    assert all(0 < counts[n] < 16 for n in EXPERTS), counts
    assert all(counts[n] == 16 for n in ("gate.weight", "head.weight", "head.bias"))
    assert all(counts[n] == 0 for n in NEVER)
    one = gradient_counts(wl, torch.device("cpu"), range(1))
    assert sum(one[n] == 0 for n in EXPERTS) == 4  # batch 0 alone: 2 experts look never used
    record = unused_params([counts, counts], 16)
    assert record.batches == 32 and list(record.never) == NEVER and list(record.sometimes) == EXPERTS


def _planner(*args: str) -> subprocess.CompletedProcess[str]:
    proc = _main(*args)
    assert proc.returncode == 0, f"planner {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def routed_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """`planner profile --quick` of the routed model on 2 workers, and `planner solve` of it: the real path, run in
    this process (the profile's workers are the warm ones, as for any command a test runs: tests/conftest.py; this
    fixture outlives the function-scoped patch that does it there, so it applies the same patch itself)."""
    folder = tmp_path_factory.mktemp("routed")
    profile, plan = folder / "profile.json", folder / "plan.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "run_distributed", _warm_when_plain(launch.run_distributed))
        out = _planner("profile", "--model", SPEC, "--nproc", "2", "--quick", "--powersgd-ranks", "1", "-o",
                       str(profile)).stdout
        _planner("solve", str(profile), "--strategy", "dense", "-o", str(plan))
    return profile, plan, out


def test_the_profile_records_unused_and_sometimes_unused_parameters_and_says_so(
        routed_files: tuple[Path, Path, str]) -> None:
    profile_path, plan_path, out = routed_files
    record = Profile.load(profile_path).unused_params
    assert record is not None and record.batches >= 16  # several batches on every rank
    assert list(record.never) == NEVER and list(record.sometimes) == EXPERTS
    said = [line for line in out.splitlines() if "unused parameters" in line]
    assert len(said) == 1, out
    assert "aux.weight" in said[0] and "experts.0.weight" in said[0] and "find_unused_parameters=True" in said[0]
    assert Plan.load(plan_path).unused_params == record  # the plan carries it to the runtime


def test_an_exchange_from_such_a_plan_turns_the_flag_on_or_refuses_false(routed_files: tuple[Path, Path, str]) -> None:
    plan = Plan.load(routed_files[1])
    plan = Plan.from_dict({**plan.to_dict(), "cluster": {**plan.cluster.to_dict(), "world_size": 1}})
    model = routed_workload().module
    with pytest.warns(RuntimeWarning, match=r"find_unused_parameters is on: .*experts\.0\.weight.*None stays None: "
                                            r"the optimizer skips it.* pass find_unused_parameters=True to say so"):
        exchange = GradientExchange(model, plan)
    assert exchange.find_unused_parameters
    exchange.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exchange = GradientExchange(model, plan, find_unused_parameters=True)  # said so: no note
    exchange.close()
    with pytest.raises(ValueError, match=r"find_unused_parameters=False, but .*; pass find_unused_parameters=True")\
            as info:
        GradientExchange(model, plan, find_unused_parameters=False)
    assert "\n" not in str(info.value)


def _like_ddp_worker(rank: int, world_size: int, plan_path: str) -> int:
    """The exchange from the routed model's plan (flag left to the plan) against DDP(find_unused_parameters=True),
    momentum SGD with weight decay, each rank its own batches (so the ranks route to different experts)."""
    wl = routed_workload()
    model = wl.module
    ref = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        exchange = GradientExchange.from_file(model, plan_path)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01) for m in (ref, model)]
    aux = model.aux.weight.detach().clone()
    compared = 0
    for step in range(6):
        x, y = wl.batch(seed=100 * rank + step)
        for m, opt in zip((ref, model), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            wl.loss_fn(m(x), y).backward()
        exchange.synchronize()
        for opt in opts:
            opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.module.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), f"step {step}: {name} has a gradient in one only"
            assert torch.allclose(p, q, rtol=RTOL, atol=ATOL), (
                f"step {step}: {name} differs from DDP by {(p - q).abs().max().item():.3g}")
            compared += 1
    assert torch.equal(model.aux.weight, aux)  # never used: no gradient, no decay, no momentum
    exchange.close()
    return compared


def test_the_exchange_from_such_a_plan_trains_like_ddp_with_find_unused(routed_files: tuple[Path, Path, str]) -> None:
    params = len(list(routed_workload().module.parameters()))
    assert run_warm(_like_ddp_worker, WORLD_SIZE, str(routed_files[1])) == [6 * params] * WORLD_SIZE


def _hook_calibration_worker(rank: int, world_size: int, times: int) -> list[int]:
    """PyTorch's PowerSGD hook measured sending on the real group (the profile's calibration of it), `times` in a
    row, each rank on its own batch so the ranks leave different experts without a gradient on the same step."""
    import torch.distributed as dist

    from planner.runtime.calibrate import _ddp_powersgd_extra_samples

    wl = routed_workload()
    inputs, targets = wl.batch(seed=rank)
    chosen = sorted(wl.module.gate(inputs.mean(0)).softmax(-1).topk(2).indices.tolist())
    others = [None] * world_size
    dist.all_gather_object(others, chosen)
    assert others[0] != others[1], f"the ranks route alike ({others}): the check needs them to differ"
    counts = []
    # Each calibration ends in gc.collect() (its DDP model and hook state are reference cycles): over all the objects
    # of a worker that imported torch (and what the first calibration imports) that takes about 0.3 s, most of this
    # test's time. The objects alive after the first calibration are set aside (gc.freeze); those each later one makes
    # are collected as before.
    try:
        for _ in range(times):
            samples = _ddp_powersgd_extra_samples(wl, wl.module, inputs, targets, torch.device("cpu"), 2,
                                                  dist.group.WORLD, 1, dist.group.WORLD, lambda: None)
            counts.append(len(samples))
            gc.freeze()
    finally:
        gc.unfreeze()
    return counts


def test_the_hooks_sending_calibration_with_ranks_leaving_different_experts_out_neither_crashes_nor_hangs() -> None:
    """The calibration a mixture of experts crashed (a gloo collective mismatch) or hung in, about half the time: 20
    times in a row on the ranks' different batches, every rank's samples gathered each time."""
    assert run_warm(_hook_calibration_worker, WORLD_SIZE, 20, timeout=300) == [[2 * WORLD_SIZE] * 20] * 2


# -- the contract ------------------------------------------------------------------------------------------------


def test_profiles_and_plans_without_the_record_load_and_with_it_round_trip(tmp_path: Path) -> None:
    profile = synthetic_profile()
    assert "unused_params" not in profile.to_dict() and Profile.from_dict(profile.to_dict()).unused_params is None
    names = [p for lt in profile.layers for p in lt.params]
    record = UnusedParams(batches=16, never=(names[0],), sometimes=(names[1],))
    recorded = Profile.from_dict({**profile.to_dict(), "unused_params": record.to_dict()})
    assert recorded.unused_params == record
    from planner.strategies.gradients import make_plan

    plan = make_plan(recorded, Strategy.DENSE)
    assert plan.unused_params == record and Plan.from_dict(plan.to_dict()).unused_params == record
    old = plan.to_dict()
    del old["unused_params"]
    assert Plan.from_dict(old).unused_params is None


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"batches": 16, "never": ["nope.weight"], "sometimes": []}, r"profile.unused_params names \['nope.weight'\]"),
        ({"batches": 0, "never": [], "sometimes": []}, r"batches must be an integer between 1"),
        ({"batches": 4, "never": "x", "sometimes": []}, r"profile.unused_params.never must be list"),
        ({"batches": 4, "never": [], "sometimes": [], "extra": 1}, r"unknown field\(s\) \['extra'\]"),
    ],
)
def test_a_bad_record_is_refused_naming_the_field(record: dict[str, object], match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        Profile.from_dict({**synthetic_profile().to_dict(), "unused_params": record})


class _SkipsOnSomeBatches(nn.Module):
    """A layer that runs only on batches whose mean input is positive (as a router's capacity can leave an
    expert out of one batch in several)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.extra(h) if x.mean() > 0 else h


def test_ddps_unused_check_looks_at_several_batches() -> None:
    """`has_unused_parameters` decides DDP's `find_unused_parameters` in the benches: batch 0 alone uses every
    parameter here, so a one-batch check would build DDP without it, which fails on the next batch that skips."""
    from planner.runtime.ddp_hooks import has_unused_parameters

    model = _SkipsOnSomeBatches()
    batches = [torch.full((4, 8), 1.0), torch.full((4, 8), -1.0)]

    def loss(x: torch.Tensor) -> object:
        return lambda m: m(x).square().mean()

    assert not has_unused_parameters(model, loss(batches[0]))
    assert has_unused_parameters(model, [loss(x) for x in batches])
    assert not has_unused_parameters(model, [loss(batches[0])] * 2)
    assert all(p.grad is None for p in model.parameters())  # probed on a copy
