"""The race's rule: which of a few finalists to keep, decided by measurement as the rounds come in.

The finalists are timed in rounds: in each round every arm still in the race runs one block of steps (in an order
drawn anew each round, the same on every rank), and its block time is the mean of its steps' slowest-rank times.
Within a round the arms ran back to back on the same machine, so a round pairs them: for each ordered pair (a, b)
the race watches the event "b's block took longer than (1 + margin) times a's" with a `HalfBet`
(`planner.sequential`: anytime-valid, so the race may stop the round it is settled).

- b is *beaten* by a once the event is settled to happen more than half the time: b's median block is slower than
  a's by more than the margin. A beaten arm leaves the race.
- a and b are *within the margin* of each other once each of the two events (b slower than a beyond the margin, a
  slower than b beyond it) is settled to happen less than half the time.

The race ends, after a round, on the first of:

1. one arm has beaten every other arm still in the race (or is the only one left): keep it ("won");
2. the arms still in the race are all within the margin of each other: keep the simplest of them ("tied");
3. the budget of rounds or time is spent ("budget"): keep the simplest arm not beaten whose median block ratio to
   each other arm not beaten is within the margin (no arm faster than it beyond the margin, by estimate); where there
   is none such, the fastest by estimate; with fewer than `MIN_ESTIMATE_ROUNDS` rounds, too few to go by estimates,
   the simplest arm not beaten.

The budget rule decides on estimates, not on settled evidence: when the budget is spent something must be kept. A
rule that kept the simplest arm not beaten whatever the estimates said kept DDP's fp16 hook in every audit round of
the MLP behind a 1 Gbit/s link, where the plan measured 2.5% faster in the race and 4.6-6.3% faster in a bench
three times as long (docs/results/race.md): a gap a little beyond the margin takes hundreds of rounds to settle at the
race's alpha, so "not settled" said little about which to keep. Within the margin the estimates still keep the
simplest.

"Simplest" follows the order the arms were given in (the caller lists them simplest first: DDP, DDP with its hook,
the plan inside DDP, the plan in GradientExchange), so that within the noise the race keeps what a user would run
without the planner. Every test runs at alpha divided by their number (two per ordered pair), so the chance that
any settled statement is false is at most alpha, whenever the race stops.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner.contracts.plan import DDP_ROW
from planner.contracts.race_record import RaceRecord
from planner.sequential import DEFAULT_ALPHA, DEFAULT_MARGIN, LESS_OFTEN, MORE_OFTEN, HalfBet

__all__ = ["DEFAULT_ALPHA", "DEFAULT_MARGIN", "MIN_ESTIMATE_ROUNDS", "RATIO_GRID", "WANTED_ROUNDS", "WHY", "Race",
           "RaceDecision", "race_summary", "ratio_interval", "replay", "too_short", "why"]

#: The fewest rounds the budget rule goes by estimates after; before, it keeps the simplest arm not beaten.
MIN_ESTIMATE_ROUNDS = 5
#: The rounds the budget rule's estimates want: on a drifting machine they keep an arm within the margin of the
#: fastest in 0.83-0.98 of simulated races at 6 rounds, 0.91-0.98 at 15 and 0.99-1.00 at 40 (blocks of 2% noise, an
#: arm 0.5% beyond the margin aside; benchmarks/budget_rule_study.py, docs/results/race.md). A race the budget ends
#: sooner says so (`too_short`).
WANTED_ROUNDS = 20
#: Candidate medians of an arm's block time over DDP's, for its interval: 0.2x to 5x in steps of about one percent
#: (an end of the interval at an end of the grid is not settled on that side).
RATIO_GRID = tuple(math.exp(math.log(0.2) + i * 0.01) for i in range(round(math.log(25) / 0.01) + 1))


def ratio_interval(interval: tuple[float, float] | None) -> str:
    """An arm's interval as printed: "[0.951, 0.987]"; an end at the grid's end is not settled on that side and
    prints as such ("<0.200", ">4.995"); "-" without one."""
    if interval is None:
        return "-"
    low, high = interval
    return f"[{'<' if low <= RATIO_GRID[0] else ''}{low:.3f}, {'>' if high >= RATIO_GRID[-1] else ''}{high:.3f}]"


@dataclass(frozen=True)
class RaceDecision:
    """The arm kept, the rule that kept it ("won", "tied" or "budget"), and after how many rounds."""

    kept: str
    rule: str
    rounds: int
    #: The arms beaten, each with the arm that beat it first.
    beaten: Mapping[str, str]

    def describe(self) -> str:
        return f"kept {self.kept} after {self.rounds} round(s): {why(self.rule, self.rounds)}"


#: What each rule means, as the race's last line says it.
WHY = {"won": "it beat every other arm beyond the margin",
       "tied": "the arms left were within the margin of each other, and it is the simplest",
       "budget": "the budget ran out, and it is the simplest arm not beaten that no other measured faster "
                 "beyond the margin"}
#: The budget rule's words before `MIN_ESTIMATE_ROUNDS` rounds, too few to go by estimates.
TOO_FEW = f"the budget ran out after fewer than {MIN_ESTIMATE_ROUNDS} rounds, and it is the simplest arm not beaten"


def why(rule: str, rounds: int) -> str:
    """What the rule that kept an arm after `rounds` rounds means, in words."""
    return TOO_FEW if rule == "budget" and rounds < MIN_ESTIMATE_ROUNDS else WHY[rule]


def race_summary(record: RaceRecord) -> str:
    """The one line that says what the race kept, by how much against the reference (DDP), measured, and by which
    rule."""
    arm = record.arm(record.kept)
    reference = "DDP" if record.reference == DDP_ROW else record.reference
    if arm.ratio_to_ddp is None or arm.name == record.reference:
        how = reference
    else:
        gain = 1 - arm.ratio_to_ddp
        span = "" if arm.interval is None else f" {ratio_interval(arm.interval)}"
        how = (f"{arm.name}, {abs(gain):.1%} {'faster' if gain >= 0 else 'slower'} than {reference} measured "
               f"(median step ratio {arm.ratio_to_ddp:.3f}{span})")
    return f"race: keep {how}; after {record.rounds} round(s) {why(record.rule, record.rounds)}"


def too_short(record: RaceRecord) -> str | None:
    """A note where the budget ended the race with fewer than `WANTED_ROUNDS` rounds: before `MIN_ESTIMATE_ROUNDS`,
    too few to go by estimates; after, estimates too thin to trust beside a gain near the margin. Says how long a race
    of `WANTED_ROUNDS` rounds of these arms would take. None otherwise."""
    if record.rule != "budget" or record.rounds >= WANTED_ROUNDS or record.seconds <= 0:
        return None
    longer = (f"--race-time {math.ceil(record.seconds / record.rounds * WANTED_ROUNDS)} gives about "
              f"{WANTED_ROUNDS} rounds of these arms")
    if record.rounds < MIN_ESTIMATE_ROUNDS:
        return (f"note: {record.rounds} round(s) in {record.seconds:.0f} s, too few to go by estimates: the simplest "
                f"arm not beaten was kept; {longer}")
    return (f"note: {record.rounds} rounds in {record.seconds:.0f} s: the estimates the budget rule went by are thin "
            f"(beside a gain near the margin they pick wrongly often under {WANTED_ROUNDS} rounds); {longer}")


class Race:
    """The evidence of one race, round by round. `arms` are listed simplest first."""

    def __init__(self, arms: Sequence[str], *, margin: float = DEFAULT_MARGIN, alpha: float = DEFAULT_ALPHA) -> None:
        if len(arms) < 2 or len(set(arms)) != len(arms):
            raise ValueError(f"a race needs two or more distinct arms, got {list(arms)}")
        if not 0 <= margin < 1:
            raise ValueError(f"the margin must be in [0, 1), got {margin}")
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        self.arms = tuple(arms)
        self.margin = margin
        self.alpha = alpha
        pairs = list(itertools.permutations(self.arms, 2))
        tests = 2 * len(pairs)
        #: (a, b) -> the bets on "b's block is slower than (1 + margin) times a's".
        self.slower = {pair: HalfBet(alpha / tests) for pair in pairs}
        self.beaten: dict[str, str] = {}
        self.rounds = 0
        #: Each arm's block times, one per round it ran in.
        self.blocks: dict[str, list[float]] = {arm: [] for arm in self.arms}

    @property
    def alive(self) -> tuple[str, ...]:
        """The arms not beaten, simplest first."""
        return tuple(arm for arm in self.arms if arm not in self.beaten)

    def observe(self, blocks: Mapping[str, float]) -> None:
        """One round: each arm still in the race and its block time (seconds)."""
        if set(blocks) != set(self.alive):
            raise ValueError(f"a round times every arm still in the race, {list(self.alive)}, got {list(blocks)}")
        bad = [arm for arm, s in blocks.items() if not (math.isfinite(s) and s > 0)]
        if bad:
            raise ValueError(f"block times must be positive and finite, got {bad[0]}: {blocks[bad[0]]}")
        self.rounds += 1
        for arm, seconds in blocks.items():
            self.blocks[arm].append(seconds)
        for a, b in itertools.permutations(self.alive, 2):
            self.slower[a, b].observe(blocks[b] > (1 + self.margin) * blocks[a])
        for a, b in itertools.permutations(self.alive, 2):
            if b not in self.beaten and a not in self.beaten and self.slower[a, b].settled(MORE_OFTEN):
                self.beaten[b] = a

    def within(self, a: str, b: str) -> bool:
        """Whether a and b are settled to be within the margin of each other."""
        return self.slower[a, b].settled(LESS_OFTEN) and self.slower[b, a].settled(LESS_OFTEN)

    def decision(self, *, out_of_budget: bool = False) -> RaceDecision | None:
        """The arm to keep once one of the three rules says so (None: race on)."""
        alive = self.alive
        winner = next((a for a in alive if all(self.slower[a, b].settled(MORE_OFTEN) for b in alive if b != a)),
                      None)
        if winner is not None:
            return RaceDecision(kept=winner, rule="won", rounds=self.rounds, beaten=dict(self.beaten))
        if all(self.within(a, b) for a, b in itertools.combinations(alive, 2)):
            return RaceDecision(kept=alive[0], rule="tied", rounds=self.rounds, beaten=dict(self.beaten))
        if out_of_budget:
            return RaceDecision(kept=self._estimated(alive), rule="budget", rounds=self.rounds,
                                beaten=dict(self.beaten))
        return None

    def _estimated(self, alive: tuple[str, ...]) -> str:
        """The budget rule's arm: the simplest of `alive` that no other arm of `alive` beats by estimate beyond the
        margin (its median block ratio to each of them within the margin); the fastest by estimate where each is so
        beaten by some other. The simplest of `alive` with fewer than `MIN_ESTIMATE_ROUNDS` rounds. The arms not
        beaten ran in every round, so each round pairs them all.

        Every pair is compared, not each arm with the fastest alone: being within the margin does not chain. In the
        verdict audit's round 28 (docs/results/race.md) DDP's fp16 hook was within the margin of the plan inside DDP,
        which the rule had estimated fastest, and so was kept; the plan in GradientExchange measured 3.4% faster than
        the hook."""
        if self.rounds < MIN_ESTIMATE_ROUNDS or len(alive) < 2:
            return alive[0]

        def unbeaten(arm: str) -> bool:
            return all((self.ratio(arm, other) or 0) <= 1 + self.margin for other in alive if other != arm)

        return next((arm for arm in alive if unbeaten(arm)), None) or self.fastest(alive)

    def fastest(self, alive: tuple[str, ...]) -> str:
        """The fastest of `alive` (arms that ran every round) by estimate: its median over the rounds of its block
        over the round's geometric mean, so that the machine's drift cancels."""
        blocks = {arm: self.blocks[arm][-self.rounds:] for arm in alive}
        means = [math.exp(statistics.fmean(math.log(blocks[arm][t]) for arm in alive)) for t in range(self.rounds)]
        return min(alive, key=lambda arm: statistics.median(b / m for b, m in zip(blocks[arm], means, strict=True)))

    def ratio(self, arm: str, reference: str) -> float | None:
        """The median over the rounds both ran in of arm's block time over reference's (None: no such round)."""
        paired = [a / r for a, r in zip(self.blocks[arm], self.blocks[reference], strict=False)]
        return statistics.median(paired) if paired else None


def replay(record: RaceRecord) -> Race:
    """The race of `record` fed again, round by round, from its arms' recorded blocks (`RacedArm.blocks_s`), at its
    margin and alpha: the evidence its rule decided on, to read or to decide on under another rule. Refused where
    the record holds no blocks (records from before they were kept)."""
    missing = [arm.name for arm in record.arms if len(arm.blocks_s) != arm.rounds]
    if missing:
        raise ValueError(f"the race of {record.raced} holds no block times for {', '.join(missing)}: it cannot be "
                         "replayed (races record them since 2026-12-03)")
    race = Race([arm.name for arm in record.arms], margin=record.margin, alpha=record.alpha)
    blocks = {arm.name: arm.blocks_s for arm in record.arms}
    for t in range(record.rounds):
        if any(t >= len(blocks[name]) for name in race.alive):
            break  # the recorded race beat an arm this one has not: it ran no further
        race.observe({name: blocks[name][t] for name in race.alive})
        if race.decision() is not None:
            break
    return race
