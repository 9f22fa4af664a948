"""Where a race's run-to-run bias comes from: every finalist raced beside its twin, the same arm built a second time.

    python benchmarks/race_twins.py --plan runs/audit/02-mlp-none-busy/plan.json --rounds 120 --runs 3 [--busy]

Races of the same plan, run one after the other, can disagree beyond their own intervals (docs/results/race.md,
"The same plan raced again and again"). Two causes predict different things here:

- the bias belongs to the build (each arm's model, optimizer and buffers allocated once, wherever the allocator put
  them, warmed once): then an arm and its twin, built apart in the same processes, disagree within a run;
- the bias belongs to the run (the processes, where the scheduler put them, the machine's state): then twins agree
  and whole runs move.

Each run starts 2 workers, builds every finalist of `planner race` twice (arm and twin, built one after the other,
the twins after all the arms), warms each up, then times `--rounds` rounds: every arm and twin one block of
`--block` steps per round in an order drawn anew each round, each step's time the slowest rank's (as the race does).
With `--rebuild-every K`, every arm is built again every K rounds (the old one dropped first): if the bias belongs to
the build, rebuilding turns it into noise the rounds average out.

Printed per run: each arm's median paired ratio to DDP (the arm, its twin), and the twin's median paired ratio to its
arm, each with a 90% bootstrap interval over the run's rounds. No elimination, no rule: the same rounds for all.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.table import Table

from planner.console import console
from planner.contracts.plan import DDP_ROW, Plan
from planner.platform.launch import run_job
from planner.sessions.bench import Runner, WorkerSetup
from planner.sessions.race import finalists
from planner.types import PlannerError

TWIN = " twin"


def _worker(rank: int, world_size: int, plan_json: str, rounds: int, block: int, warmup: int, rebuild_every: int,
            seed: int, pin: bool) -> dict[str, list[float]] | None:
    if pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    plan = Plan.from_dict(json.loads(plan_json))
    setup = WorkerSetup.on_this_rank(rank, world_size, plan.model.name, None, (plan,))
    raced = {arm.name for arm in plan.race.arms} if plan.race is not None else None
    arms = {v.name: v for v in finalists((plan,), setup.base.module, most=8)
            if raced is None or v.name in raced}
    names = [*arms, *(name + TWIN for name in arms)]

    def build() -> dict[str, Runner]:
        runners = {}
        for name in names:
            v = arms[name.removesuffix(TWIN)]
            runners[name] = Runner.build(v, plan.model.name, batch_size=None, lr=0.01, device=setup.device,
                                         find_unused=setup.find_unused)
            runners[name].warm_up(v, warmup, setup.batch)
        return runners

    runners = build()
    order = random.Random(seed)
    blocks: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        if rebuild_every and r and r % rebuild_every == 0:
            for runner in runners.values():
                runner.close()
            runners = build()
        drawn = order.sample(names, len(names))
        flat = [runners[name].step(setup.batch) for name in drawn for _ in range(block)]
        slowest = torch.tensor(flat, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        maxed = slowest.tolist()
        for i, name in enumerate(drawn):
            blocks[name].append(statistics.fmean(maxed[i * block:(i + 1) * block]))
    for runner in runners.values():
        runner.close()
    return blocks if rank == 0 else None


def _median_ratio(top: list[float], bottom: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """The median of the paired ratios and its 90% percentile bootstrap interval over the rounds."""
    ratios = [a / b for a, b in zip(top, bottom, strict=True)]
    pick = random.Random(1)
    medians = sorted(statistics.median(pick.choices(ratios, k=len(ratios))) for _ in range(draws))
    return statistics.median(ratios), medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1]


def _spread(runs: list[dict[str, list[float]]]) -> str:
    """How far twins disagree beyond what their rounds explain: the standard deviation over every arm of every run of
    the median log ratio twin / arm, the root mean square of its bootstrap standard error, and the part of the first
    the second does not explain (a build's own bias, times the square root of 2: two builds differ)."""
    medians, errors = [], []
    for blocks in runs:
        for name in (n for n in blocks if not n.endswith(TWIN)):
            logs = [math.log(a / b) for a, b in zip(blocks[name + TWIN], blocks[name], strict=True)]
            pick = random.Random(0)
            medians.append(statistics.median(logs))
            errors.append(statistics.stdev(statistics.median(pick.choices(logs, k=len(logs))) for _ in range(1000)))
    spread, error = statistics.stdev(medians), math.sqrt(statistics.fmean(e * e for e in errors))
    beyond = math.sqrt(max(0.0, spread ** 2 - error ** 2))
    return (f"twins over {len(medians)} arms: median log ratio twin / arm spread {spread:.4f}, its standard error "
            f"{error:.4f}, beyond the error {beyond:.4f} (one build's own bias about {beyond / math.sqrt(2):.4f})")


def _cell(value: tuple[float, float, float]) -> str:
    return f"{value[0]:.3f} [{value[1]:.3f}, {value[2]:.3f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, required=True, help="a plan file: the arms its race record names, or "
                        "without one, the finalists `planner race` would race")
    parser.add_argument("--rounds", type=int, default=120)
    parser.add_argument("--block", type=int, default=2, help="steps per arm per round (the race's default)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3, help="runs, one after the other, each in new workers")
    parser.add_argument("--rebuild-every", type=int, default=0, metavar="K", help="build every arm again every K "
                        "rounds (0: never)")
    parser.add_argument("--pin", action="store_true", help="each rank pinned to a core of its own (rank r to the "
                        "r-th core it may run on)")
    parser.add_argument("--busy", action="store_true", help="a busy loop at normal priority beside the runs")
    parser.add_argument("--out", type=Path, help="write every run's blocks here (JSON)")
    args = parser.parse_args(argv)
    if min(args.rounds, args.block, args.runs) < 1 or args.warmup < 0 or args.rebuild_every < 0:
        parser.error("--rounds, --block and --runs take 1 or more; --warmup and --rebuild-every 0 or more")
    try:
        plan = Plan.load(args.plan)
    except (OSError, ValueError, PlannerError) as e:  # json's errors are ValueErrors
        print(f"error: cannot race the twins of {args.plan}: {e}", file=sys.stderr)
        return 2
    if plan.kfac is not None or plan.abs is not None:
        print(f"error: {args.plan} is a K-FAC or ABS-SGD plan; the twins race a gradient plan's finalists",
              file=sys.stderr)
        return 2
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    runs: list[dict[str, Any]] = []
    try:
        for run in range(args.runs):
            blocks = run_job(_worker, plan.cluster.world_size, json.dumps(plan.to_dict()), args.rounds, args.block,
                             args.warmup, args.rebuild_every, run, args.pin)
            runs.append(blocks)
            arms = [name for name in blocks if not name.endswith(TWIN)]
            table = Table(title=f"run {run + 1}: {args.rounds} rounds of {args.block} steps"
                                f"{f', rebuilt every {args.rebuild_every}' if args.rebuild_every else ''}"
                                f"{', busy loop beside' if args.busy else ''}")
            for column in ("arm", "arm / ddp", "twin / ddp", "twin / arm"):
                table.add_column(column)
            for name in arms:
                twin = blocks[name + TWIN]
                table.add_row(name, _cell(_median_ratio(blocks[name], blocks[DDP_ROW])),
                              _cell(_median_ratio(twin, blocks[DDP_ROW])), _cell(_median_ratio(twin, blocks[name])))
            console.print(table)
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
    console.print(_spread(runs))
    if args.out is not None:
        args.out.write_text(json.dumps({"plan": str(args.plan), "args": vars(args) | {"plan": str(args.plan),
                                        "out": str(args.out)}, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
