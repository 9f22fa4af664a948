"""Micro-benchmark of the top-k selectors of `planner.kernels.topk.select_topk` on one CPU thread.

    .venv/bin/python benchmarks/topk_selectors.py [--sizes 1M,10M,25M] [--densities 0.001,0.01]
                                                  [--repeats 5] [--warmup 1] [--json]

For each size and density, every selector does the runtime's work: `residual += grad`, pick k, zero
them in the residual. Each timed call starts from a fresh copy of the same residual (copied untimed),
as the profiler times it; the table shows the median seconds per selector, exact/sampled, and the
recall of the sampled selection against the exact one (|sampled ∩ exact| / k; below 1 only on ties).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from typing import Any

import torch
from rich.table import Table

from planner.console import console
from planner.costmodel.problem import topk_count
from planner.kernels.topk import SELECTORS, select_topk
from planner.platform.timing import median, time_call

_UNITS = {"K": 10**3, "M": 10**6, "G": 10**9}


def _size(text: str) -> int:
    """An element count: 25000000, 25M, 2.5M, 500K."""
    t = text.strip().upper()
    scale = _UNITS.get(t[-1:], 1)
    try:
        n = round(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 10M, 500K, 1000000)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"`size > 0` must hold, but got {text!r}")
    return n


def _density(text: str) -> float:
    try:
        d = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a density: {text!r}") from None
    if not 0 < d <= 1:
        raise argparse.ArgumentTypeError(f"`0 < density <= 1` must hold, but got {text!r}")
    return d


def _list(kind: Any) -> Any:
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def measure(numel: int, density: float, *, repeats: int, warmup: int, seed: int = 0) -> dict[str, Any]:
    """One row: median seconds of every selector, exact/sampled, and the sampled selection's recall."""
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(numel, generator=gen)
    start = torch.randn(numel, generator=gen).mul_(0.5)  # error feedback left over from earlier steps
    residual = torch.empty_like(start)
    k = topk_count(numel, density)
    row: dict[str, Any] = {"numel": numel, "density": density, "k": k}
    picked = {}
    for selector in SELECTORS:
        call = partial(select_topk, grad, residual, k, selector=selector)
        samples = time_call(call, torch.device("cpu"), repeats=repeats, warmup=warmup,
                            before=partial(residual.copy_, start))
        row[f"{selector}_s"] = median(samples)
        residual.copy_(start)
        picked[selector] = select_topk(grad, residual, k, selector=selector)[1].long()
    row["speedup"] = row["exact_s"] / row["sampled_s"]
    row["recall"] = torch.isin(picked["sampled"], picked["exact"]).sum().item() / k
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_list(_size), default=[10**6, 10**7, 25 * 10**6],
                        help="comma-separated element counts (default 1M,10M,25M)")
    parser.add_argument("--densities", type=_list(_density), default=[0.001, 0.01],
                        help="comma-separated top-k densities (default 0.001,0.01)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per selector (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the workers use 1)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1:
        parser.error(f"`repeats >= 1, warmup >= 0, threads >= 1` must hold, but got "
                     f"({args.repeats}, {args.warmup}, {args.threads})")
    torch.set_num_threads(args.threads)
    rows = [measure(n, d, repeats=args.repeats, warmup=args.warmup) for n in args.sizes for d in args.densities]
    if args.json:
        meta = {"torch": torch.__version__, "threads": args.threads, "repeats": args.repeats, "warmup": args.warmup}
        json.dump({**meta, "rows": rows}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    table = Table(title=f"top-k selection with error feedback, {args.threads} thread(s), median of {args.repeats}")
    for col in ("elements", "density", "k", "exact ms", "sampled ms", "exact/sampled", "recall"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['numel']:,}", f"{r['density']:g}", f"{r['k']:,}", f"{r['exact_s'] * 1e3:.2f}",
                      f"{r['sampled_s'] * 1e3:.2f}", f"{r['speedup']:.1f}x", f"{r['recall']:.4f}")
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
