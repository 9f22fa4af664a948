"""Does the step just after a switch of arms cost more? The race runs its arms in short interleaved blocks; a step
that pays for the arm before it (caches, allocator, buffers another arm left cold) would weigh on the arms unequally
and bias the race against a user's training, which runs one arm throughout.

    .venv/bin/python benchmarks/switch_cost.py --plan runs/audit/01-mlp-none/plan.json --rounds 60 --block 6

Builds the plan's race finalists once in the same worker processes (`planner.sessions.race.finalists`), warms each
up, then runs rounds: every arm one block of BLOCK steps, in an order drawn anew each round, as the race does. Each
step's time is the slowest rank's. Prints per arm the median step first in its block (just after another arm ran)
and later in it, their ratio with a bootstrap 90% interval, and what a race's block of 2 would measure against a
block's later steps alone.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from planner.console import console
from planner.contracts.plan import Plan
from planner.platform.launch import run_distributed
from planner.platform.link import parse_rate
from planner.types import PlannerError


def _steps(rank: int, world_size: int, plan_json: str, rounds: int, block: int, seed: int) -> dict[str, Any] | None:
    """Every arm's step times by round, each a block of `block` steps (the slowest rank's), on rank 0."""
    from planner.sessions.bench import Runner, WorkerSetup, slowest_rank
    from planner.sessions.race import RaceConfig, finalists

    plan = Plan.from_dict(json.loads(plan_json))
    config = RaceConfig(plans=(plan,), model=plan.model.name)
    setup = WorkerSetup.on_this_rank(rank, world_size, config.model, None, config.plans)
    arms = finalists(config.plans, setup.base.module, config.peers)
    runners = [Runner.build(v, config.model, batch_size=None, lr=config.lr, device=setup.device,
                            find_unused=setup.find_unused) for v in arms]
    for runner, v in zip(runners, arms, strict=True):
        runner.warm_up(v, config.warmup, setup.batch)
    order = random.Random(seed)
    times: list[list[float]] = [[] for _ in arms]
    for _ in range(rounds):
        for i in order.sample(range(len(arms)), len(arms)):
            times[i] += [runners[i].step(setup.batch) for _ in range(block)]
    for runner in runners:
        runner.close()
    slowest = slowest_rank(times, setup.device)
    return {v.name: row for v, row in zip(arms, slowest, strict=True)} if rank == 0 else None


def _ratio_interval(first: np.ndarray, later: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """A bootstrap 90% interval of median(first) / median(later), the rounds drawn again."""
    draws = []
    for _ in range(2000):
        take = rng.integers(0, len(first), len(first))
        draws.append(np.median(first[take]) / np.median(later[take]))
    low, high = np.quantile(draws, [0.05, 0.95])
    return float(low), float(high)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", type=Path, required=True, help="a plan from `planner solve` (its finalists run)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--block", type=int, default=6, help="steps per arm per round (at least 3)")
    parser.add_argument("--link", default=None, help="emulated link rate (root), e.g. 200mbit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="JSON of every arm's steps, by round")
    args = parser.parse_args()
    if args.block < 3:
        parser.error("--block must be at least 3: a first step and two later ones")
    try:
        plan = Plan.load(args.plan)
    except PlannerError as exc:  # a missing, broken or foreign file: one line, exit 2
        parser.error(str(exc))
    plan_json = json.dumps({**plan.to_dict(), "race": None})
    link = parse_rate(args.link) if args.link else None
    steps = run_distributed(_steps, plan.cluster.world_size, plan_json, args.rounds, args.block, args.seed, link=link,
                            timeout=3600)[0]
    rng = np.random.default_rng(args.seed)
    table = Table(title=f"the step after a switch: {plan.model.name}, {args.rounds} rounds of {args.block}-step "
                        f"blocks, {args.link or 'loopback'}")
    for col in ("arm", "first step ms", "later steps ms", "first / later [90%]", "block of 2 / later"):
        table.add_column(col)
    for name, row in steps.items():
        blocks = np.array(row).reshape(args.rounds, args.block)
        first, later = blocks[:, 0], np.median(blocks[:, 1:], axis=1)
        pair = np.median(blocks[:, :2].mean(axis=1)) / np.median(later)
        low, high = _ratio_interval(first, later, rng)
        table.add_row(name, f"{np.median(first) * 1e3:.2f}", f"{np.median(later) * 1e3:.2f}",
                      f"{np.median(first) / np.median(later):.3f} [{low:.3f}, {high:.3f}]", f"{pair:.3f}")
    console.print(table)
    reference = np.array(steps["ddp"]).reshape(args.rounds, args.block)
    for name, row in steps.items():
        if name == "ddp":
            continue
        blocks = np.array(row).reshape(args.rounds, args.block)
        as_raced = statistics.median(blocks[:, :2].mean(axis=1) / reference[:, :2].mean(axis=1))
        settled = statistics.median(blocks[:, 1:].mean(axis=1) / reference[:, 1:].mean(axis=1))
        console.print(f"{name}: ratio to DDP from each block's first 2 steps {as_raced:.3f}, from its later steps "
                      f"{settled:.3f}")
    if args.out is not None:
        args.out.write_text(json.dumps(steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
