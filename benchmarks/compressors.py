"""What is sent, planned: the mixed plan against PyTorch's own DDP hooks, by step time and by time to a target loss.

    python benchmarks/compressors.py --models resnet18,vgg16,lstm --links none,1gbit -o bench-results/compressors

For every (model, link) it runs the commands a user would, on 2 local workers:

    planner profile --model M --nproc 2 --densities 0.001,0.01,0.1 [--link L] -o OUT/M-L.json
    planner solve OUT/M-L.json --strategy mixed --compressors all -o OUT/M-L-mixed.json
    planner solve OUT/M-L.json --strategy mixed --compressors C -o OUT/M-L-only-C.json   (C: fp16, powersgd:1,
                                                                                          powersgd:4, topk:0.01)
    planner bench --model M --plan OUT/M-L-mixed.json --plan OUT/M-L-only-*.json --steps S [--link L] --json

and prints one table: each variant's median step, its ratio to DDP in the same run, the prediction and
|predicted - measured| / measured: DDP, DDP with fp16_compress_hook, with powerSGD_hook at rank 1 and 4, with the
project's top-k hook, the best single-compressor plan and the mixed plan. With `--target M=T,...` it also runs

    planner solve OUT/M-L.json --strategy mixed --compressors B -o OUT/M-L-mixed-B.json   (B: lowrank, light)
    planner bench --model M --plan OUT/M-L-mixed.json --plan OUT/M-L-mixed-B.json ... [--plan BEST]
        --target-loss T --samples N [--link L] --json

(the digits model on the digits, the others as students of a fixed random teacher; BEST is the fastest
single-compressor plan in the step bench; a plan that sends what an earlier one sends runs once) and prints the
time to the target loss of DDP, its hooks and those plans: the mixed plan under three accuracy budgets.
`--link` needs root; `none` is loopback. The JSON of every run stays in OUT.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from planner.console import console
from planner.contracts.plan import Plan
from planner.sessions.bench import file_labels

ONLY = ("fp16", "powersgd:1", "powersgd:4", "topk:0.01")
#: Where the rows of the mixed plan over every compressor carry their bench name (`planner bench` names a plan by
#: what it sends, and by its file where two would read the same).
MIXED_NAME = "mixed_name"


def _run(args: list[str]) -> str:
    """Run `planner ARGS`, echo the command, return its stdout; stop with its stderr on failure."""
    console.print(f"$ planner {' '.join(args)}", style="dim")
    proc = subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"planner {' '.join(args)} failed:\n{proc.stderr.strip()}")
    return proc.stdout


def plans_for(model: str, link: str, out: Path) -> tuple[list[str], Path]:
    """Profile and solve one model on one network: the plan files (the mixed plan first) and the profile."""
    tag = f"{model}-{link}"
    link_args = [] if link == "none" else ["--link", link]
    profile = out / f"{tag}.json"
    if not profile.exists():
        _run(["profile", "--model", model, "--nproc", "2", "--densities", "0.001,0.01,0.1", *link_args, "-o",
              str(profile)])
    paths = [out / f"{tag}-mixed.json", *(out / f"{tag}-only-{c}.json" for c in ONLY)]
    _run(["solve", str(profile), "--strategy", "mixed", "--compressors", "all", "-o", str(paths[0])])
    for c, path in zip(ONLY, paths[1:], strict=True):
        _run(["solve", str(profile), "--strategy", "mixed", "--compressors", c, "-o", str(path)])
    return [str(p) for p in paths], profile


def step_rows(model: str, link: str, plans: list[str], out: Path, steps: int) -> list[dict]:
    """The step-time bench of DDP, its hooks, the single-compressor plans and the mixed plan."""
    link_args = [] if link == "none" else ["--link", link]
    plan_args = [arg for p in plans for arg in ("--plan", p)]
    text = _run(["bench", "--model", model, *plan_args, "--steps", str(steps), *link_args, "--json"])
    (out / f"{model}-{link}-bench.json").write_text(text)
    rows = json.loads(text)
    mixed = file_labels([Plan.load(p) for p in plans], plans)[0]  # the mixed plan comes first
    for row in rows:
        row.update(model=model, link=link, **{MIXED_NAME: mixed})
    return rows


def _sends(plan: Plan) -> tuple:
    return tuple((g.layers, str(plan.compressor_of(g))) for g in plan.groups)


#: The accuracy budgets the time-to-target runs plan with besides "all" (presets of `--compressors`).
BUDGETS = ("lowrank", "light")


def target_plans(model: str, link: str, plans: list[str], out: Path) -> list[str]:
    """The plans the time-to-target bench runs: the mixed plan over every compressor, the mixed plans of the
    smaller budgets (`BUDGETS`), and the fastest single-compressor plan (by the step bench's median when it ran,
    else by prediction); a plan that sends exactly what an earlier one sends runs once."""
    tag = f"{model}-{link}"
    profile = out / f"{tag}.json"
    budgets = [out / f"{tag}-mixed-{b}.json" for b in BUDGETS]
    for budget, path in zip(BUDGETS, budgets, strict=True):
        _run(["solve", str(profile), "--strategy", "mixed", "--compressors", budget, "-o", str(path)])
    singles = {p: Plan.load(p) for p in plans[1:]}
    steps = out / f"{tag}-bench.json"
    measured = {r["name"]: r["median_s"] for r in json.loads(steps.read_text())} if steps.exists() else {}
    names = dict(zip(plans, file_labels([Plan.load(p) for p in plans], plans), strict=True))  # as the bench ran them

    def speed(path: str) -> float:
        return measured.get(names[path], singles[path].predicted.iteration_s)

    chosen: dict[tuple, str] = {}
    for path in [plans[0], *map(str, budgets), min(singles, key=speed)]:
        sends = _sends(Plan.load(path))
        if sends in chosen:
            console.print(f"{tag}: {Path(path).name} sends what {Path(chosen[sends]).name} sends; it runs once")
        else:
            chosen[sends] = path
    return list(chosen.values())


def target_rows(model: str, link: str, plans: list[str], out: Path, target: float, samples: int | None,
                lr: float | None, repeats: int | None) -> dict:
    """The time-to-target bench of DDP, its hooks and `plans`."""
    link_args = [] if link == "none" else ["--link", link]
    plan_args = [arg for p in plans for arg in ("--plan", p)]
    extra = [*(["--samples", str(samples)] if samples else []), *(["--lr", str(lr)] if lr else []),
             *(["--repeats", str(repeats)] if repeats else [])]
    text = _run(["bench", "--model", model, *plan_args, "--target-loss", str(target), *extra, *link_args, "--json"])
    (out / f"{model}-{link}-target.json").write_text(text)
    return json.loads(text)


def print_steps(rows: list[dict]) -> None:
    console.print("\n| model | network | variant | median ms | vs DDP | predicted ms | error |")
    console.print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["name"] == "local (no communication)" or r["name"].startswith("per-layer"):
            continue
        ddp = next(x for x in rows if x["model"] == r["model"] and x["link"] == r["link"] and x["name"] == "ddp")
        pred = "" if r["predicted_s"] is None else f"{r['predicted_s'] * 1e3:.1f}"
        err = "" if r["rel_error"] is None else f"{r['rel_error']:.1%}"
        console.print(f"| {r['model']} | {r['link']} | {r['name']} | {r['median_s'] * 1e3:.1f} | "
                      f"{r['median_s'] / ddp['median_s']:.2f} | {pred} | {err} |")
    console.print("\nmixed plan against the best DDP hook and against DDP, measured in the same run:")
    for model, link in dict.fromkeys((r["model"], r["link"]) for r in rows):
        here = [r for r in rows if r["model"] == model and r["link"] == link]
        mine = {r["name"]: r["median_s"] for r in here}
        mixed = here[0][MIXED_NAME]
        hooks = {n: t for n, t in mine.items() if n.startswith("ddp+")}
        best = min(hooks, key=hooks.__getitem__) if hooks else None
        singles = {n: t for n, t in mine.items() if n.startswith("plan ") and n != mixed}
        best_single = min(singles, key=singles.__getitem__) if singles else None
        line = f"  {model} {link}: mixed {mine[mixed] / mine['ddp']:.2f}x DDP"
        if best:
            line += f", {mine[mixed] / hooks[best]:.2f}x the best hook ({best})"
        if best_single:
            line += f", {mine[mixed] / singles[best_single]:.2f}x the best single-compressor plan " \
                    f"({best_single})"
        console.print(line)


def print_target(model: str, link: str, doc: dict) -> None:
    console.print(f"\ntime to evaluation loss <= {doc['target_loss']:g}, {model} ({doc['task']} task), {link}:")
    console.print("| variant | time to target s | samples to target | final loss | vs best DDP/hook |")
    console.print("|---|---|---|---|---|")
    for v in doc["variants"]:
        t = "not reached" if v["time_to_target_s"] is None else f"{v['time_to_target_s']:.1f}"
        n = "-" if v["samples_to_target"] is None else f"{v['samples_to_target']:,.0f}"
        sp = "-" if v["speedup"] is None else f"{v['speedup']:.2f}x"
        console.print(f"| {v['variant']} | {t} | {n} | {v['final_loss']:.3f} | {sp} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet18,vgg16,lstm")
    parser.add_argument("--links", default="none,1gbit", help="networks: none (loopback) or a rate such as 1gbit")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--target", default="", metavar="MODEL=LOSS[,...]",
                        help="also run these models to these evaluation losses (e.g. digits=0.1,lstm=5)")
    parser.add_argument("--samples", type=int, default=None, help="samples per time-to-target run")
    parser.add_argument("--lr", type=float, default=None, help="learning rate of the time-to-target runs")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each variant to the target (default 1)")
    parser.add_argument("--no-steps", action="store_true", help="only the time-to-target runs")
    parser.add_argument("-o", "--output", type=Path, default=Path("bench-results/compressors"))
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    try:
        targets_of = {m.strip(): float(t) for m, t in (p.split("=", 1) for p in args.target.split(",") if p.strip())}
    except ValueError:
        parser.error(f"--target takes MODEL=LOSS pairs such as digits=0.1,lstm=5, not {args.target!r}")
    rows, targets = [], []
    for model in args.models.split(","):
        for link in args.links.split(","):
            plans, _ = plans_for(model, link, args.output)
            mixed = Plan.load(plans[0])
            console.print(f"{model} {link}: the mixed plan sends "
                          + ", ".join(dict.fromkeys(str(mixed.compressor_of(g)) for g in mixed.groups)))
            if not args.no_steps:
                rows += step_rows(model, link, plans, args.output, args.steps)
            if model in targets_of:
                chosen = target_plans(model, link, plans, args.output)
                targets.append((model, link, target_rows(model, link, chosen, args.output, targets_of[model],
                                                         args.samples, args.lr, args.repeats)))
    if rows:
        print_steps(rows)
    for model, link, doc in targets:
        print_target(model, link, doc)


if __name__ == "__main__":
    main()
