"""A plan inside PyTorch Lightning: `torchrun --nproc_per_node 2 train_lightning.py plan.json`."""

import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

from my_workloads import small_lm
from planner.runtime.frameworks import lightning_strategy


class LitModel(L.LightningModule):
    def __init__(self, net: torch.nn.Module, loss_fn) -> None:
        super().__init__()
        self.net, self.loss_fn = net, loss_fn

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = self.loss_fn(self.net(inputs), targets)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


workload = small_lm()
net = workload.module
generator = torch.Generator().manual_seed(int(os.environ["RANK"]))  # each rank its own data
loader = DataLoader([workload.make_batch(workload.batch_size, generator) for _ in range(5)], batch_size=None)

# --8<-- [start:fit]
strategy = lightning_strategy(sys.argv[1], module=net)               # the plan made for `net`
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, use_distributed_sampler=False,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(LitModel(net, workload.loss_fn), loader)
# --8<-- [end:fit]

rank = trainer.global_rank
print(f"rank {rank} loss {trainer.callback_metrics['loss'].item():.4f} "
      f"checksum {sum(p.sum().item() for p in net.parameters()):.6f}", flush=True)
if rank == 0:
    torch.save(net.state_dict(), "model.pt")
