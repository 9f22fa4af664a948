"""`planner bench --strategy abs`: wall-clock time to a target training loss for ABS-SGD against synchronous
SGD with equal and with speed-proportional batches, on N local workers (one of them slowed with --slowdown).

Variants, all from the same initial weights with the same SGD optimizer, each run until it has applied the
same number of samples (summed over the workers):

- abs-sgd: `planner.runtime.ABSSGD` with the plan's trigger and micro-batch;
- sync-equal: every worker computes global_batch / N samples per iteration, then `planner.runtime.GradientExchange`
  (the plan's groups, overlapped with backward) averages the gradients;
- sync-proportional: the same with the per-worker batches the plan split by measured speed; each worker's
  loss is scaled by N x its batch / global_batch, so the average is the sample-weighted mean.

The default optimizer is plain SGD (lr 0.4, no momentum): measured in one process on the digits at batch 256,
a gradient delayed by one update costs 0-8% more updates to reach a loss of 0.1 or 0.05 without momentum
(0.4, 0.5), but 2x with momentum 0.9 (lr 0.05: 175 updates against 90), and 6x at lr 0.1 (360 against 60). So
ABS-SGD is for optimizers that tolerate a one-step delay; `--momentum` shows the other side.

`--speed-change RANK=FACTOR` changes slowed workers' speed halfway through every run (once half the samples
are applied, the same moment on every rank): ABS-SGD's shares follow it, sync-proportional keeps the plan's
split.

Runs are repeated round-robin (abs-sgd, sync-equal, sync-proportional, abs-sgd, ...) so noise shows in the
spread. During a run rank 0 keeps a copy of the parameters every `snapshot_every_s` (taking one costs less
than a millisecond); after the run it evaluates them on a fixed evaluation batch, so the loss curve costs the
run no time. The time to target is the first snapshot at or below the target loss.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from rich.table import Table

from planner.console import console, progress
from planner.contracts.abs_section import ABS_VARIANTS
from planner.contracts.fingerprint import model_info
from planner.contracts.plan import Plan
from planner.models import build_workload
from planner.platform import launch  # its launchers called through it: tests replace them there
from planner.platform.launch import under_torchrun
from planner.platform.slowdown import current_slowdown, set_own_factor
from planner.runtime import ABSSGD, GradientExchange
from planner.sessions.bench import refuse_gpu_plans
from planner.types import PlanMismatchError, PlannerError

if TYPE_CHECKING:
    from planner.platform.link import LinkRate
    from planner.platform.slowdown import Slowdown

__all__ = ["ABSBenchConfig", "ABSRun", "VariantSummary", "abs_bench_worker", "print_abs_bench", "run_abs_bench",
           "summarise"]

#: The evaluation batch: this many samples drawn with this seed (the same for every run).
EVAL_SAMPLES, EVAL_SEED = 1024, 12_345


@dataclass(frozen=True, kw_only=True)
class ABSBenchConfig:
    """Which ABS plan to run, on which model, for how many samples, and the target."""

    plan: Plan
    model: str
    nproc: int = 2
    samples: int = 80_000  # per run, summed over the workers
    repeats: int = 3
    target_loss: float = 0.05
    lr: float = 0.4
    momentum: float = 0.0  # see the module docstring
    snapshot_every_s: float = 0.1
    show_progress: bool = True
    link: LinkRate | None = None
    slowdown: Slowdown | None = None
    hosts: int | None = None  # emulated hosts the local workers are spread over (`--hosts`)
    #: Halfway through every run (once half the samples are applied), these slowed workers change to these
    #: factors: a speed change the static split of sync-proportional does not follow.
    speed_change: Slowdown | None = None


@dataclass(frozen=True)
class ABSRun:
    """One run of one variant (measured on every rank; the curve from rank 0's snapshots)."""

    variant: str
    repeat: int
    wall_s: float
    samples: int  # applied, summed over the workers
    compute_s: tuple[float, ...]  # [rank] forward and backward
    idle_s: tuple[float, ...]  # [rank] waiting for the exchange (stragglers included)
    update_s: tuple[float, ...]  # [rank] optimizer steps
    worker_samples: tuple[int, ...]  # [rank] samples this worker computed
    updates: int  # optimizer steps (rounds with samples; iterations)
    changed_at: tuple[float, int] | None = None  # (seconds, samples applied) when the speed changed (rank 0)
    curve: tuple[tuple[float, int, float], ...] = ()  # (seconds, samples applied, evaluation loss)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s

    @property
    def samples_per_s_after_change(self) -> float | None:
        if self.changed_at is None or self.wall_s <= self.changed_at[0]:
            return None
        return (self.samples - self.changed_at[1]) / (self.wall_s - self.changed_at[0])

    def time_to(self, target: float) -> tuple[float, int] | None:
        """Seconds and samples at the first evaluation at or below `target` (None: not reached)."""
        return next(((t, n) for t, n, loss in self.curve if loss <= target), None)


@dataclass(frozen=True)
class VariantSummary:
    """The runs of one variant, summarised (medians over repeats), with the plan's prediction."""

    variant: str
    runs: int
    reached: int  # runs that reached the target
    time_to_target_s: float | None  # median over the runs that reached it
    time_range_s: tuple[float, float] | None
    samples_to_target: float | None
    samples_per_s: float
    predicted_samples_per_s: float
    samples_per_update: float  # median over runs: a round's (ABS-SGD) or an iteration's samples
    predicted_samples_per_update: float
    idle_fraction: tuple[float, ...]  # [rank] median over runs
    shares: tuple[float, ...]  # [rank] fraction of the samples computed
    final_loss: float
    samples_per_s_after_change: float | None = None  # median over runs, after a --speed-change
    speedup: float | None = None  # the better baseline's time to target / this one's

    @property
    def rel_error(self) -> float:
        return abs(self.predicted_samples_per_s - self.samples_per_s) / self.samples_per_s


def _variant_batches(plan: Plan, variant: str) -> tuple[int, ...]:
    assert plan.abs is not None
    return tuple(round(s) for s in plan.abs.predicted[variant].samples)


def _run(rank: int, world: int, config: ABSBenchConfig, variant: str, repeat: int, initial: float) -> ABSRun:
    """One run of `variant` on this rank (`initial`: its --slowdown factor, which a speed change leaves)."""
    plan = config.plan
    assert plan.abs is not None
    wl = build_workload(config.model)  # the same initial weights every run, on every rank
    model = wl.module
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    wl.make_batch(1, torch.Generator())  # loads the data set, if any, before the clock starts
    gen = torch.Generator().manual_seed(1_000_003 * repeat + 7919 * rank + ABS_VARIANTS.index(variant))
    compute = idle = update = 0.0
    computed = 0
    snapshots: list[tuple[float, int, dict[str, torch.Tensor]]] = []
    last_snapshot = -float("inf")

    def snapshot(now: float, applied: int) -> None:
        nonlocal last_snapshot
        if rank == 0 and now - last_snapshot >= config.snapshot_every_s:
            snapshots.append((now, applied, {k: v.detach().clone() for k, v in model.state_dict().items()}))
            last_snapshot = now

    if config.speed_change is not None and rank in config.speed_change.factors:
        set_own_factor(initial)  # every run starts at the --slowdown speed
    changed_at: tuple[float, int] | None = None
    start = 0.0

    def maybe_change_speed(applied: int) -> None:
        nonlocal changed_at
        if config.speed_change is not None and changed_at is None and applied * 2 >= config.samples:
            changed_at = (time.perf_counter() - start, applied)
            if rank in config.speed_change.factors:
                set_own_factor(config.speed_change.factor(rank))

    if variant == "abs-sgd":
        abs_sgd = ABSSGD(model, opt, plan, model_name=config.model)
        b = plan.abs.micro_batch
        dist.barrier()
        start = time.perf_counter()
        snapshot(0.0, 0)
        while abs_sgd.applied_samples < config.samples:
            x, y = wl.make_batch(b, gen)
            t0 = time.perf_counter()
            wl.loss_fn(model(x), y).backward()
            compute += time.perf_counter() - t0
            computed += b
            if abs_sgd.step(b):
                snapshot(time.perf_counter() - start, abs_sgd.applied_samples)
                maybe_change_speed(abs_sgd.applied_samples)
        abs_sgd.finish()
        wall = time.perf_counter() - start
        idle = sum(r.wait_s for r in abs_sgd.records)
        update = sum(r.update_s for r in abs_sgd.records)
        applied = abs_sgd.applied_samples
        updates = len(abs_sgd.updates)
    else:
        exchange = GradientExchange(model, plan, model_name=config.model)
        batches = _variant_batches(plan, variant)
        b, total = batches[rank], sum(batches)
        scale = world * b / total  # the average of the scaled gradients is the sample-weighted mean
        applied = 0
        dist.barrier()
        start = time.perf_counter()
        snapshot(0.0, 0)
        while applied < config.samples:
            x, y = wl.make_batch(b, gen)
            t0 = time.perf_counter()
            (wl.loss_fn(model(x), y) * scale).backward()
            t1 = time.perf_counter()
            exchange.synchronize()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            compute, idle, update = compute + (t1 - t0), idle + (t2 - t1), update + (t3 - t2)
            computed += b
            applied += total
            snapshot(t3 - start, applied)
            maybe_change_speed(applied)
        wall = time.perf_counter() - start
        exchange.close()
        updates = applied // total
    if rank == 0:
        snapshots.append((wall, applied, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    stats = torch.tensor([compute, idle, update, float(computed)], dtype=torch.float64)
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    curve = _evaluate(config, snapshots) if rank == 0 else ()
    return ABSRun(variant=variant, repeat=repeat, wall_s=wall, samples=applied,
                  compute_s=tuple(float(g[0]) for g in gathered), idle_s=tuple(float(g[1]) for g in gathered),
                  update_s=tuple(float(g[2]) for g in gathered),
                  worker_samples=tuple(int(g[3]) for g in gathered), updates=updates, changed_at=changed_at,
                  curve=curve)


def _evaluate(config: ABSBenchConfig, snapshots: list[tuple[float, int, dict[str, torch.Tensor]]]
              ) -> tuple[tuple[float, int, float], ...]:
    """The evaluation loss of each snapshot, until the first at or below the target, and of the last."""
    wl = build_workload(config.model)
    x, y = wl.make_batch(EVAL_SAMPLES, torch.Generator().manual_seed(EVAL_SEED))
    curve = []
    for i, (t, n, state) in enumerate(snapshots):
        wl.module.load_state_dict(state)
        with torch.no_grad():
            loss = float(wl.loss_fn(wl.module(x), y))
        curve.append((t, n, loss))
        if loss <= config.target_loss and i + 1 < len(snapshots):  # the rest only for the final loss
            wl.module.load_state_dict(snapshots[-1][2])
            with torch.no_grad():
                curve.append((snapshots[-1][0], snapshots[-1][1], float(wl.loss_fn(wl.module(x), y))))
            break
    return tuple(curve)


def abs_bench_worker(rank: int, world_size: int, config: ABSBenchConfig) -> list[ABSRun] | None:
    """Every run, round-robin over the variants; rank 0 returns them."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    runs = []
    initial = current_slowdown()
    show = config.show_progress and rank == 0
    with progress(enabled=show) as bar:
        task = bar.add_task("ABS-SGD bench runs", total=config.repeats * len(ABS_VARIANTS))
        for repeat in range(config.repeats):
            for variant in ABS_VARIANTS:
                runs.append(_run(rank, world_size, config, variant, repeat, initial))
                bar.advance(task)
    return runs if rank == 0 else None


def summarise(config: ABSBenchConfig, runs: list[ABSRun]) -> list[VariantSummary]:
    """Medians over the repeats of each variant, and each one's speed-up over the better baseline."""
    plan = config.plan
    assert plan.abs is not None
    out = []
    for variant in ABS_VARIANTS:
        mine = [r for r in runs if r.variant == variant]
        hits = [hit for r in mine if (hit := r.time_to(config.target_loss)) is not None]
        times = sorted(t for t, _ in hits)
        world = len(mine[0].compute_s)
        out.append(VariantSummary(
            variant=variant, runs=len(mine), reached=len(hits),
            time_to_target_s=statistics.median(times) if times else None,
            time_range_s=(times[0], times[-1]) if times else None,
            samples_to_target=statistics.median(n for _, n in hits) if hits else None,
            samples_per_s=statistics.median(r.samples_per_s for r in mine),
            predicted_samples_per_s=plan.abs.predicted[variant].samples_per_s,
            samples_per_update=statistics.median(r.samples / r.updates for r in mine),
            predicted_samples_per_update=sum(plan.abs.predicted[variant].samples),
            idle_fraction=tuple(statistics.median(r.idle_s[k] / r.wall_s for r in mine) for k in range(world)),
            shares=tuple(statistics.median(r.worker_samples[k] / sum(r.worker_samples) for r in mine)
                         for k in range(world)),
            final_loss=statistics.median(r.curve[-1][2] for r in mine),
            samples_per_s_after_change=statistics.median(after) if (after := [
                x for r in mine if (x := r.samples_per_s_after_change) is not None]) else None,
        ))
    baselines = [s.time_to_target_s for s in out if s.variant != "abs-sgd" and s.time_to_target_s is not None]
    best = min(baselines) if baselines else None
    return [s if best is None or s.time_to_target_s is None else
            VariantSummary(**{**asdict(s), "speedup": best / s.time_to_target_s}) for s in out]


def run_abs_bench(config: ABSBenchConfig) -> list[ABSRun] | None:
    """Bench the three variants on `config.nproc` local gloo workers (or torchrun's group): rank 0's runs."""
    plan = config.plan
    if plan.abs is None:
        raise PlanMismatchError("the plan has no abs section; make one with `planner solve PROFILE --strategy abs "
                                "--global-batch B`")
    if plan.cluster.world_size != config.nproc:
        raise PlanMismatchError(f"the plan was made for world size {plan.cluster.world_size}, but --nproc is "
                                f"{config.nproc}; re-plan: {plan.replan_command()}")
    if not config.target_loss > 0 or config.samples < 1 or config.repeats < 1:
        raise PlannerError(f"need --target-loss > 0, --samples >= 1 and --repeats >= 1, got {config.target_loss}, "
                           f"{config.samples}, {config.repeats}")
    if config.speed_change is not None:
        slowed = set(config.slowdown.factors) if config.slowdown is not None else set()
        unslowed = sorted(set(config.speed_change.factors) - slowed)
        if unslowed:
            raise PlannerError(f"--speed-change names rank(s) {unslowed} that --slowdown does not slow; a worker "
                               "changes speed from a --slowdown (e.g. --slowdown 1=1.5 --speed-change 1=3)")

    refuse_gpu_plans([plan], "--strategy abs")
    plan.check_compatible(model_info(build_workload(config.model).module, config.model), config.nproc,
                          hosts=None if under_torchrun() else config.hosts or 1)
    return launch.run_job(abs_bench_worker, config.nproc, config, backend="gloo", link=config.link,
                          slowdown=config.slowdown, hosts=config.hosts)


def print_abs_bench(config: ABSBenchConfig, runs: list[ABSRun], as_json: bool) -> None:
    summaries = summarise(config, runs)
    if as_json:
        console.print_json(json.dumps({"target_loss": config.target_loss, "samples": config.samples,
                                       "variants": [asdict(s) for s in summaries],
                                       "runs": [asdict(r) for r in runs]}))
        return
    slowed = config.slowdown.text if config.slowdown is not None else "none"
    if config.speed_change is not None:
        slowed += f", then {config.speed_change.text} halfway"
    table = Table(title=f"ABS-SGD bench on {config.model}, {config.nproc} workers (slowed: {slowed}): time to "
                        f"evaluation loss <= {config.target_loss:g}, median of {config.repeats} runs of "
                        f"{config.samples:,} samples")
    changing = config.speed_change is not None
    for col in ("variant", "time to target s", "range s", "samples to target", "vs better baseline",
                "samples/s", "predicted", "|pred-meas|/meas", "samples/update (pred)", "share per worker",
                "idle per worker", "final loss", *(("samples/s after the change",) if changing else ())):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for s in summaries:
        reached = f"{s.time_to_target_s:.2f}" if s.time_to_target_s is not None else "not reached"
        if s.time_to_target_s is not None and s.reached < s.runs:
            reached += f" ({s.reached}/{s.runs})"
        table.add_row(
            s.variant, reached,
            f"{s.time_range_s[0]:.2f}-{s.time_range_s[1]:.2f}" if s.time_range_s else "-",
            f"{s.samples_to_target:,.0f}" if s.samples_to_target is not None else "-",
            f"{s.speedup:.2f}x" if s.speedup is not None else "-",
            f"{s.samples_per_s:,.0f}", f"{s.predicted_samples_per_s:,.0f}", f"{s.rel_error:.1%}",
            f"{s.samples_per_update:,.0f} ({s.predicted_samples_per_update:,.0f})",
            " / ".join(f"{x:.0%}" for x in s.shares), " / ".join(f"{x:.0%}" for x in s.idle_fraction),
            f"{s.final_loss:.3f}",
            *((f"{s.samples_per_s_after_change:,.0f}" if s.samples_per_s_after_change is not None else "-",)
              if changing else ()),
            style="bold" if s.variant == "abs-sgd" else None,
        )
    console.print(table)
