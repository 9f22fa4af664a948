"""How well the race's budget rule keeps an arm within the margin of the fastest, against the rules one might put in
its place, on simulated races whose true medians are known.

    python benchmarks/budget_rule_study.py --races 400
    python benchmarks/budget_rule_study.py --replay runs/races.json   # real races, as recorded


When a race's time runs out before its anytime-valid bets settle, the budget rule (`Race._estimated`,
planner/strategies/race_rule.py) keeps the simplest arm not beaten whose median block ratio to the fastest, by
estimate, is within the margin. Each simulated race here runs on the drifting machine of
`planner.strategies.race_streams.drifting_blocks` (a trend, bursts, heavy tails) for at most `rounds` rounds; where
it ends on the budget, every rule below picks an arm from the same race's blocks:

- `medians`: the rule the race runs: the simplest arm not beaten that no other beats by estimate (median paired
  block ratio) beyond the margin;
- `to the fastest`: the rule before it: the simplest arm within the margin of the fastest by estimate, compared with
  that arm alone;
- `simplest`: the simplest arm not beaten, whatever the estimates (the race's rule before estimates counted, and its
  rule still under `MIN_ESTIMATE_ROUNDS` rounds);
- `sign 5%`, `t 5%`, `t 10%`: as `medians`, but an arm simpler than the fastest is passed over only where a one-shot
  test of its paired rounds also finds it slower than the fastest (an exact sign test on "slower in more than half
  the rounds", or Student's t on the mean log ratio, one-sided at that level);
- `t margin 10%`: passed over only where Student's t finds its mean log ratio to the fastest beyond the margin.

A race passes where the arm kept is truly within the margin of the truly fastest (the verdict audit's criterion).
The scenarios are arms' true medians over DDP's, simplest first: equal arms, one arm 5% faster, and four from the
verdict audit's benches (docs/results/race.md; rounds 11, 13, 16, 20, 21, 26 and 28).

`--replay` feeds races that were run (a race log, or plan files with a race record holding its blocks) to every
rule instead, and prints what each would have kept where the budget ended the race.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy.stats
from rich.table import Table

from planner.console import console
from planner.contracts.plan import Plan
from planner.contracts.race_log import RaceLog
from planner.contracts.race_record import RaceRecord
from planner.strategies.race_rule import Race, replay
from planner.strategies.race_streams import drifting_blocks
from planner.types import SchemaError

#: Scenarios: the arms' true median block times, simplest first (DDP first).
SCENARIOS = {
    "equal": (1.0, 1.0, 1.0, 1.0, 1.0),
    "one 5% faster": (1.0, 1.0, 1.0, 1.0, 0.95),
    "audit 11 (mlp, none, busy)": (1.0, 1.086, 1.050, 0.960, 1.033),
    "audit 13 (lstm, 1gbit, busy)": (1.0, 0.787, 0.768, 1.002, 0.778),
    "audit 16 (resnet18, 1gbit, busy)": (1.0, 0.970, 0.932, 0.965, 0.972),
    "audit 20 (resnet18, none, busy)": (1.0, 1.050, 1.028, 0.997, 1.010),
    "audit 21 (resnet18, 200mbit)": (1.0, 0.607, 0.591, 0.994, 0.575),
    "audit 26 (resnet18, none)": (1.0, 1.003, 0.977, 0.987),
    "audit 28 (lstm, 1gbit)": (1.0, 0.705, 0.696, 0.990, 0.682),
}

Rule = Callable[[Race, tuple[str, ...]], str]


def _tested(test: Callable[[np.ndarray], bool]) -> Rule:
    """The medians rule, but an arm simpler than the fastest is passed over only where `test` (on its paired block
    ratios to the fastest) also says so."""
    def rule(race: Race, alive: tuple[str, ...]) -> str:
        fastest = race.fastest(alive)
        for arm in alive:
            if arm == fastest:
                return arm
            ratios = np.array(race.blocks[arm][-race.rounds:]) / np.array(race.blocks[fastest][-race.rounds:])
            if np.median(ratios) <= 1 + race.margin or not test(ratios):
                return arm
        return fastest
    return rule


def _sign(level: float) -> Callable[[np.ndarray], bool]:
    return lambda r: scipy.stats.binom.sf(int((r > 1).sum()) - 1, len(r), 0.5) <= level


def _t(level: float, shift: float = 0.0) -> Callable[[np.ndarray], bool]:
    def test(r: np.ndarray) -> bool:
        x = np.log(r) - shift
        spread = x.std(ddof=1)
        if spread == 0:
            return bool(x.mean() > 0)
        return bool(scipy.stats.t.sf(x.mean() / (spread / math.sqrt(len(x))), len(x) - 1) <= level)
    return test


def _to_the_fastest(race: Race, alive: tuple[str, ...]) -> str:
    """The race's budget rule to 8d10c4d: the simplest arm whose median block ratio to the fastest by estimate alone
    is within the margin (within the margin chains: a third arm may be faster than it beyond the margin)."""
    fastest = race.fastest(alive)
    return next(arm for arm in alive if (race.ratio(arm, fastest) or 0) <= 1 + race.margin)


RULES: dict[str, Rule] = {
    "medians": lambda race, alive: race._estimated(alive),
    "to the fastest": _to_the_fastest,
    "simplest": lambda race, alive: alive[0],
    "sign 5%": _tested(_sign(0.05)),
    "t 5%": _tested(_t(0.05)),
    "t 10%": _tested(_t(0.10)),
    "t margin 10%": _tested(_t(0.10, math.log(1.02))),
}


def block_noise(blocks: np.ndarray) -> float:
    """The spread of a race's blocks (rounds x arms, every arm in every round) once the round's machine and the arm's
    own speed are taken out: the median absolute deviation of the two-way residuals of their log times, times 1.4826
    (a normal's standard deviation). The simulator's streams are measured alike, so the two can be set side by side."""
    logs = np.log(blocks)
    residual = logs - logs.mean(axis=1, keepdims=True)
    residual = residual - np.median(residual, axis=0, keepdims=True)
    return float(1.4826 * np.median(np.abs(residual - np.median(residual))))


def _replay(paths: list[str]) -> int:
    """What every rule keeps in the recorded races of `paths` (race logs or plan files) that the budget ended."""
    records: list[tuple[str, RaceRecord]] = []
    for path in paths:
        if json.loads(Path(path).read_text()).get("kind") == "planner.plan":
            plan = Plan.load(path)
            if plan.race is not None:
                records.append((path, plan.race))
        else:
            records += [(f"{path} #{i + 1} {logged.model} {logged.link or 'loopback'}", logged.race)
                        for i, logged in enumerate(RaceLog.load(path).races)]
    table = Table(title="recorded races the budget ended: the arm each rule keeps")
    for column in ("race", "rounds", "block noise", *RULES):
        table.add_column(column)
    for name, record in records:
        if record.rule != "budget" or any(len(a.blocks_s) != a.rounds for a in record.arms):
            continue
        race = replay(record)
        full = [arm.blocks_s for arm in record.arms if arm.rounds == record.rounds]
        noise = f"{block_noise(np.array(full).T):.3f}" if len(full) > 1 and record.rounds > 2 else "-"
        table.add_row(name, str(race.rounds), noise, *(rule(race, race.alive) for rule in RULES.values()))
    console.print(table)
    rng = np.random.default_rng(0)
    for scale in (0.02, 0.05):
        simulated = statistics.median(block_noise(drifting_blocks([1.0] * 5, 40, rng, noise=scale)) for _ in range(50))
        console.print(f"block noise of the simulator's streams at noise {scale:g}: {simulated:.3f} (median of 50)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--races", type=int, default=400, help="simulated races per cell (default 400)")
    parser.add_argument("--rounds", default="6,8,15,40", help="the budgets, in rounds (default 6,8,15,40)")
    parser.add_argument("--noise", default="0.02,0.05", help="the blocks' noise scales (default 0.02,0.05)")
    parser.add_argument("--seed", type=int, default=68)
    parser.add_argument("--replay", nargs="+", default=None, metavar="FILE",
                        help="race logs or raced plan files: replay their races under every rule instead")
    args = parser.parse_args()
    if args.replay:
        try:
            return _replay(args.replay)
        except (OSError, ValueError, SchemaError) as e:  # json's errors are ValueErrors
            print(f"error: cannot replay {' '.join(args.replay)}: {e}", file=sys.stderr)
            return 2
    rng = np.random.default_rng(args.seed)
    for noise in (float(x) for x in args.noise.split(",")):
        for rounds in (int(x) for x in args.rounds.split(",")):
            table = Table(title=f"noise {noise:g}, budget {rounds} rounds: races that kept an arm within the "
                                f"margin of the fastest, of {args.races}")
            table.add_column("scenario")
            for name in RULES:
                table.add_column(name, justify="right")
            for scenario, means in SCENARIOS.items():
                passed = dict.fromkeys(RULES, 0)
                truth = np.array(means)
                good = {f"arm{i}" for i, m in enumerate(means) if m <= 1.02 * truth.min()}
                for _ in range(args.races):
                    blocks = drifting_blocks(means, rounds, rng, noise=noise)
                    race = Race([f"arm{i}" for i in range(len(means))])
                    decision = None
                    for row in blocks:
                        race.observe({arm: float(row[int(arm[3:])]) for arm in race.alive})
                        if (decision := race.decision()) is not None:
                            break
                    for name, rule in RULES.items():
                        kept = decision.kept if decision is not None else rule(race, race.alive)
                        passed[name] += kept in good
                table.add_row(scenario, *(f"{passed[n] / args.races:.2f}" for n in RULES))
            console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
