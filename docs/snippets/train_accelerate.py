"""A plan inside Hugging Face Accelerate: `torchrun --nproc_per_node 2 train_accelerate.py plan.json` (or
`accelerate launch`)."""

import sys

import torch
from accelerate import Accelerator

from my_workloads import small_lm
from planner.runtime import PlanHook
from planner.runtime.frameworks import accelerate_prepare

accelerator = Accelerator(cpu=True)
workload = small_lm()
model, loss_fn = workload.module, workload.loss_fn
generator = torch.Generator().manual_seed(accelerator.process_index)  # each rank its own data
loader = [workload.make_batch(workload.batch_size, generator) for _ in range(5)]

# --8<-- [start:prepare]
hook = PlanHook.from_file(model, sys.argv[1])                     # after Accelerator(): the group is up
ddp = accelerate_prepare(accelerator, hook)                         # not accelerator.prepare(model)
optimizer = accelerator.prepare(torch.optim.SGD(ddp.parameters(), lr=0.1))
for inputs, targets in loader:
    optimizer.zero_grad()
    loss = loss_fn(ddp(inputs), targets)
    accelerator.backward(loss)
    optimizer.step()
# --8<-- [end:prepare]

print(f"rank {accelerator.process_index} loss {loss.item():.4f} "
      f"checksum {sum(p.sum().item() for p in model.parameters()):.6f}", flush=True)
if accelerator.is_main_process:
    torch.save(model.state_dict(), "model.pt")
# Let the DDP model go (the accelerator holds it too) before the process group: a group that outlives
# `end_training` in a live DDP is torn down at interpreter exit, where gloo's threads abort the process.
ddp = optimizer = hook = loss = None
accelerator.free_memory()
accelerator.end_training()
