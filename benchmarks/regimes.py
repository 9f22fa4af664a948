"""Where planning matters: profile, solve and bench each model over loopback and behind an emulated link.

    python benchmarks/regimes.py --models resnet18,vgg16,lstm --links none,1gbit -o bench-results

For every (model, link) it runs the commands a user would, on 2 local workers:

    planner profile --model M --nproc 2 --densities 0.001,0.01,0.1 [--link L] -o OUT/M-L.json
    planner solve OUT/M-L.json --strategy dense -o OUT/M-L-dense.json
    planner solve OUT/M-L.json --strategy topk --density 0.01 -o OUT/M-L-topk.json
    planner bench --model M --plan OUT/M-L-dense.json --plan OUT/M-L-topk.json --steps S [--link L] --json

and prints one table: each variant's median step time, its ratio to DDP measured in the same run, the
prediction and |predicted - measured| / measured, and the top-k plan's compute-path bound as a ratio to
DDP (no top-k plan can be faster than forward + backward + selection + update). `--link` needs root;
`none` is loopback. The bench JSON of every run stays in OUT.
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


def measure(model: str, link: str, out: Path, steps: int, density: float) -> list[dict]:
    """Profile, solve and bench one model on one network; the bench rows (dicts of `BenchResult.to_dict`)
    with the top-k plan's lower bound added."""
    tag = f"{model}-{link}"
    link_args = [] if link == "none" else ["--link", link]
    profile, dense, topk = out / f"{tag}.json", out / f"{tag}-dense.json", out / f"{tag}-topk.json"
    _run(["profile", "--model", model, "--nproc", "2", "--densities", "0.001,0.01,0.1", *link_args, "-o", str(profile)])
    _run(["solve", str(profile), "--strategy", "dense", "-o", str(dense)])
    _run(["solve", str(profile), "--strategy", "topk", "--density", f"{density:g}", "-o", str(topk)])
    text = _run(["bench", "--model", model, "--plan", str(dense), "--plan", str(topk), "--steps", str(steps),
                 *link_args, "--json"])
    (out / f"{tag}-bench.json").write_text(text)
    rows = json.loads(text)
    topk_plan = Plan.load(topk)
    for row in rows:
        row.update(model=model, link=link, selector=topk_plan.selector, topk_bound_s=topk_plan.lower_bound_s)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet18,vgg16,lstm")
    parser.add_argument("--links", default="none,1gbit", help="networks: none (loopback) or a rate such as 1gbit")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("-o", "--output", type=Path, default=Path("bench-results"))
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    rows = [row for model in args.models.split(",") for link in args.links.split(",")
            for row in measure(model, link, args.output, args.steps, args.density)]
    console.print("\n| model | network | variant | median ms | vs DDP | predicted ms | error |")
    console.print("|---|---|---|---|---|---|---|")
    for r in rows:
        ddp = next(x for x in rows if x["model"] == r["model"] and x["link"] == r["link"] and x["name"] == "ddp")
        pred = "" if r["predicted_s"] is None else f"{r['predicted_s'] * 1e3:.1f}"
        err = "" if r["rel_error"] is None else f"{r['rel_error']:.1%}"
        name = r["name"] + (f" ({r['selector']})" if r["name"].startswith("plan topk") else "")
        console.print(f"| {r['model']} | {r['link']} | {name} | {r['median_s'] * 1e3:.1f} | "
                      f"{r['median_s'] / ddp['median_s']:.2f} | {pred} | {err} |")
    console.print("\ncompute-path bound of any top-k plan, as a ratio to DDP's measured step:")
    for model, link in dict.fromkeys((r["model"], r["link"]) for r in rows):
        ddp = next(x for x in rows if x["model"] == model and x["link"] == link and x["name"] == "ddp")
        console.print(f"  {model} {link}: {ddp['topk_bound_s'] / ddp['median_s']:.2f}")


if __name__ == "__main__":
    main()
