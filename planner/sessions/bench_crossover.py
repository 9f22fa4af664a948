"""`planner bench --strategy crossover`: two jobs on the same devices, one after the other, side by side
uncoordinated, and crossed over (`planner.runtime.crossover` gates), each job's throughput and the total, predicted
next to measured.

The jobs are the pairing plan's (`planner pair`): each runs its own plan with `planner.runtime.GradientExchange` on
its own local workers, as a separate launch would (its own process group). Rank r of every job is pinned to
CPU core r (mod the cores this process may use): core r is "device r", which the paired jobs' rank r share;
behind `--link` rank r of every job also shares host r's shaped network card.

- sequential: each job alone; the pair's throughput at equal progress (each job one iteration per turn) is
  (samples_A + samples_B) / (t_A + t_B), what running them one after the other gives;
- side-by-side: both at once, no gate: the kernel shares the cores and the network card;
- crossover: both at once, each rank taking the pair's gate for forward and backward;
- probed: both at once, the runtime's default: the pair measures itself gated and free for four windows of
  `probe_window_s` (`planner.runtime.crossover.ProbeSchedule`) and runs the mode that made more samples per second.
  Only the steps after both jobs have the decision count, so the row shows the steady state, not the probe.
  So that the concurrent modes compare like with like, side by side and crossed over also start their clocks
  only after running together that long (`settle_s`, six windows): two jobs started together begin in
  lockstep and take seconds to drift apart. Each job gets there (settled, or the decision taken) at its own
  step, so it steps on until the other has too and only then starts its clock: otherwise a loaded machine can
  let one job finish its timed steps before the other starts its own, and leave no window to count.

Steps are timed on rank 0 of each job (wall clock, the same host clock for both). For the two concurrent
modes the jobs start together (after their warm-up steps each job's rank 0 marks itself ready and waits for
the other's mark) and only the window in which both run counts: from the later start to the earlier end, each
job's steps finished inside it over its length. Data is made before the clock starts (a few batches, reused).
Modes run round-robin, `repeats` times, so noise shows in the spread; medians are reported.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from rich.table import Table

from planner.console import console, progress
from planner.contracts.plan import Plan
from planner.models import build_workload
from planner.platform import launch  # its launchers called through it: tests replace them there
from planner.runtime import GradientExchange
from planner.runtime.crossover import ProbeSchedule
from planner.sessions.bench import refuse_gpu_plans
from planner.types import DistributedError

if TYPE_CHECKING:
    from planner.platform.link import LinkRate

__all__ = ["MODES", "CrossoverBenchConfig", "CrossoverJob", "JobRun", "ModeSummary", "crossover_job_worker",
           "print_crossover_bench", "run_crossover_bench", "summarise_crossover"]

MODES = ("sequential", "side-by-side", "crossover", "probed")
#: The modes that take the pair's gate.
GATED_MODES = ("crossover", "probed")
#: How long a probed run goes on after its probe should have decided, waiting for the decision (seconds).
PROBE_GRACE_S = 60.0
#: How long a job's rank 0 waits for the other job to be ready before giving up (seconds).
READY_TIMEOUT_S = 300.0
#: Distinct batches made before the clock starts and reused.
BATCHES = 4


@dataclass(frozen=True, kw_only=True)
class CrossoverJob:
    """One job of the pair: its name, plan, built-in model and per-rank batch."""

    name: str
    plan: Plan
    model: str
    batch: int  # samples per rank per iteration

    @property
    def world_size(self) -> int:
        return self.plan.cluster.world_size

    @property
    def samples(self) -> int:
        """Samples per iteration, over the job's ranks."""
        return self.batch * self.world_size


@dataclass(frozen=True, kw_only=True)
class CrossoverBenchConfig:
    pairing: str  # the pairing plan's path (the workers hand it to GradientExchange)
    jobs: tuple[CrossoverJob, ...]
    #: job name -> {"alone_s", "side_by_side_s", "crossover_s", "side_by_side_interleaved_s" (may be None)}
    predicted: dict[str, dict[str, float | None]]
    steps: int = 30
    warmup: int = 3
    repeats: int = 3
    lr: float = 0.01
    link: LinkRate | None = None
    hosts: int | None = None  # emulated hosts each job's workers are spread over (`--hosts`)
    gate_dir: str | None = None
    #: the probed mode's windows (seconds); its warm-up is one window
    probe_window_s: float = 2.0
    show_progress: bool = True

    @property
    def settle_s(self) -> float:
        """Seconds the side-by-side and crossover runs go on together before their clocks start: about when the
        probed run decides (its warm-up, four windows and the window in which the measurements come in)."""
        return 6 * self.probe_window_s

    @property
    def probe(self) -> ProbeSchedule:
        return ProbeSchedule(warmup_s=self.probe_window_s, window_s=self.probe_window_s, every_s=None)


@dataclass(frozen=True)
class JobRun:
    """Rank 0's record of one job in one run."""

    job: str
    mode: str
    repeat: int
    stamps: tuple[float, ...]  # wall clock (time.time) at the start and after every timed step
    gate_wait_s: float  # seconds rank 0 waited for the pair's gate
    #: probed: when rank 0's timed steps under the probe's decision began (wall clock; once every job of the pair
    #: ran its probe to the end), the decision, and the pair's samples per second the probe measured (gated, free)
    decided_at: float | None = None
    decision: str | None = None
    probed_samples_per_s: tuple[float | None, float | None] | None = None

    def steps_within(self, start: float, end: float) -> int:
        return sum(1 for t in self.stamps[1:] if start < t <= end)

    @property
    def step_s(self) -> float:
        return (self.stamps[-1] - self.stamps[0]) / (len(self.stamps) - 1)


@dataclass(frozen=True)
class ModeSummary:
    """A mode's medians over the repeats: each job's seconds per iteration, the pair's samples per second."""

    mode: str
    step_s: dict[str, float]  # job -> measured seconds per iteration (median)
    predicted_step_s: dict[str, float]
    samples_per_s: float  # the pair's total (median)
    samples_range: tuple[float, float]
    predicted_samples_per_s: float
    gate_wait_s: dict[str, float]  # job -> rank 0's seconds waiting for the gate per iteration (median)
    speedup: float = 1.0  # total against the better baseline of sequential and side by side (gated modes)
    #: side by side: the model's best case (the jobs interleaved; `predicted_*` is lockstep), when predicted
    predicted_best_step_s: dict[str, float] | None = None
    predicted_best_samples_per_s: float | None = None
    #: probed: each repeat's decision, and the pair's samples/s its probe measured gated and free
    decisions: tuple[tuple[str, float | None, float | None], ...] = ()


def _pin(rank: int) -> None:
    """Rank r on core r (mod the cores allowed): "device r" of every job."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _wait_for_partners(ready_dir: str, job: str, names: list[str]) -> None:
    Path(ready_dir, job).touch()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not all(Path(ready_dir, n).exists() for n in names):
        if time.monotonic() > deadline:
            raise DistributedError(f"job {job} waited {READY_TIMEOUT_S:.0f} s for the other job to start; it did not")
        time.sleep(0.01)


def _rank0_says(go_on: bool) -> bool:
    """Rank 0's `go_on`, on every rank of the job (so that all run the same steps)."""
    flag = torch.tensor([int(go_on)])
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def crossover_job_worker(rank: int, world_size: int, config: CrossoverBenchConfig, job: int, mode: str,
                         repeat: int, ready_dir: str, together: list[str]) -> JobRun | None:
    """One job's rank in one run: warm up, start with the jobs in `together`, time `config.steps` steps."""
    torch.set_num_threads(1)
    _pin(rank)
    spec = config.jobs[job]
    wl = build_workload(spec.model, batch_size=spec.batch)
    model = wl.module
    opt = torch.optim.SGD(model.parameters(), lr=config.lr)
    exchange = GradientExchange(model, spec.plan, model_name=spec.model,
                                crossover=config.pairing if mode in GATED_MODES else None,
                                crossover_job=spec.name, crossover_dir=config.gate_dir,
                                crossover_probe=config.probe if mode == "probed" else False)
    gen = torch.Generator().manual_seed(1000 * job + rank)
    batches = [wl.make_batch(spec.batch, gen) for _ in range(BATCHES)]

    def step(i: int) -> None:
        x, y = batches[i % BATCHES]
        wl.loss_fn(model(x), y).backward()
        exchange.synchronize()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step_until_partners(mark: str, i: int, stamps: list[float] | None) -> int:
        """Mark this job `mark` and step on until every job in `together` has: the jobs reach a point (settled,
        probed) each at its own step, and the clock starts once all have, so that a job that got there late still
        finds the others running (else the window both ran in may be empty). Returns the next step's index."""
        if rank == 0:
            Path(ready_dir, f"{spec.name}.{mark}").touch()
        deadline = time.monotonic() + READY_TIMEOUT_S

        def all_there() -> bool:
            return all(Path(ready_dir, f"{n}.{mark}").exists() for n in together)

        while _rank0_says(not all_there() and time.monotonic() < deadline):
            step(i)
            i += 1
            if stamps is not None:
                stamps.append(time.time())
        if not _rank0_says(all_there()):
            raise DistributedError(f"job {spec.name} waited {READY_TIMEOUT_S:.0f} s for the other job to be "
                                   f"{mark}; it was not")
        return i

    try:
        for i in range(config.warmup):
            step(i)
        if rank == 0:
            _wait_for_partners(ready_dir, spec.name, together)
        dist.barrier()
        probe = exchange.gate.probe if exchange.gate is not None else None
        i = config.warmup
        if mode in ("side-by-side", "crossover"):  # settle as long as the probed run takes to decide
            settled = time.time() + config.settle_s
            while _rank0_says(time.time() < settled):
                step(i)
                i += 1
            i = step_until_partners("settled", i, stamps=None)
        waited = exchange.gate.waited_s if exchange.gate is not None else 0.0
        stamps = [time.time()]
        if probe is None:
            for _ in range(config.steps):
                step(i)
                i += 1
                stamps.append(time.time())
        else:  # until rank 0 runs the probe's decision (or gives up on it), then `steps` more: the timed ones
            give_up = probe.epoch + probe.schedule.warmup_s + 6 * probe.schedule.window_s + PROBE_GRACE_S
            while _rank0_says(not probe.applied and time.time() < give_up):
                step(i)
                i += 1
                stamps.append(time.time())
            i = step_until_partners("probed", i, stamps)  # each job takes the decision at its own next step
            decided_at = time.time() if probe.applied else None  # no broadcast per step from here, as elsewhere
            for _ in range(config.steps):
                step(i)
                i += 1
                stamps.append(time.time())
        waited = (exchange.gate.waited_s if exchange.gate is not None else 0.0) - waited
    finally:
        exchange.close()
    if rank != 0:
        return None
    if probe is None or not probe.applied:
        return JobRun(spec.name, mode, repeat, tuple(stamps), waited)
    decision = probe.applied[0][1]
    return JobRun(spec.name, mode, repeat, tuple(stamps), waited, decided_at=decided_at, decision=decision.mode,
                  probed_samples_per_s=(decision.gated_samples_per_s, decision.free_samples_per_s))


def run_crossover_bench(config: CrossoverBenchConfig) -> list[JobRun]:
    """Every mode, round-robin, `config.repeats` times; rank 0's record of each job in each run."""
    refuse_gpu_plans([job.plan for job in config.jobs], "--strategy crossover")
    runs: list[JobRun] = []
    names = [j.name for j in config.jobs]
    with progress(enabled=config.show_progress) as bar:
        task = bar.add_task("crossover bench runs", total=config.repeats * len(MODES))
        for repeat in range(config.repeats):
            for mode in MODES:
                with tempfile.TemporaryDirectory(prefix="planner-crossover-") as ready:
                    if mode == "sequential":
                        for index, spec in enumerate(config.jobs):
                            (result,) = launch.run_jobs([(crossover_job_worker, spec.world_size,
                                                          (config, index, mode, repeat, ready, [spec.name]))],
                                                        link=config.link, hosts=config.hosts, timeout=_timeout(config))
                            runs.append(result[0])
                    else:
                        results = launch.run_jobs([(crossover_job_worker, spec.world_size,
                                                    (config, index, mode, repeat, ready, names))
                                                   for index, spec in enumerate(config.jobs)],
                                                  link=config.link, hosts=config.hosts, timeout=_timeout(config))
                        runs += [r[0] for r in results]
                bar.advance(task)
    return runs


def _timeout(config: CrossoverBenchConfig) -> float:
    slowest = max(max(t for t in p.values() if t is not None) for p in config.predicted.values())
    return 120.0 + 20 * slowest * (config.steps + config.warmup) + 10 * config.probe_window_s + config.settle_s


def summarise_crossover(config: CrossoverBenchConfig, runs: list[JobRun]) -> list[ModeSummary]:
    """Per mode: medians over the repeats (see the module docstring for the windows)."""
    samples = {j.name: j.samples for j in config.jobs}
    key = {"sequential": "alone_s", "side-by-side": "side_by_side_s", "crossover": "crossover_s",
           "probed": "crossover_s"}
    out = []
    for mode in MODES:
        totals, steps, waits = [], {n: [] for n in samples}, {n: [] for n in samples}  # type: ignore[var-annotated]
        decisions = []
        for repeat in range(config.repeats):
            mine = {r.job: r for r in runs if r.mode == mode and r.repeat == repeat}
            if len(mine) != len(samples):
                continue
            if mode == "probed":
                first = next(iter(mine.values()))
                if any(r.decided_at is None for r in mine.values()):
                    continue  # the probe never decided: no steady state to count
                decisions.append((first.decision or "?", *(first.probed_samples_per_s or (None, None))))
            if mode == "sequential":
                for n, r in mine.items():
                    steps[n].append(r.step_s)
                totals.append(sum(samples.values()) / sum(r.step_s for r in mine.values()))
            else:
                # probed: from when both jobs run the probe's decision
                start = max(r.stamps[0] if r.decided_at is None else r.decided_at for r in mine.values())
                end = min(r.stamps[-1] for r in mine.values())
                if end <= start:
                    continue  # one job ended before the other started: they never ran together, nothing to count
                total = 0.0
                for n, r in mine.items():
                    done = r.steps_within(start, end)
                    steps[n].append((end - start) / done if done else float("inf"))
                    total += done * samples[n] / (end - start)
                totals.append(total)
            for n, r in mine.items():
                waits[n].append(r.gate_wait_s / (len(r.stamps) - 1))
        if not totals:
            continue
        predicted = {n: float(config.predicted[n][key[mode]] or 0.0) for n in samples}
        interleaved = {n: config.predicted[n].get("side_by_side_interleaved_s") for n in samples}
        best_step = ({n: float(t) for n, t in interleaved.items() if t is not None}
                     if mode == "side-by-side" and all(t is not None for t in interleaved.values()) else None)
        if mode == "sequential":
            predicted_total = sum(samples.values()) / sum(predicted.values())
        else:
            predicted_total = sum(samples[n] / predicted[n] for n in samples)
        out.append(ModeSummary(
            mode=mode, step_s={n: statistics.median(v) for n, v in steps.items()}, predicted_step_s=predicted,
            samples_per_s=statistics.median(totals), samples_range=(min(totals), max(totals)),
            predicted_samples_per_s=predicted_total,
            gate_wait_s={n: statistics.median(v) for n, v in waits.items()},
            predicted_best_step_s=best_step,
            predicted_best_samples_per_s=None if best_step is None else sum(samples[n] / best_step[n]
                                                                           for n in samples),
            decisions=tuple(decisions)))
    best = max(s.samples_per_s for s in out if s.mode not in GATED_MODES)  # sequential always counts
    return [ModeSummary(**{**asdict(s), "speedup": s.samples_per_s / best}) for s in out]


def print_crossover_bench(config: CrossoverBenchConfig, runs: list[JobRun], as_json: bool) -> None:
    summaries = summarise_crossover(config, runs)
    if as_json:
        console.print_json(json.dumps({"jobs": [{"name": j.name, "model": j.model, "samples": j.samples}
                                                for j in config.jobs],
                                       "modes": [asdict(s) for s in summaries], "runs": [asdict(r) for r in runs]}))
        return
    link = config.link.text if config.link is not None else "loopback"
    jobs = ", ".join(f"{j.name} ({j.model}, {j.samples} samples/iteration, {j.world_size} workers)"
                     for j in config.jobs)
    table = Table(title=f"Crossover bench on {link}: {jobs}; median of {config.repeats} runs of {config.steps} "
                        "steps (side by side predicted from the jobs interleaved to the jobs in lockstep)")
    table.add_column("mode", justify="left")
    for j in config.jobs:
        table.add_column(f"{j.name} ms/iteration (pred)", justify="right")
    for col in ("total samples/s", "range", "predicted", "vs better baseline", "gate wait ms/iteration"):
        table.add_column(col, justify="right")
    for s in summaries:
        def pred_step(name: str, s: ModeSummary = s) -> str:
            lockstep = f"{s.predicted_step_s[name] * 1e3:.1f}"
            best = s.predicted_best_step_s
            return lockstep if best is None else f"{best[name] * 1e3:.1f}-{lockstep}"

        total = f"{s.predicted_samples_per_s:,.0f}"
        if s.predicted_best_samples_per_s is not None:
            total = f"{total}-{s.predicted_best_samples_per_s:,.0f}"
        table.add_row(
            s.mode,
            *(f"{s.step_s[j.name] * 1e3:.1f} ({pred_step(j.name)})" for j in config.jobs),
            f"{s.samples_per_s:,.0f}", f"{s.samples_range[0]:,.0f}-{s.samples_range[1]:,.0f}",
            total, f"{s.speedup:.2f}x" if s.mode in GATED_MODES else "-",
            " / ".join(f"{s.gate_wait_s[j.name] * 1e3:.1f}" for j in config.jobs) if s.mode in GATED_MODES else "-",
            style="bold" if s.mode in GATED_MODES else None,
        )
    console.print(table)
    for mode in MODES:
        if mode not in {s.mode for s in summaries}:
            console.print(f"{mode}: no row: in no run did both jobs get to time steps together (the probe never "
                          "decided, or one job ended before the other began); try more --steps or --repeats")
    for s in summaries:
        if s.decisions:
            console.print(f"probed: {_decisions(s.decisions)} (windows of {config.probe_window_s:g} s)")


def _decisions(decisions: tuple[tuple[str, float | None, float | None], ...]) -> str:
    """Each repeat's probe: the mode it chose and the pair's samples/s it measured in each mode."""
    def samples(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f}"

    return "; ".join(f"ran {mode} (measured gated {samples(gated)}, free {samples(free)} samples/s)"
                     for mode, gated, free in decisions)
