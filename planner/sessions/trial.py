"""`planner trial`: train the model's task with each compressor sent on every group, beside DDP, and record how
each trained against dense (`planner.contracts.trials`): its final loss, and the samples it needed to reach DDP's
half-way loss.

Each trial plan is the profile's exact mixed plan over one compressor (`make_mixed_plan(profile, [c])`: that
compressor on every group, the groups the solver's), run in the planner's runtime as a plan is run: top-k with
momentum in the exchange, PowerSGD and fp16 with it in the optimizer. The runs are those of `planner bench
--target-loss` (`planner.sessions.bench_target`): the same initial weights and batches for every variant in a
repeat, each repeat its own batches, round-robin so that a shared machine's noise falls on all alike. Each run's
evaluation curve (the loss at each snapshot, against the samples applied) is kept. No link is emulated: what a
trial measures, the loss after so many samples, does not depend on the network.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rich.table import Table

from planner.console import console
from planner.contracts.plan import DDP_ROW
from planner.contracts.profile import Profile
from planner.contracts.trials import DDP_KEY, DEFAULT_TOLERANCE, Curve, Trials
from planner.sessions.bench_target import TargetBenchConfig, run_target_bench
from planner.strategies.mixed_plan import make_mixed_plan
from planner.tasks import build_task
from planner.types import Compressor, CompressorKind, PlannerError

__all__ = ["TrialConfig", "print_trials", "run_trials", "trial_compressors"]


@dataclass(frozen=True, kw_only=True)
class TrialConfig:
    """What to try on which task, and for how long."""

    compressors: tuple[Compressor, ...]
    task: str
    samples: int
    repeats: int = 3
    lr: float | None = None  # None: the task's
    momentum: float = 0.9
    batch_size: int | None = None
    tolerance: float = DEFAULT_TOLERANCE
    show_progress: bool = True


def trial_compressors(profile: Profile, chosen: Sequence[Compressor] | None) -> tuple[Compressor, ...]:
    """The compressors to try: `chosen` (dense left out: DDP is the reference), or every one whose error the profile
    measured.

    Raises:
        PlannerError: one the profile did not measure (its costs, which the trial's plan is solved from).
    """
    measured = profile.errors.compressors if profile.errors is not None else ()
    out = tuple(c for c in (chosen if chosen is not None else measured) if c.kind is not CompressorKind.DENSE)
    if not out:
        raise PlannerError("nothing to try: give --compressors with at least one of fp16, powersgd:R, topk:D (the "
                           "profile measured no compression error to take them from)")
    return out


def run_trials(profile: Profile, config: TrialConfig) -> Trials | None:
    """Solve each compressor's plan, run the trials on the profile's world size (local gloo workers) and return what
    they measured (None on ranks other than 0, under torchrun).

    Raises:
        PlannerError: a bad task, samples or repeats; a compressor the profile did not measure.
    """
    task = build_task(profile.model.name, config.task, batch_size=config.batch_size)
    plans = [make_mixed_plan(profile, [c], source="trial", rows=False) for c in config.compressors]  # fast, alone
    labels = tuple(f"all {c}" for c in config.compressors)
    bench = TargetBenchConfig(
        plans=tuple(plans), labels=labels, model=profile.model.name, task=config.task,
        target_loss=math.inf,  # no target: a trial keeps the final losses only
        samples=config.samples, lr=config.lr, momentum=config.momentum, repeats=config.repeats, peers=(),
        nproc=profile.cluster.world_size, batch_size=config.batch_size, show_progress=config.show_progress,
        hosts=profile.cluster.host_count if profile.cluster.host_count > 1 else None, runs_called="trial runs")
    runs = run_target_bench(bench)
    if runs is None:
        return None

    def curves(variant: str) -> tuple[Curve, ...]:
        by_repeat = {r.repeat: tuple((n, loss if math.isfinite(loss) else None) for _, n, loss in r.curve)
                     for r in runs if r.variant == variant}
        return tuple(by_repeat[i] for i in range(config.repeats))

    def finals(variant: str) -> tuple[float | None, ...]:
        return tuple(curve[-1][1] for curve in curves(variant))

    reference = finals(DDP_ROW)
    if any(x is None for x in reference):
        raise PlannerError(f"DDP itself diverged on the {config.task} task at lr {config.lr or task.lr:g}: run the "
                           "trial with a lower --lr")
    return Trials(model=profile.model, task=config.task, world_size=profile.cluster.world_size,
                  samples=config.samples, lr=config.lr or task.lr, momentum=config.momentum,
                  reference=tuple(x for x in reference if x is not None), tolerance=config.tolerance,
                  compressors={c: finals(label) for c, label in zip(config.compressors, labels, strict=True)},
                  curves={DDP_KEY: curves(DDP_ROW), **{str(c): curves(label)
                                                      for c, label in zip(config.compressors, labels, strict=True)}})


def print_trials(trials: Trials, profile: Profile | None = None) -> None:
    """One row per compressor: its error as the profile measured it, its final loss over DDP's, the verdict."""
    table = Table(title=f"trials on {trials.model.name} ({trials.task} task), {trials.world_size} workers, "
                        f"{trials.samples:,} samples, SGD lr {trials.lr:g} momentum {trials.momentum:g}, "
                        f"{trials.repeats} repeat(s); like dense: final loss at most {1 + trials.tolerance:g}x "
                        "DDP's (the 90% interval's upper end)")
    columns = ["sent on every group", "error (profile)", "final loss per repeat", "vs DDP [90% interval]",
               "trained like dense"]
    if trials.curves is not None:
        columns.append("samples to DDP's half-way loss, vs DDP [90%]")
    for col in columns:
        table.add_column(col, justify="left" if col == "sent on every group" else "right")
    table.add_row("DDP (reference)", "0", ", ".join(f"{x:.4g}" for x in trials.reference), "1", "-",
                  *(["1"] if trials.curves is not None else []))
    for r in trials.results():
        error = "-"
        if profile is not None and profile.errors is not None and profile.errors.has(r.compressor):
            error = f"{profile.errors.uniform(r.compressor):.3g}"
        losses = ", ".join("diverged" if x is None else f"{x:.4g}" for x in trials.compressors[r.compressor])
        ratio = "-" if r.ratio is None else f"{r.ratio:.3f}" + (
            "" if r.low is None or r.high is None else f" [{r.low:.3f}, {r.high:.3f}]")
        samples = r.samples_missing if r.samples is None else r.samples.text()
        table.add_row(str(r.compressor), error, losses, ratio, "yes" if r.passed else "no",
                      *([samples] if trials.curves is not None else []), style="bold" if r.passed else None)
    console.print(table)
    passed = trials.passed()
    console.print("trained like dense: " + (", ".join(map(str, passed)) if passed else "none of those tried")
                  + ("" if trials.repeats > 1 else " (one repeat gives no interval: run --repeats 3)"))
