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
never measures slower than another beyond the margin). It passes "clearly" when no finalist beats the kept arm beyond
the margin by the bench's own 90% interval of their speedup (paired over the bench's interleaved rounds,
`planner.sessions.bench.paired_speedup_interval`): a bench is a measurement too. Every round is written to
`OUT/rounds.jsonl` as it ends, and the table of all rounds printed at the end (with each round's wall times:
profile, solve, race, bench).

    python benchmarks/verdict_audit.py --out runs/audit --rebench 3 --rebench 5

benches finished rounds again (the same finalists, links and steps; written to `OUT/rebench.jsonl`): do two
benches of the same arms agree where a bench and the race disagreed?
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

import numpy as np
from rich.table import Table

from planner.console import console
from planner.contracts.plan import Plan
from planner.sessions.bench import file_labels, paired_speedup_interval, plan_labels, via_ddp_label

PLANNER = [sys.executable, "-m", "planner"]
#: The race's margin where a round's record predates keeping it (`planner race --margin`'s default).
DEFAULT_MARGIN = 0.02


def _run(args: list[str], log: Path) -> tuple[float, str]:
    """Run a planner command, its output appended to `log`; its wall time and stdout (raises on failure)."""
    start = time.perf_counter()
    proc = subprocess.run([*PLANNER, *args], capture_output=True, text=True)
    with log.open("a") as out:
        out.write(f"$ planner {' '.join(args)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        raise RuntimeError(f"planner {args[0]} failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - start, proc.stdout


def _bench_names(plan: Plan, where: Path) -> dict[str, str]:
    """The race's arm name of the plan (in the runtime and inside DDP) and of each runner-up -> its bench row, the
    bench given the plan first and the runners-up after it, each as a plan file in `where` (`_bench`): the bench names
    each by what it sends, and by its file where two send alike (a plan and its next grouping)."""
    plans = [replace(plan, runners_up={}), *plan.runners_up.values()]
    bench = file_labels(plans, [where / f"bench-plan-{i}.json" for i in range(len(plans))])
    raced = plan_labels(plans[:1])[0]
    names = {raced: bench[0], via_ddp_label(raced): via_ddp_label(bench[0])}
    return {**names, **{f"runner-up {name}": label for name, label in zip(plan.runners_up, bench[1:], strict=True)}}


def _bench(where: Path, solved: Plan, arms: list[str], linked: list[str], steps: int, log: Path
           ) -> tuple[float, dict[str, dict[str, Any]]]:
    """`planner bench` of every finalist the race ran (the plan and each runner-up as plan files, DDP and the same
    hooks), interleaved, `steps` each: its wall time and its rows by name."""
    files = []
    for i, plan in enumerate([replace(solved, runners_up={}), *solved.runners_up.values()]):
        path = where / f"bench-plan-{i}.json"
        plan.save(path)
        files += ["--plan", str(path)]
    hooks = sorted({a.removeprefix("ddp+") for a in arms if a.startswith("ddp+") and "topk" not in a})
    bench_s, printed = _run(["bench", *files, *linked, "--steps", str(steps), "--peers", ",".join(hooks) or "none",
                             "--json"], log)
    return bench_s, {r["name"]: r for r in json.loads(printed[printed.index("["):])}


def judge(kept: str, margin: float, arms: list[str], rows: dict[str, dict[str, Any]], names: dict[str, str]
          ) -> dict[str, Any]:
    """The bench's verdict on the race's: each arm's median, its ratio to DDP, and whether it beat the kept arm
    beyond the margin, by the medians ("faster_than_kept", "passed") and by the medians' paired interval (the
    speedup of the arm over the kept one, its interleaved rounds resampled: "clearly_faster_than_kept" when the
    interval's lower end is beyond the margin, "passed_clearly"; `planner.sessions.bench.paired_speedup_interval`)."""
    found = {arm: rows[names.get(arm, arm)] for arm in arms if names.get(arm, arm) in rows}
    medians = {arm: row["median_s"] for arm, row in found.items()}
    beaten = sorted(arm for arm, m in medians.items() if arm != kept and kept in medians
                    and medians[kept] > (1 + margin) * m)
    over_kept: dict[str, list[float]] = {}
    if kept in found and "samples_s" in found[kept]:
        ours = found[kept]
        over_kept = {arm: list(paired_speedup_interval(ours["samples_s"], row["samples_s"], row["block"]))
                     for arm, row in found.items() if arm != kept and "samples_s" in row}
    clearly = sorted(arm for arm, (low, _) in over_kept.items() if low > 1 + margin)
    return {"bench_ms": {a: m * 1e3 for a, m in medians.items()},
            "bench_ratio": {a: m / medians["ddp"] for a, m in medians.items()} if "ddp" in medians else {},
            "bench_over_kept": {a: medians[kept] / m for a, m in medians.items() if a != kept and kept in medians},
            "bench_over_kept_interval": over_kept,
            "missing": sorted(set(arms) - set(medians)), "faster_than_kept": beaten,
            "passed": not beaten and kept in medians,
            **({"clearly_faster_than_kept": clearly, "passed_clearly": not clearly and kept in medians}
               if over_kept else {})}


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
        steps = max(3 * max(a["steps"] for a in race["arms"]), 20)
        bench_s, rows = _bench(where, solved, list(arms), linked, steps, log)
    finally:
        if loop is not None:
            loop.kill()
    result = {"round": index, "spec": spec, "kept": race["kept"], "rule": race["rule"], "rounds": race["rounds"],
              "margin": race["margin"], "race_steps": {a: arms[a]["steps"] for a in arms}, "bench_steps": steps,
              "race_ratio": {a: arms[a]["ratio_to_ddp"] for a in arms},
              "interval": {a: arms[a]["interval"] for a in arms},
              "predicted_ratio": {a: arms[a]["predicted_ratio"] for a in arms},
              **judge(race["kept"], race["margin"], list(arms), rows, _bench_names(solved, where)),
              "seconds": {"profile": profile_s, "solve": solve_s, "race": race_s, "bench": bench_s}}
    with (out / "rounds.jsonl").open("a") as f:
        f.write(json.dumps(result) + "\n")
    return result


def rebench(where: Path, record: dict[str, Any], link: str | None, steps: int | None = None) -> dict[str, Any]:
    """A second, independent bench of a finished round's finalists (its directory `where`, its line of
    rounds.jsonl `record`): the same arms and steps unless `steps`, judged as the round was. Does the bench agree
    with itself where it disagreed with the race?"""
    log = where / "rebench-log.txt"
    solved = Plan.load(where / "plan.json")
    steps = steps or record["bench_steps"]
    linked = [] if link in (None, "none") else ["--link", link]
    bench_s, rows = _bench(where, solved, list(record["race_ratio"]), linked, steps, log)
    margin = record.get("margin", DEFAULT_MARGIN)
    return {"round": record["round"], "spec": record["spec"], "kept": record["kept"], "bench_steps": steps,
            "first_bench_ratio": record["bench_ratio"], "first_passed": record["passed"],
            **judge(record["kept"], margin, list(record["race_ratio"]), rows, _bench_names(solved, where)),
            "seconds": {"bench": bench_s}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round", dest="rounds", action="append", default=[], metavar="MODEL:LINK[:busy]",
                        help="a round to run (none: summarise the rounds OUT holds)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--race-time", type=float, default=60.0)
    parser.add_argument("--rebench", type=int, action="append", default=[], metavar="ROUND",
                        help="bench a finished round of OUT again (its plans in OUT's round directory), "
                             "written to OUT/rebench.jsonl")
    parser.add_argument("--build-bias", type=float, default=0.006, metavar="SD",
                        help="the ceiling's bias of one build of an arm, a standard deviation on log time (default "
                             "0.006: benchmarks/race_twins.py, docs/results/race.md)")
    parser.add_argument("--error-scale", type=float, default=1.0, metavar="X",
                        help="the ceiling on benches X times as noisy as these, a build's bias too (default 1): how "
                             "quiet a machine the goal needs")
    args = parser.parse_args()
    if not (args.build_bias >= 0 and args.error_scale >= 0):  # NaN refused too
        parser.error("--build-bias and --error-scale take 0 or more")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.rebench:
        return _rebench_rounds(args.out, args.rebench)
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
                "faster in the bench", "profile+solve+race s", "passed", "passed by the bench's interval"):
        table.add_column(col)
    for r in results:
        kept = r["kept"]
        table.add_row(str(r["round"]), r["spec"], f"{kept} ({r['rule']}, {r['rounds']})",
                      _fmt(r["race_ratio"].get(kept)), _fmt(r["bench_ratio"].get(kept)),
                      ", ".join(r["faster_than_kept"]) or "-",
                      f"{r['seconds']['profile'] + r['seconds']['solve'] + r['seconds']['race']:.0f}",
                      "yes" if r["passed"] else "NO",
                      "-" if "passed_clearly" not in r else "yes" if r["passed_clearly"] else "NO")
    console.print(table)
    passed = sum(r["passed"] for r in results)
    console.print(f"{passed} of {len(results)} rounds: the kept arm never measured slower than another beyond the "
                  "margin")
    judged = [r for r in results if "passed_clearly" in r]
    if judged:
        console.print(f"{sum(r['passed_clearly'] for r in judged)} of {len(judged)} rounds with the bench's steps "
                      "kept: no arm faster than the kept one beyond the margin by the bench's 90% interval")
    print_coverage(results)
    print_ceiling(results[-20:], args.build_bias, args.error_scale)
    return 0


def _rebench_rounds(out: Path, rounds: list[int]) -> int:
    """Bench each of `rounds` again (`rebench`), appending to OUT/rebench.jsonl, and print both benches' verdicts."""
    records = {r["round"]: r for r in map(json.loads, (out / "rounds.jsonl").read_text().splitlines())}
    for index in rounds:
        if index not in records:
            console.print(f"no round {index} in {out / 'rounds.jsonl'}: give one of {', '.join(map(str, records))}")
            return 2
        record = records[index]
        model, link, *_ = record["spec"].split(":")
        where = next(out.glob(f"{index:02d}-{model}-{link}*"))
        console.print(f"round {index} ({record['spec']}) benched again")
        busy = record["spec"].endswith(":busy")
        loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            again = rebench(where, record, link)
        finally:
            if loop is not None:
                loop.kill()
        with (out / "rebench.jsonl").open("a") as f:
            f.write(json.dumps(again) + "\n")
        kept = record["kept"]
        for arm, ratio in again["bench_over_kept"].items():
            low, high = again["bench_over_kept_interval"].get(arm, [math.nan, math.nan])
            first = record["bench_ratio"][kept] / record["bench_ratio"][arm]
            console.print(f"  {arm} over kept {kept}: first bench {first:.3f}, again {ratio:.3f} "
                          f"[{low:.3f}, {high:.3f}]")
        console.print(f"  passed: first bench {'yes' if record['passed'] else 'NO'}, again by medians "
                      f"{'yes' if again['passed'] else 'NO'}, again by the paired interval "
                      f"{'yes' if again.get('passed_clearly') else 'NO'}")
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


def print_ceiling(results: list[dict[str, Any]], build_bias: float, scale: float = 1.0, draws: int = 20000) -> None:
    """How many of `results` a race that knew the truth would be expected to pass, the bench judging it as the audit
    does (its medians, the margin): a ceiling on the audit's pass rate that the bench's own noise sets.

    The truth is each round's bench medians (a plug-in estimate: the bench is all there is). Three races know it:
    one keeps the simplest arm no other is faster than beyond the margin (the race's own rule), one the simplest
    arm within half the margin of every other, one the fastest arm. The bench then measures each arm's log time
    with an error of standard deviation sqrt(s^2 / 2 + build_bias^2), s the standard error of a paired log ratio in
    that bench (from the round's paired 90% intervals where it kept its steps, else the median over the rounds that
    did): the same error as its intervals, plus a build's own bias, which they do not see; both times `scale`.
    Rounds are independent."""
    errors = {r["round"]: [math.log(high / low) / (2 * 1.645) for low, high in r["bench_over_kept_interval"].values()]
              for r in results if r.get("bench_over_kept_interval")}
    if not errors:
        return
    typical = float(np.median([e for es in errors.values() for e in es]))
    rng = np.random.default_rng(0)
    # Each race that knows: the share of the margin within which it keeps the simplest arm (0: the fastest).
    within = {"the simplest within the margin": 1.0, "the simplest within half the margin": 0.5, "the fastest": 0.0}
    passes: dict[str, list[float]] = {oracle: [] for oracle in within}
    for r in results:
        slack = math.log(1 + r.get("margin", DEFAULT_MARGIN))
        arms = [a for a in r["race_ratio"] if a in r["bench_ratio"]]
        truth = np.log([r["bench_ratio"][a] for a in arms])
        paired = float(np.median(errors[r["round"]])) if r["round"] in errors else typical
        sd = scale * math.sqrt(paired ** 2 / 2 + build_bias ** 2)
        measured = truth + rng.normal(0.0, sd, size=(draws, len(arms)))
        fastest = measured.min(axis=1)
        for oracle, share in within.items():
            kept = next(i for i, t in enumerate(truth) if t <= truth.min() + share * slack)
            passes[oracle].append(float(np.mean(measured[:, kept] <= fastest + slack)))
    goal = math.ceil(0.95 * len(results))
    for oracle, chances in passes.items():
        at_least = np.array([1.0])  # the chance of k passes, k = 0, 1, ...
        for p in chances:
            at_least = np.convolve(at_least, [1 - p, p])
        console.print(f"a race that knew each round's bench medians and kept {oracle} would pass {sum(chances):.1f} "
                      f"of the last {len(chances)} rounds in expectation, at least {goal} with chance "
                      f"{at_least[goal:].sum():.2f}")
    console.print(f"  (judged by benches {'as noisy as these' if scale == 1 else f'{scale:g} times as noisy as these'}"
                  f": paired standard error {typical:.4f} where a round kept none, a build's own bias {build_bias:g})")


def _fmt(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.3f}"


if __name__ == "__main__":
    sys.exit(main())
