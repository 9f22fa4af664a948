"""Train with a K-FAC plan: `torchrun --nproc_per_node 2 train_kfac.py runs/plans/small-lm-kfac.json`."""

import sys

import torch
import torch.distributed as dist

from my_workloads import small_lm
from planner.runtime import KFACPreconditioner

dist.init_process_group("gloo")
workload = small_lm()
model, loss_fn = workload.module, workload.loss_fn
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
generator = torch.Generator().manual_seed(dist.get_rank())
loader = [workload.make_batch(workload.batch_size, generator) for _ in range(5)]

# --8<-- [start:loop]
precond = KFACPreconditioner.from_file(model, sys.argv[1], lr=0.01)
for inputs, targets in loader:
    optimizer.zero_grad()
    loss = loss_fn(model(inputs), targets)        # a mean over the local batch
    loss.backward()                               # hooks compute factors, allreduce them in planned buffers
    precond.step()                                # average gradients, invert on owners, precondition
    optimizer.step()
# --8<-- [end:loop]

print(f"rank {dist.get_rank()} loss {loss.item():.4f} checksum {sum(p.sum().item() for p in model.parameters()):.6f}", flush=True)
dist.destroy_process_group()
