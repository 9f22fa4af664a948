"""Top-k with momentum on scikit-learn's digits: dense momentum SGD vs DGC momentum correction vs naive.

    python benchmarks/momentum_digits.py --steps 500 -o curves.png

Trains a 64-128-10 MLP on 2 gloo processes (each rank takes its half of every batch) three ways, from
the same initial weights and batches: dense momentum SGD (a dense plan, `torch.optim.SGD(momentum=m)`),
top-k with DGC momentum correction (`GradientExchange(momentum=m)`, optimizer without momentum) and
top-k with the optimizer's momentum applied after the sparse exchange (naive). The defaults are the
recipe of tests/test_momentum.py: global batch 256, lr 0.3 decayed linearly to 0, an L2 penalty of
1e-3 in the loss. Writes the full-data cross-entropy curves to a PNG and prints the final losses.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
from torch import nn

from planner.console import console
from planner.contracts.fingerprint import ClusterInfo, model_info
from planner.contracts.layers import gradient_layers
from planner.contracts.plan import Plan, Prediction
from planner.costmodel.problem import groups_for
from planner.platform.launch import run_distributed
from planner.runtime import GradientExchange
from planner.types import Strategy

METHODS = ("dense momentum SGD", "top-k + momentum correction", "top-k + optimizer momentum")


def per_layer_plan(model: nn.Module, strategy: Strategy, density: float | None, world_size: int) -> Plan:
    """A plan with one group per layer (ready order) and zero predictions: the exchange reads only the groups."""
    layers = gradient_layers(model)[::-1]
    zero = Prediction(iteration_s=0, compute_s=0, exposed_comm_s=0, comm_s=0)
    return Plan(
        strategy=strategy, density=density, model=model_info(model, "digits-mlp"),
        cluster=ClusterInfo(world_size=world_size, backend="gloo", device="cpu"),
        groups=groups_for(layers, tuple(range(1, len(layers) + 1)), strategy, density), predicted=zero,
        baselines={}, lower_bound_s=0.0, solver="per-layer", solve_seconds=0.0, source_profile="none",
        profiled="none", created="none",
    )  # fmt: skip


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits, features scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target, dtype=torch.long)


def train(rank: int, world_size: int, method: str, args: argparse.Namespace) -> list[float]:
    """Train one way; return the full-data loss every `args.eval_every` steps (and at the end)."""
    x, y = digits()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    if method == METHODS[0]:
        exchange = GradientExchange(model, per_layer_plan(model, Strategy.DENSE, None, world_size))
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    elif method == METHODS[1]:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        plan = per_layer_plan(model, Strategy.TOPK, args.density, world_size)
        exchange = GradientExchange(model, plan, momentum=args.momentum, optimizer=opt)
    else:
        exchange = GradientExchange(model, per_layer_plan(model, Strategy.TOPK, args.density, world_size))
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    batches = torch.Generator().manual_seed(args.seed)
    per_rank = args.batch_size // world_size
    curve = []
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            with torch.no_grad():
                curve.append(nn.functional.cross_entropy(model(x), y).item())
        if step == args.steps:
            break
        for group in opt.param_groups:
            group["lr"] = args.lr * (1 - step / args.steps) if args.decay else args.lr
        batch = torch.randint(0, len(x), (args.batch_size,), generator=batches)
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[mine]), y[mine])
        if args.l2:
            loss = loss + 0.5 * args.l2 * sum(p.pow(2).sum() for p in model.parameters())
        loss.backward()
        exchange.synchronize()
        opt.step()
    exchange.close()
    return curve


def worker(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, list[float]]:
    curves = {method: train(rank, world_size, method, args) for method in METHODS}
    dist.barrier()
    return curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--no-decay", dest="decay", action="store_false", help="keep lr constant (default: to 0)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch, split over the ranks")
    parser.add_argument("--l2", type=float, default=1e-3, help="L2 penalty in the loss (accelerated and compressed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("-o", "--output", default="curves.png")
    args = parser.parse_args()

    curves = run_distributed(worker, args.nproc, args, timeout=600)[0]
    xs = [min(i * args.eval_every, args.steps) for i in range(len(curves[METHODS[0]]))]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, curve in curves.items():
        ax.plot(xs, curve, label=f"{method} (final {curve[-1]:.4f})")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (all 1797 digits)")
    ax.set_title(f"digits MLP, {args.nproc} ranks, density {args.density}, momentum {args.momentum}, lr {args.lr}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    for method, curve in curves.items():
        final = curve[-1]
        shown = f"{final:.4f}" if math.isfinite(final) else "diverged"
        console.print(f"{method:<30} final loss {shown}")
    console.print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
