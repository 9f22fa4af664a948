"""Run by tests/test_frameworks.py under torchrun (2 gloo ranks): the small LM's plan (PowerSGD, top-k, dense) in
Accelerate with SGD's momentum in the hook (`PlanHook(momentum=0.9, optimizer=...)`, the optimizer at momentum 0,
then prepared by Accelerate), its parameters saved to `momentum.pt`; then the optimizer given momentum after the
hook was made, which the hook refuses at the next step (printed as "rank R refused: ..."). Last, in the same
processes (one launch for both of the test's Accelerate cases), docs/snippets/train_accelerate.py itself, as its own
launch runs it, after "rank R: train_accelerate.py starts" on stderr: its lines and `model.pt`, and its
`end_training` ends the group.

    torchrun --nproc_per_node 2 tests/accelerate_momentum.py PLAN
"""

import runpy
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from my_workloads import small_lm

from planner.runtime import PlanHook
from planner.runtime.frameworks import accelerate_prepare

MOMENTUM = 0.9
SNIPPET = Path(__file__).resolve().parents[1] / "docs" / "snippets" / "train_accelerate.py"

accelerator = Accelerator(cpu=True)
workload = small_lm()
model, loss_fn = workload.module, workload.loss_fn
generator = torch.Generator().manual_seed(accelerator.process_index)  # each rank its own data
loader = [workload.make_batch(workload.batch_size, generator) for _ in range(5)]

optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
hook = PlanHook.from_file(model, sys.argv[1], momentum=MOMENTUM, optimizer=optimizer)
ddp = accelerate_prepare(accelerator, hook)
optimizer = accelerator.prepare(optimizer)
for inputs, targets in loader:
    optimizer.zero_grad()
    accelerator.backward(loss_fn(ddp(inputs), targets))
    optimizer.step()
rank = accelerator.process_index
print(f"rank {rank} checksum {sum(p.sum().item() for p in model.parameters()):.6f}", flush=True)
if accelerator.is_main_process:
    torch.save(model.state_dict(), "momentum.pt")
for group in optimizer.optimizer.param_groups:
    group["momentum"] = MOMENTUM  # momentum in the optimizer too: applied twice
try:
    optimizer.zero_grad()
    accelerator.backward(loss_fn(ddp(loader[0][0]), loader[0][1]))
    optimizer.step()
except ValueError as exc:
    print(f"rank {rank} refused: {exc}", flush=True)
# The group stays up for the snippet, whose Accelerator() takes this one's state and whose end_training ends it.
ddp = optimizer = hook = None
accelerator.free_memory()
print(f"rank {rank}: {SNIPPET.name} starts", file=sys.stderr, flush=True)
sys.argv = [str(SNIPPET), sys.argv[1]]  # the snippet's command line: `train_accelerate.py PLAN`
runpy.run_path(str(SNIPPET), run_name="__main__")
