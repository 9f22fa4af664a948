"""`planner bench --plan P ... --target-loss L`: wall-clock time to a target evaluation loss of DDP, PyTorch's DDP
hooks and the plans, on a task whose loss means something (`planner.tasks`: the digits, or a student of a fixed
random teacher).

Every variant of the step-time bench but the local steps and the one-group-per-layer rows runs from the same
initial weights on the same batches (each rank its own, the same for every variant) until it has applied
`samples` samples (summed over the workers), round-robin over the variants and repeats so that the noise of a
shared machine falls on all of them alike. The optimizer is SGD with momentum for every variant, as a user would
run it: DDP and its hooks apply momentum in the optimizer (PowerSGD's paper does too), and so do the planner's
dense, fp16 and PowerSGD plans; a plan with top-k groups applies it in the exchange (Deep Gradient Compression's
momentum correction, the runtime's way for top-k) with the optimizer's momentum at 0.

During a run rank 0 keeps a copy of the parameters and buffers every `snapshot_every_s`; after the run it
evaluates them on the task's held-out batch (in eval mode), so the loss curve costs the run no time. The copies
are held within a share of the memory available (`snapshot_memory_fraction`) and at most `max_snapshots` of them:
when they reach that, every other one is dropped and the interval doubles, so a long run of a large model keeps an
evenly spaced, coarser curve (between a half and all of `max_snapshots` points) instead of running out of memory or
spending longer on evaluation than on training (an evaluation of ResNet-18 on the teacher's 256 held-out images
takes 4 s on a CPU). The time to target is the first snapshot at or below the target loss, so it is resolved to
the spacing of the snapshots: at worst 1/20 of the run at the default.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from rich.table import Table

from planner.console import console, progress
from planner.contracts.fingerprint import model_info
from planner.contracts.plan import Plan
from planner.platform import launch  # its launchers called through it: tests replace them there
from planner.platform.hosts import count_hosts
from planner.platform.memory import available_bytes
from planner.runtime.adaptive import Replanning, replannable
from planner.runtime.ddp_hooks import has_unused_parameters
from planner.sessions.bench import (
    DEFAULT_PEERS,
    LOCAL,
    Variant,
    bench_variants,
    ddp_with_hook,
    plan_hook_in_ddp,
    plan_tag,
    refuse_gpu_plans,
    sgd_as_advised,
)
from planner.tasks import Task, build_task
from planner.types import Compressor, PlanMismatchError, PlannerError

if TYPE_CHECKING:
    from planner.models import Workload
    from planner.platform.link import LinkRate
    from planner.platform.slowdown import Slowdown

__all__ = ["TASK_SAMPLES", "TargetBenchConfig", "TargetRun", "TargetSummary", "print_target_bench",
           "run_target_bench", "summarise_target"]

#: Per task: samples per run, summed over the workers (the learning rate is the task's, momentum 0.9).
TASK_SAMPLES: dict[str, int] = {"digits": 40_000, "text": 8_000, "teacher": 4_000}
#: Batches per rank on which a model is checked for parameters without a gradient before DDP is built.
UNUSED_PROBES = 4


@dataclass(frozen=True, kw_only=True)
class TargetBenchConfig:
    """Which plans and peers to run to a target loss, on which model and task, and how long."""

    plans: tuple[Plan, ...]
    model: str
    task: str
    target_loss: float
    samples: int
    lr: float | None = None  # None: the task's
    momentum: float = 0.9
    repeats: int = 1
    peers: tuple[Compressor, ...] = DEFAULT_PEERS
    nproc: int = 2
    batch_size: int | None = None
    #: Seconds between snapshots of the parameters, at least; taking one is kept under 5% of the run (a copy of
    #: an 80 MB model takes tens of milliseconds on a CPU).
    snapshot_every_s: float = 0.05
    #: Share of the memory available at the start of a run that its snapshots may take (`_Snapshots`).
    snapshot_memory_fraction: float = 0.25
    #: Most snapshots a run keeps, whatever the memory (each costs an evaluation after the run).
    max_snapshots: int = 40
    show_progress: bool = True
    link: LinkRate | None = None
    slowdown: Slowdown | None = None
    hosts: int | None = None  # emulated hosts the local workers are spread over (`--hosts`)
    #: The row name of each plan ("plan dense", `planner.sessions.bench.plan_labels`); empty: by the plans alone.
    labels: tuple[str, ...] = ()
    #: (start_density, steps) of a density warm-up for the top-k plans (`GradientExchange(density_warmup=)`);
    #: the other variants run without one. None: no warm-up.
    density_warmup: tuple[float, int] | None = None
    #: Also run each plan kept within an error budget re-planned every this many steps (`Replanning(every=)`), as a
    #: variant of its own ("... adaptive"). None: not.
    adaptive: int | None = None
    #: Also run each plan inside DDP (`PlanHook`, the row "plan X via DDP"), where PlanHook runs it; with `adaptive`,
    #: re-planned there too (its groups kept: DDP's buckets).
    via_ddp: bool = False
    #: What the progress bar calls the runs.
    runs_called: str = "runs to the target loss"


@dataclass(frozen=True)
class TargetRun:
    """One run of one variant: its wall time, samples and steps applied, and rank 0's loss curve."""

    variant: str
    repeat: int
    wall_s: float
    samples: int
    steps: int
    curve: tuple[tuple[float, int, float], ...]  # (seconds, samples applied, evaluation loss)
    replans: tuple[str, ...] = ()  # an adaptive variant's plan changes: "step S: what it sends now"

    def time_to(self, target: float) -> tuple[float, int] | None:
        """Seconds and samples at the first evaluation at or below `target` (None: not reached)."""
        return next(((t, n) for t, n, loss in self.curve if loss <= target), None)


@dataclass(frozen=True)
class TargetSummary:
    """The runs of one variant (medians over the repeats)."""

    variant: str
    runs: int
    reached: int
    time_to_target_s: float | None  # median over the runs that reached it
    samples_to_target: float | None
    final_loss: float
    step_s: float  # median wall time per step
    predicted_step_s: float | None
    speedup: float | None = None  # the best peer's time to target over this one's
    #: The prediction's interval (low, high) from the plan it came from (`Plan.intervals`); None where it has none.
    predicted_interval_s: tuple[float, float] | None = None


def _variants(plans: tuple[Plan, ...], module: torch.nn.Module, peers: tuple[Compressor, ...],
              labels: tuple[str, ...] = (), adaptive: bool = False, via_ddp: bool = False) -> list[Variant]:
    """DDP, the plans and the hooks of the step-time bench, without the local steps, the per-layer rows and (unless
    `via_ddp`) the plans run inside DDP; with `adaptive`, after each plan kept within an error budget the same plan
    re-planned as training goes (inside DDP too)."""
    out = []
    for v in bench_variants(plans, module, peers, labels):
        if v.name == LOCAL or v.name.startswith("per-layer") or (v.via_ddp and not via_ddp):
            continue
        out.append(v)
        if adaptive and v.plan is not None and not replannable(v.plan):
            out.append(replace(v, name=f"{v.name} adaptive", adaptive=True))
    return out


def _probe_loss(workload: Workload, x: torch.Tensor, y: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    return workload.loss_fn(module(x), y)


def _run(rank: int, world: int, config: TargetBenchConfig, variant: Variant, repeat: int, task: Task) -> TargetRun:
    """One run of `variant` on this rank, from the task's initial weights."""
    wl = task.workload
    initial = wl.module
    student = copy.deepcopy(initial)
    lr = config.lr or task.lr
    b = wl.batch_size
    gen = torch.Generator().manual_seed(1_000_003 * repeat + 7919 * rank)
    # Several batches: a router may leave an expert unused in some only, which DDP must be told as well.
    probes = [wl.make_batch(b, torch.Generator().manual_seed(rank + world * i)) for i in range(UNUSED_PROBES)]
    unused = has_unused_parameters(student, [functools.partial(_probe_loss, wl, x, y) for x, y in probes])
    plan = variant.plan
    schedule = None
    if variant.adaptive:
        assert config.adaptive is not None
        schedule = Replanning(every=config.adaptive)
    replanner: Any = None  # what re-plans, for its plan changes
    if variant.via_ddp:  # the plan inside DDP, SGD's momentum where the step-time bench puts it
        assert plan is not None
        in_hook = plan.sends_topk
        opt = torch.optim.SGD(student.parameters(), lr=lr, momentum=0.0 if in_hook else config.momentum)
        model, replanner = plan_hook_in_ddp(student, plan, find_unused=unused,
                                            momentum=config.momentum if in_hook else 0.0,
                                            optimizer=opt if in_hook or schedule is not None else None,
                                            adaptive=schedule)
        exchange = None
    else:
        model = student if plan is not None else ddp_with_hook(student, variant.hook, find_unused=unused,
                                                               selector=variant.selector)
        opt, exchange = sgd_as_advised(model, plan, lr=lr, momentum=config.momentum, find_unused=unused,
                                       model_name=config.model, density_warmup=config.density_warmup,
                                       adaptive=schedule)
        replanner = exchange
    state_bytes = sum(v.numel() * v.element_size() for v in student.state_dict().values())
    cap = min(config.max_snapshots, snapshot_cap(state_bytes, config.snapshot_memory_fraction))
    snapshots = _Snapshots(cap, config.snapshot_every_s)
    applied = steps = 0
    dist.barrier()
    start = time.perf_counter()
    while applied < config.samples:
        now = time.perf_counter() - start
        if rank == 0 and snapshots.due(now):
            snapshots.add(now, applied, {k: v.detach().clone() for k, v in student.state_dict().items()},
                          copy_s=time.perf_counter() - start - now)
        x, y = wl.make_batch(b, gen)
        opt.zero_grad(set_to_none=True)
        wl.loss_fn(model(x), y).backward()
        if exchange is not None:
            exchange.synchronize()
        opt.step()
        applied += b * world
        steps += 1
    wall = time.perf_counter() - start
    if exchange is not None:
        exchange.close()
    if rank == 0:
        snapshots.items.append((wall, applied, {k: v.detach().clone() for k, v in student.state_dict().items()}))
    curve = _evaluate(task, initial, snapshots.items, config.target_loss) if rank == 0 else ()
    changes = () if replanner is None else tuple(
        f"step {r.step}: {plan_tag(taken)}" for r, taken in _taken(replanner))
    return TargetRun(variant=variant.name, repeat=repeat, wall_s=wall, samples=applied, steps=steps, curve=curve,
                     replans=changes)


def _taken(exchange: Any) -> list[tuple[Any, Plan]]:
    """An adaptive exchange's (or PlanHook's) plan changes, each with the plan it took (the last one is the plan in
    use)."""
    return [(r, r.plan) for r in getattr(exchange, "replans", []) if r.changed and r.plan is not None]


def snapshot_cap(state_bytes: int, fraction: float) -> int:
    """How many copies of a model state of `state_bytes` fit in `fraction` of the memory available now (Linux's
    MemAvailable; 4 GiB where it cannot be read), at least 8."""
    available = available_bytes() or 4 << 30
    return max(8, int(fraction * available) // max(1, state_bytes))


class _Snapshots:
    """Copies of the model state during a run, at most `cap` of them, evenly spaced: at `cap` every other one is
    dropped (the first stays) and the interval doubles. A copy is taken at most every `min_interval_s`, and at
    most every 20 copy times, so taking them costs the run at most 5% of its time."""

    def __init__(self, cap: int, min_interval_s: float) -> None:
        if cap < 2:
            raise ValueError(f"`cap >= 2` must hold, but got cap={cap}")
        self.cap = cap
        self.items: list[tuple[float, int, dict[str, torch.Tensor]]] = []
        self._floor = min_interval_s
        self._interval = min_interval_s
        self._last = -float("inf")

    def due(self, now: float) -> bool:
        return now - self._last >= self._interval

    def add(self, now: float, applied: int, state: dict[str, torch.Tensor], *, copy_s: float = 0.0) -> None:
        self.items.append((now, applied, state))
        self._last = now
        if len(self.items) >= self.cap:
            self.items = self.items[::2]
            self._floor = 2 * self._interval
            self._last = self.items[-1][0]  # the next one follows the last kept at the new spacing
        self._interval = max(self._floor, 20 * copy_s)


def _evaluate(task: Task, initial: torch.nn.Module, snapshots: list[tuple[float, int, dict[str, torch.Tensor]]],
              target: float) -> tuple[tuple[float, int, float], ...]:
    """The evaluation loss of each snapshot until the first at or below the target, and of the last (of every one
    where the target is infinite: a trial's whole curve)."""
    module = copy.deepcopy(initial)
    module.train(False)  # evaluation mode
    curve: list[tuple[float, int, float]] = []
    for i, (t, n, state) in enumerate(snapshots):
        if math.isfinite(target) and curve and curve[-1][2] <= target and i + 1 < len(snapshots):
            continue  # reached: only the final loss is left to evaluate
        module.load_state_dict(state)
        curve.append((t, n, task.eval_loss(module)))
    return tuple(curve)


def target_bench_worker(rank: int, world_size: int, config: TargetBenchConfig) -> list[TargetRun] | None:
    """Every run, round-robin over the variants and repeats; rank 0 returns them."""
    torch.manual_seed(0)
    task = build_task(config.model, config.task, batch_size=config.batch_size)  # the data, once per process
    hosts = count_hosts()
    for plan in config.plans:
        plan.check_compatible(model_info(task.workload.module, config.model), world_size, hosts=hosts)
    variants = _variants(config.plans, task.workload.module, config.peers, config.labels, config.adaptive is not None,
                         config.via_ddp)
    runs = []
    with progress(enabled=config.show_progress and rank == 0) as bar:
        tick = bar.add_task(config.runs_called, total=config.repeats * len(variants))
        for repeat in range(config.repeats):
            for variant in variants:
                runs.append(_run(rank, world_size, config, variant, repeat, task))
                bar.advance(tick)
    return runs if rank == 0 else None


def summarise_target(config: TargetBenchConfig, runs: list[TargetRun], predicted: dict[str, float | None],
                     intervals: dict[str, tuple[float, float] | None] | None = None) -> list[TargetSummary]:
    """Medians over the repeats of each variant, and each one's speed-up over the best of DDP and its hooks, beside
    each variant's predicted step (and its interval, from `intervals`)."""
    out = []
    for name in dict.fromkeys(r.variant for r in runs):
        mine = [r for r in runs if r.variant == name]
        hits = [hit for r in mine if (hit := r.time_to(config.target_loss)) is not None]
        out.append(TargetSummary(
            variant=name, runs=len(mine), reached=len(hits),
            time_to_target_s=statistics.median(t for t, _ in hits) if hits else None,
            samples_to_target=statistics.median(n for _, n in hits) if hits else None,
            final_loss=statistics.median(r.curve[-1][2] for r in mine),
            step_s=statistics.median(r.wall_s / r.steps for r in mine),
            predicted_step_s=predicted.get(name), predicted_interval_s=(intervals or {}).get(name)))
    peers = [s.time_to_target_s for s in out if s.variant.startswith("ddp") and s.time_to_target_s is not None]
    best = min(peers) if peers else None
    return [s if best is None or s.time_to_target_s is None else
            TargetSummary(**{**asdict(s), "speedup": best / s.time_to_target_s}) for s in out]


def _predicted_ms(summary: TargetSummary) -> str:
    """The predicted step in ms, with its interval where the plan has one: "170.2 [161.0, 181.5]"."""
    if summary.predicted_step_s is None:
        return "-"
    text = f"{summary.predicted_step_s * 1e3:,.1f}"
    if summary.predicted_interval_s is not None:
        low, high = summary.predicted_interval_s
        text += f" [{low * 1e3:,.1f}, {high * 1e3:,.1f}]"
    return text


def run_target_bench(config: TargetBenchConfig) -> list[TargetRun] | None:
    """Run every variant to the target on `config.nproc` local gloo workers (or torchrun's group): rank 0's runs."""
    if not config.target_loss > 0 or config.samples < 1 or config.repeats < 1 or not (config.lr or 1) > 0:
        raise PlannerError(f"need --target-loss > 0, --samples >= 1, --repeats >= 1 and --lr > 0, got "
                           f"{config.target_loss}, {config.samples}, {config.repeats}, {config.lr}")
    if not 0 <= config.momentum < 1:
        raise PlannerError(f"`0 <= --momentum < 1` must hold, but got {config.momentum}")
    for plan in config.plans:
        if plan.cluster.world_size != config.nproc:
            raise PlanMismatchError(f"the plan was made for world size {plan.cluster.world_size}, but --nproc is "
                                    f"{config.nproc}; re-plan: {plan.replan_command()}")
        if plan.kfac is not None or plan.abs is not None:
            raise PlannerError("--target-loss with gradient plans runs dense, top-k and mixed plans; K-FAC and "
                               "ABS-SGD plans have their own benches (--strategy kfac, --strategy abs)")
    refuse_gpu_plans(config.plans, "--target-loss")
    build_task(config.model, config.task, batch_size=config.batch_size)  # a bad task is one line, before starting
    return launch.run_job(target_bench_worker, config.nproc, config, backend="gloo", link=config.link,
                          slowdown=config.slowdown, hosts=config.hosts)


def print_target_bench(config: TargetBenchConfig, runs: list[TargetRun], as_json: bool) -> None:
    task = build_task(config.model, config.task, batch_size=config.batch_size)
    variants = _variants(config.plans, task.workload.module, config.peers, config.labels,
                         config.adaptive is not None, config.via_ddp)
    summaries = summarise_target(config, runs, {v.name: v.predicted_s for v in variants},
                                 {v.name: v.interval for v in variants})
    if as_json:
        console.print_json(json.dumps({"target_loss": config.target_loss, "samples": config.samples,
                                       "task": config.task, "lr": config.lr or task.lr,
                                       "density_warmup": config.density_warmup,
                                       "variants": [asdict(s) for s in summaries], "runs": [asdict(r) for r in runs]}))
        return
    table = Table(title=f"time to evaluation loss <= {config.target_loss:g} on {config.model} ({config.task} task), "
                        f"{config.nproc} workers, SGD lr {config.lr or task.lr:g} momentum {config.momentum:g}, "
                        + (f"top-k density warm-up {config.density_warmup[0]:g} over {config.density_warmup[1]} "
                           "steps, " if config.density_warmup is not None else "")
                        + f"median of {config.repeats} run(s) of {config.samples:,} samples")
    for col in ("variant", "time to target s", "samples to target", "vs best DDP/hook", "final loss",
                "median step ms", "predicted step ms"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for s in summaries:
        reached = f"{s.time_to_target_s:.2f}" if s.time_to_target_s is not None else "not reached"
        if s.time_to_target_s is not None and s.reached < s.runs:
            reached += f" ({s.reached}/{s.runs})"
        table.add_row(s.variant, reached,
                      f"{s.samples_to_target:,.0f}" if s.samples_to_target is not None else "-",
                      f"{s.speedup:.2f}x" if s.speedup is not None else "-", f"{s.final_loss:.3f}",
                      f"{s.step_s * 1e3:,.1f}",
                      _predicted_ms(s), style="bold" if s.variant.startswith("plan") else None)
    console.print(table)
    for run in runs:
        if run.variant.endswith(" adaptive"):
            changes = "; ".join(run.replans) or "kept the plan it was given"
            console.print(f"{run.variant}, run {run.repeat + 1}: {changes}")
