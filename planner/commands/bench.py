"""`planner bench`: real training steps on N local workers, DDP against the runtime with and without the plan.

Variants run interleaved in short blocks (round-robin) in the same processes, so that the noise of a
shared machine falls on all of them alike; each step is timed from a barrier to the end of
`optimizer.step()`, and a step's time is the slowest rank's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from planner.console import progress
from planner.contracts.fingerprint import model_info
from planner.contracts.layers import gradient_layers
from planner.contracts.plan import Group, Plan
from planner.costmodel.problem import topk_count
from planner.models import build_workload
from planner.types import PlanMismatchError, Strategy

if TYPE_CHECKING:
    from planner.platform.link import LinkRate
    from planner.platform.slowdown import Slowdown

__all__ = [
    "LOCAL",
    "BenchConfig",
    "BenchResult",
    "Variant",
    "bench_variants",
    "bench_worker",
    "local_prediction",
    "machine_drift",
    "per_layer_plan",
    "run_bench",
]


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Which plans to run, on which model, and how many steps."""

    plans: tuple[Plan, ...]
    model: str
    batch_size: int | None = None
    nproc: int = 2
    steps: int = 20
    warmup: int = 5
    block: int = 5
    lr: float = 0.01
    show_progress: bool = True
    link: LinkRate | None = None
    slowdown: Slowdown | None = None


@dataclass(frozen=True, kw_only=True)
class BenchResult:
    """One variant's measured step times (seconds), its predicted time, and its speedup over `reference`
    (a variant measured in the same run)."""

    name: str
    strategy: str
    median_s: float
    p25_s: float
    p75_s: float
    steps: int
    predicted_s: float | None
    speedup: float | None = None
    reference: str = "ddp"

    @classmethod
    def from_samples(cls, name: str, strategy: str, samples: list[float], *, steps: int, predicted_s: float | None,
                     reference: str) -> BenchResult:
        """Median and quartiles of the samples (step times, or average step times over windows)."""
        q = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1 else [samples[0]] * 3
        return cls(name=name, strategy=strategy, median_s=statistics.median(samples), p25_s=q[0], p75_s=q[2],
                   steps=steps, predicted_s=predicted_s, reference=reference)

    @property
    def rel_error(self) -> float | None:
        if self.predicted_s is None:
            return None
        return abs(self.predicted_s - self.median_s) / self.median_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "strategy": self.strategy, "median_s": self.median_s, "p25_s": self.p25_s,
            "p75_s": self.p75_s, "steps": self.steps, "predicted_s": self.predicted_s,
            "speedup": self.speedup, "reference": self.reference, "rel_error": self.rel_error,
        }


def timed_step(
    model: torch.nn.Module,
    loss_fn: Any,
    batch: tuple[torch.Tensor, torch.Tensor],
    opt: torch.optim.Optimizer,
    *after_backward: Any,
) -> float:
    """Seconds of one training step from a barrier: forward, backward, `after_backward()` calls, update."""
    inputs, targets = batch
    dist.barrier()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss_fn(model(inputs), targets).backward()
    for finish in after_backward:
        finish()
    opt.step()
    return time.perf_counter() - t0


def slowest_rank(times: list[list[float]]) -> list[list[float]]:
    """Each step's time as the slowest rank's (a collective: every rank calls it)."""
    all_times = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(all_times, op=dist.ReduceOp.MAX)
    return all_times.tolist()


def per_layer_plan(plan: Plan, module: torch.nn.Module) -> Plan:
    """The same plan with one collective per layer (the WFBP baseline), in the plan's ready order."""
    spec = {s.name: s for s in gradient_layers(module)}
    groups = []
    for name in (lay for g in plan.groups for lay in g.layers):
        if name not in spec:
            raise PlanMismatchError(f"layer {name!r} of the plan is not a layer of the model")
        s = spec[name]
        k = None
        if plan.strategy is Strategy.TOPK:
            assert plan.density is not None
            k = topk_count(s.numel, plan.density)
        groups.append(Group(layers=(name,), params=s.params, numel=s.numel, k=k))
    wfbp = plan.baselines.get("wfbp", plan.predicted)
    return replace(plan, groups=tuple(groups), solver="wfbp", predicted=wfbp)


@dataclass(frozen=True)
class Variant:
    """One benched configuration: DDP (plan None), DDP with the top-k hook at a top-k plan's density and
    selector (`ddp_hook`), the runtime executing `plan`, or local steps that communicate nothing (`local`:
    each rank trains on its own, the compute every prediction is built on); `predicted_s` is the model's
    time for it."""

    name: str
    plan: Plan | None
    predicted_s: float | None
    ddp_hook: bool = False
    local: bool = False


#: Name of the variant of local steps (no communication).
LOCAL = "local (no communication)"


def local_prediction(plan: Plan) -> float:
    """The profile's forward + backward + update, as a dense plan's prediction holds it: its compute path
    less packing and interference (the whole step when nothing is communicated)."""
    p = plan.predicted
    return p.compute_s - p.pack_s - p.interference_s - p.selection_s - p.decode_s


def machine_drift(results: list[BenchResult]) -> float | None:
    """How much slower (> 0) or faster the local steps ran than the profile predicts, or None without them:
    a shared machine that is busier now than when it was profiled makes every prediction off as much."""
    local = next((r for r in results if r.name == LOCAL), None)
    if local is None or not local.predicted_s:
        return None
    return local.median_s / local.predicted_s - 1


def bench_variants(plans: tuple[Plan, ...], module: torch.nn.Module) -> list[Variant]:
    """Every variant the bench runs: DDP, then per plan one group per layer and the plan itself, and for a
    top-k plan DDP with the top-k hook (predicted as the plan's "ddp-25mb" baseline: top-k on 25 MB buckets)."""
    dense = next((p for p in plans if p.strategy is Strategy.DENSE), None)
    ddp_pred = (dense or plans[0]).baselines.get("ddp-25mb") if plans else None
    out = [Variant("ddp", None, ddp_pred.iteration_s if ddp_pred else None)]
    if dense is not None:
        out.append(Variant(LOCAL, None, local_prediction(dense), local=True))
    for plan in plans:
        tag = plan.strategy.value if plan.strategy is Strategy.DENSE else f"topk@{plan.density:g}"
        pl = per_layer_plan(plan, module)
        out.append(Variant(f"per-layer {tag}", pl, pl.predicted.iteration_s))
        out.append(Variant(f"plan {tag}", plan, plan.predicted.iteration_s))
        if plan.strategy is Strategy.TOPK:
            hooked = plan.baselines.get("ddp-25mb")
            out.append(Variant(f"ddp {tag} hook", plan, hooked.iteration_s if hooked else None, ddp_hook=True))
    return out


def bench_worker(rank: int, world_size: int, config: BenchConfig) -> list[BenchResult] | None:
    """Run every variant on this rank; rank 0 returns the results."""
    from torch.nn.parallel import DistributedDataParallel

    from runtime import GradientExchange, TopkHookState, topk_hook
    from runtime.ddp_hooks import has_unused_parameters

    torch.manual_seed(0)
    base = build_workload(config.model, batch_size=config.batch_size)
    for given in config.plans:
        given.check_compatible(model_info(base.module, config.model), world_size)
    variants = bench_variants(config.plans, base.module)
    gen = torch.Generator().manual_seed(1000 + rank)
    batch = base.make_batch(base.batch_size, gen)
    # A model with parameters the loss does not use: DDP and the exchange must be told (as a user would).
    unused = has_unused_parameters(base.module, lambda m: base.loss_fn(m(batch[0]), batch[1]))
    runners = []
    for v in variants:
        plan = v.plan
        wl = build_workload(config.model, batch_size=config.batch_size)  # same seed: same weights on every rank
        if v.local:
            model: torch.nn.Module = wl.module
            exchange = None
        elif plan is None or v.ddp_hook:
            wrapped = DistributedDataParallel(wl.module, find_unused_parameters=unused)
            if plan is not None:
                assert plan.density is not None
                wrapped.register_comm_hook(TopkHookState(plan.density, selector=plan.selector or "exact"), topk_hook)
            model = wrapped
            exchange = None
        else:
            model = wl.module
            exchange = GradientExchange(model, plan, find_unused_parameters=unused)
        opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
        runners.append((wl, model, exchange, opt))

    def step(i: int) -> float:
        wl, model, exchange, opt = runners[i]
        return timed_step(model, wl.loss_fn, batch, opt, *([exchange.synchronize] if exchange else []))

    n = len(variants)
    times: list[list[float]] = [[] for _ in range(n)]
    show = config.show_progress and rank == 0
    with progress(enabled=show) as bar:
        task = bar.add_task("bench steps", total=n * (config.warmup + config.steps))
        for i in range(n):
            for _ in range(config.warmup):
                step(i)
                bar.advance(task)
        while any(len(t) < config.steps for t in times):
            for i in range(n):
                for _ in range(min(config.block, config.steps - len(times[i]))):
                    times[i].append(step(i))
                    bar.advance(task)
    for _, _, exchange, _ in runners:
        if exchange is not None:
            exchange.close()
    slowest = slowest_rank(times)
    if rank != 0:
        return None
    results = [
        BenchResult.from_samples(v.name, "local" if v.local else "ddp" if v.plan is None else v.plan.strategy.value,
                                 row, steps=len(row),
                                 predicted_s=v.predicted_s, reference="ddp")
        for v, row in zip(variants, slowest, strict=True)
    ]
    ddp = results[0].median_s
    return [replace(r, speedup=ddp / r.median_s) for r in results]


def run_bench(config: BenchConfig) -> list[BenchResult] | None:
    """Bench every variant on `config.nproc` local gloo workers, or on torchrun's group (possibly across
    hosts) when launched by torchrun; the results on rank 0, None on the other torchrun ranks."""
    for plan in config.plans:
        if plan.cluster.world_size != config.nproc:
            raise PlanMismatchError(
                f"the plan was made for world size {plan.cluster.world_size}, but --nproc is {config.nproc}; "
                f"re-plan: {plan.replan_command()}"
            )
    from planner.platform.launch import run_job

    return run_job(bench_worker, config.nproc, config, backend="gloo", link=config.link, slowdown=config.slowdown)
