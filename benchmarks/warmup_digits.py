"""Top-k with DGC momentum correction and a density warm-up on scikit-learn's digits, step by step.

    python benchmarks/warmup_digits.py --steps 300 --every 50

Trains the 64-128-10 MLP of benchmarks/momentum_digits.py on 2 gloo processes (global batch 256, each rank its
half, constant lr) from the same weights and batches, in these ways (`--variants`):

- `topk`: top-k at `--density` with momentum correction (`GradientExchange(momentum=m)`), no warm-up;
- `warmup`: the same with `density_warmup=(--start, --warm-steps)`;
- `dense`: a dense plan with `torch.optim.SGD(momentum=m)`;
- `topk-nomask`, `warmup-nomask`: as `topk` and `warmup` without momentum factor masking (a diagnosis: the
  velocity is left as it is where the exchange sent);
- `topk-delayed`, `warmup-delayed`: masking only where the sent value held a residual from earlier steps.

Per step of the top-k ways it prints the density sent (sum of k over numel), the norm of what rank 0 sent over
the norm of its velocity and of its gradient, the share of the sent entries that were sent the step before, and,
for every way, the cross-entropy on all 1797 digits before the step. The diagnostic ways replace the exchange's
engine's `prepare` on the instance (momentum, then the codec's selection); nothing else is changed.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.distributed as dist
from momentum_digits import digits, per_layer_plan
from torch import nn

from planner.platform.launch import run_distributed
from planner.runtime import GradientExchange
from planner.types import Strategy

VARIANTS = ("topk", "warmup", "dense", "topk-nomask", "warmup-nomask", "topk-delayed", "warmup-delayed")


def _instrument(exchange: GradientExchange, variant: str, record: dict[str, float]) -> None:
    """Record what each group sends; change the masking for the diagnostic variants."""
    engine = exchange._engine
    original = engine.prepare
    previous: dict[int, set[int]] = {}

    def prepare(codec: Any, flat: torch.Tensor, velocity: torch.Tensor, *, taken: bool) -> None:
        grad_sq = flat.norm().item() ** 2
        velocity_sq = (velocity * engine.momentum + flat).norm().item() ** 2  # u = m u + g, before masking
        k = codec.k_now
        if variant.endswith(("-nomask", "-delayed")):
            velocity.mul_(engine.momentum).add_(flat)
            indices = codec.prepare(flat, velocity)
            if variant.endswith("-delayed"):
                idx = indices.long()
                values = codec.send[:k]
                velocity.index_fill_(0, idx[values != velocity[idx]], 0.0)  # a residual was added there
        else:
            original(codec, flat, velocity, taken=taken)
        sent = codec.send[:k]
        picked = set(codec.send[k : 2 * k].view(torch.int32).tolist())
        again = len(picked & previous.get(id(codec), set()))
        previous[id(codec)] = picked
        for key, value in (("k", k), ("sent_sq", sent.norm().item() ** 2), ("velocity_sq", velocity_sq),
                           ("grad_sq", grad_sq), ("again", again)):
            record[key] = record.get(key, 0.0) + value

    engine.prepare = prepare  # type: ignore[method-assign]


def train(rank: int, world_size: int, variant: str, args: argparse.Namespace) -> list[dict[str, float]]:
    x, y = digits()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    numel = sum(p.numel() for p in model.parameters())
    record: dict[str, float] = {}
    if variant == "dense":
        exchange = GradientExchange(model, per_layer_plan(model, Strategy.DENSE, None, world_size))
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        warmup = (args.start, args.warm_steps) if variant.startswith("warmup") else None
        exchange = GradientExchange(model, per_layer_plan(model, Strategy.TOPK, args.density, world_size),
                                    momentum=args.momentum, optimizer=opt, density_warmup=warmup)
        _instrument(exchange, variant, record)
    batches = torch.Generator().manual_seed(args.seed)
    per_rank = args.batch_size // world_size
    log = []
    for step in range(args.steps + 1):
        with torch.no_grad():
            entry = {"step": step, "loss": nn.functional.cross_entropy(model(x), y).item()}
        log.append(entry)
        if step == args.steps:
            break
        batch = torch.randint(0, len(x), (args.batch_size,), generator=batches)
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        opt.zero_grad()
        record.clear()
        nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        exchange.synchronize()
        opt.step()
        if record:
            entry.update(density=record["k"] / numel,
                         sent_over_velocity=(record["sent_sq"] / record["velocity_sq"]) ** 0.5,
                         sent_over_grad=(record["sent_sq"] / record["grad_sq"]) ** 0.5,
                         sent_again=record["again"] / record["k"])
    exchange.close()
    return log


def worker(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    logs = {variant: train(rank, world_size, variant, args) for variant in args.variants}
    dist.barrier()
    return logs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--start", type=float, default=0.25, help="the warm-up's first density")
    parser.add_argument("--warm-steps", type=int, default=500, help="the warm-up's length in steps")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch, split over the ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default="topk,warmup,dense", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--every", type=int, default=50, help="print every N steps")
    parser.add_argument("-o", "--output", default=None, help="write every step's record as JSON")
    args = parser.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; valid: {', '.join(VARIANTS)}")
    logs = run_distributed(worker, 2, args, timeout=600)[0]
    if args.output:
        with open(args.output, "w") as f:
            json.dump(logs, f)
    for variant, log in logs.items():
        print(f"{variant}")
        for entry in log:
            if entry["step"] % args.every == 0 or entry["step"] == args.steps:
                shown = (f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in entry.items())
                print("  " + "  ".join(shown))


if __name__ == "__main__":
    main()
