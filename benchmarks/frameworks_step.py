"""Lightning's training step against the plain DDP loop, the same plan inside DDP (`PlanHook`) in both, in one run.

    PYTHONPATH=docs/snippets planner profile --quick --model my_workloads:small_lm --nproc 2 -o lm.json
    PYTHONPATH=docs/snippets planner solve lm.json --strategy mixed -o lm-plan.json
    PYTHONPATH=docs/snippets torchrun --standalone --nproc_per_node 2 benchmarks/frameworks_step.py lm-plan.json

Each round runs the plan in a plain loop (DDP built with `hook.ddp_kwargs()`, the hook registered, SGD) and in
`Trainer.fit` with `lightning_strategy` (CPU, no logger, checkpoint, progress bar or model summary; the
LightningModule's `training_step` is the loop's forward and loss), the plain loop first in even rounds and
Lightning first in odd ones, each on a fresh copy of the model, with the same batches and data loader.
A step is the time between two consecutive step ends (after `optimizer.step()`; Lightning's `on_train_batch_end`),
the first `--warmup` of each run left out (DDP's first iteration lays out its buckets). Rank 0 prints each
round's medians and the median over all rounds of each, with their ratio (the goal: Lightning within 3% of the
plain loop), and, with `--json`, one JSON line. `--model` takes a built-in name or package.module:factory (the
plan made for it); the default is the docs' small LM (docs/snippets on PYTHONPATH). `--stock` also runs both
without the plan (plain DDP; Lightning's own `DDPStrategy`), in the same rounds, to tell Lightning's own cost per
step from the strategy's.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from planner.models import build_workload
from planner.runtime import PlanHook
from planner.runtime.frameworks import lightning_strategy


class _Lit(L.LightningModule):
    def __init__(self, net: nn.Module, loss_fn: Any, lr: float) -> None:
        super().__init__()
        self.net, self.loss_fn, self.lr = net, loss_fn, lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return self.loss_fn(self.net(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class _StepEnds(L.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())


def _intervals(ends: list[float], warmup: int) -> list[float]:
    return [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:], strict=False)]


def plain(workload: Any, plan: str | None, loader: DataLoader, lr: float) -> list[float]:
    model = workload.module
    if plan is None:
        ddp = DistributedDataParallel(model)
    else:
        hook = PlanHook.from_file(model, plan)
        ddp = DistributedDataParallel(model, **hook.ddp_kwargs())
        hook.register(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    ends = []
    for inputs, targets in loader:
        optimizer.zero_grad()
        workload.loss_fn(ddp(inputs), targets).backward()
        optimizer.step()
        ends.append(time.perf_counter())
    return ends


def lightning(workload: Any, plan: str | None, loader: DataLoader, lr: float) -> list[float]:
    ends = _StepEnds()
    strategy = DDPStrategy() if plan is None else lightning_strategy(plan, module=workload.module)
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_epochs=1,
                        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[ends])
    trainer.fit(_Lit(workload.module, workload.loss_fn, lr), loader)
    return ends.ends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="the plan file (made for --model, for the world size torchrun starts)")
    parser.add_argument("--model", default="my_workloads:small_lm", help="built-in name or package.module:factory")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first in each run (default 5)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of both runs, plain first in the even ones "
                        "(default 4)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--stock", action="store_true", help="also run both without the plan (DDP's own buckets and "
                        "allreduce; Lightning's DDPStrategy): Lightning's own cost beside the plan's")
    parser.add_argument("--json", action="store_true", help="also print one JSON line")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # Lightning takes the group torchrun's environment set up
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    first = build_workload(args.model)
    batches = [first.make_batch(first.batch_size, generator) for _ in range(args.warmup + args.steps + 1)]
    loader = DataLoader(batches, batch_size=None)
    rounds: list[dict[str, float]] = []
    pairs = [("", args.plan), ("stock ", None)] if args.stock else [("", args.plan)]
    runs: dict[str, list[float]] = {}
    for i in range(args.rounds):
        medians = {}
        for prefix, plan in pairs:
            order = ((f"{prefix}plain", plain), (f"{prefix}lightning", lightning))
            for name, run in order if i % 2 == 0 else order[::-1]:  # each goes first in every other round
                workload = build_workload(args.model)  # a fresh model: the last run's DDP leaves no hook on it
                gc.collect()
                dist.barrier()
                steps = _intervals(run(workload, plan, loader, args.lr), args.warmup)
                runs.setdefault(name, []).extend(steps)
                medians[name] = statistics.median(steps)
        rounds.append(medians)
    if rank != 0:
        return
    summary: dict[str, Any] = {"model": args.model, "plan": args.plan, "world_size": dist.get_world_size(),
                               "steps": len(runs["plain"]), "rounds": rounds}
    for prefix, _ in pairs:
        for i, m in enumerate(rounds):
            print(f"{prefix}round {i}: plain {m[prefix + 'plain'] * 1e3:.2f} ms  lightning "
                  f"{m[prefix + 'lightning'] * 1e3:.2f} ms  ratio {m[prefix + 'lightning'] / m[prefix + 'plain']:.3f}")
        plain_s, lightning_s = statistics.median(runs[prefix + "plain"]), statistics.median(runs[prefix + "lightning"])
        print(f"{prefix}median over {len(runs[prefix + 'plain'])} steps each: plain {plain_s * 1e3:.2f} ms  lightning "
              f"{lightning_s * 1e3:.2f} ms  ratio {lightning_s / plain_s:.3f}" + ("" if prefix else " (goal <= 1.03)"))
        key = prefix.strip().replace(" ", "_") + "_" if prefix else ""
        summary.update({f"{key}plain_median_s": plain_s, f"{key}lightning_median_s": lightning_s,
                        f"{key}ratio": lightning_s / plain_s})
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
