"""The race in the first steps of training (`GradientExchange(race=True)`): steps to decide, its cost, and whether it
keeps what the offline race (`planner race`) kept.

    sudo .venv/bin/python benchmarks/online_race.py --plan runs/audit/02-lstm-200mbit/plan.json --link 200mbit \\
        --runs 5 --steps 200

For each of `--runs` runs, on 2 local workers behind the emulated `--link`, three trainings of `--steps` steps of
the plan's model (its synthetic batches, SGD), interleaved run by run (ABC, BCA, CAB, ...): the racing exchange
(`race=True`: the plan and its runners-up), then an exchange of the arm the race kept and one of the plan file's
plan, each started fresh. The race's overhead is the racing run's total time over the kept arm's (the steps spent
on slower arms and the switches); the kept arm is compared with the plan file's race record (`planner race` on the
same plan, when it has one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from planner.console import console
from planner.contracts.plan import Plan
from planner.models import build_workload
from planner.platform.launch import run_distributed
from planner.platform.link import parse_rate
from planner.runtime import GradientExchange, OnlineRace


def _train(rank: int, world_size: int, plan_json: str, which: str, steps: int, max_rounds: int) -> dict[str, Any]:
    """`steps` steps on `which` arm ("race", or an arm name: "plan", "runner-up NAME"); the wall time of the steps,
    and the race's result."""
    plan = Plan.from_dict(json.loads(plan_json))
    run_plan = plan if which in ("race", "plan") else plan.runners_up[which.removeprefix("runner-up ")]
    workload = build_workload(plan.model.name)
    opt = torch.optim.SGD(workload.module.parameters(), lr=0.01)
    exchange = GradientExchange(workload.module, run_plan, optimizer=opt,
                                race=OnlineRace(max_rounds=max_rounds) if which == "race" else False)
    inputs, targets = workload.batch(seed=rank)
    decided_at = None
    start = time.perf_counter()
    for step in range(steps):
        opt.zero_grad()
        workload.loss(inputs, targets).backward()
        exchange.synchronize()
        opt.step()
        if decided_at is None and exchange.race is not None:
            decided_at = step + 1
    seconds = time.perf_counter() - start
    out = {"seconds": seconds, "decided_at": decided_at,
           "race": exchange.race.to_dict() if exchange.race is not None else None}
    exchange.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", type=Path, required=True, help="a plan with runners-up (`solve --strategy auto`)")
    parser.add_argument("--link", default=None, help="emulated link rate (root), e.g. 200mbit")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--max-rounds", type=int, default=15, help="the race's budget of rounds (OnlineRace)")
    parser.add_argument("--out", type=Path, default=None, help="JSON of every run")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds one training of --steps steps may take before its workers are killed "
                             "(default 1800: an LSTM behind 200 Mbit/s takes seconds a step)")
    args = parser.parse_args()
    plan = Plan.load(args.plan)
    offline = plan.race.kept if plan.race is not None else None
    plan_json = json.dumps({**plan.to_dict(), "race": None})
    link = parse_rate(args.link) if args.link else None
    rows = []
    for run in range(args.runs):
        raced = run_distributed(_train, 2, plan_json, "race", args.steps, args.max_rounds, link=link,
                                timeout=args.timeout)[0]
        assert raced["race"] is not None, f"the race did not decide in {args.steps} steps"
        kept = raced["race"]["kept"]
        plain = {}
        for which in (kept, "plan") if run % 2 == 0 else ("plan", kept):
            done = run_distributed(_train, 2, plan_json, which, args.steps, args.max_rounds, link=link,
                                   timeout=args.timeout)
            plain[which] = done[0]["seconds"]
        rows.append({"run": run + 1, "kept": kept, "rule": raced["race"]["rule"],
                     "rounds": raced["race"]["rounds"], "decided_at": raced["decided_at"],
                     "race_s": raced["seconds"], "kept_s": plain[kept], "plan_s": plain["plan"],
                     "ratios": raced["race"]["ratios"], "offline": offline})
        console.print(f"run {run + 1}: kept {kept} ({raced['race']['rule']}) at step {raced['decided_at']}; "
                      f"{args.steps} steps {raced['seconds']:.1f} s racing, {plain[kept]:.1f} s on the arm kept")
    table = Table(title=f"the race in the first steps: {plan.model.name}, {args.steps} steps, 2 workers, "
                        f"{args.link or 'loopback'}")
    for col in ("run", "kept (rule, rounds)", "decided at step", "racing s", "kept arm s", "overhead",
                "plan s", "offline race kept"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["run"]), f"{r['kept']} ({r['rule']}, {r['rounds']})", str(r["decided_at"]),
                      f"{r['race_s']:.1f}", f"{r['kept_s']:.1f}", f"{r['race_s'] / r['kept_s'] - 1:+.1%}",
                      f"{r['plan_s']:.1f}", str(r["offline"]))
    console.print(table)
    console.print(f"median overhead {statistics.median(r['race_s'] / r['kept_s'] - 1 for r in rows):+.1%}; "
                  f"median step of decision {statistics.median(r['decided_at'] for r in rows)}")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
