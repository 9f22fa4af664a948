"""`planner bench --strategy kfac`: real K-FAC steps on N local workers, the plan against reference layouts.

Variants, all with the plan's gradient groups (runtime.GradientExchange) and the same SGD optimizer:

- local (no communication): each rank alone, forward, backward and update (how far the machine moved since
  the profile);
- local K-FAC (no communication): each rank alone on a process group of itself, all of K-FAC's work (every
  factor as an upper triangle, every inversion, every layer preconditioned), nothing sent: how far K-FAC's kernels
  moved since the profile, which the first row cannot show (plans solved before it was predicted do not run it);

- sgd: no preconditioning (what K-FAC costs on top of plain data-parallel SGD);
- everywhere: K-FAC, factors in 25 MB buckets, every factor inverted on every worker;
- kfac-pytorch: K-FAC as kfac-pytorch runs by default (COMM_OPT): whole factors in 25 MB buckets, each
  layer's two factors inverted on one worker, layers assigned largest summed d^3 first to the least-loaded
  worker, inverses broadcast and every worker preconditioning every layer;
- kaisa-mem-opt: the same, as kfac-pytorch's MEM_OPT: each layer preconditioned by its inverse worker,
  which broadcasts the preconditioned gradient (inverses never travel); with 2 workers this is also
  HYBRID_OPT (gradient-worker fraction 1/2);
- plan, everyone preconditions: the plan's buffers and owners with every worker preconditioning every
  layer (only when the plan gives some layer a preconditioner rank);
- plan: K-FAC with the plan's factor buffers, inversion owners and preconditioners.

The rows of kfac-pytorch's layouts run in this runtime, with this project's factor kernels, so the bench names
them as layouts ("COMM_OPT layout, this runtime"): they tell the layout's gain apart from the kernels'. When the
real kfac-pytorch is importable (installed into a bench environment only; never a dependency), the bench also runs
its `kfac.preconditioner.KFACPreconditioner` under DDP in COMM_OPT, MEM_OPT and HYBRID_OPT (one row where two of
them are the same gradient-worker fraction, as MEM_OPT and HYBRID_OPT are at 2 workers), in the same processes and
interleaved with the other variants, with the plan's intervals, method and skip pattern, its other settings at
their defaults (factor decay 0.95, KL clip 0.001, as this runtime's). Its gradients travel in DDP's buckets, not
in the plan's groups, and its copy of the model has in-place activations turned off (kfac-pytorch's backward
hooks refuse a hooked layer's output modified in place; the values are the same, the memory traffic a little
higher). Speed-ups are then against the real COMM_OPT, else against its layout in this runtime.

A K-FAC step is not like the next (factors every `factor_update_steps`, inverses every `inv_update_steps`),
so the unit of measurement is a window of `inv_update_steps` steps: its time divided by its steps is one
sample of the average step time the model predicts. Variants run window by window, round-robin, in the
same processes; each step is timed from a barrier, and a step's time is the slowest rank's.

After the plan's row, one row that is not a step: the plan's factor hooks (computing and packing A and G, the
runtime's `factor_seconds`) on each measured factor-update step, slowest rank, beside the profile's calibrated
time for them. The factors are most of what a K-FAC step adds to sgd on a CPU, and their kernels drift apart
from the rest of the compute on a shared machine: this row says how much of a K-FAC row's error that is, as the
local row does for the compute.
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from planner.console import err_console, progress
from planner.contracts.fingerprint import model_info
from planner.contracts.kfac_section import KFACSection, kfac_layers
from planner.contracts.plan import Plan
from planner.models import build_workload
from planner.platform import launch  # its launchers called through it: tests replace them there
from planner.platform.hosts import count_hosts
from planner.platform.launch import device_for
from planner.runtime import GradientExchange, KFACPreconditioner
from planner.runtime.calibrate import group_of_this_rank
from planner.sessions.bench import LOCAL, BenchResult, bench_backend, local_prediction, slowest_rank, timed_step
from planner.strategies.kfac_plan import LOCAL_KFAC, PLAN_EVERYONE, reference_sections
from planner.types import InverseMethod, PlanMismatchError

if TYPE_CHECKING:
    from planner.platform.link import LinkRate
    from planner.platform.slowdown import Slowdown

__all__ = ["FACTOR_HOOKS", "FACTOR_HOOKS_STRATEGY", "KFACBenchConfig", "kfac_bench_worker", "kfac_variants",
           "peer_available", "peer_variants", "run_kfac_bench"]

REFERENCE = "kfac-pytorch"
#: Bench rows of kfac-pytorch's layouts as this runtime runs them (the plan's baselines keep the short names).
LAYOUT_ROWS = {REFERENCE: "COMM_OPT layout, this runtime", "kaisa-mem-opt": "MEM_OPT layout, this runtime"}
#: The real kfac-pytorch's distributed strategies, and the row of the first (the speed-ups' reference).
PEER_STRATEGIES = ("COMM_OPT", "MEM_OPT", "HYBRID_OPT")
PEER_REFERENCE = "kfac-pytorch COMM_OPT"
#: The row (not a step) of the plan's factor hooks: computing and packing A and G on a factor-update step, the
#: largest compute term the K-FAC rows add to the sgd row, beside the profile's calibrated time for it.
FACTOR_HOOKS = "factor hooks in the plan's steps (A and G)"
FACTOR_HOOKS_STRATEGY = "kfac-factors"


@dataclass(frozen=True, kw_only=True)
class KFACBenchConfig:
    """Which K-FAC plan to run, on which model, and for how many steps."""

    plan: Plan
    model: str
    batch_size: int | None = None
    nproc: int = 2
    steps: int = 20
    warmup_windows: int = 1
    lr: float = 0.01
    damping: float = 1e-3
    show_progress: bool = True
    link: LinkRate | None = None
    slowdown: Slowdown | None = None
    hosts: int | None = None  # emulated hosts the local workers are spread over (`--hosts`)
    #: Also run the real kfac-pytorch when it is importable (`peer_available`).
    peer: bool = True

    @property
    def window(self) -> int:
        assert self.plan.kfac is not None
        return self.plan.kfac.inv_update_steps

    @property
    def windows(self) -> int:
        """Measured windows per variant: enough for `steps` steps, and at least three."""
        return max(3, math.ceil(self.steps / self.window))


def kfac_variants(plan: Plan) -> list[tuple[str, KFACSection | None, float | None]]:
    """(name, K-FAC section or None for plain SGD, predicted average step seconds) of every variant."""
    if plan.kfac is None:
        raise PlanMismatchError("the plan has no kfac section; make one with `planner solve PROFILE --strategy kfac`")
    refs = reference_sections(plan)
    baselines = plan.kfac.baselines or {}

    def predicted(name: str) -> float | None:
        p = baselines.get(name)
        return None if p is None else p.step_s

    local_kfac = []
    if LOCAL_KFAC in baselines:  # plans solved before it was predicted have no such row
        k = plan.kfac
        section = replace(KFACSection.simple(list(k.layers), method=k.method, factor_update_steps=k.factor_update_steps,
                                             inv_update_steps=k.inv_update_steps), skip=k.skip)
        local_kfac.append((LOCAL_KFAC, section, predicted(LOCAL_KFAC)))
    return [
        (LOCAL, None, local_prediction(plan)),
        *local_kfac,
        ("sgd", None, predicted("sgd")),
        *((name, refs[name], predicted(name)) for name in ("everywhere", REFERENCE, "kaisa-mem-opt", PLAN_EVERYONE)
          if name in refs),
        ("plan", plan.kfac, None if plan.kfac.predicted is None else plan.kfac.predicted.step_s),
    ]


def peer_available() -> bool:
    """Whether the real kfac-pytorch can be imported here (its `kfac.preconditioner`)."""
    try:
        return importlib.util.find_spec("kfac.preconditioner") is not None
    except (ImportError, ValueError):  # a `kfac` that is not kfac-pytorch's package, or one not installed
        return False


def peer_variants(world_size: int) -> list[tuple[str, str]]:
    """(row name, kfac-pytorch `DistributedStrategy` name) of the real library's rows: one per distinct
    gradient-worker fraction (COMM_OPT 1, MEM_OPT 1/world, HYBRID_OPT 1/2), named by every strategy it stands
    for ("kfac-pytorch MEM_OPT = HYBRID_OPT" at 2 workers)."""
    fractions = {"COMM_OPT": 1.0, "MEM_OPT": 1.0 / world_size, "HYBRID_OPT": 0.5}
    rows: dict[float, list[str]] = {}
    for name in PEER_STRATEGIES:
        rows.setdefault(fractions[name], []).append(name)
    return [("kfac-pytorch " + " = ".join(names), names[0]) for names in rows.values()]


def _peer_runner(config: KFACBenchConfig, strategy: str, device: torch.device) -> tuple:
    """The real kfac-pytorch preconditioning a fresh copy of the model under DDP, with the plan's intervals,
    method and skip pattern: (workload, DDP model, its step, SGD)."""
    from kfac.enums import ComputeMethod, DistributedStrategy  # optional extra: kfac-pytorch
    from kfac.preconditioner import KFACPreconditioner as PeerPreconditioner  # optional extra: kfac-pytorch

    k = config.plan.kfac
    assert k is not None
    wl = build_workload(config.model, batch_size=config.batch_size)  # the same weights as every variant's
    # kfac-pytorch's full backward hooks refuse a hooked layer's output changed in place (ReLU(inplace=True)):
    # the same activations, out of place.
    for module in wl.module.modules():
        if isinstance(module, (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.Hardtanh, nn.SiLU, nn.Dropout)):
            module.inplace = False
    model = DistributedDataParallel(wl.module.to(device))
    peer = PeerPreconditioner(
        model, factor_update_steps=k.factor_update_steps, inv_update_steps=k.inv_update_steps,
        damping=config.damping, lr=config.lr, grad_worker_fraction=DistributedStrategy[strategy],
        compute_method=ComputeMethod.EIGEN if k.method == InverseMethod.EIGEN else ComputeMethod.INVERSE,
        skip_layers=[k.skip] if k.skip is not None else [])
    hooked = sorted(re.sub(r"^module\.", "", name) for name, _ in peer._layers.values())
    if hooked != sorted(spec.name for spec in k.layers):
        raise PlanMismatchError(f"kfac-pytorch preconditions {len(hooked)} layers of {config.model} where the plan "
                                f"has {len(k.layers)}, so their steps do not compare; run with --peers none")
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    return wl, model, peer.step, opt


def kfac_bench_worker(rank: int, world_size: int, config: KFACBenchConfig) -> list[BenchResult] | None:
    """Run every variant on this rank; rank 0 returns the results."""
    torch.manual_seed(0)
    plan = config.plan
    backend = dist.get_backend()
    device = device_for(backend)
    base = build_workload(config.model, batch_size=config.batch_size)
    plan.check_compatible(model_info(base.module, config.model), world_size, hosts=count_hosts(), backend=backend)
    variants = kfac_variants(plan)
    runners, closers = [], []
    plan_runtime: KFACPreconditioner | None = None  # the plan's, whose factor hooks are timed
    alone = group_of_this_rank(None) if any(name == LOCAL_KFAC for name, _, _ in variants) else None
    for name, section, _pred in variants:
        wl = build_workload(config.model, batch_size=config.batch_size)  # same seed: same weights on every rank
        wl.module.to(device)
        # After backward: the SGD variant waits for its gradient exchange; K-FAC's step() does that and more.
        runtime_part: GradientExchange | KFACPreconditioner
        if name == LOCAL:  # each rank on its own: the compute every prediction is built on
            opt = torch.optim.SGD(wl.module.parameters(), lr=config.lr, momentum=0.9)
            runners.append((wl, wl.module, lambda: None, opt))
            continue
        if section is None:
            runtime_part = GradientExchange(wl.module, plan)
            finish = runtime_part.synchronize
        elif name == LOCAL_KFAC:  # each rank on its own (a group of itself): all of K-FAC's work, nothing sent
            runtime_part = KFACPreconditioner(wl.module, kfac=section, process_group=alone, lr=config.lr,
                                              damping=config.damping)
            finish = runtime_part.step
        else:
            runtime_part = KFACPreconditioner(wl.module, plan=plan, kfac=section, lr=config.lr, damping=config.damping)
            finish = runtime_part.step
            if name == "plan":
                plan_runtime = runtime_part
        opt = torch.optim.SGD(wl.module.parameters(), lr=config.lr, momentum=0.9)
        runners.append((wl, wl.module, finish, opt))
        closers.append(runtime_part.close)
    peers = peer_variants(world_size) if config.peer and peer_available() else []
    for name, strategy in peers:
        runners.append(_peer_runner(config, strategy, device))
        variants.append((name, None, None))
    gen = torch.Generator().manual_seed(1000 + rank)
    inputs, targets = base.make_batch(base.batch_size, gen)
    batch = (inputs.to(device), targets.to(device))

    plan_index = next(i for i, (name, _, _) in enumerate(variants) if name == "plan")
    hook_times: list[float] = []  # the plan's factor hooks on each measured factor-update step

    def step(i: int, measured: bool = False) -> float:
        wl, model, finish, opt = runners[i]
        if i != plan_index or plan_runtime is None:
            return timed_step(model, wl.loss_fn, batch, opt, finish)
        factor_step = plan_runtime.steps % plan_runtime.factor_update_steps == 0
        before = plan_runtime.factor_seconds
        seconds = timed_step(model, wl.loss_fn, batch, opt, finish)
        if measured and factor_step:
            hook_times.append(plan_runtime.factor_seconds - before)
        return seconds

    n, window = len(variants), config.window
    times: list[list[float]] = [[] for _ in range(n)]
    show = config.show_progress and rank == 0
    with progress(enabled=show) as bar:
        task = bar.add_task("K-FAC bench steps", total=n * window * (config.warmup_windows + config.windows))
        for i in range(n):
            for _ in range(window * config.warmup_windows):
                step(i)
                bar.advance(task)
        for _ in range(config.windows):
            for i in range(n):
                for _ in range(window):
                    times[i].append(step(i, measured=True))
                    bar.advance(task)
    for close in closers:
        close()
    slowest = slowest_rank(times, device)
    slowest_hooks = slowest_rank([hook_times], device)[0] if hook_times else []
    if rank != 0:
        return None
    reference = PEER_REFERENCE if peers else LAYOUT_ROWS[REFERENCE]
    results = []
    intervals = (plan.kfac.intervals if plan.kfac is not None else None) or {}
    for (name, _section, pred), row in zip(variants, slowest, strict=True):
        per_window = [sum(row[w * window:(w + 1) * window]) / window for w in range(config.windows)]
        strategy = "local" if name in (LOCAL, LOCAL_KFAC) else "sgd" if name == "sgd" else "kfac"
        results.append(replace(BenchResult.from_samples(LAYOUT_ROWS.get(name, name), strategy, per_window,
                                                        steps=len(row), predicted_s=pred, reference=reference),
                               predicted_interval=intervals.get(name)))
    ref = next(r.median_s for r in results if r.name == reference)
    results = [replace(r, speedup=ref / r.median_s) for r in results]
    if slowest_hooks and not batch[0].is_cuda:  # on a GPU the hooks only launch kernels
        assert plan.kfac is not None
        predicted = plan.kfac.predicted
        results.insert(next(i for i, r in enumerate(results) if r.name == "plan") + 1, BenchResult.from_samples(
            FACTOR_HOOKS, FACTOR_HOOKS_STRATEGY, slowest_hooks, steps=len(slowest_hooks), reference=reference,
            predicted_s=None if predicted is None else predicted.factor_compute_s))
    return results


def run_kfac_bench(config: KFACBenchConfig) -> list[BenchResult] | None:
    """Bench every K-FAC variant on `config.nproc` local workers (on the backend the plan was profiled on), or on
    torchrun's group when launched by torchrun; the results on rank 0, None on the other torchrun ranks."""
    plan = config.plan
    if plan.kfac is None:
        raise PlanMismatchError("the plan has no kfac section; make one with `planner solve PROFILE --strategy kfac`")
    if plan.cluster.world_size != config.nproc:
        raise PlanMismatchError(
            f"the plan was made for world size {plan.cluster.world_size}, but --nproc is {config.nproc}; "
            f"re-plan: {plan.replan_command()}"
        )

    module = build_workload(config.model, batch_size=config.batch_size).module
    plan.check_compatible(model_info(module, config.model), config.nproc)
    plan.kfac.check_layers(kfac_layers(module, plan.kfac.skip))  # the layers it was profiled with
    if config.peer and not peer_available():
        err_console.print("kfac-pytorch is not importable here: the bench runs its layouts in this runtime only; "
                          "for rows of the real library, install it into a bench environment (make bench-env) and "
                          "run .venv-bench/bin/planner bench ...")
    return launch.run_job(kfac_bench_worker, config.nproc, config, backend=bench_backend((plan,)), link=config.link,
                          slowdown=config.slowdown, hosts=config.hosts)
