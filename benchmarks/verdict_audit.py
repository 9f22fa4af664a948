"""Audit the race's verdicts: does the arm a race keeps hold up in an independent, longer bench?

    sudo .venv/bin/python benchmarks/verdict_audit.py --out runs/audit \\
        --round mlp:1gbit --round lstm:200mbit --round mlp:none:busy ...

Each round (`MODEL:LINK[:busy]`, LINK a rate or `none` for loopback; `busy`: a busy loop at normal priority on one
core for the whole round) runs the user's path with the planner's own commands, each timed:

1. `planner profile --quick --no-calibrate` of MODEL on 2 workers behind LINK;
2. `planner solve --strategy auto` (its plan records its runners-up);
3. `planner race` on the plan (a copy: a race that keeps a runner-up rewrites its file) behind the same link;
4. an independent `planner bench` of every finalist the race ran: the plan and each runner-up as plan files, DDP and
   the same hooks, interleaved, with at least 3 times the steps the race gave its arm that ran most (a race stops
   early, so its counts are small).

A round passes when no finalist's bench median is below the kept arm's by more than the race's margin (the kept arm
never measures slower than another beyond the margin). Every round is written to `OUT/rounds.jsonl` as it ends, and
the table of all rounds printed at the end (with each round's wall times: profile, solve, race, bench).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.table import Table

from planner.console import console
from planner.contracts.plan import Plan
from planner.sessions.bench import plan_labels

PLANNER = [sys.executable, "-m", "planner"]


def _run(args: list[str], log: Path) -> tuple[float, str]:
    """Run a planner command, its output appended to `log`; its wall time and stdout (raises on failure)."""
    start = time.perf_counter()
    proc = subprocess.run([*PLANNER, *args], capture_output=True, text=True)
    with log.open("a") as out:
        out.write(f"$ planner {' '.join(args)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        raise RuntimeError(f"planner {args[0]} failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - start, proc.stdout


def _bench_names(plan: Plan) -> dict[str, str]:
    """The race's arm name of each runner-up -> its bench row, the bench given the plan first and the runners-up
    after it, each as a plan file (the plan's own arms, in the runtime and inside DDP, have the same names in both)."""
    labels = plan_labels([replace(plan, runners_up={}), *plan.runners_up.values()])
    return {f"runner-up {name}": label for name, label in zip(plan.runners_up, labels[1:], strict=True)}


def audit_round(spec: str, out: Path, index: int, race_time: float) -> dict[str, Any]:
    model, link, *rest = spec.split(":")
    busy = rest == ["busy"]
    where = out / f"{index:02d}-{model}-{link}{'-busy' if busy else ''}"
    where.mkdir(parents=True, exist_ok=True)
    log = where / "log.txt"
    linked = [] if link == "none" else ["--link", link]
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        profile_s, _ = _run(["profile", "--model", model, "--nproc", "2", "--quick", "--no-calibrate", *linked,
                             "-o", str(where / "profile.json")], log)
        solve_s, _ = _run(["solve", str(where / "profile.json"), "--strategy", "auto", "-o",
                           str(where / "plan.json")], log)
        solved = Plan.load(where / "plan.json")
        raced_path = where / "raced.json"
        solved.save(raced_path)
        race_s, printed = _run(["race", str(raced_path), *linked, "--race-time", str(race_time), "--json"], log)
        race = json.loads(printed[printed.index("{"):])
        arms = {a["name"]: a for a in race["arms"]}
        names = _bench_names(solved)
        files = []
        plans = [replace(solved, runners_up={}), *solved.runners_up.values()]
        for i, plan in enumerate(plans):
            path = where / f"bench-plan-{i}.json"
            plan.save(path)
            files += ["--plan", str(path)]
        hooks = sorted({a.removeprefix("ddp+") for a in arms if a.startswith("ddp+") and "topk" not in a})
        steps = max(3 * max(a["steps"] for a in race["arms"]), 20)
        bench_s, printed = _run(["bench", *files, *linked, "--steps", str(steps),
                                 "--peers", ",".join(hooks) or "none", "--json"], log)
        rows = {r["name"]: r for r in json.loads(printed[printed.index("["):])}
    finally:
        if loop is not None:
            loop.kill()
    medians = {}
    for arm in arms:
        row = names.get(arm, arm)
        if row in rows:
            medians[arm] = rows[row]["median_s"]
    kept = race["kept"]
    margin = race["margin"]
    beaten = {arm: m for arm, m in medians.items() if arm != kept and kept in medians
              and medians[kept] > (1 + margin) * m}
    result = {"round": index, "spec": spec, "kept": kept, "rule": race["rule"], "rounds": race["rounds"],
              "race_steps": {a: arms[a]["steps"] for a in arms}, "bench_steps": steps,
              "race_ratio": {a: arms[a]["ratio_to_ddp"] for a in arms},
              "interval": {a: arms[a]["interval"] for a in arms},
              "predicted_ratio": {a: arms[a]["predicted_ratio"] for a in arms},
              "bench_ms": {a: m * 1e3 for a, m in medians.items()},
              "bench_ratio": {a: m / medians["ddp"] for a, m in medians.items()} if "ddp" in medians else {},
              "missing": sorted(set(arms) - set(medians)), "faster_than_kept": sorted(beaten),
              "passed": not beaten and kept in medians,
              "seconds": {"profile": profile_s, "solve": solve_s, "race": race_s, "bench": bench_s}}
    with (out / "rounds.jsonl").open("a") as f:
        f.write(json.dumps(result) + "\n")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round", dest="rounds", action="append", default=[], metavar="MODEL:LINK[:busy]",
                        help="a round to run (none: summarise the rounds OUT holds)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--race-time", type=float, default=60.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    done = [json.loads(line) for line in (args.out / "rounds.jsonl").read_text().splitlines()] \
        if (args.out / "rounds.jsonl").exists() else []
    results = list(done)
    for i, spec in enumerate(args.rounds, start=len(done) + 1):
        console.print(f"round {i}: {spec}")
        try:
            r = audit_round(spec, args.out, i, args.race_time)
        except RuntimeError as exc:
            console.print(f"round {i} failed: {exc}")
            continue
        results.append(r)
        console.print(f"  kept {r['kept']} ({r['rule']}, {r['rounds']} rounds); faster in the bench beyond the "
                      f"margin: {', '.join(r['faster_than_kept']) or 'none'}")
    table = Table(title="verdict audit: the arm each race kept, against an independent interleaved bench")
    for col in ("round", "model:link", "kept (rule, rounds)", "race ratio kept", "bench ratio kept",
                "faster in the bench", "profile+solve+race s", "passed"):
        table.add_column(col)
    for r in results:
        kept = r["kept"]
        table.add_row(str(r["round"]), r["spec"], f"{kept} ({r['rule']}, {r['rounds']})",
                      _fmt(r["race_ratio"].get(kept)), _fmt(r["bench_ratio"].get(kept)),
                      ", ".join(r["faster_than_kept"]) or "-",
                      f"{r['seconds']['profile'] + r['seconds']['solve'] + r['seconds']['race']:.0f}",
                      "yes" if r["passed"] else "NO")
    console.print(table)
    passed = sum(r["passed"] for r in results)
    console.print(f"{passed} of {len(results)} rounds: the kept arm never measured slower than another beyond the "
                  "margin")
    print_coverage(results)
    return 0


def print_coverage(results: list[dict[str, Any]], level: float = 0.9) -> None:
    """How often the bench's measured ratio to DDP fell inside each interval printed for it: the race's anytime
    interval of the median ratio, and the model's predicted ratio widened by its error (split conformal at `level`,
    calibrated on the other rounds' race residuals: leave one round out, as a new round would see the log)."""
    race_in = race_n = conf_in = conf_n = 0
    for i, r in enumerate(results):
        others = [abs(math.log(o["race_ratio"][a] / o["predicted_ratio"][a])) for j, o in enumerate(results)
                  if j != i for a in o["race_ratio"] if a != "ddp" and o["race_ratio"][a] and o["predicted_ratio"][a]]
        others.sort()
        rank = math.ceil((len(others) + 1) * level)
        bound = others[rank - 1] if rank <= len(others) else None
        for arm, measured in r["bench_ratio"].items():
            if arm == "ddp":
                continue
            interval = r["interval"].get(arm)
            if interval is not None:
                race_n += 1
                race_in += interval[0] <= measured <= interval[1]
            predicted = r["predicted_ratio"].get(arm)
            if predicted and bound is not None:
                conf_n += 1
                conf_in += predicted * math.exp(-bound) <= measured <= predicted * math.exp(bound)
    console.print(f"the bench's ratios to DDP inside the race's anytime intervals: {race_in} of {race_n}; inside the "
                  f"predicted ratio widened by the model's error ({level:.0%}, split conformal on the other rounds' "
                  f"races): {conf_in} of {conf_n}")


def _fmt(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.3f}"


if __name__ == "__main__":
    sys.exit(main())
