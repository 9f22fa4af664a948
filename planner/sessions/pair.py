"""`planner pair`: which jobs sharing the same devices to cross over, from their plans (Muri-style pairing).

Each job is a plan from `planner solve` and its samples per iteration (`--batch`: plans have no batch size).
Its iteration alternates compute and exposed communication, read off the plan's predicted timeline
(`planner.contracts.pairing.job_phases`). Every two jobs are simulated together, crossed over and side by side
(`planner.costmodel.crossover.simulate_pair`), the exact pairing is solved (`planner.solvers.pairing`), and
the pairing plan is written (`planner.contracts.pairing`) and printed.

Only gradient plans (dense or top-k) are paired: a K-FAC plan's iterations also compute and exchange factors
and inverses on their own schedule, and an ABS-SGD plan's rounds stretch to cover the exchange, so neither is
the fixed compute/communicate cycle the crossover model assumes; both are refused with one line.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from planner.console import console
from planner.contracts.jsonio import check_output_path
from planner.contracts.pairing import MAX_SAMPLES, JobPrediction, PairingJob, PairingPlan
from planner.contracts.plan import Plan
from planner.costmodel.crossover import DEFAULT_ITERATIONS, simulate_pair
from planner.solvers.pairing import Pairing, best_pairing
from planner.types import PlanMismatchError, PlannerError

__all__ = ["job_names", "load_job_plan", "make_pairing", "parse_batch", "print_pairing", "run_pair"]


def parse_batch(text: str, count: int) -> list[int]:
    """`--batch N[,N...]`: one value for all `count` jobs, or one per job; PlannerError in one line if not."""
    values = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            value = 0
        if not 1 <= value <= MAX_SAMPLES:
            raise PlannerError(f"--batch must be whole numbers between 1 and {MAX_SAMPLES:,} separated by commas, "
                               f"but got {text!r}")
        values.append(value)
    if len(values) == 1:
        return values * count
    if len(values) != count:
        raise PlannerError(f"--batch gives {len(values)} values for {count} plans; give one value for every job, "
                           "or one per plan in the order of the plans")
    return values


def job_names(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Each plan file's stem, made unique with -2, -3, ... in the order given."""
    names: list[str] = []
    for path in paths:
        stem = Path(path).stem or "job"
        name, n = stem, 1
        while name in names:
            n += 1
            name = f"{stem}-{n}"
        names.append(name)
    return names


def load_job_plan(path: str | os.PathLike[str]) -> Plan:
    """The gradient plan at `path`; PlanMismatchError for a K-FAC or ABS-SGD plan (see the module docstring)."""
    plan = Plan.load(path)
    if plan.kfac is not None:
        raise PlanMismatchError(f"plan {path} is a K-FAC plan: its factor and inverse steps are not the compute/"
                                "communicate cycle a pairing models; pair gradient plans (`planner solve --strategy "
                                "dense` or `topk`)")
    if plan.abs is not None:
        raise PlanMismatchError(f"plan {path} is an ABS-SGD plan: its rounds stretch to cover the exchange instead "
                                "of alternating compute and communication; pair gradient plans (`planner solve "
                                "--strategy dense` or `topk`)")
    return plan


def make_pairing(jobs: Sequence[PairingJob], *, created: str | None = None,
                 iterations: int = DEFAULT_ITERATIONS) -> tuple[PairingPlan, Pairing]:
    """The best pairing of `jobs` and its pairing plan: jobs of the same world size may pair.

    Every two such jobs are simulated crossed over and side by side; a pair's period (what the solver
    minimises) is the larger of its two jobs' crossed-over periods.
    """
    phases = [job.phases for job in jobs]
    alone_s = [p.iteration_s for p in phases]
    crossed: dict[tuple[int, int], tuple[float, float]] = {}
    side: dict[tuple[int, int], tuple[float, float]] = {}
    interleaved: dict[tuple[int, int], tuple[float, float]] = {}
    for i in range(len(jobs)):
        for j in range(i + 1, len(jobs)):
            if jobs[i].world_size == jobs[j].world_size:
                crossed[(i, j)] = simulate_pair(phases[i], phases[j], gated=True, iterations=iterations)
                side[(i, j)] = simulate_pair(phases[i], phases[j], gated=False, iterations=iterations)
                interleaved[(i, j)] = simulate_pair(phases[i], phases[j], gated=False, iterations=iterations,
                                                    interleaved=True)
    pairing = best_pairing(alone_s, {pair: max(t) for pair, t in crossed.items()})
    predicted = [JobPrediction(alone_s=t, side_by_side_s=t, crossover_s=t, side_by_side_interleaved_s=t)
                 for t in alone_s]
    for i, j in pairing.pairs:
        for k, job in ((0, i), (1, j)):
            predicted[job] = JobPrediction(alone_s=alone_s[job], side_by_side_s=side[(i, j)][k],
                                           crossover_s=crossed[(i, j)][k],
                                           side_by_side_interleaved_s=interleaved[(i, j)][k])
    plan = PairingPlan(jobs=tuple(jobs), pairs=pairing.pairs, alone=pairing.alone, predicted=tuple(predicted),
                       created=created or dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    return plan, pairing


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def _interleaved_round_s(pairing: PairingPlan) -> float | None:
    """A round of the groups with the pairs side by side, the jobs interleaved (None: not predicted)."""
    best = [p.side_by_side_interleaved_s for p in pairing.predicted]
    if any(t is None for t in best):
        return None
    return sum(max(best[i] or 0.0, best[j] or 0.0) for i, j in pairing.pairs) + sum(best[k] or 0.0
                                                                                    for k in pairing.alone)


def print_pairing(pairing: PairingPlan, *, optimal: bool = True) -> None:
    """Per job its iteration alone, side by side and crossed over with its partner; the pairs; the totals."""
    sizes = sorted({job.world_size for job in pairing.jobs})
    table = Table(title=f"crossover pairing of {len(pairing.jobs)} jobs (world size {', '.join(map(str, sizes))}): "
                        "ms per iteration")
    for col in ("job", "model", "samples", "alone", "side by side (interleaved)", "crossover", "crossed over with"):
        table.add_column(col, justify="left" if col in ("job", "model", "crossed over with") else "right")
    for k, (job, p) in enumerate(zip(pairing.jobs, pairing.predicted, strict=True)):
        partner = pairing.partner(k)
        best = "" if p.side_by_side_interleaved_s is None else f" ({_ms(p.side_by_side_interleaved_s)})"
        table.add_row(job.name, job.model, f"{job.samples:,}", _ms(p.alone_s), _ms(p.side_by_side_s) + best,
                      _ms(p.crossover_s), "- (alone)" if partner is None else pairing.jobs[partner].name,
                      style=None if partner is None else "bold")
    console.print(table)
    totals = Table(title="all jobs, taking turns on the devices group by group (every job one iteration a round)")
    for col in ("pairs run", "round ms", "samples/s", "vs sequential"):
        totals.add_column(col, justify="left" if col == "pairs run" else "right")
    reference = pairing.samples_per_s("sequential")
    for mode, label in (("sequential", "one job after the other"), ("side_by_side", "side by side, in lockstep"),
                        ("side_by_side_interleaved", "side by side, interleaved"), ("crossover", "crossed over")):
        if mode == "side_by_side_interleaved":
            round_s = _interleaved_round_s(pairing)
            if round_s is None:
                continue
            rate = sum(job.samples for job in pairing.jobs) / round_s
        else:
            round_s, rate = pairing.round_s(mode), pairing.samples_per_s(mode)
        totals.add_row(label, _ms(round_s), f"{rate:,.1f}", f"{rate / reference:.2f}x",
                       style="bold" if mode == "crossover" else None)
    console.print(totals)
    names = [job.name for job in pairing.jobs]
    pairs = ", ".join(f"{names[i]} + {names[j]}" for i, j in pairing.pairs) or "none (no pair is faster crossed over)"
    alone = ", ".join(names[k] for k in pairing.alone) or "none"
    proof = "optimal" if optimal else "the best found, not proven optimal"
    console.print(f"pairs: {pairs}; alone: {alone} ({proof})")


def run_pair(paths: Sequence[str | os.PathLike[str]], batch: str, output: str | os.PathLike[str]) -> PairingPlan:
    """`planner pair PLAN [PLAN ...] --batch N[,N...] -o OUTPUT`: solve, print, write; returns the pairing plan."""
    target = check_output_path(output, "pairing plan")
    if not paths:
        raise PlannerError("give at least one plan")
    # realpath, not Path.resolve: a symlink loop among the plans is for load_job_plan to refuse in one line
    if any(os.path.realpath(path) == os.path.realpath(target) for path in paths):
        raise PlannerError(f"the output {output} is one of the plans; give the pairing plan another file name")
    samples = parse_batch(batch, len(paths))
    plans = [load_job_plan(path) for path in paths]
    sizes = {plan.cluster.world_size for plan in plans}
    if len(sizes) > 1:
        found = ", ".join(f"{path}: {plan.cluster.world_size}" for path, plan in zip(paths, plans, strict=True))
        raise PlanMismatchError(f"the jobs have different world sizes ({found}); jobs crossed over share the same "
                                "devices: pair plans made for one world size")
    jobs = [PairingJob.from_plan(plan, str(path), name=name, samples=n)
            for path, plan, name, n in zip(paths, plans, job_names(paths), samples, strict=True)]
    pairing, solved = make_pairing(jobs)
    print_pairing(pairing, optimal=solved.optimal)
    pairing.save(output)
    console.print(f"wrote pairing plan {output}")
    return pairing
