"""`planner race`: the plan's finalists raced in real steps, in the same worker processes, until the race's rule
(`planner.strategies.race_rule`) settles which to keep.

The finalists are what the bench would run minus what no user would keep: DDP, DDP with each of PyTorch's hooks
(and the project's top-k hook at a top-k plan's density), each plan inside DDP (`PlanHook`) where it runs there, and
each plan in the runtime (`GradientExchange`), with the plan's runners-up (the best plans of other structures its
solve found), listed simplest first. Each is built once, warmed up, and then timed
in rounds: every arm still in the race runs one block of steps per round, in an order drawn anew each round from a
seed every rank shares; each step's time is the slowest rank's, and an arm's block time the mean of its steps.
Every rank receives the same slowest times, so every rank settles the same rule on the same numbers, the same round.
DDP runs in every round, beaten or not, as the reference each arm's ratio is measured against.
"""

from __future__ import annotations

import datetime
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from planner.console import progress
from planner.contracts.jsonio import ensure_folder
from planner.contracts.plan import DDP_ROW, Plan, plan_simplicity
from planner.contracts.race_log import LoggedRace, RaceLog
from planner.contracts.race_record import RacedArm, RaceRecord
from planner.platform import launch  # its launchers called through it: tests replace them there
from planner.sequential import median_interval, weights_near
from planner.sessions.bench import (
    DEFAULT_PEERS,
    LOCAL,
    Runner,
    Variant,
    WorkerSetup,
    bench_backend,
    bench_variants,
    plan_tag,
)
from planner.strategies.auto import NEXT_GROUPING
from planner.strategies.race_rule import DEFAULT_ALPHA, DEFAULT_MARGIN, RATIO_GRID, Race, RaceDecision
from planner.types import Compressor, PlanMismatchError

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.progress import Progress

    from planner.platform.link import LinkRate
    from planner.platform.slowdown import Slowdown

__all__ = [
    "DEFAULT_ARMS",
    "RUNNER_UP",
    "RaceConfig",
    "Rounds",
    "beyond_budget",
    "finalists",
    "log_race",
    "race_rounds",
    "race_worker",
    "run_race",
    "with_race",
]

#: How many arms a race has at most by default: DDP, its hooks within the budget and the plan both ways always
#: race; the plan's runners-up fill the rest.
DEFAULT_ARMS = 6
#: How a runner-up's arm is named: "runner-up " and its name in `Plan.runners_up`.
RUNNER_UP = "runner-up "


@dataclass(frozen=True, kw_only=True)
class RaceConfig:
    """The plans whose finalists race, on which model and workers, and the race's rule and budget."""

    plans: tuple[Plan, ...]
    model: str
    peers: tuple[Compressor, ...] = DEFAULT_PEERS
    batch_size: int | None = None
    nproc: int = 2
    block: int = 2  # steps per arm per round: short blocks, more rounds (a round settles more than a longer block)
    warmup: int = 5
    margin: float = DEFAULT_MARGIN
    alpha: float = DEFAULT_ALPHA
    #: Wall-clock seconds of racing (after the warm-up) before the budget rule keeps the simplest arm not beaten.
    race_time_s: float = 60.0
    max_rounds: int = 500
    #: The most arms: the plans' runners-up fill what DDP, its hooks and the plans both ways leave (`finalists`).
    max_arms: int = DEFAULT_ARMS
    lr: float = 0.01
    seed: int = 0
    show_progress: bool = True
    link: LinkRate | None = None
    slowdown: Slowdown | None = None
    hosts: int | None = None
    labels: tuple[str, ...] = ()


def finalists(plans: tuple[Plan, ...], module: torch.nn.Module, peers: tuple[Compressor, ...] = DEFAULT_PEERS,
              labels: tuple[str, ...] = (), most: int = DEFAULT_ARMS) -> list[Variant]:
    """The arms of the race, simplest first: DDP, DDP with each hook, each plan inside DDP, then the plans in the
    runtime (each plan, and its runners-up: `Plan.runners_up`, the best plans of other structures its solve
    found), the less they compress the simpler. The runners-up fill what is left of `most` arms, in the order
    their solve predicted them; the other arms always race.

    The bench's other rows (local steps, one group per layer, a twin the profile did not model) are measurements
    beside the plan, not choices a user would keep, and do not race; nor do the hooks beyond a plan's error budget
    (`beyond_budget`): their error is not what the plan was asked to hold to."""
    beyond = beyond_budget(plans)
    variants = [v for v in bench_variants(plans, module, peers, list(labels))
                if not (v.local or v.name == LOCAL or v.name.startswith("per-layer ")
                        or v.name.endswith("(not modelled)") or v.name in beyond)]
    taken = {v.name for v in variants}
    for plan in plans:
        for name, other in plan.runners_up.items():
            label = f"{RUNNER_UP}{name}"
            if len(variants) < most and label not in taken:
                taken.add(label)
                interval = other.intervals.rows.get("plan") if other.intervals is not None else None
                variants.append(Variant(label, other, other.predicted.iteration_s, interval=interval))

    def simplicity(v: Variant) -> int:
        if v.name == DDP_ROW:
            return 0
        if v.hook is not None:
            return 1
        if v.via_ddp or v.plan is None:
            return 2
        return 3 + plan_simplicity(v.plan)  # in the runtime: dense, then lossless, then lossy

    return sorted(variants, key=simplicity)  # stable: the bench's order within each kind


def with_race(plan: Plan, record: RaceRecord) -> Plan:
    """`plan` with `record` of its race, to write back to its file. Where the race kept one of its runners-up, that
    runner-up becomes the file's plan (the runtime runs the file's plan), and the plan it replaced one of its
    runners-up, named by what it sends (`plan_tag`)."""
    if not record.kept.startswith(RUNNER_UP) or record.kept.removeprefix(RUNNER_UP) not in plan.runners_up:
        return replace(plan, race=record)
    name = record.kept.removeprefix(RUNNER_UP)
    tag = plan_tag(plan)
    # The replaced plan's next grouping stays a finalist, named as what it is now: another plan's next grouping.
    others = {(f"{key} of {tag}" if key == NEXT_GROUPING else key): other
              for key, other in plan.runners_up.items() if key != name}
    while tag in others or tag == name:
        tag += " (solved)"
    return replace(plan.runners_up[name], race=record,
                   runners_up={tag: replace(plan, runners_up={}, race=None), **others})


def log_race(path: Path, plan: Plan, record: RaceRecord, link: LinkRate | None) -> RaceLog:
    """Add the race of `plan` to the race log at `path` (`planner.contracts.race_log`: the pairs the model's error is
    calibrated from); the log as it was before, to weigh the race's predictions by the races before it."""
    before = RaceLog.load(path)
    ensure_folder(path.parent, "race log folder")
    before.with_race(LoggedRace(model=plan.model.name, world_size=plan.cluster.world_size,
                                link=None if link is None else link.label, race=record)).save(path)
    return before


def beyond_budget(plans: tuple[Plan, ...]) -> set[str]:
    """The DDP hooks ("ddp+C") some plan's verdict left unweighed because C's error is beyond its budget."""
    return {name for p in plans if p.verdict is not None for name in p.verdict.beyond_budget}


def race_worker(rank: int, world_size: int, config: RaceConfig, every_rank: bool = False) -> RaceRecord | None:
    """Build every finalist on this rank, warm each up, and race them; rank 0 returns the result (`every_rank`: every
    rank returns its own, which is rank 0's: each settles the rule on the same numbers)."""
    setup = WorkerSetup.on_this_rank(rank, world_size, config.model, config.batch_size, config.plans)
    device, batch, unused = setup.device, setup.batch, setup.find_unused
    arms = finalists(config.plans, setup.base.module, config.peers, config.labels, config.max_arms)
    runners = {v.name: Runner.build(v, config.model, batch_size=config.batch_size, lr=config.lr, device=device,
                                    find_unused=unused) for v in arms}
    show = config.show_progress and rank == 0
    with progress(enabled=show) as bar:
        task = bar.add_task("race warm-up", total=len(arms))
        for v in arms:
            runners[v.name].warm_up(v, config.warmup, batch)
            bar.advance(task)
        bar.remove_task(task)
        rounds = race_rounds([v.name for v in arms], DDP_ROW, lambda name: runners[name].step(batch), config.block,
                             config, device, bar)
    for runner in runners.values():
        runner.close()
    if rank != 0 and not every_rank:
        return None
    return rounds.record([(v.name, v.predicted_s) for v in arms], config)


@dataclass
class Rounds:
    """What `race_rounds` measured: the rule's evidence, the reference's block in every round, the decision."""

    race: Race
    reference: str
    reference_blocks: list[float]
    decision: RaceDecision
    block: int
    seconds: float

    def record(self, arms: list[tuple[str, float | None]], config: RaceConfig) -> RaceRecord:
        """The race's record: each arm (name, predicted seconds per step), simplest first, with its measured ratio
        to the reference, the ratio's anytime interval and the predicted ratio."""
        race, decision = self.race, self.decision
        predicted_reference = dict(arms)[self.reference]
        results = []
        for name, predicted_s in arms:
            blocks = self.reference_blocks if name == self.reference else race.blocks[name]
            ratios = [a / d for a, d in zip(blocks, self.reference_blocks, strict=False)]  # the rounds the arm ran
            predicted = (predicted_s / predicted_reference if predicted_s is not None and predicted_reference
                         else None)
            # The interval spends its error near the predicted ratio, known before the race (uniformly without one).
            weights = weights_near(RATIO_GRID, predicted) if predicted is not None else None
            interval = median_interval(ratios, RATIO_GRID, config.alpha, weights) if name != self.reference else None
            results.append(RacedArm(
                name=name, rounds=len(blocks), steps=len(blocks) * self.block,
                median_block_s=statistics.median(blocks), ratio_to_ddp=statistics.median(ratios) if ratios else None,
                interval=interval, predicted_ratio=predicted, beaten_by=decision.beaten.get(name),
                blocks_s=tuple(blocks)))
        return RaceRecord(raced=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                          kept=decision.kept, rule=decision.rule, rounds=decision.rounds, block=self.block,
                          margin=config.margin, alpha=config.alpha, seconds=self.seconds, arms=tuple(results),
                          reference=self.reference)


def race_rounds(names: list[str], reference: str, step: Callable[[str], float], block: int, config: RaceConfig,
                device: torch.device, bar: Progress) -> Rounds:
    """Race the arms `names` (simplest first) round by round until the rule decides: every arm still in the race
    runs `block` steps (`step(name)`: one step's seconds on this rank) per round, in an order drawn anew each round
    from a seed every rank shares; `reference` runs every round, beaten or not, as the arm every ratio is paired
    with. Each step's time is the slowest rank's and an arm's block the mean of its steps: every rank settles the
    rule on the same numbers, the same round."""
    race = Race(names, margin=config.margin, alpha=config.alpha)
    order = random.Random(config.seed)  # the same draws on every rank: every rank runs the arms in the same order
    task = bar.add_task(f"race rounds: {len(names)} arms", total=None)
    start = time.perf_counter()
    decision = None
    reference_blocks: list[float] = []
    elapsed = 0.0
    while decision is None:
        alive = race.alive
        timed = alive if reference in alive else (*alive, reference)
        times = {name: [step(name) for _ in range(block)] for name in order.sample(timed, len(timed))}
        flat = [t for name in timed for t in times[name]] + [time.perf_counter() - start]
        slowest = torch.tensor(flat, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # each step's slowest rank, and the longest clock
        maxed = slowest.tolist()
        this_round = {name: statistics.fmean(maxed[i * block:(i + 1) * block]) for i, name in enumerate(timed)}
        reference_blocks.append(this_round[reference])
        race.observe({name: this_round[name] for name in alive})
        elapsed = maxed[-1]
        decision = race.decision(out_of_budget=elapsed >= config.race_time_s or race.rounds >= config.max_rounds)
        bar.update(task, advance=1, description=f"race rounds: {len(race.alive)} of {len(names)} arms left")
    return Rounds(race=race, reference=reference, reference_blocks=reference_blocks, decision=decision, block=block,
                  seconds=elapsed)


def run_race(config: RaceConfig) -> RaceRecord | None:
    """Race the finalists of `config.plans` on `config.nproc` local workers (or torchrun's group); the result on
    rank 0, None on the other torchrun ranks."""
    for plan in config.plans:
        if plan.cluster.world_size != config.nproc:
            raise PlanMismatchError(f"the plan was made for world size {plan.cluster.world_size}, but --nproc is "
                                    f"{config.nproc}; re-plan: {plan.replan_command()}")
    return launch.run_job(race_worker, config.nproc, config, backend=bench_backend(config.plans), link=config.link,
                   slowdown=config.slowdown, hosts=config.hosts)
