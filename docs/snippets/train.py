"""Train with a plan: `torchrun --nproc_per_node 2 train.py runs/plans/small-lm.json`."""

import sys

import torch
import torch.distributed as dist

from my_workloads import small_lm
from planner.runtime import GradientExchange

dist.init_process_group("gloo")
workload = small_lm()
model, loss_fn = workload.module, workload.loss_fn
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
generator = torch.Generator().manual_seed(dist.get_rank())  # each rank its own data
loader = [workload.make_batch(workload.batch_size, generator) for _ in range(5)]

# --8<-- [start:loop]
exchange = GradientExchange.from_file(model, sys.argv[1], optimizer=optimizer)
for inputs, targets in loader:
    optimizer.zero_grad()
    loss = loss_fn(model(inputs), targets)
    loss.backward()                               # the plan's collectives start from gradient hooks
    exchange.synchronize()                        # wait; averaged gradients are in .grad
    optimizer.step()
# --8<-- [end:loop]

print(f"rank {dist.get_rank()} loss {loss.item():.4f} checksum {sum(p.sum().item() for p in model.parameters()):.6f}", flush=True)
exchange.close()
dist.destroy_process_group()
