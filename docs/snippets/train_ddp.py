"""A plan inside plain DDP: `torchrun --nproc_per_node 2 train_ddp.py plan.json`."""

import gc
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from my_workloads import small_lm
from planner.runtime import PlanHook

dist.init_process_group("gloo")
workload = small_lm()
model, loss_fn = workload.module, workload.loss_fn
generator = torch.Generator().manual_seed(dist.get_rank())  # each rank its own data
loader = [workload.make_batch(workload.batch_size, generator) for _ in range(5)]

# --8<-- [start:ddp]
hook = PlanHook.from_file(model, sys.argv[1])                     # after init_process_group
ddp = DistributedDataParallel(model, **hook.ddp_kwargs())           # the plan's groups as DDP's buckets
hook.register(ddp)                                                  # each bucket sent as its group says
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
for inputs, targets in loader:
    optimizer.zero_grad()
    loss = loss_fn(ddp(inputs), targets)
    loss.backward()
    optimizer.step()
# --8<-- [end:ddp]

print(f"rank {dist.get_rank()} loss {loss.item():.4f} checksum {sum(p.sum().item() for p in model.parameters()):.6f}", flush=True)
if dist.get_rank() == 0:
    torch.save(model.state_dict(), "model.pt")
# DDP and its hook sit in reference cycles that hold the process group: collect them before destroying it, or the
# interpreter frees the group as it exits, and gloo's threads then abort the process (2-3 exits in 24 under load).
del ddp, hook
gc.collect()
dist.destroy_process_group()
