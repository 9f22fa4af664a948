"""The race in the first steps of training: the plan and its runners-up take turns on the user's own steps until the
race's rule settles which to keep (`GradientExchange(race=True)`).

`planner race` settles the same question before training, on steps of its own. Here every step trains: the first
steps of the user's run rotate through the finalists (the plan file's plan and its runners-up, `Plan.runners_up`) on
a schedule every rank draws alike, and the rule of `planner.strategies.race_rule` decides, as in `planner race`:

- a round runs each arm still in the race for one block of `OnlineRace.block` steps, in an order drawn anew each
  round from a seed every rank shares; the first step of a block carries the switch (the error fed back flushed, the
  groups rebuilt) and is not timed; an arm's block time is the mean of its other steps, each the time from one
  `synchronize()` to the next (the user's whole step: data, forward, backward, exchange, optimizer);
- at the end of a round the ranks take each block's slowest time (one all-reduce, which also carries the clock), so
  every rank observes the same numbers and settles the same rule the same round;
- the first round warms every arm up and is not observed.

Once the rule decides (or the budget, `max_rounds` and `max_seconds`, is spent: the simplest arm not beaten), the
exchange commits to the arm kept and says so in one log line; `exchange.race` holds the result. Switching arms is
what adaptive re-planning does (`GradientExchange._adopt`): the error each rank fed back is averaged into that step's
gradients and momentum velocities carry over parameter by parameter, so no step is lost to the race.

This is Horovod's autotuning of its fusion buffer on the first steps, with exact finalists and a stopping rule.
"""

from __future__ import annotations

import logging
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from planner.contracts.plan import Plan, plan_simplicity
from planner.sequential import DEFAULT_ALPHA, DEFAULT_MARGIN
from planner.types import DENSE_COMPRESSOR, Compressor, CompressorKind, Strategy

if TYPE_CHECKING:
    from planner.runtime.engine import StateCheck
    from planner.strategies.race_rule import RaceDecision

__all__ = ["BUCKET_ARMS", "OnlineRace", "OnlineRaceResult", "RaceSchedule", "bucket_arms", "check_race",
           "saved_race"]

#: Where the race in the first steps says what it kept (rank 0, INFO): the runtime's logger.
_LOG = logging.getLogger("planner.runtime")


@dataclass(frozen=True, kw_only=True)
class OnlineRace:
    """How the first steps of training race the plan's finalists.

    Attributes:
        block: steps each arm runs per round (at least 2: the first of a block is not timed).
        margin: the practical margin: a less simple arm is kept only when it is faster than every other by more.
        alpha: the chance that any statement the race settles is false.
        max_rounds: rounds after which the simplest arm not beaten is kept (the warm-up round not counted).
        max_seconds: seconds of racing after which the same (None: rounds alone bound the race).
        seed: the seed of the rounds' orders (the same on every rank).
    """

    block: int = 3
    margin: float = DEFAULT_MARGIN
    alpha: float = DEFAULT_ALPHA
    max_rounds: int = 40
    max_seconds: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 2:
            raise ValueError(f"OnlineRace.block must be an integer >= 2 (the first step of a block is not timed), "
                             f"but got {self.block!r}")
        if isinstance(self.max_rounds, bool) or not isinstance(self.max_rounds, int) or self.max_rounds < 1:
            raise ValueError(f"OnlineRace.max_rounds must be an integer >= 1, but got {self.max_rounds!r}")
        if self.max_seconds is not None and not self.max_seconds >= 0:
            raise ValueError(f"OnlineRace.max_seconds must be >= 0 or None, but got {self.max_seconds!r}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"OnlineRace.margin must be in [0, 1), but got {self.margin!r}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"OnlineRace.alpha must be in (0, 1), but got {self.alpha!r}")


@dataclass(frozen=True)
class OnlineRaceResult:
    """What the race in the first steps decided: the arm kept, by which rule, after how many rounds and steps, and
    each arm's median block time over the plan's ("plan": the plan file's own plan; None where they never ran in
    the same round)."""

    kept: str
    rule: str
    rounds: int
    steps: int
    seconds: float
    ratios: dict[str, float | None]
    beaten: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """The log line: "race: kept runner-up dense after 12 rounds (38 steps, 4.1 s): it beat every other arm
        beyond the margin; median step over the plan's: plan 1.000, runner-up dense 0.912"."""
        from planner.strategies.race_rule import why  # deferred: a job without race= loads no strategies

        ratios = ", ".join(f"{arm} {'-' if r is None else f'{r:.3f}'}" for arm, r in self.ratios.items())
        return (f"race: kept {self.kept} after {self.rounds} round(s) ({self.steps} steps, {self.seconds:.1f} s): "
                f"{why(self.rule, self.rounds)}; median step over the plan's: {ratios}")

    def to_dict(self) -> dict:
        return {"kept": self.kept, "rule": self.rule, "rounds": self.rounds, "steps": self.steps,
                "seconds": self.seconds, "ratios": dict(self.ratios), "beaten": dict(self.beaten)}


class RaceSchedule:
    """Which arm each step runs, and the rule's evidence round by round; every rank holds one and feeds it the same
    slowest times, so every rank switches and decides alike. `arms` are named simplest first; "plan" among them is
    the reference of the ratios."""

    def __init__(self, arms: Sequence[str], config: OnlineRace, *, start: str) -> None:
        from planner.strategies.race_rule import Race  # deferred: a job without race= loads no strategies

        self.config = config
        self.rule = Race(arms, margin=config.margin, alpha=config.alpha)
        self._order = random.Random(config.seed)
        self.round = 0  # rounds begun; round 1 is the warm-up
        self.steps = 0  # steps run while racing
        self.seconds = 0.0  # racing time, the slowest rank's (from the all-reduces)
        self.decision: RaceDecision | None = None
        self._queue: list[str] = [start]  # the arm in use finishes the step under way before the first round
        self._in_block = 0
        self._times: dict[str, list[float]] = {}
        self._begin_round(first=start)

    @property
    def current(self) -> str:
        """The arm the next step runs."""
        return self._queue[0]

    def _begin_round(self, first: str | None = None) -> None:
        """Draw the next round's order (the arm in use first in the warm-up round: one switch fewer)."""
        self.round += 1
        alive = list(self.rule.alive)
        order = self._order.sample(alive, len(alive))
        if first is not None and first in order:
            order.remove(first)
            order.insert(0, first)
        self._queue = order
        self._in_block = 0
        self._times = {arm: [] for arm in order}

    def after_step(self, seconds: float | None) -> bool:
        """The step just run on `current` took `seconds` (None: not timed, a step the exchange could not time).
        True when the round is complete: then `block_times` go to the ranks' all-reduce and `observe` takes the
        slowest."""
        self.steps += 1
        arm = self.current
        if self._in_block > 0 and seconds is not None:  # the block's first step carries the switch: untimed
            self._times[arm].append(seconds)
        self._in_block += 1
        if self._in_block < self.config.block:
            return False
        self._queue.pop(0)
        self._in_block = 0
        return not self._queue

    def block_times(self) -> list[float]:
        """This rank's block time of each arm of the round, in the arms' order (`Race.alive`); 0 for a block with no
        timed step (then the round is not observed)."""
        return [statistics.fmean(self._times[arm]) if self._times.get(arm) else 0.0 for arm in self.rule.alive]

    def observe(self, slowest: Sequence[float], seconds: float) -> RaceDecision | None:
        """The round's slowest block times (`block_times`' order, maxed over the ranks) and the racing time so far:
        the rule observes them (the warm-up round excepted), and the decision once there is one; the next round
        begins otherwise."""
        self.seconds = seconds
        if self.round > 1 and all(s > 0 for s in slowest):
            self.rule.observe(dict(zip(self.rule.alive, slowest, strict=True)))
        budget = self.rule.rounds >= self.config.max_rounds or (
            self.config.max_seconds is not None and seconds >= self.config.max_seconds)
        self.decision = self.rule.decision(out_of_budget=budget)
        if self.decision is None:
            self._begin_round()
        return self.decision

    def end_round(self, seconds: float, device: torch.device, group: dist.ProcessGroup | None,
                  world_size: int) -> OnlineRaceResult | None:
        """At a round's end (`after_step` said so), `seconds` of racing on this rank's clock: the ranks' slowest
        block times and clock (one all-reduce over `group` of `world_size` ranks), the rule's decision, and once
        there is one the result, said in one log line on the group's rank 0 (None: the race goes on)."""
        times = torch.tensor([*self.block_times(), seconds], dtype=torch.float64, device=device)
        if world_size > 1:
            dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        slowest = times.tolist()
        if self.observe(slowest[:-1], slowest[-1]) is None:
            return None
        result = self.result()
        if world_size == 1 or dist.get_rank(group) == 0:
            _LOG.info(result.describe())
        return result

    def result(self) -> OnlineRaceResult:
        """The decision as `exchange.race` holds it."""
        assert self.decision is not None
        reference = "plan" if "plan" in self.rule.arms else self.rule.arms[0]
        return OnlineRaceResult(kept=self.decision.kept, rule=self.decision.rule, rounds=self.decision.rounds,
                                steps=self.steps, seconds=self.seconds,
                                ratios={arm: self.rule.ratio(arm, reference) for arm in self.rule.arms},
                                beaten=dict(self.decision.beaten))


def check_race(plan: Plan, race: bool | OnlineRace, adaptive: object, density_warmup: object, crossover: object,
               *, needs_runners_up: bool = True) -> OnlineRace | None:
    """`race` as a configuration (None: no race), refused where it cannot run: a plan without runners-up (nothing to
    race it against, where `needs_runners_up`), or beside adaptive re-planning, a density warm-up or crossover."""
    if race is False:
        return None
    config = race if isinstance(race, OnlineRace) else OnlineRace() if race is True else None
    if config is None:
        raise ValueError(f"race must be True, False or an OnlineRace, but got {race!r}")
    if needs_runners_up and not plan.runners_up:
        raise ValueError("race=True races the plan against its runners-up, but this plan has none: solve with "
                         "`planner solve --strategy auto` (it records them), or race DDP's variants before training "
                         "with `planner race PLAN`")
    if adaptive not in (False, None) or density_warmup is not None or crossover is not None:
        raise ValueError("race=True runs without adaptive re-planning, a density warm-up or crossover; leave them out "
                         "(the race decides in the first steps; re-plan after it)")
    return config


#: The arms a race inside DDP adds to the plan: every bucket sent by one compressor (DDP's allreduce, its fp16 hook).
BUCKET_ARMS = {"every bucket dense": DENSE_COMPRESSOR, "every bucket fp16": Compressor(CompressorKind.FP16)}


def bucket_arms(plan: Plan) -> dict[str, Plan]:
    """The arms of a race inside DDP, whose buckets are the plan's groups, fixed: the plan, and the same groups each
    sent dense and each sent fp16 (what DDP and its fp16 hook send), where they differ from the plan; simplest
    first (the plan last among equals)."""
    arms: dict[str, Plan] = {}
    sent = [plan.compressor_of(g) for g in plan.groups]
    for name, compressor in BUCKET_ARMS.items():
        if all(c == compressor for c in sent):
            continue
        dense = compressor == DENSE_COMPRESSOR
        groups = tuple(replace(g, compressor=None if dense else compressor, k=None) for g in plan.groups)
        arms[name] = replace(plan, strategy=Strategy.DENSE if dense else Strategy.MIXED, density=None, selector=None,
                             compressors=None if dense else (compressor,), groups=groups, error=None, verdict=None,
                             intervals=None, race=None, runners_up={})
    arms["plan"] = plan
    return dict(sorted(arms.items(), key=lambda kv: plan_simplicity(kv[1])))


def saved_race(state: dict[str, Any], check: StateCheck, arms: dict[str, Plan]
               ) -> tuple[str | None, OnlineRaceResult | None]:
    """The arm a racing exchange or hook saved (`state["race_arm"]`) and its race's result (None, None: none saved),
    checked against the `arms` the one loading it has (PlanMismatchError, one line, else)."""
    if "race_arm" not in state:
        return None, None
    arm = state["race_arm"]
    if arm not in arms:
        raise check.refuse(f"the state's race arm {arm!r} is not among the arms here ({', '.join(arms)})")
    saved = state.get("race")
    if saved is None:
        return arm, None
    try:
        raced = OnlineRaceResult(**check.entry(saved, "the state's race"))
    except TypeError as exc:
        raise check.refuse(f"the state's race is not a race's result ({exc})") from None
    if raced.kept != arm:
        raise check.refuse(f"the state's race kept {raced.kept!r}, but its arm in use is {arm!r}")
    return arm, raced
