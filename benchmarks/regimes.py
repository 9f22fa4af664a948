"""Where planning matters: profile, solve and bench each model over loopback and behind an emulated link.

    python benchmarks/regimes.py --models resnet18,vgg16,lstm --links none,1gbit -o bench-results
    python benchmarks/regimes.py --models mlp --links none,1gbit,200mbit --plans dense,auto      # both ways
    python benchmarks/regimes.py --models mlp --links 200mbit --nproc 4 --hosts 2 --plans dense,auto

For every (model, link) it runs the commands a user would, on --nproc local workers (default 2):

    planner profile --model M --nproc 2 --densities 0.001,0.01,0.1 [--link L] -o OUT/M-L.json
    planner solve OUT/M-L.json --strategy dense -o OUT/M-L-dense.json
    planner solve OUT/M-L.json --strategy topk --density 0.01 -o OUT/M-L-topk.json
    planner solve OUT/M-L.json --strategy auto --compressors all -o OUT/M-L-auto.json     (with --plans auto)
    planner bench --model M --plan OUT/M-L-dense.json --plan OUT/M-L-topk.json --steps S [--link L] --json

(`--plans` names which plans; `--hosts H` splits the workers into H emulated hosts, as `planner bench --hosts`.)
It prints one table: each variant's median step time, its ratio to DDP measured in the same run, the
prediction and |predicted - measured| / measured, and the top-k plan's compute-path bound as a ratio to
DDP (no top-k plan can be faster than forward + backward + selection + update). The bench runs every plan both
ways, in GradientExchange ("plan X") and inside DDP ("plan X via DDP", `PlanHook`); a second table puts the two
side by side with the fastest of DDP's own hooks. `--link` and `--hosts` need root; `none` is loopback. The
bench JSON of every run, and solve's output (auto's line on which way to run its plan), stay in OUT.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from planner.console import console
from planner.contracts.plan import Plan


def _run(args: list[str]) -> str:
    """Run `planner ARGS`, echo the command, return its stdout; stop with its stderr on failure."""
    console.print(f"[dim]$ planner {' '.join(args)}[/dim]")
    proc = subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"planner {' '.join(args)} failed:\n{proc.stderr.strip()}")
    return proc.stdout


def measure(model: str, link: str, out: Path, steps: int, density: float, plans: list[str], nproc: int = 2,
            hosts: int | None = None) -> list[dict]:
    """Profile, solve and bench one model on one network; the bench rows (dicts of `BenchResult.to_dict`)
    with the top-k plan's lower bound added (where a top-k plan was solved)."""
    tag = f"{model}-{link}" + ("" if nproc == 2 and hosts is None else f"-{nproc}w") + (f"-{hosts}h" if hosts else "")
    net_args = ([] if link == "none" else ["--link", link]) + ([] if hosts is None else ["--hosts", str(hosts)])
    profile = out / f"{tag}.json"
    _run(["profile", "--model", model, "--nproc", str(nproc), "--densities", "0.001,0.01,0.1", *net_args,
          "-o", str(profile)])
    solved: dict[str, Path] = {}
    for kind in plans:
        path = solved[kind] = out / f"{tag}-{kind}.json"
        how = {"dense": ["--strategy", "dense"], "topk": ["--strategy", "topk", "--density", f"{density:g}"],
               "auto": ["--strategy", "auto", "--compressors", "all"]}[kind]
        (out / f"{tag}-{kind}.solve.txt").write_text(_run(["solve", str(profile), *how, "-o", str(path)]))
    plan_args = [arg for path in solved.values() for arg in ("--plan", str(path))]
    text = _run(["bench", "--model", model, *plan_args, "--steps", str(steps), *net_args, "--json"])
    (out / f"{tag}-bench.json").write_text(text)
    rows = json.loads(text)
    bound = Plan.load(solved["topk"]).lower_bound_s if "topk" in solved else None
    selector = Plan.load(solved["topk"]).selector if "topk" in solved else None
    for row in rows:
        row.update(model=model, link=tag.removeprefix(f"{model}-"), selector=selector, topk_bound_s=bound)
    return rows


def _both_ways(rows: list[dict]) -> None:
    """Each plan in GradientExchange and inside DDP, beside DDP and the fastest of DDP's own hooks."""
    console.print("\n| model | network | plan | DDP ms | best DDP hook | plan ms (vs DDP) | via DDP ms (vs DDP) "
                  "| via DDP predicted | via DDP / best hook |")
    console.print("|---|---|---|---|---|---|---|---|---|")
    for model, link in dict.fromkeys((r["model"], r["link"]) for r in rows):
        mine = {r["name"]: r for r in rows if r["model"] == model and r["link"] == link}
        ddp = mine["ddp"]["median_s"]
        hooks = [r for n, r in mine.items() if n.startswith("ddp+")]
        best = min(hooks, key=lambda r: r["median_s"]) if hooks else None
        for name, row in mine.items():
            via = mine.get(f"{name} via DDP")
            if not name.startswith("plan ") or via is None:
                continue
            pred = "-" if via["predicted_s"] is None else f"{via['predicted_s'] * 1e3:.1f}"
            hook = "-" if best is None else f"{best['name']} {best['median_s'] * 1e3:.1f}"
            ratio = "-" if best is None else f"{via['median_s'] / best['median_s']:.2f}"
            console.print(f"| {model} | {link} | {name.removeprefix('plan ')} | {ddp * 1e3:.1f} | {hook} | "
                          f"{row['median_s'] * 1e3:.1f} ({row['median_s'] / ddp:.2f}) | "
                          f"{via['median_s'] * 1e3:.1f} ({via['median_s'] / ddp:.2f}) | {pred} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet18,vgg16,lstm")
    parser.add_argument("--links", default="none,1gbit", help="networks: none (loopback) or a rate such as 1gbit")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--plans", default="dense,topk", help="which plans to solve and bench: dense, topk, auto")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hosts", type=int, default=None, help="emulated hosts (needs root and --link)")
    parser.add_argument("-o", "--output", type=Path, default=Path("bench-results"))
    args = parser.parse_args()
    plans = args.plans.split(",")
    if not plans or not set(plans) <= {"dense", "topk", "auto"}:
        sys.exit(f"--plans takes dense, topk and auto, but got {args.plans!r}")
    args.output.mkdir(parents=True, exist_ok=True)
    rows = [row for model in args.models.split(",") for link in args.links.split(",")
            for row in measure(model, link, args.output, args.steps, args.density, plans, args.nproc, args.hosts)]
    console.print("\n| model | network | variant | median ms | vs DDP | predicted ms | error |")
    console.print("|---|---|---|---|---|---|---|")
    for r in rows:
        ddp = next(x for x in rows if x["model"] == r["model"] and x["link"] == r["link"] and x["name"] == "ddp")
        pred = "" if r["predicted_s"] is None else f"{r['predicted_s'] * 1e3:.1f}"
        err = "" if r["rel_error"] is None else f"{r['rel_error']:.1%}"
        name = r["name"] + (f" ({r['selector']})" if r["name"].startswith("plan topk") and r["selector"] else "")
        console.print(f"| {r['model']} | {r['link']} | {name} | {r['median_s'] * 1e3:.1f} | "
                      f"{r['median_s'] / ddp['median_s']:.2f} | {pred} | {err} |")
    _both_ways(rows)
    if any(r["topk_bound_s"] is not None for r in rows):
        console.print("\ncompute-path bound of any top-k plan, as a ratio to DDP's measured step:")
    for model, link in dict.fromkeys((r["model"], r["link"]) for r in rows if r["topk_bound_s"] is not None):
        ddp = next(x for x in rows if x["model"] == model and x["link"] == link and x["name"] == "ddp")
        console.print(f"  {model} {link}: {ddp['topk_bound_s'] / ddp['median_s']:.2f}")


if __name__ == "__main__":
    main()
